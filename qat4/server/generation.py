"""Many generations at once: the engine's step loop in one thread, each request fed its own tokens.

`EngineLoop.submit(prompt_ids, params, detokenizer)` queues a `Generation`, whose `events()` are text
deltas (with the logprobs of their tokens, when asked for) followed by one `Finished`. One engine
thread adds requests to the engine's batch and runs its steps while any sequence waits or runs, so
the event loop stays free to accept, reject (429, only when the waiting queue is full) and serve
other requests. Leaving `events()` early (a client that went away) aborts the request's sequence
before the next step, which gives its KV back. `EngineLoop.call(work)` runs other engine work
(scoring a prompt) on the same thread between steps, never beside one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from qat4.engine.engine import PoolBusy
from qat4.engine.logprobs import TokenLogprobs
from qat4.server.metrics import Metrics

log = logging.getLogger("qat4.server")


class ShuttingDown(Exception):
    """The engine loop was closed; no new generation starts."""


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
    ignore_eos: bool = False  # generate through end-of-turn tokens, up to max_tokens
    constraint: Any = None  # the engine's TokenConstraint: a grammar the reply follows
    logprobs: int | None = None  # each token's logprob and this many most likely tokens; None: no logprobs


@dataclass
class Timings:
    """llama.cpp-style timings. prompt_n counts the prompt tokens read, cache_n those whose KV came
    from the prompt cache; prompt_ms runs from the start of the generation to the first token
    (prompt read, first token picked), predicted_ms from the first token to the last; the decode
    rate counts the tokens after the first over predicted_ms, and is None with fewer than two.
    draft_n counts the draft tokens speculative decoding verified, draft_n_accepted those kept."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0

    def as_dict(self) -> dict[str, float | None]:
        steps = self.predicted_n - 1  # a rate needs two decode steps: the first was enqueued before token 1 came back
        decode_per_s = round(steps / self.predicted_ms * 1e3, 2) if steps >= 2 and self.predicted_ms > 0 else None
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_n / self.prompt_ms * 1e3, 2) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": decode_per_s,
            "decode_ms": round(self.predicted_ms, 3),
            "decode_tok_per_s": decode_per_s,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
        }


@dataclass(frozen=True)
class Delta:
    """Text a reply grew by, and the logprobs of the tokens read since the last delta (when asked
    for): a token whose text is held back (part of a character, or maybe of a stop string) goes
    with the delta that shows it."""

    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class Finished:
    """The end of a generation: why it stopped, token counts and timings."""

    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


