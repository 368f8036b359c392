"""Attention and norm kernels at Gemma 4 E2B shapes on a CUDA GPU, in bf16 and fp16, against the
torch references: decode rows of 1 to 64 sequences over paged KV up to 131,072 keys, prompt chunks,
decode replayed from a CUDA graph at changing positions; the attention tiles chosen for
64-KiB-shared-memory parts (sm_75) compiled for sm_75."""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qat4.ops import attention as attn
from qat4.ops import norms, qkv_prep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, CACHE, W = 8, 131072, 512
DTYPES = [torch.bfloat16, torch.float16]


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda").to(dtype)


def assert_attention_close(actual, expected):
    """16-bit P.V operands: relative error against the fp32-softmax reference well under 1e-2."""
    err = (actual.float() - expected.float()).norm() / expected.float().norm()
    assert actual.dtype == expected.dtype and err < 1e-2, err


def paged(lengths, D, dtype, BS=16):
    """Keys and values of sequences of these lengths in one pool of shuffled blocks, the block
    table, and each sequence's contiguous history."""
    blocks = [-(-n // BS) for n in lengths]
    order = torch.randperm(sum(blocks), device="cuda").int() + 1
    k = rand((sum(blocks) + 1) * BS, D, dtype=dtype)
    v = rand((sum(blocks) + 1) * BS, D, dtype=dtype)
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device="cuda")
    at = 0
    for r, b in enumerate(blocks):
        table[r, :b] = order[at : at + b]
        at += b
    return k, v, table


def seqs(q_lens, ends):
    positions = torch.cat([torch.arange(e - n, e) for n, e in zip(q_lens, ends)]).cuda()
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda")
    return attn.PagedSeqs(positions, cu, torch.arange(len(q_lens), device="cuda"), max(q_lens), max(ends))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_at_e2b_lengths(dtype):
    """One decode row per sequence, 1 .. 131,072 keys, full layers (512 wide) and the sliding window (256)."""
    lengths = [1, 31, 512, 513, 4097, 65536, CACHE]
    for D, window in ((512, None), (256, W)):
        k, v, table = paged(lengths, D, dtype)
        q = rand(len(lengths), H, D, dtype=dtype)
        args = (q, k, v, table, 16, seqs([1] * len(lengths), lengths))
        assert_attention_close(attn.paged_attention_triton(*args, window=window),
                               attn.paged_attention_reference(*args, window=window))


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_batches_of_sequences(batch):
    dtype = torch.bfloat16
    lengths = torch.randint(1, 9000, (batch,)).tolist()
    for D, window in ((512, None), (256, W)):
        k, v, table = paged(lengths, D, dtype)
        q = rand(batch, H, D, dtype=dtype)
        args = (q, k, v, table, 16, seqs([1] * batch, lengths))
        assert_attention_close(attn.paged_attention_triton(*args, window=window),
                               attn.paged_attention_reference(*args, window=window))


def test_decode_graph_replay_follows_the_positions():
    """One capture; replays at other positions (other split boundaries) stay right."""
    dtype = torch.bfloat16
    lengths = [CACHE, CACHE]
    k, v, table = paged(lengths, 512, dtype)
    kr, vr, tr = paged(lengths, 256, dtype)
    q, qr = rand(2, H, 512, dtype=dtype), rand(2, H, 256, dtype=dtype)
    batch = seqs([1, 1], [8, 8])
    step = lambda: (  # noqa: E731
        attn.paged_attention_triton(q, k, v, table, 16, batch._replace(max_keys=CACHE)),
        attn.paged_attention_triton(qr, kr, vr, tr, 16, batch._replace(max_keys=CACHE), window=W),
    )
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        full_out, ring_out = step()
    for newest in ((7, 600), (20000, 3), (CACHE - 1, 513)):
        batch.positions.copy_(torch.tensor(newest))
        graph.replay()
        now = batch._replace(max_keys=CACHE)
        assert_attention_close(full_out, attn.paged_attention_reference(q, k, v, table, 16, now))
        assert_attention_close(ring_out, attn.paged_attention_reference(qr, kr, vr, tr, 16, now, window=W))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 700, 4096, 32768])
def test_prompt_chunks(dtype, start):
    """A 256-token chunk at `start` beside a 64-token one at 0, both layer types."""
    T = 256
    ends = [start + T, 64]
    for D, window in ((512, None), (256, W)):
        k, v, table = paged(ends, D, dtype)
        q = rand(T + 64, H, D, dtype=dtype)
        args = (q, k, v, table, 16, seqs([T, 64], ends))
        assert_attention_close(attn.paged_attention_triton(*args, window=window),
                               attn.paged_attention_reference(*args, window=window))


def _compile_for_sm75(kind, head_dim, split):
    tiles = attn._tiles(kind, head_dim, small_smem=True)
    signature = {name: "i32" for name in attn._paged_attn_kernel.arg_names}
    signature.update({name: "*fp16" for name in ("Q", "K", "V", "Out")})
    signature.update({name: "*fp32" for name in ("PartAcc", "PartM", "PartL")})
    signature.update({"Pos": "*i64", "CuQ": "*i64", "SeqRows": "*i64", "BlockTable": "*i32"})
    constexprs = {"H": H, "D": head_dim, "BS": 16, "SPLIT": split, "BLOCK_R": tiles.block_r,
                  "BLOCK_N": tiles.block_n, "BLOCK_B": 0, "USE_PDL": False}  # PDL needs sm_90
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(attn._paged_attn_kernel, signature, constexprs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 75, 32), options=options)


@pytest.mark.parametrize("kind,split", [("decode", True), ("prefill", False), ("prefill", True)])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_sm75_tiles_fit_64_kib_of_shared_memory(kind, split, head_dim):
    assert _compile_for_sm75(kind, head_dim, split).metadata.shared <= 64 * 1024


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernels_at_e2b_shapes(dtype):
    x, w = rand(3, 1536, dtype=dtype) * 4, rand(1536, dtype=dtype) * 10
    assert_rounding_close(norms.rms_norm_triton(x, w), norms.rms_norm_reference(x, w))
    for D, inv in ((256, qkv_prep.rope_inv_freq(256, 1e4)),
                   (512, qkv_prep.rope_inv_freq(512, 1e6, 0.25, proportional=True))):
        cache = qkv_prep.rope_cos_sin_cache(inv.cuda(), CACHE, dtype)
        qkv = rand(4, (H + 2) * D, dtype=dtype) * 3
        q, k, v = qkv[:, : H * D].view(4, H, D), qkv[:, H * D : (H + 1) * D].view(4, 1, D), qkv[:, (H + 1) * D :].view(4, 1, D)
        positions = torch.tensor([0, 511, 4096, CACHE - 1], device="cuda")
        qw, kw = rand(D, dtype=dtype) * 5, rand(D, dtype=dtype) * 5
        got = qkv_prep.qk_norm_rope_triton(q, k, v, positions, cache, qw, kw)
        for a, b in zip(got, qkv_prep.qk_norm_rope_reference(q, k, v, positions, cache, qw, kw)):
            assert_rounding_close(a, b)


def assert_rounding_close(actual, expected):
    """Same rounding points as the reference, fp32 intermediates an ulp apart (rsqrt, FMA): two
    16-bit ulp of the element or of the tensor's mean magnitude (RoPE differences cancel)."""
    magnitude = expected.float().abs()
    allowed = 2 * torch.finfo(expected.dtype).eps * magnitude.clamp_min(magnitude.mean())
    assert actual.dtype == expected.dtype
    assert bool(((actual.float() - expected.float()).abs() <= allowed).all())
