"""One generation at a time: a bounded wait queue, a worker thread, cancellation between tokens.

`Scheduler.submit(prompt_ids, params, decode)` queues a `Generation`, whose `events()` are text
deltas followed by one `Finished`. The engine runs in a single worker thread so the event loop
stays free to accept, reject (429) and serve other requests. Leaving `events()` early (a client
that went away) cancels the job: a waiting job never starts, a running one stops before its next
token.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from qat4.server.metrics import Metrics


class ShuttingDown(Exception):
    """The scheduler was closed; no new generation starts."""


class QueueFull(Exception):
    """Every waiting slot is taken; the client should retry after `retry_after` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"The server is busy; retry after {retry_after} s.")
        self.retry_after = retry_after


@dataclass(frozen=True)
class GenerationParams:
    """What the engine is asked for; None sampling options mean the checkpoint's defaults."""

    max_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Timings:
    """llama.cpp-style timings. prompt_ms runs from the start of the generation to the first token
    (prompt read, first token picked), predicted_ms from the first token to the last; the decode
    rate counts the tokens after the first over predicted_ms."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float

    def as_dict(self) -> dict[str, float]:
        decode_per_s = round(max(self.predicted_n - 1, 0) / self.predicted_ms * 1e3, 2) if self.predicted_ms > 0 else 0.0
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_n / self.prompt_ms * 1e3, 2) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": decode_per_s,
            "decode_ms": round(self.predicted_ms, 3),
            "decode_tok_per_s": decode_per_s,
        }


@dataclass
class Finished:
    """The end of a generation: why it stopped, token counts and timings."""

    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


class IncrementalDecoder:
    """Token ids in, text deltas out; holds back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are already emitted and no longer re-decoded
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):]


class StopStrings:
    """Cuts generated text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: Iterable[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.hit = False

    def feed(self, delta: str) -> str:
        if self.hit:
            return ""
        if not self._stops:
            return delta
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self._held = True, ""
            return text[:cut]
        keep = max((k for s in self._stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.hit else held


TokenSource = Callable[[list[int], GenerationParams, Callable[[], bool]], Iterator[int]]
"""(prompt ids, sampling, should_stop) -> generated token ids; runs in the worker thread."""


@dataclass
class _Job:
    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "waiting"  # waiting -> running | abandoned
    started_at: float = 0.0

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


_END = object()


class Scheduler:
    """Runs generations one at a time through `token_source`, with at most `max_queue` waiting."""

    def __init__(self, token_source: TokenSource, stop_token_ids: Iterable[int], max_queue: int, metrics: Metrics):
        self._token_source = token_source
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_queue, self.metrics = max_queue, metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qat4-generate")
        self._lock = threading.Lock()
        self._waiting = 0
        self._current: _Job | None = None  # the running job
        self._closed = False
        self._seconds_per_job = 1.0  # running average of job durations, for Retry-After

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(self._waiting)
        self.metrics.busy.set(0 if self._current is None else 1)

    def _reserve(self) -> None:
        with self._lock:
            if self._closed:
                raise ShuttingDown("The server is shutting down.")
            if (self._current is not None or self._waiting) and self._waiting >= self.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(max(1, math.ceil(self._seconds_per_job * (self._waiting + 1))))
            self._waiting += 1
            self._update_gauges()

    def _start(self, job: _Job) -> bool:
        """Make `job` the running one; False when its request left or the scheduler closed."""
        with self._lock:
            if job.state == "abandoned":
                return False
            self._waiting -= 1
            if self._closed:
                job.state = "abandoned"
                self._update_gauges()
                job.put(_END)
                return False
            job.state, job.started_at = "running", time.perf_counter()
            self._current = job
            self._update_gauges()
            return True

    def _abandon(self, job: _Job) -> None:
        job.cancel.set()
        with self._lock:
            if job.state == "waiting":
                job.state = "abandoned"
                self._waiting -= 1
                self._update_gauges()

    def _run(self, job: _Job) -> None:
        """Worker thread: feed token ids (or an exception) into the job's queue, then _END."""
        if not self._start(job):
            return
        try:
            for token_id in self._token_source(job.prompt_ids, job.params, job.cancel.is_set):
                job.put(token_id)
                if job.cancel.is_set():
                    break
        except Exception as exc:  # re-raised in the request that owns the job
            job.put(exc)
        finally:
            with self._lock:
                self._current = None
                self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (time.perf_counter() - job.started_at)
                self._update_gauges()
            job.put(_END)

    def submit(self, prompt_ids: list[int], params: GenerationParams, decode: Callable[[list[int]], str]) -> Generation:
        """Queue a generation (raises QueueFull when every waiting slot is taken)."""
        self._reserve()
        loop = asyncio.get_running_loop()
        job = _Job(list(prompt_ids), params, loop, asyncio.Queue())
        loop.run_in_executor(self._executor, self._run, job)
        return Generation(self, job, decode)

    def close(self) -> None:
        """Stop the running generation at its next token and end the waiting ones unstarted, so
        every open request finishes at once; new requests are refused (ShuttingDown)."""
        with self._lock:
            self._closed = True
            if self._current is not None:
                self._current.cancel.set()
        self._executor.shutdown(wait=False)


class Generation:
    """One queued or running generation; iterate `events()` once, `cancel()` to drop it."""

    def __init__(self, scheduler: Scheduler, job: _Job, decode: Callable[[list[int]], str]):
        self._scheduler, self._job, self._decode = scheduler, job, decode
        self._arrived = time.perf_counter()

    def cancel(self) -> None:
        """Stop at once: a waiting job never starts, a running one stops before its next token."""
        self._scheduler._abandon(self._job)

    async def events(self) -> AsyncIterator[str | Finished]:
        """Text deltas, then one Finished. Leaving early (or being cancelled) cancels the job."""
        job, metrics = self._job, self._scheduler.metrics
        decoder, stops = IncrementalDecoder(self._decode), StopStrings(job.params.stop)
        n, first, by_token = 0, 0.0, False
        try:
            while (item := await job.out.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                if n == 0:
                    first = time.perf_counter()
                    metrics.ttft.observe(first - self._arrived)
                n += 1
                if item in self._scheduler.stop_token_ids:
                    by_token = True
                    break
                delta = stops.feed(decoder.push(item))
                if delta:
                    yield delta
                if stops.hit:
                    break
            tail = stops.feed(decoder.flush()) + stops.flush()
            if tail:
                yield tail
        finally:
            self.cancel()
        end = time.perf_counter()
        reason = "stop" if by_token or stops.hit or n < job.params.max_tokens else "length"
        metrics.prompt_tokens.inc(amount=len(job.prompt_ids))
        metrics.generated_tokens.inc(amount=n)
        metrics.generations.inc(reason)
        prompt_ms = ((first if n else end) - (job.started_at or self._arrived)) * 1e3
        timings = Timings(len(job.prompt_ids), prompt_ms, n, (end - first) * 1e3 if n else 0.0)
        yield Finished(reason, len(job.prompt_ids), n, timings)


def engine_token_source(engine: Any) -> TokenSource:
    """Generated token ids from `engine.stream`, which checks `should_stop` between tokens."""

    def tokens(prompt_ids: list[int], params: GenerationParams, should_stop: Callable[[], bool]) -> Iterator[int]:
        return engine.stream(prompt_ids, max_new_tokens=params.max_tokens, temperature=params.temperature,
                             top_k=params.top_k, top_p=params.top_p, seed=params.seed, should_stop=should_stop)

    return tokens
