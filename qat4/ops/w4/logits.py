"""The output layer on the decode GEMV: softcapped logits and the greedy token (M <= 16).

:func:`w4_logits_triton` (:func:`~qat4.ops.w4.reference.w4_logits_reference`) runs the GEMV with
Gemma's ``cap * tanh(z / cap)`` softcap in its epilogue; :func:`w4_argmax_triton`
(:func:`~qat4.ops.w4.reference.w4_argmax_reference`) keeps one (max, first column) per block of
rows instead and never writes the logits. Both launch on a fixed tiling (:func:`_output_config`),
so the argmax equals torch.argmax of the logits bit for bit.
"""

import torch

from qat4.ops._triton import triton
from qat4.ops.pdl import pdl_launch
from qat4.ops.w4.common import argmax_reduce_kernel
from qat4.ops.w4.gemv import launch_matvec
from qat4.ops.w4.tiling import matvec_block_m


def _output_config(m: int) -> dict:
    """The output layer's fixed tiling: no split, 16 groups per step. Every row of the logits is
    then summed in one order whatever the rows per thread, so w4_argmax equals
    torch.argmax(w4_logits) bit for bit."""
    return {"RR": 8 if matvec_block_m(m) <= 2 else 4, "TR": 2, "BLOCK_G": 16, "SPLIT_K": 1}


def w4_logits_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                     *, config: dict | None = None) -> torch.Tensor:
    """Triton :func:`~qat4.ops.w4.reference.w4_logits_reference`: the GEMV with the softcap in its
    epilogue (M <= 16)."""
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32, device=x.device)
    launch_matvec(x, packed, scales, out, softcap=None if softcap is None else float(softcap),
                  config=config or _output_config(x.shape[0]))
    return out


def w4_argmax_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, softcap: float | None = 30.0,
                     *, config: dict | None = None) -> torch.Tensor:
    """Triton :func:`~qat4.ops.w4.reference.w4_argmax_reference` (M <= 16): the softcapped GEMV
    keeps one (max, first column) per block of rows instead of the logits, then
    :func:`~qat4.ops.w4.common.argmax_reduce_kernel` picks the first maximum per row of x."""
    m = x.shape[0]
    config = config or _output_config(m)
    n_blocks = triton.cdiv(packed.shape[0], config["RR"] * config["TR"])
    pmax = torch.empty(m, n_blocks, dtype=torch.float32, device=x.device)
    pidx = torch.empty(m, n_blocks, dtype=torch.int32, device=x.device)
    launch_matvec(x, packed, scales, pmax, idx=pidx, softcap=None if softcap is None else float(softcap), argmax=True,
                  config=config)
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    block = min(16384, triton.next_power_of_2(n_blocks))
    argmax_reduce_kernel[(m,)](pmax, pidx, out, n_blocks, BLOCK=block, num_warps=16 if block >= 8192 else 4,
                               **pdl_launch(x, m))
    return out
