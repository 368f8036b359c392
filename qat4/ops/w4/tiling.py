"""The decode GEMV's tilings: the space its autotuner searches, the autotuners' timer, and a
model's record of the tilings launched and pinned (:class:`MatvecTilings`).

A GEMV tiling sets RR, TR, BLOCK_G and SPLIT_K of :func:`~qat4.ops.w4.gemv._matvec_kernel`
(:data:`TILING_KEYS`; num_warps = TR * BLOCK_G / 32). They are autotuned per (N, K, BLOCK_M,
epilogue) over a small space: per tiling, the smallest split that launches 8 warps per SM
(:func:`prune_matvec`). The engine lists the shapes of a decode step
(:meth:`MatvecTilings.launched` of its model's tilings), times candidate tilings of the whole step
(:func:`matvec_tiling_candidates`) and pins the best (:meth:`MatvecTilings.pin`);
:mod:`qat4.engine.tuning` keeps them per GPU. :func:`bench` is the timer of the GEMV's and the
prefill GEMM's autotuners.
"""

import torch

from qat4.ops._triton import triton
from qat4.ops.w4.common import interpreting, sm_count

MAX_SLOTS = 1 << 12  # split-K ticket counters per device (row blocks x row-of-x blocks)
MAX_PARTIALS = 1 << 20  # split-K fp32 partial sums per device (4 MiB)


# ----------------------------------------------------------------------------------------------
# The tiling space


# (RR, TR, BLOCK_G) per BLOCK_M; num_warps = TR * BLOCK_G / 32. A thread holds RR * BLOCK_M sums.
# One-warp tiles suit long rows split many ways; the wider ones cover a small matrix in fewer steps.
_ONE_ROW_TILES = [(8, 2, 16), (8, 1, 32), (4, 4, 8), (4, 4, 16), (2, 8, 16), (2, 4, 32)]
_MATVEC_TILES = {1: _ONE_ROW_TILES, 2: _ONE_ROW_TILES, 4: [(4, 2, 16), (2, 4, 8)]}
_SPLITS = (1, 2, 3, 4, 6, 8, 12)  # 3, 6 and 12 divide the 48 groups of a 1536-wide row and the 384 of down
TILING_KEYS = ("RR", "TR", "BLOCK_G", "SPLIT_K")  # what a GEMV tiling sets (num_warps follows)


def matvec_configs():
    """Every tiling of every BLOCK_M with every split, as the autotuner's configs."""
    tiles = sorted({tile for tiles in _MATVEC_TILES.values() for tile in tiles})
    return [
        triton.Config({"RR": rr, "TR": tr, "BLOCK_G": bg, "SPLIT_K": split}, num_warps=tr * bg // 32, num_stages=1)
        for rr, tr, bg in tiles
        for split in _SPLITS
    ]


def split_fits(n: int, m_blocks: int, block_m: int, block_n: int, split: int) -> bool:
    """Whether a split's ticket counters and fp32 partials fit the per-device scratch."""
    slots = triton.cdiv(n, block_n) * m_blocks
    return split == 1 or (slots <= MAX_SLOTS and slots * split * block_m * block_n <= MAX_PARTIALS)


def prune_matvec(configs, named_args, **kwargs):
    """The tilings of BLOCK_M; per tiling the smallest split that launches at least 8 warps per
    SM (each split at least one step), else the largest that fits."""
    n, g, m = named_args["N"], named_args["G"], named_args["M"]
    block_m = kwargs["BLOCK_M"]
    m_blocks = triton.cdiv(m, block_m)
    target = 8 * sm_count(named_args["x_ptr"].device)
    chosen = {}
    for cfg in configs:
        rr, tr, bg, split = (cfg.kwargs[key] for key in TILING_KEYS)
        key = (rr, tr, bg)
        if key not in _MATVEC_TILES[block_m]:
            continue
        warps = lambda c: triton.cdiv(n, rr * tr) * m_blocks * c.kwargs["SPLIT_K"] * c.num_warps
        if key in chosen and warps(chosen[key]) >= target:
            continue
        if (split == 1 or triton.cdiv(g, split) >= bg) and split_fits(n, m_blocks, block_m, rr * tr, split):
            chosen[key] = cfg
    pruned = list(chosen.values())
    return [max(pruned, key=lambda c: c.kwargs["RR"] * c.kwargs["TR"])] if interpreting() else pruned


def matvec_block_m(m: int) -> int:
    """Rows of x per GEMV program for m rows: 1, 2 or 4."""
    return min(triton.next_power_of_2(m), 4)


# ----------------------------------------------------------------------------------------------
# The autotuners' timer


def flush_nbytes(device: int | torch.device) -> int:
    """Bytes the autotuner writes between timed runs to empty the L2: twice the L2 (at least 8
    MiB), where Triton's own timer writes 256 MB, which a capped 4 GB card has no room for."""
    return max(8 << 20, 2 * torch.cuda.get_device_properties(device).L2_cache_size)


def bench(fn, quantiles, warmup_ms: float = 5.0, rep_ms: float = 25.0) -> list[float]:
    """The autotuner's timer, as ``triton.testing.do_bench``: ms per call of fn at `quantiles`,
    each timed run after the L2 was emptied (:func:`flush_nbytes`)."""
    device = torch.cuda.current_device()
    flush = torch.empty(flush_nbytes(device) // 4, dtype=torch.int32, device=device)
    fn()
    probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    probe[0].record()
    for _ in range(5):
        flush.zero_()
        fn()
    probe[1].record()
    torch.cuda.synchronize(device)
    each = max(probe[0].elapsed_time(probe[1]) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / each))):
        fn()
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(max(1, int(rep_ms / each)))]
    for start, end in marks:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    times = torch.tensor([start.elapsed_time(end) for start, end in marks])
    return torch.quantile(times, torch.tensor(list(quantiles))).tolist()


