"""The int4 linear layers the model calls: each picks a kernel by the rows of x it multiplies.

- the reference (:mod:`qat4.ops.w4.reference`) when :func:`qat4.ops.use_triton` says so (CPU
  tensors, ``QAT4_OPS=reference``);
- the GEMV (:mod:`qat4.ops.w4.gemv`, its output layer :mod:`qat4.ops.w4.logits`) for at most
  GEMV_ROWS rows (by default one: a single-sequence decode step; a step of two rows, one stream
  verifying a draft, took 2,294 µs with the GEMV and 2,031 with the batch kernel on an H200, and
  two sequences 2,078 against 2,005 with the GEMV's 2-row tilings pinned to the fastest of each
  shape timed alone, where the GEMV beat the batch kernel at every shape);
- the decode-batch tensor-core product (:mod:`qat4.ops.w4.batch`) up to BATCH_ROWS rows: many
  sequences decoding together;
- from DENSE_ROWS rows (by default: beyond BATCH_ROWS, where products would expand W), where the
  caller keeps a 16-bit copy of W (``dense``: a model loaded with ``dense_weights``), that copy
  multiplied by cuBLAS (:mod:`qat4.ops.w4.expanded`), which saves a prompt step the expansion of
  every matrix (a 512-token prompt's first token 8.8 -> 7.0 ms on an H100, BENCHMARKS.md
  2026-12-07). Not for decode steps: there the copies made a 64-row step longer (4.026 against
  3.932 ms), though cuBLAS on the copy multiplied a 64-row step's layer products alone in 2,215
  against the batch kernel's 2,359 µs: the batch kernel's gated and residual epilogues do work
  that cuBLAS leaves to separate launches;
- from EXPAND_ROWS rows (by default: beyond BATCH_ROWS) of 16-bit x on a GPU with tensor cores,
  when a scratch that holds W is reserved (the model's load does, where its memory plan has room),
  W expanded into it and multiplied by cuBLAS (:mod:`qat4.ops.w4.expanded`): prompt chunks, and
  steps that mix them with decoding rows;
- the prefill GEMM (:mod:`qat4.ops.w4.gemm`) beyond BATCH_ROWS otherwise, and from WIDE_GEMM_ROWS
  rows of 16-bit x on tensor cores for a wide, short W (at least WIDE_N rows of at most WIDE_K
  columns: the MLP's gate/up), where its pipelined tiles beat the batch kernel's (at 64 rows on an
  H200: 24,576 x 1,536 in 22.8 against 35.0 µs, 12,288 x 1,536 in 18.6 against 24.3); never the
  output layer, whose fp32 logits and argmax the batch kernel writes.

The layers that can run the GEMV take ``tilings``, the calling model's
:class:`~qat4.ops.w4.tiling.MatvecTilings`: the GEMV launches on the tilings pinned there and
records there the tiling of each shape it launches. Without it (``tilings=None``: the ops called
directly, as the tests and ``tools/bench_w4.py`` do) the GEMV takes the autotuner's picks and
records nothing. The output layer's GEMV launches on a fixed tiling and takes none.

The boundaries come from timing the kernels at E2B's shapes on an H200
(``tools/bench_w4.py --rows R``, BENCHMARKS.md); ``QAT4_GEMV_ROWS=N``, ``QAT4_EXPAND_ROWS=N`` and
``QAT4_WIDE_GEMM_ROWS=N`` and ``QAT4_DENSE_ROWS=N`` move them (read when this module is imported),
e.g. to time a step both ways.
"""

from __future__ import annotations

import os

import torch

from qat4.ops import triton_on, use_triton
from qat4.ops.norms import residual_rms_norm_triton
from qat4.ops.w4.batch import w4_batch_argmax, w4_batch_linear, w4_batch_linear_gelu, w4_batch_logits
from qat4.ops.w4.expanded import has_scratch, w4_expanded_matmul
from qat4.ops.w4.gemm import multiplies_in_fp32, w4_matmul
from qat4.ops.w4.gemv import MAX_MATVEC_ROWS, w4_matvec, w4_matvec_gelu, w4_matvec_residual
from qat4.ops.w4.logits import w4_argmax_triton, w4_logits_triton
from qat4.ops.w4.reference import (
    ResidualStep, w4_argmax_reference, w4_linear_gelu_reference, w4_linear_reference, w4_linear_residual_reference,
    w4_logits_reference,
)
from qat4.ops.w4.tiling import MatvecTilings

GEMV_ROWS = int(os.environ.get("QAT4_GEMV_ROWS", "1"))  # the GEMV up to this many rows of x
BATCH_ROWS = 128  # the decode-batch kernel up to this many; the prefill GEMM beyond
WIDE_GEMM_ROWS = int(os.environ.get("QAT4_WIDE_GEMM_ROWS", "33"))  # a wide W's product on the GEMM from this many
WIDE_N, WIDE_K = 8192, 2048  # a wide W: at least WIDE_N rows of at most WIDE_K columns
EXPAND_ROWS = int(os.environ.get("QAT4_EXPAND_ROWS", str(BATCH_ROWS + 1)))  # the expanded product from this many
DENSE_ROWS = int(os.environ.get("QAT4_DENSE_ROWS", str(BATCH_ROWS + 1)))  # a kept 16-bit copy of W multiplied from this many


