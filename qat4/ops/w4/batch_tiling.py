"""The decode-batch kernel's tilings (:func:`~qat4.ops.w4.batch._batch_kernel`): a fixed table per
BLOCK_M (the rows of x rounded up to 16, 32, 64 or 128) and N, and a split rule. Nothing is timed
at decode time, so a captured CUDA graph launches what the table says. ``config=`` of the batch
products pins any of its keys (:data:`TILING_KEYS`, checked by :func:`resolve_tiling`);
:func:`batch_tiling_candidates` lists what tools/bench_w4.py --sweep times.
"""

import functools

import torch

from qat4.ops._triton import triton
from qat4.ops.w4.common import fits_half_l2, l2_bytes, sm_count

TILING_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_G", "SPLIT_K", "PREFETCH", "ONE_DOT", "PAIR_UNPACK", "L2_PREFETCH",
               "num_warps", "num_stages")
_MAX_SPLIT = 16  # the last program of a tile adds this many partials at most (unrolled)
BATCH_SLOTS = 1 << 12  # split-K ticket counters per device (row blocks of W x row blocks of x)
BATCH_PARTIALS = 1 << 22  # split-K fp32 partial sums per device (16 MiB)

# (BLOCK_M, smallest N, tile, registers): a shape takes the last row of its BLOCK_M whose smallest
# N it reaches; a tile is (BLOCK_N, BLOCK_G, num_warps, num_stages, PREFETCH). Reasoning (H200:
# 132 SMs, 64 Ki registers and 228 KiB of shared memory each): every tile gives a thread 8-16
# words per step (2-4 loads of 16 bytes) and at most 64 fp32 sums. Every row block re-reads its
# slice of x from L2, 3.6 * BLOCK_M / BLOCK_N times the weight bytes in all, so wide W (where row
# blocks are plenty) takes wide blocks, and narrow W the tiles that an SM holds most bytes of at
# once. Loads in the unpacking step (PREFETCH=0, num_stages=1, see :mod:`qat4.ops.w4.batch`). The
# last field is the registers per thread of Triton 3.6's sm_90a code (no spills; eight dots, each
# weight unpacked in fp32, as when these splits were timed), which sets how many programs an SM
# holds (:func:`_programs_per_sm`): 3, 4, 3, 2, 2, 1, 1. Compiled on 2026-12-07 the tiles took
# 130 / 69 / 162 / 98 / 210 / 128 / 186 that way and 127 / 64 / 128 / 80 / 208 / 128 / 186 with pair
# unpacking (`tools/kernel_sass.py`), so the 32-row tiles would hold one program more per SM with
# pairs; the column stays as timed until the splits are timed again that way. BLOCK_G = 8 costs
# 130-210 registers, and up to 255 with more than 16 words per thread. At 64 rows the 64-wide tile
# took less time than the 128-wide one at every shape of E2B narrower than 8,192 rows, up to 43 %
# less (`tools/bench_w4.py --rows 64 --batch-config`, BENCHMARKS.md); wider W there goes to the
# prefill GEMM (:mod:`qat4.ops.w4.dispatch`), all but the output layer. At 4 and 16 rows the
# 64-wide tile also took less time up to 24,576 rows (8,960 x 1,536: 11.8 -> 9.0 µs, 12,288 x
# 1,536: 9.8 -> 9.3, 24,576 x 1,536: 17.1 -> 15.0 at 4 rows, with the split rule's splits), the
# 128-wide one at the output layer's 262,144 rows (133 against 146 µs at 4 rows); `tools/bench_w4.py
# --rows 4 --sweep` and `--rows 16 --sweep`, BENCHMARKS.md.
_TILES = (
    (16, 0, (64, 8, 4, 1, 0), 130),
    (16, 65536, (128, 4, 8, 1, 0), 64),
    (32, 0, (64, 8, 4, 1, 0), 157),
    (32, 8192, (128, 4, 8, 1, 0), 89),
    (64, 0, (64, 8, 4, 1, 0), 210),
    (64, 8192, (256, 4, 16, 1, 0), 100),
    (128, 0, (128, 4, 8, 1, 0), 190),
)
_IN_FLIGHT = 32 << 10  # weight bytes to keep in flight per SM: ~4.1 TB/s over 132 SMs times ~1 us


def _block_m(m: int) -> int:
    """Rows of x per program: the rows rounded up to 16, 32, 64 or 128 (more rows: blocks of 128)."""
    return min(max(16, triton.next_power_of_2(m)), 128)


def _default_tile(n: int, block_m: int) -> tuple:
    rows = [tile for bm, min_n, tile, _ in _TILES if bm == block_m and n >= min_n]
    if not rows:
        raise ValueError(f"no batch tile for BLOCK_M={block_m}")
    return rows[-1]


