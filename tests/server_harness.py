"""Shared pieces of the server tests: the tiny synthetic model, a scripted engine, a live server.

`ScriptedEngine` has the surface the server uses from `qat4.engine.Engine` and replays a given
reply text as the real tokenizer's ids, so tool calls, thinking and timing-sensitive behaviour
(batching, queueing, cancellation) can be checked exactly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import socket
import threading
import time
import types
from collections.abc import Callable, Iterator

import torch
import uvicorn

from qat4.checkpoint.synth import synthetic_model
from qat4.commands.model_args import synthetic_tokenizer
from qat4.config import PRESETS
from qat4.engine import Engine, SamplingParams, StepOutput
from qat4.engine.sequence import Sequence, State
from qat4.errors import Qat4Error
from qat4.serve_process import HOST, ServerProcess, free_port, serve_command
from qat4.tokenizer import Tokenizer

TINY_MAX_CTX = 512


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """The real Gemma 4 tokenizer and chat template that synthetic checkpoints carry."""
    return synthetic_tokenizer()


@functools.cache
def tiny_engine(**options) -> Engine:
    """The real engine on the tiny synthetic model (built in memory), on the CPU; ``options`` are
    EngineConfig fields."""
    return Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=TINY_MAX_CTX, tokenizer=tiny_tokenizer(),
                              **options)


class ScriptedEngine:
    """Replays `reply` (text with special tokens) as token ids, `delay` seconds per step.

    It has the surface the server uses from `qat4.engine.Engine` (tokenizer, config, stop_token_ids, max_ctx,
    device, encode, check_request, add_request, step, abort, has_work, scheduler.running/waiting,
    pool.usage, pool.cached_blocks) and batches like it: up to `max_num_seqs` sequences run, the rest wait. After the
    scripted ids a sequence keeps producing `filler` until max_new_tokens, unless the reply ended
    in a stop token. Every prompt that starts running is kept in `prompts`; `produced` counts the
    ids it produced; `error` (when set) is raised by add_request instead of queueing, `step_error`
    by every step (a device that broke).
    """

    def __init__(self, reply: str = "", *, delay: float = 0.0, max_ctx: int = 4096, max_num_seqs: int = 1):
        self.tokenizer = tiny_tokenizer()
        self.config = PRESETS["tiny"]
        self.stop_token_ids = self.config.eos_token_id
        self.max_ctx, self.max_num_seqs = max_ctx, max_num_seqs
        self.device = torch.device("cpu")
        self.reply, self.delay, self.error, self.step_error = reply, delay, None, None
        self.filler = self.tokenizer.encode(" more")[-1]
        self.prompts: list[list[int]] = []
        self.produced = 0
        self.scheduler = types.SimpleNamespace(running=[], waiting=collections.deque())
        self.pool = types.SimpleNamespace(usage=lambda: {"full_attention": 0.0}, cached_blocks=lambda: {"full_attention": 0})

    def encode(self, prompt: str | list[int]) -> list[int]:
        return Engine.encode(self, prompt)

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens + max_new_tokens > self.max_ctx:
            raise Qat4Error(f"{prompt_tokens} + {max_new_tokens} tokens are more than the context of {self.max_ctx}")

    def prompt_text(self, index: int = -1) -> str:
        """The text of a prompt the engine was given."""
        return self.tokenizer.decode(self.prompts[index])

    def add_request(self, prompt, max_new_tokens=256, temperature=None, top_k=None, top_p=None, seed=None,
                    stop_token_ids=None, constraint=None, logprobs=None) -> Sequence:
        if self.error is not None:
            raise self.error
        stops = frozenset(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        seq = Sequence(self.encode(prompt), SamplingParams(), 0, max_new_tokens, stops)
        self.scheduler.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        for queue in (self.scheduler.running, self.scheduler.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.state, seq.finish_reason = State.FINISHED, seq.finish_reason or "abort"

    @property
    def has_work(self) -> bool:  # a step that raised stays in flight, as the real engine's does
        return self.step_error is not None or bool(self.scheduler.running or self.scheduler.waiting)

    def drain(self) -> None:
        while self.has_work:
            self.step()

    def step(self) -> list[StepOutput]:
        if self.step_error is not None:
            raise self.step_error
        running, waiting = self.scheduler.running, self.scheduler.waiting
        while waiting and len(running) < self.max_num_seqs:
            seq = waiting.popleft()
            seq.state, seq.started = State.RUNNING, time.perf_counter()
            self.prompts.append(seq.prompt)
            running.append(seq)
        time.sleep(self.delay)
        script = self.tokenizer.encode(self.reply)
        outputs = []
        for seq in list(running):
            i = len(seq.output)
            token = script[i] if i < len(script) else self.filler
            seq.pending += 1
            self.produced += 1
            done = seq.accept(token, time.perf_counter())
            if done:
                self.abort(seq)
            outputs.append(StepOutput(seq, token, done))
        return outputs


class LiveServer:
    """A uvicorn server for `app` on a free loopback port, in a background thread. Idle
    connections stay open for the whole test (uvicorn closes them after 5 s): the tests' clients
    reuse them without retrying, and a close racing a reused connection's next request would fail
    a test that is not about keep-alive."""

    def __init__(self, app):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=900))
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


@contextlib.contextmanager
def tiny_serve_process() -> Iterator[str]:
    """A `qat4 serve synthetic:tiny` process on the CPU on a free loopback port; yields its URL."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    with ServerProcess(serve_command("synthetic:tiny", port, device="cpu", max_queue=8), url):
        yield url
