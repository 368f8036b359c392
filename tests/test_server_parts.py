"""The server's pure pieces: incremental decoding, stop strings, Prometheus text, prompt building."""

from __future__ import annotations

import pytest
from server_harness import tiny_tokenizer

from qat4.server.chat_prompt import build_chat_prompt
from qat4.server.completions import TEXT_SLOT, sse, sse_of_text
from qat4.server.errors import APIError
from qat4.server.generation import IncrementalDecoder, StopStrings
from qat4.server.metrics import Metrics
from qat4.server.schemas import ChatCompletionRequest


def test_incremental_decoder_never_splits_a_character():
    tokenizer = tiny_tokenizer()
    text = "Grüße, 世界! 🎉🦙 <|tool_call>call:f{}<tool_call|> done"
    decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids))
    deltas = [decoder.push(t) for t in tokenizer.encode(text)]
    deltas.append(decoder.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("pieces, stops, out, hit", [
    (["hel", "lo wo", "rld"], ["lo w"], "hel", True),
    (["abc ST", "OP more"], ["STOP"], "abc ", True),
    (["abc ST", "AY"], ["STOP"], "abc STAY", False),
    (["no stops here"], [], "no stops here", False),
    (["x", "y", "END", "z"], ["Q", "END"], "xy", True),
])
def test_stop_strings(pieces, stops, out, hit):
    cutter = StopStrings(stops)
    emitted = "".join(cutter.feed(p) for p in pieces) + cutter.flush()
    assert emitted == out and cutter.hit == hit


def test_stop_strings_hold_back_only_a_possible_match():
    cutter = StopStrings(["</answer>"])
    assert cutter.feed("text </ans") == "text "
    assert cutter.feed("wer") == ""
    assert cutter.feed("! more") == "</answer! more"


def test_prometheus_text():
    metrics = Metrics()
    metrics.requests.inc("/v1/chat/completions", "200")
    metrics.requests.inc("/v1/chat/completions", "200")
    metrics.requests.inc('odd"path', "404")
    for seconds in (0.003, 0.2, 1000.0):
        metrics.latency.observe(seconds)
    metrics.queue_depth.set(3)
    text = metrics.render()
    assert 'qat4_requests_total{endpoint="/v1/chat/completions",status="200"} 2\n' in text
    assert 'qat4_requests_total{endpoint="odd\\"path",status="404"} 1\n' in text
    assert 'qat4_request_duration_seconds_bucket{le="0.005"} 1\n' in text
    assert 'qat4_request_duration_seconds_bucket{le="0.25"} 2\n' in text
    assert 'qat4_request_duration_seconds_bucket{le="+Inf"} 3\n' in text
    assert "qat4_request_duration_seconds_count 3\n" in text
    assert "qat4_request_duration_seconds_sum 1000.203\n" in text
    assert "# TYPE qat4_queue_depth gauge\nqat4_queue_depth 3\n" in text
    assert "qat4_generated_tokens_total 0\n" in text


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **body})


def test_json_instruction_joins_the_system_message():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
                     {"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    prompt = build_chat_prompt(req)
    assert prompt.text.startswith("<bos><|turn>system\nBe terse. Answer with a single valid JSON object")
    assert 'It must match this JSON schema: {"type": "object"}' in prompt.text
    assert prompt.text.endswith("<|turn>model\n{") and prompt.reply_prefix == "{"


def after_a_tool_result(**fields) -> ChatCompletionRequest:
    """A chat with thinking on whose last message is a tool's result, with more request ``fields``."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "tools": [tool], "chat_template_kwargs": {"enable_thinking": True}, **fields})


def test_forced_call_after_an_open_thought_closes_it():
    prompt = build_chat_prompt(after_a_tool_result(tool_choice="required"))
    assert prompt.text.endswith("<tool_response|><|channel>thought\n<channel|><|tool_call>call:")
    assert prompt.reply_prefix == "<|channel>thought\n<channel|><|tool_call>call:"


def test_json_after_an_open_thought_continues_it():
    """After a tool result with thinking on, the template opens the thought channel: the JSON
    reply's grammar starts inside it, and the parser reads what follows as that thought's end."""
    req = after_a_tool_result(response_format={"type": "json_object"})
    prompt = build_chat_prompt(req)
    assert prompt.text.endswith("<tool_response|><|channel>thought\n")
    assert prompt.reply_prefix == prompt.grammar.prefix == "<|channel>thought\n"


def test_tool_choice_needs_tools():
    with pytest.raises(APIError) as info:
        build_chat_prompt(_request(tool_choice="required"))
    assert info.value.status == 400 and info.value.param == "tool_choice"


@pytest.mark.parametrize("model", ["gemma-4-e2b-it", f"odd{TEXT_SLOT}name", TEXT_SLOT])
def test_text_chunks_rendered_once_are_the_events_rendered_whole(model):
    """The spliced event is byte for byte the whole one, for texts JSON must escape; an event with
    another string that is the slot itself (a model so named) falls back to rendering each whole."""
    def event(text: str) -> str:
        return sse({"id": "cmpl-1", "model": model, "choices": [{"index": 0, "text": text, "logprobs": None}]})

    fast = sse_of_text(event)
    assert (fast is event) == (model == TEXT_SLOT)
    for text in ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab\x00nul", "é中🙂", TEXT_SLOT, "</script>"]:
        assert fast(text) == event(text)


def test_free_token_texts_give_the_deltas_decoding_gives():
    """With each token's free text (Detokenizer.free), the incremental decoder emits exactly the
    deltas it emits decoding every window: over prose, emoji and CJK made of byte pieces, control
    tokens, and random ids from the whole vocabulary."""
    import random

    from qat4.server.generation import Detokenizer

    tokenizer = tiny_tokenizer()
    detokenizer = Detokenizer(tokenizer.decode)
    rng = random.Random(0)
    texts = ["Grüße, 世界! 🎉🦙 <|tool_call>call:f{}<tool_call|> done", "  two  spaces\n\nand\ttabs ", "<|turn>model\nhi"]
    sequences = [tokenizer.encode(t) for t in texts]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(50)]
    for ids in sequences:
        slow, fast = IncrementalDecoder(tokenizer.decode), IncrementalDecoder(detokenizer.decode, detokenizer.free)
        assert [slow.push(t) for t in ids] + [slow.flush()] == [fast.push(t) for t in ids] + [fast.flush()], ids
    assert detokenizer.free(tokenizer.encode(" world")[0]) == " world"
    assert detokenizer.free(tokenizer.token_to_id("<0xE4>")) is None  # a byte of a longer character
