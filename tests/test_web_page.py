"""The chat page at / in real headless Chromium, driven over the DevTools protocol.

Chromium talks DevTools over a pipe (`--remote-debugging-pipe`: it reads commands on fd 3 and
writes replies on fd 4, each a JSON message ended by a NUL byte), so no extra package is needed.
The page is served by a live server over a scripted engine that streams a known reply slowly.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any

import pytest
from server_harness import LiveServer, ScriptedEngine, wait_until

from qat4.server.app import create_app

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--remote-debugging-pipe")
REASONING = "The user wants a greeting; keep it short."
ANSWER = "Hello from qat4! Streaming one token at a time, straight from the packed weights."


class DevTools:
    """A minimal DevTools-protocol client over Chromium's debugging pipe."""

    def __init__(self, binary: str, profile: str):
        commands_r, self._commands = os.pipe()
        self._replies, replies_w = os.pipe()

        def wire_fds() -> None:  # in the child: commands on fd 3, replies on fd 4
            high_r = fcntl.fcntl(commands_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(replies_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"], close_fds=False,
                                     preexec_fn=wire_fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_r)
        os.close(replies_w)
        self._next_id = 0
        self._results: dict[int, dict[str, Any]] = {}
        self.exceptions: list[dict[str, Any]] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._replies, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                with self._ready:
                    if "id" in message:
                        self._results[message["id"]] = message
                        self._ready.notify_all()
                    elif message.get("method") == "Runtime.exceptionThrown":
                        self.exceptions.append(message["params"])

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 20) -> dict[str, Any]:
        """Send one command and wait for its result."""
        self._next_id += 1
        command_id = self._next_id
        message = {"id": command_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        with self._ready:
            if not self._ready.wait_for(lambda: command_id in self._results, timeout):
                raise TimeoutError(f"no DevTools reply to {method}")
            reply = self._results.pop(command_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._commands)


@pytest.fixture
def browser(tmp_path):
    devtools = DevTools(CHROMIUM, str(tmp_path / "profile"))
    yield devtools
    devtools.close()


def test_chat_page_streams_an_answer(browser, tmp_path):
    engine = ScriptedEngine(f"<|channel>thought\n{REASONING}<channel|>{ANSWER}<turn|>", delay=0.03)
    with LiveServer(create_app(engine, model_name="scripted-gemma")) as server:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def js(expression: str) -> Any:
            result = browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
            return result["result"].get("value")

        browser.send("Runtime.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride",
                     {"width": 1000, "height": 700, "deviceScaleFactor": 1, "mobile": False}, session)
        browser.send("Page.navigate", {"url": server.url + "/"}, session)
        assert wait_until(lambda: (js("document.getElementById('model') && document.getElementById('model').textContent")
                                   or "").startswith("scripted-gemma"))

        js("document.getElementById('thinking').click(); document.getElementById('input').focus()")
        browser.send("Input.insertText", {"text": "Say hello"}, session)
        for kind in ("keyDown", "keyUp"):
            browser.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                    "windowsVirtualKeyCode": 13}, session)

        seen: list[str] = []
        read_state = ("(() => { const m = document.querySelector('.msg.assistant'); if (!m) return null;"
                      " return [m.querySelector('.content').textContent, m.querySelector('.stats').textContent]; })()")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = js(read_state)
            if state:
                seen.append(state[0])
                if state[1]:
                    break
            time.sleep(0.03)
        content, stats = js(read_state)

        assert content == ANSWER
        assert any(0 < len(text) < len(ANSWER) for text in seen), "the answer did not arrive piece by piece"
        assert re.fullmatch(r"\d+ tokens · [\d.]+ tok/s · prompt \d+ tokens in [\d.]+ s", stats), stats
        assert js("document.querySelector('.msg.user').textContent") == "Say hello"
        thinking = js("(() => { const d = document.querySelector('details.thinking');"
                      " return [d.hidden, d.open, d.querySelector('div').textContent]; })()")
        assert thinking == [False, False, REASONING]
        assert "<|think|>" in engine.prompt_text()
        assert browser.exceptions == []

        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session)["data"])
        assert shot.startswith(b"\x89PNG")
        (tmp_path / "chat-page.png").write_bytes(shot)
