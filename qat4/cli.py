"""`qat4` command line: one module per subcommand under qat4.commands, each with
`add_parser(subparsers)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from qat4.errors import Qat4Error

# Subcommand modules in the order `qat4 --help` lists them.
COMMANDS = [
    "synth",
    "generate",
    "serve",
    "status",
    "stop",
    "ask",
    "bench",
    "eval",
    "repack",
    "verify",
    "doctor",
    "mcp",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qat4", description="Gemma 4 E2B from packed 4-bit QAT weights.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"qat4.commands.{name}").add_parser(sub)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A terminated command unwinds like Ctrl-C, so writers remove their temporary files.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.run(args) or 0)
    except Qat4Error as exc:
        print(f"qat4 {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"qat4 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
