"""`qat4 bench serve`: its statistics, runs against a fake OpenAI-compatible server, its errors, and
one run against a real `qat4 serve` on the CPU, which it starts and stops."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import signal
import statistics
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_harness import LiveServer

from qat4.bench_serve.driver import WARMUP_MAX_TOKENS, RequestResult, arrival_gaps
from qat4.bench_serve.levels import level_report
from qat4.bench_serve.stats import percentile, summarize_ms
from qat4.bench_serve.workload import default_rate_requests
from qat4.cli import main
from qat4.commands.bench import parse_compare
from qat4.errors import Qat4Error
from qat4.serve_process import free_port

FAILURE = "the fake server fails on purpose"


@pytest.fixture(autouse=True)
def _sigterm_handler_restored():
    """qat4.cli.main, called in process here, turns SIGTERM into KeyboardInterrupt; pytest gets its own back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


# ---- statistics --------------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(v) for v in range(1, 101)], 99) == pytest.approx(99.01)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile([7.0], 99) == 7.0


def test_summaries_are_milliseconds_and_none_without_values():
    assert summarize_ms([0.001, 0.002, 0.003]) == pytest.approx({"mean": 2.0, "p50": 2.0, "p99": 2.98})
    assert summarize_ms([]) == {"mean": None, "p50": None, "p99": None}


def test_level_figures_from_known_requests():
    results = [
        RequestResult(latency_s=1.0, ttft_s=0.1, input_tokens=10, output_tokens=4, chunk_gaps_s=[0.3, 0.3, 0.3]),
        RequestResult(latency_s=2.0, ttft_s=0.5, input_tokens=10, output_tokens=2, chunk_gaps_s=[1.5]),
        RequestResult(latency_s=0.2, error="HTTP 500: boom"),
        RequestResult(latency_s=0.1, error="HTTP 429: busy"),
    ]
    level = level_report(2, results, duration_s=2.0, output_len=4)
    assert (level.requests, level.completed, level.failed, level.first_error) == (4, 2, 2, "HTTP 500: boom")
    assert level.short_replies == 1
    assert (level.input_tokens, level.output_tokens) == (20, 6)
    assert level.output_tok_s == 3.0 and level.total_tok_s == 13.0 and level.request_per_s == 1.0
    # TPOT: (1.0 - 0.1) / 3 = 0.3 s and (2.0 - 0.5) / 1 = 1.5 s.
    assert level.tpot_ms == pytest.approx({"mean": 900.0, "p50": 900.0, "p99": 1488.0})
    assert level.ttft_ms["mean"] == pytest.approx(300.0)
    assert level.itl_ms["p50"] == pytest.approx(300.0)
    assert level.e2e_latency_ms["p50"] == pytest.approx(1500.0)


def test_a_one_token_reply_has_no_time_per_output_token():
    assert RequestResult(latency_s=1.0, ttft_s=0.5, output_tokens=1).tpot_s is None
    level = level_report(1, [RequestResult(latency_s=1.0, ttft_s=0.5, output_tokens=1)], 1.0, 1)
    assert level.tpot_ms == {"mean": None, "p50": None, "p99": None}


def test_compare_points():
    assert parse_compare(["llama.cpp=1:373,4:900.5", "vLLM=16:2000"]) == {
        "llama.cpp": [(1, 373.0), (4, 900.5)], "vLLM": [(16, 2000.0)]}
    for bad in ("llama.cpp", "=1:3", "x=1", "x=0:3", "x=a:b"):
        with pytest.raises(Qat4Error, match="--compare takes NAME=CONCURRENCY:TOK_S"):
            parse_compare([bad])


