"""Shared pieces of the server tests: the tiny synthetic model, a scripted engine, a live server.

`ScriptedEngine` has the surface the server uses from `qat4.engine.Engine` (tokenizer, config,
max_ctx, encode, stream) and replays a given reply text as the real tokenizer's ids, so tool calls,
thinking and timing-sensitive behaviour (queueing, cancellation) can be checked exactly.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn

from qat4.checkpoint.synth import synthetic_model
from qat4.commands.model_args import synthetic_tokenizer
from qat4.config import PRESETS
from qat4.engine import DEFAULT_STOP_IDS, Engine
from qat4.tokenizer import Tokenizer

TINY_MAX_CTX = 512


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """The real Gemma 4 tokenizer and chat template that synthetic checkpoints carry."""
    return synthetic_tokenizer()


@functools.cache
def tiny_engine() -> Engine:
    """The real engine on the tiny synthetic model (built in memory), on the CPU."""
    return Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=TINY_MAX_CTX, tokenizer=tiny_tokenizer())


class ScriptedEngine:
    """Replays `reply` (text with special tokens) as token ids, `delay` seconds per token.

    After the scripted ids it keeps producing `filler` until max_new_tokens, unless the reply
    ended in a stop token. Every prompt it is asked to continue is kept in `prompts`; `produced`
    counts the ids it yielded, `error` (when set) is raised instead of generating.
    """

    def __init__(self, reply: str = "", *, delay: float = 0.0, max_ctx: int = 4096):
        self.tokenizer = tiny_tokenizer()
        self.config = PRESETS["tiny"]
        self.max_ctx = max_ctx
        self.reply, self.delay, self.error = reply, delay, None
        self.filler = self.tokenizer.encode(" more")[-1]
        self.prompts: list[list[int]] = []
        self.produced = 0

    def encode(self, prompt: str | list[int]) -> list[int]:
        return Engine.encode(self, prompt)

    def prompt_text(self, index: int = -1) -> str:
        """The text of a prompt the engine was given."""
        return self.tokenizer.decode(self.prompts[index])

    def stream(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_token_ids: list[int] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        ids = self.encode(prompt)
        self.prompts.append(ids)
        if self.error is not None:
            raise self.error
        script = self.tokenizer.encode(self.reply)
        for i in range(max_new_tokens):
            token = script[i] if i < len(script) else self.filler
            time.sleep(self.delay)
            self.produced += 1
            yield token
            if token in DEFAULT_STOP_IDS or (should_stop is not None and should_stop()):
                return


class LiveServer:
    """A uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
