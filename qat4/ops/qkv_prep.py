"""Attention's input preparation: head norms, rotary embedding, and the decode step's KV-cache
write, in one Triton kernel (:func:`_qkv_norm_rope_kernel`) per attention layer.

The kernel normalises each head row of q and k (RMSNorm with weight) and of v (the V-norm, no
weight), rotates q and k, and, in a decode step, stores k and v straight into the layer's cache
rows. Why one module rather than a RoPE module and a KV-store module: norm, RoPE and store are
not three kernels but one, a single launch for every head of q, k and v whose programs each run
:func:`_norm_rope_row` on one head row, so either module would hold a part of the same kernel.
Plain RoPE (:func:`rope_triton`) is that kernel with the norm off. The plain norms it builds on
are in :mod:`qat4.ops.norms`.

Semantics follow transformers 5.17 `models/gemma4/modeling_gemma4.py`:

- RoPE: rotate-half layout with the ``[f, f]`` frequency vector; cos/sin are computed in fp32 and
  cast to the activation dtype before ``x * cos + rotate_half(x) * sin`` runs in that dtype.
  Proportional RoPE (full-attention layers) has zero frequencies past the first
  ``int(factor * head_dim // 2)`` pairs, so only dims ``[0, n_rot)`` and ``[D/2, D/2 + n_rot)``
  rotate. :func:`rope_inv_freq` and :func:`rope_cos_sin_cache` build the tables the kernel reads.
- Head norms: :func:`qat4.ops.norms.rms_norm_reference` per head, before RoPE.

Each op has a plain-torch ``*_reference`` and a Triton ``*_triton`` with the same signature; the
public function (:func:`qk_norm_rope`, :func:`qk_norm_rope_store`) picks one with
:func:`qat4.ops.use_triton`. The Triton code keeps HF's rounding points (after the norm, after each
RoPE product) so 16-bit results match HF's eager run.
"""

import torch
import torch.nn.functional as F

from qat4.ops import use_triton
from qat4.ops._triton import tl, triton
from qat4.ops.attention import pool_rows
from qat4.ops.norms import rms_norm_reference
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel

# ----------------------------------------------------------------------------------------------
# RoPE tables


