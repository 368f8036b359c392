"""Linear layers on packed 4-bit weights: decode GEMV, prefill GEMM and the softcapped output layer.

A weight W [N, K] (N outputs, K inputs, K a multiple of 32) is kept in the layout of
:mod:`qat4.checkpoint.packing`: ``packed`` int32 [N, K/8], column ``8j + i`` in bits ``4i..4i+3`` of
word ``j`` as the code ``level + 8``; ``scales`` fp16/bf16 [N, K/32], ``W[r, c] = scales[r, c // 32]
* level``. Every op computes ``y = x @ W.T`` with fp32 accumulation and never writes W in 16 bits.

Kernels (each with a plain-torch reference of the same signature; :mod:`qat4.ops.w4` picks among
them, :mod:`qat4.ops.w4_batch` and this module's, by the rows of x):

- :func:`w4_matvec` (decode, M <= 16) and :func:`w4_matmul` (prefill), both checked against
  :func:`w4_linear_reference`.
- :func:`w4_logits_triton` / :func:`w4_argmax_triton`: the output layer with Gemma's
  ``cap * tanh(z / cap)`` softcap fused into the GEMV epilogue; the argmax never writes the logits.
- :func:`w4_matvec_gelu`: a projection whose GELU gate runs in the epilogue (the MLP's gate/up
  with alternating rows; the per-layer input gate times its per-layer input); the GEMM has the
  same epilogues.
- :func:`w4_matvec_residual`: a projection feeding the residual step and the next input norm
  (:class:`ResidualStep`); the GEMV's last program runs it, so the step costs no launch.

GEMV design (:func:`_matvec_kernel`): a program owns RR * TR rows and one of SPLIT_K slices of
K; per step each thread loads one group of 32 weights of RR rows (16-byte loads) and the group's
32 values of x. A nibble ANDed out of its word and read as float bits is the subnormal
code * 2^(4p - 149) (:func:`nibble_f32`), so each product is one AND and one FMA against x
pre-scaled by 2^(100 - 4p); the -8 bias comes off as 8 * sum(x) per group, the scale once per
group. The lane dimension is the only contiguous one of every load, which makes Triton 3.6 and
later pick the same register layout for words and x (no shared-memory shuffles in the loop).
The next step's loads are issued before the current step's arithmetic. With SPLIT_K > 1 every
program stores an fp32 partial and the last one of a row block (a ticket counter per block) adds
them in split order and runs the epilogue: no extra launch, deterministic. Tiling and split are
autotuned per (N, K, BLOCK_M, epilogue) over a small space: per tiling, the smallest split that
launches 8 warps per SM.
"""

import functools
import os
import weakref
from typing import NamedTuple

import torch

from qat4.checkpoint.packing import dequantize
from qat4.ops._triton import tl, triton
from qat4.ops.norms import gelu_tanh_gate, gelu_tanh_mul_reference, residual_rms_norm_reference, residual_rms_norm_row
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel

MAX_MATVEC_ROWS = 16  # the GEMV takes at most this many rows of x
_REFERENCE_CHUNK = 1 << 22  # dequantised weights per chunk of the references (16 MiB in fp32)
_REFERENCE_ROWS = 16  # rows of x per matrix product of the references
_MAX_SLOTS = 1 << 12  # split-K ticket counters per device (row blocks x row-of-x blocks)
_MAX_PARTIALS = 1 << 20  # split-K fp32 partial sums per device (4 MiB)
PLAIN, GELU_PAIRS, GELU_UP = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # GEMV / GEMM epilogues


# ----------------------------------------------------------------------------------------------
# References


_KEPT: dict[int, tuple[torch.Tensor, list]] = {}  # id(packed words) -> (scales, chunks), dropped with the words
KEPT_BYTES = 1 << 30  # dequantised CPU weights the references keep between calls


