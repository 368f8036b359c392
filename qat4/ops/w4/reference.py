"""The plain-torch references every w4 kernel is checked against, and the residual step they feed.

W [N, K] in the layout of :mod:`qat4.ops.w4`. Each reference computes ``x @ W.T`` in fp32 from
W dequantised in row chunks, with the same signature as the kernels that stand in for it:

- :func:`w4_linear_reference`: the GEMV (:mod:`~qat4.ops.w4.gemv`), the decode-batch product
  (:mod:`~qat4.ops.w4.batch`) and the prefill GEMM (:mod:`~qat4.ops.w4.gemm`);
- :func:`w4_linear_gelu_reference`, :func:`w4_linear_residual_reference`: the same products with
  the GELU gate or the residual step (:class:`ResidualStep`) in their epilogues;
- :func:`w4_logits_reference`, :func:`w4_argmax_reference`: the softcapped output layer
  (:mod:`~qat4.ops.w4.logits`, :mod:`~qat4.ops.w4.batch`).

:func:`check` is the shape check every kernel's launcher runs too.
"""

import weakref
from typing import NamedTuple

import torch

from qat4.checkpoint.packing import dequantize
from qat4.ops.norms import gelu_tanh_mul_reference, residual_rms_norm_reference

_REFERENCE_CHUNK = 1 << 22  # dequantised weights per chunk of the references (16 MiB in fp32)
_REFERENCE_ROWS = 16  # rows of x per matrix product of the references

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
    check(x, packed, scales)
    m = x.shape[0]
    out = torch.empty(m, packed.shape[0], dtype=dtype, device=x.device)
    xf = torch.zeros(-(-m // _REFERENCE_ROWS) * _REFERENCE_ROWS, x.shape[1], device=x.device)
    xf[:m] = x.float()
    for r0, w in _dequantized_row_chunks(packed, scales):
        for m0 in range(0, m, _REFERENCE_ROWS):
            z = (xf[m0 : m0 + _REFERENCE_ROWS] @ w.T)[: m - m0]  # the padding rows go no further
            if softcap is not None:
                z = z.div_(softcap).tanh_().mul_(softcap)
            out[m0 : m0 + _REFERENCE_ROWS, r0 : r0 + w.shape[0]] = z
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


def check(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ValueError unless x [M, K], packed int32 [N, K/8] and scales [N, K/32] fit together."""
    n, kw = packed.shape
    if packed.dtype != torch.int32 or x.dim() != 2 or x.shape[1] != kw * 8 or tuple(scales.shape) != (n, kw // 4):
        raise ValueError(
            f"w4 linear needs x [M, K], packed int32 [N, K/8], scales [N, K/32] with K a multiple of 32; "
            f"got x {tuple(x.shape)}, packed {packed.dtype} {tuple(packed.shape)}, scales {tuple(scales.shape)}"
        )


def check_gelu(x: torch.Tensor, packed: torch.Tensor, up: torch.Tensor | None) -> None:
    """Raise ValueError unless a GELU-gated product fits: without `up` W's rows come in gate/up
    pairs (an even N), with it `up` is [M, N]."""
    (m, _), n = x.shape, packed.shape[0]
    if up is None and n % 2:
        raise ValueError(f"GELU row pairs need an even row count, got N={n}")
    if up is not None and tuple(up.shape) != (m, n):
        raise ValueError(f"up must be [{m}, {n}], got {tuple(up.shape)}")


class ResidualStep(NamedTuple):
    """The residual step a linear layer's output y [M, D] feeds, as in
    :func:`qat4.ops.norms.residual_rms_norm_reference`: h_out = (h + RMSNorm_weight(y)) * scalar
    and x_next = RMSNorm_next_weight(h_out) (None without next_weight)."""

    h: torch.Tensor
    weight: torch.Tensor
    scalar: torch.Tensor | None = None
    next_weight: torch.Tensor | None = None
    eps: float = 1e-6
