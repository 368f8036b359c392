"""Attention ops: references against a naive per-query formula and transformers' Gemma 4 eager
attention; Triton kernels against the references.

The kernel tests run on CUDA when present, else under the Triton interpreter: a plain `pytest`
starts them in a subprocess with TRITON_INTERPRET=1 (Triton reads it when kernels are defined).
The interpreter mishandles bf16, so kernels are checked there in fp32 and fp16 only. transformers
is imported inside the tests that use it, to keep the interpreter subprocess light.
"""

import types

import pytest
import torch
from kernel_harness import KERNEL_DEVICE, kernel_test, run_interpreted
from qat4.ops import attention as attn

H = 8


# ----------------------------------------------------------------------------------------------
# Helpers


def naive_attention(q, k, v, q_pos, k_pos, window):
    """Per-query float64 loop; visibility from transformers' own mask functions (by position)."""
    from transformers import masking_utils

    if window is None:
        visible_fn = masking_utils.causal_mask_function
    else:
        visible_fn = masking_utils.sliding_window_causal_mask_function(window)
    out = torch.zeros(q.shape, dtype=torch.float64)
    k_pos = torch.as_tensor(k_pos).long()
    zero = torch.tensor(0)
    for t in range(q.shape[0]):
        visible = (k_pos >= 0) & visible_fn(zero, zero, torch.tensor(int(q_pos[t])), k_pos)
        keys = visible.nonzero()[:, 0]
        if keys.numel() == 0:
            continue
        kk, vv = k[keys].double(), v[keys].double()
        for h in range(q.shape[1]):
            w = torch.softmax(kk @ q[t, h].double(), dim=0)
            out[t, h] = w @ vv
    return out


