"""Gemma 4 attention over the engine-owned KV cache: decode (split-K) and chunked prefill.

One KV head serves every query head (MQA); logit scale 1.0; no softcap; softmax in fp32. Masks go
by absolute position: a key at position ``kp`` is visible to a query at position ``qp`` iff
``0 <= kp <= qp`` and, with a window ``W`` (sliding layers), ``qp - W < kp``. Negative key
positions mark empty slots. A query that sees no key gets a zero output. Empty slots, and slots
past the newest query position, are never used, so they may hold anything (NaN included).

Cache contract (the engine owns the buffers): K and V are [S, D] in the compute dtype. Full layers
use slot = position; sliding layers a ring of S slots with ``slot_pos`` [S] holding the position
stored in each slot (-1 = empty).

Each entry point has a plain-torch ``*_reference`` and a Triton ``*_triton`` with the same
signature (the Triton one takes extra keyword-only tuning knobs); the public function picks one with
:func:`qat4.ops.use_triton`.

Triton design: one kernel, ``_attn_fwd_kernel``, computes online-softmax attention for a block of
query rows (row = token * H + head, so the 8 heads of a token share each K/V tile read) over one
split of the keys. Decode launches a fixed number of splits per cache size; each split's key range
is computed inside the kernel from the position tensor, so a captured CUDA graph stays valid for
every length and the active length is spread evenly over all splits. With more than one split the
kernel writes fp32 partials (m, l, acc) and ``_attn_merge_kernel`` combines them.
"""

import functools
from typing import NamedTuple

import torch

from qat4.ops import use_triton
from qat4.ops._triton import tl, triton
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel

_NO_WINDOW = 1 << 30  # window value that masks nothing
_MAX_SPLITS = 256
_REFERENCE_SCORE_ELEMENTS = 1 << 24  # fp32 scores per chunk of the reference (64 MiB)

# ----------------------------------------------------------------------------------------------
# Reference


