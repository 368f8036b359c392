"""Decode GEMV on packed 4-bit weights: x [M, K] (M <= 16) @ W.T, with fused epilogues.

W [N, K] in the layout of :mod:`qat4.ops.w4`; each entry point is checked against the reference of
:mod:`qat4.ops.w4.reference` named beside it:

- :func:`w4_matvec` (:func:`~qat4.ops.w4.reference.w4_linear_reference`): out [M, N] in x.dtype.
- :func:`w4_matvec_gelu` (:func:`~qat4.ops.w4.reference.w4_linear_gelu_reference`): a projection
  whose GELU gate runs in the epilogue (the MLP's gate/up with alternating rows; the per-layer
  input gate times its per-layer input).
- :func:`w4_matvec_residual` (:func:`~qat4.ops.w4.reference.w4_linear_residual_reference`): a
  projection feeding the residual step and the next input norm
  (:class:`~qat4.ops.w4.reference.ResidualStep`); the GEMV's last program runs it, so the step
  costs no launch.

The output layer on this kernel is :mod:`qat4.ops.w4.logits`; its tilings are
:mod:`qat4.ops.w4.tiling`'s.

Design (:func:`_matvec_kernel`): a program owns RR * TR rows and one of SPLIT_K slices of K; per
step each thread loads one group of 32 weights of RR rows (16-byte loads) and the group's 32
values of x. A nibble ANDed out of its word and read as float bits is the subnormal code * 2^(4p -
149) (:func:`~qat4.ops.w4.common.nibble_f32`), so each product is one AND and one FMA against x
pre-scaled by 2^(100 - 4p); the -8 bias comes off as 8 * sum(x) per group, the scale once per
group. The lane dimension is the only contiguous one of every load, which makes Triton 3.6 and
later pick the same register layout for words and x (no shared-memory shuffles in the loop).
The next step's loads are issued before the current step's arithmetic. With SPLIT_K > 1 every
program stores an fp32 partial and the last one of a row block (a ticket counter per block) adds
them in split order and runs the epilogue: no extra launch, deterministic.
"""

import functools

import torch

from qat4.ops._triton import tl, triton
from qat4.ops.norms import gelu_tanh_gate, residual_rms_norm_row
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel
from qat4.ops.w4.common import GELU_PAIRS, GELU_UP, PLAIN, _softcap, nibble_f32, split_last, unit_columns
from qat4.ops.w4.reference import ResidualStep, check
from qat4.ops.w4.tiling import (
    MAX_PARTIALS, MAX_SLOTS, TILING_KEYS, MatvecTilings, bench, matvec_block_m, matvec_configs, prune_matvec,
    split_fits,
)

MAX_MATVEC_ROWS = 16  # the GEMV takes at most this many rows of x


# ----------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _word_dot(word, xs, acc):
    """word [RR, T] int32, xs [BM, 8T] fp32 (the 8 columns of each word, times 2^(100 - 4p)),
    acc [BM, RR, T] -> acc + sum_i code_i * x_i * 2^-49: one AND and one FMA per product."""
    x0, x1, x2, x3, x4, x5, x6, x7 = split_last(xs, 8)
    acc += nibble_f32(word, 0)[None, :, :] * x0[:, None, :]
    acc += nibble_f32(word, 1)[None, :, :] * x1[:, None, :]
    acc += nibble_f32(word, 2)[None, :, :] * x2[:, None, :]
    acc += nibble_f32(word, 3)[None, :, :] * x3[:, None, :]
    acc += nibble_f32(word, 4)[None, :, :] * x4[:, None, :]
    acc += nibble_f32(word, 5)[None, :, :] * x5[:, None, :]
    acc += nibble_f32(word, 6)[None, :, :] * x6[:, None, :]
    acc += nibble_f32(word, 7)[None, :, :] * x7[:, None, :]
    return acc


