"""Logprobs on the tiny synthetic model on the CPU: every token's logprob and top tokens are those
of the log-softmax of `Engine.logits` at its position (the model's own distribution, whatever the
sampling or grammar), a prompt's own tokens are scored the same way, and asking for logprobs
changes no token of any sequence in the batch; in the engine, and through the server's chat and
text completions, whole and streamed, with the echoed prompt."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from server_harness import TINY_MAX_CTX, LiveServer, ScriptedEngine, tiny_engine, tiny_tokenizer

from qat4.checkpoint.synth import synthetic_model
from qat4.config import PRESETS
from qat4.engine import Engine
from qat4.engine.engine import PoolBusy
from qat4.engine.logprobs import TOP_LOGPROBS
from qat4.errors import Qat4Error
from qat4.server.app import create_app
from qat4.server.generation import Detokenizer, EngineLoop, Finished, GenerationParams
from qat4.server.logprobs import TokenTexts
from qat4.server.metrics import Metrics

PROMPT = "The capital of France is"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine():
    """The tiny engine (the weights of server_harness.tiny_engine) in an instance of its own,
    reading prompts in chunks of 16 so that they chunk beside decoding sequences."""
    return Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=TINY_MAX_CTX, prefill_chunk=16,
                              tokenizer=tiny_tokenizer())


def model_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The log-softmax [len, V] of the logits of ``ids`` read alone."""
    return torch.log_softmax(engine.logits(ids), dim=-1)


def check_scored(rows: torch.Tensor, tokens: list[int], entries, k: int) -> None:
    """entries[i] (TokenLogprobs) scores tokens[i] under rows[i] (log-probabilities [V]): its
    logprob, and the k most likely tokens, most likely first."""
    assert [e.token for e in entries] == tokens
    for row, token, entry in zip(rows, tokens, entries):
        assert abs(entry.logprob - float(row[token])) < TOLERANCE
        values, ids = row.topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(lp - float(v)) < TOLERANCE for (_, lp), v in zip(entry.top, values))


SAMPLINGS = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 7},
    "constrained": {"temperature": 0, "json_schema": {"type": "object"}},
}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_each_token_is_scored_under_the_models_own_distribution(engine, sampling):
    """Whatever picks the token (argmax, a seeded draw at a temperature, a grammar's mask), its
    logprob is the model's raw log-softmax; a greedy token is the most likely one."""
    options = dict(SAMPLINGS[sampling])
    schema = options.pop("json_schema", None)
    constraint = None if schema is None else engine.json_constraint(schema)
    ids = engine.encode(PROMPT)
    stops = None if constraint else []  # a grammar ends at a stop token
    seq = engine.add_request(ids, 6, stop_token_ids=stops, constraint=constraint, logprobs=3, **options)
    engine.drain()
    rows = model_logprobs(engine, ids + seq.output)[len(ids) - 1 : -1]
    check_scored(rows, seq.output, seq.token_logprobs, 3)
    if sampling == "greedy":
        assert all(e.top[0][0] == e.token for e in seq.token_logprobs)
    if sampling == "constrained":  # the mask picked tokens the model does not favour, scored unmasked
        assert any(e.top[0][0] != e.token for e in seq.token_logprobs)


def test_prompt_tokens_are_scored_by_the_positions_before_them(engine):
    ids = engine.encode(PROMPT * 3)
    scored = engine.prompt_logprobs(ids, TOP_LOGPROBS)
    assert len(scored) == len(ids) and scored[0] is None
    check_scored(model_logprobs(engine, ids)[:-1], ids[1:], scored[1:], TOP_LOGPROBS)
    assert [e.top for e in engine.prompt_logprobs(ids, 0)[1:]] == [()] * (len(ids) - 1)


def test_logprobs_out_of_range_are_refused(engine):
    with pytest.raises(Qat4Error, match="logprobs is 21"):
        engine.add_request(PROMPT, 2, logprobs=TOP_LOGPROBS + 1)
    with pytest.raises(Qat4Error, match="k is -1"):
        engine.prompt_logprobs([2, 3], -1)


