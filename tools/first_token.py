"""Time to the first token of one prompt alone on the engine (no server), and the host's share.

For each prompt length: the median over five fresh prompts of the time from add_request to the
first token read back, then one prompt step on its own: how long the host takes to enqueue it and
how long until the device has run it (equal when the host is the bottleneck). With ``--history H``
each prompt instead follows a history of H tokens that the prompt cache holds (the history is
read once, then the timed requests are the history plus N new tokens each), which is what a chat's
next turn costs the engine; the line compares it with the same N tokens read alone.

    python tools/first_token.py --lengths 16,80,512,2048
    python tools/first_token.py --lengths 80,160 --history 8000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="16,80,512,2048", help="prompt lengths in tokens")
    parser.add_argument("--history", type=int, default=0, metavar="H",
                        help="tokens of a cached history before each prompt (default: none)")
    args = parser.parse_args()
    engine = Engine.from_packed(synthetic_model(E2B, seed=0, device="cuda"), "cuda",
                                max_ctx=max(8192, 2 * args.history + 4096), max_num_seqs=16)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return rng.choices(range(1000, 32000), k=n)

    def first_token(ids: list[int]) -> tuple[float, int]:
        """Seconds from add_request to the first token, and the prompt tokens the cache held."""
        seq = engine.add_request(ids, 2, temperature=0, stop_token_ids=[])
        start = time.perf_counter()
        while not seq.output:
            engine.step()
        seconds = time.perf_counter() - start
        engine.drain()
        return seconds, seq.cached_tokens

    history = prompt(args.history)
    if history:
        first_token(history)  # reads the history once: the prompt cache keeps it
    for n in (int(x) for x in args.lengths.split(",")):
        first_token(history + prompt(n))  # compiles what this length needs
        runs = [first_token(history + prompt(n)) for _ in range(5)]
        median = statistics.median(seconds for seconds, _ in runs)
        if history:
            alone = statistics.median(first_token(prompt(n))[0] for _ in range(5))
            cached = min(cached for _, cached in runs)
            print(f"{n:>6} tokens after a {args.history}-token history ({cached} from the prompt cache): first "
                  f"token after {median * 1e3:.1f} ms; the same tokens alone {alone * 1e3:.1f} ms "
                  f"({median / alone:.2f}x)")
            continue
        engine.add_request(prompt(n), 2, temperature=0, stop_token_ids=[])
        batch = engine.scheduler.schedule()
        torch.cuda.synchronize()
        start = time.perf_counter()
        launched = engine._launch(batch)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        done = time.perf_counter() - start
        engine._in_flight = launched
        engine.drain()
        print(f"{n:>6}-token prompt: first token after {median * 1e3:.1f} ms; its prompt step enqueued in "
              f"{host * 1e3:.1f} ms, run by {done * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
