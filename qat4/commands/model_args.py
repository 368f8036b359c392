"""The flags every command that loads a model shares, their defaults, and the engine they ask for."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from qat4.errors import Qat4Error

if TYPE_CHECKING:
    from qat4.engine import Engine
    from qat4.tokenizer import Tokenizer

MAX_CTX_DEFAULT = 131_072
DEVICES = ("cuda", "cpu")


def add_model_arguments(p: argparse.ArgumentParser, *, synthetic: bool = False) -> None:
    """--model, --device and --max-ctx; `synthetic` when the command also takes synthetic:PRESET (see load_engine)."""
    what = "checkpoint directory or file, or a Hugging Face model id"
    if synthetic:
        what += "; synthetic:e2b or synthetic:tiny builds random on-grid weights in memory (seed 0)"
    p.add_argument("--model", required=True, metavar="PATH|ID", help=what)
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-ctx", type=int, default=None, metavar="N",
                   help=f"context length in tokens, prompt plus reply (default: the model's, at most {MAX_CTX_DEFAULT})")


def add_dense_weights_argument(p: argparse.ArgumentParser) -> None:
    """--dense-weights / --no-dense-weights (EngineConfig.dense_weights: None unless given)."""
    p.add_argument("--dense-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="keep a 16-bit copy of every layer matrix on the GPU (3.75 GB on E2B), which prompt steps "
                        "multiply instead of expanding the packed words; --no-dense-weights never (default: where "
                        "it fits in the memory left over)")


def add_prefill_chunk_argument(p: argparse.ArgumentParser) -> None:
    """--prefill-chunk (EngineConfig.prefill_chunk: None unless given)."""
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens a step reads, over all the sequences reading a prompt, beside the decoding "
                        "rows: smaller chunks bring first tokens sooner under load, larger ones serve more tokens a "
                        "second (default: the largest of 4096 .. 256 that fits in memory; 256 on the CPU)")


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--speculative and --spec-tokens (speculative decoding; see speculative_options)."""
    p.add_argument("--speculative", default=None, metavar="DRAFTER",
                   help="speculative decoding: ngram drafts the tokens that followed an earlier occurrence of the "
                        "last few tokens (prompt lookup); mtp:PATH|ID runs Gemma 4's MTP drafter from a folder or "
                        "model id (google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant); the output is the same, "
                        "token for token (default: off)")
    p.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                   help="most draft tokens verified per step, 1 to 8; each step drafts as many as pay (default: 4)")


def speculative_options(args: argparse.Namespace) -> dict:
    """The EngineConfig options of --speculative and --spec-tokens, checked before anything loads."""
    if args.speculative is None and args.spec_tokens is None:
        return {"speculative": None}
    from qat4.engine.config import MAX_SPEC_TOKENS, check_drafter  # imports torch: not for plain decoding

    if args.speculative is not None:
        check_drafter(args.speculative, "--speculative")
    if args.spec_tokens is None:
        return {"speculative": args.speculative}
    if not args.speculative:
        raise Qat4Error("--spec-tokens sets how many drafts speculative decoding verifies; it needs --speculative")
    if not 1 <= args.spec_tokens <= MAX_SPEC_TOKENS:
        raise Qat4Error(f"--spec-tokens is {args.spec_tokens}; it must be 1 to {MAX_SPEC_TOKENS}")
    return {"speculative": args.speculative, "spec_tokens": args.spec_tokens}


def resolve_device(choice: str | None) -> str:
    """--device as given, else cuda when a GPU is visible, else cpu; --device cuda without a GPU
    is refused here, before anything loads."""
    import torch

    if choice is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise Qat4Error("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return choice


def synthetic_tokenizer() -> Tokenizer:
    """The real Gemma 4 tokenizer and chat template shipped in qat4/data, which synthetic checkpoints carry."""
    import tokenizers

    from qat4.checkpoint.synth import synthetic_aux
    from qat4.tokenizer import Tokenizer

    aux = synthetic_aux()
    return Tokenizer(tokenizers.Tokenizer.from_str(aux.tokenizer_json), aux.chat_template)


def load_engine(command: str, model: str, device: str, **options) -> Engine:
    """The Engine for --model with EngineConfig ``options``.

    A checkpoint from disk or the Hub is read with a status line on stderr naming each tensor (a
    16-bit checkpoint has its 4-bit grid recovered then, which takes minutes at full size on a
    CPU). synthetic:PRESET builds that preset's random on-grid weights (seed 0) in memory on
    `device`, which takes seconds where writing a full-size checkpoint first would take minutes,
    with the shipped tokenizer.
    """
    import torch

    from qat4.checkpoint.loader import load_packed
    from qat4.commands.bench import load_packed_for_bench
    from qat4.commands.progress import ProgressLine
    from qat4.config import SYNTHETIC
    from qat4.engine import Engine

    if model.startswith(SYNTHETIC):
        packed = load_packed_for_bench(model, torch.device(device), seed=0)
        return Engine.from_packed(packed, device, tokenizer=synthetic_tokenizer(), **options)
    line = ProgressLine()
    try:
        packed = load_packed(model, progress=lambda done, total, name: line.update(
            f"qat4 {command}: reading tensor {done}/{total} ({name})"))
    finally:
        line.done()
    return Engine.from_packed(packed, device, **options)