def _masked_attention_reference(q, k, v, q_pos, k_pos, window):
    """q [T, H, D]; k, v [S, D]; q_pos [T], k_pos [S] (int tensors) -> [T, H, D] in q.dtype.

    Explicit fp32 matmul / softmax (never SDPA with broadcast K/V), chunked over tokens. Rows of
    V at empty slots or past the newest query are zeroed, so whatever they hold is never used.
    """
    T, H, _ = q.shape
    kp = k_pos.reshape(1, -1).long()
    unused = (kp < 0) | (kp > q_pos.max())
    kf, vf = k.float(), v.float().masked_fill(unused.reshape(-1, 1), 0.0)
    out = torch.empty_like(q)
    step = max(1, _REFERENCE_SCORE_ELEMENTS // (H * k.shape[0]))
    for t0 in range(0, T, step):
        qp = q_pos[t0 : t0 + step].reshape(-1, 1).long()
        visible = (kp >= 0) & (kp <= qp)
        if window is not None:
            visible &= kp > qp - window
        scores = q[t0 : t0 + step].float() @ kf.T
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[t0 : t0 + step] = (probs @ vf).to(q.dtype)
    return out


def _decode_queries(q, k_cache, window, slot_pos):
    """q [H, D] or [M, H, D] as [M, H, D]; checks that a ring can hold every key the M tokens see."""
    q3 = q if q.dim() == 3 else q[None]
    if slot_pos is not None and window is not None and k_cache.shape[0] < window + q3.shape[0] - 1:
        raise ValueError(f"a ring of {k_cache.shape[0]} slots cannot serve {q3.shape[0]} tokens with window {window}")
    return q3


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    *,
    window: int | None = None,
    slot_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the newest token(s) over a layer's cache.

    q [H, D] for one token at position ``pos``, or [M, H, D] for M tokens at pos .. pos+M-1;
    k_cache, v_cache [S, D]; pos an int tensor with one element; ``slot_pos`` [S] int for a ring
    (None: slot = position); ``window`` W for sliding layers (None: full causal). Keys of every
    query position must already be in the cache (a ring serving M > 1 tokens needs
    S >= W + M - 1 slots). Returns q's shape and dtype.
    """
    q3 = _decode_queries(q, k_cache, window, slot_pos)
    q_pos = pos.reshape(-1)[:1] + torch.arange(q3.shape[0], device=q.device)
    k_pos = slot_pos if slot_pos is not None else torch.arange(k_cache.shape[0], device=q.device)
    return _masked_attention_reference(q3, k_cache, v_cache, q_pos, k_pos, window).reshape(q.shape)


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a chunk of T tokens over the keys it may see.

    q [T, H, D]; k, v [S, D] (sliding layers: previous ring contents then the chunk's own keys);
    q_pos [T], k_pos [S] absolute positions (int; -1 = empty slot). Causal mask and, with
    ``window``, the sliding mask, both by position. Returns [T, H, D] in q.dtype.
    """
    return _masked_attention_reference(q, k, v, q_pos, k_pos, window)


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, QPos, KPos, Out, PartAcc, PartM, PartL,
    n_rows, n_keys, window,
    stride_qt, stride_qh, stride_kn, stride_vn, stride_ot, stride_oh,
    H: tl.constexpr, D: tl.constexpr,
    Q_POS_TENSOR: tl.constexpr, K_POS_TENSOR: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Online-softmax attention of BLOCK_R query rows over one split of the keys.

    Q [T, H, D] (strides stride_qt, stride_qh, 1); rows r = t * H + h, n_rows = T * H.
    K, V [n_keys, D] (row strides stride_kn, stride_vn). Logit scale 1.0.
    Query positions: QPos[t] (Q_POS_TENSOR) or QPos[0] + t (decode). Key positions: KPos[n]
    (K_POS_TENSOR) or n, and then only keys n <= QPos[0] + T - 1 are read.
    Visible iff 0 <= kpos <= qpos and kpos > qpos - window.
    fp32 inputs multiply in full fp32 (no tf32); 16-bit ones on tensor cores with fp32 accumulation.
    SPLIT: write PartM/PartL [n_splits, n_rows] (m in log2 units) and PartAcc [n_splits, n_rows, D]
    fp32 (unnormalised); else write Out [T, H, D] (strides stride_ot, stride_oh, 1) = acc / l.
    Split s covers keys [s * c, (s + 1) * c) with c = ceil(n_keys / n_splits) rounded up to BLOCK_N.
    Grid: (cdiv(n_rows, BLOCK_R), n_splits).
    """
    wait_for_previous_kernel(USE_PDL)
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    t = rows // H
    h = rows % H
    d = tl.arange(0, D)
    q = tl.load(Q + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if Q_POS_TENSOR:
        q_pos = tl.load(QPos + t, mask=row_ok, other=0)
    else:
        q_pos = tl.load(QPos) + t
    if not K_POS_TENSOR:
        n_keys = tl.minimum(n_keys, tl.load(QPos) + n_rows // H)

    chunk = tl.cdiv(tl.cdiv(n_keys, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_keys)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if K_POS_TENSOR:
            k_pos = tl.load(KPos + n, mask=n_ok, other=-1)
        else:
            k_pos = tl.where(n_ok, n, -1)
        used = k_pos >= 0
        k = tl.load(K + n[:, None] * stride_kn + d[None, :], mask=used[:, None], other=0.0)
        v = tl.load(V + n[:, None] * stride_vn + d[None, :], mask=used[:, None], other=0.0)
        visible = used[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * 1.4426950408889634
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if SPLIT:
        part = pid_s * n_rows + rows
        tl.store(PartM + part, m_i, mask=row_ok)
        tl.store(PartL + part, l_i, mask=row_ok)
        tl.store(PartAcc + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = Out + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, o.to(Out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_merge_kernel(
    PartAcc, PartM, PartL, Out, n_rows, n_splits, stride_ot, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Combine the split partials of one query row over a BLOCK_D slice of the head dim.

    PartM, PartL [n_splits, n_rows] fp32 (m in log2 units, -inf for an empty split), PartAcc
    [n_splits, n_rows, D] fp32; Out [T, H, D] (strides stride_ot, stride_oh, 1), row r = t * H + h.
    Empty splits' accumulators are not read. BLOCK_S >= n_splits.
    Grid: (n_rows, D // BLOCK_D).
    """
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < n_splits
    m = tl.load(PartM + s * n_rows + row, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    l = tl.sum(w * tl.load(PartL + s * n_rows + row, mask=s_ok, other=0.0), axis=0)
    used = s_ok & (m > float("-inf"))
    acc = tl.load(PartAcc + (s[:, None] * n_rows + row) * D + d[None, :], mask=used[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(l > 0, l, 1.0)
    t = row // H
    h = row % H
    tl.store(Out + t * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Tiles and splits


class AttentionTiles(NamedTuple):
    """Launch shape of ``_attn_fwd_kernel``: query rows and keys per tile, warps, pipeline stages."""

    block_r: int
    block_n: int
    num_warps: int
    num_stages: int


def attention_tiles(kind: str, head_dim: int, device: torch.device) -> AttentionTiles:
    """Tiles for ``kind`` 'decode' or 'prefill' at ``head_dim`` on ``device``."""
    small_smem = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8
    return _tiles(kind, head_dim, small_smem)


def _tiles(kind: str, head_dim: int, small_smem: bool) -> AttentionTiles:
    """``small_smem``: 64 KiB of shared memory per block (compute capability < 8, e.g. sm_75),
    where Triton stages q, K and V through shared memory without pipelining: at width 512 a
    16-key tile is the most that fits (64 KiB). Larger parts take bigger key tiles, 2 stages
    (the fastest of the shapes timed on an H200 by ``tools/bench_attention.py --sweep``)."""
    wide = head_dim > 256
    if kind == "decode":
        if small_smem:
            return AttentionTiles(16, 16 if wide else 32, 4, 1)
        return AttentionTiles(16, 32 if wide else 64, 4, 2)
    if small_smem:
        return AttentionTiles(16, 16, 4, 1) if wide else AttentionTiles(32, 32, 4, 1)
    return AttentionTiles(64, 32, 8, 2) if wide else AttentionTiles(64, 64, 4, 2)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(cache_len: int, head_dim: int, device: torch.device) -> int:
    """Fixed split count for a cache of ``cache_len`` slots: two programs per SM (at most 256),
    and no more splits than key tiles. Depends on the cache size only, never on the length."""
    block_n = attention_tiles("decode", head_dim, device).block_n
    return max(1, min(triton.cdiv(cache_len, block_n), 2 * _sm_count(device), _MAX_SPLITS))


def _prefill_num_splits(n_keys: int, n_row_blocks: int, device: torch.device) -> int:
    """Splits over the keys so that a short chunk over a long context fills the GPU, with at
    least 1024 keys per split."""
    return max(1, min(triton.cdiv(2 * _sm_count(device), n_row_blocks), triton.cdiv(n_keys, 1024), _MAX_SPLITS))


# ----------------------------------------------------------------------------------------------
# Triton launchers


def _attention_triton(q3, k, v, q_pos, k_pos, window, *, consecutive, num_splits, tiles):
    """Launch the forward (and merge) kernels for q3 [T, H, D] over k, v [S, D].

    ``consecutive``: ``q_pos`` is the one-element position of token 0 (decode), else [T] positions.
    ``k_pos`` [S] or None (key n is at position n). Returns [T, H, D] in q3.dtype.
    """
    T, H, D = q3.shape
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 16")
    if k.dtype != q3.dtype or v.dtype != q3.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q3.dtype}, {k.dtype}, {v.dtype}")
    if q3.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a unit stride along the head dim")
    n_rows = T * H
    out = torch.empty((T, H, D), dtype=q3.dtype, device=q3.device)
    if num_splits > 1:
        part_acc = torch.empty((num_splits, n_rows, D), dtype=torch.float32, device=q3.device)
        part_m = torch.empty((num_splits, n_rows), dtype=torch.float32, device=q3.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    _attn_fwd_kernel[(triton.cdiv(n_rows, tiles.block_r), num_splits)](
        q3, k, v, q_pos, q_pos if k_pos is None else k_pos, out, part_acc, part_m, part_l,
        n_rows, k.shape[0], _NO_WINDOW if window is None else window,
        q3.stride(0), q3.stride(1), k.stride(0), v.stride(0), out.stride(0), out.stride(1),
        H=H, D=D, Q_POS_TENSOR=not consecutive, K_POS_TENSOR=k_pos is not None, SPLIT=num_splits > 1,
        BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_launch(q3, T),
    )
    if num_splits > 1:
        block_s = triton.next_power_of_2(num_splits)
        block_d = min(D, max(16, 4096 // block_s))
        _attn_merge_kernel[(n_rows, D // block_d)](
            part_acc, part_m, part_l, out, n_rows, num_splits, out.stride(0), out.stride(1),
            H=H, D=D, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, **pdl_launch(q3, T),
        )
    return out


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    *,
    window: int | None = None,
    slot_pos: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Triton :func:`decode_attention_reference` (split-K over the cache, then a merge).

    ``num_splits`` defaults to :func:`decode_num_splits` of the cache size and ``tiles`` to
    :func:`attention_tiles`; both depend on shapes only, so the launch can be graph-captured.
    """
    q3 = _decode_queries(q, k_cache, window, slot_pos)
    D = q3.shape[-1]
    out = _attention_triton(
        q3, k_cache, v_cache, pos, slot_pos, window, consecutive=True,
        num_splits=num_splits or decode_num_splits(k_cache.shape[0], D, q.device),
        tiles=tiles or attention_tiles("decode", D, q.device),
    )
    return out.reshape(q.shape)


def prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
    num_splits: int | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Triton :func:`prefill_attention_reference` (flash-attention tiles, key splits when the
    chunk alone cannot fill the GPU)."""
    tiles = tiles or attention_tiles("prefill", q.shape[-1], q.device)
    if num_splits is None:
        n_row_blocks = triton.cdiv(q.shape[0] * q.shape[1], tiles.block_r)
        num_splits = _prefill_num_splits(k.shape[0], n_row_blocks, q.device)
    return _attention_triton(q, k, v, q_pos, k_pos, window, consecutive=False, num_splits=num_splits, tiles=tiles)


# ----------------------------------------------------------------------------------------------
# Dispatch


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    *,
    window: int | None = None,
    slot_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a layer's cache. See :func:`decode_attention_reference`."""
    fn = decode_attention_triton if use_triton(q) else decode_attention_reference
    return fn(q, k_cache, v_cache, pos, window=window, slot_pos=slot_pos)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Chunked-prefill attention. See :func:`prefill_attention_reference`."""
    fn = prefill_attention_triton if use_triton(q) else prefill_attention_reference
    return fn(q, k, v, q_pos, k_pos, window=window)
