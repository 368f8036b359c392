"""Row lookup in a packed 4-bit table (token embeddings, the per-layer embedding table).

The table E [V, K] is in the layout of :mod:`qat4.checkpoint.packing` (``packed`` int32 [V, K/8],
``scales`` [V, K/32]). A lookup returns ``E[ids] * scale`` computed in fp32 and rounded once to
``out_dtype``: Gemma multiplies token embeddings by sqrt(hidden) rounded to the compute dtype
(39.25 in bf16) and the per-layer table (K = 35 * 256 = 8960 on E2B) by 16. Only the gathered rows
are ever dequantised. Ids must lie in [0, V); the kernel does not check them.
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
def _embedding_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, G, scale, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr):
    """out [T, 32G] = rows ids [T] of the table (words [V, 4G] int32, scales [V, G]) times scale.

    Grid: (T, cdiv(G, BLOCK_G)); program (t, b) writes groups b*BLOCK_G .. of token t.
    """
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    g0 = tl.program_id(1) * BLOCK_G
    row = tl.load(ids_ptr + t).to(tl.int64)
    kk = tl.arange(0, 4 * BLOCK_G)
    gs = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, 32 * BLOCK_G)
    words = tl.load(w_ptr + row * (4 * G) + 4 * g0 + kk, mask=(g0 + kk // 4) < G, other=0)
    s = tl.load(s_ptr + row * G + g0 + gs, mask=(g0 + gs) < G, other=0.0).to(tl.float32)
    w = tl.reshape(unpack_levels(words[None, :]), [BLOCK_G, 32]) * s[:, None] * scale
    tl.store(out_ptr + t.to(tl.int64) * (32 * G) + 32 * g0 + cols, tl.reshape(w, [32 * BLOCK_G]).to(out_ptr.dtype.element_ty),
             mask=(g0 + cols // 32) < G)


def w4_embedding_triton(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale: float,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Triton :func:`w4_embedding_reference`, bit-identical to it. Launch: :func:`_embedding_kernel`."""
    flat = ids.reshape(-1).contiguous()
    g = scales.shape[1]
    out = torch.empty(flat.shape[0], g * 32, dtype=out_dtype, device=packed.device)
    block_g = min(64, triton.next_power_of_2(g))
    if flat.numel():
        _embedding_kernel[(flat.shape[0], triton.cdiv(g, block_g))](
            flat, packed.contiguous(), scales.contiguous(), out, g, float(scale), BLOCK_G=block_g, num_warps=4,
            **pdl_launch(out, flat.shape[0]))
    return out.reshape(*ids.shape, g * 32)


def w4_embedding(ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scale: float,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Look up ids [...] in a packed table -> [..., K] in out_dtype. See :func:`w4_embedding_reference`."""
    fn = w4_embedding_triton if use_triton(packed) else w4_embedding_reference
    return fn(ids, packed, scales, scale, out_dtype)
