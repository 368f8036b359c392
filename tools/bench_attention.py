"""Time the paged attention kernel (qat4.ops.attention) at Gemma 4 E2B shapes.

    python tools/bench_attention.py [--dtype bf16|fp16] [--only decode|prefill] [--sweep] [--splits 1,2,4]
                                    [--prompts 1] [--chunk 256]
                                    [--batch 1,4,16] [--lengths 512,4096,32768,131072] [--max-ctx 131072]

Decode: B sequences of one query token each, as the engine's decode graphs launch them: the
sliding layers (head dim 256, window 512) and the full layers (head dim 512) at each length. Prefill:
one ``--chunk``-token chunk of each of ``--prompts`` sequences over a prefix of each length (8 x 512
from position 0 is a served wave's prompt step at 64 clients). The key splits of both are sized
for a context of ``--max-ctx`` tokens, as the engine's graphs size them. The K/V pages of every sequence are
distinct memory, and a case smaller than four L2s cycles through that many copies of its pool, so
every call reads its keys from HBM. Each case is checked against the torch reference and timed as
CUDA-graph replays of back-to-back calls (median µs per call); GB/s counts the K and V bytes the
queries can see, TFLOP/s 4 * heads * (query, visible key) pairs * head dim. ``--sweep`` also times
other split counts and tiles.

``--device cpu`` (with TRITON_INTERPRET=1) runs the same cases through the interpreter, timed
with a wall clock: a check of the tool, not a measurement.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_w4 import graph_time_us  # noqa: E402  (this tool's folder)
from qat4.ops import attention as attn  # noqa: E402

HEADS = 8
SLIDING = (256, 512)  # (head dim, window) of E2B's sliding layers
FULL_DIM = 512
L2_BYTES = 50 << 20
DECODE_SPLITS = {"sliding": (4, 8, 16), "full": (33, 66, 132, 256, 384, 512)}  # --sweep, one sequence (scaled by batch)
DECODE_TILES = {256: [(16, 32, 4, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 4, 3)],
                512: [(16, 16, 4, 2), (16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3)]}
PREFILL_TILES = {256: [(64, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2)],
                 512: [(32, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 3), (128, 16, 8, 2), (128, 32, 16, 2)]}


class Case:
    """``seqs`` sequences of ``length`` keys each, whose ``queries`` query tokens are the last
    positions, over K/V pages of head dim ``dim``: each sequence's keys in blocks of ``block_size``
    rows, scattered over a pool of ``copies`` sets (set c at block offset c * blocks). The key
    splits are sized for ``max_keys`` keys a sequence (:class:`~qat4.ops.attention.PagedSeqs`)."""

    def __init__(self, seqs: int, length: int, queries: int, dim: int, dtype, device, *, max_keys: int,
                 block_size: int = 16, copies: int = 1):
        per_seq = triton.cdiv(length, block_size)
        blocks = seqs * per_seq
        self.copies = copies
        self.k = torch.randn(copies * blocks * block_size, dim, device=device).to(dtype)
        self.v = torch.randn_like(self.k)
        order = torch.randperm(blocks, device=device).to(torch.int32)  # pages scattered over the pool
        self.tables = [(order + c * blocks).view(seqs, per_seq) for c in range(copies)]
        self.block_size = block_size
        positions = torch.arange(length - queries, length, device=device).repeat(seqs)
        self.q = torch.randn(seqs * queries, HEADS, dim, device=device).to(dtype)
        self.seqs = attn.PagedSeqs(positions, torch.arange(0, seqs * queries + 1, queries, dtype=torch.int32,
                                                           device=device),
                                   torch.arange(seqs, dtype=torch.int32, device=device), queries, max_keys)

    def run(self, copy: int = 0, *, window=None, out=None, splits=None, tiles=None, reference=False):
        if reference:
            return attn.paged_attention_reference(self.q, self.k, self.v, self.tables[copy], self.block_size,
                                                  self.seqs, window=window)
        return attn.paged_attention_triton(self.q, self.k, self.v, self.tables[copy], self.block_size, self.seqs,
                                           window=window, out=out, splits=splits, tiles=tiles)


def copies_for(seqs: int, length: int, dim: int, dtype) -> int:
    """Pool copies enough for four L2s of K/V (at most 64)."""
    nbytes = 2 * seqs * length * dim * torch.finfo(dtype).bits // 8
    return max(1, min(64, triton.cdiv(4 * L2_BYTES, nbytes)))


def time_us(call, copies: int, device) -> float:
    """Median µs of one call(copy), back to back over the copies: CUDA-graph replays on a GPU, a
    wall clock on the CPU."""
    if device.type != "cuda":
        times = []
        for i in range(3):
            start = time.perf_counter()
            call(i % copies)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    calls = copies * max(1, 16 // copies)
    return graph_time_us(lambda: [call(i % copies) for i in range(calls)], calls)


def report(name: str, label: str, us: float, nbytes: int, flops: int, err: float) -> str:
    line = f"{name:44s} {label:28s} {us:9.1f} µs {nbytes / us / 1e3:7.0f} GB/s"
    if flops:  # prompt chunks; a decode step's few queries are bound by the keys' bytes
        line += f" {flops / us / 1e6:6.1f} TFLOP/s"
    return line + f"  err {err:.1e}"


def bench_case(name: str, case: Case, window, visible: int, pairs: int, configs, device) -> None:
    """Check `case` against the reference with each config (splits, tiles; None: the kernel's own
    choice), time it and print a line. `visible`: keys each sequence's queries can see; `pairs`:
    (query, visible key) pairs for TFLOP/s (0: none shown)."""
    ref = case.run(window=window, reference=True).float()
    nbytes = 2 * case.seqs.rows.shape[0] * visible * case.k.shape[1] * case.k.element_size()
    flops = 4 * HEADS * pairs * case.k.shape[1]
    out = torch.empty_like(case.q)
    for splits, tiles in configs:
        try:
            err = (case.run(window=window, splits=splits, tiles=tiles).float() - ref).abs().max().item()
            us = time_us(lambda c: case.run(c, window=window, out=out, splits=splits, tiles=tiles), case.copies, device)
        except triton.runtime.errors.OutOfResources as e:
            line = f"{name:44s} splits={splits} tiles={tiles and tuple(tiles)}: {e}"
        else:
            label = "default" if splits is None and tiles is None else (
                f"splits={splits}" if tiles is None else f"tiles={tuple(tiles)}")
            line = report(name, label, us, nbytes, flops, err)
        print(line, flush=True)


def decode_configs(kind: str, dim: int, batch: int, sweep: bool, splits: list[int]) -> list:
    """(splits, tiles) to time: the kernel's own choice, each of `splits`, and with `sweep` the
    kind's split counts scaled by the batch and the other decode tiles."""
    counts = set(splits)
    if sweep:
        counts |= {max(1, s // batch) for s in DECODE_SPLITS[kind]}
    configs = [(None, None)] + [(s, None) for s in sorted(counts)]
    if sweep:
        configs += [(None, attn.AttentionTiles(*t)) for t in DECODE_TILES[dim]]
    return configs


def bench_decode(batches, lengths, max_ctx, dtype, device, sweep, splits) -> None:
    """Decode steps of each batch size: a sliding layer (its queries see the last `window` keys
    of a longer history), then a full layer at each length."""
    dim, window = SLIDING
    history = min(max(lengths), 4 * window)
    visible = min(window, history)  # the keys a sliding query reads, which the pool copies are sized by
    for b in batches:
        case = Case(b, history, 1, dim, dtype, device, max_keys=max_ctx, copies=copies_for(b, visible, dim, dtype))
        bench_case(f"decode sliding D={dim} B={b} len={history}", case, window, visible, 0,
                            decode_configs("sliding", dim, b, sweep, splits), device)
        del case
        for length in lengths:
            case = Case(b, length, 1, FULL_DIM, dtype, device, max_keys=max_ctx,
                        copies=copies_for(b, length, FULL_DIM, dtype))
            bench_case(f"decode full D={FULL_DIM} B={b} len={length}", case, None, length, 0,
                                decode_configs("full", FULL_DIM, b, sweep, splits), device)
            del case


def bench_prefill(lengths, chunk, max_ctx, dtype, device, sweep, prompts) -> None:
    """A chunk of each of `prompts` sequences' prompts, the last `chunk` of their keys, read in
    one call as the engine reads several prompts in one step: over a sliding layer's window, then
    over a full layer's whole prefix at each length; split for a context of max_ctx, as the
    engine's prompt graphs are."""
    dim, window = SLIDING
    runs = [(dim, window, min(lengths) + chunk)] + [(FULL_DIM, None, n) for n in lengths if n >= chunk]
    for d, w, n_keys in runs:
        case = Case(prompts, n_keys, chunk, d, dtype, device, max_keys=max_ctx,
                    copies=copies_for(prompts, n_keys, d, dtype))
        first = n_keys - chunk  # position of each chunk's first query
        pairs = prompts * sum(min(w or n_keys, first + t + 1) for t in range(chunk))
        configs = [(None, None)] + ([(None, attn.AttentionTiles(*t)) for t in PREFILL_TILES[d]] if sweep else [])
        bench_case(f"prefill D={d} P={prompts} T={chunk} keys={n_keys} {f'window={w}' if w else 'causal'}", case, w,
                   min(w + chunk - 1 if w else n_keys, n_keys), pairs, configs, device)
        del case


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu under TRITON_INTERPRET=1 (a check, not a timing)")
    parser.add_argument("--only", choices=["decode", "prefill"], help="time one of the two")
    parser.add_argument("--sweep", action="store_true", help="also time other split counts and tiles")
    parser.add_argument("--batch", default="1,4,16", help="decode sequences per call (default: %(default)s)")
    parser.add_argument("--lengths", default="512,4096,32768,131072", help="keys per sequence (default: %(default)s)")
    parser.add_argument("--max-ctx", type=int, default=131072, help="the context the splits are sized for")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=1,
                        help="sequences whose prefill chunks one call reads (default: %(default)s)")
    parser.add_argument("--splits", default="", help="decode key splits to time beside the default, e.g. 1,2,4")
    args = parser.parse_args(argv)
    if args.prompts < 1 or any(s < 1 for s in int_list(args.splits)):
        parser.error("--prompts and every --splits count must be at least 1")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreted: not a timing)"
    print(f"{name}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    lengths = int_list(args.lengths)
    if args.only != "prefill":
        bench_decode(int_list(args.batch), lengths, args.max_ctx, dtype, device, args.sweep, int_list(args.splits))
    if args.only != "decode":
        bench_prefill(lengths, args.chunk, args.max_ctx, dtype, device, args.sweep, args.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