def _dequantized_row_chunks(packed: torch.Tensor, scales: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(first row, fp32 [rows, K]) chunks of W, at most _REFERENCE_CHUNK weights each.

    On the CPU the chunks of a matrix are kept (while its packed words live, up to KEPT_BYTES in
    all, first come first kept), so a decode step does not unpack every matrix again.
    """
    kept = _KEPT.get(id(packed))
    if kept is not None and kept[0] is scales:
        return kept[1]
    n, kw = packed.shape
    step = max(1, _REFERENCE_CHUNK // (kw * 8))
    chunks = [(r0, dequantize(packed[r0 : r0 + step], scales[r0 : r0 + step])) for r0 in range(0, n, step)]
    held = sum(w.numel() * 4 for _, parts in _KEPT.values() for _, w in parts)
    if packed.device.type == "cpu" and held + n * kw * 32 <= KEPT_BYTES:
        _KEPT[id(packed)] = (scales, chunks)
        weakref.finalize(packed, _KEPT.pop, id(packed), None)
    return chunks


def _reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None, dtype):
    """fp32 ``x @ W.T`` (optionally softcapped) in row chunks of W -> [M, N] in `dtype`.

    Rows of x go through the products _REFERENCE_ROWS at a time, zero-padded: a matrix product
    may round a row differently with other rows beside it (its blocking follows the shape), so a
    fixed shape makes each row's result independent of its batch, as a batched engine needs.
    """
    _check(x, packed, scales)
    m = x.shape[0]
    out = torch.empty(m, packed.shape[0], dtype=dtype, device=x.device)
    xf = torch.zeros(-(-m // _REFERENCE_ROWS) * _REFERENCE_ROWS, x.shape[1], device=x.device)
    xf[:m] = x.float()
    for r0, w in _dequantized_row_chunks(packed, scales):
        for m0 in range(0, m, _REFERENCE_ROWS):
            z = xf[m0 : m0 + _REFERENCE_ROWS] @ w.T
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            out[m0 : m0 + _REFERENCE_ROWS, r0 : r0 + w.shape[0]] = z[: m - m0].to(dtype)
    return out


def w4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x.dtype, computed in fp32 (reference of matvec, matmul, linear)."""
    return _reference(x, packed, scales, None, x.dtype)


def w4_linear_gelu_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                             up: torch.Tensor | None = None) -> torch.Tensor:
    """A GELU-gated linear layer, y = x [M, K] @ W.T rounded to x.dtype, then gelu_tanh_mul_reference:
    without `up`, W's rows alternate gate and up (the MLP's merged gate/up) and the result is
    [M, N / 2] = gelu(y[:, 0::2]) * y[:, 1::2]; with `up` [M, N], gelu(y) * up."""
    y = w4_linear_reference(x, packed, scales)
    return gelu_tanh_mul_reference(y[:, 0::2], y[:, 1::2]) if up is None else gelu_tanh_mul_reference(y, up)


