"""`qat4 doctor`: will qat4 run here, and how (the checks are in qat4.doctor)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from qat4.commands.model_args import DEVICES

ICONS = {"ok": "✅", "warn": "⚠️", "fail": "❌"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="check whether qat4 will run here, and how (exit 1 when something blocks it)",
        description="Check this machine for qat4 without loading weights or reaching the network: the Python, torch "
                    "and Triton versions, the GPU, the paths qat4 takes on it (dtype, kernels, prefill GEMM, PDL, "
                    "CUDA graphs), free disk where checkpoints and the Hugging Face cache go, --model (a local "
                    "checkpoint, a Hub model id downloaded or not, synthetic:PRESET) and the largest context that "
                    "fits beside the model. One line per check, then a summary. Exit status: 1 when a check fails "
                    "(something blocks running), else 0.")
    p.add_argument("--model", default=None, metavar="PATH|ID",
                   help="checkpoint directory or file, Hugging Face model id, or synthetic:tiny / synthetic:e2b "
                        "(default: none; the context is worked out for Gemma 4 E2B)")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda when available, else cpu")
    p.add_argument("--memory-cap-mib", type=float, default=None, metavar="N",
                   help="work the context out for N MiB of device memory, as qat4 serve --memory-cap-mib N would")
    p.add_argument("--max-ctx", type=int, default=None, metavar="N",
                   help="check that a context of N tokens fits (default: that the model's default context does)")
    p.add_argument("--json", action="store_true", help='print {"checks": [{"name", "status", "detail"}, ...], "ok": ...}')
    p.set_defaults(run=run)


def summary(checks) -> str:
    """One line: how many checks passed, warned and failed, and what that means."""
    counts = Counter(c.status for c in checks)
    tally = f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail"
    if counts["fail"]:
        return f"{tally}: something blocks running qat4 here; fix the ❌ lines first"
    if counts["warn"]:
        return f"{tally}: qat4 will run here; the ⚠️ lines say how"
    return f"{tally}: qat4 will run here"


def run(args: argparse.Namespace) -> int:
    from qat4.doctor import diagnose, passed

    checks = diagnose(args.model, memory_cap_mib=args.memory_cap_mib, device=args.device, max_ctx=args.max_ctx)
    if args.json:
        print(json.dumps({"checks": [c.as_dict() for c in checks], "ok": passed(checks)}, indent=2))
    else:
        for c in checks:
            print(f"{ICONS[c.status]} {c.name}: {c.detail}")
        print(summary(checks))
    return 0 if passed(checks) else 1
