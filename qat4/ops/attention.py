"""Gemma 4 attention over a paged KV pool: one kernel for decode rows and prompt chunks alike.

One KV head serves every query head (MQA); logit scale 1.0; no softcap; softmax in fp32. A key at
position ``kp`` is visible to a query at position ``qp`` iff ``kp <= qp`` and, with a window ``W``
(sliding layers), ``qp - W < kp``. A query that sees no key gets a zero output.

Pool contract (the engine's :mod:`qat4.engine.kv_cache` owns the buffers): a KV-owning layer's K
and V are [num_blocks * BS, D] in the compute dtype; the key of a sequence's position ``p`` is row
``block_table[r, p // BS] * BS + p % BS``, where ``r`` is the sequence's row of the block table.
Every key a query may see has been written before the attention runs (the K/V store of the same
forward comes first). Block-table entries of positions a query cannot see (past its position,
or before its window on a sliding layer, whose blocks the engine frees) are never read.

A batch (:class:`PagedSeqs`) holds the query tokens of B sequences back to back: sequence ``b``
owns q rows ``cu_q[b] .. cu_q[b + 1] - 1``, each with its own position. A decode step is B
sequences of one token; a prompt chunk is one sequence of many; speculative verification is
sequences of a few.

Each entry point has a plain-torch ``*_reference`` and a Triton ``*_triton`` with the same
signature (the Triton one takes extra keyword-only tuning knobs); :func:`paged_attention` picks one
with :func:`qat4.ops.use_triton`.

Triton design: ``_paged_attn_kernel`` computes online-softmax attention for a block of query rows
(row = token * H + head, so the 8 heads of a token share each K/V tile read) of one sequence over
one split of the keys that block can see; the split bounds come from the positions inside the
kernel, so a captured CUDA graph stays valid at every length, and the active length is spread
evenly over all splits. With more than one split the kernel writes fp32 partials (m, l, acc) and
``_attn_merge_kernel`` combines them. (Merging in the last split program of each row block
instead, on a ticket, made every decode step on an H200 114-154 µs longer than the separate merge
launches, which cost 61-93 µs: BENCHMARKS.md, 2026-12-03.)
"""

import functools
from typing import NamedTuple

import torch

from qat4.ops import use_triton
from qat4.ops._triton import tl, triton
from qat4.ops.pdl import pdl_launch, wait_for_previous_kernel

_NO_WINDOW = 1 << 30  # window value that masks nothing
_MAX_SPLITS = 256
DECODE_QUERIES = 16  # at most this many query tokens per sequence: decode tiles and fine key splits


class PagedSeqs(NamedTuple):
    """The query side of a paged attention call (module docstring).

    positions [T] int64: position of each query token; cu_q [B + 1] int32: first q row of each
    sequence, then T; rows [B] int32: each sequence's row of the block table. max_q_len (host):
    the most query tokens one sequence has (sizes the grid); max_keys (host): a bound on the keys
    one sequence's queries see, e.g. the context length (sizes the key splits).
    """

    positions: torch.Tensor
    cu_q: torch.Tensor
    rows: torch.Tensor
    max_q_len: int
    max_keys: int


