"""Constrained decoding on the tiny synthetic model, whose random weights write gibberish: only the
grammar makes its replies JSON that matches a schema, or tool calls whose arguments match a tool's
parameters. Through the server (whole and streamed, batched), the Python API and the grammar itself."""

from __future__ import annotations

import gc
import json
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
import xgrammar
from server_harness import TINY_MAX_CTX, LiveServer, tiny_engine, tiny_tokenizer

from qat4.chat.call_grammar import CallGrammar
from qat4.chat.grammars import GrammarConstraint, grammars_for
from qat4.checkpoint.synth import synthetic_model
from qat4.config import PRESETS
from qat4.engine import Engine
from qat4.server.app import create_app

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "minimum": -1, "maximum": 1},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                 "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}
BOOKING = {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "guests": {"type": "integer", "minimum": 1, "maximum": 12},
        "time": {"type": "string", "enum": ["lunch", "dinner"]},
        "options": {"type": "object", "properties": {"outside": {"type": "boolean"}, "budget": {
            "type": "number", "minimum": 0, "maximum": 500}}, "required": ["outside"]},
        "notes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["city", "guests", "time"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
BOOK = [{"role": "user", "content": "Book dinner in Rome for four."}]
REQUESTS = 16  # one product of the CPU reference, which multiplies 16 rows at a time


@pytest.fixture(scope="module")
def server():
    """The tiny engine with a slot and KV room for all REQUESTS sequences at once, so they decode
    together rather than preempting one another (constrained sequences preempted and read again:
    test_constrained_sequences_preempted_and_read_again_still_follow_their_grammar)."""
    engine = tiny_engine(max_num_seqs=REQUESTS, kv_tokens=REQUESTS * TINY_MAX_CTX)
    with LiveServer(create_app(engine, model_name="tiny")) as live:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=600) as live.client:
            yield live


def client(server) -> openai.OpenAI:
    """The server's client, which the requests share (it is thread-safe)."""
    return server.client


