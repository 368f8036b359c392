"""Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms.

Hand-written so the server needs no client library. Every metric is process-wide and guarded by
one lock, since the worker thread and the event loop both update them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

LabelKey = tuple[str, ...]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: LabelKey, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str], lock: threading.Lock):
        self.name, self.help, self.label_names, self._lock = name, help_text, tuple(labels), lock

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count per label set."""

    kind = "counter"

    def __init__(self, *args):
        super().__init__(*args)
        self._values: dict[LabelKey, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self._header()
        for key, v in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {_number(v)}")
        if not self._values and not self.label_names:
            lines.append(f"{self.name} 0")
        return lines


class Gauge(_Metric):
    """A value that goes up and down, per label set."""

    kind = "gauge"

    def __init__(self, *args):
        super().__init__(*args)
        self._values: dict[LabelKey, float] = {} if self.label_names else {(): 0.0}

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = float(value)

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        return self._header() + [f"{self.name}{_labels(self.label_names, key)} {_number(v)}"
                                 for key, v in sorted(self._values.items())]


class Histogram(_Metric):
    """Cumulative buckets, sum and count of observed values (no labels)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float], lock: threading.Lock):
        super().__init__(name, help_text, (), lock)
        self.bounds = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._sum += value
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1
                    break

    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        lines, running = self._header(), 0
        for bound, n in zip(self.bounds, self._counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        lines.append(f"{self.name}_sum {_number(self._sum)}")
        lines.append(f"{self.name}_count {running}")
        return lines


class Metrics:
    """The server's metrics; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        lock = threading.Lock()
        self._lock = lock
        self.requests = Counter("qat4_requests_total", "HTTP requests by endpoint and status code.", ("endpoint", "status"), lock)
        self.prompt_tokens = Counter("qat4_prompt_tokens_total", "Prompt tokens read by finished generations.", (), lock)
        self.cache_hits = Counter("qat4_prompt_cache_hit_tokens_total", "Prompt tokens of finished generations whose KV came from the prompt cache.", (), lock)
        self.cache_misses = Counter("qat4_prompt_cache_miss_tokens_total", "Prompt tokens of finished generations read from scratch.", (), lock)
        self.generated_tokens = Counter("qat4_generated_tokens_total", "Tokens generated.", (), lock)
        self.drafted = Counter("qat4_spec_draft_tokens_total", "Draft tokens verified by speculative decoding, in finished generations.", (), lock)
        self.draft_accepted = Counter("qat4_spec_accepted_tokens_total", "Draft tokens the model agreed with and kept, in finished generations.", (), lock)
        self.generations = Counter("qat4_generations_total", "Generations by finish reason.", ("finish_reason",), lock)
        self.rejected = Counter("qat4_queue_rejections_total", "Requests answered 429 because the queue was full.", (), lock)
        self.latency = Histogram("qat4_request_duration_seconds", "HTTP request latency, to the last byte sent.", LATENCY_BUCKETS, lock)
        self.ttft = Histogram("qat4_time_to_first_token_seconds", "From a generation request's arrival (queue wait included) to its first token.", LATENCY_BUCKETS, lock)
        self.queue_time = Histogram("qat4_request_queue_seconds", "From a generation request's arrival to its first admission into the running batch (the first part of its time to first token).", LATENCY_BUCKETS, lock)
        self.prefill_time = Histogram("qat4_request_prefill_seconds", "From a generation's first admission into the running batch to its first token: its prompt's read, the step already in flight, any time preempted (the rest of its time to first token).", LATENCY_BUCKETS, lock)
        self.tpot = Histogram("qat4_time_per_output_token_seconds", "A finished generation's time from its first token to its end, per token after the first.", TOKEN_BUCKETS, lock)
        self.queue_depth = Gauge("qat4_queue_depth", "Generation requests waiting to join the running batch.", (), lock)
        self.running = Gauge("qat4_running_sequences", "Sequences in the running batch.", (), lock)
        self.busy = Gauge("qat4_engine_busy", "1 while the engine is generating.", (), lock)
        self.kv_usage = Gauge("qat4_kv_pool_usage", "Share of the KV pool's blocks in use, by layer type.", ("layer_type",), lock)
        self.cached_blocks = Gauge("qat4_prompt_cache_blocks", "KV blocks the prompt cache keeps that no running sequence holds, by layer type.", ("layer_type",), lock)
        self.batch_size = Histogram("qat4_batch_size", "Sequences in the running batch, once per engine step.", BATCH_BUCKETS, lock)

    def render(self) -> str:
        with self._lock:  # every metric defined above, in that order
            lines = [line for m in vars(self).values() if isinstance(m, _Metric) for line in m.render()]
        return "\n".join(lines) + "\n"
