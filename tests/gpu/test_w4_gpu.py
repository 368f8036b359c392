"""Packed int4 kernels against their torch references at Gemma 4 E2B shapes, on a CUDA GPU.

Weights are random int32 words (every bit pattern is 8 valid codes) with nonzero random steps.
Run with `pytest -m gpu tests/gpu`; timings live in tools/bench_w4.py, not here.
"""

import pytest
import torch
from cuda_weights import random_weight, rel_err

from qat4.ops.w4 import dispatch as w4
from qat4.ops.w4 import embedding as we
from qat4.ops.w4 import expanded as wx
from qat4.ops.w4 import gemm as wm
from qat4.ops.w4 import gemv as wv
from qat4.ops.w4 import reference as wr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DECODE_SHAPES = [  # [N, K] of every GEMV of one decode step (gemma4-e2b.md section 5.5)
    (2560, 1536), (5120, 1536), (2048, 1536), (4096, 1536), (1536, 2048), (1536, 4096), (12288, 1536),
    (24576, 1536), (1536, 6144), (1536, 12288), (256, 1536), (1536, 256), (8960, 1536), (262144, 1536),
]
VOCAB, HIDDEN, PER_LAYER = 262144, 1536, 8960


def _dtypes():
    bf16 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.bfloat16, torch.float16] if bf16 else [torch.float16]


DTYPES = _dtypes()
OUT_TOL = {torch.float16: 1e-3, torch.bfloat16: 4e-3}  # rounding of the 16-bit output
MATMUL_TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}  # plus one rounding of each weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_matvec_at_e2b_shapes(n, k, dtype):
    packed, scales = random_weight(n, k, dtype)
    for m in (1, 3, 16) if dtype == torch.bfloat16 else (1,):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = wv.w4_matvec(x, packed, scales)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < OUT_TOL[dtype], (m, n, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(2560, 1536), (24576, 1536), (1536, 12288), (1536, 256), (262144, 1536)])
def test_matmul_at_e2b_shapes(n, k, dtype):
    packed, scales = random_weight(n, k, dtype)
    for m in (64, 1000) if n < VOCAB else (64,):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = wm.w4_matmul(x, packed, scales)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < MATMUL_TOL[dtype], (m, n, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(2560, 1536), (24576, 1536), (1536, 12288), (1536, 256)])
def test_expanded_product_at_e2b_shapes(n, k, dtype):
    """Prompt-sized products through the dispatcher take the expanded path once a scratch holds W
    and agree with the reference as the GEMM does; replayed from a CUDA graph they repeat the
    eager result."""
    packed, scales = random_weight(n, k, dtype)
    if not wx.has_scratch("cuda", dtype, n * k):
        assert w4._kernel(torch.empty(4096, k, device="cuda", dtype=dtype), packed) == "gemm"
        wx.reserve_scratch("cuda", dtype, n * k)
    for m in (w4.EXPAND_ROWS, 1000, 4096):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert w4._kernel(x, packed) == "expanded"
        out = w4.w4_linear(x, packed, scales)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < MATMUL_TOL[dtype], (m, n, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = wx.w4_expanded_matmul(x, packed, scales)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    decode_batch = "gemm" if n >= w4.WIDE_N and k <= w4.WIDE_K else "batch"  # the MLP's gate/up: the GEMM
    assert w4._kernel(x[: w4.BATCH_ROWS], packed) == decode_batch and w4._kernel(x.float(), packed) == "gemm"
    assert w4._kernel(x) == "gemm"  # the output layer is never expanded


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_fp32_path(dtype, monkeypatch):
    packed, scales = random_weight(2560, 1536, dtype)
    x = torch.randn(300, 1536, device="cuda", dtype=dtype)
    monkeypatch.setenv("QAT4_PREFILL_FP32", "1")
    assert wm.prefill_uses_fp32(x)
    assert rel_err(wm.w4_matmul(x, packed, scales), wr.w4_linear_reference(x, packed, scales)) < OUT_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_layer_at_vocab_size(dtype):
    """GEMV rows (exact weights, fp32 sums) match the reference to 1e-5 and its argmax; decode-batch
    rows (weights rounded to the 16-bit dtype for the tensor cores) to the GEMM's tolerance. Either
    kernel's argmax is torch.argmax of its own logits."""
    packed, scales = random_weight(VOCAB, HIDDEN, dtype)
    for m in (w4.GEMV_ROWS, 16, 64):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=dtype) * 4
        logits = w4.w4_logits(x, packed, scales)
        reference = wr.w4_logits_reference(x, packed, scales)
        assert logits.dtype == torch.float32 and rel_err(logits, reference) < (1e-5 if m <= w4.GEMV_ROWS else MATMUL_TOL[dtype])
        top = w4.w4_argmax(x, packed, scales)
        assert torch.equal(top, torch.argmax(logits, dim=-1))
        if m <= w4.GEMV_ROWS:
            assert torch.equal(top, torch.argmax(reference, dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,scale", [(HIDDEN, 39.25), (PER_LAYER, 16.0)])
def test_embedding_is_exact(k, scale, dtype):
    packed, scales = random_weight(VOCAB, k, torch.float16)
    ids = torch.cat([torch.tensor([0, VOCAB - 1], device="cuda"), torch.randint(0, VOCAB, (62,), device="cuda")])
    out = we.w4_embedding(ids, packed, scales, scale, dtype)
    assert torch.equal(out, we.w4_embedding_reference(ids, packed, scales, scale, dtype))


def test_split_k_is_deterministic_and_graph_safe():
    """The split-K tickets reset themselves: many eager launches and graph replays agree bit for bit."""
    packed, scales = random_weight(1536, 12288, torch.bfloat16)
    x = torch.randn(1, 12288, device="cuda", dtype=torch.bfloat16)
    config = {"RR": 8, "TR": 2, "BLOCK_G": 16, "SPLIT_K": 8}
    first = wv.w4_matvec(x, packed, scales, config=config)
    assert rel_err(first, wr.w4_linear_reference(x, packed, scales)) < OUT_TOL[torch.bfloat16]
    for _ in range(50):
        assert torch.equal(wv.w4_matvec(x, packed, scales, config=config), first)
    out = torch.empty_like(first)
    wv.w4_matvec(x, packed, scales, out)  # autotune before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wv.w4_matvec(x, packed, scales, out)
    eager = wv.w4_matvec(x, packed, scales)
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,per_layer", [(12288, 1536, False), (24576, 1536, False), (256, 1536, True)])
def test_gelu_epilogue_at_e2b_shapes(n, k, per_layer, dtype):
    """The MLP's alternating gate/up rows and the per-layer gate times a strided slice of the
    per-layer inputs [T, 35, 256], as GEMV (1 and 3 rows) and decode-batch (16 and 64 rows)
    epilogues, and after the expanded product (300 rows)."""
    packed, scales = random_weight(n, k, dtype)
    for m in (1, 3, 16, 64, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype) * 4
        up = torch.randn(m, 35, n, device="cuda", dtype=dtype)[:, 7] if per_layer else None
        out = w4.w4_linear_gelu(x, packed, scales, up)
        tol = (OUT_TOL if m <= w4.GEMV_ROWS else MATMUL_TOL)[dtype]
        assert rel_err(out, wr.w4_linear_gelu_reference(x, packed, scales, up)) < tol, (m, n, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1536, 2048), (1536, 4096), (1536, 6144), (1536, 12288), (1536, 256)])
