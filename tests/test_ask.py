"""`qat4 ask` as a subprocess against a live server over a scripted engine."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys

import pytest
from server_harness import LiveServer, ScriptedEngine

from qat4.cli import main
from qat4.server.app import create_app

REPLY = "<|channel>thought\nThree commits, one theme.<channel|>The parser got faster.<turn|>"
TIMING_LINE = re.compile(r"^\[\d+ tokens, [\d.]+ tok/s, [\d.]+ s\]$", re.M)


@pytest.fixture(scope="module")
def server():
    engine = ScriptedEngine(REPLY)
    with LiveServer(create_app(engine)) as live:
        live.engine = engine
        yield live


def ask_subprocess(url: str, *args: str, stdin: str) -> subprocess.CompletedProcess:
    """`qat4 ask ARGS` as its own process, with QAT4_URL=url."""
    env = {**{k: v for k, v in os.environ.items() if k != "QAT4_API_KEY"}, "QAT4_URL": url}
    return subprocess.run([sys.executable, "-m", "qat4.cli", "ask", *args], input=stdin, text=True,
                          capture_output=True, env=env, timeout=120)


class Terminal(io.StringIO):
    """Typed lines on a terminal (stdin that is a tty)."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def ask(monkeypatch, capsys):
    """Run `qat4 ask` in this process: ask(url, *args, stdin=text or Terminal) -> (status, stdout, stderr)."""
    def run(url: str, *args: str, stdin: io.StringIO | str = "", api_key: str | None = None) -> tuple[int, str, str]:
        monkeypatch.setenv("QAT4_URL", url)
        if api_key:
            monkeypatch.setenv("QAT4_API_KEY", api_key)
        else:
            monkeypatch.delenv("QAT4_API_KEY", raising=False)
        monkeypatch.setattr(sys, "stdin", stdin if isinstance(stdin, io.StringIO) else io.StringIO(stdin))
        status = main(["ask", *args])
        out, err = capsys.readouterr()
        return status, out, err
    return run


def test_material_on_stdin_and_words(server):
    done = ask_subprocess(server.url, "summarize", "this", stdin="commit 1: parser\ncommit 2: parser again\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The parser got faster.\n"
    assert TIMING_LINE.search(done.stderr) and "Three commits" not in done.stderr
    prompt = server.engine.prompt_text()
    assert "<|turn>user\nsummarize this\n\ncommit 1: parser\ncommit 2: parser again<turn|>" in prompt
    assert "<|think|>" not in prompt


def test_thinking_and_quiet(server, ask):
    status, out, err = ask(server.url, "-T", "-q", "why?")
    assert status == 0, err
    assert out == "The parser got faster.\n"
    assert "Three commits, one theme." in err and not TIMING_LINE.search(err)
    assert "<|think|>" in server.engine.prompt_text()


def test_url_flag_and_connection_refused(server, ask):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    status, out, err = ask(closed, "hello")
    assert status == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"qat4 ask: cannot connect to {closed}")
    status, out, err = ask(closed, "--url", server.url, "-q", "hello")
    assert status == 0 and out == "The parser got faster.\n"


def test_nothing_to_ask(server, ask):
    status, out, err = ask(server.url)
    assert status == 1 and "nothing to ask" in err


def test_server_error_is_one_line(ask):
    with LiveServer(create_app(ScriptedEngine(REPLY), api_key="k")) as live:
        status, out, err = ask(live.url, "hello")
        assert status == 1 and "401" in err and err.count("\n") == 1
        status, out, err = ask(live.url, "-q", "hello", api_key="k")
        assert status == 0 and out == "The parser got faster.\n"


def test_interactive_chat_keeps_history(server, ask):
    status, out, err = ask(server.url, "-q", stdin=Terminal("first question\nsecond question\n!\nfresh start\n"))
    assert status == 0, err
    assert out.count("The parser got faster.") == 3 and "conversation cleared" in err
    second, fresh = server.engine.prompt_text(-2), server.engine.prompt_text(-1)
    assert "first question" in second and "The parser got faster." in second and "second question" in second
    assert "first question" not in fresh and "fresh start" in fresh
