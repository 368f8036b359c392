"""The decode-batch int4 kernels of qat4.ops.w4.batch against the torch references of
qat4.ops.w4.reference, and their tiling table.

As in tests/test_ops_w4.py, the kernel tests (test_kernel_*) run on CUDA when present, else under
the Triton interpreter in a subprocess with TRITON_INTERPRET=1. The interpreter cannot run a bf16
tl.dot, so there the kernel multiplies the bf16-rounded weights and bf16 x in fp32 (the values
the tensor cores would multiply), and it truncates fp32 -> bf16 instead of rounding. Shapes are
tiny (N <= 256, K <= 512) so the file stays fast; tests/gpu/test_w4_batch_gpu.py covers the
Gemma 4 E2B shapes. Every output starts as NaN, so an element the kernel leaves unwritten fails.
"""

import types

import pytest
import torch
from kernel_harness import INTERPRETED, KERNEL_DEVICE, kernel_test, run_interpreted

from qat4.checkpoint import packing
from qat4.ops import pdl
from qat4.ops.w4 import batch as wb
from qat4.ops.w4 import batch_tiling as bt
from qat4.ops.w4 import reference as wr

# Relative Frobenius error allowed per x dtype. fp32: accumulation order only. 16-bit: each
# weight is rounded to x.dtype once (2^-11 fp16, 2^-8 bf16; truncated, so up to twice that, under
# the interpreter) and a 16-bit output once more: twice test_ops_w4's GEMV tolerance, as for its
# tensor-core GEMM.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2 if INTERPRETED else 8e-3}
# E2B's decode shapes (N, K), as tools/bench_w4.py times them
DECODE_SHAPES = [(2560, 1536), (5120, 1536), (2048, 1536), (4096, 1536), (1536, 2048), (1536, 4096), (12288, 1536),
                 (24576, 1536), (1536, 6144), (1536, 12288), (256, 1536), (1536, 256), (262144, 1536)]


def inputs(m, n, k, x_dtype, scale_dtype, seed, x_scale=1.0):
    """Fresh random levels, steps of either sign and x on KERNEL_DEVICE -> (x, packed, scales)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-8, 8, (n, k), generator=g)
    steps = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.002) * (torch.randint(0, 2, (n, k // 32), generator=g) * 2 - 1)
    x = torch.randn(m, k, generator=g) * x_scale
    return (x.to(KERNEL_DEVICE, x_dtype), packing.pack_levels(levels).to(KERNEL_DEVICE),
            steps.to(KERNEL_DEVICE, scale_dtype))


def nans(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=KERNEL_DEVICE)


def rel_err(actual, expected):
    a, e = actual.double().cpu(), expected.double().cpu()
    assert not a.isnan().any(), "unwritten (NaN) outputs"
    return float((a - e).norm() / e.norm())


def test_triton_kernels_under_interpreter(request):
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1 (shared by the kernel
    test files of the session)."""
    run_interpreted(__file__, request)


