"""`qat4 bench`: decode and prompt speed, memory and roofline fraction, optionally beside transformers;
`qat4 bench serve`: throughput and latency of an OpenAI-compatible server under concurrent load."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qat4.commands.model_args import DEVICES, add_dense_weights_argument, add_prefill_chunk_argument, \
    add_speculative_arguments, resolve_device, speculative_options
from qat4.config import SYNTHETIC, synthetic_config
from qat4.errors import Qat4Error

DEFAULT_CONCURRENCY = "1,4,16,64"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure decode tok/s at several context depths, prompt tok/s, memory and roofline fraction; "
             "`bench serve`: load-test a server",
        description="Measure one engine: decode speed with DEPTHS tokens held (each also as a fraction of the "
        "bandwidth roofline), prompt reading speed, time to first token, peak GPU memory. "
        "--model synthetic:e2b builds E2B-shaped on-grid weights on the GPU in seconds. "
        "`qat4 bench serve` measures a server under concurrent load instead (qat4 bench serve --help).",
    )
    # Required, but checked in run(): `qat4 bench serve` has a --model of its own.
    p.add_argument("--model", help="checkpoint folder, GGUF file, Hub id, or synthetic:e2b / synthetic:tiny (required)")
    p.add_argument("--depths", default="0,4096,32768,131072", help="comma-separated context depths (default: %(default)s)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded at each depth (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt length for prompt tok/s (default: %(default)s)")
    p.add_argument("--batch", default="", metavar="B,B,...",
                   help="also decode B sequences together at each of these sizes (aggregate tok/s of the decode "
                        "phase, as llama-batched-bench's S_TG), each holding --batch-context tokens")
    p.add_argument("--batch-context", type=int, default=512, metavar="N",
                   help="prompt tokens of each sequence of a --batch run (default: %(default)s)")
    p.add_argument("--memory-cap-mib", type=float, help="cap this process's GPU memory, e.g. 3732 for a 4 GB card")
    p.add_argument("--max-ctx", type=int, help="KV cache size in tokens (default: the deepest depth plus --new, at most the model's)")
    add_prefill_chunk_argument(p)
    add_dense_weights_argument(p)
    p.add_argument("--device", choices=DEVICES, default="cuda", help="cuda (default) or cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot decode tok/s against depth with the roofline")
    p.add_argument("--peers", choices=["hf"], help="also run transformers' Gemma 4 (bf16, same weights) and print the ratios")
    p.add_argument("--tune", action="store_true",
                   help="first choose each decode GEMV's tiling by the whole step's replay time and save it for this GPU")
    add_speculative_arguments(p)
    p.set_defaults(run=run)
    modes = p.add_subparsers(dest="bench_mode", title="other measurements", metavar="serve | speculative")
    _add_serve_parser(modes)
    _add_speculative_parser(modes)


def _add_speculative_parser(modes) -> None:
    p = modes.add_parser(
        "speculative", help="cost of verifying drafts and speed-up at controlled acceptance rates",
        description="Measure speculative decoding on one engine: the cost of a step verifying k drafts per "
        "sequence (k = 0 .. --spec-tokens) at each --batch size, then greedy decode tok/s with a replay "
        "drafter whose draft tokens are the true continuation with probability A for each A of --acceptance, "
        "for each k of --k and with the engine's adaptive choice of k, beside plain decoding.")
    p.add_argument("--model", required=True, help="checkpoint folder, GGUF file, Hub id, or synthetic:e2b / synthetic:tiny")
    p.add_argument("--batch", default="1,16", metavar="B,B,...", help="sequences decoding together (default: %(default)s)")
    p.add_argument("--acceptance", default="0,0.3,0.5,0.7,0.9", metavar="A,A,...",
                   help="chances that a draft token is the true one (default: %(default)s)")
    p.add_argument("--k", default="1,2,3,4", metavar="K,K,...", help="drafts per step to measure (default: %(default)s)")
    p.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                   help="most drafts per step the engine is built for (default: the largest of --k)")
    p.add_argument("--new", type=int, default=128, help="tokens decoded per sequence (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--mtp", metavar="PATH|ID", default=None,
                   help="an MTP drafter (folder or model id): also measure its drafts' cost, pay it in every replayed "
                        "step, and decode with its own drafts")
    p.add_argument("--device", choices=DEVICES, default="cuda", help="cuda (default) or cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.set_defaults(run=run_speculative)


def run_speculative(args: argparse.Namespace) -> int:
    import torch

    from qat4 import bench, bench_speculative
    from qat4.engine.speculation import SPEC_MAX_BATCH

    batches = _int_list(args.batch, "--batch", 1, "numbers of sequences of at least 1")
    if max(batches) > SPEC_MAX_BATCH:
        raise Qat4Error(f"--batch {max(batches)} is more than {SPEC_MAX_BATCH}, the most sequences that speculate together")
    ks = _int_list(args.k, "--k", 1, "draft counts of at least 1")
    try:
        acceptances = [float(a) for a in args.acceptance.split(",")]
    except ValueError:
        raise Qat4Error(f"--acceptance must be comma-separated numbers, got {args.acceptance!r}") from None
    if not all(0 <= a <= 1 for a in acceptances):
        raise Qat4Error(f"--acceptance values must be between 0 and 1, got {args.acceptance!r}")
    spec_tokens = max(ks) if args.spec_tokens is None else args.spec_tokens
    if max(ks) > spec_tokens:
        raise Qat4Error(f"--k {max(ks)} is more than --spec-tokens {spec_tokens}")
    if args.new < 2 or args.context < 1:
        raise Qat4Error("--new must be at least 2 and --context at least 1")
    device = torch.device(resolve_device(args.device))
    bench.progress(f"loading {args.model}")
    packed = load_packed_for_bench(args.model, device, args.seed)
    engine = bench_speculative.build_engine(packed, device, max(batches), args.context, args.new, spec_tokens, args.mtp)
    report = bench_speculative.run(engine, args.model, batches, acceptances, ks, args.new, args.context,
                                   log=bench.progress)
    print(bench_speculative.format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0


def _add_serve_parser(modes) -> None:
    p = modes.add_parser(
        "serve",
        help="throughput and latency of an OpenAI-compatible server at several concurrency levels or request rates",
        description="Load an OpenAI-compatible server with streamed requests of exactly --input-len prompt and "
        "--output-len output tokens, sent by exactly N concurrent clients for each N of --concurrency (or, with "
        "--request-rate, at R requests a second for each R, whether or not replies have come), after one "
        "uncounted warm-up request. Prints output and total tok/s, req/s, time to first token, time per output "
        "token, inter-token and end-to-end latency per level. Without --url it starts `qat4 serve --model ...` "
        "on a free loopback port and stops it afterwards; with --url it measures any running server "
        "(qat4, llama.cpp's llama-server, vLLM).")
    p.add_argument("--model", metavar="PATH|ID",
                   help="the model qat4 serve starts with (a checkpoint, Hub id, synthetic:e2b or synthetic:tiny); "
                        "with --url the model name sent (default: the first one /v1/models lists)")
    p.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080 or .../v1 (default: start qat4 serve)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: prompts of random token ids, exact length (default); chat: random words")
    p.add_argument("--concurrency",
                   help=f"comma-separated numbers of concurrent clients, one level each (default: {DEFAULT_CONCURRENCY})")
    p.add_argument("--request-rate", metavar="RATES",
                   help="instead of --concurrency: comma-separated request rates (requests a second, or inf: all at "
                        "once), one level each; a level sends its requests at that rate on average whether or not "
                        "replies have come (an open loop, as `vllm bench serve --request-rate` does)")
    p.add_argument("--burstiness", type=float, metavar="B",
                   help="with --request-rate: the gamma shape of the gaps between requests (default: 1, a Poisson "
                        "process; below 1 burstier, above 1 more even)")
    p.add_argument("--max-concurrency", type=int, metavar="N",
                   help="with --request-rate: at most N requests in flight; one over it waits for a place, its times "
                        "counted from when it is sent (default: no limit); given alone, it means --request-rate inf: "
                        "a level's requests all sent at once, N in flight (vllm bench serve's --max-concurrency)")
    p.add_argument("--input-len", type=int, default=512, metavar="N", help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, metavar="N", help="output tokens per request (default: %(default)s)")
    p.add_argument("--requests-per-level", "--num-prompts", type=int, dest="requests_per_level", metavar="N",
                   help="requests at every level (default: 4 per client and at least 16; at a request rate, 8 "
                        "seconds of them and at least 16, or all at once 4 per --max-concurrency place, else 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default: 0, greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("QAT4_API_KEY"), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY', and given to the qat4 serve started (default: $QAT4_API_KEY)")
    p.add_argument("--device", choices=DEVICES, help="where the qat4 serve started runs (default: its own)")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help='more flags for the qat4 serve started, as one string: --server-args="--max-ctx 4096"')
    p.add_argument("--json", metavar="FILE", help="write every figure and the parameters as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot output tok/s, TTFT and TPOT against concurrency (or the request rate)")
    p.add_argument("--multi-turn", type=int, metavar="T",
                   help="instead of the levels: --sessions chat conversations of T turns at once (the first message "
                        "--input-len words, each later one --turn-len), then the same requests read cold; TTFT per "
                        "turn both ways and the prompt cache's hit rate")
    p.add_argument("--sessions", type=int, default=8, metavar="S", help="conversations at once with --multi-turn (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="with --multi-turn: run the --sessions conversations R times over, one round after the "
                        "other, each turn's percentiles over all of them (default: %(default)s)")
    p.add_argument("--turn-len", type=int, default=64, metavar="N",
                   help="words of each user message after the first with --multi-turn (default: %(default)s)")
    p.add_argument("--compare", action="append", metavar="NAME=C:TOK_S,...",
                   help="reference output tok/s by concurrency to draw beside this run, e.g. llama.cpp=1:373,4:900 "
                        "(repeatable)")
    p.set_defaults(run=run_serve)


def _int_list(text: str, flag: str, minimum: int, what: str) -> list[int]:
    """Comma-separated integers of at least `minimum`, described as `what` when one is smaller."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Qat4Error(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise Qat4Error(f"{flag} must list {what}, got {text!r}")
    return values


