"""What a constrained row costs per token: the host's fill of its allowed-token bitmask (xgrammar,
over the real 262,144-token Gemma 4 vocabulary of the test fixtures) and applying bitmasks to a
step's logits (:func:`qat4.engine.sampler.mask_logits`) on a device.

    python tools/bench_grammar.py [--device cuda] [--rows 1 16]

Fill: a JSON-schema reply (nested object, enum, bounded numbers, array) and a Gemma 4 tool call
walked token by token, every fill timed; median and 90th percentile. Apply: median of 50 runs
per row count, synchronised on CUDA.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import xgrammar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from qat4.chat.grammars import grammars_for  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