def w4_linear_residual_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                                 residual: "ResidualStep") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual step of :class:`ResidualStep` on y = x [M, K] @ W.T (rounded to x.dtype):
    (h_out, x_next), each [M, N]."""
    y = w4_linear_reference(x, packed, scales)
    return residual_rms_norm_reference(residual.h, y, residual.weight, residual.scalar, residual.next_weight, residual.eps)


def w4_logits_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0) -> torch.Tensor:
    """x [M, K] -> fp32 logits [M, N] = softcap * tanh((x @ W.T) / softcap)."""
    return _reference(x, packed, scales, softcap, torch.float32)


def w4_argmax_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0) -> torch.Tensor:
    """x [M, K] -> int64 [M]: torch.argmax of :func:`w4_logits_reference` (ties -> lowest index)."""
    return torch.argmax(w4_logits_reference(x, packed, scales, softcap), dim=-1)


def _check(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    n, kw = packed.shape
    if packed.dtype != torch.int32 or x.dim() != 2 or x.shape[1] != kw * 8 or tuple(scales.shape) != (n, kw // 4):
        raise ValueError(
            f"w4 linear needs x [M, K], packed int32 [N, K/8], scales [N, K/32] with K a multiple of 32; "
            f"got x {tuple(x.shape)}, packed {packed.dtype} {tuple(packed.shape)}, scales {tuple(scales.shape)}"
        )


# ----------------------------------------------------------------------------------------------
# Shared device helpers

@triton.jit
def nibble_f32(words, I: tl.constexpr):
    """Nibble I of int32 words (any shape) as the float code * 2^(4p - 149), exactly.

    The masked nibble, reinterpreted as float bits, is a subnormal: no integer-to-float
    conversion, one AND per value; p = I for nibbles 0..4 (read in place) and I - 5 for nibbles
    5..7 (read after one shift of the word by 20). code = level + 8.
    """
    P: tl.constexpr = I if I < 5 else I - 5
    w = words.to(tl.uint32, bitcast=True)
    w = w if I < 5 else w >> 20
    return (w & (15 << (4 * P))).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(E: tl.constexpr):
    """2^E as an fp32 constant (E in -126..127)."""
    return tl.full([], (127 + E) << 23, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _level(words, I: tl.constexpr):
    """Nibble I of int32 words as its fp32 level (-8..7), exactly."""
    P: tl.constexpr = I if I < 5 else I - 5
    return nibble_f32(words, I) * _pow2(100) * _pow2(49 - 4 * P) - 8.0


@triton.jit
def unpack_levels(words):
    """int32 words [R, W] -> fp32 levels [R, W, 8] (column 8j + i at [:, j, i]); the nibble dim
    is built with joins, so it stays in the registers of the thread that loaded the word."""
    even = tl.reshape(tl.join(tl.join(_level(words, 0), _level(words, 4)), tl.join(_level(words, 2), _level(words, 6))),
                      [words.shape[0], words.shape[1], 4])
    odd = tl.reshape(tl.join(tl.join(_level(words, 1), _level(words, 5)), tl.join(_level(words, 3), _level(words, 7))),
                     [words.shape[0], words.shape[1], 4])
    return tl.reshape(tl.join(even, odd), [words.shape[0], words.shape[1], 8])


@triton.jit
def _split_last(t, K: tl.constexpr):
    """t [A, T * K] -> the K tensors [A, T] of t viewed as [A, T, K] (K in {4, 8}), in order."""
    A: tl.constexpr = t.shape[0]
    T: tl.constexpr = t.shape[1] // K
    even, odd = tl.split(tl.reshape(t, [A, T, K // 2, 2]))
    if K == 4:
        t0, t2 = tl.split(even)
        t1, t3 = tl.split(odd)
        return t0, t1, t2, t3
    else:
        e0, e1 = tl.split(tl.reshape(even, [A, T, 2, 2]))
        o0, o1 = tl.split(tl.reshape(odd, [A, T, 2, 2]))
        t0, t4 = tl.split(e0)
        t2, t6 = tl.split(e1)
        t1, t5 = tl.split(o0)
        t3, t7 = tl.split(o1)
        return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _word_dot(word, xs, acc):
    """word [RR, T] int32, xs [BM, 8T] fp32 (the 8 columns of each word, times 2^(100 - 4p)),
    acc [BM, RR, T] -> acc + sum_i code_i * x_i * 2^-49: one AND and one FMA per product."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split_last(xs, 8)
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
def _softcap(z, cap):
    """cap * tanh(z / cap), elementwise in fp32."""
    y = z / cap
    t = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0, -th, th)


# ----------------------------------------------------------------------------------------------
# Decode GEMV


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
        word0, word1, word2, word3 = _split_last(words, 4)
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


# (RR, TR, BLOCK_G) per BLOCK_M; num_warps = TR * BLOCK_G / 32. A thread holds RR * BLOCK_M sums.
# One-warp tiles suit long rows split many ways; the wider ones cover a small matrix in fewer steps.
_ONE_ROW_TILES = [(8, 2, 16), (8, 1, 32), (4, 4, 8), (4, 4, 16), (2, 8, 16), (2, 4, 32)]
_MATVEC_TILES = {1: _ONE_ROW_TILES, 2: _ONE_ROW_TILES, 4: [(4, 2, 16), (2, 4, 8)]}
_SPLITS = (1, 2, 3, 4, 6, 8, 12)  # 3, 6 and 12 divide the 48 groups of a 1536-wide row and the 384 of down
TILING_KEYS = ("RR", "TR", "BLOCK_G", "SPLIT_K")  # what a GEMV tiling sets (num_warps follows)


