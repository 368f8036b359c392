"""What a constrained row costs per token: the host's fill of its allowed-token bitmask (xgrammar,
over the real 262,144-token Gemma 4 vocabulary of the test fixtures) and applying bitmasks to a
step's logits (:func:`qat4.engine.sampler.mask_logits`) on a device; with --engine, the whole
decode step of an engine whose every row is constrained, against the same rows unconstrained.

    python tools/bench_grammar.py [--device cuda] [--rows 1 16]
    python tools/bench_grammar.py --engine [--device cuda] [--model synthetic:e2b] [--rows 1 16] [--json PATH]

Fill: a JSON-schema reply (nested object, enum, bounded numbers, array) and a Gemma 4 tool call
walked token by token, every fill timed; median and 90th percentile. Apply: median of 50 runs
per row count, synchronised on CUDA.

Engine: for each row count R, R greedy requests of --prompt random token ids, each constrained by
SCHEMA (stop tokens on: the reply ends once the grammar completes), then R requests on the same
prompts unconstrained (stop tokens off, --new tokens each), each case run once untimed first (the
masked steps' CUDA graphs are captured when first used). A decode step is the time from one read
back of the rows' tokens to the next, over steps in which no prompt is read and no graph is
captured: the engine launches an unconstrained step before it reads the one before; a constrained
row's next mask needs its last token, so a step with one launches its forward, reads the step
before, fills the masks and then enqueues its pick. Reported: decode
steps, their median, tokens per second over them, and the overhead of the constrained median over
the unconstrained one; the synthetic model's words are random, so a constrained reply is whatever
the grammar lets them be, and it may end earlier (medians per step compare them all the same).
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import xgrammar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from qat4.chat.grammars import grammars_for  # noqa: E402
from qat4.commands.model_args import load_engine, resolve_device  # noqa: E402
from qat4.config import E2B  # noqa: E402
from qat4.engine.sampler import mask_logits  # noqa: E402
from vocab_fixtures import VOCAB_GGUF  # noqa: E402
from qat4.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "address"]}
REPLY = {"name": "Ada Lovelace and friends", "age": 36, "score": 0.5, "tags": ["a", "b"],
         "address": {"city": "London town", "zip": "NW1"}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 14}}, "required": ["city"]}}}
CALL = 'get_weather{city:<|"|>Paris, France<|"|>,days:3}<tool_call|>'


def fill_us(constraint, tokens: list[int], vocab_size: int) -> list[float]:
    """µs of each bitmask fill while the constraint takes ``tokens`` (and one after the last)."""
    bitmasks = xgrammar.allocate_token_bitmask(1, vocab_size)
    times = []
    for token in [*tokens, None]:
        start = time.perf_counter()
        constraint.fill(bitmasks, 0)
        times.append((time.perf_counter() - start) * 1e6)
        if token is not None:
            constraint.accept(token)
    return times


def decode_steps(engine, rows: int) -> tuple[list[float], int, int]:
    """Step ``engine`` until its sequences end -> (seconds of each decode step of all ``rows``
    rows, tokens those steps read back, steps left out for a graph capture). A step runs from one
    read back to the next (one `Engine.step` call that returns tokens); it counts when
    none of its calls began with a prompt to read or captured a decode graph, and every row was
    still running (a constrained reply may end early, leaving smaller, cheaper steps)."""
    scheduler, graphs = engine.scheduler, engine.runner.graphs
    seconds, tokens, captured = [], 0, 0
    spent, reading, capturing = 0.0, False, False
    while engine.has_work:
        reading |= bool(scheduler.waiting) or any(s.num_computed < len(s.prompt) for s in scheduler.running)
        known = len(graphs)
        start = time.perf_counter()
        outputs = engine.step()
        spent += time.perf_counter() - start
        capturing |= len(graphs) > known
        if outputs:
            if not reading and not capturing and len(outputs) == rows:
                seconds.append(spent)
                tokens += len(outputs)
            captured += capturing and not reading
            spent, reading, capturing = 0.0, False, False
    return seconds, tokens, captured


def run_case(engine, prompts: list[list[int]], new: int, constrained: bool) -> dict:
    """One greedy request per prompt, all constrained by SCHEMA or none (then stop tokens off, so
    each runs ``new`` tokens), stepped to the end -> their decode steps' numbers."""
    seqs = [engine.add_request(ids, new, temperature=0, constraint=engine.json_constraint(SCHEMA))
            if constrained else engine.add_request(ids, new, temperature=0, stop_token_ids=[]) for ids in prompts]
    seconds, tokens, captured = decode_steps(engine, len(prompts))
    return {"decode_steps": len(seconds), "median_ms": statistics.median(seconds) * 1e3 if seconds else 0.0,
            "tok_s": tokens / sum(seconds) if seconds else 0.0, "captures": captured,
            "reply_tokens": statistics.mean(len(s.output) for s in seqs)}


