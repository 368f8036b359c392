"""`qat4 mcp`: qat4 as a Model Context Protocol server on stdin/stdout, for MCP clients such as
Claude Desktop (the tools are in qat4.mcp_server; README, "MCP")."""

from __future__ import annotations

import argparse

from qat4.errors import Qat4Error

INSTALL = "pip install 'qat4[mcp]'"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mcp", help="serve qat4's tools to an MCP client over stdin/stdout (doctor, status, start, stop, bench, chat)",
        description="Run a Model Context Protocol server on stdin/stdout for an MCP client to start as a child "
                    "(command `qat4`, arguments `mcp`). Its tools: doctor, status, start and stop (qat4 serve in "
                    "the background), bench, and chat with the running server. Needs the mcp package: "
                    f"{INSTALL}.")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from qat4.mcp_server import build_server
    except ModuleNotFoundError as exc:
        if exc.name != "mcp" and not (exc.name or "").startswith(("mcp.", "mcp_types")):
            raise
        raise Qat4Error(f"the MCP server needs the mcp package, version 2.3 or newer; {INSTALL}") from None
    build_server().run("stdio")
    return 0