def test_residual_epilogue_at_e2b_shapes(n, k, dtype):
    """o_proj, down and the per-layer projection feeding the residual step, with and without the
    layer scalar and next input norm; graph replays agree with eager launches bit for bit."""
    packed, scales = random_weight(n, k, dtype)
    vec = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)  # noqa: E731
    for m in (1, 3, 16, 64):
        x = vec(m, k)
        tol = (OUT_TOL if m <= w4.GEMV_ROWS else MATMUL_TOL)[dtype]
        for step in (wr.ResidualStep(vec(m, n), vec(n)), wr.ResidualStep(vec(m, n), vec(n), vec(1), vec(n))):
            h_out, x_next = w4.w4_linear_residual(x, packed, scales, step)
            want_h, want_x = wr.w4_linear_residual_reference(x, packed, scales, step)
            assert rel_err(h_out, want_h) < tol, (m, n, k)
            assert (x_next is None) == (want_x is None)
            assert x_next is None or rel_err(x_next, want_x) < 2 * tol
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = w4.w4_linear_residual(x, packed, scales, step)
    for _ in range(5):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, w4.w4_linear_residual(x, packed, scales, step)[0])


@pytest.mark.parametrize("n,k", [(2560, 1536), (1536, 6144), (24576, 1536)])
def test_a_kept_16_bit_copy_is_the_matrix_the_expanded_product_multiplies(n, k):
    """``dense_weights``' copy (expand_matrix) against W expanded into the scratch at prompt rows:
    the same products bit for bit, plain and gated; at 64 rows the copy on cuBLAS against the batch
    kernel within bf16 rounding."""
    packed, scales = random_weight(n, k, torch.bfloat16)
    copy = wx.expand_matrix(packed, scales, torch.bfloat16)
    assert torch.equal(copy, we.w4_expand_rows_reference(packed, scales, torch.empty_like(copy)))
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(wx.w4_expanded_matmul(x, packed, scales, dense=copy), wx.w4_expanded_matmul(x, packed, scales))
    assert torch.equal(wx.w4_expanded_matmul(x, packed, scales, gelu=True, dense=copy),
                       wx.w4_expanded_matmul(x, packed, scales, gelu=True))
    x = x[:64]
    ours = w4.w4_linear(x, packed, scales, dense=copy)
    assert w4._kernel(x, packed, copy) == "dense"
    assert rel_err(ours, w4.w4_linear(x, packed, scales)) < MATMUL_TOL[torch.bfloat16]
