"""What the requests of `qat4 bench serve` ask for: the endpoint, random prompts of an exact length,
and the streamed body that asks for exactly `output_len` new tokens."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Prompt token ids are drawn from here: ordinary tokens in Gemma's vocabulary, and valid ids in any
# vocabulary of 32,000 entries or more (llama-server and vLLM may serve other models).
PROMPT_IDS = range(1_000, 32_000)
# Chat prompts: common English words, about one token each.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city name team minute idea kid body back parent face others level office door health person art").split()

Prompt = list[int] | str | list[dict[str, str]]  # token ids or text (one user message), or chat messages


def default_requests(concurrency: int) -> int:
    """Requests per level unless given: four per client, so every client sends four in turn and the
    level runs at full concurrency for most of its time, and at least 16, so percentiles have samples."""
    return max(4 * concurrency, 16)


DEFAULT_BURSTINESS = 1.0  # gamma-distributed gaps of shape 1: a Poisson process's arrivals
MAX_DEFAULT_RATE_REQUESTS = 1000  # as vllm bench serve's default --num-prompts


def default_rate_requests(rate: float, max_concurrency: int | None) -> int:
    """Requests per request-rate level unless given: eight seconds of arrivals at a finite rate (at
    least 16, at most MAX_DEFAULT_RATE_REQUESTS), so the level runs at that rate for most of its
    time; all at once (an infinite rate), four per place when in-flight requests are limited (at
    least 16), else 64."""
    if math.isinf(rate):
        return default_requests(max_concurrency) if max_concurrency else 64
    return max(16, math.ceil(8 * min(rate, MAX_DEFAULT_RATE_REQUESTS / 8)))


def level_requests(requests_per_level: int | None, concurrency: int | None, rate: float | None) -> int:
    """The requests a level sends: ``requests_per_level`` when given, else the default of a level of
    ``concurrency`` clients (no ``rate``), or of a request rate at most ``concurrency`` in flight."""
    if requests_per_level:
        return requests_per_level
    return default_requests(concurrency) if rate is None else default_rate_requests(rate, concurrency)


@dataclass(frozen=True)
class Workload:
    """Where the requests go and what each one asks for."""

    url: str
    endpoint: str  # a key of ENDPOINTS
    model: str | None  # the "model" field sent; None leaves it out
    input_len: int
    output_len: int
    temperature: float = 0.0
    api_key: str | None = None

    def prompts(self, count: int, rng: random.Random) -> list[Prompt]:
        """`count` random prompts: `input_len` token ids, or `input_len` words for chat."""
        if self.endpoint == "chat":
            return [" ".join(rng.choices(WORDS, k=self.input_len)) for _ in range(count)]
        return [rng.choices(PROMPT_IDS, k=self.input_len) for _ in range(count)]

    def body(self, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        """The JSON body of one streamed request for exactly `max_tokens` new tokens."""
        body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "chat":
            body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

