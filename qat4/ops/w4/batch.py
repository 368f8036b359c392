"""Packed int4 x 16-bit matrix products on tensor cores for decode batches (2..128 rows of x).

A continuous-batching decode step multiplies a few dozen rows of activations by every weight
matrix. The GEMV of :mod:`qat4.ops.w4.gemv` pays the unpacking and one FMA per weight *per
row* on CUDA cores, and the prefill GEMM's tiles are built for thousands of rows and do not split
K; this kernel unpacks every weight once per program, multiplies on tensor cores and splits K
until the GPU is full, so that it streams the weights near bandwidth from 2 to 128 rows.

Layout as in :mod:`qat4.ops.w4`: W [N, K], K a multiple of 32, ``packed`` int32 [N, K/8]
(column ``8j + i`` in bits ``4i..4i+3`` of word ``j`` as the code ``level + 8``), ``scales``
fp16/bf16 [N, K/32]; ``y = x @ W.T`` with fp32 accumulation; W never exists in 16 bits in memory.

Entry points (each checked against the reference of :mod:`qat4.ops.w4.reference` named beside it):

- :func:`w4_batch_linear` (:func:`~qat4.ops.w4.reference.w4_linear_reference`): out [M, N] in x.dtype.
- :func:`w4_batch_linear_gelu` (:func:`~qat4.ops.w4.reference.w4_linear_gelu_reference`): the MLP's
  gate/up with alternating rows, out [M, N/2]; or gelu(y) * up, out [M, N].
- :func:`w4_batch_logits` (:func:`~qat4.ops.w4.reference.w4_logits_reference`): fp32 logits
  ``cap * tanh(y / cap)``; :func:`w4_batch_argmax`
  (:func:`~qat4.ops.w4.reference.w4_argmax_reference`): the first maximum of those logits per
  row, without writing them.

Kernel (:func:`_batch_kernel`)
------------------------------

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K)``. Program (m, n, k) owns rows
``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of W, rows ``[m * BLOCK_M, (m + 1) * BLOCK_M)`` of x (all of
them for M <= 128) and the k-th of SPLIT_K slices of K (a whole number of steps each). A step
covers BLOCK_G groups, BLOCK_K = 32 * BLOCK_G columns::

    words [BLOCK_N, 4 * BLOCK_G] int32 ----- 8 nibble planes -----> W_i [BLOCK_N, 4 * BLOCK_G] x.dtype
    x tile [BLOCK_M, BLOCK_K] ------------- 8 column planes ------> x_i [BLOCK_M, 4 * BLOCK_G]
    acc [BLOCK_N, BLOCK_M] fp32 += W_i @ x_i^T   (i = 0..7, eight tl.dot per step)

- *Swapped orientation*: ``acc = W @ x^T``, so the large weight dimension is the MMA's M side
  (64 rows per warpgroup on Hopper) and the few rows of x its N side (16 and up), instead of
  padding 2..16 rows of x up to an M side of 64. It also makes the unpacked weights the dot's
  *left* operand, which Hopper's wgmma (and mma.sync) read from registers: the unpacked tile is
  never written to shared memory; only the small x tile is.
- *Nibble planes instead of interleaving*: plane i holds nibble i of every word, W_i[:, j] =
  W[:, 8j + i]; x is split the same way (x_i[:, j] = x[:, 8j + i], register splits of a
  contiguous load), and a dot over K does not care in which order K comes. Each plane is an
  elementwise function of the loaded words, so no join/reshape moves unpacked values between
  threads (the prefill GEMM's interleaving ``unpack_levels`` does) and the compiler may load the
  words straight into the dot operand's layout.
- *Unpacking*, two routes to the same weights. With 16-bit x and steps of the same dtype on a GPU
  (:func:`unpacks_pairs`) and PAIR_UNPACK in the tiling (where the table's rule measured it faster,
  :mod:`qat4.ops.w4.batch_tiling`), two weights per instruction in x.dtype (:func:`_nibble_pairs`): a PRMT
  puts the same byte of two words into the halves of a register, a LOP3 ORs the exponent of 128
  (bf16) or 1024 (fp16) over one nibble in each half, and two packed fmas subtract magic + 8
  (exact) and multiply by the steps (rounded once): 2 instructions per weight, and the loop of a
  step shrinks from 353-896 to 227-638 instructions per thread at the table's tiles (Triton 3.6,
  sm_90a, `tools/kernel_sass.py` with and without ``--fp32-unpack``). Otherwise in fp32
  (:func:`_nibble_times_step`): a nibble at bits 4p..4p+3 (p in 2..4) ANDed out and
  ORed under the exponent of 2^(23 - 4p) reads as the float 2^(23 - 4p) + code, so
  ``fma(f, s, -(2^(23 - 4p) + 8) * s)`` is (code - 8) * s = W exactly (one rounding of an exact
  result; the bias product has at most 24 significant bits). Per weight one AND+OR (a LOP3), one
  FMA and half a conversion to x.dtype; per word two shifts (nibbles 0, 1 and 5..7 are moved to
  p in 2..4) and the three bias products. Each weight is rounded to x.dtype once, as in the
  prefill GEMM; fp32 x multiplies in fp32 (``input_precision="ieee"``).
- *Loads*: the words of a row are contiguous along K, 16 bytes per thread (K a multiple of 128
  keeps every row 16-byte aligned); the steps of a row's BLOCK_G groups are one contiguous load,
  broadcast to their 4 words each in registers.
- *Loads and pipelining* (PREFETCH, num_stages): by default (PREFETCH=0, num_stages=1) a step's
  words and steps are loaded in the loop iteration that unpacks them. Triton then moves the
  *packed* words (4 bytes per 8 weights) and their steps into the MMA operand's register layout
  through shared memory, and the unpacking runs in that layout; otherwise it moves the unpacked
  16-bit planes (2 bytes per weight, stored and loaded again: at the HBM rate about all the
  shared-memory bandwidth an SM has). In Triton 3.6's sm_90a output the conversion reaches the
  packed words only when they are loaded in the same iteration and not pipelined by num_stages,
  so latency is hidden by the 1-4 programs each SM holds (64-190 registers per thread at the
  default tiles) and by splitting K until they hold 32 KiB of weights in flight per SM, rather
  than by buffering inside a program. The first step is peeled so that its
  weights are loaded before the PDL wait (weights are never written by an earlier kernel).
  PREFETCH=1 or 2 instead keeps that many steps of words in flight in registers (8 weights per
  register; the first ones loaded before the PDL wait too), and num_stages > 1 lets Triton
  pipeline the loads through shared memory; both pay the conversion of the unpacked planes, and
  both are in :func:`~qat4.ops.w4.batch_tiling.batch_tiling_candidates` for the GPU to decide.
  A Gluon kernel that loaded the words straight in the wgmma operand's layout and held one or two
  later steps of them in registers matched the reference but took 1,505 against 1,379 µs for a
  4-row step's products on an H200 at best (BENCHMARKS.md, 2026-12-03).
- *L2 prefetch* (L2_PREFETCH; :func:`~qat4.ops.w4.common.prefetches_l2` turns it off with
  ``QAT4_L2_PREFETCH=0``): before its PDL wait a program asks L2 for its whole slice of W
  (:func:`~qat4.ops.w4.common.prefetch_slice`, ``prefetch.global.L2``: no register holds what is
  in flight), so its steps' loads (with PREFETCH=0 each issued in the iteration that unpacks it)
  find the words in L2 instead of each paying a trip to memory. The table asks for it where it
  was timed faster: 64-row programs of 3 steps or more (:mod:`qat4.ops.w4.batch_tiling`).
- *One dot per step* (ONE_DOT): the eight planes interleaved back into column order with joins
  (which keep each value in the thread that unpacked it) and one dot of K = 32 * BLOCK_G with the
  x tile as loaded, instead of eight dots of K = 4 * BLOCK_G on the eight column planes of x.
  Compiled offline for sm_90a by Triton 3.6 (`tools/kernel_sass.py --fp32-unpack`), the eight dots are eight
  wgmma launches each behind its own store of an x plane to shared memory, fence and wait (16
  warpgroup arrive/waits, 8 fences per step), and one dot is one launch and one wait; the loop
  shrinks from 353-393 to 312-321 instructions per thread and step at the table's tiles, while the
  unpacked tile now goes through shared memory (37-49 KiB per program instead of 8-33) and 16-row
  tiles take up to 92 registers instead of 69. Timed on an H200, one dot is slower wherever a
  program has several steps and faster where K is a single step (1,536 x 256), where the table
  takes it (:mod:`qat4.ops.w4.batch_tiling`); :func:`~qat4.ops.w4.batch_tiling.batch_tiling_candidates`
  times both. The sums are the same products added in another order, so the two differ by fp32
  rounding.
- *Split-K*: with SPLIT_K > 1 each program stores its fp32 partial [BLOCK_N, BLOCK_M] to a
  per-device scratch and takes a ticket from its tile's counter (acq_rel); the last program of
  the tile adds the partials in split order and runs the epilogue, then resets the counter, as
  :func:`~qat4.ops.w4.gemv._matvec_kernel` does: one launch, deterministic whatever order the
  programs finish in.
- *Epilogues* (constexpr): PLAIN (out [M, N] in x.dtype), GELU_PAIRS and GELU_UP (the rounding
  points of ``w4_linear_gelu_reference``: y to x.dtype, ``gelu_tanh_gate``), SOFTCAP (fp32,
  ``_softcap``), ARGMAX (per row of x and block of W the softcapped maximum and its first column,
  then :func:`~qat4.ops.w4.common.argmax_reduce_kernel`).

Tilings come from a fixed table and a split rule, :mod:`qat4.ops.w4.batch_tiling`; ``config=``
pins any of their keys.
"""

