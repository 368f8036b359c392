"""Packed int4 linear, output layer and embedding ops: references against dense fp64 math,
Triton kernels against the references.

The kernel tests (named test_kernel_*) run on CUDA when present, else under the Triton
interpreter: a plain `pytest` runs them in a subprocess with TRITON_INTERPRET=1, because Triton
reads that variable when a kernel is defined, i.e. when the qat4.ops.w4 modules are first imported,
and setting it in this process would also turn every kernel of later test modules into an
interpreted one. The interpreter mishandles bf16 arithmetic (it truncates fp32 -> bf16 and cannot
run bf16 tl.dot), so there bf16 appears as scales and inputs, and bf16 outputs get a wider
tolerance; tests/gpu/test_w4_gpu.py covers bf16 at E2B shapes.
"""


import pytest
import torch
from kernel_harness import INTERPRETED, KERNEL_DEVICE, kernel_test, run_interpreted

from qat4.checkpoint import packing
from qat4.errors import Qat4Error
from qat4.ops.w4 import embedding as we
from qat4.ops.w4 import expanded as wx
from qat4.ops.w4 import gemm as wm
from qat4.ops.w4 import gemv as wv
from qat4.ops.w4 import logits as wo
from qat4.ops.w4 import reference as wr
from qat4.ops.w4 import tiling as wt

# relative Frobenius error allowed for an output of each dtype (fp32 accumulation everywhere)
OUT_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3 if INTERPRETED else 4e-3}


