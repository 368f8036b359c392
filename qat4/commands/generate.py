"""`qat4 generate`: run the engine on one prompt and print the generated text."""

from __future__ import annotations

import argparse
import sys

from qat4.commands.model_args import add_model_arguments, add_speculative_arguments, load_engine, resolve_device, \
    speculative_options
from qat4.errors import Qat4Error


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from one prompt, in process (no server)",
        description="Load a checkpoint, generate from one prompt and print the text on stdout; a one-line "
                    "timing summary goes to stderr. The prompt is --prompt, else standard input. Unset "
                    "sampling options come from the checkpoint's generation_config; --temperature 0 is greedy.")
    add_model_arguments(p)
    p.add_argument("--prompt", default=None, help="prompt text (default: read standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    p.add_argument("--max-new", type=int, default=256, metavar="N", help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=None, metavar="T", help="0 for greedy (default: the checkpoint's)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="keep the K most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="keep the most likely tokens up to probability P")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    add_speculative_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_new < 1:
        raise Qat4Error(f"--max-new is {args.max_new}; it must be at least 1")
    device = resolve_device(args.device)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt:
        raise Qat4Error("the prompt is empty; pass --prompt TEXT or pipe text on standard input")
    engine = load_engine("generate", args.model, device, max_ctx=args.max_ctx, **speculative_options(args))
    if args.chat:
        from qat4.chat import render_prompt

        template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
        prompt = render_prompt([{"role": "user", "content": prompt}], template=template)
    result = engine.generate(prompt, max_new_tokens=args.max_new, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed)
    print(result.text)
    rate = "no rate (fewer than 2 decode steps)" if result.decode_tok_s is None else f"{result.decode_tok_s:.1f} tok/s"
    drafts = f"{result.accepted} of {result.drafted} draft tokens kept, " if args.speculative else ""
    print(f"qat4 generate: {result.prompt_tokens} prompt tokens in {result.prefill_ms:.1f} ms, "
          f"{len(result.tokens)} new tokens, decode {rate}, {drafts}"
          f"finish {result.finish_reason}, {engine.device.type} {str(engine.dtype).removeprefix('torch.')}",
          file=sys.stderr)
    return 0
