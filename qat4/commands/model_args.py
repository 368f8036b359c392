"""The flags every command that loads a model shares, and their defaults."""

from __future__ import annotations

import argparse

from qat4.errors import Qat4Error

MAX_CTX_DEFAULT = 131_072
DEVICES = ("cuda", "cpu")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --device and --max-ctx."""
    p.add_argument("--model", required=True, metavar="PATH|ID", help="checkpoint directory or file, or a Hugging Face model id")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-ctx", type=int, default=None, metavar="N",
                   help=f"context length in tokens, prompt plus reply (default: the model's, at most {MAX_CTX_DEFAULT})")


def resolve_device(choice: str | None) -> str:
    """--device as given, else cuda when a GPU is visible, else cpu; --device cuda without a GPU
    is refused here, before anything loads."""
    import torch

    if choice is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise Qat4Error("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    return choice


def load_engine(command: str, model: str, device: str, **options):
    """`Engine.load` with a status line on stderr while the checkpoint's tensors are read (a 16-bit
    checkpoint has its 4-bit grid recovered then, which takes minutes at full size on a CPU)."""
    from qat4.checkpoint.loader import load_packed
    from qat4.commands.progress import ProgressLine
    from qat4.engine import Engine

    line = ProgressLine()
    try:
        packed = load_packed(model, progress=lambda done, total, name: line.update(
            f"qat4 {command}: reading tensor {done}/{total} ({name})"))
    finally:
        line.done()
    return Engine.from_packed(packed, device, **options)
