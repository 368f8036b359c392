"""`qat4 synth`: write a synthetic checkpoint whose random weights lie exactly on the 4-bit grid."""

from __future__ import annotations

import argparse
from pathlib import Path

from qat4.checkpoint import FORMATS
from qat4.config import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth", help="write a synthetic checkpoint (random weights on the 4-bit grid) in any format",
        description="Write random Gemma 4 weights that lie exactly on the 4-bit grid, with the real vocabulary "
                    "and chat template, in any supported format. The same seed gives the same levels and "
                    "steps in every format. The e2b preset is full size (4.6 B parameters).")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model shape (default: tiny)")
    p.add_argument("--format", choices=FORMATS, default=None, dest="fmt",
                   help="ct and ct-emb4: compressed-tensors folders; qat-bf16: Google's dense bf16 layout; "
                        "gguf: one Q4_0 .gguf file (required unless --assistant)")
    p.add_argument("--assistant", action="store_true",
                   help="write instead an MTP drafter for the preset's model (Gemma4AssistantForCausalLM layout: "
                        "config.json and dense bf16 safetensors), for --speculative mtp:PATH")
    p.add_argument("--out", type=Path, required=True, metavar="PATH", help="folder to write (for gguf: the .gguf file)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qat4.checkpoint.synth import write_synthetic
    from qat4.errors import Qat4Error

    if args.assistant:
        from qat4.checkpoint.assistant import write_synthetic_assistant

        if args.fmt is not None:
            raise Qat4Error("--assistant writes the drafter's own layout; leave out --format")
        out = write_synthetic_assistant(args.out, PRESETS[args.preset], seed=args.seed, overwrite=args.force)
        print(f"wrote an MTP drafter for the {args.preset} model to {out}")
        return 0
    if args.fmt is None:
        raise Qat4Error("--format is required (or --assistant for an MTP drafter)")
    out = write_synthetic(args.out, PRESETS[args.preset], args.fmt, seed=args.seed, overwrite=args.force)
    print(f"wrote a {args.preset} {args.fmt} checkpoint to {out}")
    return 0
