"""What one synchronisation point costs on this GPU: a kernel boundary in a CUDA graph (with and
without programmatic dependent launch) against a grid-wide barrier inside one resident kernel.

    python tools/bench_sync.py [--kernels 500] [--barriers 2000]

A decode step is a chain of some 330 dependent kernels; a persistent kernel per layer would
replace most boundaries with grid barriers. Both are timed here with the least work around them:

- chain: a CUDA graph of `--kernels` one-program kernels, each waiting for its predecessor and
  passing one value on (x[i + 1] = x[i] + 1), so every boundary is a dependency;
- barrier: one kernel, one program per SM, crossing `--barriers` grid barriers (each program adds
  one to a counter, then polls it with acquire loads until every program has arrived), each phase
  handing a value from one program to the next through global memory.
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel  # noqa: E402


@triton.jit(do_not_specialize=["i"])
def _pass_on_kernel(x_ptr, i, USE_PDL: tl.constexpr):
    """x[i + 1] = x[i] + 1 (x fp32). Grid: (1,)."""
    wait_for_previous_kernel(USE_PDL)
    tl.store(x_ptr + i + 1, tl.load(x_ptr + i) + 1.0)


@triton.jit
def _barrier_kernel(counter_ptr, ring_ptr, n_barriers):
    """n_barriers phases; in phase b program p writes b to ring[p], crosses a grid barrier, then
    reads ring[(p + 1) % P] and checks it (a mismatch is counted in counter_ptr[1]). The barrier
    counter (counter_ptr[0], zero at launch) only grows: barrier b completes at (b + 1) * P.
    Grid: (P,), every program resident at once."""
    p = tl.program_id(0)
    n = tl.num_programs(0)
    for b in range(n_barriers):
        tl.store(ring_ptr + p, b)
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < (b + 1) * n:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        got = tl.load(ring_ptr + (p + 1) % n, volatile=True)
        tl.atomic_add(counter_ptr + 1, (got < b).to(tl.int32))
        # no program may write phase b + 1 before every program has read phase b
        tl.atomic_add(counter_ptr + 2, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(counter_ptr + 2, 0, sem="acquire", scope="gpu")
        while seen < (b + 1) * n:
            seen = tl.atomic_add(counter_ptr + 2, 0, sem="acquire", scope="gpu")


def time_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def chain_us(kernels: int, pdl: bool) -> float:
    x = torch.zeros(kernels + 1, device="cuda")
    flags = pdl_launch(x, 1) if pdl else {"USE_PDL": False}
    _pass_on_kernel[(1,)](x, 0, **flags)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(kernels):
            _pass_on_kernel[(1,)](x, i, **flags)
    ms = time_ms(graph.replay)
    assert x[-1].item() == kernels, "the chain lost a dependency"
    return ms * 1000 / kernels


def barrier_us(barriers: int) -> float:
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(3, dtype=torch.int32, device="cuda")
    ring = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def run():
        counters.zero_()
        _barrier_kernel[(programs,)](counters, ring, barriers, num_warps=4)

    ms = time_ms(run)
    assert counters[1].item() == 0, "a program read a phase before it was written"
    return ms * 1000 / barriers / 2  # two barriers per phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=500)
    parser.add_argument("--barriers", type=int, default=2000)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}")
    print(f"kernel boundary in a CUDA graph, no PDL: {chain_us(args.kernels, False):6.2f} µs")
    print(f"kernel boundary in a CUDA graph, PDL:    {chain_us(args.kernels, True):6.2f} µs")
    print(f"grid barrier, one program per SM:        {barrier_us(args.barriers):6.2f} µs")


if __name__ == "__main__":
    main()