def allowed_tokens(constraint, vocab_size: int) -> list[int]:
    """The tokens ``constraint`` allows next, in order (its bitmask unpacked: bit j of word i is token 32 i + j)."""
    bitmasks = xgrammar.allocate_token_bitmask(1, vocab_size)
    constraint.fill(bitmasks, 0)
    bits = (bitmasks[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero()[:, 0].tolist()


def many(function, count: int = REQUESTS) -> list:
    """``function(i)`` for i < count, concurrently, so the engine batches the requests."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(function, range(count)))


def read_prompt_once(server, **body) -> None:
    """A one-token request of ``body``'s prompt, so the prompt cache holds it: the concurrent requests
    after it then decode together from their first step, instead of each reading the prompt."""
    reply = client(server).chat.completions.create(model="tiny", max_tokens=1, **body)
    assert reply.choices[0].finish_reason == "length"


def streamed_chat(server, **body) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client(server).chat.completions.create(model="tiny", stream=True, **body):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            calls[call.index] = {"name": call.function.name, "arguments": call.function.arguments}
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_validate(server, stream):
    def one(i: int) -> str:
        body = dict(messages=ASK, response_format=person_format(), max_tokens=200, seed=i,
                    temperature=0 if i % 4 == 0 else 1.0)
        if stream:
            content, _, finish = streamed_chat(server, **body)
        else:
            reply = client(server).chat.completions.create(model="tiny", **body)
            content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert finish == "stop", content
        return content

    read_prompt_once(server, messages=ASK, response_format=person_format())
    for content in many(one):
        person = json.loads(content)
        jsonschema.validate(person, PERSON)
        assert list(person) == [key for key in PERSON["properties"] if key in person]  # in the schema's order


def test_json_object_reply_opens_an_object_and_its_grammar_takes_only_objects(server):
    """The tiny model's random words rarely close a free-form object within a test's tokens, so the
    reply is checked to open one, and the grammar behind it to take an object whole and nothing
    else: an array is refused at the start, and after `}` only a stop token may follow."""
    reply = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=24, seed=1,
                                                    response_format={"type": "json_object"}).choices[0]
    assert reply.message.content.startswith("{")
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    tokenizer, stops = tiny_tokenizer(), tiny_engine().stop_token_ids
    grammars = grammars_for(tokenizer, stops)

    constraint = grammars.json(None)
    assert tokenizer.encode("[")[0] not in allowed_tokens(constraint, grammars.vocab_size)
    for token in tokenizer.encode('{"a": [1, "x"], "b": {"c": null}}'):
        constraint.accept(token)
    assert allowed_tokens(constraint, grammars.vocab_size) == sorted(set(stops))


def test_json_cut_by_max_tokens_is_length(server):
    reply = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, seed=2,
                                                    response_format=person_format())
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate(server, stream):
    def one(i: int) -> list[dict]:
        body = dict(messages=BOOK, tools=[WEATHER, BOOKING], tool_choice="required", max_tokens=200, seed=100 + i,
                    temperature=0 if i % 4 == 0 else 1.0, parallel_tool_calls=i % 2 == 0)
        if stream:
            _, calls, finish = streamed_chat(server, **body)
        else:
            reply = client(server).chat.completions.create(model="tiny", **body)
            finish = reply.choices[0].finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in reply.choices[0].message.tool_calls]
        assert finish == "tool_calls" and calls
        assert i % 2 == 0 or len(calls) == 1
        return calls

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, BOOKING)}
    read_prompt_once(server, messages=BOOK, tools=[WEATHER, BOOKING], tool_choice="required")
    for calls in many(one):
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_named_tool_call_validates(server):
    reply = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Book a table."}], tools=[WEATHER, BOOKING], seed=5,
        tool_choice={"type": "function", "function": {"name": "book_table"}}, max_tokens=200,
        parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "book_table" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), BOOKING["function"]["parameters"])


def test_text_completion_fields(server):
    base = {"model": "tiny", "prompt": "JSON:", "max_tokens": 300, "seed": 3}
    for extra in ({"json_schema": PERSON}, {"response_format": person_format()}):
        reply = httpx.post(server.url + "/v1/completions", json={**base, **extra}, timeout=600).json()
        assert reply["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["choices"][0]["text"]), PERSON)
    gbnf = 'root ::= ("yes" | "no") " " [0-9]'
    reply = httpx.post(server.url + "/v1/completions", json={**base, "grammar": gbnf}, timeout=600).json()
    assert reply["choices"][0]["text"] in {f"{w} {d}" for w in ("yes", "no") for d in range(10)}


@pytest.mark.parametrize("body, param", [
    ({"grammar": "root ::= nothing_defined"}, "grammar"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ({"json_schema": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert "Traceback" not in response.text


def test_python_api_json_schema_and_grammar_state_freed():
    engine = tiny_engine()
    constraint = engine.json_constraint(PERSON)
    ref = weakref.ref(constraint)
    seq = engine.add_request("Person:", max_new_tokens=300, temperature=1.0, seed=9, constraint=constraint)
    del constraint
    tokens = []
    while not seq.finished:
        tokens += [out.token for out in engine.step() if out.seq is seq]
    engine.drain()
    assert seq.finish_reason == "stop" and seq.constraint is None
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens[:-1])), PERSON)
    gc.collect()
    assert ref() is None
    aborted = engine.add_request("Person:", max_new_tokens=300, seed=9, constraint=engine.json_constraint(PERSON))
    engine.step()
    engine.abort(aborted)
    assert aborted.constraint is None
    engine.drain()
    generation = engine.generate("Person:", max_new_tokens=300, temperature=0, json_schema=PERSON)
    jsonschema.validate(json.loads(generation.text), PERSON)


def test_constrained_sequences_preempted_and_read_again_still_follow_their_grammar():
    """A pool of 128 positions holds four prompts but not their replies: sequences are preempted
    mid-reply and read again, prompt and output, while their grammars keep their place; each reply
    is the one the same seeded request gets where the pool holds them all, and validates."""
    requests = [("Person:", i) for i in range(4)]
    cramped = Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=128, kv_tokens=128,
                                 tokenizer=tiny_tokenizer())
    replies = []
    for engine in (cramped, tiny_engine()):
        seqs = [engine.add_request(prompt, max_new_tokens=120, temperature=1.0, seed=seed,
                                   constraint=engine.json_constraint(PERSON)) for prompt, seed in requests]
        engine.drain()
        assert all(seq.finish_reason == "stop" and seq.constraint is None for seq in seqs)
        replies.append([seq.output for seq in seqs])
        if engine is cramped:
            assert engine.scheduler.preempted_total > 0
    assert replies[0] == replies[1]
    for tokens in replies[0]:
        jsonschema.validate(json.loads(cramped.tokenizer.decode(tokens[:-1])), PERSON)


def test_a_constraint_switched_on_mid_reply_drops_the_token_picked_without_it():
    """Auto mode: a call grammar that a token the model writes switches on (here its first greedy
    token stands in for `<|tool_call>`). The engine had launched the next token before reading that
    one: it is dropped, its position fed again under the mask, and the call that follows parses."""
    from qat4.chat import parse_reply

    engine = tiny_engine()
    first = engine.generate("Book it:", max_new_tokens=1, temperature=0).tokens[0]
    compiled = grammars_for(engine.tokenizer, engine.stop_token_ids).compiled("ebnf", CallGrammar([BOOKING]).text("open"))
    seq = engine.add_request("Book it:", max_new_tokens=64, temperature=0,  # the call closes at token 58
                             constraint=GrammarConstraint(compiled, trigger=first))
    engine.drain()
    assert seq.output[0] == first and seq.stale == 0
    text = engine.tokenizer.decode(seq.output[1:])
    assert text.startswith("call:book_table{")
    call_text = text[: text.index("<tool_call|>") + len("<tool_call|>")]
    (call,) = parse_reply("<|tool_call>" + call_text).tool_calls
    jsonschema.validate(call["arguments"], BOOKING["function"]["parameters"])


def test_a_constrained_row_gets_a_token_from_every_step_beside_free_rows():
    """A constrained row's pick waits for its mask, not its whole step: beside an unconstrained
    request it gets a token from every step, as the free row does."""
    engine = tiny_engine()
    free = engine.add_request("Person:", max_new_tokens=40, temperature=0, stop_token_ids=[])
    constrained = engine.add_request("Person:", max_new_tokens=40, temperature=0,
                                     constraint=engine.json_constraint(PERSON))
    steps = 0
    while engine.has_work:
        running = not constrained.finished
        served = {out.seq for out in engine.step()}
        if free in served and running:
            assert constrained in served
            steps += 1
    assert steps == len(constrained.output) == 40


def test_a_call_grammar_waiting_for_its_trigger_leaves_its_row_free_beside_masked_rows():
    """Auto mode, a call made and closed: the grammar waits for the next `<|tool_call>` and the
    row picks freely again, also in steps whose other rows pick under masks; its reply is the one
    it writes alone (a stale mask from the call would have steered it)."""
    def reply(beside: bool) -> list[int]:
        engine = tiny_engine()
        first = engine.generate("Book it:", max_new_tokens=1, temperature=0).tokens[0]
        compiled = grammars_for(engine.tokenizer, engine.stop_token_ids).compiled("ebnf", CallGrammar([BOOKING]).text("open"))
        seq = engine.add_request("Book it:", max_new_tokens=66, temperature=0, stop_token_ids=[],
                                 constraint=GrammarConstraint(compiled, trigger=first))  # the call closes at token 58
        if beside:
            letters = grammars_for(engine.tokenizer, engine.stop_token_ids).gbnf("root ::= [a-z]+")
            engine.add_request("Letters:", max_new_tokens=66, temperature=0, stop_token_ids=[], constraint=letters)
        engine.drain()
        return seq.output

    alone = reply(beside=False)
    assert "<tool_call|>" in tiny_tokenizer().decode(alone)[:-10]  # the call closed, free tokens follow
    assert reply(beside=True) == alone


@pytest.mark.parametrize("parallel", [True, False])
def test_an_opened_call_is_constrained_then_the_reply_is_free_again_or_ends(parallel):
    """Auto mode: free until `<|tool_call>`, the call's grammar until `<tool_call|>`; then free
    again for more calls, or (parallel_tool_calls false) only a stop token."""
    tokenizer, stops = tiny_tokenizer(), tiny_engine().stop_token_ids
    grammars = grammars_for(tokenizer, stops)
    constraint = grammars.tool_calls([WEATHER], "open", parallel=parallel)
    for token in tokenizer.encode("Let me look."):
        constraint.accept(token)
    assert not constraint.active
    constraint.accept(grammars.call_open)
    assert constraint.active
    for token in tokenizer.encode('call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'):
        constraint.accept(token)
    assert constraint.active is not parallel
    if not parallel:
        assert allowed_tokens(constraint, grammars.vocab_size) == sorted(set(stops))


def test_call_grammar_follows_the_parser():
    """Texts the grammar accepts are calls qat4's parser reads with the same values."""
    from qat4.chat import parse_reply

    grammar = CallGrammar([BOOKING]).text("name")
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([b"x"])).compile_grammar(grammar)
    good = 'book_table{city:<|"|>Rome<|"|>,guests:4,time:<|"|>dinner<|"|>,options:{outside:false,budget:12.5}}<tool_call|>'
    assert xgrammar.GrammarMatcher(compiled).accept_string(good)
    reply = parse_reply("<|tool_call>call:" + good)
    assert reply.tool_calls[0]["arguments"]["options"] == {"outside": False, "budget": 12.5}
    for bad in ('book_table{guests:4,time:<|"|>dinner<|"|>}<tool_call|>',  # city is required
                'book_table{city:<|"|>Rome<|"|>,guests:13,time:<|"|>dinner<|"|>}<tool_call|>',  # guests <= 12
                'book_table{city:<|"|>Ro<tool_call|>',  # a marker inside a string
                'book_table{city:<|"|>Rome<|"|>,guests:4,time:<|"|>noon<|"|>}<tool_call|>'):  # not in the enum
        assert not xgrammar.GrammarMatcher(compiled).accept_string(bad), bad


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 5},
                                    {"type": "string", "minLength": 1}, {"type": "string", "pattern": "^a"}])
