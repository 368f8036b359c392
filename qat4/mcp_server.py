"""`qat4 mcp`: qat4's deployment steps as Model Context Protocol tools, served on stdin/stdout.

The tools, in the order a deployment's failures get expensive: ``doctor`` (will qat4 run here),
``status`` (what the running server is), ``start`` and ``stop`` (a server in the background),
``bench`` (how fast the engine is) and ``chat`` (one answer from the running server). ``start``,
``stop`` and ``bench`` run the `qat4` command itself (``python -m qat4.cli``) as a child with
its input from /dev/null and its output captured, so a started server outlives this one and a
user's commands and these tools take the same path. While serving, the SDK's stdio transport
points descriptor 1 at stderr, so nothing printed during a tool call reaches the protocol channel.
A failure comes back as a tool error of one sentence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

import qat4
from qat4.api_client import auth_headers, error_message
from qat4.commands.status import server_status
from qat4.commands.stop import DEFAULT_TIMEOUT_S
from qat4.errors import Qat4Error
from qat4.server_control import DEFAULT_PORT, LOOPBACK, url_for

CHAT_TIMEOUT = httpx.Timeout(10.0, read=None)  # an answer takes as long as its tokens do
INSTRUCTIONS = (
    "qat4 runs Google's Gemma 4 E2B from packed 4-bit weights. Run doctor first (will it run here, how much "
    "context fits), then start a server, status to see it, chat to use it, bench to measure it, stop to end it. "
    "model is a checkpoint folder, a .gguf file, a Hugging Face model id, or synthetic:tiny / synthetic:e2b "
    "(random weights, no download)."
)

Model = Annotated[str, Field(description="checkpoint folder, .gguf file, Hugging Face model id "
                                         "(e.g. xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4), "
                                         "or synthetic:tiny / synthetic:e2b (random weights, no download)")]
Device = Annotated[Literal["cuda", "cpu"] | None, Field(description="cuda or cpu (default: cuda when a GPU is "
                                                                    "visible, else cpu)")]
CAP = "MiB of GPU memory qat4 may use, e.g. 3732 for a 4 GB card's share (default: the whole GPU)"
Port = Annotated[int, Field(description="the port of this machine the server listens on")]
Url = Annotated[str | None, Field(description="a server's address instead of the port, e.g. http://10.0.0.5:8100")]


def failure_message(stderr: str, returncode: int) -> str:
    """What a failed `qat4` command said: its last `qat4 ...:` line (the one-line error every command
    prints), followed by the last line of any output it introduces; else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [i for i, line in enumerate(lines) if line.startswith("qat4 ")]
    if not said:
        return lines[-1] if lines else f"qat4 exited with status {returncode} and said nothing"
    message = lines[said[-1]]
    if message.endswith(":") and said[-1] < len(lines) - 1:
        message += " " + lines[-1]
    return message


def run_qat4(*words: str) -> str:
    """Run `qat4 WORDS...` as a child (no stdin, output captured) and return its stdout; a failure is a
    ToolError with what it said."""
    command = [sys.executable, "-m", "qat4.cli", *words]
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except OSError as exc:
        raise ToolError(f"cannot run {command[0]} ({exc.strerror or exc})") from None
    if done.returncode != 0:
        raise ToolError(failure_message(done.stderr, done.returncode))
    return done.stdout


def options(**flags: Any) -> list[str]:
    """Command-line words `--flag=value` for each flag that is set (underscores as dashes)."""
    return [f"--{name.replace('_', '-')}={value}" for name, value in flags.items() if value is not None]


def doctor(model: Annotated[str | None, Field(description="the model to check, as start takes it (default: none; "
                                                          "the context is worked out for Gemma 4 E2B)")] = None,
           memory_cap_mib: Annotated[float | None, Field(description=CAP, gt=0)] = None,
           device: Device = None) -> dict[str, Any]:
    """Check whether qat4 will run on this machine, and how, without loading weights or reaching the
    network: Python, torch and Triton versions, the GPU, the compute path qat4 takes on it, free disk,
    the model (found, downloaded or not, its format) and the largest context that fits beside it.
    Each check has a status: ok, warn (qat4 runs, but read this) or fail (this blocks running);
    ok is true when nothing fails."""
    from qat4.doctor import diagnose, passed

    try:
        checks = diagnose(model, memory_cap_mib=memory_cap_mib, device=device)
    except Qat4Error as exc:
        raise ToolError(str(exc)) from None
    return {"checks": [c.as_dict() for c in checks], "ok": passed(checks)}


def status(port: Port = DEFAULT_PORT, url: Url = None) -> dict[str, Any]:
    """What the qat4 server on this machine's port (or at url) is, as `qat4 status --json` reports it:
    status (ok, error; starting or unreachable when nothing answers, with the reason in error), pid,
    model, the device it computes on, memory, running and queued sequences, KV pool use, uptime, and
    its pid and log files when it was started in the background."""
    try:
        return (server_status(url=url) if url else server_status(port=port)).report
    except Qat4Error as exc:
        raise ToolError(str(exc)) from None


