"""What one synchronisation point costs on this GPU: a kernel boundary in a CUDA graph (with and
without programmatic dependent launch) against a grid-wide barrier inside one resident kernel.

    python tools/bench_sync.py [--kernels 500] [--barriers 2000] [--stages 1,2,4,8] [--check]

A decode step is a chain of some 330 dependent kernels; a persistent kernel per layer would
replace most boundaries with grid barriers. Both are timed here with the least work around them:

- chain: a CUDA graph of `--kernels` one-program kernels, each waiting for its predecessor and
  passing one value on (x[i + 1] = x[i] + 1), so every boundary is a dependency;
- barrier: one kernel, one program per SM, crossing `--barriers` grid barriers (each program adds
  one to a counter, then polls it with acquire loads until every program has arrived), each phase
  handing a value from one program to the next through global memory;
- stages: S dependent int4 GEMV stages x[s + 1] = W[s] @ x[s] (K x K, each stage's weights its
  own), run as S kernels chained with PDL, or as one kernel whose programs for stage s wait on a
  counter that stage s - 1's programs count themselves into, with their weights loaded before the
  wait or after it. The slope over S is what one dependent GEMV stage costs in each design.

`--check` runs the stage kernel on small shapes against its torch reference and exits (it runs
under TRITON_INTERPRET=1 on a CPU).
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.checkpoint.packing import dequantize, pack_levels  # noqa: E402
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


@triton.jit(do_not_specialize=["first_stage", "epoch"])
def _stage_kernel(x_ptr, w_ptr, s_ptr, counter_ptr, first_stage, epoch, K: tl.constexpr, K_POW2: tl.constexpr,
                  ROWS: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Stages of the chain x[s + 1] = W[s] @ x[s]: x fp32 [stages + 1, K], W[s] [K, K] as int32
    words [stages, K, K / 8] (column 8j + i in bits 4i..4i+3 of word j as level + 8) and fp32 steps
    [stages, K, K / 32]. Grid: (S * P,), P = K / ROWS programs per stage; program q serves stage
    first_stage + q // P, rows (q % P) * ROWS onwards, then counts itself into counter[stage].
    Programs of a stage after the launch's first wait until counter[stage - 1] reaches P * epoch
    (counters only grow; epoch numbers the launches that share them). PRELOAD loads the weights
    before that wait (and before the PDL wait), else after it. K_POW2: K rounded up to a power of two
    (the columns past K are masked)."""
    q = tl.program_id(0)
    P: tl.constexpr = K // ROWS
    stage = first_stage + q // P
    rows = (q % P) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, K_POW2 // 8)
    g = tl.arange(0, K_POW2 // 32)
    w_ptrs = w_ptr + stage * K * (K // 8) + rows[:, None] * (K // 8) + j[None, :]
    s_ptrs = s_ptr + stage * K * (K // 32) + rows[:, None] * (K // 32) + g[None, :]
    w_mask, s_mask = j[None, :] < K // 8, g[None, :] < K // 32
    if PRELOAD:
        words, steps = tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0.0)
    wait_for_previous_kernel(USE_PDL)
    if q >= P:  # gives up after 2^24 polls (then the chain fails its check instead of hanging)
        seen = tl.atomic_add(counter_ptr + stage - 1, 0, sem="acquire", scope="gpu")
        polls = 0
        while (seen < P * epoch) & (polls < 16777216):
            seen = tl.atomic_add(counter_ptr + stage - 1, 0, sem="acquire", scope="gpu")
            polls += 1
        tl.debug_barrier()
    if not PRELOAD:
        words, steps = tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0.0)
    acc = tl.zeros([ROWS, K_POW2 // 8], dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x_ptr + stage * K + 8 * j + i, mask=j < K // 8, other=0.0, cache_modifier=".cg")
        acc += (((words >> (4 * i)) & 15).to(tl.float32) - 8.0) * xi[None, :]
    y = tl.sum(tl.sum(tl.reshape(acc, [ROWS, K_POW2 // 32, 4]), axis=2) * steps, axis=1)
    tl.store(x_ptr + (stage + 1) * K + rows, y)
    tl.debug_barrier()
    tl.atomic_add(counter_ptr + stage, 1, sem="release", scope="gpu")


def stage_chain_reference(x0: torch.Tensor, words: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """x [stages + 1, K] of :func:`_stage_kernel`'s chain, in fp32 torch."""
    xs = [x0.float()]
    for w, s in zip(words, steps):
        xs.append(dequantize(w, s) @ xs[-1])
    return torch.stack(xs)


class StageChain:
    """Weights and buffers for :func:`_stage_kernel`: `sets` copies of `stages` K x K int4 matrices
    (consecutive launches read different copies, so that the weights come from HBM), levels random,
    steps keeping x at unit scale."""

    ROWS = 16

    def __init__(self, k: int, stages: int, sets: int, device: str):
        g = torch.Generator(device).manual_seed(0)
        levels = torch.randint(-8, 8, (sets * stages * k, k), generator=g, device=device)
        self.words = pack_levels(levels).reshape(sets, stages, k, k // 8)
        self.steps = torch.full((sets, stages, k, k // 32), (21.5 * k) ** -0.5, device=device)
        self.x = torch.zeros(stages + 1, k, device=device)
        self.x[0] = torch.randn(k, generator=g, device=device)
        self.counters = torch.zeros(stages, dtype=torch.int32, device=device)
        self.k, self.sets = k, sets

    def one_kernel(self, stages: int, preload: bool, epoch: int) -> None:
        """The first `stages` stages of copy (epoch - 1) % sets in one launch, handed on through
        the counters; `epoch` counts the launches since the counters were zeroed (from 1)."""
        self._launch((epoch - 1) % self.sets, 0, stages, epoch, preload)

    def kernel_per_stage(self, stages: int, r: int) -> None:
        """The first `stages` stages of copy r as one launch each, chained by PDL where the device has it."""
        for stage in range(stages):
            self._launch(r, stage, 1, 1, True)

    def _launch(self, r: int, first_stage: int, stages: int, epoch: int, preload: bool) -> None:
        """One :func:`_stage_kernel` launch over `stages` stages of copy r from `first_stage` on."""
        _stage_kernel[(stages * (self.k // self.ROWS),)](
            self.x, self.words[r], self.steps[r], self.counters, first_stage, epoch, K=self.k,
            K_POW2=triton.next_power_of_2(self.k), ROWS=self.ROWS, PRELOAD=preload, num_warps=4,
            **pdl_launch(self.x, 1))

    def matches_reference(self, stages: int, r: int) -> bool:
        """Whether x[: stages + 1] is the chain of copy r's first `stages` matrices."""
        ref = stage_chain_reference(self.x[0].cpu(), self.words[r, :stages].cpu(), self.steps[r, :stages].cpu())
        return torch.allclose(self.x[: stages + 1].cpu(), ref, rtol=1e-3, atol=1e-3)


def stages_us(stage_counts: list[int], k: int = 1536, sets: int = 12) -> list[tuple[int, float, float, float]]:
    """Per S: µs per launch of S stages as S PDL-chained kernels, as one kernel with the weights
    loaded before the counter wait, and after it; each a CUDA graph over `sets` weight copies."""
    chain = StageChain(k, max(stage_counts), sets, "cuda")
    rows = []
    for stages in stage_counts:
        variants = [lambda r: chain.kernel_per_stage(stages, r)]
        variants += [lambda r, preload=preload: chain.one_kernel(stages, preload, r + 1) for preload in (True, False)]
        times = []
        for launch in variants:
            chain.counters.zero_()
            launch(0)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain.counters.zero_()
                for r in range(sets):
                    launch(r)
            times.append(time_ms(graph.replay) * 1000 / sets)
            assert chain.matches_reference(stages, sets - 1), f"{stages} stages: the chain went wrong"
        rows.append((stages, *times))
    return rows


def check_stages() -> None:
    """The stage kernel against its reference on small shapes, both hand-offs (CPU interpreter or GPU);
    K = 96 is not a power of two, as E2B's 1536 is not."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chain = StageChain(96, 3, 2, device)
    for epoch, preload in ((1, True), (2, False)):
        chain.one_kernel(3, preload, epoch)
        assert chain.matches_reference(3, epoch - 1), f"one kernel, preload={preload}: wrong chain"
    chain.kernel_per_stage(2, 1)
    assert chain.matches_reference(2, 1), "kernel per stage: wrong chain"
    print("stage kernel matches its reference")


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
    parser.add_argument("--stages", default="1,2,4,8", help="stage counts of the GEMV hand-off comparison")
    parser.add_argument("--check", action="store_true", help="only check the stage kernel against its reference")
    args = parser.parse_args()
    if args.check:
        check_stages()
        return
    print(f"{torch.cuda.get_device_name(0)}")
    print(f"kernel boundary in a CUDA graph, no PDL: {chain_us(args.kernels, False):6.2f} µs")
    print(f"kernel boundary in a CUDA graph, PDL:    {chain_us(args.kernels, True):6.2f} µs")
    print(f"grid barrier, one program per SM:        {barrier_us(args.barriers):6.2f} µs")
    print("\nS dependent 1536 x 1536 int4 GEMV stages, µs per launch of S stages:")
    print(f"{'S':>3} {'kernel per stage, PDL':>22} {'one kernel, preloaded':>22} {'one kernel, loaded after wait':>30}")
    for stages, per_kernel, preloaded, after in stages_us([int(v) for v in args.stages.split(",")]):
        print(f"{stages:>3} {per_kernel:>22.2f} {preloaded:>22.2f} {after:>30.2f}")


if __name__ == "__main__":
    main()
