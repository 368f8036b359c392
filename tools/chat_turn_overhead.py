"""The server's host time on a chat turn over a long history, against a prompt of only its new tokens.

A chat sends its whole history again every turn; the prompt cache spares the engine re-reading
it, but the server still parses, validates, renders, tokenizes and hashes all of it on the host.
This tool serves the real app in-process (uvicorn in a thread, as `qat4 serve` runs it) over the
real engine on the CPU whose model is replaced by one that answers at once, so every step the
engine takes is its host work alone: scheduling, the prompt cache's block hashes and lookups,
reading back. A conversation of random words (as `qat4 bench serve --multi-turn`
builds them: a first message of ``--history`` words, then ``--turn`` words a turn, each answered)
is read up to turn ``--at-turn``; then each repetition sends, interleaved:

- ``chat``: the next turn of that conversation (the history and ``--turn`` new words, different
  each time) as a streamed chat completion;
- ``new only``: a streamed text completion of as many random token ids as the chat turn read
  beyond its cached tokens,

and times each from sending the request to the first streamed token. Then it times the stages of
the host's work that grow with the history, each on its own, on the same requests (median of
``--repeat`` each, for both requests, and their difference): the server's parse_body
(``json.loads``, ``check_values``, ``model_validate``), build_chat_prompt (``model_dump`` of the
messages, the ``chat template``), ``tokenizer.encode`` and ``Engine.encode(text)`` around it (the
server's, off the event loop), then on the engine thread ``Engine.encode(ids)`` (add_request's),
the prompt's ``block hashes`` and the prompt cache's ``attach_prefix``, and ``engine to first
token``: add_request and the steps to the first token read back, the three before included.

    python tools/chat_turn_overhead.py --history 8000 --turn 64 --repeat 200
    python tools/chat_turn_overhead.py --history 8000 --turn 64 --at-turn 10
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import uvicorn  # noqa: E402

from qat4.bench_serve.workload import PROMPT_IDS, WORDS  # noqa: E402
from qat4.chat.template import render_prompt  # noqa: E402
from qat4.checkpoint.synth import synthetic_model  # noqa: E402
from qat4.commands.model_args import synthetic_tokenizer  # noqa: E402
from qat4.commands.serve import SWITCH_INTERVAL_S  # noqa: E402
from qat4.config import E2B, PRESETS  # noqa: E402
from qat4.engine import Engine  # noqa: E402
from qat4.engine.model_runner import StepTokens  # noqa: E402
from qat4.engine.sequence import Sequence  # noqa: E402
from qat4.server.app import create_app  # noqa: E402
from qat4.server.chat_prompt import build_chat_prompt  # noqa: E402
from qat4.server.schemas import ChatCompletionRequest, CompletionRequest, check_values, parse_body  # noqa: E402

HOST = "127.0.0.1"
MAX_TOKENS = 4  # tokens each timed request asks for: the first is what is timed
WARMUP_TURNS = 3


class InstantRunner:
    """The engine's model runner with the model left out: a launched step's tokens (``token`` for
    every sequence that samples) are ready at once; everything else is the real runner's."""

    def __init__(self, runner: Any, token: int):
        self._runner, self._token = runner, token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def launch(self, decode: list[Sequence], decode_keep: int, chunks: list[tuple[Sequence, int]], sampled: list[int],
               masked: bool = False, scored: bool = False, defer_pick: bool = False) -> StepTokens:
        """The step's table entries sent as the real launch sends them, and its tokens, ready."""
        self._runner.pool.flush()
        seqs = decode + [chunks[i][0] for i in sampled]
        return StepTokens(seqs, [[] for _ in seqs], torch.full((len(seqs),), self._token), None)


def instant_engine(max_ctx: int) -> Engine:
    """The real engine (scheduler, KV pool with the prompt cache, tokenizer) over the tiny synthetic
    model with E2B's sliding window, its runner an InstantRunner."""
    config = dataclasses.replace(PRESETS["tiny"], sliding_window=E2B.sliding_window, max_position_embeddings=max_ctx)
    tokenizer = synthetic_tokenizer()
    engine = Engine.from_packed(synthetic_model(config), "cpu", max_ctx=max_ctx, max_num_seqs=4, tokenizer=tokenizer)
    engine.runner = InstantRunner(engine.runner, tokenizer.encode(" more")[-1])
    return engine


