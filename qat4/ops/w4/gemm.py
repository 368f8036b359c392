"""Prefill GEMM on packed 4-bit weights: x [M, K] @ W.T for prompt chunks (more rows than the
decode kernels take), with the GELU gate in the epilogue.

W [N, K] in the layout of :mod:`qat4.ops.w4`. :func:`w4_matmul` is checked against
:func:`~qat4.ops.w4.reference.w4_linear_reference` (and with ``gelu``,
:func:`~qat4.ops.w4.reference.w4_linear_gelu_reference`). Launch: :func:`_matmul_kernel`, autotuned
over the tiles of :func:`_matmul_configs`; tensor cores in x.dtype unless
:func:`prefill_uses_fp32` (``QAT4_PREFILL_FP32=1``, fp32 x, or a GPU without them).
"""

import functools
import os

import torch

from qat4.ops._triton import tl, triton
from qat4.ops.w4.common import GELU_PAIRS, GELU_UP, PLAIN, interpreting, store_tile, unit_columns, unpack_levels
from qat4.ops.w4.reference import check
from qat4.ops.w4.tiling import bench

@triton.jit(do_not_specialize=["M", "M_BIN"])
def _matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, u_ptr, M, N, G, stride_xm, stride_om, stride_um, M_BIN,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, EPILOGUE: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W.T for large M; K = 32 * G.

    x [M, K] (row stride stride_xm, columns contiguous), W words [N, 4G], scales [N, G].
    EPILOGUE as in :func:`~qat4.ops.w4.common.store_tile`: PLAIN, GELU_PAIRS (out [M, N / 2]) or GELU_UP (U [M, N],
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
    return keep[-1:] if interpreting() else keep


_matmul_tuned = triton.autotune(
    configs=_matmul_configs(), key=["M_BIN", "N", "G", "DOT_F32", "EPILOGUE"], prune_configs_by={"early_config_prune": _prune_matmul},
    do_bench=bench,
)(_matmul_kernel)


@functools.lru_cache(maxsize=None)
def has_tensor_cores(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CUDA `device` has tensor cores for `dtype`: fp16 from sm_70, bf16 from sm_80, none on
    the GTX 16xx."""
    major, _ = torch.cuda.get_device_capability(device)
    if major < 7 or (dtype == torch.bfloat16 and major < 8):
        return False
    return "GTX 16" not in torch.cuda.get_device_name(device)  # TU116/TU117: Turing without tensor cores


def prefill_uses_fp32(x: torch.Tensor, fp32: bool | None = None) -> bool:
    """Whether :func:`w4_matmul` multiplies in fp32 (no tensor cores) for this x.

    `fp32` forces it either way; otherwise :func:`multiplies_in_fp32` for x's dtype and device.
    """
    return fp32 if fp32 is not None else multiplies_in_fp32(x.dtype, x.device)


def multiplies_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prompt products of ``dtype`` activations on ``device`` run in fp32 rather than on
    tensor cores: ``QAT4_PREFILL_FP32=1``, fp32 activations, or a CUDA device without usable
    tensor cores for the dtype (pre-Volta, GTX 16xx, bf16 before sm_80)."""
    if os.environ.get("QAT4_PREFILL_FP32", "0") == "1" or dtype == torch.float32:
        return True
    device = torch.device(device)
    return device.type == "cuda" and not has_tensor_cores(device, dtype)


def w4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fp32: bool | None = None,
              *, gelu: bool = False, up: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Prefill GEMM: x [M, K] @ W.T -> [M, N] in x.dtype, fp32 accumulation.

    Tensor cores in x.dtype (bf16/fp16) unless :func:`prefill_uses_fp32`. With `gelu`, the GELU
    gate of :func:`~qat4.ops.w4.reference.w4_linear_gelu_reference` runs in the epilogue (rows of W
    as gate/up pairs, or times `up` [M, N] when given). `config` pins BLOCK_M, BLOCK_N, BLOCK_G
    (and num_warps, num_stages) instead of autotuning. Launch: :func:`_matmul_kernel`.
    """
    check(x, packed, scales)
    x = x if x.stride(1) == 1 else x.contiguous()
    up = unit_columns(up)
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