# ---- a fake OpenAI-compatible server ----------------------------------------------------------------


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class FakeServer:
    """Streams `max_tokens` pieces `delay_s` apart (only 2 when it ignores `ignore_eos`), the usage
    when asked and `usage` is on; a chat reply starts with a role-only chunk sent at once. `fail`:
    "status" answers 500, "mid-stream" sends an error event after the first piece. Keeps every
    request body and the most requests it had in flight at once."""

    def __init__(self, *, delay_s: float = 0.01, usage: bool = True, honours_ignore_eos: bool = True,
                 fail: str | None = None):
        self.delay_s, self.usage, self.honours_ignore_eos, self.fail = delay_s, usage, honours_ignore_eos, fail
        self.bodies: list[dict] = []
        self.in_flight = self.peak_in_flight = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._answer(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._answer(await request.json(), chat=True)

        return app

    async def _answer(self, body: dict, chat: bool):
        self.bodies.append(body)
        if self.fail == "status":
            return JSONResponse({"error": {"message": FAILURE, "type": "server_error"}}, status_code=500)
        n = body["max_tokens"] if body.get("ignore_eos") and self.honours_ignore_eos else min(2, body["max_tokens"])
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return StreamingResponse(self._events(body, n, chat), media_type="text/event-stream")

    async def _events(self, body: dict, n: int, chat: bool):
        def choice(piece: str) -> dict:
            return {"index": 0, "finish_reason": None, **({"delta": {"content": piece}} if chat else {"text": piece})}

        try:
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                yield sse({"choices": [choice(f" piece{i}")]})
                if self.fail == "mid-stream":
                    yield sse({"error": {"message": FAILURE}})
                    break
            yield sse({"choices": [{**choice(""), "finish_reason": "length"}]})
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                prompt = body.get("prompt") or body["messages"][0]["content"].split()
                yield sse({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                    "total_tokens": len(prompt) + n}})
            yield sse("[DONE]")
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake(request):
    server = FakeServer(**getattr(request, "param", {}))
    with LiveServer(server.app()) as live:
        server.url = live.url
        yield server


def bench(url: str, *args: str) -> int:
    return main(["bench", "serve", "--url", url, *args])


REPORT_FIELDS = {"model", "url", "endpoint", "server", "input_len", "output_len", "requests_per_level", "burstiness",
                 "max_concurrency", "temperature", "seed", "date", "qat4_version", "qat4_commit", "server_command",
                 "levels", "compare"}
LEVEL_FIELDS = {"concurrency", "request_rate", "peak_in_flight", "requests", "completed", "failed", "first_error", "short_replies", "duration_s",
                "input_tokens", "output_tokens", "output_tok_s", "total_tok_s", "request_per_s", "ttft_ms", "tpot_ms",
                "itl_ms", "e2e_latency_ms"}


