"""What `qat4 bench serve` shows and writes: the table of levels, the per-turn table of
`--multi-turn`, the JSON report and the plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from qat4.bench_serve.levels import LevelReport, ServeBenchReport, format_rate, level_name
from qat4.bench_serve.multi_turn import TurnReport, hit_rate
from qat4.bench_serve.workload import ENDPOINTS


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _stat_columns(name: str, stats: Sequence[str]) -> list[tuple[str, Callable[[LevelReport], str]]]:
    return [(stat, lambda lv, stat=stat: _figure(getattr(lv, name)[stat], ",.1f")) for stat in stats]


# The table's column groups: (group title, [(column title, cell of a level), ...]); the first names
# the levels, by clients or by request rates.
CLIENT_LEVELS = ("", [("concurrency", lambda lv: str(lv.concurrency)), ("requests", lambda lv: str(lv.requests)),
                      ("failed", lambda lv: str(lv.failed))])
RATE_LEVELS = ("", [("request rate", lambda lv: format_rate(lv.request_rate)),
                    ("peak in flight", lambda lv: str(lv.peak_in_flight)), ("requests", lambda lv: str(lv.requests)),
                    ("failed", lambda lv: str(lv.failed))])
FIGURES = [
    ("throughput", [("output tok/s", lambda lv: f"{lv.output_tok_s:,.1f}"),
                    ("total tok/s", lambda lv: f"{lv.total_tok_s:,.1f}"),
                    ("req/s", lambda lv: f"{lv.request_per_s:.2f}")]),
    ("TTFT ms", _stat_columns("ttft_ms", ("mean", "p50", "p99"))),
    ("TPOT ms", _stat_columns("tpot_ms", ("mean", "p50", "p99"))),
    ("ITL ms", _stat_columns("itl_ms", ("p50", "p99"))),
    ("E2E latency ms", _stat_columns("e2e_latency_ms", ("mean", "p50", "p99"))),
]


def format_table(report: ServeBenchReport) -> str:
    """A heading, the levels as a table (right-aligned columns under centred group titles), and a
    line for each level that had failures."""
    table = [RATE_LEVELS if report.by_rate else CLIENT_LEVELS, *FIGURES]
    cells = [[[cell(lv) for _, cell in columns] for _, columns in table] for lv in report.levels]
    widths = [[max(len(title), *(len(row[g][c]) for row in cells)) + 1 for c, (title, _) in enumerate(columns)]
              for g, (_, columns) in enumerate(table)]
    groups = "  ".join(title.center(sum(w)) for (title, _), w in zip(table, widths))
    titles = "  ".join("".join(t.rjust(w) for (t, _), w in zip(columns, ws)) for (_, columns), ws in zip(table, widths))
    rows = ["  ".join("".join(c.rjust(w) for c, w in zip(group, ws)) for group, ws in zip(row, widths)) for row in cells]
    head = (f"{report.model or 'server'} at {report.url}{ENDPOINTS[report.endpoint]}: {report.input_len} prompt and "
            f"{report.output_len} output tokens per request")
    if report.by_rate:
        limit = "no limit" if report.max_concurrency is None else f"at most {report.max_concurrency}"
        head += f"; arrivals of burstiness {report.burstiness:g}, {limit} in flight"
    failures = [f"{level_name(lv.concurrency, lv.request_rate)}: {lv.failed} of {lv.requests} requests failed; "
                f"the first: {lv.first_error}" for lv in report.levels if lv.failed]
    return "\n".join([head, "", groups.rstrip(), titles, *rows, *([""] + failures if failures else [])])


def format_turns(turns: Sequence[TurnReport]) -> str:
    """The per-turn table of :func:`run_multi_turn` and the hit rate."""
    head = (f"{'turn':>5} {'prompt':>8} {'cached':>8} {'TTFT p50 ms':>12} {'cold p50 ms':>12} {'new-only p50':>12} "
            f"{'x new-only':>10} {'TTFT p99 ms':>12} {'cold p99 ms':>12}")
    rows = [head]
    for t in turns:
        p50s = (t.ttft_ms["p50"], t.cold_ttft_ms["p50"], t.new_only_ttft_ms["p50"])
        rows.append(f"{t.turn:>5} {t.prompt_tokens:>8,.0f} {t.cached_tokens:>8,.0f} "
                    + " ".join(f"{_figure(ms, ',.1f'):>12}" for ms in p50s)
                    + f" {_figure(t.over_new_only, '.2f'):>10} "
                    + " ".join(f"{_figure(ms, ',.1f'):>12}" for ms in (t.ttft_ms["p99"], t.cold_ttft_ms["p99"])))
    rate = hit_rate(turns)
    rows.append(f"prompt cache hit rate over turns 2..{len(turns)}: " + ("n/a" if rate is None else f"{rate:.1%}")
                + " of the previous turn's prompt")
    return "\n".join(rows)


def save_json(report: ServeBenchReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def write_plot(report: ServeBenchReport, path: str | Path) -> None:
    """Output tok/s against concurrency (with the --compare points), and TTFT and TPOT p50 against
    concurrency; or, for levels of request rates, each against the rate (one tick per level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    def values(figures: list[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in figures]

    rates = report.by_rate
    xs = list(range(len(report.levels))) if rates else [lv.concurrency for lv in report.levels]
    fig, (tput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    tput.plot(xs, [lv.output_tok_s for lv in report.levels], "o-", label=report.model or "server")
    for name, points in report.compare.items():
        tput.plot([c for c, _ in points], [t for _, t in points], "s--", label=name)
    tput.set_ylabel("output tokens / s (all clients)")
    tput.set_title(f"{report.input_len} in, {report.output_len} out per request")
    latency.plot(xs, values([lv.ttft_ms["p50"] for lv in report.levels]), "o-", label="time to first token, p50")
    latency.plot(xs, values([lv.tpot_ms["p50"] for lv in report.levels]), "s-", label="time per output token, p50")
    latency.set_yscale("log")
    latency.set_ylabel("ms")
    latency.set_title(report.url)
    tput.set_ylim(bottom=0)
    if rates:
        ticks, labels, axis = xs, [format_rate(lv.request_rate) for lv in report.levels], "requests a second"
    else:
        ticks = sorted({*xs, *(c for points in report.compare.values() for c, _ in points)})
        labels, axis = [str(t) for t in ticks], "concurrent clients"
    for ax in (tput, latency):
        if not rates:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(axis)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
