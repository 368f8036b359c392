"""The requests of `qat4 bench serve` on the wire: one streamed request timed chunk by chunk (each
on a connection of its own, read by :func:`qat4.api_client.post_streamed`), a level's requests
through exactly `concurrency` clients (a closed loop) or sent at a request rate (an open loop), and
the uncounted warm-up."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qat4.api_client import StreamError, WireError, astream_events, error_message, post_streamed
from qat4.bench_serve.workload import ENDPOINTS, Prompt, Workload

WARMUP_MAX_TOKENS = 4


@dataclass
class RequestResult:
    """What one request measured; a failed one has `error` and no token figures."""

    latency_s: float
    ttft_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the reply's text (a chat reply's content)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a reply of one token."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def _has_text(event: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated text (a completion's text, a chat delta's content,
    reasoning or tool call); role-only and finish chunks do not."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def send_request(workload: Workload, prompt: Prompt, max_tokens: int) -> RequestResult:
    """Send one streamed request and time it. HTTP errors, error events and broken connections come
    back as a failed RequestResult naming the status and the server's message."""
    start = time.perf_counter()

    def failed(message: str) -> RequestResult:
        return RequestResult(latency_s=time.perf_counter() - start, error=message)

    first = last = None
    gaps: list[float] = []
    text: list[str] = []
    chunks, usage = 0, {}
    try:
        async with post_streamed(workload.url, ENDPOINTS[workload.endpoint], workload.body(prompt, max_tokens),
                                 workload.api_key) as reply:
            if reply.status != 200:
                return failed(f"HTTP {reply.status}: {error_message(await reply.body())}")
            async for event in astream_events(reply.lines()):
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if _has_text(event):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last, chunks = now, chunks + 1
    except StreamError as exc:
        return failed(str(exc))
    except (OSError, asyncio.IncompleteReadError, WireError) as exc:
        return failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if first is None:
        return failed("the reply ended without any text")
    return RequestResult(latency_s=time.perf_counter() - start, ttft_s=first - start,
                         input_tokens=int(usage.get("prompt_tokens") or workload.input_len),
                         output_tokens=int(usage.get("completion_tokens") or chunks), chunk_gaps_s=gaps,
                         text="".join(text), cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))


async def run_level(workload: Workload, prompts: Sequence[Prompt], concurrency: int,
                    on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send `prompts` through exactly `concurrency` clients; the results in prompt order, and the wall time."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue = iter(enumerate(prompts))  # shared by the clients: each takes the next prompt when free

    async def one_client() -> None:
        for i, prompt in queue:
            results[i] = await send_request(workload, prompt, workload.output_len)
            if on_result is not None:
                on_result(results[i])

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def arrival_gaps(count: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds from each request's send to the next one's, for `count` requests at `rate` a second on
    average: gamma-distributed with shape `burstiness` (1: a Poisson process's exponential gaps;
    below 1 burstier, above 1 more even), all 0 at an infinite rate (every request at once)."""
    if math.isinf(rate):
        return [0.0] * max(0, count - 1)
    return [rng.gammavariate(burstiness, 1.0) / (rate * burstiness) for _ in range(count - 1)]


async def run_rate_level(workload: Workload, prompts: Sequence[Prompt], gaps: Sequence[float],
                         max_concurrency: int | None, on_result: Callable[[RequestResult], None] | None = None,
                         ) -> tuple[list[RequestResult], float, int]:
    """Send `prompts` at the times `gaps` apart (:func:`arrival_gaps`) whether or not earlier replies
    have come, at most `max_concurrency` in flight (None: no limit; a request over it waits for a
    place, and its times start when it is sent). The results in prompt order, the wall time, and the
    most requests that were in flight at once."""
    results: list[RequestResult | None] = [None] * len(prompts)
    places = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0

    async def one(i: int, prompt: Prompt) -> None:
        nonlocal in_flight, peak
        if places is not None:
            await places.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            results[i] = await send_request(workload, prompt, workload.output_len)
        finally:
            in_flight -= 1
            if places is not None:
                places.release()
        if on_result is not None:
            on_result(results[i])

    start = time.perf_counter()
    due, sent = 0.0, []
    for i, prompt in enumerate(prompts):
        if i:
            due += gaps[i - 1]
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
        sent.append(asyncio.create_task(one(i, prompt)))
    await asyncio.gather(*sent)
    return results, time.perf_counter() - start, peak


async def warm_up(workload: Workload, prompt: Prompt) -> RequestResult:
    """One uncounted request of WARMUP_MAX_TOKENS, so first-use costs (compiling, caches) stay out of the figures."""
    return await send_request(workload, prompt, min(workload.output_len, WARMUP_MAX_TOKENS))