def parse_rates(text: str) -> list[float]:
    """--request-rate: comma-separated rates above 0, or inf, as floats (math.inf)."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not rate > 0 for rate in rates):  # not > 0: also NaN
        raise Qat4Error(f"--request-rate must list request rates above 0 a second (or inf), got {text!r}")
    return rates


def parse_compare(specs: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """--compare NAME=C1:TPS1,C2:TPS2,... (repeatable) as {name: [(concurrency, output tok/s), ...]}."""
    out: dict[str, list[tuple[int, float]]] = {}
    for spec in specs:
        name, _, points = spec.partition("=")
        try:
            pairs = [point.split(":") for point in points.split(",")]
            parsed = [(int(c), float(tps)) for c, tps in pairs]
        except ValueError:
            parsed = []
        if not name.strip() or not parsed or any(c < 1 or tps < 0 for c, tps in parsed):
            raise Qat4Error(f"--compare takes NAME=CONCURRENCY:TOK_S,... such as llama.cpp=1:373,4:900, got {spec!r}")
        out[name.strip()] = parsed
    return out


def load_packed_for_bench(model: str, device, seed: int):
    """A PackedModel in host memory: synthetic (made on `device`, then moved) or read from disk."""
    import torch

    if model.startswith(SYNTHETIC):
        from qat4.checkpoint.synth import synthetic_model

        packed = synthetic_model(synthetic_config(model), seed, device)
        packed.tensors = {n: t.to("cpu") for n, t in packed.tensors.items()}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return packed
    from qat4.checkpoint.loader import load_packed

    return load_packed(model)


def run(args: argparse.Namespace) -> int:
    import torch

    from qat4 import bench
    from qat4.engine.tuning import pinned_tilings_note
    from qat4.engine import Engine
    from qat4.engine.memory import AUTO_PREFILL_CHUNKS

    if args.model is None:
        raise Qat4Error("--model is required: a checkpoint, Hub id or synthetic:e2b (or use `qat4 bench serve`)")
    depths = _int_list(args.depths, "--depths", 0, "non-negative token counts")
    batches = _int_list(args.batch, "--batch", 1, "numbers of sequences of at least 1") if args.batch else []
    if args.new < 1 or args.prompt < 1 or args.batch_context < 1:
        raise Qat4Error("--new, --prompt and --batch-context must be at least 1")
    device = torch.device(resolve_device(args.device))
    t0 = time.perf_counter()
    bench.progress(f"loading {args.model}")
    packed = load_packed_for_bench(args.model, device, args.seed)
    cfg = packed.config
    chunk = args.prefill_chunk or AUTO_PREFILL_CHUNKS[-1]  # the engine's prompt chunk is at least this unless set
    batch_seq = max((bench.batch_tokens(b, args.batch_context, args.new, chunk) for b in batches), default=0)
    longest = max(max(depths) + bench.decode_tokens(args.new), args.prompt + 1, batch_seq)
    max_ctx = args.max_ctx or min(cfg.max_position_embeddings, longest)
    kv_tokens = max(max_ctx, max(batches, default=1) * batch_seq)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = Engine.from_packed(packed, device, max_ctx=max_ctx, prefill_chunk=args.prefill_chunk,
                                memory_cap_mib=args.memory_cap_mib, kv_tokens=kv_tokens,
                                max_num_seqs=max(batches) if batches else None, dense_weights=args.dense_weights,
                                **speculative_options(args))
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
                       memory_cap_mib=args.memory_cap_mib, batches=batches, batch_context=args.batch_context,
                       log=bench.progress)
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


def _log(line: str) -> None:
    print(f"[bench serve] {line}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    from qat4.bench_serve.workload import level_requests
    from qat4.serve_process import serving

    rates = _rate_levels(args)
    concurrencies = [] if rates else _int_list(args.concurrency or DEFAULT_CONCURRENCY, "--concurrency", 1,
                                               "numbers of clients of at least 1")
    if args.multi_turn is not None and min(args.multi_turn, args.sessions, args.rounds, args.turn_len) < 1:
        raise Qat4Error("--multi-turn, --sessions, --rounds and --turn-len must be at least 1")
    if args.multi_turn is not None:
        concurrencies = [args.sessions]
    if args.input_len < 1 or args.output_len < 1:
        raise Qat4Error("--input-len and --output-len must be at least 1")
    if rates and args.requests_per_level is not None and args.requests_per_level < 1:
        raise Qat4Error(f"--requests-per-level must be at least 1, got {args.requests_per_level}")
    if concurrencies and args.requests_per_level is not None and args.requests_per_level < max(concurrencies):
        raise Qat4Error(f"--requests-per-level {args.requests_per_level} is fewer than the largest --concurrency "
                        f"{max(concurrencies)}; every client needs at least one request")
    compare = parse_compare(args.compare or [])
    # the server started queues every request that can be in flight at once, so none is refused for room
    if rates:
        in_flight = args.max_concurrency or max(level_requests(args.requests_per_level, None, rate) for rate in rates)
    else:
        in_flight = max(concurrencies)
    with serving("qat4 bench serve", args.url, args.model, api_key=args.api_key, device=args.device,
                 server_args=args.server_args, max_queue=in_flight, log=_log) as served:
        server = "qat4 serve, started by the benchmark" if served.command else "external"
        return _measure(args, served.url, served.model, server, list(served.command), concurrencies, compare, rates)


def _rate_levels(args: argparse.Namespace) -> list[float]:
    """The request rates of an open-loop run (none for levels of clients), after checking the flags
    that go with them. --max-concurrency alone means --request-rate inf, as in vllm bench serve."""
    if args.request_rate is None and args.max_concurrency is None:
        if args.burstiness is not None:
            raise Qat4Error("--burstiness goes with --request-rate")
        return []
    clashing = [flag for flag, value in (("--concurrency", args.concurrency), ("--multi-turn", args.multi_turn),
                                         ("--compare", args.compare)) if value is not None]
    if clashing:
        raise Qat4Error(f"{' and '.join(clashing)} cannot go with --request-rate or --max-concurrency, which run "
                        f"levels of request rates (--compare's points are by concurrency)")
    if args.burstiness is not None and not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise Qat4Error(f"--burstiness must be a number above 0, got {args.burstiness:g}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise Qat4Error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    return parse_rates(args.request_rate or "inf")


def _measure(args: argparse.Namespace, url: str, model: str | None, server: str, server_command: list[str],
             concurrencies: list[int], compare: dict, rates: list[float]) -> int:
    """Run the levels (of ``rates`` when there are any) against `url`, print the table, write --json and --plot."""
    from qat4.bench_serve import levels, output
    from qat4.bench_serve.workload import DEFAULT_BURSTINESS, Workload

    if args.multi_turn is not None:
        return _measure_turns(args, url, model, server)
    workload = Workload(url, args.endpoint, model, args.input_len, args.output_len,
                        temperature=args.temperature, api_key=args.api_key)
    report = levels.new_report(workload, server=server, requests_per_level=args.requests_per_level,
                               seed=args.seed, server_command=server_command, compare=compare,
                               burstiness=(args.burstiness or DEFAULT_BURSTINESS) if rates else None,
                               max_concurrency=args.max_concurrency)
    levels.run(workload, report, concurrencies=concurrencies, rates=rates, on_result=_progress(str),
               warn=lambda text: _log(f"warning: {text}"))
    print(output.format_table(report))
    if args.json:
        output.save_json(report, args.json)
    if args.plot:
        output.write_plot(report, args.plot)
    if not any(level.completed for level in report.levels):
        total = sum(level.requests for level in report.levels)
        raise Qat4Error(f"every one of the {total} requests failed; the first: {report.levels[0].first_error}")
    return 0


def _progress(describe: Callable[[Any], str]) -> Callable[[Any, int, int, Any], None]:
    """A bench serve callback (key, done, total, result): one status line per key (a level's name,
    a phase) with its requests done and failed."""
    from qat4.commands.progress import ProgressLine

    line, failed = ProgressLine(), Counter()

    def show(key: Any, done: int, total: int, result: Any) -> None:
        failed[key] += not result.ok
        line.update(f"[bench serve] {describe(key)}: {done}/{total} requests, {failed[key]} failed")
        if done == total:
            line.done()

    return show


def _measure_turns(args: argparse.Namespace, url: str, model: str | None, server: str) -> int:
    """--multi-turn: the conversations against `url`, the per-turn table, --json."""
    from dataclasses import asdict

    from qat4.bench_serve.levels import qat4_commit
    from qat4.bench_serve.multi_turn import hit_rate, run_multi_turn
    from qat4.bench_serve.output import format_turns
    from qat4.bench_serve.workload import Workload

    workload = Workload(url, "chat", model, args.input_len, args.output_len,
                        temperature=args.temperature, api_key=args.api_key)
    conversations = args.sessions * args.rounds
    show = _progress(lambda phase: f"{conversations} conversations, {phase}")
    turns = run_multi_turn(workload, args.multi_turn, args.sessions, args.turn_len, args.seed, show, args.rounds)
    rounds = f", {args.rounds} rounds of {args.sessions} at once" if args.rounds > 1 else ""
    print(f"{model} at {url} ({server}): {conversations} conversations of {args.multi_turn} turns{rounds}, "
          f"{args.output_len} output tokens a turn")
    print(format_turns(turns))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "url": url, "model": model, "server": server, "sessions": args.sessions, "rounds": args.rounds,
            "turns": args.multi_turn,
            "input_len": args.input_len, "turn_len": args.turn_len, "output_len": args.output_len,
            "qat4_commit": qat4_commit(), "hit_rate": hit_rate(turns),
            "per_turn": [asdict(t) for t in turns]}, indent=2))
    if all(t.failed == t.conversations for t in turns):
        raise Qat4Error("every request of the conversations failed")
    return 0
