"""Where the time of one decode step and one prefill chunk goes, kernel class by kernel class.

    python tools/profile_step.py [--depth 512] [--chunk 256] [--top 25]

Builds the E2B-shaped synthetic engine on the GPU, runs the greedy decode step eagerly under
torch.profiler (CUDA activity only) and prints, per kernel name: launches per step, total µs and
µs per launch; then the same for one prefill chunk. It also times the step as the engine runs it
(CUDA-graph replay), so the gap between that and the kernels' sum is the launch overhead.
"""

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.bench import fill  # noqa: E402
from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.decode_tuning import describe_tilings  # noqa: E402
from qat4.engine import GREEDY, Engine  # noqa: E402
from qat4.ops import w4_linear  # noqa: E402


def kernel_table(prof, steps: int, top: int) -> tuple[str, float, int]:
    """(table text, summed µs per step, launches per step) of the CUDA kernels in `prof`."""
    total, count = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name if len(event.name) < 60 else event.name[:57] + "..."
            total[name] += event.device_time_total
            count[name] += 1
    rows = sorted(total, key=total.get, reverse=True)
    lines = [f"{'kernel':60s} {'launches':>8s} {'µs':>9s} {'µs each':>8s}"]
    for name in rows[:top]:
        lines.append(f"{name:60s} {count[name] / steps:8.1f} {total[name] / steps:9.1f} {total[name] / count[name]:8.2f}")
    return "\n".join(lines), sum(total.values()) / steps, sum(count.values()) // steps


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    packed = load_packed_for_bench("synthetic:e2b", torch.device("cuda"), seed=0)
    engine = Engine.from_packed(packed, "cuda", max_ctx=8192, prefill_chunk=args.chunk)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.config.vocab_size, (max(args.depth, args.chunk),), generator=g).cuda()
    fill(engine, ids[: args.depth])
    step = engine.step
    step.pos.fill_(args.depth)
    step.prepare(GREEDY)

    step.use_graph = False
    for _ in range(3):
        step.run(GREEDY)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step.run(GREEDY)
        torch.cuda.synchronize()
    table, kernel_us, launches = kernel_table(prof, 5, args.top)
    step.use_graph = True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        step.run(GREEDY)
    end.record()
    torch.cuda.synchronize()
    graph_us = start.elapsed_time(end) * 10
    print(f"decode step at depth {args.depth}: {launches} kernels, {kernel_us:.0f} µs of kernel time, "
          f"{graph_us:.0f} µs per graph replay ({1e6 / graph_us:.0f} tok/s)")
    print(table)
    print("\nGEMV tilings, pinned or autotuned:")
    print("\n".join("  " + line for line in describe_tilings(w4_linear.matvec_tilings())))

    chunk = ids[: args.chunk]
    engine.model.prefill(chunk, 0, engine.cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.model.prefill(chunk, 0, engine.cache)
        torch.cuda.synchronize()
    table, kernel_us, launches = kernel_table(prof, 1, args.top)
    print(f"\nprefill chunk of {args.chunk} tokens: {launches} kernels, {kernel_us:.0f} µs of kernel time")
    print(table)


if __name__ == "__main__":
    main()
