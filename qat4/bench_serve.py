"""`qat4 bench serve`: load an OpenAI-compatible server at several concurrency levels and measure it.

Every request asks for exactly `output_len` new tokens (`max_tokens` with `ignore_eos`, which
qat4, llama.cpp's llama-server and vLLM accept) after a prompt of `input_len` random token ids
(/v1/completions, so the length is exact) or random words (/v1/chat/completions). Replies are
streamed, so the time to first token is what a client sees, queueing included. At each level
exactly `concurrency` clients send the level's requests, each sending its next one as soon as its
last one has ended. One warm-up request comes before the first level and is not counted.

Figures of a level, as vllm bench serve defines them:

- output tok/s: output tokens of the completed requests over the level's wall time (first request
  sent to last reply ended); total tok/s adds their prompt tokens; req/s counts completed requests.
- TTFT (time to first token): from sending a request to the first streamed text.
- TPOT (time per output token): per request, (latency - TTFT) / (output tokens - 1).
- ITL (inter-token latency): the gaps between successive streamed text chunks, over all requests
  (a server that sends several tokens in one chunk shows one longer gap for them).
- E2E latency: from sending a request to the end of its reply.

Token counts are the server's `usage` (asked for with `stream_options.include_usage`); without
it, output tokens are the number of text chunks and prompt tokens `input_len`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import random
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from qat4 import __version__
from qat4.errors import Qat4Error

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
WARMUP_MAX_TOKENS = 4
CONNECT_TIMEOUT_S = 30.0  # replies themselves have no time limit: at high concurrency they wait in the server's queue
PROBE_TIMEOUT_S = 10.0
QUANTILES = (50, 99)

Prompt = list[int] | str | list[dict[str, str]]  # token ids or text (one user message), or chat messages


def default_requests(concurrency: int) -> int:
    """Requests per level unless given: four per client, so every client sends four in turn and the
    level runs at full concurrency for most of its time, and at least 16, so percentiles have samples."""
    return max(4 * concurrency, 16)


# ---- statistics ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of durations in seconds, in milliseconds; None each when there are none."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    return {"mean": 1e3 * sum(seconds) / len(seconds), **{f"p{q}": 1e3 * percentile(seconds, q) for q in QUANTILES}}


# ---- requests ----------------------------------------------------------------------------------------


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

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

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


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}} or vLLM's {"message"}), else the text."""
    try:
        data = json.loads(body)
        error = data.get("error", data)
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError, AttributeError):
        return body.decode(errors="replace").strip()[:300] or "no details"