def test_levels_against_a_fake_server(fake, tmp_path, capsys):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    code = bench(f"{fake.url}/v1/", "--concurrency", "1,3", "--input-len", "12", "--output-len", "5", "--requests-per-level", "6",
                 "--json", str(out), "--plot", str(plot), "--compare", "other=1:100,3:250")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "output tok/s" in captured.out and "TTFT ms" in captured.out
    report = json.loads(out.read_text())
    assert set(report) == REPORT_FIELDS
    assert report["url"] == fake.url  # given as an OpenAI client's base URL
    assert report["model"] == "fake-model" and report["server"] == "external" and report["compare"] == {
        "other": [[1, 100.0], [3, 250.0]]}
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    assert report["burstiness"] is None and report["max_concurrency"] is None
    assert [(level["request_rate"], level["peak_in_flight"]) for level in report["levels"]] == [(None, 1), (None, 3)]
    for level in report["levels"]:
        assert set(level) == LEVEL_FIELDS
        assert (level["requests"], level["completed"], level["failed"], level["short_replies"]) == (6, 6, 0, 0)
        assert (level["input_tokens"], level["output_tokens"]) == (6 * 12, 6 * 5)
        assert level["output_tok_s"] == pytest.approx(level["output_tokens"] / level["duration_s"])
        assert 0 < level["ttft_ms"]["p50"] < level["e2e_latency_ms"]["p50"]
        assert level["tpot_ms"]["mean"] >= 0.8 * 1e3 * fake.delay_s
        assert level["itl_ms"]["p50"] > 0
    assert fake.peak_in_flight == 3
    warm, *counted = fake.bodies
    assert warm["max_tokens"] == WARMUP_MAX_TOKENS and len(counted) == 12
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] is True and b["stream"] is True and len(b["prompt"]) == 12
               and b["stream_options"] == {"include_usage": True} and b["model"] == "fake-model" for b in counted)
    assert len({tuple(b["prompt"]) for b in fake.bodies}) == len(fake.bodies)  # no two prompts share a cache
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize("fake", [{"usage": False, "honours_ignore_eos": False}], indirect=True)
def test_without_usage_tokens_are_counted_from_chunks_and_short_replies_warned(fake, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert bench(fake.url, "--concurrency", "2", "--output-len", "5", "--input-len", "3", "--requests-per-level", "4",
                 "--json", str(out)) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["output_tokens"] == 4 * 2 and level["short_replies"] == 4
    assert level["input_tokens"] == 4 * 3
    assert "4 of 4 replies at concurrency 2 had fewer than 5 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("fake", [{"delay_s": 0.05}], indirect=True)
def test_chat_prompts_are_words_and_the_role_chunk_is_not_the_first_token(fake, tmp_path):
    out = tmp_path / "serve.json"
    assert bench(fake.url, "--endpoint", "chat", "--concurrency", "1", "--input-len", "7", "--output-len", "3",
                 "--requests-per-level", "2", "--model", "asked-for", "--json", str(out)) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["output_tokens"] == 6 and level["input_tokens"] == 14
    assert level["ttft_ms"]["p50"] >= 40  # the role chunk comes at once, the first piece after 50 ms
    body = fake.bodies[-1]
    assert body["model"] == "asked-for" and len(body["messages"][0]["content"].split()) == 7


@pytest.mark.parametrize("fake, first_error", [
    ({"fail": "status"}, f"HTTP 500: {FAILURE}"),
    ({"fail": "mid-stream"}, f"error event mid-reply: {FAILURE}"),
], indirect=["fake"])
def test_server_errors_are_counted_as_failed_requests(fake, first_error, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = bench(fake.url, "--concurrency", "2", "--requests-per-level", "4", "--output-len", "3", "--input-len", "2",
                 "--json", str(out))
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert captured.err.splitlines()[-1] == f"qat4 bench: every one of the 4 requests failed; the first: {first_error}"
    level = json.loads(out.read_text())["levels"][0]
    assert (level["failed"], level["completed"], level["first_error"]) == (4, 0, first_error)
    assert f"concurrency 2: 4 of 4 requests failed; the first: {first_error}" in captured.out


def test_arrival_gaps_keep_the_rate_and_spread_by_burstiness():
    for burstiness, spread in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):  # a gamma's coefficient of variation: 1 / sqrt(shape)
        gaps = arrival_gaps(20_001, 50.0, burstiness, random.Random(7))
        assert len(gaps) == 20_000 and min(gaps) >= 0
        assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(spread, rel=0.08)
    assert arrival_gaps(5, 3.0, 1.0, random.Random(1)) == arrival_gaps(5, 3.0, 1.0, random.Random(1))
    assert arrival_gaps(4, math.inf, 1.0, random.Random(1)) == [0.0, 0.0, 0.0] and arrival_gaps(1, 2.0, 1.0, random.Random(1)) == []


def test_default_requests_at_a_rate_are_eight_seconds_of_arrivals_within_bounds():
    assert [default_rate_requests(rate, None) for rate in (0.5, 10.0, 1e4, 1e308)] == [16, 80, 1000, 1000]
    assert (default_rate_requests(math.inf, None), default_rate_requests(math.inf, 2), default_rate_requests(math.inf, 32)) == (64, 16, 128)


@pytest.mark.parametrize("fake", [{"delay_s": 0.1}], indirect=True)
def test_request_rates_send_on_time_whatever_the_replies(fake, tmp_path, capsys):
    """An open loop: at 100 requests a second five requests of 0.3 s are all in flight at once, where
    one client would have taken 1.5 s; all at once with --max-concurrency 2, two at a time."""
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    code = bench(fake.url, "--request-rate", "100,inf", "--max-concurrency", "5", "--requests-per-level", "5",
                 "--input-len", "4", "--output-len", "3", "--burstiness", "2", "--json", str(out), "--plot", str(plot))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    assert set(report) == REPORT_FIELDS and (report["burstiness"], report["max_concurrency"]) == (2.0, 5)
    assert [level["request_rate"] for level in report["levels"]] == [100.0, "inf"]
    for level in report["levels"]:
        assert set(level) == LEVEL_FIELDS
        assert (level["concurrency"], level["peak_in_flight"]) == (None, 5)
        assert (level["requests"], level["completed"], level["output_tokens"]) == (5, 5, 15)
        assert level["ttft_ms"]["p50"] >= 80
    assert fake.peak_in_flight == 5
    assert "request rate" in captured.out and "100/s" in captured.out and "inf" in captured.out
    assert "arrivals of burstiness 2, at most 5 in flight" in captured.out
    assert plot.stat().st_size > 1000

    fake.peak_in_flight = 0  # --max-concurrency alone: all at once, two in flight
    assert bench(fake.url, "--max-concurrency", "2", "--requests-per-level", "4", "--input-len", "2",
                 "--output-len", "2", "--json", str(out)) == 0
    report = json.loads(out.read_text())
    level = report["levels"][0]
    assert (report["max_concurrency"], level["request_rate"], level["peak_in_flight"], level["completed"]) == (2, "inf", 2, 4)
    assert fake.peak_in_flight == 2
    assert level["duration_s"] >= 2 * 2 * 0.1 * 0.9  # two rounds of two replies of 0.2 s


@pytest.mark.parametrize("fake", [{"delay_s": 0.001}], indirect=True)
def test_a_rate_spaces_its_requests_out_even_when_replies_are_quick(fake, tmp_path):
    """Nearly even gaps at 20 a second: five requests take at least the four gaps of 50 ms between
    them, although each reply takes a few ms (sent all at once, they would take a few ms in all)."""
    out = tmp_path / "serve.json"
    assert bench(fake.url, "--request-rate", "20", "--burstiness", "1000", "--requests-per-level", "5",
                 "--input-len", "2", "--output-len", "2", "--json", str(out)) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["completed"] == 5 and level["duration_s"] >= 0.9 * 4 / 20


@pytest.mark.parametrize("args, max_queue", [
    (["--request-rate", "10,inf"], 80), (["--request-rate", "inf", "--max-concurrency", "8"], 8),
    (["--request-rate", "2", "--requests-per-level", "5"], 5), (["--concurrency", "1,4"], 4), ([], 64),
])
def test_the_started_server_queues_every_request_that_can_be_in_flight(args, max_queue, monkeypatch):
    """bench serve starts qat4 serve with a waiting queue as long as the most requests a level can
    have in flight, so that none is refused for room (429)."""
    import contextlib

    import qat4.serve_process

    asked = {}

    @contextlib.contextmanager
    def serving(*_args, max_queue, **_kwargs):
        asked["max_queue"] = max_queue
        raise Qat4Error("stopped before starting")
        yield

    monkeypatch.setattr(qat4.serve_process, "serving", serving)
    assert main(["bench", "serve", "--model", "m", *args]) == 1
    assert asked == {"max_queue": max_queue}


def test_an_unreachable_url_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert bench(url, "--concurrency", "1") == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qat4 bench: cannot reach {url}: ")


@pytest.mark.parametrize("args, message", [
    (["--model", "m", "--concurrency", "0"], "--concurrency must list numbers of clients of at least 1, got '0'"),
    (["--model", "m", "--concurrency", "1,x"], "--concurrency must be comma-separated integers, got '1,x'"),
    (["--model", "m", "--output-len", "0"], "--input-len and --output-len must be at least 1"),
    (["--model", "m", "--multi-turn", "3", "--rounds", "0"], "--multi-turn, --sessions, --rounds and --turn-len must be"),
    (["--model", "m", "--concurrency", "4", "--requests-per-level", "2"],
     "--requests-per-level 2 is fewer than the largest --concurrency 4; every client needs at least one request"),
    (["--model", "m", "--compare", "llama.cpp=1"], "--compare takes NAME=CONCURRENCY:TOK_S"),
    (["--model", "m", "--request-rate", "0"], "--request-rate must list request rates above 0 a second (or inf), got '0'"),
    (["--model", "m", "--request-rate", "2,x"], "--request-rate must list request rates above 0 a second (or inf), got '2,x'"),
    (["--model", "m", "--request-rate", "nan"], "--request-rate must list request rates above 0"),
    (["--model", "m", "--request-rate", "2", "--concurrency", "4"],
     "--concurrency cannot go with --request-rate or --max-concurrency, which run levels of request rates"),
    (["--model", "m", "--max-concurrency", "2", "--compare", "x=1:2", "--multi-turn", "2"],
     "--multi-turn and --compare cannot go with --request-rate or --max-concurrency"),
    (["--model", "m", "--burstiness", "2"], "--burstiness goes with --request-rate"),
    (["--model", "m", "--request-rate", "2", "--burstiness", "0"], "--burstiness must be a number above 0, got 0"),
    (["--model", "m", "--request-rate", "2", "--burstiness", "inf"], "--burstiness must be a number above 0, got inf"),
    (["--model", "m", "--request-rate", "2", "--max-concurrency", "0"], "--max-concurrency must be at least 1, got 0"),
    (["--model", "m", "--request-rate", "2", "--requests-per-level", "0"], "--requests-per-level must be at least 1, got 0"),
    (["--model", "m", "--server-args=--port 9000"], "--server-args must not set --host or --port"),
    (["--url", "http://127.0.0.1:9", "--server-args=--max-ctx 64"], "leave them out with --url"),
    ([], "qat4 bench serve needs --url of a running server, or --model to start one"),
])
def test_bad_flags_are_one_line(args, message, capsys):
    assert main(["bench", "serve", *args]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_the_engine_bench_still_needs_its_model(capsys):
    assert main(["bench", "--depths", "0"]) == 1
    assert "--model is required" in capsys.readouterr().err


# ---- against a real qat4 serve ------------------------------------------------------------------------


def test_against_a_real_qat4_serve_on_the_cpu(tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qat4.cli", "bench", "serve", "--model", "synthetic:tiny", "--device", "cpu",
         "--concurrency", "1,2", "--input-len", "16", "--output-len", "4", "--requests-per-level", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["server"] == "qat4 serve, started by the benchmark" and report["model"] == "synthetic:tiny"
    assert report["server_command"][:4] == ["qat4", "serve", "--model", "synthetic:tiny"]
    for level in report["levels"]:
        assert (level["requests"], level["completed"], level["input_tokens"]) == (2, 2, 32)
        assert 0 < level["output_tokens"] <= 8 and level["output_tok_s"] > 0
    url = re.search(r"starting qat4 serve --model synthetic:tiny on (\S+)", proc.stderr).group(1)
    with pytest.raises(httpx.ConnectError):  # stopped with the benchmark
        httpx.get(f"{url}/health", timeout=2)



def test_multi_turn_conversations_hit_the_prompt_cache(tmp_path, capsys):
    """Two conversations of three turns against qat4's server on the tiny model: every later turn
    reads the previous turn's prompt from the cache, the cold replay reads it all again."""
    from qat4.server.app import create_app
    from server_harness import tiny_engine

    with LiveServer(create_app(tiny_engine(), model_name="tiny")) as server:
        out = tmp_path / "turns.json"
        assert bench(server.url, "--multi-turn", "3", "--sessions", "2", "--rounds", "2", "--input-len", "60",
                     "--turn-len", "10", "--output-len", "4", "--json", str(out)) == 0
    report = json.loads(out.read_text())
    later = report["per_turn"][1:]
    assert report["rounds"] == 2 and all(t["conversations"] == 4 for t in report["per_turn"])  # two rounds of two
    assert all(t["failed"] == 0 for t in report["per_turn"]) and report["per_turn"][0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] >= t["reusable_tokens"] - 16 - 4 for t in later)  # all but the reply and a block
    assert report["hit_rate"] > 0.7
    printed = capsys.readouterr().out
    assert "prompt cache hit rate over turns 2..3" in printed and "cold p50 ms" in printed and "x new-only" in printed
    assert "4 conversations of 3 turns, 2 rounds of 2 at once" in printed
    assert all(t["new_only_ttft_ms"]["p50"] > 0 for t in report["per_turn"])
