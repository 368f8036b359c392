"""What sampling adds to a decode step: the step per sampling setting, the draw's parts, and generate.

    python tools/bench_sampling.py [--model synthetic:e2b] [--new 256]

Builds the engine on the GPU (pinning the tilings of ``$QAT4_TILINGS`` when it is set) and prints
µs per graph replay of the decode step for greedy decoding (the argmax fused into the output layer),
top_k 64 and the whole vocabulary; then µs per launch, as CUDA graphs of 50 launches, of the output
layer with the fused argmax and with logits, `torch.topk` (k = 64) and `torch.sort` over the
vocabulary, and the whole draw with top_k 64 and over the vocabulary; then `Engine.generate`'s
decode tok/s for greedy decoding, Gemma's defaults (temperature 1.0, top_k 64, top_p 0.95) and
top_k 0, after a 512-token prompt.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.engine import GREEDY, Engine  # noqa: E402
from qat4.sampling import sample  # noqa: E402


def graph_us(fn, launches: int = 50) -> float:
    """µs per call of fn, captured `launches` times in one CUDA graph (best of 5 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / launches * 1e6)
    return best


def step_us(engine: Engine, key: object, replays: int = 300) -> float:
    """µs per graph replay of the decode step for sampling key `key` (GREEDY or a top_k)."""
    step = engine.step
    step.prepare(key)
    step.token.fill_(5)
    step.pos.fill_(100)
    for _ in range(10):
        step.run(key)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        step.run(key)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays * 1e6


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:e2b")
    parser.add_argument("--new", type=int, default=256, help="tokens per generate run")
    args = parser.parse_args()
    device = torch.device("cuda")
    engine = Engine.from_packed(load_packed_for_bench(args.model, device, seed=0), device, max_ctx=4096)
    model = engine.model
    for key, label in ((GREEDY, "greedy"), (64, "top_k 64"), (None, "whole vocabulary")):
        print(f"decode step, {label:>16}: {step_us(engine, key):8.1f} µs per replay")

    h = torch.randn(1, model.config.hidden_size, device=device, dtype=engine.dtype)
    logits = model.logits(h)[0]
    one = lambda v: torch.full((1,), v, device=device)  # noqa: E731
    uniform, temperature, top_p = one(0.5), one(1.0), one(0.95)
    ops = {
        "output layer, argmax fused": lambda: model.argmax(h),
        "output layer, logits": lambda: model.logits(h),
        "torch.topk, k = 64": lambda: torch.topk(logits, 64),
        "torch.sort": lambda: torch.sort(logits, descending=True),
        "draw, top_k 64": lambda: sample(logits, uniform, temperature, top_p, 64),
        "draw, whole vocabulary": lambda: sample(logits, uniform, temperature, top_p, None),
    }
    for label, fn in ops.items():
        print(f"{label:>28}: {graph_us(fn):8.1f} µs")

    prompt = list(range(10, 522))
    settings = {"greedy": {"temperature": 0}, "Gemma's defaults": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
                "top_k 0, top_p 0.95": {"temperature": 1.0, "top_k": 0, "top_p": 0.95}}
    for label, options in settings.items():
        engine.generate(prompt, max_new_tokens=8, stop_token_ids=[], **options)
        result = engine.generate(prompt, max_new_tokens=args.new, stop_token_ids=[], **options)
        print(f"generate {args.new} tokens, {label:>20}: {result.decode_tok_s:7.1f} tok/s")


if __name__ == "__main__":
    main()