import functools
import os

import torch

from qat4.ops._triton import tl, triton
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel
from qat4.ops.w4.common import (
    GELU_PAIRS, GELU_UP, PLAIN, _softcap, argmax_reduce_kernel, interpreting, prefetch_slice, prefetches_l2, split_last,
    store_tile, unit_columns,
)
from qat4.ops.w4.batch_tiling import BATCH_PARTIALS, BATCH_SLOTS, resolve_tiling
from qat4.ops.w4.reference import check, check_gelu


# ----------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _nibble_times_step(src, P: tl.constexpr, step, bias):
    """(code - 8) * step for the nibble at bits 4P..4P+3 of uint32 src (P in 2..4), exactly, in
    fp32: the nibble ORed under the exponent of 2^(23 - 4P) reads as 2^(23 - 4P) + code, and
    bias = -(2^(23 - 4P) + 8) * step (exact: at most 13 + 11 significant bits)."""
    f = ((src & (15 << (4 * P))) | ((150 - 4 * P) << 23)).to(tl.float32, bitcast=True)
    return tl.fma(f, step, bias)


def _pairs_asm(magic: int, one: int, minus_magic_8: int, fma: str) -> str:
    """PTX of :func:`_nibble_pairs` for one 16-bit type, by its bit patterns: ``magic`` (the
    exponent under which a nibble in the low mantissa bits reads as magic + code), 1.0 and
    -(magic + 8), each twice in a 32-bit register, and its packed fma instruction."""
    body = [".reg .b32 t0, t1, t2, t3, v, one, bias, zero;",
            f"mov.b32 one, {one:#x};", f"mov.b32 bias, {minus_magic_8:#x};", "mov.b32 zero, 0x80008000;"]
    for byte in range(4):  # t: that byte of word 0 in both bytes of the low half, of word 1 in the high half
        body.append(f"prmt.b32 t{byte}, $8, $9, {(0x4400 + 0x1111 * byte):#x};")
    for nibble in range(8):
        t = f"t{nibble // 2}"
        if nibble % 2:
            body.append(f"shr.b32 {t}, {t}, 4;")
        body += [f"lop3.b32 v, {t}, 0x000f000f, {magic:#x}, 0xea;",  # (t & 0x000f000f) | magic
                 f"{fma} v, v, one, bias;",  # code - 8, exactly
                 f"{fma} ${nibble}, v, $10, zero;"]  # (code - 8) * step, rounded once
    return "{\n" + "\n".join(body) + "\n}"


