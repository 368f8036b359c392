"""`qat4 verify`: compare two checkpoints tensor by tensor, in any formats."""

from __future__ import annotations

import argparse
import json

from qat4.commands.progress import ProgressLine


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="compare two checkpoints tensor by tensor (exit 0 when their int4 codes are identical)",
        description="Compare checkpoints A and B (any formats; folders, .gguf files or Hub model ids) tensor by "
                    "tensor and print, per group of tensors and in total: elements, elements whose dequantised "
                    "values differ (compared in fp32), int4 codes that disagree, the worst difference in units of "
                    "the group step, and for tensors recovered from 16-bit values the share that reconstruct "
                    "bit-identically. Exit status: 0 when every int4 code is identical and both hold the same "
                    "tensors, 1 otherwise; config fields that differ are listed, and named in the last line, "
                    "without changing the exit status.")
    p.add_argument("a", metavar="A", help="first checkpoint")
    p.add_argument("b", metavar="B", help="second checkpoint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from qat4.checkpoint.loader import open_checkpoint
    from qat4.checkpoint.verify import compare, format_comparison

    line = ProgressLine()
    try:
        result = compare(open_checkpoint(args.a), open_checkpoint(args.b),
                         progress=lambda done, total, name: line.update(f"verify: tensor {done}/{total} ({name})"))
    finally:
        line.done()
    print(json.dumps(result.to_json(), indent=2) if args.json else format_comparison(result))
    return 0 if result.identical_codes else 1