def rope_inv_freq(
    head_dim: int, theta: float, partial_rotary_factor: float = 1.0, proportional: bool = False
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, as HF builds them for Gemma 4.

    ``proportional=False`` is Gemma 4's ``default`` type (sliding layers): every pair rotates and
    ``partial_rotary_factor`` must be 1. ``proportional=True`` is the ``proportional`` type (full
    layers): the first ``int(partial_rotary_factor * head_dim // 2)`` pairs get
    ``theta^(-2j / head_dim)`` (exponent over the whole head dim) and the rest are zero.
    """
    if not proportional:
        if partial_rotary_factor != 1.0:
            raise ValueError("default RoPE rotates every pair; partial_rotary_factor must be 1.0")
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    n_rot = int(partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * n_rot, 2, dtype=torch.int64).to(torch.float) / head_dim
    rotated = 1.0 / (theta**exponents)
    return torch.cat([rotated, torch.zeros(head_dim // 2 - n_rot, dtype=torch.float32)])


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """cos/sin table [max_positions, 2 * n_rot]: ``[:, :n_rot]`` cos, ``[:, n_rot:]`` sin.

    ``n_rot`` counts the non-zero frequencies of ``inv_freq`` (they lead, zeros trail); the
    pairs past it have cos 1 and sin 0 and are not stored. Angles are ``fp32(pos * f)`` and cos/sin
    are taken in fp32 exactly as HF does, then cast to ``dtype``: building the table in the
    activation dtype reproduces HF's own cast (E2B at 131,072 positions in bf16: 32 MiB for full
    layers, 64 MiB for sliding layers).
    """
    n_rot = int((inv_freq != 0).sum())
    if not bool((inv_freq[:n_rot] != 0).all()):
        raise ValueError("inv_freq must hold its non-zero frequencies first")
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    angles = positions[:, None] * inv_freq[None, :n_rot].float()
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


# ----------------------------------------------------------------------------------------------
# References


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] at positions [T] (int) with a table from :func:`rope_cos_sin_cache`."""
    half = x.shape[-1] // 2
    n_rot = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].to(x.dtype)
    cos = F.pad(cs[:, :n_rot], (0, half - n_rot), value=1.0)
    sin = F.pad(cs[:, n_rot:], (0, half - n_rot), value=0.0)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    return x * cos + _rotate_half(x) * sin


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Head norms + RoPE of one attention layer.

    q [T, H, D] -> RoPE(RMSNorm_{q_weight}(q)); k [T, Hk, D] -> RoPE(RMSNorm_{k_weight}(k));
    v [T, Hk, D] -> RMSNorm(v) without weight. k, v (and k_weight) are None on KV-shared layers.
    positions [T] int. Returns new tensors (q, k, v), None where the input was None.
    """
    q = rope_reference(rms_norm_reference(q, q_weight, eps), positions, cos_sin_cache)
    if k is not None:
        k = rope_reference(rms_norm_reference(k, k_weight, eps), positions, cos_sin_cache)
    if v is not None:
        v = rms_norm_reference(v, None, eps)
    return q, k, v


def qk_norm_rope_store_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slots: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """:func:`qk_norm_rope_reference` whose k and v [T, 1, D] go straight into a layer's pages.

    k_cache, v_cache [S, D], a paged pool (:mod:`qat4.ops.attention`'s contract): token t, of the
    sequence in block_table row slots[t] [T] int64, is stored at row ``block_table[slots[t],
    positions[t] // block_size] * block_size + positions[t] % block_size``
    (:func:`~qat4.ops.attention.pool_rows`). Returns the rotated q [T, H, D].
    """
    q, k, v = qk_norm_rope_reference(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps)
    rows = pool_rows(block_table, block_size, slots, positions)
    k_cache.index_copy_(0, rows, k[:, 0])
    v_cache.index_copy_(0, rows, v[:, 0])
    return q


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _norm_rope_row(
    X, Y, W, CS, n_rot, eps,
    NORM: tl.constexpr, HAS_W: tl.constexpr, ROPE: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    """Norm and/or rotate one head row X[0:2*HALF] into Y. CS points at this position's table row
    (cos[0:n_rot] then sin[0:n_rot]). Rounds to Y's dtype where HF does: after the norm and after
    each RoPE product and the sum."""
    dt = Y.dtype.element_ty
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    lo = tl.load(X + j, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(X + HALF + j, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
        lo = lo * inv
        hi = hi * inv
        if HAS_W:
            lo = lo * tl.load(W + j, mask=ok, other=0.0).to(tl.float32)
            hi = hi * tl.load(W + HALF + j, mask=ok, other=0.0).to(tl.float32)
        lo = lo.to(dt).to(tl.float32)
        hi = hi.to(dt).to(tl.float32)
    if ROPE:
        rot = j < n_rot
        c = tl.load(CS + j, mask=rot, other=1.0).to(dt).to(tl.float32)
        s = tl.load(CS + n_rot + j, mask=rot, other=0.0).to(dt).to(tl.float32)
        lo_c = (lo * c).to(dt).to(tl.float32)
        hi_c = (hi * c).to(dt).to(tl.float32)
        lo_s = (lo * s).to(dt).to(tl.float32)
        hi_s = (hi * s).to(dt).to(tl.float32)
        lo, hi = lo_c - hi_s, hi_c + lo_s
    tl.store(Y + j, lo.to(dt), mask=ok)
    tl.store(Y + HALF + j, hi.to(dt), mask=ok)


@triton.jit(do_not_specialize=["Pos", "Slots", "Table"])
def _qkv_norm_rope_kernel(
    Q, K, V, QO, KO, VO, QW, KW, CS, Pos, Slots, Table,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_tab, n_rot, eps,
    HQ: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, NORM: tl.constexpr,
    STORE: tl.constexpr, BS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Per-head norm + RoPE of q, k and the V-norm of v, one launch.

    Q [T, HQ, D], K [T, HK, D], V [T, HV, D] (any token/head strides, unit dim stride; HK = HV = 0
    when absent); QO contiguous [T, HQ, D]; QW, KW [D]; CS [P, 2 * n_rot]; Pos [T] int.
    NORM=False only rotates q (plain RoPE). D = 2 * HALF. KO/VO are contiguous [T, HK, D], or,
    with STORE (HK = HV = 1), a layer's paged cache [S, D] written at the pool row of token t's
    position: Table[Slots[t], Pos[t] // BS] * BS + Pos[t] % BS (Slots [T] int64, Table [R, W]
    int32, row stride stride_tab). Positions, slots and tables come from the host, so they and the
    row are read before the PDL wait.
    Grid: (T, HQ + HK + HV); program (t, h) handles one head row.
    """
    t = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(Pos + t)
    cs = CS + p * stride_cs
    if STORE:
        seq = tl.load(Slots + t).to(tl.int64)
        slot = tl.load(Table + seq * stride_tab + p // BS).to(tl.int64) * BS + p % BS
    else:
        slot = t.to(tl.int64)
    wait_for_previous_kernel(USE_PDL)
    if h < HQ:
        _norm_rope_row(Q + t * stride_qt + h * stride_qh, QO + (t * HQ + h) * (2 * HALF), QW, cs, n_rot, eps,
                       NORM, NORM, True, HALF, BLOCK)
    elif h < HQ + HK:
        hk = h - HQ
        dst = KO + slot * (2 * HALF) if STORE else KO + (t * HK + hk) * (2 * HALF)
        _norm_rope_row(K + t * stride_kt + hk * stride_kh, dst, KW, cs, n_rot, eps, True, True, True, HALF, BLOCK)
    else:
        hv = h - HQ - HK
        dst = VO + slot * (2 * HALF) if STORE else VO + (t * HV + hv) * (2 * HALF)
        _norm_rope_row(V + t * stride_vt + hv * stride_vh, dst, KW, cs, n_rot, eps, True, False, False, HALF, BLOCK)


# ----------------------------------------------------------------------------------------------
# Triton launchers


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Triton :func:`qk_norm_rope_reference`: one launch for every head of q, k and v."""
    return _launch_norm_rope(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, norm=True)


def rope_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Triton :func:`rope_reference`."""
    return _launch_norm_rope(x, None, None, positions, cos_sin_cache, None, None, 0.0, norm=False)[0]


def qk_norm_rope_store_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slots: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton :func:`qk_norm_rope_store_reference`: the same single launch, k and v written into the pages."""
    return _launch_norm_rope(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, norm=True,
                             cache=(k_cache, v_cache, block_table, block_size, slots))[0]


def _launch_norm_rope(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps, norm, cache=None):
    q = _heads(q)
    k = None if k is None else _heads(k)
    v = None if v is None else _heads(v)
    T, HQ, D = q.shape
    HK = 0 if k is None else k.shape[1]
    HV = 0 if v is None else v.shape[1]
    qo = torch.empty((T, HQ, D), dtype=q.dtype, device=q.device)
    if cache is None:
        ko = None if k is None else torch.empty((T, HK, D), dtype=k.dtype, device=k.device)
        vo = None if v is None else torch.empty((T, HV, D), dtype=v.dtype, device=v.device)
        table, block_size, slots = positions, 1, positions
    else:
        ko, vo, table, block_size, slots = cache
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    block = triton.next_power_of_2(D // 2)
    _qkv_norm_rope_kernel[(T, HQ + HK + HV)](
        q, q if k is None else k, q if v is None else v,
        qo, qo if ko is None else ko, qo if vo is None else vo,
        q if q_weight is None else q_weight, q if k_weight is None else k_weight, cs, positions, slots, table,
        q.stride(0), q.stride(1),
        0 if k is None else k.stride(0), 0 if k is None else k.stride(1),
        0 if v is None else v.stride(0), 0 if v is None else v.stride(1),
        cs.stride(0), table.stride(0), cs.shape[-1] // 2, eps,
        HQ=HQ, HK=HK, HV=HV, NORM=norm, STORE=cache is not None, BS=block_size, HALF=D // 2, BLOCK=block,
        num_warps=max(1, min(4, block // 64)), **pdl_launch(q, T),
    )
    return qo, None if cache else ko, None if cache else vo


# ----------------------------------------------------------------------------------------------
# Dispatch


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slots: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Head norms + RoPE with k, v stored into a layer's pages. See :func:`qk_norm_rope_store_reference`."""
    fn = qk_norm_rope_store_triton if use_triton(q) else qk_norm_rope_store_reference
    return fn(q, k, v, positions, cos_sin_cache, q_weight, k_weight, k_cache, v_cache, block_table, block_size, slots,
              eps)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Head norms + RoPE of one attention layer. See :func:`qk_norm_rope_reference`."""
    fn = qk_norm_rope_triton if use_triton(q) else qk_norm_rope_reference
    return fn(q, k, v, positions, cos_sin_cache, q_weight, k_weight, eps)
