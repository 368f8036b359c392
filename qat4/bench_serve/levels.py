"""The run of `qat4 bench serve` by concurrency levels: the warm-up, each level's requests, and the
figures of each level with the run's parameters (what `--json` writes)."""

from __future__ import annotations

import asyncio
import datetime
import random
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qat4 import __version__
from qat4.bench_serve.driver import RequestResult, run_level, warm_up
from qat4.bench_serve.stats import summarize_ms
from qat4.bench_serve.workload import Workload, default_requests


@dataclass
class LevelReport:
    """Every figure of one concurrency level (durations in ms; None where no request completed)."""

    concurrency: int
    requests: int
    completed: int
    failed: int
    first_error: str | None
    short_replies: int  # completed requests that returned fewer tokens than asked for
    duration_s: float
    input_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    request_per_s: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_latency_ms: dict[str, float | None]


def level_report(concurrency: int, results: Sequence[RequestResult], duration_s: float, output_len: int) -> LevelReport:
    """The figures of a level from its requests' results and wall time."""
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return LevelReport(
        concurrency=concurrency, requests=len(results), completed=len(done), failed=len(errors),
        first_error=errors[0] if errors else None,
        short_replies=sum(r.output_tokens < output_len for r in done), duration_s=duration_s,
        input_tokens=input_tokens, output_tokens=output_tokens, output_tok_s=output_tokens * per_s,
        total_tok_s=(input_tokens + output_tokens) * per_s, request_per_s=len(done) * per_s,
        ttft_ms=summarize_ms([r.ttft_s for r in done]),
        tpot_ms=summarize_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=summarize_ms([gap for r in done for gap in r.chunk_gaps_s]),
        e2e_latency_ms=summarize_ms([r.latency_s for r in done]),
    )


@dataclass
class ServeBenchReport:
    """The parameters of a run and its levels, as `--json` writes them."""

    model: str | None
    url: str
    endpoint: str
    server: str  # "qat4 serve, started by the benchmark" or "external"
    input_len: int
    output_len: int
    requests_per_level: int | None  # None: default_requests(concurrency)
    temperature: float
    seed: int
    date: str
    qat4_version: str
    qat4_commit: str | None
    server_command: list[str] = field(default_factory=list)  # the qat4 serve command line, when the benchmark started it
    levels: list[LevelReport] = field(default_factory=list)
    compare: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # reference output tok/s by concurrency

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _git(*args: str) -> str | None:
    """The output of a git command run in qat4's package folder; None when it fails."""
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def qat4_commit() -> str | None:
    """`git describe --always --dirty` of the checkout qat4 runs from; None for an installed copy
    (even one that sits inside some other git repository)."""
    if _git("ls-files", "--error-unmatch", Path(__file__).name) is None:
        return None
    return _git("describe", "--always", "--dirty", "--abbrev=12")


def new_report(workload: Workload, *, server: str, requests_per_level: int | None, seed: int,
               server_command: Sequence[str] = (), compare: dict[str, list[tuple[int, float]]] | None = None) -> ServeBenchReport:
    """A report with the run's parameters, the date and the qat4 commit, and no levels yet."""
    return ServeBenchReport(
        model=workload.model, url=workload.url, endpoint=workload.endpoint, server=server,
        input_len=workload.input_len, output_len=workload.output_len, requests_per_level=requests_per_level,
        temperature=workload.temperature, seed=seed,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        qat4_version=__version__, qat4_commit=qat4_commit(), server_command=list(server_command), compare=dict(compare or {}),
    )


def run(workload: Workload, concurrencies: Sequence[int], report: ServeBenchReport, *,
        on_result: Callable[[int, int, int, RequestResult], None] | None = None,
        warn: Callable[[str], None] = print) -> ServeBenchReport:
    """The warm-up, then one level per concurrency, each appended to `report` (whose seed and
    requests_per_level it follows). `on_result(concurrency, done, total, result)` follows the
    requests; `warn` receives a failed warm-up and levels with short replies."""

    async def levels() -> None:
        rng = random.Random(report.seed)
        warm = await warm_up(workload, workload.prompts(1, rng)[0])
        if not warm.ok:
            warn(f"the warm-up request failed ({warm.error}); carrying on")
        for concurrency in concurrencies:
            count = report.requests_per_level or default_requests(concurrency)
            done = 0

            def counted(result: RequestResult) -> None:
                nonlocal done
                done += 1
                if on_result is not None:
                    on_result(concurrency, done, count, result)

            results, seconds = await run_level(workload, workload.prompts(count, rng), concurrency, counted)
            level = level_report(concurrency, results, seconds, workload.output_len)
            if level.short_replies:
                warn(f"{level.short_replies} of {level.completed} replies at concurrency {concurrency} had fewer "
                     f"than {workload.output_len} tokens; does the server honour ignore_eos?")
            report.levels.append(level)

    asyncio.run(levels())
    return report

