"""`qat4 bench`: decode speed at several context depths, prompt speed, memory, and the roofline.

Decode is bandwidth-bound, so every decode figure is also given as a fraction of its roofline:
bytes read per token (every 4-bit matrix including the output layer, plus the KV entries the
attention reads at that depth) over the card's read bandwidth, measured in the same run.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from qat4.checkpoint.packed_model import expected_tensors
from qat4.checkpoint.packing import GROUP
from qat4.config import Gemma4Config
from qat4.engine import Engine

MIB = 1 << 20
ROW_LOOKUPS = ("embed_tokens_per_layer", "embed_tokens")


@dataclass
class DepthResult:
    depth: int  # tokens held in the cache before decoding starts
    decode_tok_s: float
    ms_per_token: float
    bytes_per_token: int
    roofline_tok_s: float

    @property
    def roofline_fraction(self) -> float:
        return self.decode_tok_s / self.roofline_tok_s


@dataclass
class BatchResult:
    batch: int  # sequences decoding together
    context: int  # tokens each held when the timed steps began
    decode_tok_s: float  # tokens over the whole batch per second
    ms_per_step: float


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    read_bandwidth_gb_s: float
    model_mib: float
    kv_cache_mib: float
    max_ctx: int
    prompt_tokens: int
    prompt_tok_s: float
    ttft_ms: float
    prefill_chunk: int = 0
    kv_tokens: int = 0
    max_num_seqs: int = 1
    depths: list[DepthResult] = field(default_factory=list)
    batches: list[BatchResult] = field(default_factory=list)
    peak_mib: float = 0.0
    memory_cap_mib: float | None = None
    dense_mib: float = 0.0  # the 16-bit weight copies (dense_weights), 0 without them
    peers: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        for d, res in zip(out["depths"], self.depths):
            d["roofline_fraction"] = res.roofline_fraction
        return out


def weight_bytes_per_token(config: Gemma4Config, scale_bytes: int = 2) -> int:
    """Bytes of every 4-bit matrix a decode step streams: all linears and the output layer
    (the per-layer table and the input embedding are row lookups)."""
    total = 0
    for name, spec in expected_tensors(config).items():
        if spec.packed and name not in ROW_LOOKUPS:
            rows, cols = spec.shape
            total += rows * cols // 2 + rows * cols // GROUP * scale_bytes
    rows, cols = config.vocab_size, config.hidden_size
    return total + rows * cols // 2 + rows * cols // GROUP * scale_bytes


def kv_bytes_per_token(engine: Engine, depth: int) -> int:
    """K and V bytes the 35 attention reads touch when the token at position `depth` decodes."""
    cfg, item = engine.config, engine.dtype.itemsize
    total = 0
    for layer in range(cfg.num_hidden_layers):
        seen = depth + 1 if not cfg.is_sliding(layer) else min(depth + 1, cfg.sliding_window)
        total += 2 * seen * cfg.layer_head_dim(layer) * item
    return total


def measure_read_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 20) -> float:
    """Read bandwidth in bytes/s: median time of a sum over `gib` GiB, of bf16 on a GPU and fp32
    elsewhere (a CPU sums bf16 slower than it reads it: 1.1 against 17.6 GB/s of fp32 on a 2-core
    x86 host)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.ones(int(gib * (1 << 30)) // dtype.itemsize, device=device, dtype=dtype)
    times = [_timed(device, lambda: x.sum(dtype=torch.float32)) for _ in range(repeats + 3)][3:]
    del x
    return gib * (1 << 30) / statistics.median(times)


def _peak_mib(device: torch.device) -> float:
    """PyTorch's peak allocation on `device` since its last reset, in MiB (0 off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn, times: int = 1) -> float:
    """Seconds for `times` calls of fn, the device drained before and after."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(times):
        fn()
    _sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def time_prompt(engine: Engine, n: int, generator: torch.Generator) -> tuple[float, float]:
    """(prompt tok/s, time to first token in ms) for an n-token prompt read from an empty pool;
    the best of two passes after a first one that compiles and tunes the kernels, each pass a
    prompt of its own (the same one again would come from the prompt cache)."""
    results = []
    for _ in range(3):
        ids = _random_ids(engine, n, generator)
        first = engine.generate(ids, max_new_tokens=1, temperature=0, stop_token_ids=[]).prefill_ms
        results.append((n / first * 1e3, first))
    return max(results[1:], key=lambda r: r[0])


def decode_tokens(new: int) -> int:
    """Tokens a decode measurement of `new` steps generates: the first token, then at least two
    decode steps (one interval alone gives no rate)."""
    return max(new, 2) + 1


@torch.no_grad()
def time_decode(engine: Engine, depth: int, new: int, generator: torch.Generator) -> float:
    """Seconds per decoded token over `new` (at least 2) greedy decode steps of one sequence (graph
    replays on CUDA, through the engine's step loop) with `depth` tokens already held."""
    ids = _random_ids(engine, max(depth, 1), generator)
    out = engine.generate(ids, max_new_tokens=decode_tokens(new), temperature=0, stop_token_ids=[])
    return 1 / out.decode_tok_s


def batch_tokens(batch: int, context: int, new: int, prefill_chunk: int) -> int:
    """The most tokens one of :func:`time_batch`'s `batch` sequences holds: its `context` prompt
    tokens, `new` timed steps and 4 more, and a step more for every prompt chunk the batch reads
    (at most `prefill_chunk` tokens a step) while it already decodes."""
    return context + new + 4 + batch * math.ceil(context / prefill_chunk)


@torch.no_grad()
def time_batch(engine: Engine, batch: int, context: int, new: int, generator: torch.Generator) -> BatchResult:
    """Aggregate decode speed of `batch` sequences decoding together, each holding `context` prompt
    tokens: every prompt is read first, then `new` steps of the engine's loop (decode rows only,
    graph replays on CUDA) are timed; the decode phase alone, as llama-batched-bench's S_TG. The
    first sequences decode while the later ones read their prompts (a chunk a step), so each may
    generate that many steps more and still be decoding when the timing starts."""
    reply = batch_tokens(batch, context, new, engine.prefill_chunk) - context
    seqs = [engine.add_request(_random_ids(engine, context, generator), reply, temperature=0,
                               stop_token_ids=[]) for _ in range(batch)]
    while any(not s.output for s in seqs):
        engine.step()
    engine.step()
    before = sum(len(s.output) for s in seqs)
    seconds = _timed(engine.device, engine.step, times=new)
    produced = sum(len(s.output) for s in seqs) - before  # a speculating step brings more than one each
    for seq in seqs:
        engine.abort(seq)
    engine.drain()
    return BatchResult(batch, context, produced / seconds, seconds / new * 1e3)


def _random_ids(engine: Engine, n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, engine.config.vocab_size, (n,), generator=generator).tolist()


def run(engine: Engine, model_name: str, depths: list[int], new: int, prompt: int,
        memory_cap_mib: float | None = None, batches: list[int] = (), batch_context: int = 512,
        log=print) -> BenchReport:
    """Measure everything on one engine; `log` receives progress lines."""
    device = engine.device
    g = torch.Generator().manual_seed(0)
    log("measuring read bandwidth")
    peak_before = _peak_mib(device)
    gib = 4.0
    if device.type != "cuda":
        gib = 0.25
    elif memory_cap_mib is not None:  # what the cap leaves beside the engine, at most a quarter GiB
        gib = min(0.25, max(1 / 64, (memory_cap_mib * MIB - torch.cuda.memory_reserved(device)) / 2 / (1 << 30)))
    else:  # at most half of what the GPU has free beside the engine (its 16-bit copies may take most of it)
        gib = min(gib, max(1 / 64, torch.cuda.mem_get_info(device)[0] / 2 / (1 << 30)))
    bandwidth = measure_read_bandwidth(device, gib=gib)
    if device.type == "cuda":  # the bandwidth buffer is the benchmark's, not the engine's: left out of the peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    log(f"reading a {prompt}-token prompt")
    prompt_tok_s, ttft = time_prompt(engine, prompt, g)
    weights = weight_bytes_per_token(engine.config)
    report = BenchReport(
        model=model_name, device=_device_name(device), dtype=str(engine.dtype).replace("torch.", ""),
        read_bandwidth_gb_s=bandwidth / 1e9, model_mib=engine.nbytes["model"] / MIB,
        kv_cache_mib=engine.nbytes["kv_cache"] / MIB, max_ctx=engine.max_ctx, prompt_tokens=prompt,
        prompt_tok_s=prompt_tok_s, ttft_ms=ttft, prefill_chunk=engine.prefill_chunk, memory_cap_mib=memory_cap_mib,
        kv_tokens=engine.pool.capacity_tokens, max_num_seqs=engine.max_num_seqs,
        dense_mib=engine.nbytes.get("dense", 0) / MIB,
    )
    for depth in depths:
        depth = min(depth, engine.max_ctx - decode_tokens(new))
        log(f"decoding {new} tokens at depth {depth}")
        sec = time_decode(engine, depth, new, g)
        nbytes = weights + kv_bytes_per_token(engine, depth)
        report.depths.append(DepthResult(depth, 1 / sec, sec * 1e3, nbytes, bandwidth / nbytes))
    for batch in batches:
        log(f"decoding {new} steps of {batch} sequences of {batch_context} tokens")
        report.batches.append(time_batch(engine, batch, batch_context, new, g))
    report.peak_mib = max(peak_before, _peak_mib(device))
    return report


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def format_table(report: BenchReport) -> str:
    lines = [
        f"model {report.model} on {report.device} ({report.dtype}), read bandwidth {report.read_bandwidth_gb_s:,.0f} GB/s",
        f"model {report.model_mib:,.0f} MiB"
        + (f" and its 16-bit copies {report.dense_mib:,.0f} MiB (dense_weights)" if report.dense_mib else "")
        + f", KV pool {report.kv_cache_mib:,.0f} MiB ({report.kv_tokens:,} tokens, "
        f"up to {report.max_num_seqs} sequences of up to {report.max_ctx:,}), "
        f"peak {report.peak_mib:,.0f} MiB" + (f" (cap {report.memory_cap_mib:g} MiB)" if report.memory_cap_mib else ""),
        f"prompt {report.prompt_tokens:,} tokens in chunks of {report.prefill_chunk:,}: {report.prompt_tok_s:,.0f} tok/s, "
        f"time to first token {report.ttft_ms:,.1f} ms",
        "",
        f"{'depth':>8} {'decode tok/s':>13} {'ms/token':>9} {'MB/token':>9} {'roofline tok/s':>15} {'of roofline':>12}",
    ]
    for d in report.depths:
        lines.append(f"{d.depth:>8,} {d.decode_tok_s:>13,.1f} {d.ms_per_token:>9.3f} {d.bytes_per_token / 1e6:>9,.1f} "
                     f"{d.roofline_tok_s:>15,.0f} {d.roofline_fraction:>11.1%}")
    if report.batches:
        lines += ["", f"{'batch':>8} {'context':>8} {'decode tok/s':>13} {'ms/step':>8}"]
        for b in report.batches:
            lines.append(f"{b.batch:>8} {b.context:>8,} {b.decode_tok_s:>13,.1f} {b.ms_per_step:>8.3f}")
    if report.peers:
        first = f"depth {report.depths[0].depth:,}" if report.depths else "no depth"
        lines += ["", f"{'same weights':>18} {'decode tok/s':>13} {'prompt tok/s':>13} {'peak MiB':>9} "
                      f"{'qat4 decode (' + first + ')':>26} {'qat4 prompt':>12}"]
        for name, peer in report.peers.items():
            ratio = f"{peer['qat4_decode_ratio']:.2f}x" if "qat4_decode_ratio" in peer else "-"
            lines.append(f"{name:>18} {peer['decode_tok_s']:>13,.1f} {peer['prompt_tok_s']:>13,.0f} "
                         f"{peer['peak_mib']:>9,.0f} {ratio:>26} {peer['qat4_prompt_ratio']:>11.2f}x")
    return "\n".join(lines)


def write_plot(report: BenchReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [max(d.depth, 1) for d in report.depths]
    ax.plot(xs, [d.decode_tok_s for d in report.depths], "o-", label="qat4 decode")
    ax.plot(xs, [d.roofline_tok_s for d in report.depths], "--", color="gray", label="bandwidth roofline")
    for name, peer in report.peers.items():
        ax.plot(xs[:1], [peer["decode_tok_s"]], "s", label=f"{name} decode (16-token prompt)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens held in the KV cache")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report.model} on {report.device}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_json(report: BenchReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)


def progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


class _StepClock:
    """A logits processor that notes the time (the device drained) each time transformers'
    ``generate`` has a step's logits: the intervals after the first are its decode steps."""

    def __init__(self, device: torch.device, times: list[float]):
        self.device, self.times = device, times

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def run_hf_peer(packed, device: torch.device, prompt: int, new: int, report: BenchReport, log=print) -> dict:
    """transformers' Gemma4ForCausalLM (bf16, eager attention, dynamic cache) on the same weights:
    decode tok/s after a 16-token prompt, prompt tok/s, and qat4's ratios over both."""
    from transformers import LogitsProcessorList

    from qat4.reference import cast, hf_model

    if device.type == "cuda":  # the peer's own peak, not the engine's (the caller dropped the engine)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    log("building transformers' Gemma 4 in bf16 on the same weights")
    hf = cast(hf_model(packed, device), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    short = torch.randint(3, packed.config.vocab_size, (1, 16), generator=g).to(device)

    def generate(n: int, clock: list[float] | None = None) -> None:
        hf.generate(short, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    logits_processor=None if clock is None else LogitsProcessorList([_StepClock(device, clock)]))

    log(f"transformers: decoding {new} tokens")
    generate(2)
    clock: list[float] = []
    generate(new, clock)
    decode_s = (clock[-1] - clock[0]) / (len(clock) - 1)  # the steps after the first: decoding alone
    ids = torch.randint(3, packed.config.vocab_size, (1, prompt), generator=g).to(device)
    log(f"transformers: reading a {prompt}-token prompt")
    hf(ids[:, :16])
    prompt_s = _timed(device, lambda: hf(ids, logits_to_keep=1))
    peer = {"decode_tok_s": 1 / decode_s, "prompt_tok_s": prompt / prompt_s,
            "peak_mib": _peak_mib(device)}
    if report.depths:
        peer["qat4_decode_ratio"] = report.depths[0].decode_tok_s * decode_s
    peer["qat4_prompt_ratio"] = report.prompt_tok_s * prompt_s / prompt
    del hf
    return peer
