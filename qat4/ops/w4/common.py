"""The pieces several w4 kernels share: nibble unpacking, the softcap, the tile epilogue, the
argmax reduction, the L2 prefetch of a program's weights, and the host helpers their launchers use.

- :func:`nibble_f32`, :func:`unpack_levels`: packed words to float codes / levels in registers
  (the GEMV, the prefill GEMM, the embedding lookup); :func:`split_last` splits a tensor's last
  dim the way the GEMV and the decode-batch kernel read a word's columns.
- :data:`PLAIN`, :data:`GELU_PAIRS`, :data:`GELU_UP`: the epilogues of the GEMV, the batch kernel
  and the GEMM; :func:`store_tile` is the batch kernel's and the GEMM's; :func:`_softcap` the
  output layer's in the GEMV and the batch kernel.
- :func:`argmax_reduce_kernel`: the second pass of both argmax output layers.
- :func:`prefetch_slice`: the batch kernel's slice of W asked of L2 before its PDL wait, where its
  tiling, :func:`prefetches_l2` and :func:`fits_half_l2` allow it.
"""

import functools
import os

import torch

from qat4.ops._triton import tl, triton
from qat4.ops.norms import gelu_tanh_gate
from qat4.ops.pdl import wait_for_previous_kernel

PLAIN, GELU_PAIRS, GELU_UP = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # GEMV / batch / GEMM epilogues


# ----------------------------------------------------------------------------------------------
# Unpacking


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
def split_last(t, K: tl.constexpr):
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


# ----------------------------------------------------------------------------------------------
# Epilogues


@triton.jit
def _softcap(z, cap):
    """cap * tanh(z / cap), elementwise in fp32."""
    y = z / cap
    t = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0, -th, th)


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


@triton.jit
def argmax_reduce_kernel(pmax_ptr, pidx_ptr, out_ptr, NB, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
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


# ----------------------------------------------------------------------------------------------
# Host helpers of the launchers


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (1 elsewhere)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each of ptrs (any shape; one ``prefetch.global.L2`` per
    element): nothing waits for it and no register holds it. Not in the interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_slice(w_ptr, s_ptr, rows, N, G, g_begin, g_end):
    """Prefetch into L2 a program's slice of W, words [N, 4G] int32 and steps [N, G]: rows
    [R] over the groups [g_begin, g_end), the words 64 bytes (4 groups) per address, two
    addresses a row per iteration, the steps by the first and last byte of each 128 bytes (64
    groups). Rows past N read row N - 1 and every address lies inside the slice, so none faults.
    A kernel calls it before its PDL wait: the weights stream into L2 while it waits, and its
    steps' loads find them there instead of each paying a trip to memory."""
    r = tl.minimum(rows, N - 1)[:, None]
    pair = tl.arange(0, 2)[None, :]
    for g in range(g_begin, g_end, 8):
        _prefetch_l2(w_ptr + r * (4 * G) + 4 * tl.maximum(tl.minimum(g + 4 * pair, g_end - 4), g_begin))
    for g in range(g_begin, g_end, 64):
        _prefetch_l2(s_ptr + r * G + tl.minimum(g + 63 * pair, g_end - 1))


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    """Bytes of L2 cache of a CUDA device (0 elsewhere)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0


def fits_half_l2(n: int, k: int, l2: int) -> bool:
    """Whether W [n, k] (4-bit words and 16-bit steps) fits in half of an L2 of ``l2`` bytes: a
    product over it may prefetch it whole, and what it prefetched is still there when its steps
    reach it (the output layer's 201 MB would evict itself)."""
    return 2 * (n * k // 2 + n * k // 16) <= l2


def prefetches_l2(x: torch.Tensor) -> bool:
    """Whether the decode-batch kernel may prefetch its slices of W into L2 (:func:`prefetch_slice`)
    where its tiling says so: x on a CUDA GPU, outside the interpreter, unless
    ``QAT4_L2_PREFETCH=0`` (for timing the two ways)."""
    return x.is_cuda and not interpreting() and os.environ.get("QAT4_L2_PREFETCH", "1") != "0"


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unit_columns(t: torch.Tensor | None) -> torch.Tensor | None:
    """t (or None) with unit column stride: t itself when it has one, else a contiguous copy."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()
