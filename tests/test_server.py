"""The HTTP server over real loopback HTTP, driven by the official `openai` client and httpx.

Two engines: the real engine on the tiny synthetic model (random weights, so replies are
gibberish and only their structure is checked), and a scripted engine that replays a known reply
through the real tokenizer, for tool calls, thinking, queueing and cancellation.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from server_harness import TINY_MAX_CTX, LiveServer, ScriptedEngine, tiny_engine, wait_until

from qat4.cli import main
from qat4.commands import serve
from qat4.server.app import create_app

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
QUESTION = {"role": "user", "content": "What is the weather in Paris right now?"}
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "decode_ms", "decode_tok_per_s",
               "draft_n", "draft_n_accepted"}


def openai_client(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def metric(text: str, name: str) -> float:
    """The value of one sample line (`name` includes any labels) in Prometheus text."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def real():
    with LiveServer(create_app(tiny_engine(), model_name="tiny")) as server:
        yield server


def test_a_speculating_server_reports_its_drafts_and_answers_as_a_plain_one(real):
    """Prompt lookup on a prompt that repeats itself: the greedy reply is the plain server's, and
    the timings and /metrics count the draft tokens verified and kept."""
    prompt = "one two three four five six seven eight " * 6
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    plain = httpx.post(real.url + "/v1/completions", json=body, timeout=120).json()
    with LiveServer(create_app(tiny_engine(speculative="ngram", spec_tokens=3, spec_adaptive=False),
                               model_name="tiny")) as spec:
        reply = httpx.post(spec.url + "/v1/completions", json=body, timeout=120).json()
        metrics = httpx.get(spec.url + "/metrics").text
    assert reply["choices"][0]["text"] == plain["choices"][0]["text"]
    timings = reply["timings"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert plain["timings"]["draft_n"] == 0
    assert f"qat4_spec_draft_tokens_total {timings['draft_n']}" in metrics
    assert f"qat4_spec_accepted_tokens_total {timings['draft_n_accepted']}" in metrics


@pytest.fixture
def scripted():
    engine = ScriptedEngine()
    with LiveServer(create_app(engine, model_name="scripted", max_queue=1)) as server:
        server.engine = engine
        yield server


# ---- the real engine -------------------------------------------------------------------------


def test_models_and_health(real):
    models = openai_client(real).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = models.data[0].model_dump()
    assert card["owned_by"] == "qat4"
    assert card["context_length"] == card["max_model_len"] == TINY_MAX_CTX
    health = httpx.get(real.url + "/health").json()
    assert health["status"] == "ok" and health["queue_depth"] == 0
    assert (health["device"], health["max_ctx"]) == ("cpu", TINY_MAX_CTX)
    assert health["max_num_seqs"] == tiny_engine().max_num_seqs
    assert health["memory"]["resident_mib"] > 0


def test_chat_plain_and_streamed(real):
    client = openai_client(real)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    args = dict(model="tiny", messages=messages, max_tokens=4, temperature=0)
    resp = client.chat.completions.create(**args)
    assert resp.object == "chat.completion" and resp.model == "tiny"
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    prompt = httpx.post(real.url + "/apply-template", json={"messages": messages}).json()["prompt"]
    prompt_ids = httpx.post(real.url + "/tokenize", json={"content": prompt}).json()["tokens"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= resp.usage.completion_tokens <= 4
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    timings = resp.model_extra["timings"]
    assert TIMING_KEYS <= set(timings) and timings["prompt_n"] + timings["cache_n"] == len(prompt_ids)
    assert timings["cache_n"] == resp.usage.prompt_tokens_details.cached_tokens
    assert timings["predicted_n"] == resp.usage.completion_tokens

    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")  # greedy: the same reply both ways
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [f.finish_reason for f in finishes] == [choice.finish_reason]
    assert TIMING_KEYS <= set(chunks[-2].model_extra["timings"])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (resp.usage.prompt_tokens,
                                                                                          resp.usage.completion_tokens)
    # the same prompt again: its whole blocks but the one holding its last token come from the prompt cache
    block = real.app.state.engine_loop.engine.pool.block_size
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // block * block


def test_text_completions_plain_streamed_and_stop(real):
    client = openai_client(real)
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
    plain = client.completions.create(**args)
    text = plain.choices[0].text
    assert plain.object == "text_completion" and plain.usage.completion_tokens <= 4 and len(text) >= 2
    assert "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices) == text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(**args, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_tokenize_detokenize(real):
    tokens = httpx.post(real.url + "/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    assert tokens[0] == 2 and len(tokens) >= 2
    assert httpx.post(real.url + "/detokenize", json={"tokens": tokens[1:]}).json() == {"content": "Hello world",
                                                                                        "prompt": "Hello world"}


def test_tokenizer_endpoints_answer_as_vllm_for_remote_tokenizers(real):
    """lm-evaluation-harness tokenizes through a server that answers /tokenizer_info and vLLM's
    /tokenize fields, so it needs no copy of the tokenizer."""
    info = httpx.get(real.url + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<bos>", "<eos>") and "<|turn>" in info["chat_template"]
    tokens = httpx.post(real.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tokens["tokens"] == tokens_of(real, "Hello world") and tokens["count"] == len(tokens["tokens"])
    assert httpx.post(real.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    missing = httpx.post(real.url + "/tokenize", json={"add_special": True})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "content"


def tokens_of(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]


def test_apply_template_tool_round_trip(real):
    messages = [QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
    prompt = httpx.post(real.url + "/apply-template", json={"messages": messages, "tools": [WEATHER_TOOL]}).json()["prompt"]
    assert prompt == (
        '<bos><|turn>system\n<|tool>declaration:get_weather{description:<|"|>Current weather for a city<|"|>,'
        'parameters:{properties:{city:{type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}'
        '<tool|><turn|>\n<|turn>user\nWhat is the weather in Paris right now?<turn|>\n<|turn>model\n'
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>{"temp_c": 18}<|"|>}<tool_response|>')


@pytest.mark.parametrize("body, status, param", [
    (b'{"messages": [', 400, None),
    (b'[1, 2]', 400, None),
    (b'{}', 400, "messages"),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 7}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}', 400, "stop"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools[0].function"),
    (b'{"messages": [{"role": "tool", "content": "18", "tool_call_id": "x"}]}', 400, "messages"),
])
def test_bad_requests_name_the_field(real, body, status, param):
    resp = httpx.post(real.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].endswith(".") and "\n" not in error["message"]
    if param and param != "messages":
        assert f"'{param}'" in error["message"]


def test_context_overflow_states_both_numbers(real):
    client = openai_client(real)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10_000)
    message = info.value.body["message"]
    assert "10000" in message and str(TINY_MAX_CTX) in message and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
    assert str(TINY_MAX_CTX) in info.value.body["message"] and "prompt has" in info.value.body["message"]


def test_other_errors_have_openai_shape(real):
    resp = httpx.get(real.url + "/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    resp = httpx.post(real.url + "/detokenize", json={"tokens": [5, 10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens[1]"
    resp = httpx.post(real.url + "/v1/completions", json={"prompt": {"x": 1}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_decode_rate_needs_two_decode_steps(real):
    """With 2 tokens (one decode step) no rate is reported; with 4, a positive one."""
    rates = []
    for n in (2, 4):
        body = {"prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        timings = httpx.post(real.url + "/v1/completions", json=body, timeout=60).json()["timings"]
        assert timings["predicted_n"] == n
        rates.append((timings["decode_tok_per_s"], timings["predicted_per_second"]))
    assert rates[0] == (None, None) and rates[1][0] > 0 and rates[1][0] == rates[1][1]


def test_metrics_move(real):
    before = httpx.get(real.url + "/metrics").text
    openai_client(real).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    httpx.post(real.url + "/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    after = httpx.get(real.url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    ok, bad = ('qat4_requests_total{endpoint="/v1/chat/completions",status="%s"}' % s for s in ("200", "400"))
    assert metric(after.text, ok) == metric(before, ok) + 1
    assert metric(after.text, bad) == metric(before, bad) + 1
    assert metric(after.text, "qat4_generated_tokens_total") > metric(before, "qat4_generated_tokens_total")
    assert metric(after.text, "qat4_prompt_tokens_total") > metric(before, "qat4_prompt_tokens_total")
    assert metric(after.text, "qat4_time_to_first_token_seconds_count") == metric(before, "qat4_time_to_first_token_seconds_count") + 1
    moved = {name: metric(after.text, name) - metric(before, name) for name in (
        "qat4_time_to_first_token_seconds_sum", "qat4_request_queue_seconds_sum", "qat4_request_prefill_seconds_sum",
        "qat4_request_queue_seconds_count", "qat4_request_prefill_seconds_count", "qat4_time_per_output_token_seconds_count")}
    assert moved["qat4_request_queue_seconds_count"] == moved["qat4_request_prefill_seconds_count"] == 1
    assert moved["qat4_time_per_output_token_seconds_count"] == 1  # two tokens: one gap
    # the first token's wait, split at the admission into the batch
    assert moved["qat4_request_queue_seconds_sum"] + moved["qat4_request_prefill_seconds_sum"] == pytest.approx(
        moved["qat4_time_to_first_token_seconds_sum"], abs=1e-5)
    assert moved["qat4_request_queue_seconds_sum"] >= 0 and moved["qat4_request_prefill_seconds_sum"] > 0
    assert metric(after.text, 'qat4_request_duration_seconds_bucket{le="+Inf"}') > metric(before, 'qat4_request_duration_seconds_bucket{le="+Inf"}')
    assert "# TYPE qat4_queue_depth gauge" in after.text and metric(after.text, "qat4_queue_depth") == 0
    assert metric(after.text, "qat4_batch_size_count") > metric(before, "qat4_batch_size_count")
    assert "qat4_kv_pool_usage{layer_type=\"full_attention\"}" in after.text
    httpx.get(real.url + "/v1/models/tiny")
    counted = httpx.get(real.url + "/metrics").text
    assert metric(counted, 'qat4_requests_total{endpoint="/v1/models/{id}",status="200"}') == 1
    # the split is the engine's admission: the prefill part is the reply's prompt_ms
    mark = httpx.get(real.url + "/metrics").text
    timings = httpx.post(real.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).json()["timings"]
    prefill = metric(httpx.get(real.url + "/metrics").text, "qat4_request_prefill_seconds_sum") - metric(
        mark, "qat4_request_prefill_seconds_sum")
    assert prefill == pytest.approx(timings["prompt_ms"] / 1e3, abs=1e-5)


def test_api_key():
    with LiveServer(create_app(tiny_engine(), api_key="sekret", model_name="tiny")) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            resp = httpx.get(server.url + "/v1/models", headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(server.url + "/tokenize", json={"content": "x"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, "wrong").models.list()
        assert openai_client(server, "sekret").models.list().data[0].id == "tiny"


# ---- the scripted engine: exact replies ------------------------------------------------------


def test_tool_call(scripted):
    scripted.engine.reply = WEATHER_CALL
    resp = openai_client(scripted).chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER_TOOL])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<|tool>declaration:get_weather{" in scripted.engine.prompt_text()


def test_tool_call_streamed(scripted):
    scripted.engine.reply = WEATHER_CALL
    chunks = list(openai_client(scripted).chat.completions.create(
        model="m", messages=[QUESTION], tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content for d in deltas)
    (call,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.reply = WEATHER_CALL
    first = client.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    engine.reply = "It is 18 °C in Paris.<turn|>"
    messages = [QUESTION, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is 18 °C in Paris." and second.choices[0].finish_reason == "stop"
    assert engine.prompt_text().endswith(
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>{"temp_c": 18}<|"|>}<tool_response|>')


def test_thinking_is_returned_separately(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.reply = "<|channel>thought\nThe user greets me.<channel|>Hello there!<turn|>"
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], extra_body=on)
    assert resp.choices[0].message.content == "Hello there!"
    assert resp.choices[0].message.model_extra["reasoning_content"] == "The user greets me."
    assert "<|think|>" in engine.prompt_text()
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                 extra_body=on, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "The user greets me."
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])


@pytest.mark.parametrize("stream", [False, True])
def test_a_thought_block_is_dropped_when_thinking_is_off(scripted, stream):
    engine = scripted.engine
    engine.reply = "<|channel>thought\nThe user greets me.<channel|>Hello there!<turn|>"
    resp = openai_client(scripted).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                           stream=stream)
    if stream:
        deltas = [c.choices[0].delta for c in resp if c.choices]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    else:
        content, reasoning = resp.choices[0].message.content, resp.choices[0].message.model_extra["reasoning_content"]
    assert content == "Hello there!" and not reasoning


def test_thinking_switches(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.reply = "Hello there!<turn|>"
    hi = [{"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model="m", messages=hi)
    assert "<|think|>" not in engine.prompt_text()
    assert resp.choices[0].message.content == "Hello there!"
    assert "reasoning_content" in resp.choices[0].message.model_extra  # a client may read it unguarded
    assert resp.choices[0].message.model_extra["reasoning_content"] is None
    client.chat.completions.create(model="m", messages=hi, reasoning_effort="low")
    assert "<|think|>" in engine.prompt_text()
    client.chat.completions.create(model="m", messages=hi, reasoning_effort="none")
    assert "<|think|>" not in engine.prompt_text()


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_is_prefilled(scripted, stream):
    engine = scripted.engine
    engine.reply = 'city:<|"|>Rome<|"|>}<tool_call|><|tool_response>'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = openai_client(scripted).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], tool_choice=choice, stream=stream)
    if stream:
        (call,) = [tc for c in resp for tc in c.choices[0].delta.tool_calls or []]
    else:
        (call,) = resp.choices[0].message.tool_calls
    assert engine.prompt_text().endswith("<|turn>model\n<|tool_call>call:get_weather{")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}


def test_forced_tool_call_cut_by_max_tokens_is_reported_unfinished(scripted):
    """No markup in content; the partial call in tool_calls with the text written so far (not JSON,
    so LangChain files it under invalid_tool_calls); finish_reason length. Streamed and whole agree."""
    scripted.engine.reply = 'city:<|"|>Rome<|"|>}<tool_call|><|tool_response>'
    args = dict(model="m", messages=[QUESTION], tools=[WEATHER_TOOL], max_tokens=4,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    client = openai_client(scripted)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{city:<|"|>Rome'
    chunks = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content for d in deltas)
    (streamed,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert (streamed.index, streamed.function.name, streamed.function.arguments) == (0, "get_weather", '{city:<|"|>Rome')
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_tool_schema_guides_repairs_whole_and_streamed(scripted):
    """A string argument the model wrote without delimiters (commas and all) is recovered because the
    tool's schema types it as a string."""
    scripted.engine.reply = "<|tool_call>call:get_weather{city:Paris, France<tool_call|><|tool_response>"
    args = dict(model="m", messages=[QUESTION], tools=[WEATHER_TOOL])
    client = openai_client(scripted)
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert json.loads(whole.message.tool_calls[0].function.arguments) == {"city": "Paris, France"}
    chunks = list(client.chat.completions.create(**args, stream=True))
    (streamed,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert json.loads(streamed.function.arguments) == {"city": "Paris, France"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_and_none_tool_choice(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.reply = 'get_weather{city:<|"|>Oslo<|"|>}<tool_call|><|tool_response>'
    resp = client.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER_TOOL], tool_choice="required")
    assert engine.prompt_text().endswith("<|turn>model\n<|tool_call>call:")
    assert json.loads(resp.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    engine.reply = "No tools today.<turn|>"
    resp = client.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER_TOOL], tool_choice="none")
    assert "<|tool>" not in engine.prompt_text() and resp.choices[0].message.content == "No tools today."
    bad = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER_TOOL], tool_choice=bad)
    assert info.value.body["param"] == "tool_choice"


def test_json_response_format(scripted):
    engine = scripted.engine
    engine.reply = '"answer": 42}<turn|>'
    resp = openai_client(scripted).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Answer as JSON."}], response_format={"type": "json_object"})
    assert json.loads(resp.choices[0].message.content) == {"answer": 42}
    prompt = engine.prompt_text()
    assert "valid JSON object" in prompt and prompt.endswith("<|turn>model\n{")


def test_stop_strings_and_length(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.reply = "alpha beta STOP gamma<turn|>"
    resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stop="STOP")
    assert resp.choices[0].message.content == "alpha beta" and resp.choices[0].finish_reason == "stop"
    engine.reply = "endless"
    resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5


def test_unexpected_engine_error_is_500_and_server_continues(scripted):
    client, engine = openai_client(scripted), scripted.engine
    engine.error = RuntimeError("kaboom")
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.status_code == 500 and info.value.body["type"] == "server_error"
    with httpx.stream("POST", scripted.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["message"] == "kaboom" and events[-1] == "[DONE]"
    engine.error, engine.reply = None, "Fine again.<turn|>"
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}]).choices[0].message.content == "Fine again."


def test_a_broken_engine_fails_every_request_and_health_says_so(scripted):
    """Every step raising (a device error that stays): the request in flight gets a 500, /health
    answers 503 with the error, and later requests a 503 at once instead of waiting forever."""
    client, engine = openai_client(scripted), scripted.engine
    engine.reply, engine.step_error = "endless", RuntimeError("device lost")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert wait_until(lambda: httpx.get(scripted.url + "/health").status_code == 503)
    health = httpx.get(scripted.url + "/health").json()
    assert health["status"] == "error" and "device lost" in health["error"]
    start = time.perf_counter()
    later = httpx.post(scripted.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert later.status_code == 503 and "device lost" in later.json()["error"]["message"]
    assert time.perf_counter() - start < 2


# ---- queueing and cancellation ---------------------------------------------------------------

LONG = {"messages": [{"role": "user", "content": "Talk."}], "stream": True, "max_tokens": 3000}


def test_queue_overflow_is_429_and_loop_stays_responsive(scripted):
    engine = scripted.engine
    engine.reply, engine.delay = "endless", 0.01
    with httpx.Client(base_url=scripted.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=LONG) as running:
            assert running.status_code == 200
            assert wait_until(lambda: engine.produced > 0)
            with http.stream("POST", "/v1/chat/completions", json=LONG) as waiting:
                assert waiting.status_code == 200
                assert wait_until(lambda: httpx.get(scripted.url + "/health").json()["queue_depth"] == 1)
                start = time.perf_counter()
                rejected = httpx.post(scripted.url + "/v1/chat/completions", json=LONG)
                assert time.perf_counter() - start < 2
                assert rejected.status_code == 429 and int(rejected.headers["Retry-After"]) >= 1
                assert rejected.json()["error"]["code"] == "queue_full"
                assert "qat4_queue_rejections_total 1" in httpx.get(scripted.url + "/metrics").text
    assert wait_until(lambda: _load(scripted) == {
        "status": "ok", "model": "scripted", "queue_depth": 0, "running": 0, "busy": False,
        "kv_pool_usage": {"full_attention": 0.0}})
    assert len(engine.prompts) == 1  # the waiting request left before it started: never run


def _load(server: LiveServer) -> dict:
    """/health's fields about the server's load."""
    health = httpx.get(server.url + "/health").json()
    return {k: health[k] for k in ("status", "model", "queue_depth", "running", "busy", "kv_pool_usage")}


def _stops_soon(engine: ScriptedEngine) -> bool:
    """The engine stops producing within a second and stays stopped."""
    def settled() -> bool:
        before = engine.produced
        time.sleep(0.2)
        return engine.produced == before
    return wait_until(settled, timeout=2)


def test_disconnect_cancels_streamed_generation(scripted):
    """The generation stops, and the tokens it streamed before still count in the metrics."""
    engine = scripted.engine
    engine.reply, engine.delay = "endless", 0.01
    before = metric(httpx.get(scripted.url + "/metrics").text, "qat4_generated_tokens_total")
    with httpx.stream("POST", scripted.url + "/v1/chat/completions", json=LONG, timeout=30) as resp:
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
    assert _stops_soon(engine) and engine.produced < 500
    counted = metric(httpx.get(scripted.url + "/metrics").text, "qat4_generated_tokens_total") - before
    assert 4 <= counted <= engine.produced  # 10 lines: the role chunk, 4 tokens and their blank lines


def test_disconnect_cancels_plain_generation(scripted):
    engine = scripted.engine
    engine.reply, engine.delay = "endless", 0.01
    body = {**LONG, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert _stops_soon(engine) and engine.produced < 500
    engine.reply, engine.delay = "Still here.<turn|>", 0.0
    resp = openai_client(scripted).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert resp.choices[0].message.content == "Still here."


def test_concurrent_requests_queue_and_all_finish():
    engine = ScriptedEngine("Done.<turn|>", delay=0.005)
    with LiveServer(create_app(engine, max_queue=4)) as server:
        client = openai_client(server)
        results: list[str] = []

        def ask() -> None:
            resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
            results.append(resp.choices[0].message.content)

        threads = [threading.Thread(target=ask) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert results == ["Done."] * 5


def test_serve_command_builds_the_app(monkeypatch, tmp_path):
    seen: dict = {}
    monkeypatch.setattr(serve, "load_engine", lambda command, model, device, **options:
                        seen.update(model=model, device=device, **options) or tiny_engine())
    monkeypatch.setattr(uvicorn.Server, "run", lambda server: seen.update(config=server.config))
    folder = tmp_path / "my-gemma"
    folder.mkdir()
    assert main(["serve", "--model", str(folder), "--device", "cpu", "--port", "9999", "--api-key", "k",
                 "--max-queue", "3", "--max-ctx", "256"]) == 0
    assert seen["model"] == str(folder) and seen["device"] == "cpu" and seen["max_ctx"] == 256
    assert seen["config"].host == "127.0.0.1" and seen["config"].port == 9999
    app = seen["config"].app
    assert app.state.model_name == "my-gemma" and app.state.engine_loop.max_waiting == 3
    with TestClient(app, base_url="http://127.0.0.1:9999") as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "my-gemma"
        # listening on loopback: another Host name (a rebound DNS name) reaches nothing
        assert client.get("/health", headers={"Host": "evil.example:9999"}).status_code == 403


SERVE_SCRIPTED = """
import sys
sys.path.insert(0, {tests!r})
import uvicorn
from server_harness import ScriptedEngine
from qat4.commands.serve import _Server
from qat4.server.app import create_app
app = create_app(ScriptedEngine("endless", delay=0.01), max_queue=2)
_Server(uvicorn.Config(app, host="127.0.0.1", port={port}, log_level="warning"), app.state.engine_loop.close).run()
"""


def test_ctrl_c_ends_open_answers_at_once(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = SERVE_SCRIPTED.format(tests=str(Path(__file__).parent), port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(up, timeout=60)
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=LONG) as running, \
                    http.stream("POST", "/v1/chat/completions", json=LONG) as waiting:
                assert wait_until(lambda: httpx.get(url + "/health").json()["queue_depth"] == 1)
                proc.send_signal(signal.SIGINT)
                start = time.perf_counter()
                tails = [[line for line in r.iter_lines() if line][-1] for r in (running, waiting)]
                assert time.perf_counter() - start < 2
        assert tails == ["data: [DONE]", "data: [DONE]"]
        proc.wait(timeout=15)
    finally:
        proc.kill()
    log = proc.stdout.read()
    assert proc.returncode in (-signal.SIGINT, 0) and "Exception in ASGI application" not in log, log


def test_small_plain_requests_are_prepared_on_the_event_loop_and_the_rest_in_a_worker(scripted):
    """A hop to a worker thread and back waits its turn for the interpreter under load, so a small
    request without a grammar is parsed and encoded on the event loop; a grammar's compilation, a
    long prompt's encoding and a long chat's or a tool call's rendering go to a worker thread and
    never hold the other streams."""
    engine, client = scripted.engine, openai_client(scripted)
    threads = []
    encode = engine.encode
    engine.encode = lambda prompt: (threads.append(threading.current_thread().name)  # noqa: E731
                                    if threading.current_thread().name != "qat4-engine" else None) or encode(prompt)
    engine.reply = '"a": 1}<turn|>'
    ask = lambda content, **extra: client.chat.completions.create(  # noqa: E731
        model="m", messages=[{"role": "user", "content": content}], max_completion_tokens=4, **extra)
    ask("Hi")
    client.completions.create(model="m", prompt="Hi", max_tokens=2)
    client.completions.create(model="m", prompt=[1000 + i for i in range(1500)], max_tokens=2)  # 9 KB of ids
    ask("Hi", response_format={"type": "json_object"})
    ask("hello " * 400)  # a text body over INLINE_TEXT_BYTES
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}] * 17, max_completion_tokens=4)
    called = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    client.chat.completions.create(model="m", max_completion_tokens=4, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [called]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}])
    loop_thread = scripted._thread.name  # uvicorn's event loop runs in the LiveServer's thread
    assert threads[:3] == [loop_thread] * 3 and len(threads) == 7
    assert loop_thread not in threads[3:]


def test_the_chat_template_is_compiled_when_the_app_is_built():
    """A small chat is rendered on the event loop, so the template's first compilation comes before any request."""
    from qat4.chat import template

    template._compile.cache_clear()
    create_app(ScriptedEngine(), model_name="scripted")
    assert template._compile.cache_info().currsize == 1
