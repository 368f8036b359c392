"""Attention and norm kernels at Gemma 4 E2B shapes on a CUDA GPU, in bf16 and fp16, against the
torch references; decode replayed from a CUDA graph at changing positions; the attention tiles
chosen for 64-KiB-shared-memory parts (sm_75) compiled for sm_75."""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qat4.ops import attention as attn
from qat4.ops import norms

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


def ring_positions(newest, slots):
    """slot_pos of a ring after writing positions 0..newest at slot = position % slots."""
    pos = torch.arange(slots, device="cuda")
    pos = newest - (newest - pos) % slots
    return torch.where(pos >= 0, pos, -1).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_full_cache_at_e2b_lengths(dtype):
    k, v = rand(CACHE, 512, dtype=dtype), rand(CACHE, 512, dtype=dtype)
    q = rand(H, 512, dtype=dtype)
    for length in (1, 31, 512, 513, 4097, 65536, CACHE):
        pos = torch.tensor(length - 1, device="cuda")
        assert_attention_close(attn.decode_attention_triton(q, k, v, pos), attn.decode_attention_reference(q, k, v, pos))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sliding_ring_at_e2b_shape(dtype):
    k, v = rand(W, 256, dtype=dtype), rand(W, 256, dtype=dtype)
    for newest in (0, 100, 511, 512, 5000):
        q, pos, slot_pos = rand(H, 256, dtype=dtype), torch.tensor([newest], device="cuda"), ring_positions(newest, W)
        kw = dict(window=W, slot_pos=slot_pos)
        assert_attention_close(attn.decode_attention_triton(q, k, v, pos, **kw), attn.decode_attention_reference(q, k, v, pos, **kw))


@pytest.mark.parametrize("M", [2, 5, 16])
def test_decode_several_tokens(M):
    dtype = torch.bfloat16
    pos = torch.tensor(3000, device="cuda")
    q, k, v = rand(M, H, 512, dtype=dtype), rand(8192, 512, dtype=dtype), rand(8192, 512, dtype=dtype)
    assert_attention_close(attn.decode_attention_triton(q, k, v, pos), attn.decode_attention_reference(q, k, v, pos))
    slots = W + M - 1
    q, k, v = rand(M, H, 256, dtype=dtype), rand(slots, 256, dtype=dtype), rand(slots, 256, dtype=dtype)
    kw = dict(window=W, slot_pos=ring_positions(3000 + M - 1, slots))
    assert_attention_close(attn.decode_attention_triton(q, k, v, pos, **kw), attn.decode_attention_reference(q, k, v, pos, **kw))


def test_decode_graph_replay_follows_the_position_tensor():
    """One capture per layer type; replays at other positions (other split boundaries) stay right."""
    dtype = torch.bfloat16
    k, v, q = rand(CACHE, 512, dtype=dtype), rand(CACHE, 512, dtype=dtype), rand(H, 512, dtype=dtype)
    kr, vr, qr = rand(W, 256, dtype=dtype), rand(W, 256, dtype=dtype), rand(H, 256, dtype=dtype)
    pos = torch.tensor([7], device="cuda")
    slot_pos = ring_positions(7, W)
    step = lambda: (
        attn.decode_attention_triton(q, k, v, pos),
        attn.decode_attention_triton(qr, kr, vr, pos, window=W, slot_pos=slot_pos),
    )
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        full_out, ring_out = step()
    for newest in (7, 600, 20000, CACHE - 1):
        pos.fill_(newest)
        slot_pos.copy_(ring_positions(newest, W))
        graph.replay()
        assert_attention_close(full_out, attn.decode_attention_reference(q, k, v, pos))
        assert_attention_close(ring_out, attn.decode_attention_reference(qr, kr, vr, pos, window=W, slot_pos=slot_pos))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_sliding_ring_plus_chunk(dtype):
    T, start = 256, 3000
    q_pos = torch.arange(start, start + T, device="cuda")
    k_pos = torch.cat([ring_positions(start - 1, W), q_pos.to(torch.int32)])
    q, k, v = rand(T, H, 256, dtype=dtype), rand(W + T, 256, dtype=dtype), rand(W + T, 256, dtype=dtype)
    args = (q, k, v, q_pos, k_pos)
    assert_attention_close(attn.prefill_attention_triton(*args, window=W), attn.prefill_attention_reference(*args, window=W))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_keys", [256, 700, 4096 + 256, 32768])
def test_prefill_full_layer(dtype, n_keys):
    T = 256
    k_pos = torch.arange(n_keys, device="cuda")
    q, k, v = rand(T, H, 512, dtype=dtype), rand(n_keys, 512, dtype=dtype), rand(n_keys, 512, dtype=dtype)
    args = (q, k, v, k_pos[-T:], k_pos)
    assert_attention_close(attn.prefill_attention_triton(*args), attn.prefill_attention_reference(*args))


def _compile_for_sm75(kind, head_dim, split):
    tiles = attn._tiles(kind, head_dim, small_smem=True)
    signature = {name: "i32" for name in attn._attn_fwd_kernel.arg_names}
    signature.update({name: "*fp16" for name in ("Q", "K", "V", "Out")})
    signature.update({name: "*fp32" for name in ("PartAcc", "PartM", "PartL")})
    signature.update({"QPos": "*i64", "KPos": "*i32"})
    constexprs = {"H": H, "D": head_dim, "Q_POS_TENSOR": kind == "prefill", "K_POS_TENSOR": True, "SPLIT": split,
                  "BLOCK_R": tiles.block_r, "BLOCK_N": tiles.block_n, "USE_PDL": False}  # PDL needs sm_90
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(attn._attn_fwd_kernel, signature, constexprs)
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
    for D, inv in ((256, norms.rope_inv_freq(256, 1e4)), (512, norms.rope_inv_freq(512, 1e6, 0.25, proportional=True))):
        cache = norms.rope_cos_sin_cache(inv.cuda(), CACHE, dtype)
        qkv = rand(4, (H + 2) * D, dtype=dtype) * 3
        q, k, v = qkv[:, : H * D].view(4, H, D), qkv[:, H * D : (H + 1) * D].view(4, 1, D), qkv[:, (H + 1) * D :].view(4, 1, D)
        positions = torch.tensor([0, 511, 4096, CACHE - 1], device="cuda")
        qw, kw = rand(D, dtype=dtype) * 5, rand(D, dtype=dtype) * 5
        got = norms.qk_norm_rope_triton(q, k, v, positions, cache, qw, kw)
        for a, b in zip(got, norms.qk_norm_rope_reference(q, k, v, positions, cache, qw, kw)):
            assert_rounding_close(a, b)


def assert_rounding_close(actual, expected):
    """Same rounding points as the reference, fp32 intermediates an ulp apart (rsqrt, FMA): two
    16-bit ulp of the element or of the tensor's mean magnitude (RoPE differences cancel)."""
    magnitude = expected.float().abs()
    allowed = 2 * torch.finfo(expected.dtype).eps * magnitude.clamp_min(magnitude.mean())
    assert actual.dtype == expected.dtype
    assert bool(((actual.float() - expected.float()).abs() <= allowed).all())
