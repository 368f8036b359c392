"""Time the packed int4 kernels at Gemma 4 E2B shapes on a CUDA GPU and print one table.

    python tools/bench_w4.py [--dtype bf16|fp16] [--rows 1] [--sweep] [--shapes 262144x1536,...]
                             [--batch-config '{"ONE_DOT": 1}']

Decode GEMV per weight shape of one decode step: the GEMV runs over enough distinct copies of the
matrix (>= 1 GiB in all) that every launch reads its weights from HBM, as in a real decode step;
the launches are captured in one CUDA graph and timed with triton.testing.do_bench (median).
bytes = N*K/2 (codes) + N*K/16 (scales) + activations; GB/s = bytes / time. The 'per token' row
weighs each shape by its count per decode step (gemma4-e2b.md section 5.5) and compares with the
read bandwidth measured by a plain copy. --sweep also times the candidate tilings one by one.
From --rows 2 (a continuous-batching decode step up to 128; a prompt step beyond) a second table
times, the same way, the decode-batch kernel of qat4.ops.w4.batch beside the GEMV (up to 16
rows), the prefill GEMM, the expanded product of qat4.ops.w4.expanded (the matrix expanded into
its scratch, then cuBLAS) and cuBLAS on a 16-bit copy kept beside the words (dense_weights);
--sweep there times every tiling of
qat4.ops.w4.batch_tiling.batch_tiling_candidates.
Then (without --shapes): the output layer (logits, argmax), the prefill GEMM, the embeddings.
--floor instead times chains of N x 1536 GEMVs from 0.1 to 42 MB at fixed tilings, with and without
programmatic dependent launch: what a dependent GEMV costs before its bytes.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.ops.w4 import batch as wb  # noqa: E402
from qat4.ops.w4 import batch_tiling as bt  # noqa: E402
from qat4.ops.w4 import expanded as wx  # noqa: E402
from qat4.ops.w4 import gemm as wm  # noqa: E402
from qat4.ops.w4 import gemv as wv  # noqa: E402
from qat4.ops.w4 import logits as wo  # noqa: E402
from qat4.ops.w4 import tiling as wt  # noqa: E402
from qat4.ops.w4.embedding import w4_embedding  # noqa: E402

# (N, K, count per decode step); the last one is the output layer
DECODE_SHAPES = [
    (2560, 1536, 12), (5120, 1536, 3), (2048, 1536, 16), (4096, 1536, 4), (1536, 2048, 28), (1536, 4096, 7),
    (12288, 1536, 15), (24576, 1536, 20), (1536, 6144, 15), (1536, 12288, 20), (256, 1536, 35), (1536, 256, 35),
    (8960, 1536, 1), (262144, 1536, 1),
]
PREFILL_SHAPES = [(2560, 1536), (24576, 1536), (1536, 12288), (262144, 1536)]
# (RR, TR, BLOCK_G) GEMV tilings outside the autotune space, also timed by --sweep (no split)
EXTRA_TILINGS = [(16, 2, 16), (8, 1, 32), (8, 2, 32), (4, 4, 16), (8, 16, 8), (4, 8, 16)]
WORKING_SET = 1 << 30


def random_weight(n, k, scale_dtype, device, copies=1):
    """`copies` random packed matrices [N, K] (every int32 pattern is a valid word of 8 codes)."""
    packed = torch.randint(-2**31, 2**31 - 1, (copies, n, k // 8), dtype=torch.int32, device=device)
    scales = (torch.rand(copies, n, k // 32, device=device) * 0.02 + 0.001).to(scale_dtype)
    return packed, scales


def weight_bytes(n, k, scale_dtype):
    return n * k // 2 + n * k // 32 * torch.finfo(scale_dtype).bits // 8


def graph_time_us(fn, launches):
    """Median µs per launch of `fn` (which makes `launches` launches), replayed as one CUDA graph."""
    fn()  # compile, autotune, allocate scratch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / launches


def copy_bandwidth(device):
    """GB/s read by a device-to-device copy of 2 GiB (read + write counted)."""
    a = torch.empty(1 << 29, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=200, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def chained(n, k, rows, dtype, device):
    """A timer for one op on x [rows, K] and W [N, K] launched back to back over distinct copies
    of W (>= WORKING_SET in all, so every launch reads its weights from HBM) in one CUDA graph:
    time_us(launch) -> median µs per launch, launch(x, packed, scales, out [rows, N]) making one;
    with ``dense`` launch also gets each copy's 16-bit matrix (expanded once, before the timing)."""
    copies = max(1, min(256, WORKING_SET // weight_bytes(n, k, dtype)))
    packed, scales = random_weight(n, k, dtype, device, copies)
    x = torch.randn(rows, k, dtype=dtype, device=device)
    out = torch.empty(copies, rows, n, dtype=dtype, device=device)
    matrices = []

    def time_us(launch, dense=False):
        if dense and not matrices:
            matrices.extend(wx.expand_matrix(packed[i], scales[i], dtype) for i in range(copies))
        extra = (lambda i: (matrices[i],)) if dense else (lambda i: ())  # noqa: E731
        return graph_time_us(lambda: [launch(x, packed[i], scales[i], out[i], *extra(i)) for i in range(copies)], copies)

    return time_us


def chained_matvec(n, k, rows, dtype, device):
    """:func:`chained` for the GEMV: time_us(config=None) -> median µs per launch, with `config`
    as w4_matvec takes it."""
    time_us = chained(n, k, rows, dtype, device)
    return lambda config=None: time_us(lambda x, p, s, o: wv.w4_matvec(x, p, s, o, config=config))


def bench_matvec(dtype, rows, sweep, shapes, device, peak):
    """The GEMV table; returns µs per launch per (N, K)."""
    print(f"\n# decode GEMV, x [{rows}, K] {dtype}, scales {dtype}, CUDA graph over distinct copies, median")
    print(f"{'N x K':>14} {'count':>5} {'µs':>8} {'GB/s':>7} {'% copy':>6}  config")
    total_us = total_bytes = 0.0
    timed = {}
    for n, k, count in shapes:
        nbytes = weight_bytes(n, k, dtype) + rows * k * 2 + rows * n * 2
        time_us = chained_matvec(n, k, rows, dtype, device)
        us = timed[n, k] = time_us()
        best = wv._matvec_tuned.best_config
        gbs = nbytes / us / 1e3
        total_us += us * count
        total_bytes += nbytes * count
        print(f"{n:>7} x {k:<5} {count:>5} {us:>8.2f} {gbs:>7.0f} {100 * gbs / peak:>5.0f}%  "
              f"RR={best.kwargs['RR']} TR={best.kwargs['TR']} BG={best.kwargs['BLOCK_G']} split={best.kwargs['SPLIT_K']}")
        if sweep:
            tuned = wt.matvec_tiling_candidates((n, k // 32, wt.matvec_block_m(rows)), device)
            extra = [{"RR": rr, "TR": tr, "BLOCK_G": bg, "SPLIT_K": 1} for rr, tr, bg in EXTRA_TILINGS]
            for tiling in tuned + extra:
                us_t = time_us(tiling)
                print(f"{'':>22} {us_t:>8.2f} {nbytes / us_t / 1e3:>7.0f}         {tiling}")
        del time_us  # frees this shape's copies before the next shape's
    gbs = total_bytes / total_us / 1e3
    print(f"{'per token':>14} {'':>5} {total_us:>8.1f} {gbs:>7.0f} {100 * gbs / peak:>5.0f}%  "
          f"({total_bytes / 1e9:.3f} GB over {sum(c for *_, c in shapes)} GEMVs)")
    return timed


def describe_batch_tiling(t):
    return (f"BM={t['BLOCK_M']} BN={t['BLOCK_N']} BG={t['BLOCK_G']} split={t['SPLIT_K']} pf={t['PREFETCH']} "
            f"1dot={t['ONE_DOT']} pairs={t['PAIR_UNPACK'] if os.environ.get('QAT4_PAIR_UNPACK') != '0' else 0} "
            f"l2={t['L2_PREFETCH'] if os.environ.get('QAT4_L2_PREFETCH') != '0' else 0} "
            f"w={t['num_warps']} st={t['num_stages']}")


def bench_batch(dtype, rows, sweep, shapes, device, peak, gemv_us=None, pinned=None):
    """Per decode shape: the GEMV (from `gemv_us`, the GEMV table's timings, when given), the
    prefill GEMM, the expanded product, cuBLAS on a kept 16-bit copy (``dense_weights``) and the
    decode-batch kernel at its table's tiling with the keys of `pinned` (--batch-config), each over
    distinct copies in one CUDA graph; --sweep adds every candidate tiling of the batch kernel."""
    gemv_us = gemv_us or {}
    print(f"\n# decode batch, x [{rows}, K] {dtype}, CUDA graph over distinct copies, median µs per launch; "
          f"GB/s and % copy of the batch kernel")
    print(f"{'N x K':>14} {'count':>5} {'GEMV':>8} {'GEMM':>8} {'expand':>8} {'dense':>8} {'batch':>8} {'GB/s':>7} "
          f"{'% copy':>6}  batch tiling")
    totals = {"GEMV": 0.0, "GEMM": 0.0, "expand": 0.0, "dense": 0.0, "batch": 0.0}
    total_bytes = 0.0
    for n, k, count in shapes:
        nbytes = weight_bytes(n, k, dtype) + rows * k * 2 + rows * n * 2
        time_us = chained(n, k, rows, dtype, device)
        tiling = bt.resolve_tiling(pinned, n, k, rows, device)
        gemm = time_us(lambda x, p, s, o: wm.w4_matmul(x, p, s))
        expand = time_us(lambda x, p, s, o: wx.w4_expanded_matmul(x, p, s))
        dense = time_us(lambda x, p, s, o, d: wx.w4_expanded_matmul(x, p, s, dense=d), dense=True)
        batch = time_us(lambda x, p, s, o: wb.w4_batch_linear(x, p, s, out=o, config=tiling))
        gemv = gemv_us.get((n, k))
        for name, us in (("GEMV", gemv), ("GEMM", gemm), ("expand", expand), ("dense", dense), ("batch", batch)):
            totals[name] += (us or 0.0) * count
        total_bytes += nbytes * count
        gbs = nbytes / batch / 1e3
        gemv_cell = f"{gemv:>8.2f}" if gemv is not None else f"{'-':>8}"
        print(f"{n:>7} x {k:<5} {count:>5} {gemv_cell} {gemm:>8.2f} {expand:>8.2f} {dense:>8.2f} {batch:>8.2f} {gbs:>7.0f} "
              f"{100 * gbs / peak:>5.0f}%  "
              f"{describe_batch_tiling(tiling)}")
        if sweep:
            for candidate in bt.batch_tiling_candidates(n, k, rows, device)[1:]:
                us = time_us(lambda x, p, s, o, c=candidate: wb.w4_batch_linear(x, p, s, out=o, config=c))
                print(f"{'':>56} {us:>8.2f} {nbytes / us / 1e3:>7.0f}         {describe_batch_tiling(candidate)}")
        del time_us  # frees this shape's copies before the next shape's
    gbs = total_bytes / totals["batch"] / 1e3
    gemv_total = f"{totals['GEMV']:>8.1f}" if gemv_us else f"{'-':>8}"
    print(f"{'per token':>14} {'':>5} {gemv_total} {totals['GEMM']:>8.1f} {totals['expand']:>8.1f} {totals['dense']:>8.1f} "
          f"{totals['batch']:>8.1f} "
          f"{gbs:>7.0f} "
          f"{100 * gbs / peak:>5.0f}%  ({total_bytes / 1e9:.3f} GB over {sum(c for *_, c in shapes)} launches)")


FLOOR_ROWS = (128, 512, 1536, 3072, 6144, 12288, 24576, 49152)
FLOOR_TILINGS = [(8, 2, 16, 1), (2, 8, 16, 1), (8, 2, 16, 3)]  # (RR, TR, BLOCK_G, SPLIT_K)


def bench_floor(dtype, device):
    """µs per launch of chained N x 1536 GEMVs (distinct copies) per fixed tiling, PDL on and off."""
    k = 1536
    heads = [f"{'x'.join(map(str, t))} {'pdl' if pdl else 'no pdl'}" for t in FLOOR_TILINGS for pdl in (True, False)]
    print(f"\n# chained GEMV N x {k} {dtype}, µs per launch; tilings RRxTRxBLOCK_GxSPLIT_K")
    print(f"{'N':>6} {'MB':>6} " + " ".join(f"{h:>15}" for h in heads))
    pdl_setting = os.environ.get("QAT4_PDL")
    for n in FLOOR_ROWS:
        time_us = chained_matvec(n, k, 1, dtype, device)
        cells = []
        for rr, tr, bg, split in FLOOR_TILINGS:
            for pdl in (True, False):
                os.environ["QAT4_PDL"] = "1" if pdl else "0"
                cells.append(time_us({"RR": rr, "TR": tr, "BLOCK_G": bg, "SPLIT_K": split}))
        print(f"{n:>6} {weight_bytes(n, k, dtype) / 1e6:>6.2f} " + " ".join(f"{us:>15.2f}" for us in cells))
        del time_us
    if pdl_setting is None:
        os.environ.pop("QAT4_PDL")
    else:
        os.environ["QAT4_PDL"] = pdl_setting


def bench_output(dtype, device, peak):
    n, k = 262144, 1536
    packed, scales = random_weight(n, k, dtype, device)
    print(f"\n# output layer {n} x {k}, fp32 logits with softcap 30")
    print(f"{'op':>14} {'rows':>5} {'µs':>8} {'GB/s':>7} {'% copy':>6}")
    for rows in (1, 4):
        x = torch.randn(rows, k, dtype=dtype, device=device)
        for name, fn, out_bytes in (("logits", wo.w4_logits_triton, rows * n * 4), ("argmax", wo.w4_argmax_triton, 0)):
            us = graph_time_us(lambda: fn(x, packed[0], scales[0]), 1)
            gbs = (weight_bytes(n, k, dtype) + out_bytes) / us / 1e3
            print(f"{name:>14} {rows:>5} {us:>8.1f} {gbs:>7.0f} {100 * gbs / peak:>5.0f}%")


def bench_prefill(dtype, device):
    print(f"\n# prefill GEMM, {dtype}, do_bench median (TFLOP/s = 2*M*N*K / time); fp32 path at M = 512")
    print(f"{'N x K':>14} {'M':>5} {'µs':>9} {'TFLOP/s':>8} {'fp32 TFLOP/s':>13}")
    for n, k in PREFILL_SHAPES:
        packed, scales = random_weight(n, k, dtype, device)
        for m in (512, 4096):
            x = torch.randn(m, k, dtype=dtype, device=device)
            tflops = lambda fp32: 2 * m * n * k / 1e9 / triton.testing.do_bench(
                lambda: wm.w4_matmul(x, packed[0], scales[0], fp32=fp32), return_mode="median")
            tc = tflops(None)
            f32 = f"{tflops(True):13.1f}" if m == 512 else ""
            print(f"{n:>7} x {k:<5} {m:>5} {2 * m * n * k / tc / 1e6:>9.1f} {tc:>8.1f} {f32:>13}")


def bench_embedding(dtype, device):
    print("\n# embedding lookups (one token, and 512), CUDA graph, median")
    print(f"{'table':>14} {'tokens':>6} {'µs':>8}")
    for name, k, scale in (("embed", 1536, 39.25), ("per-layer", 8960, 16.0)):
        packed, scales = random_weight(262144, k, torch.float16, device)
        for t in (1, 512):
            ids = torch.randint(0, 262144, (t,), device=device)
            us = graph_time_us(lambda: w4_embedding(ids, packed[0], scales[0], scale, dtype), 1)
            print(f"{name:>14} {t:>6} {us:>8.2f}")
        del packed, scales


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--rows", type=int, default=1,
                        help="rows of x: the GEMV table up to 16, the decode-batch table from 2")
    parser.add_argument("--sweep", action="store_true", help="also time every GEMV and decode-batch tiling")
    parser.add_argument("--shapes", help="decode shapes to time, e.g. 262144x1536,1536x12288 (default: all)")
    parser.add_argument("--batch-config", type=json.loads, metavar="JSON",
                        help='keys pinned on the decode-batch kernel\'s table tiling, e.g. \'{"ONE_DOT": 1}\'')
    parser.add_argument("--floor", action="store_true", help="only the chained-GEMV cost against weight bytes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_w4 needs a CUDA GPU.")
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    peak = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {peak:.0f} GB/s (read + write)")
    if args.floor:
        bench_floor(dtype, device)
        return
    shapes = DECODE_SHAPES
    if args.shapes:
        wanted = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
        shapes = [shape for shape in DECODE_SHAPES if shape[:2] in wanted]
    if args.rows < 1:
        sys.exit("--rows must be at least 1.")
    gemv_us = bench_matvec(dtype, args.rows, args.sweep, shapes, device, peak) if args.rows <= wv.MAX_MATVEC_ROWS else None
    if args.rows >= 2:
        bench_batch(dtype, args.rows, args.sweep, shapes, device, peak, gemv_us, args.batch_config)
    if not args.shapes:
        bench_output(dtype, device, peak)
        bench_prefill(dtype, device)
        bench_embedding(dtype, device)


if __name__ == "__main__":
    main()