@contextmanager
def serving(app: Any) -> Iterator[int]:
    """The app on a free loopback port, served by uvicorn in a thread of this process; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclasses.dataclass
class Reply:
    """A streamed answer: seconds to its first token, its text, and its usage."""

    ttft_s: float
    text: str
    usage: dict[str, Any]


def _token_text(event: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries (a chat delta's content or a completion's text)."""
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def post_streamed(port: int, path: str, body: bytes) -> Reply:
    """POST a streamed request and read it to the end, timing its first token."""
    connection = http.client.HTTPConnection(HOST, port)
    start = time.perf_counter()
    connection.request("POST", path, body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"{path} answered {response.status}: {response.read()[:500]!r}")
    first, parts, usage = None, [], {}
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        text = _token_text(event)
        if text and first is None:
            first = time.perf_counter()
        parts.append(text)
        usage = event.get("usage") or usage
    connection.close()
    if first is None:
        raise SystemExit(f"{path} streamed no token")
    return Reply(first - start, "".join(parts), usage)


def words(rng: random.Random, n: int) -> str:
    """``n`` random words, as `qat4 bench serve --multi-turn` writes its messages."""
    return " ".join(rng.choices(WORDS, k=n))


def chat_body(messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> bytes:
    """A streamed, greedy chat completion request."""
    return json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


def completion_body(ids: list[int]) -> bytes:
    """A streamed, greedy text completion request of token ids."""
    return json.dumps({"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


@dataclasses.dataclass
class Requests:
    """The timed requests: chat turns after the cached history, and prompts of their new tokens."""

    history: list[dict[str, str]]  # system, then user and assistant messages
    rng: random.Random
    turn_words: int

    def chat(self) -> bytes:
        """The next turn: the history and a new message of random words."""
        return chat_body([*self.history, {"role": "user", "content": words(self.rng, self.turn_words)}])

    def new_only(self, n: int) -> bytes:
        """A prompt of ``n`` random token ids."""
        return completion_body(self.rng.choices(PROMPT_IDS, k=n))


def start_conversation(port: int, history_words: int, turn: int, turn_words: int, seed: int) -> Requests:
    """The turns of a conversation before ``turn``, sent one by one (the prompt cache keeps them):
    a first message of ``history_words`` words, then messages of ``turn_words``, each answered with
    64 tokens; and the requests of ``turn`` to come."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": words(rng, 8)}]
    for i in range(turn - 1):
        messages.append({"role": "user", "content": words(rng, turn_words if i else history_words)})
        reply = post_streamed(port, "/v1/chat/completions", chat_body(messages, 64))
        messages.append({"role": "assistant", "content": reply.text})
    return Requests(messages, rng, turn_words)


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in ms."""
    return statistics.median(seconds) * 1e3


def time_requests(port: int, requests: Requests, repeat: int) -> dict[str, Any]:
    """Median ms to the first token of chat turns and of their new tokens alone, interleaved, and
    the prompt tokens and cached tokens of the turns."""
    for _ in range(WARMUP_TURNS):  # the first turns after the history cache a little less than later ones
        chat = post_streamed(port, "/v1/chat/completions", requests.chat())
    new = max(1, chat.usage["prompt_tokens"] - chat.usage["prompt_tokens_details"]["cached_tokens"])
    post_streamed(port, "/v1/completions", requests.new_only(new))
    chats, news, cached = [], [], []
    for _ in range(repeat):
        reply = post_streamed(port, "/v1/chat/completions", requests.chat())
        chats.append(reply.ttft_s)
        cached.append(reply.usage["prompt_tokens_details"]["cached_tokens"])
        news.append(post_streamed(port, "/v1/completions", requests.new_only(new)).ttft_s)
    return {"chat_prompt_tokens": chat.usage["prompt_tokens"], "cached_tokens": min(cached), "new_tokens": new,
            "chat_ttft_ms": median_ms(chats), "new_only_ttft_ms": median_ms(news)}


def timed(work: Callable[[], Any], repeat: int) -> float:
    """Median ms of ``work()`` over ``repeat`` calls."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return median_ms(seconds)


def stages(engine: Engine, raw: bytes, model: type, keep: int, repeat: int) -> dict[str, float]:
    """Median ms of each host stage of one request body, in the order the server runs them; the
    engine reads prompts of its first ``keep`` tokens and new ones after them."""
    data = json.loads(raw)
    req = parse_body(model, raw)
    out = {"json.loads": timed(lambda: json.loads(raw), repeat),
           "check_values": timed(lambda: check_values(data, raw), repeat),
           "model_validate": timed(lambda: model.model_validate(data), repeat)}
    if model is ChatCompletionRequest:
        template = engine.tokenizer.chat_template
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        text = build_chat_prompt(req, template).text
        out |= {"model_dump": timed(lambda: [m.model_dump(exclude_none=True) for m in req.messages], repeat),
                "chat template": timed(lambda: render_prompt(messages, template=template), repeat),
                "tokenizer.encode": timed(lambda: engine.tokenizer.encode(text), repeat)}
        prompt: str | list[int] = text
    else:
        prompt = req.prompt
    if isinstance(prompt, str):
        out["Engine.encode(text)"] = timed(lambda: engine.encode(prompt), repeat)
    ids = engine.encode(prompt)
    out["Engine.encode(ids)"] = timed(lambda: engine.encode(ids), repeat)
    out |= _admission(engine, ids, repeat)
    out["engine to first token"] = _first_token_ms(engine, ids, keep, repeat)
    return out


def _first_token_ms(engine: Engine, ids: list[int], keep: int, repeat: int) -> float:
    """Median ms of the engine's host work from add_request to the first token read back (a
    one-token request, so nothing follows it but giving its blocks back to the prompt cache), for
    prompts of the first ``keep`` of ``ids`` and random ids after them, as new turns have."""
    rng, seconds = random.Random(len(ids)), []
    for _ in range(repeat):
        prompt = engine.encode(ids[:keep] + rng.choices(PROMPT_IDS, k=len(ids) - keep))  # the server's thread checks them
        start = time.perf_counter()
        seq = engine.add_request(prompt, 1, temperature=0, stop_token_ids=[])
        while not seq.output:
            engine.step()
        seconds.append(time.perf_counter() - start)
        engine.drain()
    return median_ms(seconds)


def _admission(engine: Engine, ids: list[int], repeat: int) -> dict[str, float]:
    """Median ms of the engine's admission work on a prompt: its block hashes, and the prompt cache's
    lookup of them (the slot it opens given back each time)."""
    pool, bs = engine.pool, engine.pool.block_size

    def hashes() -> list[bytes]:
        return Sequence(ids, None, 0, 1, frozenset()).block_hashes(bs, len(ids))

    def attach() -> float:
        names, slot = hashes(), pool.open_slot()
        start = time.perf_counter()
        pool.attach_prefix(slot, names, len(ids))
        seconds = time.perf_counter() - start
        pool.close_slot(slot)
        return seconds

    return {"block hashes": timed(hashes, repeat), "attach_prefix": median_ms([attach() for _ in range(repeat)])}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Serve and time, then time the stages of one chat turn and of its new tokens alone."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine = instant_engine(max_ctx=2 * (args.history + args.at_turn * (args.turn + 64)) + 4096)
    with serving(create_app(engine, max_queue=8)) as port:
        requests = start_conversation(port, args.history, args.at_turn, args.turn, args.seed)
        served = time_requests(port, requests, args.repeat)
    chat = stages(engine, requests.chat(), ChatCompletionRequest, served["cached_tokens"], args.repeat)
    new = stages(engine, requests.new_only(served["new_tokens"]), CompletionRequest, 0, args.repeat)
    return {**served, "stages_ms": {name: {"chat": chat[name], "new_only": new.get(name)} for name in chat}}


def report(result: dict[str, Any]) -> None:
    """Print the first tokens' times and the table of stages."""
    chat, new = result["chat_ttft_ms"], result["new_only_ttft_ms"]
    print(f"chat turn: {result['chat_prompt_tokens']} prompt tokens, {result['cached_tokens']} from the prompt cache; "
          f"first token after {chat:.2f} ms")
    print(f"its {result['new_tokens']} new tokens alone: first token after {new:.2f} ms ({chat / new:.2f}x, "
          f"{chat - new:+.2f} ms)")
    print(f"\n{'stage':<24} {'chat ms':>8} {'new only ms':>11} {'difference':>10}")
    for name, ms in result["stages_ms"].items():
        alone = ms["new_only"] or 0.0
        print(f"{name:<24} {ms['chat']:8.3f} {alone:11.3f} {ms['chat'] - alone:10.3f}")


def main(argv: list[str] | None = None) -> int:
    """Measure and print (and write, with --json) the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--history", type=int, default=8000,
                   help="words of the conversation's first message (default: %(default)s)")
    p.add_argument("--at-turn", type=int, default=2,
                   help="the turn of the conversation timed, after the first of --history words and the "
                        "others of --turn words, each answered (default: %(default)s)")
    p.add_argument("--turn", type=int, default=64,
                   help="words of the message of each turn after the first, the timed ones too (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=100, help="timed requests of each kind (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="of the random words and ids (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)
    result = measure(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
