"""Attention ops: references against a naive per-query formula and transformers' Gemma 4 eager
attention; Triton kernels against the references.

The kernel tests run on CUDA when present, else under the Triton interpreter: a plain `pytest`
starts them in a subprocess with TRITON_INTERPRET=1 (Triton reads it when kernels are defined).
The interpreter mishandles bf16, so kernels are checked there in fp32 and fp16 only. transformers
is imported inside the tests that use it, to keep the interpreter subprocess light.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from qat4.ops import attention as attn

H = 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)
kernel_test = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")


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


def ring_from_history(k_hist, v_hist, n_written, slots):
    """Ring of ``slots`` after writing positions 0 .. n_written-1 at slot = position % slots."""
    D = k_hist.shape[1]
    k_ring = torch.full((slots, D), float("nan"), dtype=k_hist.dtype)  # empty slots may hold anything
    v_ring = torch.full((slots, D), float("nan"), dtype=k_hist.dtype)
    slot_pos = torch.full((slots,), -1, dtype=torch.int32)
    for p in range(n_written):
        k_ring[p % slots], v_ring[p % slots], slot_pos[p % slots] = k_hist[p], v_hist[p], p
    return k_ring, v_ring, slot_pos


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def assert_close(actual, expected, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("pos", [0, 1, 17, 63])
def test_decode_reference_full_layer_matches_naive(pos):
    D, S = 32, 64
    q, k, v = rand(H, D), rand(S, D), rand(S, D)
    out = attn.decode_attention_reference(q, k, v, torch.tensor(pos))
    expected = naive_attention(q[None], k, v, [pos], torch.arange(S), None)[0]
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("n_written", [1, 5, 8, 9, 30])
def test_decode_reference_ring_matches_window_over_history(n_written):
    """A ring of W slots (wrapped or not, empty slots included) gives the window over the history."""
    D, W = 32, 8
    k_hist, v_hist = rand(n_written, D), rand(n_written, D)
    k_ring, v_ring, slot_pos = ring_from_history(k_hist, v_hist, n_written, W)
    q = rand(H, D)
    pos = n_written - 1
    out = attn.decode_attention_reference(q, k_ring, v_ring, torch.tensor([pos]), window=W, slot_pos=slot_pos)
    expected = naive_attention(q[None], k_hist, v_hist, [pos], torch.arange(n_written), W)[0]
    assert_close(out, expected, torch.float32)


def test_decode_reference_several_tokens_on_a_larger_ring():
    D, W, M, n_written = 32, 8, 3, 21
    slots = W + M - 1
    k_hist, v_hist = rand(n_written, D), rand(n_written, D)
    k_ring, v_ring, slot_pos = ring_from_history(k_hist, v_hist, n_written, slots)
    q = rand(M, H, D)
    pos = n_written - M
    out = attn.decode_attention_reference(q, k_ring, v_ring, torch.tensor(pos), window=W, slot_pos=slot_pos)
    expected = naive_attention(q, k_hist, v_hist, range(pos, pos + M), torch.arange(n_written), W)
    assert_close(out, expected, torch.float32)
    with pytest.raises(ValueError, match="ring"):
        attn.decode_attention_reference(q, k_ring[:W], v_ring[:W], torch.tensor(pos), window=W, slot_pos=slot_pos[:W])


def test_prefill_reference_sliding_ring_plus_chunk_matches_naive():
    """Sliding prefill: keys = previous ring (wrapped, in slot order) + the chunk's own keys."""
    D, W, start, T = 32, 8, 13, 6
    k_hist, v_hist = rand(start + T, D), rand(start + T, D)
    k_ring, v_ring, slot_pos = ring_from_history(k_hist, v_hist, start, W)
    k = torch.cat([k_ring, k_hist[start:]])
    v = torch.cat([v_ring, v_hist[start:]])
    k_pos = torch.cat([slot_pos, torch.arange(start, start + T, dtype=torch.int32)])
    q, q_pos = rand(T, H, D), torch.arange(start, start + T)
    out = attn.prefill_attention_reference(q, k, v, q_pos, k_pos, window=W)
    assert_close(out, naive_attention(q, k_hist, v_hist, q_pos, torch.arange(start + T), W), torch.float32)


def test_prefill_reference_full_layer_matches_naive():
    D, start, T = 32, 13, 6
    k, v = rand(start + T, D), rand(start + T, D)
    q, q_pos = rand(T, H, D), torch.arange(start, start + T)
    out = attn.prefill_attention_reference(q, k, v, q_pos, torch.arange(start + T))
    assert_close(out, naive_attention(q, k, v, q_pos, torch.arange(start + T), None), torch.float32)


def test_prefill_reference_matches_transformers_eager_attention():
    """transformers' Gemma 4 eager attention (scale 1.0, repeat_kv over 8 heads) with its own mask."""
    from transformers import masking_utils
    from transformers.models.gemma4 import modeling_gemma4

    D, W, T = 64, 8, 20
    q, k, v = rand(T, H, D), rand(T, D), rand(T, D)
    positions = torch.arange(T)
    mask_fn = masking_utils.sliding_window_causal_mask_function(W)
    zero = torch.tensor(0)
    mask = mask_fn(zero, zero, positions[:, None], positions[None, :])
    additive = torch.zeros(T, T).masked_fill(~mask, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=H, training=False)
    expected, _ = modeling_gemma4.eager_attention_forward(
        module, q.transpose(0, 1)[None], k[None, None], v[None, None], additive, scaling=1.0
    )
    out = attn.prefill_attention_reference(q, k, v, positions, positions, window=W)
    assert_close(out, expected[0], torch.float32)


