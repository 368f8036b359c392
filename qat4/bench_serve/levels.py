"""The run of `qat4 bench serve` by levels, of concurrent clients or of request rates: the warm-up,
each level's requests, and the figures of each level with the run's parameters (what `--json`
writes)."""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qat4 import __version__
from qat4.bench_serve.driver import RequestResult, arrival_gaps, run_level, run_rate_level, warm_up
from qat4.bench_serve.stats import summarize_ms
from qat4.bench_serve.workload import Workload, level_requests


@dataclass
class LevelReport:
    """Every figure of one level (durations in ms; None where no request completed): a level of
    concurrent clients (a concurrency, no request_rate) or of a request rate (req/s, math.inf: all
    at once; no concurrency, the run's max_concurrency limits it)."""

    concurrency: int | None
    request_rate: float | None
    peak_in_flight: int  # the most requests that were in flight at once
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


def level_report(concurrency: int | None, results: Sequence[RequestResult], duration_s: float, output_len: int, *,
                 request_rate: float | None = None, peak_in_flight: int | None = None) -> LevelReport:
    """The figures of a level from its requests' results and wall time (a closed loop's peak in
    flight: its clients, or its requests where fewer)."""
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return LevelReport(
        concurrency=concurrency, request_rate=request_rate,
        peak_in_flight=min(concurrency or 0, len(results)) if peak_in_flight is None else peak_in_flight,
        requests=len(results), completed=len(done), failed=len(errors),
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
    requests_per_level: int | None  # None: each level's default, workload.level_requests
    burstiness: float | None  # the gamma shape of the gaps between a rate level's requests; None: levels of clients
    max_concurrency: int | None  # the most requests a rate level keeps in flight; None: no limit, or levels of clients
    temperature: float
    seed: int
    date: str
    qat4_version: str
    qat4_commit: str | None
    server_command: list[str] = field(default_factory=list)  # the qat4 serve command line, when the benchmark started it
    levels: list[LevelReport] = field(default_factory=list)
    compare: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # reference output tok/s by concurrency

    @property
    def by_rate(self) -> bool:
        """Whether the levels are request rates (an open loop) rather than numbers of clients."""
        return self.burstiness is not None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values: an infinite request rate is the string "inf"."""
        data = asdict(self)
        for level in data["levels"]:
            if level["request_rate"] is not None and math.isinf(level["request_rate"]):
                level["request_rate"] = "inf"
        return data


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
               server_command: Sequence[str] = (), compare: dict[str, list[tuple[int, float]]] | None = None,
               burstiness: float | None = None, max_concurrency: int | None = None) -> ServeBenchReport:
    """A report with the run's parameters, the date and the qat4 commit, and no levels yet; a run of
    request rates has a burstiness (and may have a max_concurrency), a run of clients neither."""
    return ServeBenchReport(
        model=workload.model, url=workload.url, endpoint=workload.endpoint, server=server,
        input_len=workload.input_len, output_len=workload.output_len, requests_per_level=requests_per_level,
        burstiness=burstiness, max_concurrency=max_concurrency, temperature=workload.temperature, seed=seed,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        qat4_version=__version__, qat4_commit=qat4_commit(), server_command=list(server_command), compare=dict(compare or {}),
    )


def run(workload: Workload, report: ServeBenchReport, *, concurrencies: Sequence[int] = (), rates: Sequence[float] = (),
        on_result: Callable[[str, int, int, RequestResult], None] | None = None,
        warn: Callable[[str], None] = print) -> ServeBenchReport:
    """The warm-up, then one level per concurrency (a closed loop of that many clients), or one per
    request rate (an open loop: requests sent at that rate on average, the gaps drawn with the
    report's burstiness, at most its max_concurrency in flight), each appended to `report` (whose
    seed and requests_per_level it follows). `on_result(level name, done, total, result)` follows
    the requests; `warn` receives a failed warm-up and levels with short replies."""
    if bool(concurrencies) == bool(rates):
        raise ValueError("a run has levels of concurrent clients or of request rates, one of the two")

    async def levels() -> None:
        rng = random.Random(report.seed)
        arrivals = random.Random(f"arrivals {report.seed}")  # its own: the prompts stay those of the seed
        warm = await warm_up(workload, workload.prompts(1, rng)[0])
        if not warm.ok:
            warn(f"the warm-up request failed ({warm.error}); carrying on")
        for concurrency, rate in [(c, None) for c in concurrencies] or [(report.max_concurrency, r) for r in rates]:
            name = level_name(concurrency, rate)
            count = level_requests(report.requests_per_level, concurrency, rate)
            done = 0

            def counted(result: RequestResult) -> None:
                nonlocal done
                done += 1
                if on_result is not None:
                    on_result(name, done, count, result)

            prompts = workload.prompts(count, rng)
            if rate is None:
                results, seconds = await run_level(workload, prompts, concurrency, counted)
                level = level_report(concurrency, results, seconds, workload.output_len)
            else:
                gaps = arrival_gaps(count, rate, report.burstiness, arrivals)
                results, seconds, peak = await run_rate_level(workload, prompts, gaps, concurrency, counted)
                level = level_report(None, results, seconds, workload.output_len, request_rate=rate, peak_in_flight=peak)
            if level.short_replies:
                warn(f"{level.short_replies} of {level.completed} replies at {name} had fewer "
                     f"than {workload.output_len} tokens; does the server honour ignore_eos?")
            report.levels.append(level)

    asyncio.run(levels())
    return report


def format_rate(rate: float) -> str:
    """A request rate as the flag takes it: "inf", or requests a second ("2.5/s")."""
    return "inf" if math.isinf(rate) else f"{rate:g}/s"


def level_name(concurrency: int | None, rate: float | None) -> str:
    """A level as messages name it: "concurrency 4", or "request rate 2.5/s"."""
    return f"concurrency {concurrency}" if rate is None else f"request rate {format_rate(rate)}"
