"""Time to the first token of one prompt alone on the engine (no server), and the host's share.

For each prompt length: the median over five fresh prompts of the time from add_request to the
first token read back, then one prompt step on its own: how long the host takes to enqueue it and
how long until the device has run it (equal when the host is the bottleneck).

    python tools/first_token.py --lengths 16,80,512,2048
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
    args = parser.parse_args()
    engine = Engine.from_packed(synthetic_model(E2B, seed=0, device="cuda"), "cuda", max_ctx=8192, max_num_seqs=16)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return rng.choices(range(1000, 32000), k=n)

    def first_token(n: int) -> float:
        seq = engine.add_request(prompt(n), 2, temperature=0, stop_token_ids=[])
        start = time.perf_counter()
        while not seq.output:
            engine.step()
        seconds = time.perf_counter() - start
        engine.drain()
        return seconds

    for n in (int(x) for x in args.lengths.split(",")):
        first_token(n)  # compiles what this length needs
        median = statistics.median(first_token(n) for _ in range(5))
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