def _expandable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products of ``dtype`` activations on ``device`` run on tensor cores through cuBLAS."""
    return torch.device(device).type == "cuda" and not multiplies_in_fp32(dtype, device)


def _kernel(x: torch.Tensor, packed: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> str:
    """The kernel for x [M, K] times W (``packed``; None: the output layer, never expanded; ``dense``:
    a 16-bit copy of W the caller keeps, or None)."""
    if not use_triton(x):
        return "reference"
    m = x.shape[0]
    if m <= min(GEMV_ROWS, MAX_MATVEC_ROWS):
        return "gemv"
    if dense is not None and m >= DENSE_ROWS and _expandable(x.dtype, x.device):
        return "dense"
    if (packed is not None and m >= EXPAND_ROWS and _expandable(x.dtype, x.device)
            and has_scratch(x.device, x.dtype, packed.numel() * 8)):
        return "expanded"
    wide = (packed is not None and packed.shape[0] >= WIDE_N and packed.shape[1] * 8 <= WIDE_K
            and _expandable(x.dtype, x.device))
    return "batch" if m <= BATCH_ROWS and not (wide and m >= WIDE_GEMM_ROWS) else "gemm"


def expands_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products of ``dtype`` activations on ``device`` can take the expanded path (from
    EXPAND_ROWS rows on, into a scratch the model reserves at load when its memory plan allows)."""
    return triton_on(device) and _expandable(dtype, device)


def w4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, *,
              tilings: MatvecTilings | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x.dtype; ``tilings`` and ``dense`` as the module docstring
    says. See :func:`qat4.ops.w4.reference.w4_linear_reference`."""
    x2 = x.reshape(-1, x.shape[-1])
    kernel = _kernel(x2, packed, dense)
    if kernel == "gemv":
        y = w4_matvec(x2, packed, scales, tilings=tilings)
    elif kernel == "dense":
        y = w4_expanded_matmul(x2, packed, scales, dense=dense)
    else:
        fn = {"reference": w4_linear_reference, "batch": w4_batch_linear, "gemm": w4_matmul,
              "expanded": w4_expanded_matmul}[kernel]
        y = fn(x2, packed, scales)
    return y.reshape(*x.shape[:-1], packed.shape[0])


def w4_linear_gelu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   up: torch.Tensor | None = None, *, tilings: MatvecTilings | None = None,
                   dense: torch.Tensor | None = None) -> torch.Tensor:
    """GELU-gated linear layer on x [T, K], the gate in the kernel's epilogue; ``tilings`` and
    ``dense`` as the module docstring says. See :func:`qat4.ops.w4.reference.w4_linear_gelu_reference`."""
    kernel = _kernel(x, packed, dense)
    if kernel == "dense":
        return w4_expanded_matmul(x, packed, scales, gelu=True, up=up, dense=dense)
    if kernel in ("gemm", "expanded"):
        return (w4_matmul if kernel == "gemm" else w4_expanded_matmul)(x, packed, scales, gelu=True, up=up)
    if kernel == "gemv":
        return w4_matvec_gelu(x, packed, scales, up, tilings=tilings)
    return {"reference": w4_linear_gelu_reference, "batch": w4_batch_linear_gelu}[kernel](x, packed, scales, up)


def w4_linear_residual(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, residual: ResidualStep, *,
                       tilings: MatvecTilings | None = None,
                       dense: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer on x [T, K] feeding a residual step: fused into the GEMV, else the product
    then :func:`qat4.ops.norms.residual_rms_norm_triton` (run in the batch kernel's last program
    instead, the step on an H200 took 145 / 310 / 664 µs longer at 2 / 4 / 8 rows: BENCHMARKS.md,
    2026-12-03); ``tilings`` and ``dense`` as the module docstring says. See
    :func:`qat4.ops.w4.reference.w4_linear_residual_reference`."""
    kernel = _kernel(x, packed, dense)
    if kernel == "reference":
        return w4_linear_residual_reference(x, packed, scales, residual)
    if kernel == "gemv":
        return w4_matvec_residual(x, packed, scales, residual, tilings=tilings)
    if kernel == "dense":
        y = w4_expanded_matmul(x, packed, scales, dense=dense)
    else:
        y = {"batch": w4_batch_linear, "gemm": w4_matmul, "expanded": w4_expanded_matmul}[kernel](x, packed, scales)
    return residual_rms_norm_triton(residual.h, y, residual.weight, residual.scalar, residual.next_weight, residual.eps)


def _output_layer(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None, reference,
                  gemv, batch) -> torch.Tensor:
    """The output layer of x [M, K] by rows: the reference, the GEMV (in chunks of at most
    MAX_MATVEC_ROWS rows), or the batch kernel in chunks of at most BATCH_ROWS."""
    kernel = _kernel(x)
    if kernel == "reference":
        return reference(x, packed, scales, softcap)
    fn, rows = (gemv, GEMV_ROWS) if kernel == "gemv" else (batch, BATCH_ROWS)
    parts = [fn(x[r0 : r0 + rows], packed, scales, softcap) for r0 in range(0, x.shape[0], rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def w4_logits(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0) -> torch.Tensor:
    """Softcapped output layer: x [..., K] -> fp32 logits [..., N]. See
    :func:`qat4.ops.w4.reference.w4_logits_reference`."""
    x2 = x.reshape(-1, x.shape[-1])
    out = _output_layer(x2, packed, scales, softcap, w4_logits_reference, w4_logits_triton, w4_batch_logits)
    return out.reshape(*x.shape[:-1], packed.shape[0])


def w4_argmax(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0) -> torch.Tensor:
    """Greedy token: x [..., K] -> int64 [...], the first maximum of the softcapped logits,
    without writing them. See :func:`qat4.ops.w4.reference.w4_argmax_reference`."""
    x2 = x.reshape(-1, x.shape[-1])
    return _output_layer(x2, packed, scales, softcap, w4_argmax_reference, w4_argmax_triton,
                         w4_batch_argmax).reshape(x.shape[:-1])