# (prompt, sampling, logprobs) of the requests batched; the prompts are longer than a chunk and
# arrive while the others decode
BATCH = [
    ("Paris is the capital of", {"temperature": 0}, 2),
    ("Once upon a time, in a land far away, there lived a", {"temperature": 0}, None),
    ("1, 2, 3,", {"temperature": 1.0, "top_k": 64, "seed": 5}, 0),
    ("The weather today is sunny and warm, and the children are", {"temperature": 0.7, "seed": 6}, None),
    ("def fibonacci(n):", {"temperature": 0}, TOP_LOGPROBS),
]


def test_a_batch_with_and_without_logprobs_gets_what_each_gets_alone(engine):
    alone = []
    for prompt, sampling, logprobs in BATCH:
        seq = engine.add_request(prompt, 8, stop_token_ids=[], logprobs=logprobs, **sampling)
        engine.drain()
        alone.append(seq)
    seqs, steps = [], 0
    while len(seqs) < len(BATCH) or engine.has_work:
        if steps % 2 == 0 and len(seqs) < len(BATCH):  # one joins every other step
            prompt, sampling, logprobs = BATCH[len(seqs)]
            seqs.append(engine.add_request(prompt, 8, stop_token_ids=[], logprobs=logprobs, **sampling))
        engine.step()
        steps += 1
    for seq, was in zip(seqs, alone):
        assert seq.output == was.output
        assert len(seq.token_logprobs) == (0 if seq.logprobs is None else len(seq.output))
        for got, want in zip(seq.token_logprobs, was.token_logprobs):
            assert got.token == want.token and [t for t, _ in got.top] == [t for t, _ in want.top]
            assert abs(got.logprob - want.logprob) < TOLERANCE


# ---- through the server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(tiny_engine(), model_name="tiny")) as live:
        yield live