def _has_text(event: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated text (a completion's text, a chat delta's content,
    reasoning or tool call); role-only and finish chunks do not."""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return False


async def send_request(client: httpx.AsyncClient, workload: Workload, prompt: Prompt, max_tokens: int) -> RequestResult:
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
        async with client.stream("POST", ENDPOINTS[workload.endpoint], json=workload.body(prompt, max_tokens)) as reply:
            if reply.status_code != 200:
                return failed(f"HTTP {reply.status_code}: {error_message(await reply.aread())}")
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    return failed(f"the server sent an event that is not JSON: {data[:80]!r}")
                if "error" in event:
                    return failed(f"error event mid-reply: {error_message(data.encode())}")
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
    except httpx.HTTPError as exc:
        return failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if first is None:
        return failed("the reply ended without any text")
    return RequestResult(latency_s=time.perf_counter() - start, ttft_s=first - start,
                         input_tokens=int(usage.get("prompt_tokens") or workload.input_len),
                         output_tokens=int(usage.get("completion_tokens") or chunks), chunk_gaps_s=gaps,
                         text="".join(text), cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))


def _client(workload: Workload, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=workload.url, headers=workload.headers,
                             timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None, write=None, pool=None),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def run_level(workload: Workload, prompts: Sequence[Prompt], concurrency: int,
                    on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send `prompts` through exactly `concurrency` clients; the results in prompt order, and the wall time."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue = iter(enumerate(prompts))  # shared by the clients: each takes the next prompt when free

    async with _client(workload, concurrency) as client:
        async def one_client() -> None:
            for i, prompt in queue:
                results[i] = await send_request(client, workload, prompt, workload.output_len)
                if on_result is not None:
                    on_result(results[i])

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return results, time.perf_counter() - start


async def warm_up(workload: Workload, prompt: Prompt) -> RequestResult:
    """One uncounted request of WARMUP_MAX_TOKENS, so first-use costs (compiling, caches) stay out of the figures."""
    async with _client(workload, 1) as client:
        return await send_request(client, workload, prompt, min(workload.output_len, WARMUP_MAX_TOKENS))


def probe(url: str, api_key: str | None = None) -> str | None:
    """The first model id `url/v1/models` lists (None when it lists none or does not answer with JSON);
    Qat4Error when nothing answers at `url` at all."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise Qat4Error(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    except httpx.InvalidURL as exc:
        raise Qat4Error(f"cannot reach {url}: {exc}") from None
    try:
        return str(reply.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


# ---- the report ------------------------------------------------------------------------------------


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


# ---- multi-turn conversations ----------------------------------------------------------------------


@dataclass
class TurnReport:
    """One turn over every session: time to first token with the prompt cache's help, read cold
    (the same conversation under a fresh system message, so no prefix matches) and for a prompt of
    only the tokens the turn read (random ids, as many as its prompt minus its cached tokens), and
    how much of the previous turn's prompt came back from the cache."""

    turn: int
    sessions: int
    failed: int
    prompt_tokens: float  # mean over the sessions
    cached_tokens: float  # mean over the sessions
    reusable_tokens: float  # mean: the previous turn's prompt, which this one starts with
    ttft_ms: dict[str, float | None]
    cold_ttft_ms: dict[str, float | None]
    new_only_ttft_ms: dict[str, float | None]

    @property
    def over_new_only(self) -> float | None:
        """p50 TTFT over the p50 TTFT of reading only the new tokens."""
        warm, new = self.ttft_ms["p50"], self.new_only_ttft_ms["p50"]
        return warm / new if warm is not None and new else None


def _conversation_turns(workload: Workload, turns: int, turn_len: int, rng: random.Random) -> list[list[str]]:
    """User messages of one conversation: input_len words, then turn_len words each turn."""
    return [" ".join(rng.choices(WORDS, k=workload.input_len if t == 0 else turn_len)) for t in range(turns)]


def run_multi_turn(workload: Workload, turns: int, sessions: int, turn_len: int, seed: int,
                   on_result: Callable[[str, int, int, RequestResult], None] | None = None) -> list[TurnReport]:
    """`sessions` conversations of `turns` turns at once, each client sending its next turn when its
    last reply ended (the history grows by the reply and turn_len words each turn); then the same
    requests again, each under a system message of its own (a cold read), and as completions of
    random token ids as long as what each warm turn read beyond its cached tokens (the time of
    reading only the new tokens). TTFT per turn all three ways and the prompt tokens the server
    reports cached (usage.prompt_tokens_details.cached_tokens)."""
    rng = random.Random(seed)
    conversations = [_conversation_turns(workload, turns, turn_len, rng) for _ in range(sessions)]
    tag = lambda: " ".join(rng.choices(WORDS, k=8))  # noqa: E731  (a system message of 8 words)
    sent: list[list[list[dict[str, str]]]] = [[] for _ in range(sessions)]
    warm: list[list[RequestResult]] = [[] for _ in range(sessions)]
    cold: list[list[RequestResult | None]] = [[None] * turns for _ in range(sessions)]
    new_only: list[list[RequestResult | None]] = [[None] * turns for _ in range(sessions)]
    ids = replace(workload, endpoint="completions")
    done = {"warm": 0, "cold": 0, "new tokens only": 0}

    def counted(phase: str, result: RequestResult) -> None:
        done[phase] += 1
        if on_result is not None:
            on_result(phase, done[phase], sessions * turns, result)

    async def converse(client: httpx.AsyncClient, s: int) -> None:
        messages = [{"role": "system", "content": tag()}]
        for user in conversations[s]:
            messages.append({"role": "user", "content": user})
            sent[s].append(list(messages))
            result = await send_request(client, workload, list(messages), workload.output_len)
            warm[s].append(result)
            counted("warm", result)
            messages.append({"role": "assistant", "content": result.text})

    async def replay(client: httpx.AsyncClient, s: int) -> None:
        for t, messages in enumerate(sent[s]):
            fresh = [{"role": "system", "content": tag()}, *messages[1:]]
            cold[s][t] = await send_request(client, workload, fresh, workload.output_len)
            counted("cold", cold[s][t])

    async def read_new(client: httpx.AsyncClient, s: int) -> None:
        for t, turn in enumerate(warm[s]):
            if turn.ok:
                prompt = rng.choices(PROMPT_IDS, k=max(1, turn.input_tokens - turn.cached_tokens))
                new_only[s][t] = await send_request(client, ids, prompt, workload.output_len)
                counted("new tokens only", new_only[s][t])

    async def phases() -> None:
        async with _client(workload, sessions) as client:
            for phase in (converse, replay, read_new):
                await asyncio.gather(*(phase(client, s) for s in range(sessions)))

    asyncio.run(phases())
    reports = []
    for t in range(turns):
        ok = [s for s in range(sessions) if t < len(warm[s]) and warm[s][t].ok]
        colds = [cold[s][t] for s in range(sessions) if cold[s][t] is not None and cold[s][t].ok]
        news = [new_only[s][t] for s in range(sessions) if new_only[s][t] is not None and new_only[s][t].ok]
        per = max(1, len(ok))
        reports.append(TurnReport(
            turn=t + 1, sessions=sessions, failed=sessions - len(ok),
            prompt_tokens=sum(warm[s][t].input_tokens for s in ok) / per,
            cached_tokens=sum(warm[s][t].cached_tokens for s in ok) / per,
            reusable_tokens=sum(warm[s][t - 1].input_tokens for s in ok if t) / per,
            ttft_ms=summarize_ms([warm[s][t].ttft_s for s in ok]), cold_ttft_ms=summarize_ms([r.ttft_s for r in colds]),
            new_only_ttft_ms=summarize_ms([r.ttft_s for r in news]),
        ))
    return reports


def hit_rate(turns: Sequence[TurnReport]) -> float | None:
    """Cached tokens over reusable ones (each turn's cached tokens counted up to its reusable ones),
    over the turns after the first; None when nothing was reusable."""
    later = [t for t in turns if t.turn > 1 and t.reusable_tokens]
    reusable = sum(t.reusable_tokens for t in later)
    return sum(min(t.cached_tokens, t.reusable_tokens) for t in later) / reusable if reusable else None


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


def parse_compare(specs: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """--compare NAME=C1:TPS1,C2:TPS2,... (repeatable) as {name: [(concurrency, output tok/s), ...]}."""
    out: dict[str, list[tuple[int, float]]] = {}
    for spec in specs:
        name, _, points = spec.partition("=")
        try:
            pairs = [point.split(":") for point in points.split(",")]
            parsed = [(int(c), float(tps)) for c, tps in pairs]
        except ValueError:
            parsed = []
        if not name.strip() or not parsed or any(c < 1 or tps < 0 for c, tps in parsed):
            raise Qat4Error(f"--compare takes NAME=CONCURRENCY:TOK_S,... such as llama.cpp=1:373,4:900, got {spec!r}")
        out[name.strip()] = parsed
    return out


# ---- output --------------------------------------------------------------------------------------------


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _stat_columns(name: str, stats: Sequence[str]) -> list[tuple[str, Callable[[LevelReport], str]]]:
    return [(stat, lambda lv, stat=stat: _figure(getattr(lv, name)[stat], ",.1f")) for stat in stats]


# The table's column groups: (group title, [(column title, cell of a level), ...]).
TABLE = [
    ("", [("concurrency", lambda lv: str(lv.concurrency)), ("requests", lambda lv: str(lv.requests)),
          ("failed", lambda lv: str(lv.failed))]),
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
    cells = [[[cell(lv) for _, cell in columns] for _, columns in TABLE] for lv in report.levels]
    widths = [[max(len(title), *(len(row[g][c]) for row in cells)) + 1 for c, (title, _) in enumerate(columns)]
              for g, (_, columns) in enumerate(TABLE)]
    groups = "  ".join(title.center(sum(w)) for (title, _), w in zip(TABLE, widths))
    titles = "  ".join("".join(t.rjust(w) for (t, _), w in zip(columns, ws)) for (_, columns), ws in zip(TABLE, widths))
    rows = ["  ".join("".join(c.rjust(w) for c, w in zip(group, ws)) for group, ws in zip(row, widths)) for row in cells]
    head = (f"{report.model or 'server'} at {report.url}{ENDPOINTS[report.endpoint]}: {report.input_len} prompt and "
            f"{report.output_len} output tokens per request")
    failures = [f"concurrency {lv.concurrency}: {lv.failed} of {lv.requests} requests failed; the first: {lv.first_error}"
                for lv in report.levels if lv.failed]
    return "\n".join([head, "", groups.rstrip(), titles, *rows, *([""] + failures if failures else [])])


def save_json(report: ServeBenchReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def write_plot(report: ServeBenchReport, path: str | Path) -> None:
    """Output tok/s against concurrency (with the --compare points), and TTFT and TPOT p50 against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    def values(figures: list[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in figures]

    xs = [lv.concurrency for lv in report.levels]
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
    ticks = sorted({*xs, *(c for points in report.compare.values() for c, _ in points)})
    for ax in (tput, latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