# ----------------------------------------------------------------------------------------------
# Kernels

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@kernel_test
@pytest.mark.parametrize("m,n,k,x_dtype,scale_dtype,config", [
    (1, 64, 256, BF16, BF16, None),  # the table's tiling
    (2, 64, 256, F32, F16, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 1}),  # no tail: unmasked weights
    (5, 96, 512, F16, BF16, {"BLOCK_N": 64, "BLOCK_G": 4, "SPLIT_K": 3}),  # row tail; splits of 8, 8, 0 groups
    (16, 64, 512, BF16, F16, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 4, "PREFETCH": 1}),  # whole splits, 1 ahead
    (33, 256, 96, F16, F16, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_G": 4, "SPLIT_K": 1}),  # group tail, 2 x blocks
    (64, 96, 512, F32, BF16, {"BLOCK_N": 64, "BLOCK_G": 8, "SPLIT_K": 2, "PREFETCH": 2}),  # 2 steps ahead
    (33, 64, 256, F16, BF16, None),  # the table at BLOCK_M = 64
    (130, 40, 128, F16, F16, None),  # two blocks of 128 rows of x, one block of W wider than W
    (5, 96, 512, F16, BF16, {"BLOCK_N": 64, "BLOCK_G": 4, "SPLIT_K": 3, "ONE_DOT": 1}),  # one dot a step, tails
    (16, 64, 512, F32, F16, {"BLOCK_N": 32, "BLOCK_G": 8, "SPLIT_K": 2, "PREFETCH": 2, "ONE_DOT": 1}),
    (33, 256, 96, BF16, F16, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_G": 4, "SPLIT_K": 1, "ONE_DOT": 1}),
])
def test_kernel_batch_linear(m, n, k, x_dtype, scale_dtype, config):
    x, packed, scales = inputs(m, n, k, x_dtype, scale_dtype, seed=m * 1000 + n + k)
    out = nans(m, n, dtype=x_dtype)
    assert wb.w4_batch_linear(x, packed, scales, out=out, config=config) is out
    assert rel_err(out, wr.w4_linear_reference(x, packed, scales)) < TOL[x_dtype]
    fresh = wb.w4_batch_linear(x, packed, scales, config=config)
    assert fresh.shape == (m, n) and fresh.dtype == x_dtype and torch.equal(fresh, out)


@kernel_test
def test_kernel_batch_split_k_is_deterministic_and_resets_its_tickets():
    """Two launches of a 4-way split over a row tail and an x tail agree bit for bit (the last
    program adds the partials in split order), and the second one, which starts from the
    counters the first left, is right too."""
    x, packed, scales = inputs(17, 80, 512, F32, F16, seed=11)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 4}
    first = wb.w4_batch_linear(x, packed, scales, out=nans(17, 80, dtype=F32), config=config)
    second = wb.w4_batch_linear(x, packed, scales, out=nans(17, 80, dtype=F32), config=config)
    assert torch.equal(first, second)
    assert rel_err(second, wr.w4_linear_reference(x, packed, scales)) < TOL[F32]
    locks, _ = wb.batch_scratch(x.device)
    assert not locks.any()


@kernel_test
@pytest.mark.parametrize("m,x_dtype,config", [
    (5, F32, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 3}),
    (16, F16, {"BLOCK_N": 64, "BLOCK_G": 8, "SPLIT_K": 1}),
    (20, BF16, None),
    (7, F16, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 2, "ONE_DOT": 1}),
])
def test_kernel_batch_gelu_gates_in_the_epilogue(m, x_dtype, config):
    """Alternating gate/up rows (the MLP; a row tail of whole pairs) and gelu(y) * up with up a
    strided view (the per-layer input)."""
    x, packed, scales = inputs(m, 48, 512, x_dtype, F16, seed=m, x_scale=4.0)  # gates of a few units
    pairs = nans(m, 24, dtype=x_dtype)
    wb.w4_batch_linear_gelu(x, packed, scales, out=pairs, config=config)
    assert rel_err(pairs, wr.w4_linear_gelu_reference(x, packed, scales)) < TOL[x_dtype]
    table = torch.randn(m, 3, 48, generator=torch.Generator().manual_seed(m + 1)).to(KERNEL_DEVICE, x_dtype)
    gated = nans(m, 48, dtype=x_dtype)
    wb.w4_batch_linear_gelu(x, packed, scales, table[:, 1], out=gated, config=config)
    assert rel_err(gated, wr.w4_linear_gelu_reference(x, packed, scales, table[:, 1])) < TOL[x_dtype]


