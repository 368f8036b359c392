"""Norm / RoPE / GELU ops (qat4.ops.norms, qat4.ops.qkv_prep): references against transformers
5.17's Gemma 4 functions and naive formulas; Triton kernels against the references (CUDA, or the
interpreter in a subprocess)."""

import math

import pytest
import torch

from qat4.ops import norms, qkv_prep
from kernel_harness import KERNEL_DEVICE, kernel_test, run_interpreted

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNEL_DTYPES = [torch.float32, torch.float16]  # the interpreter mishandles bf16


def hf_rotary(head_dim, global_head_dim):
    """transformers' Gemma 4 rotary embedding with the E2B rope parameters (its defaults)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    config = Gemma4TextConfig(
        hidden_size=128, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=1,
        head_dim=head_dim, global_head_dim=global_head_dim, num_kv_shared_layers=0,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
    )
    assert config.rope_parameters["full_attention"]["rope_type"] == "proportional"
    return Gemma4TextRotaryEmbedding(config)


def our_inv_freq(layer_type, head_dim):
    if layer_type == "sliding_attention":
        return qkv_prep.rope_inv_freq(head_dim, 10000.0)
    return qkv_prep.rope_inv_freq(head_dim, 1e6, 0.25, proportional=True)


def full_cos_sin(cache, positions, head_dim):
    """Expand our table to HF's [T, D] cos and sin (``[f, f]`` layout, cos 1 / sin 0 past n_rot)."""
    n_rot = cache.shape[-1] // 2
    pad = head_dim // 2 - n_rot
    cos = torch.nn.functional.pad(cache[positions, :n_rot], (0, pad), value=1.0)
    sin = torch.nn.functional.pad(cache[positions, n_rot:], (0, pad), value=0.0)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


# ----------------------------------------------------------------------------------------------
# References vs transformers


@pytest.mark.parametrize("head_dim,global_head_dim", [(32, 64), (256, 512)])
def test_inv_freq_matches_transformers(head_dim, global_head_dim):
    rotary = hf_rotary(head_dim, global_head_dim)
    for layer_type, dim in (("sliding_attention", head_dim), ("full_attention", global_head_dim)):
        expected = getattr(rotary, f"{layer_type}_inv_freq")
        assert torch.equal(our_inv_freq(layer_type, dim), expected)