def random_weight(n, k, scale_dtype=torch.float16, seed=0, device="cpu"):
    """Random levels in -8..7 and nonzero steps of either sign -> (levels, steps fp32, packed, scales)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-8, 8, (n, k), generator=g)
    steps = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.002) * (torch.randint(0, 2, (n, k // 32), generator=g) * 2 - 1)
    scales = steps.to(scale_dtype)
    return levels, scales.float(), packing.pack_levels(levels).to(device), scales.to(device)


def dense(levels, steps):
    """[N, K] fp64 weights straight from levels and steps (no unpacking involved)."""
    n, k = levels.shape
    return (levels.double().view(n, -1, 32) * steps.double()[:, :, None]).view(n, k)


def rel_err(actual, expected):
    a, e = actual.double().cpu(), expected.double().cpu()
    return float((a - e).norm() / e.norm())


# ----------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("m,n,k", [(1, 7, 32), (3, 40, 96), (20, 33, 256)])
def test_linear_reference_matches_dense(m, n, k):
    levels, steps, packed, scales = random_weight(n, k, seed=m)
    x = torch.randn(m, k)
    out = wr.w4_linear_reference(x, packed, scales)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert rel_err(out, x.double() @ dense(levels, steps).T) < 1e-6


def test_linear_reference_keeps_x_dtype():
    _, _, packed, scales = random_weight(16, 64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    out = wr.w4_linear_reference(x, packed, scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, wr.w4_linear_reference(x.float(), packed, scales).to(torch.bfloat16))


def test_reference_dequantises_a_large_table_in_chunks(monkeypatch):
    """A 262,144-row table: never more than _REFERENCE_CHUNK weights dequantised at once."""
    n, k = 262144, 64
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32)
    scales = torch.full((n, k // 32), 0.01, dtype=torch.float16)
    largest = []
    real = packing.dequantize
    monkeypatch.setattr(wr, "dequantize", lambda p, s: largest.append(p.shape[0] * k) or real(p, s))
    x = torch.randn(1, k)
    logits = wr.w4_logits_reference(x, packed, scales)
    assert logits.shape == (1, n) and max(largest) <= wr._REFERENCE_CHUNK
    sample = torch.arange(0, n, 4099)
    expected = 30 * torch.tanh(x.double() @ real(packed[sample], scales[sample]).double().T / 30)
    assert rel_err(logits[:, sample], expected) < 1e-6


def test_logits_and_argmax_references():
    levels, steps, packed, scales = random_weight(50, 64)
    x = torch.randn(3, 64) * 40  # large enough that the softcap bends
    z = x.double() @ dense(levels, steps).T
    logits = wr.w4_logits_reference(x, packed, scales, softcap=30.0)
    assert logits.dtype == torch.float32 and logits.abs().max() < 30
    assert rel_err(logits, 30 * torch.tanh(z / 30)) < 1e-6
    assert torch.equal(wr.w4_argmax_reference(x, packed, scales), torch.argmax(z, dim=-1))


def test_embedding_reference_is_exact():
    levels, steps, packed, scales = random_weight(10, 96, torch.bfloat16)
    ids = torch.tensor([[3, 0], [9, 3]])
    out = we.w4_embedding_reference(ids, packed, scales, 39.25, torch.float32)
    assert out.shape == (2, 2, 96)
    assert torch.equal(out.double(), dense(levels, steps)[ids] * 39.25)


def test_dispatch_follows_qat4_ops_and_the_rows(monkeypatch):
    from qat4.ops.w4 import dispatch as w4

    _, _, packed, scales = random_weight(24, 64)
    calls = []
    for name in ("w4_matvec", "w4_batch_linear", "w4_matmul"):
        monkeypatch.setattr(w4, name, lambda x, p, s, name=name, **kw: calls.append((name, kw))
                            or wr.w4_linear_reference(x, p, s))
    x_small = torch.randn(2, 2, 64)  # leading dims are flattened
    for mode in ("auto", "reference"):
        monkeypatch.setenv("QAT4_OPS", mode)
        assert w4.w4_linear(x_small, packed, scales).shape == (2, 2, 24) and calls == []
    monkeypatch.setenv("QAT4_OPS", "triton")
    tilings = wt.MatvecTilings()  # the model's, handed to the GEMV alone
    for rows in (1, w4.GEMV_ROWS, w4.GEMV_ROWS + 1, w4.BATCH_ROWS, w4.BATCH_ROWS + 1):
        w4.w4_linear(torch.randn(rows, 64), packed, scales, tilings=tilings)
    gemv = ("w4_matvec", {"tilings": tilings})
    assert calls == [gemv, gemv, ("w4_batch_linear", {}), ("w4_batch_linear", {}), ("w4_matmul", {})]
    monkeypatch.setenv("QAT4_OPS", "fast")
    with pytest.raises(Qat4Error, match="QAT4_OPS"):
        w4.w4_linear(x_small, packed, scales)
    monkeypatch.setenv("QAT4_OPS", "triton")
    assert not w4.expands_products(torch.bfloat16, torch.device("cpu"))  # cuBLAS on a GPU with tensor cores only


def test_wide_mlp_products_leave_the_batch_kernel_from_wide_gemm_rows(monkeypatch):
    """Gate/up-shaped W (WIDE_N rows of at most WIDE_K columns) takes the prefill GEMM from
    WIDE_GEMM_ROWS rows of x; narrower or longer W, and the output layer, stay on the batch kernel."""
    from qat4.ops.w4 import dispatch as w4

    monkeypatch.setenv("QAT4_OPS", "triton")
    monkeypatch.setattr(w4, "_expandable", lambda dtype, device: dtype != torch.float32)  # as on a GPU with tensor cores
    words = lambda n, k: torch.empty(n, k // 8, dtype=torch.int32)  # noqa: E731
    x = lambda m, k: torch.empty(m, k, dtype=torch.bfloat16)  # noqa: E731
    wide, short, long_k = words(w4.WIDE_N, 64), words(w4.WIDE_N - 1, 64), words(w4.WIDE_N, w4.WIDE_K + 32)
    assert w4._kernel(x(w4.WIDE_GEMM_ROWS - 1, 64), wide) == "batch"
    assert w4._kernel(x(w4.WIDE_GEMM_ROWS, 64), wide) == "gemm"
    assert w4._kernel(x(w4.BATCH_ROWS, 64), wide) == "gemm"
    assert w4._kernel(x(w4.WIDE_GEMM_ROWS, 64), short) == "batch"
    assert w4._kernel(x(w4.WIDE_GEMM_ROWS, w4.WIDE_K + 32), long_k) == "batch"
    assert w4._kernel(x(w4.BATCH_ROWS, 64)) == "batch"  # the output layer
    assert w4._kernel(x(w4.WIDE_GEMM_ROWS, 64).float(), wide) == "batch"  # no tensor cores for it


def test_a_kept_16_bit_copy_takes_products_from_dense_rows(monkeypatch):
    """With a 16-bit copy of W (``dense_weights``) products of DENSE_ROWS rows or more (prompt
    steps, by default) multiply it, the gated and residual layers too; fewer rows (decode steps)
    keep the kernel they have without a copy; without tensor cores for x's dtype nothing changes.
    The copy reaches the expanded product."""
    from qat4.ops.w4 import dispatch as w4

    monkeypatch.setenv("QAT4_OPS", "triton")
    monkeypatch.setattr(w4, "_expandable", lambda dtype, device: dtype != torch.float32)  # as on a GPU with tensor cores
    assert w4.DENSE_ROWS > w4.BATCH_ROWS  # the copies replace the expansion, not the decode-batch kernel
    _, _, packed, scales = random_weight(w4.WIDE_N, 64)
    copy = torch.empty(w4.WIDE_N, 64, dtype=torch.bfloat16)
    x = lambda m: torch.empty(m, 64, dtype=torch.bfloat16)  # noqa: E731
    assert w4._kernel(x(w4.DENSE_ROWS), packed, copy) == "dense"
    assert w4._kernel(x(4096), packed, copy) == "dense"
    assert w4._kernel(x(w4.DENSE_ROWS - 1), packed, copy) == w4._kernel(x(w4.DENSE_ROWS - 1), packed) == "gemm"
    assert w4._kernel(x(1), packed, copy) == "gemv"
    assert w4._kernel(x(w4.DENSE_ROWS), packed) == "gemm"  # no copy and no scratch: the GEMM
    assert w4._kernel(x(w4.DENSE_ROWS).float(), packed, copy) == "gemm"  # no tensor cores for fp32 x
    _, _, packed, scales = random_weight(64, 64)
    copy = torch.empty(64, 64, dtype=torch.bfloat16)
    assert w4._kernel(x(64), packed, copy) == "batch"  # a 64-row decode step keeps the packed words
    calls = []
    monkeypatch.setattr(w4, "w4_expanded_matmul", lambda x, p, s, **kw: calls.append(kw) or x.new_zeros(len(x), 64))
    monkeypatch.setattr(w4, "residual_rms_norm_triton", lambda h, y, *a: (h + y, None))
    w4.w4_linear(x(w4.DENSE_ROWS), packed, scales, dense=copy)
    w4.w4_linear_gelu(x(w4.DENSE_ROWS), packed, scales, dense=copy)
    step = wr.ResidualStep(torch.zeros(w4.DENSE_ROWS, 64, dtype=torch.bfloat16), None)
    w4.w4_linear_residual(x(w4.DENSE_ROWS), packed, scales, step, dense=copy)
    assert [kw["dense"] is copy for kw in calls] == [True, True, True] and calls[1]["gelu"]


def test_prefill_precision_choice(monkeypatch):
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    monkeypatch.delenv("QAT4_PREFILL_FP32", raising=False)
    assert not wm.prefill_uses_fp32(x) and wm.prefill_uses_fp32(x, fp32=True)
    assert wm.prefill_uses_fp32(x.float())
    monkeypatch.setenv("QAT4_PREFILL_FP32", "1")
    assert wm.prefill_uses_fp32(x) and not wm.prefill_uses_fp32(x, fp32=False)


def test_shape_mismatch_is_rejected():
    _, _, packed, scales = random_weight(8, 64)
    with pytest.raises(ValueError, match="K/8"):
        wr.w4_linear_reference(torch.randn(1, 32), packed, scales)


# ----------------------------------------------------------------------------------------------
# Triton kernels


def test_triton_kernels_under_interpreter(request):
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1 (shared by the kernel
    test files of the session)."""
    run_interpreted(__file__, request)