@kernel_test
@pytest.mark.parametrize("m,x_dtype,config", [
    (2, F32, None),
    (17, F16, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 2}),
    (9, F32, {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": 1, "ONE_DOT": 1}),
])
def test_kernel_batch_logits_and_argmax(m, x_dtype, config):
    """fp32 logits with the softcap bending them (and without a softcap); the argmax equals
    torch.argmax of the kernel's own logits and the reference's."""
    x, packed, scales = inputs(m, 72, 128, x_dtype, F16, seed=m + 5, x_scale=8.0)
    for cap in (30.0, None):
        logits = nans(m, 72, dtype=F32)
        wb.w4_batch_logits(x, packed, scales, cap, out=logits, config=config)
        assert rel_err(logits, wr.w4_logits_reference(x, packed, scales, cap)) < TOL[x_dtype]
        if cap is not None:
            assert logits.abs().max() < cap
        top = wb.w4_batch_argmax(x, packed, scales, cap, config=config)
        assert top.dtype == torch.int64 and top.shape == (m,)
        assert torch.equal(top, torch.argmax(logits, dim=-1))
        assert torch.equal(top, wr.w4_argmax_reference(x, packed, scales, cap))


@kernel_test
def test_kernel_batch_argmax_ties_go_to_the_lowest_index():
    """Row 0 of x peaks on identical rows 21, 40 and 75 of W (bit-equal logits in three blocks of
    32 rows); row 1 (= -row 0) peaks on row 76, in the last, partial block."""
    x, packed, scales = inputs(2, 77, 64, F32, F16, seed=3)
    x[1] = -x[0]

    def peak(v):  # the packed row whose dot product with v is largest
        return packing.pack_levels(torch.where(v.cpu() > 0, 7, -8)[None])[0].to(KERNEL_DEVICE)

    for r, v in ((21, x[0]), (40, x[0]), (75, x[0]), (76, x[1])):
        packed[r], scales[r] = peak(v), 0.05
    for split in (1, 2):
        config = {"BLOCK_N": 32, "BLOCK_G": 4, "SPLIT_K": split}
        assert wb.w4_batch_argmax(x, packed, scales, config=config).tolist() == [21, 76]
    assert wr.w4_argmax_reference(x, packed, scales).tolist() == [21, 76]


# ----------------------------------------------------------------------------------------------
# Tilings and launch options (no kernel runs)


@pytest.mark.parametrize("m", [2, 16, 17, 64, 65, 128])
def test_tiling_table_fills_an_h200_at_every_decode_shape(m):
    for n, k in DECODE_SHAPES:
        tiling = bt.batch_tiling(n, k, m, sm_count=132)
        assert set(tiling) == set(bt.TILING_KEYS)
        assert tiling["BLOCK_M"] >= min(m, 128) and tiling["BLOCK_M"] in (16, 32, 64, 128)
        assert 32 * tiling["BLOCK_G"] % 128 == 0  # BLOCK_K: 16-byte loads of words
        assert bt._fits(n, m, tiling)
        g = k // 32
        assert g % (tiling["BLOCK_G"] * tiling["SPLIT_K"]) == 0, (n, k, tiling)  # whole steps: the unmasked path
        programs = lambda split: -(-n // tiling["BLOCK_N"]) * -(-m // tiling["BLOCK_M"]) * split  # noqa: E731
        per_sm = bt._programs_per_sm(tiling)
        step = tiling["BLOCK_N"] * tiling["BLOCK_G"] * 18 * max(1, tiling["PREFETCH"])  # weight bytes of a step
        full = lambda split: programs(split) >= 132 and min(per_sm, programs(split) / 132) * step >= 32768  # noqa: E731
        rows_pad, m_pad = -(-n // tiling["BLOCK_N"]) * tiling["BLOCK_N"], -(-m // tiling["BLOCK_M"]) * tiling["BLOCK_M"]
        moved = n * k * 9 // 16 + rows_pad // tiling["BLOCK_N"] * m_pad * k * 2  # weights, and x per row block
        slots = per_sm * 132
        one_wave = [s for s in bt._even_splits(g, tiling["BLOCK_G"]) if bt._fits(n, m, dict(tiling, SPLIT_K=s))
                    and (s == 1 or 8 * s * rows_pad * m_pad <= 2 * moved) and programs(s) <= slots] or [1]
        # the smallest split of whole steps that keeps 32 KiB of weights in flight on every SM in
        # one wave, else the largest in one wave, counting only splits that fit the scratch with
        # partials of at most twice the bytes moved anyway
        assert tiling["SPLIT_K"] == next((s for s in one_wave if full(s)), one_wave[-1]), (n, k, tiling)
        if n == 262144:
            assert tiling["SPLIT_K"] == 1  # the output layer: row blocks enough, and no partials
        candidates = bt.batch_tiling_candidates(n, k, m, sm_count=132)
        assert candidates[0] == tiling and len(candidates) == len({tuple(sorted(c.items())) for c in candidates})
        assert all(bt._fits(n, m, c) for c in candidates)
        assert candidates[1] == dict(tiling, ONE_DOT=1 - tiling["ONE_DOT"])  # timed beside the table's
        assert tiling["ONE_DOT"] == (tiling["BLOCK_M"] == 16 and g <= tiling["BLOCK_G"])  # one step: one dot
        assert candidates[2] == dict(tiling, PAIR_UNPACK=1 - tiling["PAIR_UNPACK"])
        steps = -(-(-(-g // tiling["SPLIT_K"])) // tiling["BLOCK_G"])  # of each program
        # pairs where they measured faster: 4 groups a step, or one step of a 16-row tile
        assert tiling["PAIR_UNPACK"] == (tiling["BLOCK_G"] == 4 or (tiling["BLOCK_M"] == 16 and steps == 1))
        assert tiling["L2_PREFETCH"] == 0  # no device, no L2
        assert candidates[3] == dict(tiling, L2_PREFETCH=1)
        l2 = 50 << 20  # an H200's: prefetch on 64-row programs of 3 steps or more
        for c in bt.batch_tiling_candidates(n, k, m, sm_count=132, l2_bytes=l2)[4:]:
            c_steps = -(-(-(-g // c["SPLIT_K"])) // c["BLOCK_G"])
            assert c["L2_PREFETCH"] == (c["BLOCK_M"] == 64 and c_steps >= 3 and n != 262144), c


def test_l2_prefetch_where_it_was_timed_faster():
    """On an H200 (132 SMs, 50 MiB of L2) the table prefetches the long 64-row products of a decode
    step (measured faster) and nothing at 2-16 rows or 128 (slower or untimed), never the output
    layer's 201 MB; an L2 too small for the matrix turns it off."""
    l2 = 50 << 20
    prefetched = {(n, k) for n, k in DECODE_SHAPES if bt.batch_tiling(n, k, 64, sm_count=132, l2_bytes=l2)["L2_PREFETCH"]}
    assert prefetched == {(12288, 1536), (24576, 1536), (1536, 6144), (1536, 12288)}
    for m in (2, 16, 128):
        assert not any(bt.batch_tiling(n, k, m, sm_count=132, l2_bytes=l2)["L2_PREFETCH"] for n, k in DECODE_SHAPES)
    assert bt.batch_tiling(262144, 1536, 64, sm_count=132, l2_bytes=l2)["L2_PREFETCH"] == 0
    assert bt.batch_tiling(1536, 12288, 64, sm_count=132, l2_bytes=4 << 20)["L2_PREFETCH"] == 0
    assert bt.resolve_tiling({"SPLIT_K": 1}, 1536, 6144, 64, None)["L2_PREFETCH"] == 0  # no device, no L2


def test_tiling_splits_the_long_down_projection():
    """1536 x 12288 at 16 rows: 24 row blocks alone would leave most of 132 SMs idle."""
    tiling = bt.batch_tiling(1536, 12288, 16, sm_count=132)
    assert tiling["SPLIT_K"] > 1
    assert 1536 // tiling["BLOCK_N"] * tiling["SPLIT_K"] >= 2 * 132


def test_config_pins_keys_and_bad_tilings_are_rejected():
    pinned = bt.resolve_tiling({"BLOCK_N": 32, "SPLIT_K": 2}, 64, 256, 3, "cpu")
    assert pinned["BLOCK_N"] == 32 and pinned["SPLIT_K"] == 2 and pinned["BLOCK_M"] == 16
    assert pinned["ONE_DOT"] == 1  # K = 256 is one step of the table's 8 groups
    assert bt.resolve_tiling({"BLOCK_G": 4}, 64, 256, 3, "cpu")["ONE_DOT"] == 0  # two steps: eight dots
    assert bt.resolve_tiling({"BLOCK_G": 4, "ONE_DOT": 1}, 64, 256, 3, "cpu")["ONE_DOT"] == 1
    assert bt.resolve_tiling({"BLOCK_G": 4}, 64, 256, 3, "cpu")["PAIR_UNPACK"] == 1  # the rule, for the tile pinned
    assert bt.resolve_tiling({"BLOCK_G": 4, "PAIR_UNPACK": 0}, 64, 256, 3, "cpu")["PAIR_UNPACK"] == 0
    for bad in ({"BLOCK_G": 2}, {"BLOCK_N": 48}, {"BLOCK_M": 8}, {"PREFETCH": 3}, {"SPLIT_K": 0}, {"RR": 4},
                {"num_stages": 0}, {"ONE_DOT": 2}, {"PAIR_UNPACK": 2}, {"L2_PREFETCH": 2}):
        with pytest.raises(ValueError):
            bt.resolve_tiling(bad, 64, 256, 3, "cpu")
    with pytest.raises(ValueError, match="scratch"):
        bt.resolve_tiling({"BLOCK_M": 128, "BLOCK_N": 256, "SPLIT_K": 16}, 262144, 1536, 128, "cpu")
    x = torch.randn(2, 64)
    packed, scales = torch.zeros(48, 8, dtype=torch.int32), torch.ones(48, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        wb.w4_batch_linear(x, packed, scales, out=torch.empty(2, 47))
    with pytest.raises(ValueError, match="even"):
        wb.w4_batch_linear_gelu(x, packed[:47], scales[:47])


def test_pdl_reaches_decode_batches_but_not_prefill_chunks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QAT4_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    gpu_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    on = lambda rows: pdl.pdl_launch(gpu_tensor, rows)["USE_PDL"]  # noqa: E731
    assert on(1) and on(128) and not on(129) and not on(256)


# ----------------------------------------------------------------------------------------------
# Unpacking two weights per instruction (PAIR_UNPACK): its PTX run here, and when it is used


def _halves(value: int, dtype) -> torch.Tensor:
    return torch.tensor([value & 0xFFFF, value >> 16], dtype=torch.int32).to(torch.int16).view(dtype)


def _packed_fma(a: int, b: int, c: int, dtype) -> int:
    """fma.rn on two 16-bit halves: the exact a * b + c (exact in fp64 for these values), rounded
    to nearest even once (fp64 -> fp32 exact here, fp32 -> dtype rounds)."""
    exact = _halves(a, dtype).double() * _halves(b, dtype).double() + _halves(c, dtype).double()
    bits = exact.float().to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def run_pairs_asm(asm: str, word0: int, word1: int, steps: int, dtype) -> list[int]:
    """Execute the PTX of batch._nibble_pairs (the instructions it uses, on uint32 registers):
    $8, $9 = the two words, $10 = their steps as two halves; returns $0..$7."""
    regs = {"$8": word0 & 0xFFFFFFFF, "$9": word1 & 0xFFFFFFFF, "$10": steps}
    value = lambda operand: regs[operand] if operand in regs else int(operand, 0)  # noqa: E731
    for line in asm.strip("{}\n").splitlines():
        op, _, rest = line.rstrip(";").partition(" ")
        if op.startswith(".reg"):
            continue
        d, *args = [a.strip() for a in rest.split(",")]
        a = [value(x) for x in args]
        if op == "mov.b32":
            regs[d] = a[0]
        elif op == "prmt.b32":
            source = (a[1] << 32 | a[0]).to_bytes(8, "little")
            assert a[2] & 0x8888 == 0, "sign-replicating selectors are not used"
            regs[d] = int.from_bytes(bytes(source[(a[2] >> 4 * i) & 7] for i in range(4)), "little")
        elif op == "shr.b32":
            regs[d] = a[0] >> a[1]
        elif op == "lop3.b32":
            x, y, z, lut = a
            regs[d] = sum(1 << bit for bit in range(32)
                          if lut >> ((x >> bit & 1) << 2 | (y >> bit & 1) << 1 | (z >> bit & 1)) & 1)
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            assert op == ("fma.rn.bf16x2" if dtype == torch.bfloat16 else "fma.rn.f16x2")
            regs[d] = _packed_fma(*a, dtype)
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
    return [regs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pair_unpacking_ptx_gives_the_reference_weights(dtype):
    """Plane i's halves are (nibble i of word 0 - 8) * step 0 and (nibble i of word 1 - 8) * step 1,
    rounded once to dtype, as the fp32 route and the reference round them, for every code and
    steps of 11 significant bits (fp16) and of either sign."""
    asm = (wb._PAIR_UNPACK_BF16 if dtype == torch.bfloat16 else wb._PAIR_UNPACK_FP16).value
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(2**31), 2**31, (24, 2), generator=g, dtype=torch.int64)
    words[0] = torch.tensor([0x76543210, -0x01234568])  # every code in both words
    steps = ((torch.rand(24, 2, generator=g) * 0.03 + 1e-4) * (torch.randint(0, 2, (24, 2), generator=g) * 2 - 1))
    steps = steps.to(torch.float16).to(dtype)  # fp16's 11 significant bits where dtype is fp16
    for (w0, w1), (s0, s1) in zip(words.tolist(), steps):
        packed_steps = int(torch.stack([s0, s1]).view(torch.int16)[0]) & 0xFFFF | (
            int(torch.stack([s0, s1]).view(torch.int16)[1]) & 0xFFFF) << 16
        planes = run_pairs_asm(asm, w0, w1, packed_steps, dtype)
        for i, plane in enumerate(planes):
            got = _halves(plane, dtype)
            codes = torch.tensor([(w0 >> 4 * i) & 15, (w1 >> 4 * i) & 15])
            want = ((codes - 8).float() * torch.stack([s0, s1]).float()).to(dtype)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (i, hex(w0), hex(w1), got, want)


def test_l2_prefetch_needs_a_gpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QAT4_L2_PREFETCH", raising=False)
    on_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert wb.prefetches_l2(on_gpu)  # on unless turned off
    assert not wb.prefetches_l2(torch.zeros(2, 32))
    monkeypatch.setenv("QAT4_L2_PREFETCH", "0")
    assert not wb.prefetches_l2(on_gpu)
    monkeypatch.setenv("QAT4_L2_PREFETCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not wb.prefetches_l2(on_gpu)


def test_pair_unpacking_needs_16_bit_x_with_steps_alike_on_a_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QAT4_PAIR_UNPACK", raising=False)
    monkeypatch.setattr(wb, "_has_packed_half_fma", lambda index: True)
    on_gpu = lambda dtype: types.SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", 0))  # noqa: E731
    steps = lambda dtype: types.SimpleNamespace(dtype=dtype)  # noqa: E731
    assert wb.unpacks_pairs(on_gpu(BF16), steps(BF16)) and wb.unpacks_pairs(on_gpu(F16), steps(F16))
    assert not wb.unpacks_pairs(on_gpu(BF16), steps(F16))  # fp16 steps: the fp32 route rounds once
    assert not wb.unpacks_pairs(on_gpu(F32), steps(F32))
    assert not wb.unpacks_pairs(torch.zeros(2, 32, dtype=BF16), torch.zeros(2, 1, dtype=BF16))  # the CPU
    monkeypatch.setenv("QAT4_PAIR_UNPACK", "0")
    assert not wb.unpacks_pairs(on_gpu(BF16), steps(BF16))
    monkeypatch.delenv("QAT4_PAIR_UNPACK")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not wb.unpacks_pairs(on_gpu(BF16), steps(BF16))
    monkeypatch.setattr(wb, "_has_packed_half_fma", lambda index: False)  # before sm_80
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not wb.unpacks_pairs(on_gpu(BF16), steps(BF16))