def _matvec_configs():
    tiles = sorted({tile for tiles in _MATVEC_TILES.values() for tile in tiles})
    return [
        triton.Config({"RR": rr, "TR": tr, "BLOCK_G": bg, "SPLIT_K": split}, num_warps=tr * bg // 32, num_stages=1)
        for rr, tr, bg in tiles
        for split in _SPLITS
    ]


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _split_fits(n: int, m_blocks: int, block_m: int, block_n: int, split: int) -> bool:
    slots = triton.cdiv(n, block_n) * m_blocks
    return split == 1 or (slots <= _MAX_SLOTS and slots * split * block_m * block_n <= _MAX_PARTIALS)


def _prune_matvec(configs, named_args, **kwargs):
    """The tilings of BLOCK_M; per tiling the smallest split that launches at least 8 warps per
    SM (each split at least one step), else the largest that fits."""
    n, g, m = named_args["N"], named_args["G"], named_args["M"]
    block_m = kwargs["BLOCK_M"]
    m_blocks = triton.cdiv(m, block_m)
    target = 8 * _sm_count(named_args["x_ptr"].device)
    chosen = {}
    for cfg in configs:
        rr, tr, bg, split = (cfg.kwargs[key] for key in TILING_KEYS)
        key = (rr, tr, bg)
        if key not in _MATVEC_TILES[block_m]:
            continue
        warps = lambda c: triton.cdiv(n, rr * tr) * m_blocks * c.kwargs["SPLIT_K"] * c.num_warps
        if key in chosen and warps(chosen[key]) >= target:
            continue
        if (split == 1 or triton.cdiv(g, split) >= bg) and _split_fits(n, m_blocks, block_m, rr * tr, split):
            chosen[key] = cfg
    pruned = list(chosen.values())
    return [max(pruned, key=lambda c: c.kwargs["RR"] * c.kwargs["TR"])] if _interpreting() else pruned


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def flush_nbytes(device: int | torch.device) -> int:
    """Bytes the autotuner writes between timed runs to empty the L2: twice the L2 (at least 8
    MiB), where Triton's own timer writes 256 MB, which a capped 4 GB card has no room for."""
    return max(8 << 20, 2 * torch.cuda.get_device_properties(device).L2_cache_size)


def _bench(fn, quantiles, warmup_ms: float = 5.0, rep_ms: float = 25.0) -> list[float]:
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


_matvec_tuned = triton.autotune(
    configs=_matvec_configs(), key=["N", "G", "BLOCK_M", "EPILOGUE", "RESIDUAL"],
    prune_configs_by={"early_config_prune": _prune_matvec}, do_bench=_bench,
)(_matvec_kernel)


@functools.lru_cache(maxsize=None)
def _split_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device split-K ticket counters and the grid ticket of the residual step (last entry),
    zero between launches, and fp32 partials. GEMVs of one device must therefore run one at a
    time (one stream, as in a decode graph); the first call allocates them, so make it before a
    CUDA graph capture."""
    return (torch.zeros(_MAX_SLOTS + 1, dtype=torch.int32, device=device),
            torch.empty(_MAX_PARTIALS, dtype=torch.float32, device=device))


def _matvec_block_m(m: int) -> int:
    return min(triton.next_power_of_2(m), 4)


class ResidualStep(NamedTuple):
    """The residual step a linear layer's output y [M, D] feeds, as in
    :func:`qat4.ops.norms.residual_rms_norm_reference`: h_out = (h + RMSNorm_weight(y)) * scalar
    and x_next = RMSNorm_next_weight(h_out) (None without next_weight)."""

    h: torch.Tensor
    weight: torch.Tensor
    scalar: torch.Tensor | None = None
    next_weight: torch.Tensor | None = None
    eps: float = 1e-6


_pinned_tilings: dict[tuple, dict] = {}  # GEMV shape key -> tiling used instead of the autotuner's
_launched_tilings: dict[tuple, dict] = {}  # GEMV shape key -> tiling of its last launch (pinned or autotuned)


def matvec_tilings() -> dict[tuple, dict]:
    """The tiling of each GEMV shape launched since :func:`forget_matvec_tilings`: the pinned one,
    else the autotuner's pick (shapes whose caller fixes the tiling, the output layer, are left
    out). Keys are (N, K / 32, BLOCK_M, epilogue, residual, x dtype name); values map RR, TR,
    BLOCK_G and SPLIT_K to ints."""
    return dict(_launched_tilings)


def forget_matvec_tilings() -> None:
    """Start :func:`matvec_tilings` afresh (e.g. to list the shapes of one decode step)."""
    _launched_tilings.clear()


def pin_matvec_tilings(tilings: dict[tuple, dict]) -> None:
    """Launch these GEMV shapes with these tilings from now on (keys as :func:`matvec_tilings`),
    instead of the autotuner's picks; shapes not listed are unpinned."""
    _pinned_tilings.clear()
    _pinned_tilings.update({key: {k: int(tiling[k]) for k in TILING_KEYS} for key, tiling in tilings.items()})


