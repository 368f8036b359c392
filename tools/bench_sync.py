"""What one synchronisation point costs on this GPU: a kernel boundary in a CUDA graph (with and
without programmatic dependent launch) against a grid-wide barrier inside one resident kernel.

    python tools/bench_sync.py [--kernels 500] [--barriers 2000] [--stages 1,2,4,8] [--rows 16] [--check]

A decode step is a chain of some 330 dependent kernels; a persistent kernel per layer would
replace most boundaries with grid barriers. Both are timed here with the least work around them:

- chain: a CUDA graph of `--kernels` one-program kernels, each waiting for its predecessor and
  passing one value on (x[i + 1] = x[i] + 1), so every boundary is a dependency;
- barrier: one kernel, one program per SM, crossing `--barriers` grid barriers (each program adds
  one to a counter, then polls it with acquire loads until every program has arrived), each phase
  handing a value from one program to the next through global memory;
- stages: S dependent int4 GEMV stages x[s + 1] = W[s] @ x[s] (K x K, each stage's weights its
  own), run as S kernels chained with PDL; as one kernel with a program per stage and row block,
  whose programs for stage s wait on a counter that stage s - 1's programs count themselves into,
  with their weights loaded before the wait or after it; or as one persistent kernel, K / ROWS
  programs that each serve their rows of every stage in turn, loading the next stage's weights
  before waiting on the counter, which they poll with plain loads (one acquire read once it is
  reached) or with atomic reads. The slope over S is what one dependent GEMV stage costs in each
  design.

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


@triton.jit
def _wait_for_count(count_ptr, target, LOAD_POLL: tl.constexpr):
    """Spin until the int32 at count_ptr reaches target (gives up after 2^24 polls, so that a broken
    chain fails its check instead of hanging), then acquire it: the writes released before the
    count reached target are visible to every thread of the program afterwards. LOAD_POLL polls
    with volatile loads and acquires once at the end; else every poll is an acquiring atomic read."""
    if LOAD_POLL:
        seen = tl.load(count_ptr, volatile=True)
    else:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < 16777216):
        if LOAD_POLL:
            seen = tl.load(count_ptr, volatile=True)
        else:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if LOAD_POLL:
        tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stage_rows(x_ptr, words, steps, stage, rows, j, K: tl.constexpr, K_POW2: tl.constexpr, ROWS: tl.constexpr):
    """x[stage + 1][rows] = W[stage][rows] @ x[stage] from the program's words [ROWS, K_POW2 / 8]
    and steps [ROWS, K_POW2 / 32] (zero past column K); x read past L1, as other programs wrote it."""
    acc = tl.zeros([ROWS, K_POW2 // 8], dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(x_ptr + stage * K + 8 * j + i, mask=j < K // 8, other=0.0, cache_modifier=".cg")
        acc += (((words >> (4 * i)) & 15).to(tl.float32) - 8.0) * xi[None, :]
    y = tl.sum(tl.sum(tl.reshape(acc, [ROWS, K_POW2 // 32, 4]), axis=2) * steps, axis=1)
    tl.store(x_ptr + (stage + 1) * K + rows, y)


@triton.jit
def _load_stage_weights(w_ptr, s_ptr, stage, rows, j, g, K: tl.constexpr):
    """Words [ROWS, K_POW2 / 8] and steps [ROWS, K_POW2 / 32] of W[stage]'s rows (zero past column K)."""
    w_ptrs = w_ptr + stage * K * (K // 8) + rows[:, None] * (K // 8) + j[None, :]
    s_ptrs = s_ptr + stage * K * (K // 32) + rows[:, None] * (K // 32) + g[None, :]
    words = tl.load(w_ptrs, mask=j[None, :] < K // 8, other=0)
    steps = tl.load(s_ptrs, mask=g[None, :] < K // 32, other=0.0)
    return words, steps


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
    if PRELOAD:
        words, steps = _load_stage_weights(w_ptr, s_ptr, stage, rows, j, g, K)
    wait_for_previous_kernel(USE_PDL)
    if q >= P:
        _wait_for_count(counter_ptr + stage - 1, P * epoch, False)
    if not PRELOAD:
        words, steps = _load_stage_weights(w_ptr, s_ptr, stage, rows, j, g, K)
    _stage_rows(x_ptr, words, steps, stage, rows, j, K, K_POW2, ROWS)
    tl.debug_barrier()
    tl.atomic_add(counter_ptr + stage, 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["n_stages", "epoch"])
def _persistent_stage_kernel(x_ptr, w_ptr, s_ptr, counter_ptr, n_stages, epoch, K: tl.constexpr,
                             K_POW2: tl.constexpr, ROWS: tl.constexpr, LOAD_POLL: tl.constexpr):
    """The chain of :func:`_stage_kernel` (same x, W, steps and counters) with P = K / ROWS programs,
    all resident: program p computes rows p * ROWS onwards of stages 0 .. n_stages - 1 in turn.
    Before waiting for stage s's input (counter[s - 1] reaching P * epoch) it already holds stage
    s's weights: it loads them while the stage before is still being computed. Grid: (P,)."""
    p = tl.program_id(0)
    P: tl.constexpr = K // ROWS
    rows = p * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, K_POW2 // 8)
    g = tl.arange(0, K_POW2 // 32)
    words, steps = _load_stage_weights(w_ptr, s_ptr, 0, rows, j, g, K)
    for stage in range(n_stages):
        if stage > 0:
            _wait_for_count(counter_ptr + stage - 1, P * epoch, LOAD_POLL)
        _stage_rows(x_ptr, words, steps, stage, rows, j, K, K_POW2, ROWS)
        if stage + 1 < n_stages:  # in flight while this stage is signalled and the next awaited
            words, steps = _load_stage_weights(w_ptr, s_ptr, stage + 1, rows, j, g, K)
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
    steps keeping x at unit scale; `rows` rows of a stage per program."""

    def __init__(self, k: int, stages: int, sets: int, device: str, rows: int = 16):
        g = torch.Generator(device).manual_seed(0)
        levels = torch.randint(-8, 8, (sets * stages * k, k), generator=g, device=device)
        self.words = pack_levels(levels).reshape(sets, stages, k, k // 8)
        self.steps = torch.full((sets, stages, k, k // 32), (21.5 * k) ** -0.5, device=device)
        self.x = torch.zeros(stages + 1, k, device=device)
        self.x[0] = torch.randn(k, generator=g, device=device)
        self.counters = torch.zeros(stages, dtype=torch.int32, device=device)
        self.k, self.sets, self.rows = k, sets, rows

    def one_kernel(self, stages: int, preload: bool, epoch: int) -> None:
        """The first `stages` stages of copy (epoch - 1) % sets in one launch, handed on through
        the counters; `epoch` counts the launches since the counters were zeroed (from 1)."""
        self._launch((epoch - 1) % self.sets, 0, stages, epoch, preload)

    def persistent(self, stages: int, load_poll: bool, epoch: int) -> None:
        """As :meth:`one_kernel`, by :func:`_persistent_stage_kernel` (K / ROWS programs in all)."""
        _persistent_stage_kernel[(self.k // self.rows,)](
            self.x, self.words[(epoch - 1) % self.sets], self.steps[(epoch - 1) % self.sets], self.counters,
            stages, epoch, K=self.k, K_POW2=triton.next_power_of_2(self.k), ROWS=self.rows, LOAD_POLL=load_poll,
            num_warps=4)

    def kernel_per_stage(self, stages: int, r: int) -> None:
        """The first `stages` stages of copy r as one launch each, chained by PDL where the device has it."""
        for stage in range(stages):
            self._launch(r, stage, 1, 1, True)

    def _launch(self, r: int, first_stage: int, stages: int, epoch: int, preload: bool) -> None:
        """One :func:`_stage_kernel` launch over `stages` stages of copy r from `first_stage` on."""
        _stage_kernel[(stages * (self.k // self.rows),)](
            self.x, self.words[r], self.steps[r], self.counters, first_stage, epoch, K=self.k,
            K_POW2=triton.next_power_of_2(self.k), ROWS=self.rows, PRELOAD=preload, num_warps=4,
            **pdl_launch(self.x, 1))

    def matches_reference(self, stages: int, r: int) -> bool:
        """Whether x[: stages + 1] is the chain of copy r's first `stages` matrices."""
        ref = stage_chain_reference(self.x[0].cpu(), self.words[r, :stages].cpu(), self.steps[r, :stages].cpu())
        return torch.allclose(self.x[: stages + 1].cpu(), ref, rtol=1e-3, atol=1e-3)


STAGE_DESIGNS = ("kernel per stage, PDL", "one kernel, preloaded", "one kernel, loaded after wait",
                 "persistent, load polls", "persistent, atomic polls")


def _stage_launchers(chain: StageChain, stages: int) -> list:
    """One launcher per entry of STAGE_DESIGNS: r -> launch r (from 0) of `stages` stages since the
    counters were zeroed."""
    return [
        lambda r: chain.kernel_per_stage(stages, r),
        lambda r: chain.one_kernel(stages, True, r + 1),
        lambda r: chain.one_kernel(stages, False, r + 1),
        lambda r: chain.persistent(stages, True, r + 1),
        lambda r: chain.persistent(stages, False, r + 1),
    ]


def stages_us(stage_counts: list[int], rows: int, k: int = 1536, sets: int = 12) -> list[tuple[int, ...]]:
    """Per S: µs per launch of S stages in each of STAGE_DESIGNS (`rows` rows of a stage per
    program), each timed as a CUDA graph of launches over `sets` weight copies."""
    chain = StageChain(k, max(stage_counts), sets, "cuda", rows)
    rows = []
    for stages in stage_counts:
        variants = _stage_launchers(chain, stages)
        times = []
        for design, launch in zip(STAGE_DESIGNS, variants):
            chain.counters.zero_()
            launch(0)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain.counters.zero_()
                for r in range(sets):
                    launch(r)
            times.append(time_ms(graph.replay) * 1000 / sets)
            assert chain.matches_reference(stages, sets - 1), f"{design}, {stages} stages: the chain went wrong"
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
    if device == "cuda":  # the interpreter runs one program at a time: a persistent one would wait forever
        chain.counters.zero_()
        for epoch, load_poll in ((1, True), (2, False)):
            chain.persistent(3, load_poll, epoch)
            assert chain.matches_reference(3, epoch - 1), f"persistent, load_poll={load_poll}: wrong chain"
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
    parser.add_argument("--rows", type=int, default=16, help="rows of a GEMV stage per program (divides 1536)")
    parser.add_argument("--check", action="store_true", help="only check the stage kernel against its reference")
    args = parser.parse_args()
    if args.check:
        check_stages()
        return
    print(f"{torch.cuda.get_device_name(0)}")
    print(f"kernel boundary in a CUDA graph, no PDL: {chain_us(args.kernels, False):6.2f} µs")
    print(f"kernel boundary in a CUDA graph, PDL:    {chain_us(args.kernels, True):6.2f} µs")
    print(f"grid barrier, one program per SM:        {barrier_us(args.barriers):6.2f} µs")
    print(f"\nS dependent 1536 x 1536 int4 GEMV stages, {args.rows} rows per program, µs per launch of S stages:")
    print(f"{'S':>3} " + " ".join(f"{design:>30}" for design in STAGE_DESIGNS))
    for stages, *times in stages_us([int(v) for v in args.stages.split(",")], args.rows):
        print(f"{stages:>3} " + " ".join(f"{t:>30.2f}" for t in times))


if __name__ == "__main__":
    main()