def test_e2b_proportional_rope_rotates_dims_0_63_and_256_319_only():
    inv = qkv_prep.rope_inv_freq(512, 1e6, 0.25, proportional=True)
    assert inv.shape == (256,) and bool((inv[:64] > 0).all()) and bool((inv[64:] == 0).all())
    assert inv[1].item() == pytest.approx(1e6 ** (-2 / 512))
    cache = qkv_prep.rope_cos_sin_cache(inv, 1000)
    assert cache.shape == (1000, 128)
    x = torch.randn(1, 1, 512)
    y = qkv_prep.rope_reference(x, torch.tensor([777]), cache)
    moved = (y != x)[0, 0]
    assert bool(moved[:64].all()) and bool(moved[256:320].all())
    assert not bool(moved[64:256].any()) and not bool(moved[320:].any())
    with pytest.raises(ValueError):
        qkv_prep.rope_inv_freq(256, 1e4, 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_cos_sin_and_rope_match_transformers_exactly(dtype, layer_type):
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    rotary = hf_rotary(32, 64)
    dim = 32 if layer_type == "sliding_attention" else 64
    positions = torch.tensor([0, 1, 7, 300, 4095])
    x = torch.randn(len(positions), 3, dim).to(dtype)
    hf_cos, hf_sin = rotary(x, positions[None], layer_type)
    cache = qkv_prep.rope_cos_sin_cache(our_inv_freq(layer_type, dim), 4096, dtype)
    cos, sin = full_cos_sin(cache, positions, dim)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    expected = apply_rotary_pos_emb(x, hf_cos[0], hf_sin[0], unsqueeze_dim=1)
    assert torch.equal(qkv_prep.rope_reference(x, positions, cache), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_matches_transformers_exactly(dtype, with_scale):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    module = Gemma4RMSNorm(96, eps=1e-6, with_scale=with_scale)
    weight = None
    if with_scale:
        with torch.no_grad():
            module.weight.copy_(torch.rand(96) * 20)  # real norm weights are far from 1
        weight = module.weight.detach().to(dtype)
        module = module.to(dtype)
    x = (torch.randn(4, 5, 96) * 3).to(dtype)
    with torch.no_grad():
        expected = module(x)
    assert torch.equal(norms.rms_norm_reference(x, weight), expected)


def test_rms_norm_naive_formula():
    x, w = torch.randn(3, 40), torch.randn(40)
    xd = x.double()
    expected = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(norms.rms_norm_reference(x, w).double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_matches_transformers_and_formula(dtype):
    from transformers.activations import ACT2FN

    gate_up = (torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    gate, up = gate_up[:, :48], gate_up[:, 48:]
    out = norms.gelu_tanh_mul_reference(gate, up)
    assert torch.equal(out, ACT2FN["gelu_pytorch_tanh"](gate) * up)
    g = gate.double()
    naive = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * up.double()
    if dtype == torch.float32:  # 1 + tanh cancels for very negative gates: an error of eps(1) times |g * up| / 2
        atol, rtol = torch.finfo(dtype).eps * float((g * up.double()).abs().max()) / 2, 1e-6
    else:
        atol = rtol = 2e-2
    torch.testing.assert_close(out.double(), naive, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_transformers_attention_prologue(dtype):
    """q_norm -> RoPE, k_norm -> RoPE, v_norm as in Gemma4TextAttention.forward."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

    T, H, D = 4, 8, 64
    rotary = hf_rotary(32, D)
    q_norm, k_norm, v_norm = Gemma4RMSNorm(D), Gemma4RMSNorm(D), Gemma4RMSNorm(D, with_scale=False)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(D) * 10)
        k_norm.weight.copy_(torch.rand(D) * 10)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    q, k, v = (torch.randn(T, n, D).to(dtype) for n in (H, 1, 1))
    positions = torch.tensor([5, 6, 7, 100])
    cos, sin = rotary(q, positions[None], "full_attention")
    with torch.no_grad():
        expected = (
            apply_rotary_pos_emb(q_norm(q), cos[0], sin[0], unsqueeze_dim=1),
            apply_rotary_pos_emb(k_norm(k), cos[0], sin[0], unsqueeze_dim=1),
            v_norm(v),
        )
    cache = qkv_prep.rope_cos_sin_cache(our_inv_freq("full_attention", D), 128, dtype)
    out = qkv_prep.qk_norm_rope_reference(
        q, k, v, positions, cache, q_norm.weight.detach(), k_norm.weight.detach()
    )
    for a, b in zip(out, expected):
        assert torch.equal(a, b)
    shared = qkv_prep.qk_norm_rope_reference(q, None, None, positions, cache, q_norm.weight.detach(), None)
    assert torch.equal(shared[0], expected[0]) and shared[1] is None and shared[2] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_rms_norm_is_the_layers_residual_then_the_next_norm(dtype):
    """(h + norm(y)) * scalar, then the next input norm, each rounded like transformers' layer."""
    h, y = (torch.randn(3, 96) * 4).to(dtype), (torch.randn(3, 96) * 9).to(dtype)
    w, nw = (torch.rand(96) * 10).to(dtype), (torch.rand(96) * 10).to(dtype)
    scalar = torch.tensor([0.4375], dtype=dtype)
    h_out, x = norms.residual_rms_norm_reference(h, y, w, scalar, nw)
    expected = (h + norms.rms_norm_reference(y, w)) * scalar
    assert torch.equal(h_out, expected) and torch.equal(x, norms.rms_norm_reference(expected, nw))
    plain, none = norms.residual_rms_norm_reference(h, y, w)
    assert torch.equal(plain, h + norms.rms_norm_reference(y, w)) and none is None


def test_qk_norm_rope_store_writes_each_token_at_its_row():
    """Token t's k and v land at the pool row of its position in its sequence's pages (blocks of 4:
    sequence 0 holds blocks 0 and 3, sequence 1 block 2); nothing else is written."""
    T, H, D = 3, 8, 32
    q, k, v = torch.randn(T, H, D), torch.randn(T, 1, D), torch.randn(T, 1, D)
    positions, slots = torch.tensor([5, 6, 1]), torch.tensor([0, 0, 1])
    table = torch.tensor([[0, 3, 0], [2, 0, 0]], dtype=torch.int32)
    cache = qkv_prep.rope_cos_sin_cache(our_inv_freq("sliding_attention", D), 16)
    qw, kw = torch.rand(D) * 3, torch.rand(D) * 3
    k_cache, v_cache = torch.zeros(16, D), torch.zeros(16, D)
    rows = torch.tensor([13, 14, 9])  # 3 * 4 + 1, 3 * 4 + 2, 2 * 4 + 1
    q_out = qkv_prep.qk_norm_rope_store_reference(q, k, v, positions, cache, qw, kw, k_cache, v_cache, table, 4, slots)
    eq, ek, ev = qkv_prep.qk_norm_rope_reference(q, k, v, positions, cache, qw, kw)
    assert torch.equal(q_out, eq) and torch.equal(k_cache[rows], ek[:, 0]) and torch.equal(v_cache[rows], ev[:, 0])
    assert int((k_cache.abs().sum(-1) > 0).sum()) == T


def test_public_functions_use_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("QAT4_OPS", "auto")
    x, w = torch.randn(2, 16), torch.randn(16)
    assert torch.equal(norms.rms_norm(x, w), norms.rms_norm_reference(x, w))


# ----------------------------------------------------------------------------------------------
# Triton kernels


def test_triton_kernels_under_interpreter(request):
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1 (shared by the kernel
    test files of the session)."""
    run_interpreted(__file__, request)


def assert_kernel_close(actual, expected):
    """fp32: a few ulp. 16-bit: the kernels round where HF does, but an fp32 intermediate one ulp
    apart can flip a rounding, and RoPE's difference of two rounded products can cancel: allow two
    ulp of the element or of the tensor's mean magnitude, whichever is larger."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        magnitude = expected.double().abs()
        allowed = 2 * torch.finfo(expected.dtype).eps * magnitude.clamp_min(magnitude.mean())
        assert bool(((actual.double() - expected.double()).abs() <= allowed).all())


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).to(KERNEL_DEVICE)


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_rms_norm(dtype):
    for cols in (96, 160):  # not a power of two, like the 1536-wide hidden state
        x, w = rand(3, 5, cols, dtype=dtype, scale=3), rand(cols, dtype=dtype, scale=5)
        assert_kernel_close(norms.rms_norm_triton(x, w), norms.rms_norm_reference(x, w))
        assert_kernel_close(norms.rms_norm_triton(x, None), norms.rms_norm_reference(x, None))
    strided = rand(4, 2 * 96, dtype=dtype)[:, :96]
    assert_kernel_close(norms.rms_norm_triton(strided, None), norms.rms_norm_reference(strided, None))


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("layer_type,dim", [("sliding_attention", 32), ("full_attention", 64)])
def test_kernel_rope_and_qk_norm_rope(dtype, layer_type, dim):
    T, H = 5, 8
    cache = qkv_prep.rope_cos_sin_cache(our_inv_freq(layer_type, dim), 512, dtype).to(KERNEL_DEVICE)
    positions = torch.tensor([0, 3, 4, 200, 511], device=KERNEL_DEVICE)
    qkv = rand(T, (H + 2) * dim, dtype=dtype, scale=2)  # fused projection output: strided views
    q = qkv[:, : H * dim].view(T, H, dim)
    k = qkv[:, H * dim : (H + 1) * dim].view(T, 1, dim)
    v = qkv[:, (H + 1) * dim :].view(T, 1, dim)
    qw, kw = rand(dim, dtype=dtype, scale=4), rand(dim, dtype=dtype, scale=4)
    assert_kernel_close(qkv_prep.rope_triton(q, positions, cache), qkv_prep.rope_reference(q, positions, cache))
    out = qkv_prep.qk_norm_rope_triton(q, k, v, positions, cache, qw, kw)
    for a, b in zip(out, qkv_prep.qk_norm_rope_reference(q, k, v, positions, cache, qw, kw)):
        assert a.shape == b.shape and a.is_contiguous()
        assert_kernel_close(a, b)
    q_only = qkv_prep.qk_norm_rope_triton(q, None, None, positions, cache, qw, None)
    assert_kernel_close(q_only[0], out[0])
    assert q_only[1] is None and q_only[2] is None


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_gelu_tanh_mul_takes_strided_halves(dtype):
    merged = rand(3, 2 * 1100, dtype=dtype, scale=3)  # a merged gate/up product: gate, up alternate
    gate, up = merged[:, 0::2], merged[:, 1::2]
    got = norms.gelu_tanh_mul_triton(gate, up)
    assert got.is_contiguous() and got.shape == (3, 1100)
    assert_kernel_close(got, norms.gelu_tanh_mul_reference(gate, up))
    with pytest.raises(ValueError, match="one shape"):
        norms.gelu_tanh_mul_triton(gate, up[:, :5])


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_residual_rms_norm(dtype):
    h, y = rand(2, 160, dtype=dtype, scale=4), rand(2, 160, dtype=dtype, scale=9)
    w, nw, scalar = rand(160, dtype=dtype, scale=5), rand(160, dtype=dtype, scale=5), rand(1, dtype=dtype)
    for args in ((w, scalar, nw), (w, None, None), (w, scalar, None)):
        got, want = norms.residual_rms_norm_triton(h, y, *args), norms.residual_rms_norm_reference(h, y, *args)
        assert_kernel_close(got[0], want[0])
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            assert_kernel_close(got[1], want[1])


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_qk_norm_rope_store(dtype):
    T, H, dim = 2, 8, 32
    table = qkv_prep.rope_cos_sin_cache(our_inv_freq("sliding_attention", dim), 64, dtype).to(KERNEL_DEVICE)
    positions, slots = torch.tensor([13, 14], device=KERNEL_DEVICE), torch.tensor([1, 0], device=KERNEL_DEVICE)
    block_table = torch.tensor([[6, 7], [0, 2]], dtype=torch.int32, device=KERNEL_DEVICE)  # blocks of 8
    rows = torch.tensor([21, 62], device=KERNEL_DEVICE)  # 2 * 8 + 5, 7 * 8 + 6
    qkv = rand(T, (H + 2) * dim, dtype=dtype, scale=2)
    q, k, v = qkv[:, : H * dim].view(T, H, dim), qkv[:, H * dim : (H + 1) * dim].view(T, 1, dim), qkv[:, (H + 1) * dim :].view(T, 1, dim)
    qw, kw = rand(dim, dtype=dtype, scale=4), rand(dim, dtype=dtype, scale=4)
    caches = []
    for fn in (qkv_prep.qk_norm_rope_store_triton, qkv_prep.qk_norm_rope_store_reference):
        kc, vc = (torch.full((64, dim), float("nan"), dtype=dtype, device=KERNEL_DEVICE) for _ in range(2))
        caches.append((fn(q, k, v, positions, table, qw, kw, kc, vc, block_table, 8, slots), kc, vc))
    (q1, k1, v1), (q2, k2, v2) = caches
    assert_kernel_close(q1, q2)
    for a, b in ((k1, k2), (v1, v2)):
        assert_kernel_close(a[rows], b[rows])
        assert int(torch.isnan(a).any(-1).sum()) == 64 - T  # only the two rows were written
