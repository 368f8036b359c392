"""Gemma 4 norms and the GELU gate: RMSNorm, the residual step fused with the next input norm,
and GELU-tanh times up.

Semantics follow transformers 5.17 `models/gemma4/modeling_gemma4.py`:

- RMSNorm: ``x * (mean(x^2) + eps)^-0.5 * w`` in fp32, cast back to the input dtype; no ``1 + w``
  offset; no weight for the V-norm.
- GELU gate: ``gelu_tanh(gate)`` rounded to the activation dtype, times ``up``.
- Residual step: ``(h + RMSNorm(y)) * layer_scalar`` fused with the next sublayer's input norm,
  to save a launch.

Each op has a plain-torch ``*_reference`` and a Triton ``*_triton`` with the same signature; the
public function picks one with :func:`qat4.ops.use_triton`. The GELU gate and the residual step
are also device functions (:func:`gelu_tanh_gate`, :func:`residual_rms_norm_row`) that run in the
epilogues of the :mod:`qat4.ops.w4` kernels; :mod:`qat4.ops.w4.dispatch` owns their dispatch
(``w4_linear_gelu``, ``w4_linear_residual``); the GELU gate has no kernel of its own. The Triton
code keeps HF's rounding points (after the norm, after the sum and the product) so 16-bit results
match HF's eager run. The head norms of attention run fused with RoPE in :mod:`qat4.ops.qkv_prep`.
"""

import torch
import torch.nn.functional as F

from qat4.ops import use_triton
from qat4.ops._triton import tl, triton
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel

# ----------------------------------------------------------------------------------------------
# References


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D]; weight [D] or None (V-norm). Returns x.dtype."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for gate, up [..., I] (e.g. the halves of a fused [T, 2I])."""
    return F.gelu(gate, approximate="tanh") * up


