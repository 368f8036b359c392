"""Time decode and prefill attention at Gemma 4 E2B shapes on a CUDA GPU.

Decode: D=256 over a 512-slot ring (window 512) and D=512 over a 131,072-slot full cache at
several lengths; each timed eagerly and as CUDA-graph replays (how the engine runs decode), with
the torch reference alongside. Prefill: a 256-token chunk over a sliding ring + chunk (768 keys)
and over full prefixes up to 131,072 keys. Medians of triton.testing.do_bench; GB/s counts the K
and V bytes read once; TFLOP/s counts 4 * heads * (query, visible key) pairs * D.

    python tools/bench_attention.py [--dtype bf16|fp16] [--only decode|prefill] [--sweep]

--sweep also times other split counts and tiles for each case.
"""

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.ops import attention as attn  # noqa: E402

H = 8
CACHE = 131072
L2_BYTES = 50 << 20
# prefill tiles (block_r, block_n, warps, stages) timed by --sweep
PREFILL_SWEEP_512 = [(32, 32, 4, 2), (32, 64, 4, 2), (64, 32, 8, 2), (64, 16, 8, 3), (64, 32, 4, 2), (128, 16, 8, 2)]
PREFILL_SWEEP_256 = [(64, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (32, 64, 4, 2), (64, 64, 4, 3)]


def rotating_caches(rows_used, capacity, D, dtype, max_sets=400):
    """Views k[i], v[i] of ``capacity`` rows whose first ``rows_used`` rows are distinct memory, so
    that cycling through them reads from HBM rather than L2 (enough sets for 4x the L2)."""
    n = max(1, min(max_sets, -(-4 * L2_BYTES // (rows_used * D * 4))))
    k = torch.randn(capacity + (n - 1) * rows_used, D, device="cuda").to(dtype)
    v = torch.randn_like(k)
    return [(k[i * rows_used : i * rows_used + capacity], v[i * rows_used : i * rows_used + capacity]) for i in range(n)]


def median_us(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def graph_us(step, calls):
    """Per-call time of ``calls`` launches of ``step(i)`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    return median_us(graph.replay) / calls


def cycler(n):
    state = itertools.count()
    return lambda: next(state) % n


def bench_decode(D, capacity, length, dtype, window=None, sweep=False):
    ring = window is not None
    rows_used = capacity if ring else length
    sets = rotating_caches(rows_used, capacity, D, dtype)
    q = torch.randn(H, D, device="cuda").to(dtype)
    pos = torch.tensor([length - 1], device="cuda")
    slot_pos = None
    if ring:
        first = length - capacity
        slot_pos = ((torch.arange(capacity, device="cuda") - first) % capacity + first).to(torch.int32)
    kw = dict(window=window, slot_pos=slot_pos)
    nbytes = 2 * min(length, capacity) * D * q.element_size()
    nxt = cycler(len(sets))
    name = f"decode D={D} {'ring' if ring else 'cache'}={capacity} len={length}"
    ref_us = median_us(lambda: attn.decode_attention_reference(q, *sets[nxt()], pos, **kw))

    configs = [(None, None)]
    if sweep:
        block_ns = (16, 32, 64) if D == 512 else (32, 64, 128)
        splits = (8, 16, 32) if ring else (66, 132, 256)
        configs += [(s, attn.AttentionTiles(16, bn, 4, st)) for s in splits for bn in block_ns for st in (2, 3)]
    ref = attn.decode_attention_reference(q, *sets[0], pos, **kw)
    for splits, tiles in configs:
        tune = dict(num_splits=splits, tiles=tiles)
        try:
            got = attn.decode_attention_triton(q, *sets[0], pos, **kw, **tune)
            err = (got.float() - ref.float()).abs().max().item()
            eager = median_us(lambda: attn.decode_attention_triton(q, *sets[nxt()], pos, **kw, **tune))
            calls = len(sets) * max(1, 16 // len(sets))
            graph = graph_us(lambda i: attn.decode_attention_triton(q, *sets[i % len(sets)], pos, **kw, **tune), calls)
        except triton.runtime.errors.OutOfResources as e:
            print(f"{name:42s} splits={splits} tiles={tuple(tiles)}: {e}")
            continue
        label = "default" if splits is None else f"splits={splits} {tuple(tiles)}"
        print(
            f"{name:42s} {label:32s} eager {eager:8.1f} us  graph {graph:8.1f} us  "
            f"{nbytes / graph / 1e3:7.0f} GB/s  ref {ref_us:8.1f} us  err {err:.1e}"
        )


def bench_prefill(D, n_keys, T, dtype, window=None, sweep=False):
    k = torch.randn(n_keys, D, device="cuda").to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(T, H, D, device="cuda").to(dtype)
    if window is None:
        k_pos = torch.arange(n_keys, device="cuda")
        q_pos = k_pos[-T:]
        pairs = T * (n_keys - T) + T * (T + 1) // 2  # (query, visible key) pairs
    else:  # ring of the previous window (a wrapped order) followed by the chunk
        ring = n_keys - T
        start = 5 * ring + 17
        ring_pos = (torch.arange(ring, device="cuda") - start) % ring + start - ring
        q_pos = torch.arange(start, start + T, device="cuda")
        k_pos = torch.cat([ring_pos, q_pos])
        pairs = T * window
    ref = attn.prefill_attention_reference(q, k, v, q_pos, k_pos, window=window)
    ref_us = median_us(lambda: attn.prefill_attention_reference(q, k, v, q_pos, k_pos, window=window))
    nbytes = 2 * n_keys * D * q.element_size()
    flops = 4 * H * pairs * D
    name = f"prefill D={D} T={T} keys={n_keys:<6d} {'window=' + str(window) if window else 'causal':12s}"
    configs = [None]
    if sweep:
        shapes = PREFILL_SWEEP_512 if D == 512 else PREFILL_SWEEP_256
        configs += [attn.AttentionTiles(*shape) for shape in shapes]
    for tiles in configs:
        fn = lambda: attn.prefill_attention_triton(q, k, v, q_pos, k_pos, window=window, tiles=tiles)
        try:
            err = (fn().float() - ref.float()).abs().max().item()
            us = median_us(fn)
        except triton.runtime.errors.OutOfResources as e:
            print(f"{name} tiles={tuple(tiles)}: {e}")
            continue
        label = "default" if tiles is None else str(tuple(tiles))
        print(
            f"{name} {label:18s} {us:9.1f} us  {nbytes / us / 1e3:7.0f} GB/s  {flops / us / 1e6:6.1f} TFLOP/s  "
            f"ref {ref_us:9.1f} us  err {err:.1e}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--only", choices=["decode", "prefill"], help="time one of the two")
    parser.add_argument("--sweep", action="store_true", help="also time other split counts and tiles")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    if args.only != "prefill":
        bench_decode(256, 512, 5000, dtype, window=512, sweep=args.sweep)
        for length in (512, 4096, 32768, 131072):
            bench_decode(512, CACHE, length, dtype, sweep=args.sweep)
    if args.only != "decode":
        bench_prefill(256, 512 + 256, 256, dtype, window=512, sweep=args.sweep)
        for n_keys in (256, 4096, 32768, 131072):
            bench_prefill(512, n_keys, 256, dtype, sweep=args.sweep)


if __name__ == "__main__":
    main()