_PAIR_UNPACK_BF16 = tl.constexpr(_pairs_asm(0x43004300, 0x3F803F80, 0xC308C308, "fma.rn.bf16x2"))  # magic 128
_PAIR_UNPACK_FP16 = tl.constexpr(_pairs_asm(0x64006400, 0x3C003C00, 0xE408E408, "fma.rn.f16x2"))  # magic 1024


@triton.jit
def _nibble_pairs(words, steps):
    """The eight nibble planes of int32 words [BN, T] times their steps [BN, T] (fp16 or bf16),
    in the steps' dtype: plane i is (nibble i - 8) * step, rounded once to that dtype, as
    :func:`_nibble_times_step` then a conversion would give (except that a zero weight may be -0,
    which leaves every sum as it is). Two words per instruction: a PRMT
    puts the same byte of both words into the two 16-bit halves of a register, a LOP3 masks a
    nibble in each half and ORs the exponent of ``magic`` (2^7 in bf16, 2^10 in fp16, whose unit
    in the last place is 1) over it, so each half reads as magic + code; one packed fma subtracts
    magic + 8 (exact), another multiplies by the steps. Per 16 weights 4 PRMT, 4 shifts, 8 LOP3
    and 16 packed fma, where the fp32 route pays a LOP3, an FMA and half a conversion per weight.
    sm_80 or later (packed bf16 fma); not in the interpreter."""
    dt = steps.dtype
    if dt == tl.bfloat16:
        asm: tl.constexpr = _PAIR_UNPACK_BF16
    else:
        asm: tl.constexpr = _PAIR_UNPACK_FP16
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, steps],
                                     dtype=(dt, dt, dt, dt, dt, dt, dt, dt), is_pure=True, pack=2)


