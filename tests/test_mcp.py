"""`qat4 mcp`, driven as an MCP client drives it: `python -m qat4.cli mcp` started over stdio by the
SDK's own client, its tools listed and called. One real round trip on the tiny synthetic model
(start, status, chat, stop); the GPU is hidden, so everything runs on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

from qat4.cli import main  # noqa: E402
from qat4.doctor import STATUSES  # noqa: E402
from qat4.serve_process import free_port  # noqa: E402
from qat4.server_control import stale_reason  # noqa: E402

pytestmark = pytest.mark.anyio
TOOLS = ["doctor", "status", "start", "stop", "bench", "chat"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def state(tmp_path) -> Path:
    """The state directory the MCP server and the servers it starts keep pid and log files in."""
    folder = tmp_path / "state"
    folder.mkdir()
    return folder


@asynccontextmanager
async def mcp_session(state: Path) -> AsyncIterator[ClientSession]:
    """An initialized client session with `python -m qat4.cli mcp`, its stderr in the state folder."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "qat4.cli", "mcp"],
                                   env={"QAT4_STATE_DIR": str(state), "CUDA_VISIBLE_DEVICES": ""})
    with open(state / "mcp.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def text(result) -> str:
    """The text a tool call returned."""
    return "".join(block.text for block in result.content)


def one_sentence_error(result) -> str:
    """A tool error's text, checked to be one line and no Python traceback."""
    assert result.is_error, result
    message = text(result)
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    return message


async def test_the_tools_are_listed_in_order_with_their_schemas(state):
    async with mcp_session(state) as session:
        tools = (await session.list_tools()).tools
    assert [tool.name for tool in tools] == TOOLS
    for tool in tools:
        assert tool.description and "\n" not in tool.description
        assert tool.input_schema["type"] == "object"
        for name, field in tool.input_schema["properties"].items():
            assert field.get("description"), (tool.name, name)
    required = {tool.name: tool.input_schema.get("required", []) for tool in tools}
    assert required == {"doctor": [], "status": [], "start": ["model"], "stop": [], "bench": ["model"],
                        "chat": ["prompt"]}


async def test_doctor_reports_every_check_and_the_missing_gpu(state):
    async with mcp_session(state) as session:
        result = await session.call_tool("doctor", {"model": "synthetic:tiny"})
        unknown = await session.call_tool("doctor", {"model": "synthetic:nope"})
    assert not result.is_error, text(result)
    report = result.structured_content
    assert {c["status"] for c in report["checks"]} <= set(STATUSES)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["gpu"]["status"] == "warn" and "no CUDA GPU" in checks["gpu"]["detail"]
    assert report["ok"] == all(c["status"] != "fail" for c in report["checks"])
    assert checks["model"]["status"] == "ok"
    model = {c["name"]: c for c in unknown.structured_content["checks"]}["model"]
    assert model["status"] == "fail" and "unknown synthetic preset" in model["detail"]
    assert unknown.structured_content["ok"] is False


async def test_status_and_chat_where_nothing_listens_say_so(state):
    port = free_port()
    async with mcp_session(state) as session:
        status = await session.call_tool("status", {"port": port})
        chat = await session.call_tool("chat", {"prompt": "Hello", "port": port})
    assert not status.is_error, text(status)
    assert status.structured_content["status"] == "unreachable"
    assert status.structured_content["error"].startswith(f"no server answers at http://127.0.0.1:{port}")
    assert f"no server answers at http://127.0.0.1:{port}" in one_sentence_error(chat)


async def test_a_server_that_cannot_start_is_one_sentence(state):
    async with mcp_session(state) as session:
        result = await session.call_tool("start", {"model": "synthetic:nope", "port": free_port()})
    assert "unknown synthetic preset" in one_sentence_error(result)
    assert not list(state.glob("*.pid"))


async def test_bench_returns_its_json_summary(state):
    async with mcp_session(state) as session:
        result = await session.call_tool("bench", {"model": "synthetic:tiny", "new_tokens": 4, "prompt_tokens": 16})
    assert not result.is_error, text(result)
    report = result.structured_content
    assert (report["model"], report["device"], report["prompt_tokens"]) == ("synthetic:tiny", "CPU", 16)
    assert [d["depth"] for d in report["depths"]] == [0] and report["depths"][0]["decode_tok_s"] > 0


async def test_start_status_chat_stop(state):
    port = free_port()
    try:
        async with mcp_session(state) as session:
            started = await session.call_tool("start", {"model": "synthetic:tiny", "port": port, "max_ctx": 512})
            assert not started.is_error, text(started)
            server = started.structured_content
            assert server["status"] == "ok" and server["url"] == f"http://127.0.0.1:{port}"
            assert server["pid_file"] == str(state / f"serve-{port}.pid")
            assert server["log_file"] == str(state / f"serve-{port}.log")

            status = (await session.call_tool("status", {"port": port})).structured_content
            assert (status["status"], status["device"], status["pid"]) == ("ok", "cpu", server["pid"])

            chat = await session.call_tool("chat", {"prompt": "Hello", "port": port, "max_tokens": 8,
                                                    "system": "Be brief.", "temperature": 0})
            assert not chat.is_error, text(chat)
            answer = chat.structured_content
            assert answer["finish_reason"] in ("stop", "length") and isinstance(answer["content"], str)
            usage = answer["usage"]
            assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 1

            stopped = await session.call_tool("stop", {"port": port})
            assert not stopped.is_error, text(stopped)
            assert re.fullmatch(rf"qat4 stop: stopped pid {server['pid']} \(gracefully, in [\d.]+ s\)",
                                stopped.structured_content["message"])
            assert (await session.call_tool("status", {"port": port})).structured_content["status"] == "unreachable"
        assert stale_reason(server["pid"]) is not None
    finally:
        subprocess.run([sys.executable, "-m", "qat4.cli", "stop", "--port", str(port), "--timeout", "5"],
                       capture_output=True, env={**os.environ, "QAT4_STATE_DIR": str(state)})


def test_without_the_mcp_package_it_says_how_to_install_it(monkeypatch, capsys):
    for name in ["mcp", *(name for name in sys.modules if name.startswith(("mcp.", "mcp_types")))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails as if it were not installed
    monkeypatch.delitem(sys.modules, "qat4.mcp_server", raising=False)
    assert main(["mcp"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'qat4[mcp]'" in err, err