def _programs_per_sm(tiling: dict) -> int:
    """Programs of this tiling an H200 SM holds at once, by registers (64 Ki per SM, 64 warps at
    most): the table's measured count (eight dots a step), else a rough fit to it (40 + 6 per word
    + 1.5 per sum)."""
    block_m, block_n, block_g, warps = (tiling[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_G", "num_warps"))
    measured = [regs for bm, _, (bn, bg, w, stages, prefetch), regs in _TILES
                if (bm, bn, bg, w, stages, prefetch, 0) == (block_m, block_n, block_g, warps, tiling["num_stages"],
                                                            tiling["PREFETCH"], tiling["ONE_DOT"])]
    threads = 32 * warps
    regs = measured[0] if measured else min(255, int(40 + 6 * block_n * 4 * block_g / threads + 1.5 * block_n * block_m / threads))
    return max(1, min(65536 // (-(-regs // 8) * 8 * threads), 64 // warps))


def _fits(n: int, m: int, tiling: dict) -> bool:
    """Whether a tiling's split-K partials and tickets fit the per-device scratch."""
    split = tiling["SPLIT_K"]
    slots = triton.cdiv(n, tiling["BLOCK_N"]) * triton.cdiv(m, tiling["BLOCK_M"])
    return split == 1 or (split <= _MAX_SPLIT and slots <= BATCH_SLOTS
                          and slots * split * tiling["BLOCK_N"] * tiling["BLOCK_M"] <= BATCH_PARTIALS)


def _even_splits(g: int, block_g: int) -> list[int]:
    """Splits of K into whole steps of block_g groups: divisors of the step count (all of them up
    to it when G is no multiple of block_g), at most _MAX_SPLIT."""
    steps = triton.cdiv(g, block_g)
    return [s for s in range(1, min(steps, _MAX_SPLIT) + 1) if g % block_g or steps % s == 0]


def _split_for(n: int, g: int, m: int, tile: dict, sm_count: int) -> int:
    """SPLIT_K for a tile: the smallest whole-step split that launches a program on every SM and
    keeps _IN_FLIGHT weight bytes in flight per SM (programs resident per SM times a step of
    weights, times PREFETCH), in a single wave of the programs the SMs hold at once (a second
    wave would be a tail as long as the first). Failing that, the largest split that still fits
    one wave: a matrix too small to fill the GPU's loads then issues all of them at once, most
    before the PDL wait. Only splits that fit the scratch and whose partials (written and read
    back through L2) stay within twice the bytes the kernel moves anyway (the weights, and x
    re-read by every row block) count, which decides at 64 and 128 rows of x on short rows of W."""
    row_blocks, x_blocks = triton.cdiv(n, tile["BLOCK_N"]), triton.cdiv(m, tile["BLOCK_M"])
    m_pad = x_blocks * tile["BLOCK_M"]
    partial_bytes = 8 * row_blocks * tile["BLOCK_N"] * m_pad
    moved_bytes = n * 32 * g * 9 // 16 + row_blocks * m_pad * 32 * g * 2
    fitting = [s for s in _even_splits(g, tile["BLOCK_G"])
               if _fits(n, m, dict(tile, SPLIT_K=s)) and (s == 1 or s * partial_bytes <= 2 * moved_bytes)]
    per_sm = _programs_per_sm(tile)
    step_bytes = tile["BLOCK_N"] * 32 * tile["BLOCK_G"] * 9 // 16 * max(1, tile["PREFETCH"])
    programs = lambda split: row_blocks * x_blocks * split  # noqa: E731
    one_wave = [s for s in fitting if programs(s) <= per_sm * sm_count] or [1]
    for split in one_wave:
        if programs(split) >= sm_count and min(per_sm, programs(split) / sm_count) * step_bytes >= _IN_FLIGHT:
            return split
    return one_wave[-1]


def _sms(device) -> int:
    return sm_count(torch.device(device)) if device is not None else 1


def _l2(device) -> int:
    return l2_bytes(torch.device(device)) if device is not None else 0


def _one_dot(block_m: int, block_g: int, k: int) -> int:
    """ONE_DOT for a tile: one dot for a 16-row tile whose K is a single step. With nothing to
    overlap the eight dots' round trips with, the per-layer inputs' 1,536 x 256 product took 1.86
    against 2.27 µs at 4 rows and 1.88 against 2.28 at 16 on an H200 (`tools/bench_w4.py --sweep`);
    with several steps eight dots were faster at every E2B shape."""
    return int(block_m == 16 and k // 32 <= block_g)


def _steps(tiling: dict, g: int) -> int:
    """Steps (BLOCK_G groups each) of one program of a tiling over G groups."""
    return triton.cdiv(triton.cdiv(g, tiling["SPLIT_K"]), tiling["BLOCK_G"])


def _pair_unpack(tiling: dict, g: int) -> int:
    """PAIR_UNPACK for a tiling over G groups: two weights per instruction in x.dtype (where
    :func:`~qat4.ops.w4.batch.unpacks_pairs` allows it) for tiles of 4 groups a step, and for
    16-row tiles whose programs run one step; each weight in fp32 otherwise. Timed both ways on an
    H100 with bf16 steps (`tools/bench_w4.py --rows R` with and without ``QAT4_PAIR_UNPACK=0``,
    BENCHMARKS.md, 2026-12-07), pairs took the output layer from 137.7 to 123.3 µs at 4 rows and
    from 303.9 to 273.5 at 64, 24,576 x 1,536 from 35.4 to 30.6 at 64 rows and one-step 16-row
    products 1-10 % less, but 64-row tiles of 8 groups 3-11 % more and 16-row programs of 2-3
    steps 3-9 % more."""
    return int(tiling["BLOCK_G"] == 4 or (tiling["BLOCK_M"] == 16 and _steps(tiling, g) == 1))


def _l2_prefetch(tiling: dict, n: int, k: int, l2: int) -> int:
    """L2_PREFETCH for a tiling of W [n, k] on a GPU of ``l2`` bytes of L2: 64-row tiles whose
    programs run at least 3 steps, over a W that fits half the L2 (:func:`fits_half_l2`). Timed
    both ways on an H200 (`tools/bench_w4.py --rows R` with and without ``QAT4_L2_PREFETCH=1``,
    BENCHMARKS.md, 2026-12-07): at 64 rows the prefetch took 12,288 x 1,536 (6 steps) from 21.8 to
    19.1 µs, 1,536 x 12,288 (6) from 21.3 to 20.3, 24,576 x 1,536 (12) from 29.4 to 28.2 and
    1,536 x 6,144 (3) from 12.7 to 12.4, while one-step programs gained nothing or lost up to 5 %;
    at 4 rows it moved every shape by -3 to +3 %, and a 4- and 16-row decode step took 1.5 % longer
    with it everywhere."""
    return int(tiling["BLOCK_M"] == 64 and _steps(tiling, k // 32) >= 3 and fits_half_l2(n, k, l2))


def batch_tiling(n: int, k: int, m: int, device=None, *, sm_count: int | None = None,
                 l2_bytes: int | None = None) -> dict:
    """The table's tiling (keys :data:`TILING_KEYS`) for W [n, k] and m rows of x on `device`
    (its SM count sets the split and its L2 the prefetch; `sm_count` and `l2_bytes` override
    them; no device: one SM and no L2)."""
    block_m = _block_m(m)
    block_n, block_g, warps, stages, prefetch = _default_tile(n, block_m)
    tile = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_G": block_g, "PREFETCH": prefetch,
            "ONE_DOT": _one_dot(block_m, block_g, k), "num_warps": warps, "num_stages": stages}
    sms = sm_count if sm_count is not None else _sms(device)
    tiling = dict(tile, SPLIT_K=_split_for(n, k // 32, m, tile, sms))
    return _with_rules(tiling, n, k, l2_bytes if l2_bytes is not None else _l2(device))


def _with_rules(tiling: dict, n: int, k: int, l2: int) -> dict:
    """A tiling with the table's PAIR_UNPACK and L2_PREFETCH for its tile and split."""
    return dict(tiling, PAIR_UNPACK=_pair_unpack(tiling, k // 32), L2_PREFETCH=_l2_prefetch(tiling, n, k, l2))


def batch_tiling_candidates(n: int, k: int, m: int, device=None, *, sm_count: int | None = None,
                            l2_bytes: int | None = None) -> list[dict]:
    """Tilings worth timing for one shape (tools/bench_w4.py --sweep): the table's; its tile with
    the other ONE_DOT (one dot a step or eight), its tile with the other PAIR_UNPACK, then both
    ONE_DOT ways with every PREFETCH and num_stages; its tile with every whole-step split; and the
    other tiles of 8-16 words and at most 64 sums per thread, with the split rule's split. The
    table's comes first, its ONE_DOT twin second, its PAIR_UNPACK twin third and its L2_PREFETCH
    twin fourth."""
    sms = sm_count if sm_count is not None else _sms(device)
    g, l2 = k // 32, l2_bytes if l2_bytes is not None else _l2(device)
    base = batch_tiling(n, k, m, sm_count=sms, l2_bytes=l2)
    out = [base]

    def add(tiling):
        if tiling not in out and _fits(n, m, tiling):
            out.append(tiling)

    add(dict(base, ONE_DOT=1 - base["ONE_DOT"]))
    add(dict(base, PAIR_UNPACK=1 - base["PAIR_UNPACK"]))
    add(dict(base, L2_PREFETCH=1 - base["L2_PREFETCH"]))
    for one_dot in (1 - base["ONE_DOT"], base["ONE_DOT"]):
        for prefetch in (0, 1, 2):
            for stages in (1, 2, 3):
                add(dict(base, num_stages=stages, PREFETCH=prefetch, ONE_DOT=one_dot))
    for split in _even_splits(g, base["BLOCK_G"]):
        add(_with_rules(dict(base, SPLIT_K=split), n, k, l2))
    block_m = base["BLOCK_M"]
    for block_n in (64, 128, 256):
        for block_g in (4, 8):
            for warps in (4, 8, 16):
                threads = 32 * warps
                if not (8 <= block_n * 4 * block_g // threads <= 16 and block_n * block_m // threads <= 64):
                    continue
                tile = dict(base, BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps,
                            ONE_DOT=_one_dot(block_m, block_g, k))
                add(_with_rules(dict(tile, SPLIT_K=_split_for(n, g, m, tile, sms)), n, k, l2))
    return out


@functools.lru_cache(maxsize=4096)
def _table_tiling(n: int, k: int, m: int, sms: int, l2_bytes: int) -> dict:
    """:func:`batch_tiling` for an SM count, worked out once per shape (a prompt step launches
    some 200 of these; the split rule alone is tens of µs of Python). Shared: never changed."""
    tiling = batch_tiling(n, k, m, sm_count=sms, l2_bytes=l2_bytes)
    if not _fits(n, m, tiling):
        raise ValueError(f"split-K scratch too small for {tiling} at N={n}, M={m}")
    return tiling


def resolve_tiling(config: dict | None, n: int, k: int, m: int, device) -> dict:
    """The table's tiling with the keys `config` pins, checked; a pinned tile without a pinned
    SPLIT_K gets the split rule's split for that tile, and without a pinned ONE_DOT the table's
    rule for it, and without a pinned PAIR_UNPACK or L2_PREFETCH the table's rules for the tiling
    as pinned. Without `config`, the shared table tiling."""
    if not config:
        return _table_tiling(n, k, m, _sms(device), _l2(device))
    tiling = dict(_table_tiling(n, k, m, _sms(device), _l2(device)))
    unknown = set(config) - set(TILING_KEYS)
    if unknown:
        raise ValueError(f"unknown batch tiling keys {sorted(unknown)}; use {TILING_KEYS}")
    tiling.update({key: int(value) for key, value in config.items()})
    if "ONE_DOT" not in config:  # the table's rule for the tile as pinned
        tiling["ONE_DOT"] = _one_dot(tiling["BLOCK_M"], tiling["BLOCK_G"], k)
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(tiling["BLOCK_M"]) and tiling["BLOCK_M"] >= 16 and pow2(tiling["BLOCK_N"]) and tiling["BLOCK_N"] >= 16
            and pow2(tiling["BLOCK_G"]) and tiling["BLOCK_G"] >= 4 and tiling["PREFETCH"] in (0, 1, 2)
            and tiling["ONE_DOT"] in (0, 1) and tiling["PAIR_UNPACK"] in (0, 1) and tiling["L2_PREFETCH"] in (0, 1)
            and tiling["SPLIT_K"] >= 1 and pow2(tiling["num_warps"]) and tiling["num_stages"] >= 1):
        raise ValueError(f"a batch tiling needs BLOCK_M, BLOCK_N >= 16 and BLOCK_G >= 4 (tl.dot's 16) as powers of two, "
                         f"PREFETCH 0, 1 or 2, ONE_DOT, PAIR_UNPACK and L2_PREFETCH 0 or 1, SPLIT_K >= 1; got {tiling}")
    if "SPLIT_K" not in config and any(key in config for key in ("BLOCK_N", "BLOCK_G", "BLOCK_M", "num_warps")):
        tiling["SPLIT_K"] = _split_for(n, k // 32, m, tiling, _sms(device))
    rules = _with_rules(tiling, n, k, _l2(device))  # the table's rules for the tiling as pinned
    tiling.update({key: rules[key] for key in ("PAIR_UNPACK", "L2_PREFETCH") if key not in config})
    if not _fits(n, m, tiling):
        raise ValueError(f"split-K scratch too small for {tiling} at N={n}, M={m}")
    return tiling