def post(server, path: str, **body) -> dict:
    reply = httpx.post(server.url + path, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(server, path: str, **body) -> list[dict]:
    """The choices of a streamed answer's chunks, in order."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200
        events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [choice for event in events[:-1] for choice in json.loads(event)["choices"]]


def greedy_reply(engine: Engine, ids: list[int], n: int) -> list[int]:
    return engine.generate(ids, n, temperature=0, stop_token_ids=[]).tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models(server, engine, stream):
    messages = [{"role": "user", "content": "Name a colour."}]
    body = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                top_logprobs=3)
    if stream:
        entries = [e for c in streamed(server, "/v1/chat/completions", **body) if c["logprobs"]
                   for e in c["logprobs"]["content"]]
    else:
        entries = post(server, "/v1/chat/completions", **body)["choices"][0]["logprobs"]["content"]
    ids = engine.encode(post(server, "/apply-template", messages=messages)["prompt"])
    reply = greedy_reply(engine, ids, 6)
    rows = model_logprobs(engine, ids + reply)[len(ids) - 1 : -1]
    texts = TokenTexts(tiny_tokenizer())
    assert [e["token"] for e in entries] == [texts.text(t) for t in reply]
    for entry, token, row in zip(entries, reply, rows, strict=True):
        assert entry["bytes"] == list(texts.bytes(token)) and abs(entry["logprob"] - float(row[token])) < TOLERANCE
        values, top = row.topk(3)
        assert [t["token"] for t in entry["top_logprobs"]] == [texts.text(t) for t in top.tolist()]
        assert all(abs(t["logprob"] - float(v)) < TOLERANCE for t, v in zip(entry["top_logprobs"], values))
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy


@pytest.mark.parametrize("stream", [False, True])
def test_text_logprobs_with_the_echoed_prompt_are_the_models(server, engine, stream):
    """OpenAI's legacy shape: the prompt's tokens, then the reply's; each top_logprobs holds the
    two most likely tokens (and the token, were it not one of them); text_offset indexes the text,
    in which the <bos> the server put before the prompt takes no room."""
    body = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, echo=True)
    if stream:
        choices = streamed(server, "/v1/completions", **body)
        text = "".join(c["text"] for c in choices)
        logprobs = {key: [v for c in choices if c["logprobs"] for v in c["logprobs"][key]]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        choice = post(server, "/v1/completions", **body)["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    ids = engine.encode(PROMPT)
    tokens = ids + greedy_reply(engine, ids, 4)
    texts = TokenTexts(tiny_tokenizer())
    assert text == PROMPT + engine.tokenizer.decode(tokens[len(ids) :])
    assert logprobs["tokens"] == [texts.text(t) for t in tokens]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    rows = model_logprobs(engine, tokens)
    for i in range(1, len(tokens)):
        row, token = rows[i - 1], tokens[i]
        assert abs(logprobs["token_logprobs"][i] - float(row[token])) < TOLERANCE
        likely = {texts.text(t): float(row[t]) for t in [*row.topk(2).indices.tolist(), token]}
        assert logprobs["top_logprobs"][i].keys() == likely.keys()
        assert all(abs(logprobs["top_logprobs"][i][t] - lp) < TOLERANCE for t, lp in likely.items())
    for i in range(len(ids), len(tokens)):  # greedy: what lm-evaluation-harness takes for is_greedy
        assert logprobs["token_logprobs"][i] == max(logprobs["top_logprobs"][i].values())
    offsets = logprobs["text_offset"]
    assert offsets[:2] == [0, 0] and offsets[len(ids)] == len(PROMPT) and offsets == sorted(offsets)


def test_echo_alone_scores_a_prompt_of_token_ids(server, engine):
    """lm-evaluation-harness's likelihood request as older versions send it: one prompt of ids in a
    list, nothing generated."""
    ids = engine.encode(PROMPT)
    answer = post(server, "/v1/completions", model="tiny", prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    choice = answer["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == len(ids)
    rows = model_logprobs(engine, ids)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert all(abs(lp - float(rows[i, ids[i + 1]])) < TOLERANCE for i, lp in enumerate(got[1:]))


def test_requests_with_and_without_logprobs_get_the_same_tokens_together_as_alone(server):
    bodies = [dict(model="tiny", prompt=f"{i} little pigs went to market and", max_tokens=6, ignore_eos=True, seed=i,
                   temperature=0 if i % 2 else 0.9, **({"logprobs": i} if i % 3 else {}), echo=i % 4 == 0)
              for i in range(8)]

    def text(body: dict) -> str:
        return post(server, "/v1/completions", **body)["choices"][0]["text"]

    alone = [text(body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        assert list(pool.map(text, bodies)) == alone


BAD = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": TOP_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"logprobs": TOP_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": ["one", "two"]}, "prompt"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD)
def test_bad_logprob_fields_are_400_naming_the_field(server, path, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}]} if path == "/v1/chat/completions" else {"prompt": "hi"}
    reply = httpx.post(server.url + path, json={**body, "max_tokens": 2, **fields}, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param
    assert param in error["message"] and error["message"].endswith(".") and error["message"].count(". ") == 0


def test_prompt_scoring_that_finds_the_pool_full_waits_for_the_running_sequences():
    """Engine work run through EngineLoop.call waits, between steps, while the KV pool has no
    room for it beside the sequences running, and runs once they are done."""
    engine = ScriptedEngine(delay=0.01)
    loop = EngineLoop(engine, engine.stop_token_ids, 8, Metrics())
    busy = []

    def work(engine) -> str:
        busy.append(engine.has_work)
        if engine.has_work:
            raise PoolBusy("the KV pool is full")
        return "scored"

    async def run() -> tuple[str, Finished]:
        gen = loop.submit([2, 10, 11], GenerationParams(max_tokens=5), Detokenizer(engine.tokenizer.decode))
        result = await loop.call(work)
        events = [item async for item in gen.events()]
        return result, events[-1]

    try:
        result, finished = asyncio.run(run())
    finally:
        loop.close()
    assert result == "scored" and busy[0] and not busy[-1]
    assert finished.completion_tokens == 5  # the generation ran to its end meanwhile