class Detokenizer:
    """A tokenizer's decode (``decode(ids)``, special tokens kept) and, found once per token and
    kept, each token's *free* text: what it adds after any text whose characters are complete,
    wherever it stands. A token's text is free when decoding it alone gives whole characters and
    decoding it twice gives them twice (so no decoder step depends on its position, such as a
    leading space stripped at the start); byte pieces of longer characters are not. For the event
    loop's thread: a streamed token then costs a lookup instead of two decodes."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self._free: dict[int, str | None] = {}

    def free(self, token_id: int) -> str | None:
        try:
            return self._free[token_id]
        except KeyError:
            one = self.decode([token_id])
            text = one if one and "\ufffd" not in one and self.decode([token_id, token_id]) == one + one else None
            self._free[token_id] = text
            return text


class IncrementalDecoder:
    """Token ids in, text deltas out; holds back an incomplete UTF-8 sequence until it completes.

    Each push decodes the ids from the start of the last emitted delta on (whose context keeps a
    decoder's position-dependent steps out of the new one) and emits what they add. With
    ``free`` (:meth:`Detokenizer.free`) a token whose text is free, pushed after complete text, is
    emitted without decoding: the delta the window would give."""

    def __init__(self, decode: Callable[[list[int]], str], free: Callable[[int], str | None] | None = None):
        self._decode, self._free = decode, free
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are already emitted and no longer re-decoded
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        if self._free is not None and self._ids and self._read == len(self._ids):
            text = self._free(token_id)
            if text is not None:
                self._ids.append(token_id)
                self._prefix, self._read = self._read, len(self._ids)
                return text
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


@dataclass
class _Job:
    """A request as the engine thread and the event loop share it."""

    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrived: float = 0.0  # handed to the engine loop (perf_counter), before the engine thread can see it
    seq: Any = None  # the engine's sequence, once the engine thread has added it
    started_at: float = 0.0  # admitted to the running batch the first time
    gone: bool = False  # the request left: abort at the next chance

    def put(self, item: Any) -> None:
        _hand_over(self.loop, [(self, item)])


_END = object()
Result = TypeVar("Result")


@dataclass
class _Call:
    """Engine work that a request waits for (EngineLoop.call)."""

    work: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the event loop: a call's outcome, unless its request has stopped waiting."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _deliver(items: list[tuple[_Job, Any]]) -> None:
    """On the event loop: hand each job its item (a StepOutput, an exception or the end marker)."""
    for job, item in items:
        job.out.put_nowait(item)


def _on_loop(loop: asyncio.AbstractEventLoop, function: Callable[..., None], *args: Any) -> None:
    """From the engine thread: ``function(*args)`` on the event loop; nothing when it has closed
    (the requests are gone with it)."""
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:
        pass


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[_Job, Any]]) -> None:
    """From the engine thread: deliver items on the event loop."""
    _on_loop(loop, _deliver, items)


def _hand_over_call(call: _Call, result: Any, error: BaseException | None) -> None:
    """From the engine thread: a call's outcome to the request waiting for it."""
    _on_loop(call.loop, _settle, call.future, result, error)


class EngineLoop:
    """The engine's step loop in one thread; requests join and leave it between steps.

    `submit` hands a request to the loop (raising QueueFull when `max_waiting` already wait to
    be admitted); the loop thread adds it to the engine, steps while any sequence waits or runs,
    and puts each sequence's tokens on its request's queue. Engine methods run in that thread
    only; the event loop talks to it through an inbox.
    """

    def __init__(self, engine: Any, stop_token_ids: Iterable[int], max_waiting: int, metrics: Metrics):
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self.stop_token_ids = frozenset(stop_token_ids)
        self._cond = threading.Condition()
        self._inbox: list[_Job] = []
        self._calls: list[_Call] = []
        self._jobs: dict[int, _Job] = {}  # sequence id -> job, for sequences in the engine
        self._closed = False
        self.failure: Exception | None = None  # what stopped the engine thread, if anything did
        self._seconds_per_request = 1.0  # running average of request durations, for Retry-After
        self._thread = threading.Thread(target=self._run, name="qat4-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side -----------------------------------------------------------------

    def waiting(self) -> int:
        """Requests that the running batch has no room for yet (those it can take at the next
        step are not waiting)."""
        scheduler = self.engine.scheduler
        room = max(0, self.engine.max_num_seqs - len(scheduler.running))
        return max(0, len(self._inbox) + len(scheduler.waiting) - room)

    def _check_open(self) -> None:
        """Raise ShuttingDown once the loop is closed (call with the lock held)."""
        if self._closed:
            raise ShuttingDown("The server is shutting down." if self.failure is None else
                               f"The engine stopped after an error ({self.failure}); restart the server.")

    def submit(self, prompt_ids: list[int], params: GenerationParams, detokenizer: Detokenizer) -> Generation:
        """Queue a generation, its text decoded by ``detokenizer`` (raises QueueFull when every waiting
        place is taken). ``prompt_ids``
        is kept, not copied (Engine.encode's list, which add_request takes without a second check):
        the caller must not change it."""
        with self._cond:
            self._check_open()
            scheduler = self.engine.scheduler
            room = max(0, self.engine.max_num_seqs - len(scheduler.running))
            ahead = len(self._inbox) + len(scheduler.waiting)
            if ahead + 1 - room > self.max_waiting:  # this one would wait, and the waiting places are taken
                self.metrics.rejected.inc()
                waiting = max(0, ahead - room)
                raise QueueFull(max(1, math.ceil(self._seconds_per_request * (waiting + 1) / max(1, len(scheduler.running)))))
            job = _Job(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
            self._inbox.append(job)
            self._cond.notify()
        return Generation(self, job, detokenizer)

    async def call(self, work: Callable[[Any], Result]) -> Result:
        """``work(engine)``, run on the engine thread between two steps; raises what it raises. Work
        that finds the KV pool busy (PoolBusy) runs again after the next step while sequences run."""
        loop = asyncio.get_running_loop()
        call = _Call(work, loop, loop.create_future())
        with self._cond:
            self._check_open()
            self._calls.append(call)
            self._cond.notify()
        return await call.future

    def cancel(self, job: _Job) -> None:
        """The request left: its sequence is aborted before the next step."""
        with self._cond:
            job.gone = True
            self._cond.notify()

    def close(self) -> None:
        """End every request at once (open answers finish); new requests are refused (ShuttingDown)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread. An error it cannot pin on one request ends it: every open and later
        request gets that error instead of waiting forever, and /health says so."""
        try:
            while self._run_once():
                pass
        except Exception as exc:
            log.exception("the engine loop stopped")
            with self._cond:
                self.failure, self._closed = exc, True
                stranded, self._inbox = self._inbox + list(self._jobs.values()), []
                calls, self._calls = self._calls, []
                self._jobs.clear()
            for job in stranded:
                job.put(exc)
                job.put(_END)
            for call in calls:
                _hand_over_call(call, None, exc)

    def _run_once(self) -> bool:
        """Take in new requests and cancellations, then run a step; False once closed and drained."""
        engine = self.engine
        with self._cond:
            while not (self._inbox or self._calls or self._closed or engine.has_work):
                self._cond.wait()
            arrived, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
            closed = self._closed
        for job in arrived:
            self._add(job)
        self._run_calls(calls, closed)
        for job in list(self._jobs.values()):
            if job.gone or closed:
                self._end(job, abort=True)
        if closed and not self._jobs:
            engine.drain()
            return False
        if engine.has_work:
            self._step()
        return True

    def _run_calls(self, calls: list[_Call], closed: bool) -> None:
        """Run the calls that arrived; those that find the pool busy wait for the next step."""
        busy = []
        for call in calls:
            if call.future.done():  # its request stopped waiting
                continue
            if closed:
                _hand_over_call(call, None, ShuttingDown("The server is shutting down."))
                continue
            try:
                _hand_over_call(call, call.work(self.engine), None)
            except PoolBusy as exc:
                if self.engine.has_work:
                    busy.append(call)
                else:
                    _hand_over_call(call, None, exc)
            except Exception as exc:  # re-raised in the request that waits for it
                _hand_over_call(call, None, exc)
        if busy:
            with self._cond:
                self._calls[:0] = busy

    def _add(self, job: _Job) -> None:
        if job.gone or self._closed or job.params.max_tokens == 0:  # nothing to generate
            job.put(_END)
            return
        p = job.params
        try:
            job.seq = self.engine.add_request(job.prompt_ids, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed,
                                              [] if p.ignore_eos else list(self.stop_token_ids), p.constraint,
                                              logprobs=p.logprobs)
        except Exception as exc:  # re-raised in the request that owns the job
            job.put(exc)
            job.put(_END)
            return
        self._jobs[job.seq.id] = job

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # the step failed: every request in the engine gets the error
            log.exception("engine step failed")
            for job in list(self._jobs.values()):
                job.put(exc)
                self._end(job, abort=True)
            self.engine.drain()
            return
        self._observe()
        delivered = []
        for out in outputs:
            job = self._jobs.get(out.seq.id)
            if job is None:
                continue
            job.started_at = out.seq.started
            delivered.append((job, out))
            if out.finished:
                self._end(job, deliver=delivered)
        if delivered:  # one wake-up of the event loop per step, not per token
            _hand_over(delivered[0][0].loop, delivered)

    def _end(self, job: _Job, abort: bool = False, deliver: list | None = None) -> None:
        """Drop a finished or aborted job; its end marker goes out with ``deliver`` when given."""
        if abort:
            self.engine.abort(job.seq)
        del self._jobs[job.seq.id]
        self._seconds_per_request = 0.8 * self._seconds_per_request + 0.2 * (time.perf_counter() - job.seq.arrived)
        if deliver is None:
            job.put(_END)
        else:
            deliver.append((job, _END))

    def _observe(self) -> None:
        """Gauges after a step: running and waiting sequences, KV pool use."""
        scheduler, m = self.engine.scheduler, self.metrics
        m.running.set(len(scheduler.running))
        m.queue_depth.set(self.waiting())
        m.busy.set(1 if scheduler.running else 0)
        for kind, share in self.engine.pool.usage().items():
            m.kv_usage.set(share, kind)
        for kind, blocks in self.engine.pool.cached_blocks().items():
            m.cached_blocks.set(blocks, kind)
        m.batch_size.observe(len(scheduler.running))


class Generation:
    """One queued or running generation; iterate `events()` once, `cancel()` to drop it."""

    def __init__(self, loop: EngineLoop, job: _Job, detokenizer: Detokenizer):
        self._loop, self._job, self._detokenizer = loop, job, detokenizer

    def cancel(self) -> None:
        """Stop at once: a waiting request never starts, a running one leaves before the next step."""
        self._loop.cancel(self._job)

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """Text deltas, then one Finished. Leaving early (or being cancelled) cancels the job."""
        job, metrics = self._job, self._loop.metrics
        stop_ids = frozenset() if job.params.ignore_eos else self._loop.stop_token_ids
        decoder = IncrementalDecoder(self._detokenizer.decode, self._detokenizer.free)
        stops = StopStrings(job.params.stop)
        n, first, by_token, scored = 0, 0.0, False, []
        try:
            while (item := await job.out.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                if n == 0:
                    first = time.perf_counter()
                    metrics.ttft.observe(first - job.arrived)
                    if job.started_at:  # the admission time, handed over with the token (engines that keep one)
                        metrics.queue_time.observe(job.started_at - job.arrived)
                        metrics.prefill_time.observe(first - job.started_at)
                n += 1
                if item.token in stop_ids:
                    by_token = True
                    break
                if item.logprobs is not None:
                    scored.append(item.logprobs)
                delta = stops.feed(decoder.push(item.token))
                if delta:
                    yield Delta(delta, tuple(scored))
                    scored = []
                if stops.hit:
                    break
            tail = stops.feed(decoder.flush()) + stops.flush()
            if tail or scored:
                yield Delta(tail, tuple(scored))
        finally:
            self.cancel()
            seq = job.seq
            cached, drafted, accepted = (seq.cached_tokens, seq.drafted, seq.accepted) if seq is not None else (0, 0, 0)
            metrics.prompt_tokens.inc(amount=len(job.prompt_ids))
            metrics.drafted.inc(amount=drafted)
            metrics.draft_accepted.inc(amount=accepted)
            metrics.cache_hits.inc(amount=cached)
            metrics.cache_misses.inc(amount=len(job.prompt_ids) - cached)
            metrics.generated_tokens.inc(amount=n)
        end = time.perf_counter()
        reason = "stop" if by_token or stops.hit or n < job.params.max_tokens else "length"
        metrics.generations.inc(reason)
        if n >= 2:
            metrics.tpot.observe((end - first) / (n - 1))
        prompt_ms = ((first if n else end) - (job.started_at or job.arrived)) * 1e3
        timings = Timings(len(job.prompt_ids) - cached, prompt_ms, n, (end - first) * 1e3 if n else 0.0, cached,
                          drafted, accepted)
        yield Finished(reason, len(job.prompt_ids), n, timings)