# ----------------------------------------------------------------------------------------------
# Tilings launched and pinned


def matvec_tiling_candidates(key: tuple, device: torch.device) -> list[dict]:
    """The tilings the autotuner would time for a GEMV shape key (as :class:`MatvecTilings`'s) on `device`."""
    n, g, block_m = key[:3]
    pruned = prune_matvec(matvec_configs(), {"N": n, "G": g, "M": block_m, "x_ptr": torch.empty(0, device=device)},
                          BLOCK_M=block_m)
    return [{k: c.kwargs[k] for k in TILING_KEYS} for c in pruned]


class MatvecTilings:
    """The GEMV tilings one model launches with: those pinned in place of the autotuner's picks,
    and the tiling of each shape launched since :meth:`forget`.

    A model (:class:`qat4.model.Gemma4`) owns one and hands it to every GEMV it launches (the
    ``tilings`` argument of :mod:`qat4.ops.w4.dispatch`'s layers), so two models in one process
    neither share pins nor see each other's launches. A GEMV launched without one (``tilings=None``:
    the ops called directly) takes the autotuner's pick and records nothing; one whose caller fixes
    the tiling (the output layer) is neither pinned nor recorded.

    Keys are GEMV shapes (N, K / 32, BLOCK_M, epilogue, residual, x dtype name); values map RR,
    TR, BLOCK_G and SPLIT_K to ints.
    """

    def __init__(self) -> None:
        self._pinned: dict[tuple, dict] = {}  # shape key -> tiling used instead of the autotuner's
        self._launched: dict[tuple, dict] = {}  # shape key -> tiling of its last launch (pinned or autotuned)

    def launched(self) -> dict[tuple, dict]:
        """The tiling of each GEMV shape launched since :meth:`forget`: the pinned one, else the
        autotuner's pick."""
        return dict(self._launched)

    def forget(self) -> None:
        """Start :meth:`launched` afresh (e.g. to list the shapes of one decode step)."""
        self._launched.clear()

    def pin(self, tilings: dict[tuple, dict]) -> None:
        """Launch these GEMV shapes with these tilings from now on, instead of the autotuner's
        picks; shapes not listed are unpinned."""
        self._pinned = {key: {k: int(tiling[k]) for k in TILING_KEYS} for key, tiling in tilings.items()}

    def pinned(self, key: tuple) -> dict | None:
        """The pinned tiling of a GEMV shape key, recorded as launched; None when the shape is not
        pinned."""
        tiling = self._pinned.get(key)
        if tiling is not None:
            self._launched[key] = tiling
        return tiling

    def record(self, key: tuple, tiling: dict) -> None:
        """Record the autotuner's pick for a GEMV shape key as launched."""
        self._launched[key] = tiling