def residual_rms_norm_reference(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sublayer's residual step and the next sublayer's input norm, on rows [T, D].

    h_out = (h + RMSNorm_weight(y)) * scalar (scalar [1], or None for none); x_next =
    RMSNorm_next_weight(h_out), or None when next_weight is None. Rounded to h.dtype after the
    norm, after the sum and after the product, as transformers' eager layer does.
    """
    h_out = h + rms_norm_reference(y, weight, eps)
    if scalar is not None:
        h_out = h_out * scalar
    return h_out, None if next_weight is None else rms_norm_reference(h_out, next_weight, eps)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _rms_norm_kernel(X, W, Y, n_cols, stride_x, stride_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One row per program. X [N, n_cols] (row stride stride_x, unit column stride), W [n_cols],
    Y [N, n_cols]. Grid: (N,). BLOCK = next power of two >= n_cols."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if HAS_W:
        y = y * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def residual_rms_norm_row(H, Y, W, S, NW, HO, XO, n_cols, eps,
                          HAS_S: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
    """One row of :func:`residual_rms_norm_reference`: HO = (H + RMSNorm_W(Y)) * S[0] and, with
    HAS_NEXT, XO = RMSNorm_NW(HO); every pointer at the row's first of n_cols contiguous values.
    Rounds to HO's dtype after the norm, the sum and the product. Y is read past L1 (``.cg``), so
    it may have been written by other programs of the same launch. BLOCK >= n_cols, a power of two."""
    dt = HO.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    y = tl.load(Y + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (y * tl.rsqrt(tl.sum(y * y, axis=0) / n_cols + eps) * w).to(dt)
    h = (tl.load(H + cols, mask=ok, other=0.0) + normed).to(dt)
    if HAS_S:
        h = (h * tl.load(S)).to(dt)
    tl.store(HO + cols, h, mask=ok)
    if HAS_NEXT:
        hf = h.to(tl.float32)
        nw = tl.load(NW + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(XO + cols, (hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps) * nw).to(dt), mask=ok)


@triton.jit
def _residual_rms_norm_kernel(H, Y, W, S, NW, HO, XO, n_cols, eps,
                              HAS_S: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """:func:`residual_rms_norm_row` of contiguous H, Y, HO, XO [N, n_cols]. Grid: (N,)."""
    wait_for_previous_kernel(USE_PDL)
    at = tl.program_id(0) * n_cols
    residual_rms_norm_row(H + at, Y + at, W, S, NW, HO + at, XO + at, n_cols, eps, HAS_S, HAS_NEXT, BLOCK)


@triton.jit
def gelu_tanh_gate(g, u, dt: tl.constexpr):
    """gelu_tanh(g) rounded to dt, times u, rounded to dt: g, u fp32 tensors holding dt values
    (the device form of :func:`gelu_tanh_mul_reference`).

    gelu_tanh(x) = x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3)), the same function as
    0.5 x (1 + tanh(...)) without its cancellation for negative x.
    """
    inner = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2/pi) * (...)
    act = (g / (1.0 + tl.exp(-tl.maximum(inner, -80.0)))).to(dt).to(tl.float32)
    return (act * u).to(dt)


@triton.jit
def _gelu_tanh_mul_kernel(G, U, O, n_cols, stride_gm, stride_gn, stride_um, stride_un, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """O [M, n_cols] (contiguous) = gelu_tanh_gate(G, U) for G, U [M, n_cols] of any strides.
    Grid: (M, cdiv(n_cols, BLOCK))."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + row * n_cols + cols, gelu_tanh_gate(g, u, O.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Triton launchers


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a 2-D [N, D] tensor with unit column stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Triton :func:`rms_norm_reference`."""
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(x2.shape[1])
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2 if weight is None else weight, y, x2.shape[1], x2.stride(0), y.stride(0), eps,
        HAS_W=weight is not None, BLOCK=block, num_warps=max(1, min(8, block // 256)), **pdl_launch(x2, x2.shape[0]),
    )
    return y.reshape(x.shape)


def residual_rms_norm_triton(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton :func:`residual_rms_norm_reference`: one launch, one program per row."""
    h2, y2 = h.reshape(-1, h.shape[-1]).contiguous(), y.reshape(-1, y.shape[-1]).contiguous()
    h_out = torch.empty_like(h2)
    x_next = None if next_weight is None else torch.empty_like(h2)
    block = triton.next_power_of_2(h2.shape[1])
    _residual_rms_norm_kernel[(h2.shape[0],)](
        h2, y2, weight, weight if scalar is None else scalar, weight if next_weight is None else next_weight,
        h_out, h_out if x_next is None else x_next, h2.shape[1], eps,
        HAS_S=scalar is not None, HAS_NEXT=next_weight is not None, BLOCK=block,
        num_warps=max(1, min(8, block // 256)), **pdl_launch(h2, h2.shape[0]),
    )
    return h_out.reshape(h.shape), None if x_next is None else x_next.reshape(h.shape)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton :func:`gelu_tanh_mul_reference` on 2-D gate, up [M, N] of any strides (e.g. the
    alternating columns of a merged gate/up product) -> contiguous [M, N] in gate.dtype."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"gate and up must be 2-D of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    m, n = gate.shape
    if m and n:
        block = min(1024, triton.next_power_of_2(n))
        _gelu_tanh_mul_kernel[(m, triton.cdiv(n, block))](
            gate, up, out, n, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), BLOCK=block,
            num_warps=4, **pdl_launch(gate, m))
    return out


# ----------------------------------------------------------------------------------------------
# Dispatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D], weight [D] or None. See :func:`rms_norm_reference`."""
    return (rms_norm_triton if use_triton(x) else rms_norm_reference)(x, weight, eps)


def residual_rms_norm(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A residual step and the next input norm. See :func:`residual_rms_norm_reference`."""
    fn = residual_rms_norm_triton if use_triton(h) else residual_rms_norm_reference
    return fn(h, y, weight, scalar, next_weight, eps)