def measure_engine(engine, rows: int, prompt: int, new: int, rng: random.Random) -> dict:
    """Constrained and unconstrained decode of ``rows`` rows on the same prompts, each case run
    once untimed first -> {"rows", "constrained", "unconstrained", "overhead_pct"}."""
    prompts = [[engine.config.bos_token_id] + rng.choices(range(3, engine.config.vocab_size), k=prompt - 1)
               for _ in range(rows)]
    result = {"rows": rows}
    for case, constrained in (("constrained", True), ("unconstrained", False)):
        run_case(engine, prompts, new, constrained)
        result[case] = run_case(engine, prompts, new, constrained)
    free, masked = result["unconstrained"]["median_ms"], result["constrained"]["median_ms"]
    result["overhead_pct"] = (masked / free - 1) * 100 if free and masked else None  # None: no step of all rows
    return result


def format_case(rows: int, case: str, numbers: dict) -> str:
    line = (f"batch {rows:2d} {case:13s}: {numbers['decode_steps']:4d} decode steps, median "
            f"{numbers['median_ms']:7.2f} ms, {numbers['tok_s']:8.1f} tok/s, replies of "
            f"{numbers['reply_tokens']:.0f} tokens")
    return line + (f" ({numbers['captures']} steps left out: graph captures)" if numbers["captures"] else "")


def run_engine(args: argparse.Namespace) -> None:
    """--engine: the decode step of an engine on --model with every row constrained, against none."""
    max_ctx, most = args.prompt + args.new + 16, max(args.rows)
    # every prompt read in one step, so that the rows decode in step with each other
    engine = load_engine("bench_grammar", args.model, resolve_device(args.device), max_ctx=max_ctx, max_num_seqs=most,
                         kv_tokens=most * max_ctx, prefill_chunk=most * args.prompt)
    print(f"engine {args.model} on {args.device}: {args.prompt}-token prompts, up to {args.new} new tokens, "
          f"greedy; decode steps alone, a step being one read back of every row's token to the next", flush=True)
    rng, results = random.Random(0), []
    for rows in args.rows:
        result = measure_engine(engine, rows, args.prompt, args.new, rng)
        for case in ("unconstrained", "constrained"):
            print(format_case(rows, case, result[case]), flush=True)
        results.append(result)
    for r in results:
        masked, free = r["constrained"], r["unconstrained"]
        if r["overhead_pct"] is None:
            print(f"grammar overhead at batch {r['rows']}: not measured (no decode step ran all {r['rows']} rows; "
                  f"replies of {masked['reply_tokens']:.0f} tokens constrained, {free['reply_tokens']:.0f} not)")
            continue
        print(f"grammar overhead at batch {r['rows']}: {r['overhead_pct']:+.1f} % per decode step "
              f"({masked['median_ms']:.2f} ms constrained vs {free['median_ms']:.2f} ms unconstrained, medians; "
              f"constrained replies may end earlier, {masked['reply_tokens']:.0f} vs {free['reply_tokens']:.0f} "
              f"tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "prompt_tokens": args.prompt,
                       "new_tokens": args.new, "schema": SCHEMA, "results": results}, f, indent=2)


def measure_pieces(args: argparse.Namespace) -> None:
    """The host's bitmask fill, then mask_logits on --device at each of --rows."""
    tokenizer = Tokenizer.from_gguf(VOCAB_GGUF)
    grammars = grammars_for(tokenizer, E2B.eos_token_id)
    cases = {
        "json_schema": (lambda: grammars.json(SCHEMA), tokenizer.encode(json.dumps(REPLY))),
        "tool call": (lambda: grammars.tool_calls([TOOL], "name"), tokenizer.encode(CALL)),
    }
    for name, (make, tokens) in cases.items():
        times = sorted(t for _ in range(5) for t in fill_us(make(), tokens, grammars.vocab_size))
        print(f"fill {name:12s} {len(tokens):3d} tokens: median {statistics.median(times):6.1f} µs, "
              f"p90 {times[int(len(times) * 0.9)]:6.1f} µs")
    device = torch.device(args.device)
    for rows in args.rows:
        logits = torch.randn(rows, grammars.vocab_size, device=device)
        allowed = torch.randint(-2**31, 2**31 - 1, (rows, (grammars.vocab_size + 31) // 32), dtype=torch.int32,
                                device=device)
        times = []
        for _ in range(60):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            mask_logits(logits, allowed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e6)
        print(f"apply on {device.type}, {rows:2d} rows: median {statistics.median(times[10:]):8.1f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--engine", action="store_true", help="the engine's decode step, constrained against not")
    parser.add_argument("--model", default="synthetic:e2b", help="--engine: checkpoint, Hub id or synthetic:PRESET")
    parser.add_argument("--prompt", type=int, default=32, help="--engine: prompt tokens per request (default: 32)")
    parser.add_argument("--new", type=int, default=128, help="--engine: most new tokens per request (default: 128)")
    parser.add_argument("--json", metavar="PATH", help="--engine: write the numbers to PATH")
    args = parser.parse_args()
    if args.engine:
        run_engine(args)
    else:
        measure_pieces(args)


if __name__ == "__main__":
    main()
