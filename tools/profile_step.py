"""Where the time of one decode step and one prompt chunk goes, kernel class by kernel class.

    python tools/profile_step.py [--depth 512] [--batch 1] [--chunk 256] [--prompts 1] [--top 25]

Builds the E2B-shaped synthetic engine on the GPU with --batch sequences holding --depth tokens
each, runs their greedy decode step eagerly under torch.profiler (CUDA activity only) and prints,
per kernel name: launches per step, total µs and µs per launch; then the same for one step that
reads --prompts prompts sharing a chunk of --chunk tokens (8 x 512 is a served wave's step at 64
clients). It also times both steps as the engine runs them (CUDA-graph replays through the step
loop), so the gap between that and the kernels' sum is the launch overhead.
"""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.engine import Engine  # noqa: E402
from qat4.engine.tuning import describe_tilings  # noqa: E402


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
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=1, help="sequences that share the prompt chunk, read in one step")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    packed = load_packed_for_bench("synthetic:e2b", torch.device("cuda"), seed=0)
    # the steps below (3 warm, 5 profiled, 1 replayed, 100 timed) and some to spare: the pool holds every
    # sequence to its last token, so none waits or is preempted while they run
    new_tokens = 3 + 5 + 1 + 100 + 32
    engine = Engine.from_packed(packed, "cuda", max_ctx=max(8192, 2 * args.depth), prefill_chunk=args.chunk,
                                max_num_seqs=max(args.batch, args.prompts, 1),
                                kv_tokens=max(args.chunk, args.batch * (args.depth + 1 + new_tokens)))
    g = torch.Generator().manual_seed(0)
    seqs = [engine.add_request(torch.randint(3, engine.config.vocab_size, (args.depth + 1,), generator=g).tolist(),
                               new_tokens, temperature=0, stop_token_ids=[])
            for _ in range(args.batch)]
    while any(not s.output for s in seqs):  # every prompt read: each step from now on is one decode row per sequence
        engine.step()

    runner = engine.runner
    runner.use_graph = False
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    table, kernel_us, launches = kernel_table(prof, 5, args.top)
    runner.use_graph = True
    engine.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    step_us = start.elapsed_time(end) * 10
    print(f"decode step of {args.batch} sequences at depth {args.depth}: {launches} kernels, {kernel_us:.0f} µs of "
          f"kernel time, {step_us:.0f} µs per step in the engine's loop ({args.batch * 1e6 / step_us:,.0f} tok/s)")
    print(table)
    print("\nGEMV tilings, pinned or autotuned:")
    print("\n".join("  " + line for line in describe_tilings(engine.model.tilings.launched())))
    for s in seqs:
        engine.abort(s)
    engine.drain()

    lengths = [args.chunk // args.prompts + (i < args.chunk % args.prompts) for i in range(args.prompts)]

    def read_prompts() -> float:
        """Launch one step that reads a prompt of each length (and picks each one's first token);
        seconds from the launch to its end on the GPU."""
        for n in lengths:
            engine.add_request(torch.randint(3, engine.config.vocab_size, (n,), generator=g).tolist(), 1,
                               temperature=0, stop_token_ids=[])
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        engine.drain()
        return took

    for use_graph in (False, True):
        runner.use_graph = use_graph
        read_prompts()
    runner.use_graph = False
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        read_prompts()
    table, kernel_us, launches = kernel_table(prof, 1, args.top)
    timed = {use_graph: [] for use_graph in (False, True)}
    for _ in range(5):
        for use_graph in timed:
            runner.use_graph = use_graph
            timed[use_graph].append(read_prompts() * 1e3)
    eager, graphs = (statistics.median(timed[use_graph]) for use_graph in (False, True))
    print(f"\nprompt step of {args.prompts} x {lengths[0]} tokens: {launches} kernels, {kernel_us:.0f} µs of kernel time; "
          f"launch to end {eager:.2f} ms eager, {graphs:.2f} ms in the engine's loop (median of 5)")
    print(table)


if __name__ == "__main__":
    main()
