"""What sampling adds to a decode step: the step per sampling setting, the draw's parts, and generate.

    python tools/bench_sampling.py [--model synthetic:e2b] [--new 256]

Builds the engine on the GPU (pinning the tilings of ``$QAT4_TILINGS`` when it is set) and prints
µs per graph replay of the decode step (qat4.decode_tuning.step_time_us) for greedy decoding (the
argmax fused into the output layer), top_k 64 and the whole vocabulary; then µs per launch, median
of CUDA graphs of 50 launches (tools/bench_w4.py's graph_time_us), of the output layer with the
fused argmax and with logits, `torch.topk` (k = 64) and `torch.sort` over the vocabulary, and the
whole draw with top_k 64 and over the vocabulary; then `Engine.generate`'s decode tok/s for greedy
decoding, Gemma's defaults (temperature 1.0, top_k 64, top_p 0.95) and top_k 0, after a 512-token
prompt.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_w4 import graph_time_us  # noqa: E402
from qat4.commands.bench import load_packed_for_bench  # noqa: E402
from qat4.decode_tuning import step_time_us  # noqa: E402
from qat4.engine import GREEDY, Engine  # noqa: E402
from qat4.sampling import sample  # noqa: E402

LAUNCHES = 50  # launches of an op per captured graph


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
        print(f"decode step, {label:>16}: {step_time_us(engine.step, key, replays=300):8.1f} µs per replay")

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
        us = graph_time_us(lambda fn=fn: [fn() for _ in range(LAUNCHES)], LAUNCHES)
        print(f"{label:>28}: {us:8.1f} µs")

    prompt = list(range(10, 522))
    settings = {"greedy": {"temperature": 0}, "Gemma's defaults": {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
                "top_k 0, top_p 0.95": {"temperature": 1.0, "top_k": 0, "top_p": 0.95}}
    for label, options in settings.items():
        engine.generate(prompt, max_new_tokens=8, stop_token_ids=[], **options)
        result = engine.generate(prompt, max_new_tokens=args.new, stop_token_ids=[], **options)
        print(f"generate {args.new} tokens, {label:>20}: {result.decode_tok_s:7.1f} tok/s")


if __name__ == "__main__":
    main()