def start(model: Model, port: Port = DEFAULT_PORT, device: Device = None,
          max_ctx: Annotated[int | None, Field(description="context length in tokens, prompt plus reply "
                                                           "(default: the model's, as memory allows)")] = None,
          memory_cap_mib: Annotated[int | None, Field(description=CAP, gt=0)] = None,
          extra_args: Annotated[tuple[str, ...], Field(description="more `qat4 serve` flags, e.g. "
                                                                   "[\"--max-num-seqs=8\"]")] = ()) -> dict[str, Any]:
    """Start `qat4 serve --detach`: an OpenAI-compatible server in the background on this machine's
    port, which keeps running after this MCP server ends. Returns once its /health answers (a Hub
    model may download first), with what status reports: pid, url, model, device, log and pid files.
    Stop it with stop."""
    run_qat4("serve", "--detach", *options(model=model, port=port, device=device, max_ctx=max_ctx,
                                           memory_cap_mib=memory_cap_mib), *extra_args)
    return status(port)


def stop(port: Port = DEFAULT_PORT,
         timeout_s: Annotated[float, Field(description="seconds to wait after SIGTERM before SIGKILL")]
         = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """Stop the qat4 server on this machine's port (`qat4 stop`): SIGTERM, which ends its open answers
    within 5 s, then SIGKILL if it is still there after timeout_s; its pid file is removed."""
    return {"message": run_qat4("stop", *options(port=port, timeout=timeout_s)).strip()}


def bench(model: Model, device: Device = None,
          new_tokens: Annotated[int, Field(description="tokens decoded at each depth", ge=1)] = 32,
          prompt_tokens: Annotated[int, Field(description="prompt length for the prompt speed", ge=1)] = 256,
          depths: Annotated[tuple[int, ...], Field(description="context depths (tokens held) to decode at",
                                                   min_length=1)] = (0,)) -> dict[str, Any]:
    """Measure the engine with a short `qat4 bench` in a process of its own (stop a server on the same GPU
    first): decode tokens/s at each depth with its fraction of the memory-bandwidth roofline, prompt
    tokens/s, time to first token, model and KV cache memory, peak GPU memory."""
    from qat4.commands.model_args import resolve_device

    try:
        device = resolve_device(device)  # `qat4 bench` itself defaults to cuda
    except Qat4Error as exc:
        raise ToolError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="qat4-bench-") as folder:
        report = Path(folder) / "bench.json"
        run_qat4("bench", *options(model=model, device=device, new=new_tokens, prompt=prompt_tokens,
                                   depths=",".join(map(str, depths)), json=report))
        return json.loads(report.read_text())


def chat(prompt: Annotated[str, Field(description="the user's message")], port: Port = DEFAULT_PORT, url: Url = None,
         max_tokens: Annotated[int, Field(description="most tokens in the answer", ge=1)] = 256,
         temperature: Annotated[float | None, Field(description="sampling temperature; 0 is greedy (default: the "
                                                                "model's)", ge=0)] = None,
         system: Annotated[str | None, Field(description="a system message before the prompt")] = None) -> dict[str, Any]:
    """One chat completion from the running qat4 server (POST /v1/chat/completions, not streamed):
    the answer's content, reasoning_content (its thinking, when any), finish_reason (stop or length)
    and usage (prompt, completion and total tokens)."""
    address = (url or url_for(LOOPBACK, port)).rstrip("/")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"messages": messages, "max_tokens": max_tokens, "stream": False,
            **({} if temperature is None else {"temperature": temperature})}
    headers = auth_headers(os.environ.get("QAT4_API_KEY"))
    try:
        response = httpx.post(f"{address}/v1/chat/completions", json=body, headers=headers, timeout=CHAT_TIMEOUT)
    except httpx.ConnectError:
        raise ToolError(f"no server answers at {address}; start one with the start tool") from None
    except httpx.TransportError as exc:
        raise ToolError(f"the connection to {address} failed ({exc})") from None
    if response.status_code != 200:
        raise ToolError(f"the server at {address} answered {response.status_code}: {error_message(response.content)}")
    return completion_summary(response.json())


def completion_summary(completion: dict) -> dict[str, Any]:
    """The first choice of a chat completion: content, reasoning_content, finish_reason, and the usage."""
    choice = completion["choices"][0]
    message = choice["message"]
    return {"content": message.get("content"), "reasoning_content": message.get("reasoning_content"),
            "finish_reason": choice.get("finish_reason"), "usage": completion.get("usage")}


READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
TOOLS = [(doctor, READ_ONLY), (status, READ_ONLY), (start, None), (stop, ToolAnnotations(destructive_hint=True)),
         (bench, None), (chat, None)]


def build_server() -> MCPServer:
    """The MCP server with qat4's tools, in the order a deployment uses them."""
    server = MCPServer("qat4", version=qat4.__version__, instructions=INSTRUCTIONS)
    for fn, annotations in TOOLS:
        server.add_tool(fn, description=" ".join(fn.__doc__.split()), annotations=annotations)
    return server