def matvec_tiling_candidates(key: tuple, device: torch.device) -> list[dict]:
    """The tilings the autotuner would time for a GEMV shape key on `device`."""
    n, g, block_m = key[:3]
    pruned = _prune_matvec(_matvec_tuned.configs, {"N": n, "G": g, "M": block_m, "x_ptr": torch.empty(0, device=device)},
                           BLOCK_M=block_m)
    return [{k: c.kwargs[k] for k in TILING_KEYS} for c in pruned]


def _launch_matvec(x, packed, scales, out, *, idx=None, softcap=None, argmax=False, epilogue=PLAIN, up=None,
                   residual: ResidualStep | None = None, h_out=None, x_next=None, config=None):
    """One :func:`_matvec_kernel` launch (see its docstring for what each argument feeds). Without
    `config`, a pinned tiling (:func:`pin_matvec_tilings`) or else the autotuner's."""
    _check(x, packed, scales)
    if x.shape[0] > MAX_MATVEC_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_MATVEC_ROWS} rows of x, got {x.shape[0]}; use w4_matmul")
    x = x if x.stride(1) == 1 else x.contiguous()
    (m, _), (n, kw) = x.shape, packed.shape
    locks, partials = _split_scratch(x.device)
    block_m = _matvec_block_m(m)
    shape_key = (n, kw // 4, block_m, int(epilogue), residual is not None, str(x.dtype).removeprefix("torch."))
    if config is None and shape_key in _pinned_tilings:
        config = _launched_tilings[shape_key] = _pinned_tilings[shape_key]
    step = residual or ResidualStep(None, None)
    given = lambda t: out if t is None else t  # noqa: E731  (a pointer the kernel's flags leave unread)
    args = (x, packed.contiguous(), scales.contiguous(), out, given(idx), partials, locks, given(up),
            locks[_MAX_SLOTS:], given(step.h), given(step.weight),
            given(step.scalar), given(step.next_weight), given(h_out), given(x_next),
            m, n, kw // 4, x.stride(0), out.stride(0), 0 if up is None else up.stride(0), softcap, step.eps)
    flags = dict(BLOCK_M=block_m, SOFTCAP=softcap is not None, ARGMAX=argmax, EPILOGUE=int(epilogue),
                 RESIDUAL=residual is not None, HAS_S=step.scalar is not None, HAS_NEXT=step.next_weight is not None,
                 RES_BLOCK=triton.next_power_of_2(n) if residual is not None else 1, **pdl_launch(x, m))
    if config is None:
        grid = lambda meta: (triton.cdiv(n, meta["RR"] * meta["TR"]), meta["SPLIT_K"], triton.cdiv(m, block_m))
        _matvec_tuned[grid](*args, **flags)
        picked = getattr(_matvec_tuned, "best_config", None)
        if picked is not None:
            _launched_tilings[shape_key] = {k: picked.kwargs[k] for k in TILING_KEYS}
    else:
        tiling = {key: config[key] for key in TILING_KEYS}
        block_n = tiling["RR"] * tiling["TR"]
        if not _split_fits(n, triton.cdiv(m, block_m), block_m, block_n, tiling["SPLIT_K"]):
            raise ValueError(f"split-K scratch too small for {config} at N={n}")
        grid = (triton.cdiv(n, block_n), tiling["SPLIT_K"], triton.cdiv(m, block_m))
        _matvec_kernel[grid](*args, **flags, **tiling, num_warps=max(1, tiling["TR"] * tiling["BLOCK_G"] // 32))


def w4_matvec(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
              *, config: dict | None = None) -> torch.Tensor:
    """Decode GEMV: x [M, K] (M <= 16) @ W.T -> [M, N] in x.dtype, fp32 accumulation.

    Reads the packed words once and unpacks in registers. `out` [M, N] (x.dtype, unit column
    stride) may be given, e.g. a buffer of a captured CUDA graph. `config` pins RR, TR, BLOCK_G and
    SPLIT_K of :func:`_matvec_kernel` (num_warps = TR * BLOCK_G / 32) instead of autotuning.
    """
    if out is None:
        out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype, device=x.device)
    _launch_matvec(x, packed, scales, out, config=config)
    return out


def w4_matvec_gelu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, up: torch.Tensor | None = None,
                   *, config: dict | None = None) -> torch.Tensor:
    """Triton :func:`w4_linear_gelu_reference` for M <= 16: the gate applied in the GEMV's epilogue."""
    n = packed.shape[0]
    if up is None and (n % 2 or (config and config["RR"] * config["TR"] % 2)):
        raise ValueError(f"GELU row pairs need an even row count per matrix and per tile, got N={n}, {config}")
    out = torch.empty(x.shape[0], n if up is not None else n // 2, dtype=x.dtype, device=x.device)
    _launch_matvec(x, packed, scales, out, epilogue=GELU_PAIRS if up is None else GELU_UP, up=_unit_columns(up),
                   config=config)
    return out


def w4_matvec_residual(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, residual: ResidualStep,
                       *, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton :func:`w4_linear_residual_reference` for M <= 16: the program that stores the GEMV's
    last rows runs the residual step, so y never leaves for another launch."""
    m, d = x.shape[0], packed.shape[0]
    if tuple(residual.h.shape) != (m, d):
        raise ValueError(f"the residual stream must be [{m}, {d}], got {tuple(residual.h.shape)}")
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(y)
    x_next = None if residual.next_weight is None else torch.empty_like(y)
    _launch_matvec(x, packed, scales, y, residual=residual._replace(h=residual.h.contiguous()), h_out=h_out,
                   x_next=x_next, config=config)
    return h_out, x_next


def _unit_columns(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------
# Output layer


def _output_config(m: int) -> dict:
    """The output layer's fixed tiling: no split, 16 groups per step. Every row of the logits is
    then summed in one order whatever the rows per thread, so w4_argmax equals
    torch.argmax(w4_logits) bit for bit."""
    return {"RR": 8 if _matvec_block_m(m) <= 2 else 4, "TR": 2, "BLOCK_G": 16, "SPLIT_K": 1}


@triton.jit
def _argmax_reduce_kernel(pmax_ptr, pidx_ptr, out_ptr, NB, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Per row m of pmax/pidx [M, NB] (block maxima, their first columns): out[m] = int64 column
    of the first overall maximum. Grid: (M,)."""
    wait_for_previous_kernel(USE_PDL)
    m = tl.program_id(0)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for b0 in range(0, NB, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        vals = tl.load(pmax_ptr + m * NB + offs, mask=offs < NB, other=float("-inf"))
        top = tl.max(vals, axis=0)
        where = tl.load(pidx_ptr + m * NB + b0 + tl.argmax(vals, axis=0, tie_break_left=True))
        better = top > best
        best_idx = tl.where(better, where, best_idx)
        best = tl.where(better, top, best)
    tl.store(out_ptr + m, best_idx.to(tl.int64))


def w4_logits_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                     *, config: dict | None = None) -> torch.Tensor:
    """Triton :func:`w4_logits_reference`: the GEMV with the softcap in its epilogue (M <= 16)."""
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32, device=x.device)
    _launch_matvec(x, packed, scales, out, softcap=None if softcap is None else float(softcap),
                   config=config or _output_config(x.shape[0]))
    return out


def w4_argmax_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                     *, config: dict | None = None) -> torch.Tensor:
    """Triton :func:`w4_argmax_reference` (M <= 16): the softcapped GEMV keeps one (max, first
    column) per block of rows instead of the logits, then :func:`_argmax_reduce_kernel` picks the
    first maximum per row of x."""
    m = x.shape[0]
    config = config or _output_config(m)
    n_blocks = triton.cdiv(packed.shape[0], config["RR"] * config["TR"])
    pmax = torch.empty(m, n_blocks, dtype=torch.float32, device=x.device)
    pidx = torch.empty(m, n_blocks, dtype=torch.int32, device=x.device)
    _launch_matvec(x, packed, scales, pmax, idx=pidx, softcap=None if softcap is None else float(softcap), argmax=True,
                   config=config)
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    block = min(16384, triton.next_power_of_2(n_blocks))
    _argmax_reduce_kernel[(m,)](pmax, pidx, out, n_blocks, BLOCK=block, num_warps=16 if block >= 8192 else 4,
                                **pdl_launch(x, m))
    return out


# ----------------------------------------------------------------------------------------------
# Prefill GEMM


@triton.jit(do_not_specialize=["M", "M_BIN"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, u_ptr, M, N, G, stride_xm, stride_om, stride_um, M_BIN,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, EPILOGUE: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W.T for large M; K = 32 * G.

    x [M, K] (row stride stride_xm, columns contiguous), W words [N, 4G], scales [N, G].
    EPILOGUE as in :func:`_matvec_kernel`: PLAIN, GELU_PAIRS (out [M, N / 2]) or GELU_UP (U [M, N],
    row stride stride_um).
    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), tiles ordered in bands of GROUP_M row blocks for
    L2 reuse. Per step of BLOCK_G groups the [BLOCK_N, 32 * BLOCK_G] weight tile is unpacked and
    scaled in registers and fed to tl.dot: in x.dtype (bf16 / fp16 tensor cores), or with
    DOT_F32 in fp32 without tensor cores. M_BIN only keys the autotuner.
    """
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * grid_n
    first_m = (pid // band) * GROUP_M
    band_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % band_m
    pid_n = (pid % band) // band_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kx = tl.arange(0, 32 * BLOCK_G)
    kk = tl.arange(0, 4 * BLOCK_G)
    gs = tl.arange(0, BLOCK_G)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (32 * g0 + kx)[None, :],
                     mask=(rm < M)[:, None] & ((g0 + kx // 32) < G)[None, :], other=0.0)
        words = tl.load(w_ptr + rn[:, None] * (4 * G) + (4 * g0 + kk)[None, :],
                        mask=(rn < N)[:, None] & ((g0 + kk // 4) < G)[None, :], other=0)
        s = tl.load(s_ptr + rn[:, None] * G + (g0 + gs)[None, :],
                    mask=(rn < N)[:, None] & ((g0 + gs) < G)[None, :], other=0.0).to(tl.float32)
        w = tl.reshape(unpack_levels(words), [BLOCK_N, BLOCK_G, 32]) * s[:, :, None]
        w = tl.trans(tl.reshape(w, [BLOCK_N, 32 * BLOCK_G]))
        if DOT_F32:
            acc = tl.dot(xt.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w.to(xt.dtype), acc)
    store_tile(acc, rm, rn, pid_n, M, N, out_ptr, u_ptr, stride_om, stride_um, EPILOGUE)


@triton.jit
def store_tile(y, rm, rn, pid_n, M, N, out_ptr, u_ptr, stride_om, stride_um, EPILOGUE: tl.constexpr):
    """Store the fp32 tile y [BM, BN] of out (rows rm of x, columns rn = pid_n * BN + ...) in
    out's dtype per EPILOGUE: PLAIN; GELU_PAIRS (columns alternate gate and up; out [M, N / 2]);
    GELU_UP (times U [M, N], row stride stride_um). The prefill GEMM's and the decode-batch
    kernel's epilogue."""
    BM: tl.constexpr = y.shape[0]
    BN: tl.constexpr = y.shape[1]
    dt: tl.constexpr = out_ptr.dtype.element_ty
    if EPILOGUE == GELU_PAIRS:
        gate, up = tl.split(tl.reshape(y.to(dt).to(tl.float32), [BM, BN // 2, 2]))
        cols = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        mask = (rm < M)[:, None] & (cols < N // 2)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + cols[None, :], gelu_tanh_gate(gate, up, dt), mask=mask)
    else:
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if EPILOGUE == GELU_UP:
            up = tl.load(u_ptr + rm[:, None] * stride_um + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            y = gelu_tanh_gate(y.to(dt).to(tl.float32), up, dt)
        else:
            y = y.to(dt)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y, mask=mask)


def _matmul_configs():
    tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_G, num_warps, num_stages)
        (128, 128, 2, 8, 3), (128, 64, 2, 4, 3), (64, 128, 2, 4, 3), (64, 64, 2, 4, 4), (32, 64, 1, 4, 2),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_G": bg, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bg, w, s in tiles
    ]


def _prune_matmul(configs, named_args, **kwargs):
    """Drop tiles taller than the (binned) row count; the fp32 path keeps the small tiles."""
    m_bin = named_args["M_BIN"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= max(32, m_bin)]
    if kwargs["DOT_F32"]:
        keep = [c for c in keep if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    return keep[-1:] if _interpreting() else keep


_matmul_tuned = triton.autotune(
    configs=_matmul_configs(), key=["M_BIN", "N", "G", "DOT_F32", "EPILOGUE"], prune_configs_by={"early_config_prune": _prune_matmul},
    do_bench=_bench,
)(_matmul_kernel)


@functools.lru_cache(maxsize=None)
def _has_tensor_cores(device: torch.device, dtype: torch.dtype) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    if major < 7 or (dtype == torch.bfloat16 and major < 8):
        return False
    return "GTX 16" not in torch.cuda.get_device_name(device)  # TU116/TU117: Turing without tensor cores


def prefill_uses_fp32(x: torch.Tensor, fp32: bool | None = None) -> bool:
    """Whether :func:`w4_matmul` multiplies in fp32 (no tensor cores) for this x.

    `fp32` forces it either way; otherwise ``QAT4_PREFILL_FP32=1``, fp32 activations, or a CUDA
    device without usable tensor cores for x.dtype (pre-Volta, GTX 16xx, bf16 before sm_80).
    """
    if fp32 is not None:
        return fp32
    if os.environ.get("QAT4_PREFILL_FP32", "0") == "1" or x.dtype == torch.float32:
        return True
    return x.is_cuda and not _has_tensor_cores(x.device, x.dtype)


def w4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fp32: bool | None = None,
              *, gelu: bool = False, up: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Prefill GEMM: x [M, K] @ W.T -> [M, N] in x.dtype, fp32 accumulation.

    Tensor cores in x.dtype (bf16/fp16) unless :func:`prefill_uses_fp32`. With `gelu`, the
    GELU gate of :func:`w4_linear_gelu_reference` runs in the epilogue (rows of W as gate/up pairs,
    or times `up` [M, N] when given). `config` pins BLOCK_M, BLOCK_N, BLOCK_G (and num_warps,
    num_stages) instead of autotuning. Launch: :func:`_matmul_kernel`.
    """
    _check(x, packed, scales)
    x = x if x.stride(1) == 1 else x.contiguous()
    up = _unit_columns(up)
    (m, _), (n, kw) = x.shape, packed.shape
    epilogue = PLAIN if not gelu else GELU_PAIRS if up is None else GELU_UP
    out = torch.empty(m, n // 2 if epilogue == GELU_PAIRS else n, dtype=x.dtype, device=x.device)
    args = (x, packed.contiguous(), scales.contiguous(), out, out if up is None else up, m, n, kw // 4,
            x.stride(0), out.stride(0), 0 if up is None else up.stride(0), min(triton.next_power_of_2(m), 256))
    flags = dict(DOT_F32=prefill_uses_fp32(x, fp32), EPILOGUE=int(epilogue))
    if config is None:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _matmul_tuned[grid](*args, **flags)
    else:
        tiling = {key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_G")}
        grid = (triton.cdiv(m, tiling["BLOCK_M"]) * triton.cdiv(n, tiling["BLOCK_N"]),)
        _matmul_kernel[grid](*args, **tiling, GROUP_M=8, **flags,
                             num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))
    return out
