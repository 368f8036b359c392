"""Prompt chunks of many rows: W expanded one slice at a time into a 16-bit scratch, then cuBLAS.

From a few hundred rows of x on, an int4 product is bound by tensor-core math, not by the bytes
of its weights: a 4,096-token chunk multiplies each weight 4,096 times. There cuBLAS's 16-bit
GEMM runs several times faster than :mod:`qat4.ops.w4.gemm`, whose K loop unpacks every tile of
W again for every block of rows (BENCHMARKS.md has both). Expanding W [N, K] first costs one
read of its packed bytes and one write and read of 2NK bytes, which the product's 2MNK
multiply-adds amortise from :data:`qat4.ops.w4.dispatch.EXPAND_ROWS` rows on.

The weights stay packed in memory: one matrix at a time exists in 16 bits, in a scratch per
device and dtype (:func:`reserve_scratch`) that the model reserves at load for its largest matrix
(72 MiB in bf16 on E2B: the merged gate/up of its double-wide MLPs) where the memory plan has room
for it and for a cuBLAS workspace; without one (a tight memory cap) prompt products run the
prefill GEMM. Unless the model keeps a 16-bit copy of every matrix (``dense_weights``, 3.75
GB on E2B, :func:`expand_matrix`): then the products it sends here multiply that copy, and
nothing is expanded while they run.

Rounding: each weight is rounded to x.dtype once (:func:`~qat4.ops.w4.embedding.w4_expand_rows_triton`,
as the GEMM and the decode-batch kernel round it), cuBLAS accumulates in fp32 (torch's default lets
it reduce split-K partial sums in 16 bits) and rounds y to x.dtype, and the GELU gate runs on that y (:func:`~qat4.ops.norms.gelu_tanh_mul_triton`): the
rounding points of :func:`~qat4.ops.w4.reference.w4_linear_gelu_reference`, which is this
module's reference beside :func:`~qat4.ops.w4.reference.w4_linear_reference`.
"""

import functools

import torch

from qat4.ops.norms import gelu_tanh_mul_triton
from qat4.ops.w4.embedding import w4_expand_rows_triton
from qat4.ops.w4.reference import check, check_gelu

_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # scratches a larger one replaced: kept, a captured graph may still write there


def _key(device: torch.device | str, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype


def reserve_scratch(device: torch.device | str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The expansion scratch of a device and dtype, grown to at least ``numel`` weights. It never
    shrinks and an outgrown one is never freed, since a CUDA graph captured over it keeps writing
    there; growing it during a capture is an error (the model reserves its largest matrix at load,
    before any capture). Launches on one device must run one at a time (one stream)."""
    key = _key(device, dtype)
    scratch = _SCRATCH.get(key)
    if scratch is None or scratch.numel() < numel:
        if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the expansion scratch must hold {numel} weights before a CUDA graph capture")
        if scratch is not None:
            _OUTGROWN.append(scratch)
        scratch = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=key[0])
    return scratch


def has_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> bool:
    """Whether a scratch of at least ``numel`` weights is reserved for ``device`` and ``dtype``."""
    scratch = _SCRATCH.get(_key(device, dtype))
    return scratch is not None and scratch.numel() >= numel


def expand_matrix(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype``, each weight rounded once: a copy a model keeps beside the packed
    words (``dense_weights``) for :func:`w4_expanded_matmul`'s ``dense``."""
    w = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=dtype, device=packed.device)
    return w4_expand_rows_triton(packed, scales, w)


def w4_expanded_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *, gelu: bool = False,
                       up: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (16-bit) @ W.T -> [M, N] in x.dtype, W expanded into the scratch (or ``dense``, W
    [N, K] in x.dtype as :func:`expand_matrix` gives it) and multiplied by cuBLAS; with ``gelu``
    the GELU gate afterwards as :func:`~qat4.ops.w4.gemm.w4_matmul` has it in its epilogue (W's
    rows alternating gate and up -> [M, N / 2], or gelu(y) * up [M, N])."""
    check(x, packed, scales)
    if gelu:
        check_gelu(x, packed, up)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the expanded product multiplies 16-bit activations, got {x.dtype}")
    k, n = x.shape[1], packed.shape[0]
    if dense is None:
        dense = w4_expand_rows_triton(packed, scales, reserve_scratch(x.device, x.dtype, n * k)[: n * k].view(n, k))
    elif dense.shape != (n, k) or dense.dtype != x.dtype:
        raise ValueError(f"dense is {tuple(dense.shape)} {dense.dtype}; W is [{n}, {k}] and x {x.dtype}")
    y = torch.mm(x, dense.t())
    if not gelu:
        return y
    return gelu_tanh_mul_triton(y[:, 0::2], y[:, 1::2]) if up is None else gelu_tanh_mul_triton(y, up)
