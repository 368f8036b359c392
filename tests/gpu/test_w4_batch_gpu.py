"""The decode-batch int4 kernels of qat4.ops.w4.batch at Gemma 4 E2B shapes, on a CUDA GPU,
against the torch references of qat4.ops.w4.reference.

Run with `pytest -m gpu tests/gpu`; timings live in tools/bench_w4.py --rows R, not here.
"""

import pytest
import torch
from cuda_weights import random_weight, rel_err

from qat4.ops.w4 import batch as wb
from qat4.ops.w4 import batch_tiling as bt
from qat4.ops.w4 import reference as wr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DECODE_SHAPES = [  # [N, K] of every linear layer of one decode step but the output layer
    (2560, 1536), (5120, 1536), (2048, 1536), (4096, 1536), (1536, 2048), (1536, 4096), (12288, 1536),
    (24576, 1536), (1536, 6144), (1536, 12288), (256, 1536), (1536, 256),
]
VOCAB, HIDDEN = 262144, 1536
ROWS = (2, 16, 33, 64, 128)


def _dtypes():
    bf16 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return [torch.bfloat16, torch.float16] if bf16 else [torch.float16]


DTYPES = _dtypes()
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}  # each weight rounded to x.dtype once, and the output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", DECODE_SHAPES)
def test_batch_linear_at_e2b_shapes(n, k, dtype):
    packed, scales = random_weight(n, k, dtype)
    for m in ROWS if dtype == torch.bfloat16 else (16,):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = wb.w4_batch_linear(x, packed, scales, out=torch.full((m, n), float("nan"), device="cuda", dtype=dtype))
        assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < TOL[dtype], (m, n, k, bt.batch_tiling(n, k, m, x.device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,per_layer", [(12288, 1536, False), (24576, 1536, False), (256, 1536, True)])
def test_batch_gelu_at_e2b_shapes(n, k, per_layer, dtype):
    """The MLP's alternating gate/up rows, and the per-layer gate times a strided slice of the
    per-layer inputs [T, 35, 256]."""
    packed, scales = random_weight(n, k, dtype)
    for m in (4, 64):
        x = torch.randn(m, k, device="cuda", dtype=dtype) * 4
        up = torch.randn(m, 35, n, device="cuda", dtype=dtype)[:, 7] if per_layer else None
        out = wb.w4_batch_linear_gelu(x, packed, scales, up)
        assert rel_err(out, wr.w4_linear_gelu_reference(x, packed, scales, up)) < TOL[dtype], (m, n, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_output_layer_at_vocab_size(dtype):
    """Softcapped fp32 logits; the argmax is torch.argmax of the kernel's logits bit for bit, and a
    maximum of the reference's up to the weights' rounding to x.dtype."""
    packed, scales = random_weight(VOCAB, HIDDEN, dtype)
    for m in (16, 100):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=dtype) * 4
        logits = wb.w4_batch_logits(x, packed, scales)
        reference = wr.w4_logits_reference(x, packed, scales)
        assert logits.dtype == torch.float32 and rel_err(logits, reference) < TOL[dtype]
        top = wb.w4_batch_argmax(x, packed, scales)
        assert torch.equal(top, torch.argmax(logits, dim=-1))
        slack = 4 * TOL[dtype] * reference.abs().amax(dim=-1)
        assert (reference.gather(1, top[:, None])[:, 0] >= reference.amax(dim=-1) - slack).all()


def test_batch_split_k_is_deterministic_and_graph_safe():
    """The table's split of the long down projection: eager launches and graph replays agree bit
    for bit (the tickets reset themselves)."""
    packed, scales = random_weight(1536, 12288, torch.bfloat16)
    x = torch.randn(16, 12288, device="cuda", dtype=torch.bfloat16)
    assert bt.batch_tiling(1536, 12288, 16, x.device)["SPLIT_K"] > 1
    first = wb.w4_batch_linear(x, packed, scales)
    assert rel_err(first, wr.w4_linear_reference(x, packed, scales)) < TOL[torch.bfloat16]
    for _ in range(50):
        assert torch.equal(wb.w4_batch_linear(x, packed, scales), first)
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wb.w4_batch_linear(x, packed, scales, out=out)
    for _ in range(20):
        out.zero_()
        graph.replay()
        assert torch.equal(out, first)


@pytest.mark.parametrize("m", [16, 64])
def test_every_candidate_tiling_is_right(m):
    """What tools/bench_w4.py --sweep times compiles and computes the same product."""
    n, k = 1536, 4096
    packed, scales = random_weight(n, k, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    reference = wr.w4_linear_reference(x, packed, scales)
    for tiling in bt.batch_tiling_candidates(n, k, m, x.device):
        assert rel_err(wb.w4_batch_linear(x, packed, scales, config=tiling), reference) < TOL[torch.bfloat16], tiling


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_unpacking_matches_the_fp32_route_bit_for_bit(dtype):
    """Unpacked two at a time in x.dtype, the weights are the fp32 route's rounded once to
    x.dtype, and the same dots sum them in the same order: every output is the same bit for bit,
    with eight dots and with one, plain, gated and at the output layer."""
    cases = [((2560, 1536), m, config) for m in (4, 16, 64) for config in ({}, {"ONE_DOT": 1})]
    cases += [((1536, 12288), 16, {}), ((12288, 1536), 64, {"PREFETCH": 1})]
    both = lambda run, config: (run(dict(config, PAIR_UNPACK=1)), run(dict(config, PAIR_UNPACK=0)))  # noqa: E731
    for (n, k), m, config in cases:
        packed, scales = random_weight(n, k, dtype, seed=m)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert wb.unpacks_pairs(x, scales)
        pairs, fp32 = both(lambda c: wb.w4_batch_linear(x, packed, scales, config=c), config)
        assert torch.equal(pairs, fp32), (n, k, m, config)
        assert rel_err(pairs, wr.w4_linear_reference(x, packed, scales)) < TOL[dtype]
    packed, scales = random_weight(12288, 1536, dtype)
    x = torch.randn(16, 1536, device="cuda", dtype=dtype) * 4
    assert torch.equal(*both(lambda c: wb.w4_batch_linear_gelu(x, packed, scales, config=c), {}))
    packed, scales = random_weight(VOCAB, HIDDEN, dtype)
    assert torch.equal(*both(lambda c: wb.w4_batch_logits(x, packed, scales, config=c), {}))
    assert torch.equal(*both(lambda c: wb.w4_batch_argmax(x, packed, scales, config=c), {}))


def test_l2_prefetch_changes_no_output(monkeypatch):
    """Prefetching a program's slice of W into L2 changes where the words come from, never what is
    summed: with and without it every output is the same bit for bit (a wrong address would fault),
    over slices of 12 groups (the words' last prefetch clamped), split programs with nothing left
    to sum, rows past N and an argmax over the output layer."""
    monkeypatch.delenv("QAT4_L2_PREFETCH", raising=False)
    cases = [((2560, 1536), 4, {}), ((1536, 12288), 16, {"SPLIT_K": 3}), ((1000, 1536), 33, {}),
             ((12288, 1536), 64, {"PREFETCH": 1}), ((2048, 1536), 16, {"BLOCK_G": 4, "SPLIT_K": 4}),
             ((1536, 1536), 4, {"BLOCK_G": 8, "SPLIT_K": 5})]
    both = lambda run, config: (run(dict(config, L2_PREFETCH=1)), run(dict(config, L2_PREFETCH=0)))  # noqa: E731
    for (n, k), m, config in cases:
        packed, scales = random_weight(n, k, torch.bfloat16, seed=m)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert wb.prefetches_l2(x)
        on, off = both(lambda c: wb.w4_batch_linear(x, packed, scales, config=c), config)
        assert torch.equal(on, off), (n, k, m, config)
    packed, scales = random_weight(VOCAB, HIDDEN, torch.bfloat16)
    x = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(*both(lambda c: wb.w4_batch_argmax(x, packed, scales, config=c), {}))