@triton.jit
def _plane_dot(w, xi, acc, DOT_F32: tl.constexpr):
    """acc [BN, BM] + w [BN, T] @ xi [BM, T]^T, w (weights in fp32 or already in xi.dtype) in xi.dtype: on
    tensor cores in xi.dtype, or with DOT_F32 in fp32 (fp32 x; bf16 under the interpreter, whose
    dot cannot take bf16, on the same rounded values)."""
    w = w.to(xi.dtype)
    if DOT_F32:
        acc = tl.dot(w.to(tl.float32), tl.trans(xi.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(xi), acc)
    return acc


@triton.jit
def _interleaved_dot(n0, n1, n2, n3, n4, n5, n6, n7, xt, acc, DOT_F32: tl.constexpr):
    """acc [BN, BM] + W @ xt^T with W [BN, 8T] the nibble planes n0..n7 [BN, T] (x.dtype)
    interleaved back into column order by joins (which keep each value in the thread that
    unpacked it): one dot with the x tile [BM, 8T] as loaded (ONE_DOT)."""
    BN: tl.constexpr = n0.shape[0]
    T: tl.constexpr = n0.shape[1]
    even = tl.reshape(tl.join(tl.join(n0, n4), tl.join(n2, n6)), [BN, T, 4])  # columns 8j + 0, 2, 4, 6
    odd = tl.reshape(tl.join(tl.join(n1, n5), tl.join(n3, n7)), [BN, T, 4])
    return _plane_dot(tl.reshape(tl.join(even, odd), [BN, 8 * T]), xt, acc, DOT_F32)


@triton.jit
def _tile_dot(words, steps, xt, acc, DOT_F32: tl.constexpr, ONE_DOT: tl.constexpr, PAIR_UNPACK: tl.constexpr):
    """acc [BN, BM] + W_tile @ xt^T for words [BN, T] int32 (T = 4 * BLOCK_G), the steps of their
    groups [BN, T / 4] and xt [BM, 8T] (the tile's columns in order). Eight dots, one per nibble
    plane (plane i is column 8j + i of word j, matched by the i-th column of each 8 of xt), in
    order of bit position so that each fp32 bias tensor dies early (130 rather than 160 registers
    at 64 x 256); the fp32 route computes each plane where its dot takes it (all eight computed
    first took 254 instead of 210 registers at 64 x 64 x 8 groups, Triton 3.6 sm_90a), so the two
    routes keep their own dot sequences. With ONE_DOT the planes are interleaved back into column
    order and one dot takes xt as loaded. PAIR_UNPACK unpacks in x.dtype two weights per
    instruction (:func:`_nibble_pairs`; steps in x.dtype), else each weight in fp32
    (:func:`_nibble_times_step`): the same weights, the same dots in the same order."""
    BN: tl.constexpr = words.shape[0]
    T: tl.constexpr = words.shape[1]
    dt = xt.dtype
    if PAIR_UNPACK:
        s = tl.reshape(tl.broadcast_to(steps[:, :, None], [BN, T // 4, 4]), [BN, T])
        n0, n1, n2, n3, n4, n5, n6, n7 = _nibble_pairs(words, s)
        if ONE_DOT:
            acc = _interleaved_dot(n0, n1, n2, n3, n4, n5, n6, n7, xt, acc, DOT_F32)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = split_last(xt, 8)
            acc = _plane_dot(n0, x0, acc, DOT_F32)
            acc = _plane_dot(n2, x2, acc, DOT_F32)
            acc = _plane_dot(n5, x5, acc, DOT_F32)
            acc = _plane_dot(n1, x1, acc, DOT_F32)
            acc = _plane_dot(n3, x3, acc, DOT_F32)
            acc = _plane_dot(n6, x6, acc, DOT_F32)
            acc = _plane_dot(n4, x4, acc, DOT_F32)
            acc = _plane_dot(n7, x7, acc, DOT_F32)
        return acc
    s = tl.reshape(tl.broadcast_to(steps.to(tl.float32)[:, :, None], [BN, T // 4, 4]), [BN, T])
    b2 = s * -32776.0  # -(2^15 + 8) * s
    b3 = s * -2056.0  # -(2^11 + 8) * s
    b4 = s * -136.0  # -(2^7 + 8) * s
    w = words.to(tl.uint32, bitcast=True)
    lo = w << 8  # nibbles 0, 1 at bits 8..15
    hi = w >> 12  # nibbles 5, 6, 7 at bits 8..19
    if ONE_DOT:
        n0, n1 = _nibble_times_step(lo, 2, s, b2).to(dt), _nibble_times_step(lo, 3, s, b3).to(dt)
        n2, n3 = _nibble_times_step(w, 2, s, b2).to(dt), _nibble_times_step(w, 3, s, b3).to(dt)
        n4, n5 = _nibble_times_step(w, 4, s, b4).to(dt), _nibble_times_step(hi, 2, s, b2).to(dt)
        n6, n7 = _nibble_times_step(hi, 3, s, b3).to(dt), _nibble_times_step(hi, 4, s, b4).to(dt)
        acc = _interleaved_dot(n0, n1, n2, n3, n4, n5, n6, n7, xt, acc, DOT_F32)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = split_last(xt, 8)
        acc = _plane_dot(_nibble_times_step(lo, 2, s, b2), x0, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(w, 2, s, b2), x2, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(hi, 2, s, b2), x5, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(lo, 3, s, b3), x1, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(w, 3, s, b3), x3, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(hi, 3, s, b3), x6, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(w, 4, s, b4), x4, acc, DOT_F32)
        acc = _plane_dot(_nibble_times_step(hi, 4, s, b4), x7, acc, DOT_F32)
    return acc


@triton.jit
def _tile_loads(w_ptr, s_ptr, w_off, s_off, rows_ok, kw, g0, g_end, EVEN: tl.constexpr):
    """The step at group g0: words [BN, T] int32 and the groups' steps [BN, T / 4]. Zeros (nothing
    read) once g0 >= g_end, the prefetches past a slice's end; masked at rows >= N and groups >=
    g_end unless EVEN (then every step is whole)."""
    if EVEN:
        live = (g0 + 0 * kw < g_end)[None, :]  # one predicate for the whole tile
        words = tl.load(w_ptr + w_off + 4 * g0, mask=live, other=0)
        steps = tl.load(s_ptr + s_off + g0, mask=(g0 + 0 * tl.arange(0, kw.shape[0] // 4) < g_end)[None, :], other=0.0)
    else:
        words = tl.load(w_ptr + w_off + 4 * g0, mask=rows_ok & ((g0 + kw // 4) < g_end)[None, :], other=0)
        steps = tl.load(s_ptr + s_off + g0, mask=rows_ok & ((g0 + tl.arange(0, kw.shape[0] // 4)) < g_end)[None, :],
                        other=0.0)
    return words, steps


@triton.jit
def _x_tile(x_ptr, x_off, x_rows_ok, kx, g0, g_end, EVEN: tl.constexpr):
    """The x tile [BM, 32 * BLOCK_G] at group g0 (zeros past g_end unless EVEN, rows >= M)."""
    if EVEN:
        xt = tl.load(x_ptr + x_off + 32 * g0, mask=x_rows_ok, other=0.0)
    else:
        xt = tl.load(x_ptr + x_off + 32 * g0, mask=x_rows_ok & ((g0 + kx // 32) < g_end)[None, :], other=0.0)
    return xt


@triton.jit
def _batch_epilogue(acc, rm, rn, pid_n, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks, softcap,
                    SOFTCAP: tl.constexpr, ARGMAX: tl.constexpr, EPILOGUE: tl.constexpr):
    """Finish the fp32 sums acc [BN, BM] of W rows rn and x rows rm (see :func:`_batch_kernel`)."""
    y = tl.trans(acc)  # [BM, BN]: rows of x, then columns of out
    BN: tl.constexpr = y.shape[1]
    if SOFTCAP:
        y = _softcap(y, softcap)
    if ARGMAX:
        vals = tl.where((rn < N)[None, :], y, float("-inf"))
        tl.store(out_ptr + rm * n_blocks + pid_n, tl.max(vals, axis=1), mask=rm < M)
        tl.store(idx_ptr + rm * n_blocks + pid_n, pid_n * BN + tl.argmax(vals, axis=1, tie_break_left=True),
                 mask=rm < M)
    else:
        store_tile(y, rm, rn, pid_n, M, N, out_ptr, u_ptr, stride_om, stride_um, EPILOGUE)


@triton.heuristics({"EVEN": lambda a: a["N"] % a["BLOCK_N"] == 0 and a["G"] % (a["BLOCK_G"] * a["SPLIT_K"]) == 0})
@triton.jit(do_not_specialize=["M"])
def _batch_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, idx_ptr, u_ptr, part_ptr, lock_ptr,
    M, N, G, stride_xm, stride_om, stride_um, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, ONE_DOT: tl.constexpr, EPILOGUE: tl.constexpr, SOFTCAP: tl.constexpr,
    ARGMAX: tl.constexpr, DOT_F32: tl.constexpr, PAIR_UNPACK: tl.constexpr, L2_PREFETCH: tl.constexpr,
    EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out = epilogue(x [M, K] @ W.T) for a few rows of x; K = 32 * G.

    x [M, K] (row stride stride_xm, unit column stride), W words [N, 4G] int32, scales [N, G].
    EPILOGUE: PLAIN stores y to out [M, N] (out's dtype); GELU_PAIRS (rows of W alternate gate and
    up) stores gelu_tanh(y[:, 2j]) * y[:, 2j + 1] to out [M, N / 2]; GELU_UP stores gelu_tanh(y)
    * U to out [M, N] (U row stride stride_um). SOFTCAP applies softcap * tanh(y / softcap) first
    (then out is fp32). ARGMAX stores, instead of y, each block's maximum to out [M, n_blocks] fp32
    and its first column to idx [M, n_blocks] int32.
    Grid: (cdiv(M, BLOCK_M), n_blocks = cdiv(N, BLOCK_N), SPLIT_K). Program (m, n, k) sums over
    the groups [k * S, (k + 1) * S), S = BLOCK_G * cdiv(cdiv(G, SPLIT_K), BLOCK_G), in steps of
    BLOCK_G groups (:func:`_tile_dot`, eight dots or with ONE_DOT one): PREFETCH = 0 loads each
    step's weights in that step (the
    first step peeled), PREFETCH = 1 or 2 that many steps ahead; either way the first weights are
    loaded before waiting for the kernel that wrote x (USE_PDL), and with L2_PREFETCH the program's
    whole slice of W is asked of L2 there too (:func:`prefetch_slice`). EVEN (N a multiple of BLOCK_N, G of
    BLOCK_G * SPLIT_K) drops the row and group masks of the weights. With SPLIT_K > 1 the partial
    goes to part[slot, k] (slot = n * cdiv(M, BLOCK_M) + m); a ticket from lock[slot] elects the
    last program, which adds the partials in split order, runs the epilogue and resets the ticket.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n_blocks = tl.num_programs(1)
    T: tl.constexpr = 4 * BLOCK_G
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kw = tl.arange(0, T)
    kx = tl.arange(0, 8 * T)
    per_split = tl.cdiv(tl.cdiv(G, SPLIT_K), BLOCK_G) * BLOCK_G
    g_begin = pid_k * per_split
    g_end = tl.minimum(G, g_begin + per_split)
    w_off = rn[:, None] * (4 * G) + kw[None, :]
    s_off = rn[:, None] * G + tl.arange(0, BLOCK_G)[None, :]
    x_off = rm[:, None] * stride_xm + kx[None, :]
    rows_ok = (rn < N)[:, None]
    x_rows_ok = (rm < M)[:, None]

    words, steps = _tile_loads(w_ptr, s_ptr, w_off, s_off, rows_ok, kw, g_begin, g_end, EVEN)
    if PREFETCH == 2:
        words1, steps1 = _tile_loads(w_ptr, s_ptr, w_off, s_off, rows_ok, kw, g_begin + BLOCK_G, g_end, EVEN)
    if L2_PREFETCH:
        prefetch_slice(w_ptr, s_ptr, rn, N, G, g_begin, g_end)
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH == 0:
        # each step's words are loaded where they are unpacked, so the compiler moves them into
        # the MMA operand's layout while still packed; the first step is peeled so that its
        # weights are loaded before the wait
        xt = _x_tile(x_ptr, x_off, x_rows_ok, kx, g_begin, g_end, EVEN)
        acc = _tile_dot(words, steps, xt, acc, DOT_F32, ONE_DOT, PAIR_UNPACK)
        for g0 in range(g_begin + BLOCK_G, g_end, BLOCK_G):
            words, steps = _tile_loads(w_ptr, s_ptr, w_off, s_off, rows_ok, kw, g0, g_end, EVEN)
            xt = _x_tile(x_ptr, x_off, x_rows_ok, kx, g0, g_end, EVEN)
            acc = _tile_dot(words, steps, xt, acc, DOT_F32, ONE_DOT, PAIR_UNPACK)
    else:
        for g0 in range(g_begin, g_end, BLOCK_G):
            xt = _x_tile(x_ptr, x_off, x_rows_ok, kx, g0, g_end, EVEN)
            nxt_w, nxt_s = _tile_loads(w_ptr, s_ptr, w_off, s_off, rows_ok, kw, g0 + PREFETCH * BLOCK_G, g_end, EVEN)
            acc = _tile_dot(words, steps, xt, acc, DOT_F32, ONE_DOT, PAIR_UNPACK)
            if PREFETCH == 2:
                words, steps = words1, steps1
                words1, steps1 = nxt_w, nxt_s
            else:
                words, steps = nxt_w, nxt_s

    if SPLIT_K == 1:
        _batch_epilogue(acc, rm, rn, pid_n, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks, softcap,
                        SOFTCAP, ARGMAX, EPILOGUE)
    else:
        slot = pid_n * tl.num_programs(0) + pid_m
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(part_ptr + (slot * SPLIT_K + pid_k) * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()
        ticket = tl.atomic_add(lock_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for k in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + (slot * SPLIT_K + k) * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            _batch_epilogue(total, rm, rn, pid_n, M, N, out_ptr, idx_ptr, u_ptr, stride_om, stride_um, n_blocks,
                            softcap, SOFTCAP, ARGMAX, EPILOGUE)
            tl.atomic_xchg(lock_ptr + slot, 0)


# ----------------------------------------------------------------------------------------------
# Launchers


@functools.lru_cache(maxsize=None)
def batch_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device split-K ticket counters (zero between launches) and fp32 partials of
    :func:`_batch_kernel`. Its launches on one device must therefore run one at a time (one
    stream, as in a decode graph); the first launch allocates them, so make one (or call this)
    before a CUDA graph capture."""
    return (torch.zeros(BATCH_SLOTS, dtype=torch.int32, device=device),
            torch.empty(BATCH_PARTIALS, dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def _has_packed_half_fma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


def unpacks_pairs(x: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether :func:`_batch_kernel` can unpack two weights per instruction in x.dtype
    (:func:`_nibble_pairs`), which it does where the tiling's PAIR_UNPACK says so: fp16 or bf16 x
    with steps of the same dtype, on a CUDA GPU of compute capability 8.0 or later, outside the
    interpreter, unless ``QAT4_PAIR_UNPACK=0`` (then each weight is unpacked in fp32: the same
    weights and sums, for timing the two against each other)."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and scales.dtype == x.dtype
            and not interpreting() and os.environ.get("QAT4_PAIR_UNPACK", "1") != "0"
            and _has_packed_half_fma(x.device.index or 0))


def _launch(x, packed, scales, out, *, epilogue=PLAIN, up=None, softcap=None, idx=None, argmax=False, config=None,
            tiling=None) -> dict:
    """One :func:`_batch_kernel` launch (see its docstring for what each argument feeds); returns
    the tiling launched."""
    (m, k), (n, kw) = x.shape, packed.shape
    tiling = tiling or resolve_tiling(config, n, k, m, x.device)
    if m == 0:
        return tiling
    locks, partials = batch_scratch(x.device)
    grid = (triton.cdiv(m, tiling["BLOCK_M"]), triton.cdiv(n, tiling["BLOCK_N"]), tiling["SPLIT_K"])
    dot_f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    _batch_kernel[grid](
        x, packed, scales, out, out if idx is None else idx, out if up is None else up, partials, locks,
        m, n, kw // 4, x.stride(0), out.stride(0), 0 if up is None else up.stride(0),
        1.0 if softcap is None else float(softcap),
        BLOCK_M=tiling["BLOCK_M"], BLOCK_N=tiling["BLOCK_N"], BLOCK_G=tiling["BLOCK_G"], SPLIT_K=tiling["SPLIT_K"],
        PREFETCH=tiling["PREFETCH"], ONE_DOT=tiling["ONE_DOT"], EPILOGUE=int(epilogue), SOFTCAP=softcap is not None,
        ARGMAX=argmax, DOT_F32=dot_f32, PAIR_UNPACK=bool(tiling["PAIR_UNPACK"]) and unpacks_pairs(x, scales),
        L2_PREFETCH=bool(tiling["L2_PREFETCH"]) and prefetches_l2(x),
        num_warps=tiling["num_warps"], num_stages=tiling["num_stages"],
        **pdl_launch(x, m),
    )
    return tiling


def _operands(x, packed, scales):
    check(x, packed, scales)
    return unit_columns(x), packed.contiguous(), scales.contiguous()


def _output(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {dtype} {tuple(shape)} with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    return out


def w4_batch_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x.dtype, fp32 accumulation
    (:func:`~qat4.ops.w4.reference.w4_linear_reference`).

    `out` [M, N] (x.dtype, unit column stride) may be given, e.g. a CUDA graph's buffer; `config`
    pins keys of :func:`~qat4.ops.w4.batch_tiling.batch_tiling`'s tiling.
    """
    x, packed, scales = _operands(x, packed, scales)
    out = _output(out, (x.shape[0], packed.shape[0]), x.dtype, x.device)
    _launch(x, packed, scales, out, config=config)
    return out


def w4_batch_linear_gelu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, up: torch.Tensor | None = None,
                         *, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The GELU-gated layer of :func:`~qat4.ops.w4.reference.w4_linear_gelu_reference`, the gate
    in the epilogue: without `up` W's rows alternate gate and up and the result is [M, N / 2];
    with `up` [M, N] (unit column stride, any row stride), gelu(y) * up [M, N]."""
    x, packed, scales = _operands(x, packed, scales)
    check_gelu(x, packed, up)
    (m, _), n = x.shape, packed.shape[0]
    out = _output(out, (m, n if up is not None else n // 2), x.dtype, x.device)
    _launch(x, packed, scales, out, epilogue=GELU_PAIRS if up is None else GELU_UP, up=unit_columns(up), config=config)
    return out


def w4_batch_logits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                    *, out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The output layer, fp32 logits [M, N] = softcap * tanh((x @ W.T) / softcap), or x @ W.T in
    fp32 when softcap is None (:func:`~qat4.ops.w4.reference.w4_logits_reference`)."""
    x, packed, scales = _operands(x, packed, scales)
    out = _output(out, (x.shape[0], packed.shape[0]), torch.float32, x.device)
    _launch(x, packed, scales, out, softcap=softcap, config=config)
    return out


def w4_batch_argmax(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                    *, config: dict | None = None) -> torch.Tensor:
    """Greedy tokens, int64 [M]: the first maximum per row of :func:`w4_batch_logits` (bit for bit,
    for the same tiling) without writing the logits
    (:func:`~qat4.ops.w4.reference.w4_argmax_reference`). Each program keeps its block's maximum
    and first column; :func:`~qat4.ops.w4.common.argmax_reduce_kernel` picks per row the first
    block holding the overall maximum."""
    x, packed, scales = _operands(x, packed, scales)
    (m, k), n = x.shape, packed.shape[0]
    tiling = resolve_tiling(config, n, k, m, x.device)
    n_blocks = triton.cdiv(n, tiling["BLOCK_N"])
    pmax = torch.empty(m, n_blocks, dtype=torch.float32, device=x.device)
    pidx = torch.empty(m, n_blocks, dtype=torch.int32, device=x.device)
    _launch(x, packed, scales, pmax, idx=pidx, softcap=softcap, argmax=True, tiling=tiling)
    top = torch.empty(m, dtype=torch.int64, device=x.device)
    if m:
        block = min(16384, triton.next_power_of_2(n_blocks))
        argmax_reduce_kernel[(m,)](pmax, pidx, top, n_blocks, BLOCK=block, num_warps=16 if block >= 8192 else 4,
                                   **pdl_launch(x, m))
    return top