def kernel_inputs(m, n, k, x_dtype, scale_dtype, seed=0):
    _, _, packed, scales = random_weight(n, k, scale_dtype, seed=seed, device=KERNEL_DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(KERNEL_DEVICE, x_dtype)
    return x, packed, scales


SPLIT_3 = {"RR": 4, "TR": 16, "BLOCK_G": 2, "SPLIT_K": 3}  # G = 16: splits of 6, 6 and 4 groups
SPLIT_4_EMPTY = {"RR": 4, "TR": 8, "BLOCK_G": 1, "SPLIT_K": 4}  # G = 3: the last split has no groups


@kernel_test
@pytest.mark.parametrize("m,n,k,x_dtype,scale_dtype,config", [
    (1, 37, 256, torch.float32, torch.float16, None),
    (3, 50, 512, torch.float32, torch.bfloat16, SPLIT_3),
    (1, 20, 96, torch.float16, torch.float16, SPLIT_4_EMPTY),
    (16, 9, 64, torch.float16, torch.bfloat16, None),
    (5, 33, 32, torch.bfloat16, torch.float16, {"RR": 2, "TR": 32, "BLOCK_G": 1, "SPLIT_K": 1}),
    # no tails: the unmasked path, alone and split
    (1, 64, 1024, torch.float32, torch.float16, {"RR": 4, "TR": 16, "BLOCK_G": 8, "SPLIT_K": 1}),
    (2, 32, 1024, torch.float32, torch.bfloat16, {"RR": 4, "TR": 8, "BLOCK_G": 4, "SPLIT_K": 4}),
])
def test_kernel_matvec(m, n, k, x_dtype, scale_dtype, config):
    x, packed, scales = kernel_inputs(m, n, k, x_dtype, scale_dtype)
    out = wv.w4_matvec(x, packed, scales, config=config)
    assert out.shape == (m, n) and out.dtype == x_dtype
    assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < OUT_TOL[x_dtype]


@kernel_test
def test_kernel_matvec_pinned_tiling_replaces_the_autotuners(monkeypatch):
    """A launch records the autotuner's pick per shape in the tilings it is given; a tiling pinned
    there is launched instead."""
    tilings = wt.MatvecTilings()
    x, packed, scales = kernel_inputs(1, 40, 512, torch.float32, torch.float16)
    want = wr.w4_linear_reference(x, packed, scales)
    assert rel_err(wv.w4_matvec(x, packed, scales, tilings=tilings), want) < OUT_TOL[torch.float32]
    (key, picked), = tilings.launched().items()
    assert key == (40, 16, 1, 0, False, "float32")
    assert picked in wt.matvec_tiling_candidates(key, x.device)
    pinned = dict(SPLIT_3, RR=4, TR=16)
    launched = []
    real = wv._matvec_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(wv, "_matvec_kernel", Spy())
    tilings.pin({key: pinned})
    tilings.forget()
    assert tilings.launched() == {}
    assert rel_err(wv.w4_matvec(x, packed, scales, tilings=tilings), want) < OUT_TOL[torch.float32]
    assert launched == [(1, 3, 1)]  # 40 rows in one block of 64, three splits
    assert tilings.launched() == {key: pinned}


@kernel_test
def test_kernel_matvec_tilings_of_two_models_are_apart(monkeypatch):
    """Two MatvecTilings (two models in one process) share no pins and no record: a shape pinned in
    one launches through the other on that one's own pin, or the autotuner's pick; a launch given
    none takes the autotuner's pick and records nothing."""
    x, packed, scales = kernel_inputs(1, 40, 512, torch.float32, torch.float16)
    key = (40, 16, 1, 0, False, "float32")
    split_3, whole = dict(SPLIT_3, RR=4, TR=16), {"RR": 2, "TR": 32, "BLOCK_G": 1, "SPLIT_K": 1}
    launched = []

    class Spy:
        def __init__(self, real, name):
            self.real, self.name = real, name

        def __getitem__(self, grid):
            launched.append(grid if self.name == "pinned" else self.name)
            return self.real[grid]

        def __getattr__(self, attr):  # the autotuner's best_config
            return getattr(self.real, attr)

    monkeypatch.setattr(wv, "_matvec_kernel", Spy(wv._matvec_kernel, "pinned"))
    monkeypatch.setattr(wv, "_matvec_tuned", Spy(wv._matvec_tuned, "autotuned"))
    mine, theirs = wt.MatvecTilings(), wt.MatvecTilings()
    want = wr.w4_linear_reference(x, packed, scales)
    mine.pin({key: split_3})
    for tilings in (theirs, None, mine):
        assert rel_err(wv.w4_matvec(x, packed, scales, tilings=tilings), want) < OUT_TOL[torch.float32]
    assert launched == ["autotuned", "autotuned", (1, 3, 1)]
    (picked,) = theirs.launched().values()
    assert theirs.launched() == {key: picked} and mine.launched() == {key: split_3}
    theirs.pin({key: whole})
    launched.clear()
    for tilings in (theirs, mine):
        assert rel_err(wv.w4_matvec(x, packed, scales, tilings=tilings), want) < OUT_TOL[torch.float32]
    assert launched == [(1, 1, 1), (1, 3, 1)]
    assert theirs.launched() == {key: whole} and mine.launched() == {key: split_3}


@kernel_test
def test_kernel_matvec_writes_into_out_and_split_k_is_deterministic():
    x, packed, scales = kernel_inputs(2, 24, 512, torch.float32, torch.float16)
    out = torch.full((2, 24), float("nan"), device=KERNEL_DEVICE)
    assert wv.w4_matvec(x, packed, scales, out, config=SPLIT_3) is out
    again = wv.w4_matvec(x, packed, scales, config=SPLIT_3)
    assert torch.equal(out, again)
    assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < OUT_TOL[torch.float32]


@kernel_test
@pytest.mark.parametrize("m,config", [(1, None), (3, SPLIT_3), (2, {"RR": 8, "TR": 1, "BLOCK_G": 32, "SPLIT_K": 1})])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_kernel_matvec_gelu_gates_in_the_epilogue(m, config, x_dtype):
    """Alternating gate/up rows (the MLP) and a separate up tensor, a strided view (per-layer input)."""
    x, packed, scales = kernel_inputs(m, 48, 512, x_dtype, torch.float16)
    x = x * 4  # gates of a few units: both tails of the GELU
    pairs = wv.w4_matvec_gelu(x, packed, scales, config=config)
    assert pairs.shape == (m, 24) and pairs.dtype == x_dtype
    assert rel_err(pairs, wr.w4_linear_gelu_reference(x, packed, scales)) < OUT_TOL[x_dtype]
    table = torch.randn(m, 3, 48, generator=torch.Generator().manual_seed(5)).to(KERNEL_DEVICE, x_dtype)
    gated = wv.w4_matvec_gelu(x, packed, scales, table[:, 1], config=config)
    assert gated.shape == (m, 48)
    assert rel_err(gated, wr.w4_linear_gelu_reference(x, packed, scales, table[:, 1])) < OUT_TOL[x_dtype]


@kernel_test
@pytest.mark.parametrize("m,config", [(1, None), (3, SPLIT_3), (5, {"RR": 2, "TR": 4, "BLOCK_G": 4, "SPLIT_K": 1})])
@pytest.mark.parametrize("scalar,next_norm", [(False, False), (True, True)])
def test_kernel_matvec_residual_step_runs_in_the_last_program(m, config, scalar, next_norm):
    """The residual step on the GEMV output, run by whichever program stores last: equal to the
    reference step on the reference GEMV, and the grid ticket resets (a second call agrees)."""
    x, packed, scales = kernel_inputs(m, 40, 256, torch.float32, torch.float16)
    g = torch.Generator().manual_seed(7)
    vec = lambda *shape: torch.randn(*shape, generator=g).to(KERNEL_DEVICE)  # noqa: E731
    step = wr.ResidualStep(vec(m, 40), vec(40), vec(1) if scalar else None, vec(40) if next_norm else None, 1e-6)
    h_out, x_next = wv.w4_matvec_residual(x, packed, scales, step, config=config)
    want_h, want_x = wr.w4_linear_residual_reference(x, packed, scales, step)
    assert rel_err(h_out, want_h) < 1e-5
    assert (x_next is None) == (want_x is None) and (x_next is None or rel_err(x_next, want_x) < 1e-5)
    again, _ = wv.w4_matvec_residual(x, packed, scales, step, config=config)
    assert torch.equal(again, h_out)


@kernel_test
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_kernel_matmul_gelu_gates_in_the_epilogue(x_dtype):
    x, packed, scales = kernel_inputs(40, 48, 96, x_dtype, torch.float16)
    x = x * 4
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_G": 1}
    tol = 2 * OUT_TOL[x_dtype]
    pairs = wm.w4_matmul(x, packed, scales, gelu=True, config=config)
    assert pairs.shape == (40, 24)
    assert rel_err(pairs, wr.w4_linear_gelu_reference(x, packed, scales)) < tol
    up = torch.randn(40, 2, 48, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE, x_dtype)[:, 0]
    gated = wm.w4_matmul(x, packed, scales, gelu=True, up=up, config=config)
    assert rel_err(gated, wr.w4_linear_gelu_reference(x, packed, scales, up)) < tol


@kernel_test
@pytest.mark.parametrize("m,n,k,x_dtype,fp32,config", [
    (70, 33, 96, torch.float16, False, {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_G": 2}),
    (17, 40, 64, torch.float32, None, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_G": 1}),
    (33, 20, 128, torch.bfloat16, True, {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_G": 4}),
])
def test_kernel_matmul(m, n, k, x_dtype, fp32, config):
    x, packed, scales = kernel_inputs(m, n, k, x_dtype, torch.bfloat16)
    out = wm.w4_matmul(x, packed, scales, fp32=fp32, config=config)
    assert out.shape == (m, n) and out.dtype == x_dtype
    # the tensor-core path rounds each dequantised weight to x.dtype once
    tol = OUT_TOL[x_dtype] if wm.prefill_uses_fp32(x, fp32) else 2 * OUT_TOL[x_dtype]
    assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < tol


@kernel_test
@pytest.mark.parametrize("m", [1, 3])
def test_kernel_logits_and_argmax(m):
    x, packed, scales = kernel_inputs(m, 40, 128, torch.float16, torch.float16)
    x = x * 8  # logits of tens: the softcap bends them
    logits = wo.w4_logits_triton(x, packed, scales, 30.0)
    assert logits.dtype == torch.float32 and logits.shape == (m, 40)
    assert rel_err(logits, wr.w4_logits_reference(x, packed, scales, 30.0)) < 1e-5
    top = wo.w4_argmax_triton(x, packed, scales, 30.0)
    assert top.dtype == torch.int64
    assert torch.equal(top, wr.w4_argmax_reference(x, packed, scales, 30.0))
    assert torch.equal(top, torch.argmax(logits, dim=-1))
    plain = wo.w4_logits_triton(x, packed, scales, None)  # a config without final_logit_softcapping
    assert rel_err(plain, wr.w4_linear_reference(x.float(), packed, scales)) < 1e-5
    assert torch.equal(wo.w4_argmax_triton(x, packed, scales, None), torch.argmax(plain, dim=-1))


@kernel_test
def test_kernel_argmax_ties_go_to_the_lowest_index():
    """Row 0 of x peaks on identical rows 21, 40 and 75 of W (bit-equal logits in three blocks of
    rows); row 1 (= -row 0) peaks on row 76, in the last, partial block."""
    x, packed, scales = kernel_inputs(2, 77, 64, torch.float32, torch.float16)
    x[1] = -x[0]

    def peak(v):  # the packed row whose dot product with v is largest
        return packing.pack_levels(torch.where(v.cpu() > 0, 7, -8)[None])[0].to(KERNEL_DEVICE)

    for r, v in ((21, x[0]), (40, x[0]), (75, x[0]), (76, x[1])):
        packed[r], scales[r] = peak(v), 0.05
    assert wo.w4_argmax_triton(x, packed, scales).tolist() == [21, 76]
    assert wr.w4_argmax_reference(x, packed, scales).tolist() == [21, 76]


@kernel_test
@pytest.mark.parametrize("k,out_dtype,scale_dtype,ids", [
    (96, torch.float32, torch.bfloat16, [[5, 0, 2], [2, 2, 4]]),
    (8960, torch.float16, torch.float16, [[5], [0]]),
    (64, torch.float32, torch.float16, [[3, 1]]),
])
def test_kernel_embedding_is_exact(k, out_dtype, scale_dtype, ids):
    _, _, packed, scales = random_weight(6, k, scale_dtype, device=KERNEL_DEVICE)
    ids = torch.tensor(ids, device=KERNEL_DEVICE)
    out = we.w4_embedding_triton(ids, packed, scales, 39.25, out_dtype)
    assert out.shape == (*ids.shape, k) and out.dtype == out_dtype
    assert torch.equal(out, we.w4_embedding_reference(ids, packed, scales, 39.25, out_dtype))


@kernel_test
@pytest.mark.parametrize("out_dtype,scale_dtype", [(torch.float16, torch.float16), (torch.float32, torch.bfloat16)]
                         + ([] if INTERPRETED else [(torch.bfloat16, torch.bfloat16)]))  # the interpreter truncates to bf16
def test_kernel_expand_rows_is_exact(out_dtype, scale_dtype):
    _, _, packed, scales = random_weight(7, 96, scale_dtype, device=KERNEL_DEVICE)
    out = torch.empty(7, 96, dtype=out_dtype, device=KERNEL_DEVICE)
    want = we.w4_expand_rows_reference(packed, scales, torch.empty_like(out))
    assert torch.equal(we.w4_expand_rows_triton(packed, scales, out), want)
    with pytest.raises(ValueError, match="contiguous"):
        we.w4_expand_rows_triton(packed, scales, torch.empty(96, 7, dtype=out_dtype, device=KERNEL_DEVICE).t())


@kernel_test
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
def test_kernel_expanded_matmul(x_dtype):
    x, packed, scales = kernel_inputs(37, 26, 96, x_dtype, torch.float16)
    x = x * 4
    tol = 2 * OUT_TOL[x_dtype]  # each weight rounded to x.dtype once, as the tensor-core GEMM rounds it
    out = wx.w4_expanded_matmul(x, packed, scales)
    assert out.shape == (37, 26) and out.dtype == x_dtype
    assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < tol
    pairs = wx.w4_expanded_matmul(x, packed, scales, gelu=True)
    assert pairs.shape == (37, 13)
    assert rel_err(pairs, wr.w4_linear_gelu_reference(x, packed, scales)) < tol
    up = torch.randn(37, 2, 26, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE, x_dtype)[:, 0]
    gated = wx.w4_expanded_matmul(x, packed, scales, gelu=True, up=up)
    assert rel_err(gated, wr.w4_linear_gelu_reference(x, packed, scales, up)) < tol
    small = wx.w4_expanded_matmul(x, packed[:3], scales[:3])  # a smaller matrix in the grown scratch
    assert torch.equal(small, out[:, :3])
    with pytest.raises(ValueError, match="16-bit"):
        wx.w4_expanded_matmul(x.float(), packed, scales)


@kernel_test
def test_kernel_expansion_scratch_grows_and_keeps_what_it_outgrew():
    first = wx.reserve_scratch(KERNEL_DEVICE, torch.float16, 1000)
    assert wx.reserve_scratch(KERNEL_DEVICE, torch.float16, 10) is first  # never shrinks
    grown = wx.reserve_scratch(KERNEL_DEVICE, torch.float16, first.numel() + 1)
    assert grown.numel() > first.numel() and any(t is first for t in wx._OUTGROWN)


@kernel_test
def test_kernel_dispatchers(monkeypatch):
    """The GEMV, the decode-batch kernel and the GEMM behind qat4.ops.w4.dispatch, each by its rows."""
    from qat4.ops.w4 import dispatch as w4

    monkeypatch.setenv("QAT4_OPS", "triton")
    monkeypatch.setattr(w4, "BATCH_ROWS", 16)  # the GEMM from 17 rows: a small shape for the interpreter
    x, packed, scales = kernel_inputs(18, 24, 64, torch.float16, torch.float16)
    reference = wr.w4_linear_reference(x, packed, scales)
    assert rel_err(w4.w4_linear(x, packed, scales), reference) < 2 * OUT_TOL[torch.float16]
    assert rel_err(w4.w4_linear(x[:2], packed, scales), reference[:2]) < OUT_TOL[torch.float16]
    assert torch.equal(w4.w4_argmax(x[:3], packed, scales), wr.w4_argmax_reference(x[:3], packed, scales))
    for rows in (x[:2], x[:8], x):  # the GEMV, the decode-batch kernel, the GEMM
        tol = OUT_TOL[torch.float16] * (1 if rows.shape[0] <= w4.GEMV_ROWS else 2)
        assert rel_err(w4.w4_linear_gelu(rows, packed, scales), wr.w4_linear_gelu_reference(rows, packed, scales)) < tol
        step = wr.ResidualStep(torch.randn_like(rows[:, :24]), torch.ones(24, device=KERNEL_DEVICE, dtype=rows.dtype))
        got, _ = w4.w4_linear_residual(rows, packed, scales, step)
        assert rel_err(got, wr.w4_linear_residual_reference(rows, packed, scales, step)[0]) < tol
    logits = w4.w4_logits(x[:8], packed, scales)
    assert rel_err(logits, wr.w4_logits_reference(x[:8], packed, scales)) < 2 * OUT_TOL[torch.float16]
    assert torch.equal(w4.w4_argmax(x[:8], packed, scales), logits.argmax(-1))
    ids = torch.tensor([1, 23], device=KERNEL_DEVICE)
    assert torch.equal(we.w4_embedding(ids, packed, scales, 16.0, torch.float16),
                       we.w4_embedding_reference(ids, packed, scales, 16.0, torch.float16))
