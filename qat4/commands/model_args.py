"""The flags every command that loads a model shares, their defaults, and the engine they ask for."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qat4.engine import Engine
    from qat4.tokenizer import Tokenizer

MAX_CTX_DEFAULT = 131_072


def add_model_arguments(p: argparse.ArgumentParser, *, synthetic: bool = False) -> None:
    """--model, --device and --max-ctx; `synthetic` when the command also takes synthetic:PRESET (see load_engine)."""
    what = "checkpoint directory or file, or a Hugging Face model id"
    if synthetic:
        what += "; synthetic:e2b or synthetic:tiny builds random on-grid weights in memory (seed 0)"
    p.add_argument("--model", required=True, metavar="PATH|ID", help=what)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-ctx", type=int, default=None, metavar="N",
                   help=f"context length in tokens, prompt plus reply (default: the model's, at most {MAX_CTX_DEFAULT})")


def resolve_device(choice: str | None) -> str:
    """--device as given, else cuda when a GPU is visible, else cpu."""
    if choice:
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synthetic_tokenizer() -> Tokenizer:
    """The real Gemma 4 tokenizer and chat template shipped in qat4/data, which synthetic checkpoints carry."""
    import tokenizers

    from qat4.checkpoint.synth import synthetic_aux
    from qat4.tokenizer import Tokenizer

    aux = synthetic_aux()
    return Tokenizer(tokenizers.Tokenizer.from_str(aux.tokenizer_json), aux.chat_template)


def load_engine(model: str, device: str, **options) -> Engine:
    """The Engine for --model with EngineConfig ``options``: a checkpoint read from disk or the
    Hub, or for synthetic:PRESET the random on-grid weights of that preset (seed 0) built in memory
    on `device`, which takes seconds where writing a full-size checkpoint first would take minutes,
    with the shipped tokenizer."""
    from qat4.commands.bench import SYNTHETIC, load_packed_for_bench
    from qat4.engine import Engine

    if not model.startswith(SYNTHETIC):
        return Engine.load(model, device=device, **options)
    import torch

    packed = load_packed_for_bench(model, torch.device(device), seed=0)
    return Engine.from_packed(packed, device, tokenizer=synthetic_tokenizer(), **options)
