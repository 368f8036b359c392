"""How much one decode step's speed depends on the GEMV autotuner's picks.

    python tools/decode_spread.py [--draws 3] [--replays 300]

Builds the E2B-shaped synthetic engine on the GPU. Then, per draw, it forgets every GEMV tiling the
autotuner chose, captures the greedy decode step again (which re-tunes each GEMV shape on its own,
timed in isolation) and times graph replays of the whole step from position 0 (best of three runs,
see qat4.decode_tuning.step_time_us). It prints µs per step and the tiling picked per GEMV shape,
so the spread between draws shows how well isolated timings rank tilings for the chained step.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.decode_tuning import describe_tilings, step_time_us  # noqa: E402
from qat4.engine import GREEDY, Engine  # noqa: E402
from qat4.ops import w4_linear  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--replays", type=int, default=300)
    args = parser.parse_args()
    packed = load_packed_for_bench("synthetic:e2b", torch.device("cuda"), seed=0)
    engine = Engine.from_packed(packed, "cuda", max_ctx=8192, prefill_chunk=512)
    w4_linear.pin_matvec_tilings({})  # draw from the autotuner, not from tilings saved by `qat4 bench --tune`
    for draw in range(args.draws):
        w4_linear._matvec_tuned.cache.clear()
        us = step_time_us(engine.step, GREEDY, args.replays)
        print(f"draw {draw}: {us:7.1f} µs per step ({1e6 / us:.1f} tok/s); tilings", flush=True)
        print("\n".join("    " + line for line in describe_tilings(w4_linear.matvec_tilings())))


if __name__ == "__main__":
    main()
