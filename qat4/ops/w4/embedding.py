"""Row lookup in a packed 4-bit table (token embeddings, the per-layer embedding table).

The table E [V, K] is in the layout of :mod:`qat4.checkpoint.packing` (``packed`` int32 [V, K/8],
``scales`` [V, K/32]). A lookup returns ``E[ids] * scale`` computed in fp32 and rounded once to
``out_dtype``: Gemma multiplies token embeddings by sqrt(hidden) rounded to the compute dtype
(39.25 in bf16) and the per-layer table (K = 35 * 256 = 8960 on E2B) by 16. Only the gathered rows
are ever dequantised. Ids must lie in [0, V); the kernel does not check them.

The same kernel expands whole row ranges of a weight matrix (:func:`w4_expand_rows_triton`, scale 1)
for the products of :mod:`qat4.ops.w4.expanded`.
"""

import torch

from qat4.checkpoint.packing import dequantize
from qat4.ops import use_triton
from qat4.ops._triton import tl, triton
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel
from qat4.ops.w4.common import unpack_levels


def w4_embedding_reference(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale: float,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """ids [...] (integer) -> [..., K] in out_dtype: dequantised rows times `scale`, in fp32."""
    flat = ids.reshape(-1).long()
    rows = dequantize(packed[flat], scales[flat]) * scale
    return rows.to(out_dtype).reshape(*ids.shape, packed.shape[1] * 8)


@triton.jit
def _rows_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, G, scale, BLOCK_G: tl.constexpr, GATHER: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """out [T, 32G] = T rows of the table (words [V, 4G] int32, scales [V, G]) times scale: rows
    ids [T] when GATHER, else its first T rows.

    Grid: (T, cdiv(G, BLOCK_G)); program (t, b) writes groups b*BLOCK_G .. of output row t.
    """
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    g0 = tl.program_id(1) * BLOCK_G
    if GATHER:
        row = tl.load(ids_ptr + t).to(tl.int64)
    else:
        row = t.to(tl.int64)
    kk = tl.arange(0, 4 * BLOCK_G)
    gs = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, 32 * BLOCK_G)
    words = tl.load(w_ptr + row * (4 * G) + 4 * g0 + kk, mask=(g0 + kk // 4) < G, other=0)
    s = tl.load(s_ptr + row * G + g0 + gs, mask=(g0 + gs) < G, other=0.0).to(tl.float32)
    w = tl.reshape(unpack_levels(words[None, :]), [BLOCK_G, 32]) * s[:, None] * scale
    tl.store(out_ptr + t.to(tl.int64) * (32 * G) + 32 * g0 + cols, tl.reshape(w, [32 * BLOCK_G]).to(out_ptr.dtype.element_ty),
             mask=(g0 + cols // 32) < G)


def _launch_rows(ids, packed, scales, out, scale, rows):
    g = scales.shape[1]
    block_g = min(64, triton.next_power_of_2(g))
    if rows:
        _rows_kernel[(rows, triton.cdiv(g, block_g))](
            out if ids is None else ids, packed.contiguous(), scales.contiguous(), out, g, float(scale),
            BLOCK_G=block_g, GATHER=ids is not None, num_warps=4, **pdl_launch(out, rows))


def w4_embedding_triton(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale: float,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Triton :func:`w4_embedding_reference`, bit-identical to it. Launch: :func:`_rows_kernel`."""
    flat = ids.reshape(-1).contiguous()
    g = scales.shape[1]
    out = torch.empty(flat.shape[0], g * 32, dtype=out_dtype, device=packed.device)
    _launch_rows(flat, packed, scales, out, scale, flat.shape[0])
    return out.reshape(*ids.shape, g * 32)


def w4_expand_rows_reference(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """W [N, K] of packed [N, K/8] and scales [N, K/32] dequantised in fp32 and rounded once to
    out.dtype, written into out [N, K]."""
    out.copy_(dequantize(packed, scales))
    return out


def w4_expand_rows_triton(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton :func:`w4_expand_rows_reference`, bit-identical to it. Launch: :func:`_rows_kernel`."""
    n, kw = packed.shape
    if tuple(out.shape) != (n, kw * 8) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{n}, {kw * 8}] tensor, got {tuple(out.shape)} strides {out.stride()}")
    _launch_rows(None, packed, scales, out, 1.0, n)
    return out


def w4_embedding(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale: float,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Look up ids [...] in a packed table -> [..., K] in out_dtype. See :func:`w4_embedding_reference`."""
    fn = w4_embedding_triton if use_triton(packed) else w4_embedding_reference
    return fn(ids, packed, scales, scale, out_dtype)