def test_json_strings_never_hold_markup_or_control_characters(string, thinking):
    """With thinking on the grammar is compiled over a vocabulary that keeps line breaks and tabs
    (a thought block holds them): the JSON's own rules must still keep them out of its strings."""
    grammars = grammars_for(tiny_tokenizer(), tiny_engine().stop_token_ids)
    constraint: GrammarConstraint = grammars.json({"type": "object", "properties": {"a": string}}, thinking)
    for token in tiny_tokenizer().encode('{"a": "'):
        constraint.accept(token)
    allowed = set(allowed_tokens(constraint, grammars.vocab_size))
    markers = [tiny_tokenizer().token_to_id(t) for t in ("<turn|>", "<|tool_call>", "<|channel>", "<eos>")]
    controls = [tiny_tokenizer().pieces().index(c) for c in ("\t", "\n", "<0x00>", "<0x1F>")]
    assert not allowed & set(markers + controls)
    assert tiny_tokenizer().encode("a")[0] in allowed


@pytest.mark.parametrize("prefix", ["", "<|channel>", "<|channel>thought\n"])
def test_a_thought_block_may_come_before_json(prefix):
    """With thinking on the reply may open with a thought block (line breaks and tabs in it), its
    opening perhaps already in the prompt; the JSON follows and then only a stop token."""
    from qat4.chat import Reply, parse_reply

    tokenizer, stops = tiny_tokenizer(), tiny_engine().stop_token_ids
    grammars = grammars_for(tokenizer, stops)
    constraint = grammars.json({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}},
                               thinking=True, prefix=prefix)
    reply = '<|channel>thought\nweigh\tit\n<channel|>{"a": "x"}'.removeprefix(prefix)
    for token in tokenizer.encode(reply):
        constraint.accept(token)
    assert allowed_tokens(constraint, grammars.vocab_size) == sorted(set(stops))
    assert parse_reply(prefix + reply, thinking=True) == Reply('{"a": "x"}', "weigh\tit")