class Pool:
    """A paged pool holding the keys and values of several sequences' histories: blocks of BS rows
    in shuffled order (block 0 unused), every row no sequence owns NaN, so a kernel that reads one
    shows it."""

    def __init__(self, lengths, D, BS=4, dtype=torch.float32, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        blocks = [-(-n // BS) for n in lengths]
        order = (torch.randperm(sum(blocks), generator=g) + 1).tolist()
        self.bs, self.lengths = BS, lengths
        self.k = torch.full((sum(blocks) * BS + BS, D), float("nan"), dtype=dtype)
        self.v = self.k.clone()
        self.table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
        self.history = []
        for r, n in enumerate(lengths):
            mine, order = order[: blocks[r]], order[blocks[r] :]
            self.table[r, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            k_hist, v_hist = rand(n, D, dtype=dtype), rand(n, D, dtype=dtype)
            rows = self.table[r, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS
            self.k[rows], self.v[rows] = k_hist, v_hist
            self.history.append((k_hist, v_hist))
        self.k, self.v, self.table = self.k.to(device), self.v.to(device), self.table.to(device)

    def forget_before(self, row, first):
        """Poison the positions before ``first`` of sequence ``row`` (its sliding blocks given back)."""
        p = torch.arange(first, device=self.table.device)
        rows = self.table[row, p // self.bs].long() * self.bs + p % self.bs
        self.k[rows] = float("nan")
        self.v[rows] = float("nan")


def seqs_of(q_lens, ends, rows, device="cpu"):
    """PagedSeqs for sequences with q_lens[b] query tokens ending at position ends[b] - 1."""
    positions = torch.cat([torch.arange(e - n, e) for n, e in zip(q_lens, ends)]).to(device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device)
    return attn.PagedSeqs(positions, cu, torch.tensor(rows, device=device), max(q_lens), max(ends))


def expected_of(pool, q, q_lens, ends, rows, window):
    out = []
    t = 0
    for n, e, r in zip(q_lens, ends, rows):
        k_hist, v_hist = pool.history[r]
        out.append(naive_attention(q[t : t + n].cpu(), k_hist[:e], v_hist[:e], range(e - n, e), torch.arange(e), window))
        t += n
    return torch.cat(out)


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def assert_close(actual, expected, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_naive_for_decode_rows_and_chunks(window):
    """Three sequences in shuffled pages: one decode row at position 0, one at 18, and a 5-token
    chunk ending at 23; on a sliding layer the pages before each window are poisoned."""
    D = 32
    pool = Pool([1, 19, 23], D)
    q_lens, ends, rows = [1, 1, 5], [1, 19, 23], [0, 1, 2]
    if window:
        pool.forget_before(1, 19 - window)
        pool.forget_before(2, 23 - 5 - window + 1)
    q = rand(sum(q_lens), H, D)
    out = attn.paged_attention_reference(q, pool.k, pool.v, pool.table, pool.bs, seqs_of(q_lens, ends, rows), window=window)
    assert_close(out, expected_of(pool, q, q_lens, ends, rows, window), torch.float32)


def test_reference_writes_into_out():
    D = 32
    pool = Pool([10], D)
    q = rand(2, H, D)
    out = torch.full((5, H, D), float("nan"))
    attn.paged_attention_reference(q, pool.k, pool.v, pool.table, pool.bs, seqs_of([2], [10], [0]), out=out[3:])
    assert torch.isnan(out[:3]).all() and torch.isfinite(out[3:]).all()


def test_reference_matches_transformers_eager_attention():
    """transformers' Gemma 4 eager attention (scale 1.0, repeat_kv over 8 heads) with its own mask."""
    from transformers import masking_utils
    from transformers.models.gemma4 import modeling_gemma4

    D, W, T = 64, 8, 20
    pool = Pool([T], D)
    k, v = pool.history[0]
    q = rand(T, H, D)
    positions = torch.arange(T)
    mask_fn = masking_utils.sliding_window_causal_mask_function(W)
    zero = torch.tensor(0)
    mask = mask_fn(zero, zero, positions[:, None], positions[None, :])
    additive = torch.zeros(T, T).masked_fill(~mask, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=H, training=False)
    expected, _ = modeling_gemma4.eager_attention_forward(
        module, q.transpose(0, 1)[None], k[None, None], v[None, None], additive, scaling=1.0
    )
    out = attn.paged_attention_reference(q, pool.k, pool.v, pool.table, pool.bs, seqs_of([T], [T], [0]), window=W)
    assert_close(out, expected[0], torch.float32)


def test_public_function_uses_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("QAT4_OPS", "auto")
    D = 32
    pool = Pool([9], D)
    q = rand(1, H, D)
    args = (q, pool.k, pool.v, pool.table, pool.bs, seqs_of([1], [9], [0]))
    assert torch.equal(attn.paged_attention(*args), attn.paged_attention_reference(*args))


def test_splits_fill_two_programs_per_sm_and_never_start_a_third_wave():
    tiles = attn.AttentionTiles(16, 64, 4, 2)
    cpu = torch.device("cpu")  # 4 "SMs" off CUDA
    assert attn.num_splits(1, 1, 131072, tiles, cpu) == 8
    assert attn.num_splits(3, 1, 131072, tiles, cpu) == 2  # 6 programs: 3 splits would make 9 of 8
    assert attn.num_splits(8, 1, 131072, tiles, cpu) == 1
    assert attn.num_splits(5, 1, 131072, tiles, cpu) == 1
    assert attn.num_splits(1, 1, 100, tiles, cpu) == 2  # no more splits than key tiles
    assert attn.num_splits(1, 2, 3000, tiles, cpu, chunk=True) == 3  # prompt chunks: >= 1024 keys per split
    assert attn.num_splits(1, 2, 3000, tiles, cpu) == 4  # a few tokens (drafts): as for one


# ----------------------------------------------------------------------------------------------
# Triton kernels


def test_triton_kernels_under_interpreter(request):
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1 (shared by the kernel
    test files of the session)."""
    run_interpreted(__file__, request)




KERNEL_DTYPES = [torch.float32, torch.float16]


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 3), (8, 1), (8, 2)])
def test_kernel_decode_rows(dtype, window, splits):
    """Four sequences of one token at positions 0, 7, 40 and 70 (D=64), pages shuffled, pages out
    of every window poisoned."""
    dev, D = KERNEL_DEVICE, 64
    ends = [1, 8, 41, 71]
    pool = Pool(ends, D, dtype=dtype, device=dev)
    if window:
        for r, e in enumerate(ends):
            pool.forget_before(r, max(0, e - window))
    q = rand(4, H, D, dtype=dtype, device=dev)
    seqs = seqs_of([1] * 4, ends, [0, 1, 2, 3], dev)
    args = (q, pool.k, pool.v, pool.table, pool.bs, seqs)
    out = attn.paged_attention_triton(*args, window=window, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, expected_of(pool, q, [1] * 4, ends, [0, 1, 2, 3], window).to(dtype), dtype)


@kernel_test
def test_kernel_decode_rows_split_past_the_merge_widths_kept_compiled(monkeypatch):
    """An explicit split count past _MAX_SPLITS (``tools/bench_attention.py --sweep``) merges its
    partials with a merge kernel as wide as its next power of two."""
    monkeypatch.setattr(attn, "_MAX_SPLITS", 16)
    assert (attn.merge_width(16), attn.merge_width(17), attn.merge_width(40)) == (16, 32, 64)
    dev, D, ends = KERNEL_DEVICE, 64, [700, 90]
    pool = Pool(ends, D, device=dev)
    q = rand(2, H, D, device=dev)
    seqs = seqs_of([1, 1], ends, [0, 1], dev)
    out = attn.paged_attention_triton(q, pool.k, pool.v, pool.table, pool.bs, seqs, splits=20)
    assert_close(out, expected_of(pool, q, [1, 1], ends, [0, 1], None), torch.float32)


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 2), (8, 1), (8, 3)])
def test_kernel_prompt_chunks(dtype, window, splits):
    """An 11-token chunk at positions 37..47 and a 3-token chunk at 0..2 in one launch, with the
    default 64-row tiles and with 16-row tiles (several row blocks per sequence)."""
    dev, D = KERNEL_DEVICE, 32
    q_lens, ends, rows = [11, 3], [48, 3], [1, 0]
    pool = Pool([3, 48], D, dtype=dtype, device=dev, seed=1)
    if window:
        pool.forget_before(1, 37 - window + 1)
    q = rand(14, H, D, dtype=dtype, device=dev)
    expected = expected_of(pool, q, q_lens, ends, rows, window).to(dtype)
    for tiles in (None, attn.AttentionTiles(16, 16, 4, 1)):
        out = attn.paged_attention_triton(q, pool.k, pool.v, pool.table, pool.bs, seqs_of(q_lens, ends, rows, dev),
                                          window=window, splits=splits, tiles=tiles)
        assert_close(out, expected, dtype)


@kernel_test
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 2), (8, 1)])
def test_kernel_ragged_prompt_chunks_with_empty_sequences_and_padding(window, splits):
    """Prompt chunks of 37, 0, 5, 20 and 0 tokens and 3 padding rows of no sequence (a padded
    graph's batch): the row blocks numbered back to back, with 64- and 16-row tiles (without key
    splits); without key splits the padding rows are never written (the merge of splits writes
    every row)."""
    dev, D = KERNEL_DEVICE, 32
    q_lens, ends, rows = [37, 0, 5, 20, 0], [60, 9, 5, 20, 4], [0, 1, 2, 3, 4]
    pool = Pool(ends, D, device=dev, seed=2)
    if window:
        for r, (n, e) in enumerate(zip(q_lens, ends)):
            pool.forget_before(r, max(0, e - n - window + 1))
    T = sum(q_lens)
    q = rand(T + 3, H, D, device=dev)
    seqs = seqs_of(q_lens, ends, rows, dev)
    seqs = seqs._replace(positions=torch.cat([seqs.positions, torch.zeros(3, dtype=torch.int64, device=dev)]))
    expected = expected_of(pool, q, q_lens, ends, rows, window)
    # with key splits once: their merge of every row is the interpreter's slowest launch
    for tiles in (None, attn.AttentionTiles(16, 16, 4, 1)) if splits == 1 else (None,):
        out = torch.full_like(q, float("nan"))
        attn.paged_attention_triton(q, pool.k, pool.v, pool.table, pool.bs, seqs, window=window, splits=splits,
                                    tiles=tiles, out=out)
        assert_close(out[:T], expected, torch.float32)
        assert torch.isnan(out[T:]).all() or splits > 1


@kernel_test
def test_kernel_strided_query_and_out_slice():
    """q as a view of a fused projection; the output written into a slice of a larger tensor."""
    dev, D, T = KERNEL_DEVICE, 32, 5
    fused = rand(T, (H + 2) * D, device=dev)
    q = fused[:, : H * D].view(T, H, D)
    pool = Pool([9], D, device=dev)
    seqs = seqs_of([T], [9], [0], dev)
    out = torch.full((T + 2, H, D), float("nan"), device=dev)
    attn.paged_attention_triton(q, pool.k, pool.v, pool.table, pool.bs, seqs, out=out[2:], splits=2)
    assert torch.isnan(out[:2]).all()
    assert_close(out[2:], expected_of(pool, q, [T], [9], [0], None), torch.float32)