def pool_rows(block_table: torch.Tensor, block_size: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pool rows [T] int64 of positions [T] of the sequences in block-table rows slots [T] (the
    pool contract above; device tensors, graph-capturable)."""
    return block_table[slots, positions // block_size].long() * block_size + positions % block_size


# ----------------------------------------------------------------------------------------------
# Reference


def _query_attention_reference(q, k, v):
    """One query token q [H, D] over exactly the keys it sees, k, v [S, D] -> [H, D] in q.dtype:
    explicit fp32 matmul and softmax, never SDPA with broadcast K/V."""
    probs = torch.softmax(q.float() @ k.float().T, dim=-1)
    return (probs @ v.float()).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    seqs: PagedSeqs,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the query tokens of several sequences over their pages of a layer's pool.

    q [T, H, D] (rows of the sequences back to back, see :class:`PagedSeqs`); k_pool, v_pool
    [num_blocks * block_size, D]; block_table [R, max_blocks] int32. Returns [T, H, D] in q.dtype,
    written into ``out`` when given.

    Each query token attends on its own to exactly the keys it sees (positions p - W + 1 .. p, or
    from 0 without a window), gathered through its sequence's table row: its result depends on its
    position and the K/V before it, never on which tokens share its step or where a chunk began,
    so a prompt read from any block boundary on (a prompt-cache hit) or token by token (a decode)
    gets the same fp32 results as one read whole.
    """
    out = torch.empty_like(q) if out is None else out
    cu, rows, positions = seqs.cu_q.tolist(), seqs.rows.tolist(), seqs.positions.tolist()
    for b, row in enumerate(rows):
        for t in range(cu[b], cu[b + 1]):
            p = positions[t]
            k_pos = torch.arange(0 if window is None else max(0, p - window + 1), p + 1, device=q.device)
            slots = block_table[row, k_pos // block_size].long() * block_size + k_pos % block_size
            out[t] = _query_attention_reference(q[t], k_pool[slots], v_pool[slots])
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _ragged_block(CuQ, n_seqs, H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, its row block) of program p = tl.program_id(0) when the row blocks of B =
    n_seqs sequences (CuQ [B + 1]; sequence b has cdiv((CuQ[b + 1] - CuQ[b]) * H, BLOCK_R) of them,
    none when empty) are numbered back to back; BLOCK_B >= B. A program past the last block gets
    sequence B (no sequence)."""
    p = tl.program_id(0)
    b = tl.arange(0, BLOCK_B)
    b_ok = b < n_seqs
    lengths = tl.load(CuQ + b + 1, mask=b_ok, other=0) - tl.load(CuQ + b, mask=b_ok, other=0)
    blocks = tl.cdiv(lengths * H, BLOCK_R)
    ends = tl.cumsum(blocks, axis=0)
    seq = tl.sum((ends <= p).to(tl.int32), axis=0)
    before = tl.sum(tl.where(b < seq, blocks, 0), axis=0)
    return seq, p - before


@triton.jit(do_not_specialize=["Pos", "CuQ", "SeqRows", "n_rows", "n_seqs"])
def _paged_attn_kernel(
    Q, K, V, Out, PartAcc, PartM, PartL, Pos, CuQ, SeqRows, BlockTable,
    n_rows, n_seqs, window,
    stride_qt, stride_qh, stride_kn, stride_vn, stride_ot, stride_oh, stride_bt,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Online-softmax attention of BLOCK_R query rows of one sequence over one split of its keys.

    Q [T, H, D] (strides stride_qt, stride_qh, 1); rows r = t * H + h, n_rows = T * H. Pos [T]
    int64 query positions; CuQ [B + 1] int32 first token of each sequence; SeqRows [B] int32 its
    block-table row; BlockTable [R, max_blocks] int32 (row stride stride_bt). K, V [blocks * BS, D]
    (row strides stride_kn, stride_vn); the key of position n is row BlockTable[seq, n // BS] * BS
    + n % BS. The block sees keys lo .. hi - 1 with hi = max(q_pos) + 1 and lo = max(0, min(q_pos)
    - window + 1); only those are loaded. Visible iff kpos <= qpos and kpos > qpos - window.
    fp32 inputs multiply in full fp32 (no tf32); 16-bit ones on tensor cores with fp32 accumulation.
    SPLIT: write PartM/PartL [n_splits, n_rows] (m in log2 units) and PartAcc [n_splits, n_rows, D]
    fp32 (unnormalised); else write Out [T, H, D] (strides stride_ot, stride_oh, 1) = acc / l.
    Split s covers keys [lo + s * c, lo + (s + 1) * c) with c = ceil((hi - lo) / n_splits) rounded
    up to BLOCK_N.
    Grid: (cdiv(max_q_len * H, BLOCK_R), n_splits, B) with BLOCK_B = 0; blocks past a sequence's
    rows store nothing. Or *ragged* (BLOCK_B >= B = n_seqs, a power of two): (cdiv(T * H, BLOCK_R)
    + B, n_splits, 1), the sequences' row blocks numbered back to back (:func:`_ragged_block`), so
    that sequences of very different lengths (prompt chunks of several sequences padded to a
    graph's size) launch about as many programs as their rows need; programs past the last block
    store nothing.
    """
    pid_s = tl.program_id(1)
    if BLOCK_B:
        seq, pid_r = _ragged_block(CuQ, n_seqs, H, BLOCK_R, BLOCK_B)
        live = seq < n_seqs
        seq = tl.minimum(seq, n_seqs - 1)
    else:
        pid_r = tl.program_id(0)
        seq = tl.program_id(2)
    t_begin = tl.load(CuQ + seq)
    t_end = tl.load(CuQ + seq + 1)
    if BLOCK_B:
        t_end = tl.where(live, t_end, t_begin)
    rows = t_begin * H + pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < t_end * H
    t = rows // H
    h = rows % H
    d = tl.arange(0, D)
    q_pos = tl.load(Pos + t, mask=row_ok, other=0)
    hi = tl.max(tl.where(row_ok, q_pos + 1, 0), axis=0)
    lo = tl.maximum(tl.min(tl.where(row_ok, q_pos, hi), axis=0) - window + 1, 0)
    table = BlockTable + tl.load(SeqRows + seq).to(tl.int64) * stride_bt

    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), tl.num_programs(1)), BLOCK_N) * BLOCK_N
    first = lo + pid_s * chunk
    last = tl.minimum(first + chunk, hi)
    # positions, sequence bounds and block tables come from the host, never from an earlier kernel:
    # read before the wait (the first key tile's blocks too), the chain of dependent loads runs
    # while the previous kernel finishes
    n = first + tl.arange(0, BLOCK_N)
    block = tl.load(table + n // BS, mask=n < last, other=0).to(tl.int64)
    wait_for_previous_kernel(USE_PDL)
    q = tl.load(Q + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for start in range(first, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < last
        slot = block * BS + n % BS
        k = tl.load(K + slot[:, None] * stride_kn + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vn + d[None, :], mask=n_ok[:, None], other=0.0)
        # the next tile's blocks, fetched while this tile's keys arrive
        block = tl.load(table + (n + BLOCK_N) // BS, mask=n + BLOCK_N < last, other=0).to(tl.int64)
        visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
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


@triton.jit(do_not_specialize=["n_rows", "n_splits"])
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
    """Launch shape of ``_paged_attn_kernel``: query rows and keys per tile, warps, pipeline stages."""

    block_r: int
    block_n: int
    num_warps: int
    num_stages: int


def attention_tiles(max_q_len: int, head_dim: int, device: torch.device) -> AttentionTiles:
    """Tiles for sequences of at most ``max_q_len`` query tokens at ``head_dim`` on ``device``:
    16-row blocks for a few tokens per sequence (decode), 64-row blocks for prompt chunks."""
    small_smem = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8
    return _tiles("decode" if max_q_len <= DECODE_QUERIES else "prefill", head_dim, small_smem)


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


def num_splits(n_seqs: int, row_blocks: int, max_keys: int, tiles: AttentionTiles, device: torch.device,
               chunk: bool = False) -> int:
    """Key splits for ``n_seqs`` sequences of ``row_blocks`` query blocks each over at most
    ``max_keys`` keys: the most splits that keep the programs within two per SM (at least one, at
    most 256), no more splits than key tiles, and for prompt chunks (``chunk``: more than
    DECODE_QUERIES tokens per sequence) at least 1024 keys per split. A decode tile's K/V stages
    take more than half an H200 SM's shared memory, so an SM runs one program at a time: two per
    SM are two waves, and one program more starts a third (16 sequences over 131,072 keys each: 17
    splits took 1,571 µs a layer, 16 splits 999; ``tools/bench_attention.py --sweep``). A decode
    step's few tokens per sequence (one, or a speculative step's newest token and drafts) split as
    finely as the keys allow. Depends on shapes and bounds only, never on the positions, so a
    captured graph serves every length."""
    want = 2 * _sm_count(device) // max(1, n_seqs * row_blocks)
    keys_per_split = 1024 if chunk else tiles.block_n
    return max(1, min(want, triton.cdiv(max_keys, keys_per_split), _MAX_SPLITS))


def merge_width(splits: int) -> int:
    """BLOCK_S of the merge for ``splits`` partials: 16 or _MAX_SPLITS, two compiled kernels
    whatever the split counts of a server's prompt chunks (a count of its own would compile
    mid-step when a chunk first needs it). A count past _MAX_SPLITS, which only an explicit
    ``splits`` asks for (``tools/bench_attention.py --sweep``), gets its next power of two."""
    return 16 if splits <= 16 else max(_MAX_SPLITS, triton.next_power_of_2(splits))


# ----------------------------------------------------------------------------------------------
# Triton launcher


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    seqs: PagedSeqs,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Triton :func:`paged_attention_reference` (key splits, then a merge when there are several).

    ``splits`` defaults to :func:`num_splits` and ``tiles`` to :func:`attention_tiles`; both depend
    on shapes and host bounds only, so the launch can be graph-captured. ``out`` [T, H, D] needs a
    unit stride along the head dim.
    """
    T, H, D = q.shape
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 16")
    if block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} must be a power of two")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("q, k and v need a unit stride along the head dim")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device) if out is None else out
    n_seqs = seqs.rows.shape[0]
    if T == 0 or n_seqs == 0:
        return out
    tiles = tiles or attention_tiles(seqs.max_q_len, D, q.device)
    chunk = seqs.max_q_len > DECODE_QUERIES
    ragged = chunk and n_seqs > 1
    if ragged:  # every sequence's row blocks back to back: at most one partial block each
        block_b = max(16, triton.next_power_of_2(n_seqs))
        grid_seqs, row_blocks = 1, triton.cdiv(T * H, tiles.block_r) + n_seqs
    else:
        block_b, grid_seqs, row_blocks = 0, n_seqs, triton.cdiv(seqs.max_q_len * H, tiles.block_r)
    max_keys = seqs.max_keys if window is None else min(seqs.max_keys, window + seqs.max_q_len - 1)
    splits = splits or num_splits(grid_seqs, row_blocks, max_keys, tiles, q.device, chunk)
    grid = (row_blocks, splits, grid_seqs)
    n_rows = T * H
    if splits > 1:
        part_acc = torch.empty((splits, n_rows, D), dtype=torch.float32, device=q.device)
        part_m = torch.empty((splits, n_rows), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    pdl = pdl_launch(q, seqs.max_q_len)
    _paged_attn_kernel[grid](
        q, k_pool, v_pool, out, part_acc, part_m, part_l, seqs.positions, seqs.cu_q, seqs.rows, block_table,
        n_rows, n_seqs, _NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1), k_pool.stride(0), v_pool.stride(0), out.stride(0), out.stride(1),
        block_table.stride(0),
        H=H, D=D, BS=block_size, SPLIT=splits > 1, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
        BLOCK_B=block_b, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl,
    )
    if splits > 1:
        block_s = merge_width(splits)
        block_d = min(D, max(16, 4096 // block_s))
        _attn_merge_kernel[(n_rows, D // block_d)](
            part_acc, part_m, part_l, out, n_rows, splits, out.stride(0), out.stride(1),
            H=H, D=D, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, **pdl,
        )
    return out


# ----------------------------------------------------------------------------------------------
# Dispatch


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    seqs: PagedSeqs,
    *,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a paged pool. See :func:`paged_attention_reference`."""
    fn = paged_attention_triton if use_triton(q) else paged_attention_reference
    return fn(q, k_pool, v_pool, block_table, block_size, seqs, window=window, out=out)