@triton.jit
def _matvec_epilogue(total, ms, rows, n0, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks, pid_n,
                     softcap, SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr, EPILOGUE: tl.constexpr):
    """Finish fp32 sums total [BM, RR, TR] of rows [RR, TR] (rows n0 + rr * TR + tr): optional
    softcap, then per EPILOGUE (see :func:`_matvec_kernel`) store y, GELU-gated row pairs or
    gelu(y) * U to out, or (ARGMAX) store the block's max and its first column to out [M, n_blocks]
    fp32 and idx [M, n_blocks] int32."""
    if SOFTCAP:
        total = _softcap(total, softcap)
    BM: tl.constexpr = total.shape[0]
    BN: tl.constexpr = total.shape[1] * total.shape[2]
    if ARGMAX:
        vals = tl.reshape(tl.where((rows < N)[None, :, :], total, float("-inf")), [BM, BN])
        tl.store(out_ptr + ms * n_blocks + pid_n, tl.max(vals, axis=1), mask=ms < M)
        tl.store(idx_ptr + ms * n_blocks + pid_n, n0 + tl.argmax(vals, axis=1, tie_break_left=True), mask=ms < M)
    elif EPILOGUE == GELU_PAIRS:
        dt: tl.constexpr = out_ptr.dtype.element_ty
        y = tl.reshape(total.to(dt).to(tl.float32), [BM, BN // 2, 2])
        gate, up = tl.split(y)
        cols, _ = tl.split(tl.reshape(rows, [BN // 2, 2]))
        cols = cols // 2
        mask = (ms < M)[:, None] & (cols < N // 2)[None, :]
        tl.store(out_ptr + ms[:, None] * stride_om + cols[None, :], gelu_tanh_gate(gate, up, dt), mask=mask)
    else:
        mask = (ms < M)[:, None, None] & (rows < N)[None, :, :]
        if EPILOGUE == GELU_UP:
            dt: tl.constexpr = out_ptr.dtype.element_ty
            up = tl.load(u_ptr + ms[:, None, None] * stride_um + rows[None, :, :], mask=mask, other=0.0)
            y = gelu_tanh_gate(total.to(dt).to(tl.float32), up.to(tl.float32), dt)
        else:
            y = total.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ms[:, None, None] * stride_om + rows[None, :, :], y, mask=mask)


@triton.jit
def _weight_loads(w_ptr, s_ptr, w_off, s_off, w_ok, s_ok, g0, g_end, BLOCK_G: tl.constexpr, EVEN: tl.constexpr):
    """One GEMV step's weights at group g0: words [RR, 4T] int32 and scales [RR, T]. Masked (past
    g_end, rows >= N) unless EVEN; then a step past g_end (the prefetch after the last step)
    re-reads the last one. The lane dim T = TR * BLOCK_G is the only contiguous one, so every
    Triton version lays words and x out alike: a thread owns 4 words (16 bytes) per row."""
    if EVEN:
        g0 = tl.minimum(g0, g_end - BLOCK_G)
        words = tl.load(w_ptr + w_off + 4 * g0)
        s = tl.load(s_ptr + s_off + g0)
    else:
        kw = tl.arange(0, w_off.shape[1]) % (4 * BLOCK_G) // 4
        ks = tl.arange(0, s_off.shape[1]) % BLOCK_G
        words = tl.load(w_ptr + w_off + 4 * g0, mask=w_ok & (g0 + kw < g_end)[None, :], other=0)
        s = tl.load(s_ptr + s_off + g0, mask=s_ok & (g0 + ks < g_end)[None, :], other=0.0)
    return words, s


@triton.jit
def _x_loads(x_ptr, x_off, x_ok, g0, g_end, BLOCK_G: tl.constexpr, EVEN: tl.constexpr):
    """The four 8-column quarters [BM, 8T] of x under each thread's group at g0, masked like
    :func:`_weight_loads` (and for x rows >= M)."""
    if EVEN:
        g0 = tl.minimum(g0, g_end - BLOCK_G)
        xa = tl.load(x_ptr + x_off + 32 * g0)
        xb = tl.load(x_ptr + x_off + 32 * g0 + 8)
        xc = tl.load(x_ptr + x_off + 32 * g0 + 16)
        xd = tl.load(x_ptr + x_off + 32 * g0 + 24)
    else:
        kx = tl.arange(0, x_off.shape[1]) % (8 * BLOCK_G) // 8
        x_mask = x_ok & (g0 + kx < g_end)[None, :]
        xa = tl.load(x_ptr + x_off + 32 * g0, mask=x_mask, other=0.0)
        xb = tl.load(x_ptr + x_off + 32 * g0 + 8, mask=x_mask, other=0.0)
        xc = tl.load(x_ptr + x_off + 32 * g0 + 16, mask=x_mask, other=0.0)
        xd = tl.load(x_ptr + x_off + 32 * g0 + 24, mask=x_mask, other=0.0)
    return xa, xb, xc, xd


@triton.heuristics({"EVEN": lambda a: a["N"] % (a["RR"] * a["TR"]) == 0 and a["M"] % a["BLOCK_M"] == 0
                    and a["G"] % (a["BLOCK_G"] * a["SPLIT_K"]) == 0})
@triton.jit
def _matvec_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, idx_ptr, part_ptr, lock_ptr, u_ptr, done_ptr,
    h_ptr, rw_ptr, rs_ptr, rnw_ptr, ho_ptr, xo_ptr,
    M, N, G, stride_xm, stride_om, stride_um, softcap, eps,
    BLOCK_M: tl.constexpr, RR: tl.constexpr, TR: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr,
    SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr, EPILOGUE: tl.constexpr, RESIDUAL: tl.constexpr,
    HAS_S: tl.constexpr, HAS_NEXT: tl.constexpr, RES_BLOCK: tl.constexpr, EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W.T for small M; K = 32 * G.

    x [M, K] (row stride stride_xm, columns contiguous), W words [N, 4G] int32, scales [N, G].
    EPILOGUE (see :func:`_matvec_epilogue`): PLAIN stores y = x @ W.T to out [M, N]; GELU_PAIRS
    (rows of W alternate gate and up) stores gelu_tanh(y[:, 2j]) * y[:, 2j + 1] to out [M, N / 2];
    GELU_UP stores gelu_tanh(y) * U to out [M, N] (U row stride stride_um). With RESIDUAL, out is
    y [M, D = N] and the program that stores last (a ticket from done) runs
    :func:`residual_rms_norm_row` on it: HO = (H + RMSNorm_RW(y)) * RS[0] (HAS_S), XO =
    RMSNorm_RNW(HO) (HAS_NEXT), H, HO, XO contiguous [M, D], RES_BLOCK >= D.
    Grid: (cdiv(N, RR * TR), SPLIT_K, cdiv(M, BLOCK_M)). Program (n, k, m) owns rows
    n * RR * TR + rr * TR + tr (rr < RR, tr < TR) and the groups [k * S, (k + 1) * S) with
    S = BLOCK_G * cdiv(cdiv(G, SPLIT_K), BLOCK_G). A step covers BLOCK_G groups: each of the
    TR * BLOCK_G = 32 * num_warps threads loads, per rr, one group of one row (4 words, 16 bytes)
    and the 32 x values of that group; every product is one AND and one FMA (see nibble_f32), the
    -8 bias comes off once per group as 8 * sum(x), the scale is applied once per group, and the
    next step's loads are issued before this step's arithmetic. EVEN (no row, x-row or group
    tail) drops the masks. With SPLIT_K > 1 the partial [BLOCK_M, RR, TR] goes to part[slot, k]
    (slot = m * cdiv(N, RR * TR) + n); a ticket from lock[slot] elects the last program, which
    adds the partials in split order, runs _matvec_epilogue and resets the ticket. With USE_PDL
    the first step's weights are loaded before waiting for the kernel that wrote x.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n_blocks = tl.num_programs(0)
    T: tl.constexpr = TR * BLOCK_G
    n0 = pid_n * RR * TR
    rr = tl.arange(0, RR)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    per_split = tl.cdiv(tl.cdiv(G, SPLIT_K), BLOCK_G) * BLOCK_G
    g_begin = pid_k * per_split
    g_end = tl.minimum(G, g_begin + per_split)
    # lane-major indices: u = tr * 4BG + 4g + word, v = tr * 8BG + 8g + column, t = tr * BG + g
    u = tl.arange(0, 4 * T)
    v = tl.arange(0, 8 * T)
    t = tl.arange(0, T)
    w_rows = n0 + rr[:, None] * TR + (u // (4 * BLOCK_G))[None, :]
    s_rows = n0 + rr[:, None] * TR + (t // BLOCK_G)[None, :]
    w_off = w_rows * (4 * G) + (u % (4 * BLOCK_G))[None, :]
    x_off = ms[:, None] * stride_xm + (32 * (v // 8 % BLOCK_G) + v % 8)[None, :]
    s_off = s_rows * G + (t % BLOCK_G)[None, :]
    col = v % 8
    p = tl.where(col < 5, col, col - 5)
    x_place = ((127 + 100 - 4 * p) << 23).to(tl.float32, bitcast=True)[None, :]  # 2^(100 - 4p)

    words, s = _weight_loads(w_ptr, s_ptr, w_off, s_off, w_rows < N, s_rows < N, g_begin, g_end, BLOCK_G, EVEN)
    wait_for_previous_kernel(USE_PDL)
    xa, xb, xc, xd = _x_loads(x_ptr, x_off, (ms < M)[:, None], g_begin, g_end, BLOCK_G, EVEN)
    acc = tl.zeros([BLOCK_M, RR, T], dtype=tl.float32)
    for g0 in range(g_begin, g_end, BLOCK_G):
        nxt_w, nxt_s = _weight_loads(w_ptr, s_ptr, w_off, s_off, w_rows < N, s_rows < N, g0 + BLOCK_G, g_end, BLOCK_G, EVEN)
        nxt_x = _x_loads(x_ptr, x_off, (ms < M)[:, None], g0 + BLOCK_G, g_end, BLOCK_G, EVEN)
        word0, word1, word2, word3 = split_last(words, 4)
        xa, xb, xc, xd = xa.to(tl.float32), xb.to(tl.float32), xc.to(tl.float32), xd.to(tl.float32)
        bias = tl.sum(tl.reshape(xa + xb + xc + xd, [BLOCK_M, T, 8]), axis=2) * -1.4210854715202004e-14  # -8 * 2^-49 * sum x
        part = tl.broadcast_to(bias[:, None, :], [BLOCK_M, RR, T])
        part = _word_dot(word0, xa * x_place, part)
        part = _word_dot(word1, xb * x_place, part)
        part = _word_dot(word2, xc * x_place, part)
        part = _word_dot(word3, xd * x_place, part)
        acc += part * s.to(tl.float32)[None, :, :]
        words, s = nxt_w, nxt_s
        xa, xb, xc, xd = nxt_x
    total = tl.sum(tl.reshape(acc, [BLOCK_M, RR, TR, BLOCK_G]), axis=3) * 562949953421312.0  # * 2^49
    rows = n0 + rr[:, None] * TR + tl.arange(0, TR)[None, :]

    if SPLIT_K == 1:
        _matvec_epilogue(total, ms, rows, n0, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks, pid_n,
                         softcap, SOFTCAP, ARGMAX, EPILOGUE)
        if RESIDUAL:
            _residual_after_last_store(out_ptr, stride_om, done_ptr, M, N, h_ptr, rw_ptr, rs_ptr, rnw_ptr, ho_ptr,
                                       xo_ptr, eps, HAS_S, HAS_NEXT, RES_BLOCK)
    else:
        slot = pid_m * n_blocks + pid_n
        tile = (tl.arange(0, BLOCK_M)[:, None, None] * (RR * TR) + rr[None, :, None] * TR
                + tl.arange(0, TR)[None, None, :])
        tl.store(part_ptr + (slot * SPLIT_K + pid_k) * (BLOCK_M * RR * TR) + tile, total)
        tl.debug_barrier()
        ticket = tl.atomic_add(lock_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, RR, TR], dtype=tl.float32)
            for k in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (slot * SPLIT_K + k) * (BLOCK_M * RR * TR) + tile, cache_modifier=".cg")
            _matvec_epilogue(total, ms, rows, n0, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks,
                             pid_n, softcap, SOFTCAP, ARGMAX, EPILOGUE)
            tl.atomic_xchg(lock_ptr + slot, 0)
            if RESIDUAL:
                _residual_after_last_store(out_ptr, stride_om, done_ptr, M, N, h_ptr, rw_ptr, rs_ptr, rnw_ptr, ho_ptr,
                                           xo_ptr, eps, HAS_S, HAS_NEXT, RES_BLOCK)


@triton.jit
def _residual_after_last_store(out_ptr, stride_om, done_ptr, M, D, h_ptr, rw_ptr, rs_ptr, rnw_ptr, ho_ptr, xo_ptr,
                               eps, HAS_S: tl.constexpr, HAS_NEXT: tl.constexpr, RES_BLOCK: tl.constexpr):
    """Run by every program once its rows of out [M, D] are stored: a ticket from done elects the
    last of the grid's cdiv(N, RR * TR) * cdiv(M, BLOCK_M) storing programs, which runs the
    residual step of each row of out (see :func:`_matvec_kernel`) and resets the ticket."""
    tl.debug_barrier()
    writers = tl.num_programs(0) * tl.num_programs(2)
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == writers - 1:
        for m in range(M):
            residual_rms_norm_row(h_ptr + m * D, out_ptr + m * stride_om, rw_ptr, rs_ptr, rnw_ptr, ho_ptr + m * D,
                                  xo_ptr + m * D, D, eps, HAS_S, HAS_NEXT, RES_BLOCK)
        tl.atomic_xchg(done_ptr, 0)


# ----------------------------------------------------------------------------------------------
# Launchers


_matvec_tuned = triton.autotune(
    configs=matvec_configs(), key=["N", "G", "BLOCK_M", "EPILOGUE", "RESIDUAL"],
    prune_configs_by={"early_config_prune": prune_matvec}, do_bench=bench,
)(_matvec_kernel)


@functools.lru_cache(maxsize=None)
def _split_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device split-K ticket counters and the grid ticket of the residual step (last entry),
    zero between launches, and fp32 partials. GEMVs of one device must therefore run one at a
    time (one stream, as in a decode graph); the first call allocates them, so make it before a
    CUDA graph capture."""
    return (torch.zeros(MAX_SLOTS + 1, dtype=torch.int32, device=device),
            torch.empty(MAX_PARTIALS, dtype=torch.float32, device=device))


def launch_matvec(x, packed, scales, out, *, idx=None, softcap=None, argmax=False, epilogue=PLAIN, up=None,
                  residual: ResidualStep | None = None, h_out=None, x_next=None, config=None,
                  tilings: MatvecTilings | None = None):
    """One :func:`_matvec_kernel` launch (see its docstring for what each argument feeds). Without
    `config`, the tiling `tilings` pins for the shape or else the autotuner's, recorded as launched
    in `tilings`; without `tilings` (None) always the autotuner's, recorded nowhere. A launch on
    `config` is neither pinned nor recorded."""
    check(x, packed, scales)
    if x.shape[0] > MAX_MATVEC_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_MATVEC_ROWS} rows of x, got {x.shape[0]}; use w4_matmul")
    x = x if x.stride(1) == 1 else x.contiguous()
    (m, _), (n, kw) = x.shape, packed.shape
    locks, partials = _split_scratch(x.device)
    block_m = matvec_block_m(m)
    shape_key = (n, kw // 4, block_m, int(epilogue), residual is not None, str(x.dtype).removeprefix("torch."))
    if config is None and tilings is not None:
        config = tilings.pinned(shape_key)
    step = residual or ResidualStep(None, None)
    given = lambda t: out if t is None else t  # noqa: E731  (a pointer the kernel's flags leave unread)
    args = (x, packed.contiguous(), scales.contiguous(), out, given(idx), partials, locks, given(up),
            locks[MAX_SLOTS:], given(step.h), given(step.weight),
            given(step.scalar), given(step.next_weight), given(h_out), given(x_next),
            m, n, kw // 4, x.stride(0), out.stride(0), 0 if up is None else up.stride(0), softcap, step.eps)
    flags = dict(BLOCK_M=block_m, SOFTCAP=softcap is not None, ARGMAX=argmax, EPILOGUE=int(epilogue),
                 RESIDUAL=residual is not None, HAS_S=step.scalar is not None, HAS_NEXT=step.next_weight is not None,
                 RES_BLOCK=triton.next_power_of_2(n) if residual is not None else 1, **pdl_launch(x, m))
    if config is None:
        grid = lambda meta: (triton.cdiv(n, meta["RR"] * meta["TR"]), meta["SPLIT_K"], triton.cdiv(m, block_m))
        _matvec_tuned[grid](*args, **flags)
        picked = getattr(_matvec_tuned, "best_config", None)
        if picked is not None and tilings is not None:
            tilings.record(shape_key, {k: picked.kwargs[k] for k in TILING_KEYS})
    else:
        tiling = {key: config[key] for key in TILING_KEYS}
        block_n = tiling["RR"] * tiling["TR"]
        if not split_fits(n, triton.cdiv(m, block_m), block_m, block_n, tiling["SPLIT_K"]):
            raise ValueError(f"split-K scratch too small for {config} at N={n}")
        grid = (triton.cdiv(n, block_n), tiling["SPLIT_K"], triton.cdiv(m, block_m))
        _matvec_kernel[grid](*args, **flags, **tiling, num_warps=max(1, tiling["TR"] * tiling["BLOCK_G"] // 32))


def w4_matvec(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
              *, config: dict | None = None, tilings: MatvecTilings | None = None) -> torch.Tensor:
    """Decode GEMV: x [M, K] (M <= 16) @ W.T -> [M, N] in x.dtype, fp32 accumulation.

    Reads the packed words once and unpacks in registers. `out` [M, N] (x.dtype, unit column
    stride) may be given, e.g. a buffer of a captured CUDA graph. `config` pins RR, TR, BLOCK_G and
    SPLIT_K of :func:`_matvec_kernel` (num_warps = TR * BLOCK_G / 32) instead of autotuning;
    without it, `tilings` (a model's) pins and records the tiling (:func:`launch_matvec`), and
    without either the autotuner picks it and nothing is recorded.
    """
    if out is None:
        out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype, device=x.device)
    launch_matvec(x, packed, scales, out, config=config, tilings=tilings)
    return out


def w4_matvec_gelu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, up: torch.Tensor | None = None,
                   *, config: dict | None = None, tilings: MatvecTilings | None = None) -> torch.Tensor:
    """Triton :func:`~qat4.ops.w4.reference.w4_linear_gelu_reference` for M <= 16: the gate applied
    in the GEMV's epilogue. `config` and `tilings` as :func:`w4_matvec`'s."""
    n = packed.shape[0]
    if up is None and (n % 2 or (config and config["RR"] * config["TR"] % 2)):
        raise ValueError(f"GELU row pairs need an even row count per matrix and per tile, got N={n}, {config}")
    out = torch.empty(x.shape[0], n if up is not None else n // 2, dtype=x.dtype, device=x.device)
    launch_matvec(x, packed, scales, out, epilogue=GELU_PAIRS if up is None else GELU_UP, up=unit_columns(up),
                  config=config, tilings=tilings)
    return out


def w4_matvec_residual(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, residual: ResidualStep,
                       *, config: dict | None = None,
                       tilings: MatvecTilings | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton :func:`~qat4.ops.w4.reference.w4_linear_residual_reference` for M <= 16: the program
    that stores the GEMV's last rows runs the residual step, so y never leaves for another launch.
    `config` and `tilings` as :func:`w4_matvec`'s."""
    m, d = x.shape[0], packed.shape[0]
    if tuple(residual.h.shape) != (m, d):
        raise ValueError(f"the residual stream must be [{m}, {d}], got {tuple(residual.h.shape)}")
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(y)
    x_next = None if residual.next_weight is None else torch.empty_like(y)
    launch_matvec(x, packed, scales, y, residual=residual._replace(h=residual.h.contiguous()), h_out=h_out,
                  x_next=x_next, config=config, tilings=tilings)
    return h_out, x_next
