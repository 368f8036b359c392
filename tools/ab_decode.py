"""Decode speed of this checkout against another qat4 source tree, in one process, alternating.

    python tools/ab_decode.py OTHER [--model synthetic:e2b] [--depth 0] [--new 256] [--rounds 5]
    # e.g. OTHER from: mkdir /tmp/main && git archive main qat4 | tar x -C /tmp/main

Two `qat4 bench` processes on the same GPU took 1,618-1,916 µs per step on the same code when no
saved tilings matched (each load takes the autotuner's picks), more than most changes to one kernel
are worth. Here both trees
build their engine on the same weights in one process, each pinning the tilings of
``$QAT4_TILINGS`` when it is set, and their greedy decode steps are timed in turns, `--rounds` times
`--new` steps each (graph replays on CUDA). OTHER is a folder holding a ``qat4`` package; it is
imported under the same name after this checkout's modules are set aside, and each engine keeps
running its own tree's code.
"""

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(root: str, model: str, device: torch.device, max_ctx: int):
    """(engine, time_decode) from the qat4 package under `root`, imported afresh."""
    for name in [m for m in sys.modules if m == "qat4" or m.startswith("qat4.")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        from qat4 import bench
        from qat4.commands.bench import load_packed_for_bench
        from qat4.engine import Engine
    finally:
        sys.path.remove(root)
    if not os.path.samefile(os.path.dirname(bench.__file__), os.path.join(root, "qat4")):
        raise SystemExit(f"{root}: its qat4 package was not the one imported ({bench.__file__})")
    packed = load_packed_for_bench(model, device, seed=0)
    engine = Engine.from_packed(packed, device, max_ctx=max_ctx)
    return engine, bench.time_decode


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", help="folder holding the other tree's qat4 package")
    parser.add_argument("--model", default="synthetic:e2b")
    parser.add_argument("--depth", type=int, default=0)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if not os.path.isdir(os.path.join(args.other, "qat4")):
        raise SystemExit(f"{args.other}: no qat4 package in this folder")
    device = torch.device(args.device)
    max_ctx = args.depth + args.new + 2
    trees = {"this": HERE, "other": args.other}
    runs = {label: build(root, args.model, device, max_ctx) for label, root in trees.items()}
    times = {label: [] for label in trees}
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        for label, (engine, time_decode) in runs.items():
            sec = time_decode(engine, args.depth, args.new, torch.Generator().manual_seed(r))
            if r:
                times[label].append(sec * 1e6)
    for label, us in times.items():
        print(f"{label:>5} ({trees[label]}): µs per step {' '.join(f'{t:7.1f}' for t in us)}; "
              f"median {statistics.median(us):7.1f} ({1e6 / statistics.median(us):.1f} tok/s)")
    ratio = statistics.median(times["other"]) / statistics.median(times["this"])
    print(f"this checkout decodes {ratio:.3f}x as fast as the other (median over {args.rounds} rounds)")


if __name__ == "__main__":
    main()