def test_reference_gives_zero_for_a_query_that_sees_nothing():
    D = 32
    q, k, v = rand(2, H, D), rand(4, D), rand(4, D)
    out = attn.prefill_attention_reference(q, k, v, torch.tensor([3, 9]), torch.tensor([-1, -1, 5, 6]), window=4)
    assert torch.equal(out[0], torch.zeros(H, D))
    assert torch.isfinite(out).all()


def test_public_functions_use_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("QAT4_OPS", "auto")
    D, S = 32, 16
    q, k, v = rand(H, D), rand(S, D), rand(S, D)
    pos = torch.tensor(9)
    assert torch.equal(attn.decode_attention(q, k, v, pos), attn.decode_attention_reference(q, k, v, pos))


# ----------------------------------------------------------------------------------------------
# Triton kernels


def test_triton_kernels_under_interpreter():
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1."""
    if KERNEL_DEVICE is not None:
        pytest.skip("kernel tests run in this process")
    run_interpreted(__file__, "kernel")


def run_interpreted(test_file, keyword):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(test_file).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", keyword, str(test_file)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


KERNEL_DTYPES = [torch.float32, torch.float16]


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("D,S,pos,splits", [(32, 100, 70, 3), (64, 300, 299, 4), (32, 100, 0, 5), (64, 200, 130, 1)])
def test_kernel_decode_full(dtype, D, S, pos, splits):
    dev = KERNEL_DEVICE
    q, k, v = rand(H, D, dtype=dtype, device=dev), rand(S, D, dtype=dtype, device=dev), rand(S, D, dtype=dtype, device=dev)
    k[pos + 1 :] = float("nan")  # slots past the position are never read
    v[pos + 1 :] = float("nan")
    p = torch.tensor(pos, device=dev)
    out = attn.decode_attention_triton(q, k, v, p, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, attn.decode_attention_reference(q, k, v, p), dtype)


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("n_written,splits", [(1, 1), (5, 2), (8, 3), (29, 2), (30, 1)])
def test_kernel_decode_ring(dtype, n_written, splits):
    """Rings of 8 slots (D=32) and 64 slots (D=64), with empty, wrapped and garbage slots."""
    for D, slots in ((32, 8), (64, 64)):
        k_hist, v_hist = rand(n_written, D, dtype=dtype), rand(n_written, D, dtype=dtype)
        k_ring, v_ring, slot_pos = (t.to(KERNEL_DEVICE) for t in ring_from_history(k_hist, v_hist, n_written, slots))
        q = rand(H, D, dtype=dtype, device=KERNEL_DEVICE)
        pos = torch.tensor([n_written - 1], device=KERNEL_DEVICE)
        args = (q, k_ring, v_ring, pos)
        out = attn.decode_attention_triton(*args, window=8, slot_pos=slot_pos, num_splits=splits)
        assert_close(out, attn.decode_attention_reference(*args, window=8, slot_pos=slot_pos), dtype)


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_decode_several_tokens(dtype):
    dev, D = KERNEL_DEVICE, 32
    q, k, v = rand(3, H, D, dtype=dtype, device=dev), rand(90, D, dtype=dtype, device=dev), rand(90, D, dtype=dtype, device=dev)
    pos = torch.tensor(60, device=dev)  # rows 24 > one 16-row block
    assert_close(attn.decode_attention_triton(q, k, v, pos, num_splits=3), attn.decode_attention_reference(q, k, v, pos), dtype)
    slot_pos = torch.arange(90, device=dev, dtype=torch.int64) % 10 + 55  # ring of 10 slots, window 8
    ring = (q, k[:10], v[:10], pos)
    expected = attn.decode_attention_reference(*ring, window=8, slot_pos=slot_pos[:10])
    assert_close(attn.decode_attention_triton(*ring, window=8, slot_pos=slot_pos[:10], num_splits=2), expected, dtype)


@kernel_test
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 3), (8, 1), (8, 2)])
def test_kernel_prefill(dtype, window, splits):
    """Chunk of 11 tokens at positions 37..47 over [wrapped ring of 8 ; chunk] or the full prefix."""
    dev, D, start, T = KERNEL_DEVICE, 64, 37, 11
    q = rand(T, H, D, dtype=dtype, device=dev)
    q_pos = torch.arange(start, start + T, device=dev)
    if window is None:
        k, v = rand(start + T, D, dtype=dtype, device=dev), rand(start + T, D, dtype=dtype, device=dev)
        k_pos = torch.arange(start + T, device=dev, dtype=torch.int32)
    else:
        k, v = rand(8 + T, D, dtype=dtype, device=dev), rand(8 + T, D, dtype=dtype, device=dev)
        ring_pos = torch.tensor([32, 33, 34, 35, 36, 29, 30, 31])
        k_pos = torch.cat([ring_pos, q_pos.cpu()]).to(dev)
    args = (q, k, v, q_pos, k_pos)
    out = attn.prefill_attention_triton(*args, window=window, num_splits=splits)
    assert_close(out, attn.prefill_attention_reference(*args, window=window), dtype)


@kernel_test
def test_kernel_prefill_strided_query_and_empty_rows():
    """q as a view of a fused projection; a query with no visible key gets zeros."""
    dev, D, T = KERNEL_DEVICE, 32, 5
    fused = rand(T, (H + 2) * D, device=dev)
    q = fused[:, : H * D].view(T, H, D)
    k, v = rand(6, D, device=dev), rand(6, D, device=dev)
    q_pos = torch.tensor([0, 1, 2, 3, 4], device=dev)
    k_pos = torch.tensor([-1, 1, 2, 3, 4, -1], device=dev)
    out = attn.prefill_attention_triton(q, k, v, q_pos, k_pos, num_splits=2)
    assert torch.equal(out[0].cpu(), torch.zeros(H, D))
    assert_close(out, attn.prefill_attention_reference(q, k, v, q_pos, k_pos), torch.float32)

