"""`qat4 bench serve`'s load on the engine alone (no server): what the HTTP path costs beside it.

C clients, each with one request in flight at a time: a prompt of --input-len random token ids for
exactly --output-len new tokens (greedy, stop tokens off), the next one added as soon as the last
ends, until --requests have run. Prints the aggregate output tok/s, twice (the first pass also
compiles and captures what it meets), and the engine's steps by kind: decode only, or with prompt
tokens read. A step's time is that of `Engine.step`, which launches it and reads the one before,
so it is the device's time per step whenever the host keeps ahead.

    python tools/engine_load.py --concurrency 16,64
    python tools/engine_load.py --preset tiny --device cpu --concurrency 4 --input-len 32 --output-len 8
"""

from __future__ import annotations

import argparse
import random
import time

from qat4.checkpoint.synth import synthetic_model
from qat4.config import PRESETS
from qat4.engine import Engine


def run_level(engine: Engine, clients: int, requests: int, input_len: int, output_len: int,
              rng: random.Random) -> str:
    """One closed-loop run of ``requests`` requests at ``clients`` at a time -> its report line."""
    sent = done = tokens = 0
    live: set[int] = set()
    steps = {"decode": [0.0, 0], "prompt": [0.0, 0]}  # seconds, count
    start = time.perf_counter()
    while done < requests:
        while len(live) < clients and sent < requests:
            ids = [engine.config.bos_token_id] + rng.choices(range(3, engine.config.vocab_size), k=input_len - 1)
            live.add(engine.add_request(ids, output_len, temperature=0, stop_token_ids=[]).id)
            sent += 1
        scheduler = engine.scheduler
        kind = "prompt" if scheduler.waiting or any(s.num_computed < len(s.prompt) for s in scheduler.running) else "decode"
        step_start = time.perf_counter()
        outputs = engine.step()
        steps[kind][0] += time.perf_counter() - step_start
        steps[kind][1] += 1
        for out in outputs:
            tokens += 1
            if out.finished:
                live.discard(out.seq.id)
                done += 1
    seconds = time.perf_counter() - start
    kinds = ", ".join(f"{n} {kind} steps at {1e3 * s / n:.2f} ms" for kind, (s, n) in steps.items() if n)
    return f"{clients} clients, {requests} requests: {tokens / seconds:,.0f} output tok/s over {seconds:.2f} s; {kinds}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="16,64", help="clients, comma-separated (default: 16,64)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request (default: 128)")
    parser.add_argument("--requests", type=int, default=0, metavar="N",
                        help="requests per level (default: 4 per client)")
    parser.add_argument("--preset", default="e2b", choices=sorted(PRESETS), help="synthetic weights (default: e2b)")
    parser.add_argument("--device", default="cuda", help="default: cuda")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    packed = synthetic_model(PRESETS[args.preset], seed=0, device=args.device)
    engine = Engine.from_packed(packed, args.device, max_num_seqs=max(levels))
    rng = random.Random(0)
    for clients in levels:
        for _ in range(2):
            print(run_level(engine, clients, args.requests or 4 * clients, args.input_len, args.output_len, rng),
                  flush=True)


if __name__ == "__main__":
    main()
