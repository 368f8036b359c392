"""`qat4 bench`: decode and prompt speed, memory and roofline fraction, optionally beside transformers."""

from __future__ import annotations

import argparse
import time

from qat4.commands.model_args import DEVICES, resolve_device
from qat4.errors import Qat4Error

SYNTHETIC = "synthetic:"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure decode tok/s at several context depths, prompt tok/s, memory and roofline fraction",
        description="Measure one engine: decode speed with DEPTHS tokens held (each also as a fraction of the "
        "bandwidth roofline), prompt reading speed, time to first token, peak GPU memory. "
        "--model synthetic:e2b builds E2B-shaped on-grid weights on the GPU in seconds.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder, GGUF file, Hub id, or synthetic:e2b / synthetic:tiny")
    p.add_argument("--depths", default="0,4096,32768,131072", help="comma-separated context depths (default: %(default)s)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded at each depth (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt length for prompt tok/s (default: %(default)s)")
    p.add_argument("--memory-cap-mib", type=float, help="cap this process's GPU memory, e.g. 3732 for a 4 GB card")
    p.add_argument("--max-ctx", type=int, help="KV cache size in tokens (default: the deepest depth plus --new, at most the model's)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt chunk size (default: the largest of 4096..256 that fits in memory)")
    p.add_argument("--device", choices=DEVICES, default="cuda", help="cuda (default) or cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot decode tok/s against depth with the roofline")
    p.add_argument("--peers", choices=["hf"], help="also run transformers' Gemma 4 (bf16, same weights) and print the ratios")
    p.add_argument("--tune", action="store_true",
                   help="first choose each decode GEMV's tiling by the whole step's replay time and save it for this GPU")
    p.set_defaults(run=run)


def _depths(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Qat4Error(f"--depths must be comma-separated integers, got {text!r}") from None
    if not depths or min(depths) < 0:
        raise Qat4Error(f"--depths must list non-negative token counts, got {text!r}")
    return depths


def load_packed_for_bench(model: str, device, seed: int):
    """A PackedModel in host memory: synthetic (made on `device`, then moved) or read from disk."""
    import torch

    if model.startswith(SYNTHETIC):
        from qat4.checkpoint.synth import synthetic_model
        from qat4.config import PRESETS

        preset = model[len(SYNTHETIC):]
        if preset not in PRESETS:
            raise Qat4Error(f"--model {model}: unknown synthetic preset; use one of {', '.join(SYNTHETIC + p for p in PRESETS)}")
        packed = synthetic_model(PRESETS[preset], seed, device)
        packed.tensors = {n: t.to("cpu") for n, t in packed.tensors.items()}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return packed
    from qat4.checkpoint.loader import load_packed

    return load_packed(model)


def run(args: argparse.Namespace) -> int:
    import torch

    from qat4 import bench
    from qat4.decode_tuning import pinned_tilings_note
    from qat4.engine import Engine

    depths = _depths(args.depths)
    if args.new < 1 or args.prompt < 1:
        raise Qat4Error("--new and --prompt must be at least 1")
    device = torch.device(resolve_device(args.device))
    t0 = time.perf_counter()
    bench.progress(f"loading {args.model}")
    packed = load_packed_for_bench(args.model, device, args.seed)
    cfg = packed.config
    max_ctx = args.max_ctx or min(cfg.max_position_embeddings, max(max(depths) + args.new + 1, args.prompt))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = Engine.from_packed(packed, device, max_ctx=max_ctx, prefill_chunk=args.prefill_chunk,
                                memory_cap_mib=args.memory_cap_mib)
    bench.progress(f"engine ready in {time.perf_counter() - t0:.1f} s")
    if device.type == "cuda" and not args.tune:
        bench.progress(pinned_tilings_note(*engine.pinned_tilings))
    if args.tune:
        if device.type != "cuda":
            raise Qat4Error("--tune times CUDA-graph replays; it needs --device cuda")
        bench.progress("tuning decode tilings (a whole-step replay per candidate)")
        before, after, path = engine.tune_decode()
        bench.progress(f"decode step {before:,.0f} -> {after:,.0f} µs with the tuned tilings, saved to {path}")
    report = bench.run(engine, args.model, depths, args.new, min(args.prompt, max_ctx),
                       memory_cap_mib=args.memory_cap_mib, log=bench.progress)
    if args.peers == "hf":
        del engine
        report.peers["transformers-bf16"] = bench.run_hf_peer(packed, device, args.prompt, args.new, report,
                                                              log=bench.progress)
    print(bench.format_table(report))
    if args.json:
        bench.save_json(report, args.json)
    if args.plot:
        bench.write_plot(report, args.plot)
    return 0
