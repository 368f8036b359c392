"""Prompt rendering against the canonical Gemma 4 template, and reply parsing (whole and streamed)."""

from __future__ import annotations

import copy
import functools
import json
import random

import jinja2
import pytest

from qat4.chat import Reply, ReplyStream, default_chat_template, parse_reply, render_prompt
from qat4.errors import Qat4Error
from vocab_fixtures import CANONICAL_TEMPLATE_SHA256, sha256_of


# ---------------------------------------------------------------------------------------------
# render_prompt
# ---------------------------------------------------------------------------------------------


def _raise(message):
    raise jinja2.TemplateError(message)


@functools.cache
def _canonical() -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(default_chat_template())


def _direct(messages, tools=None, enable_thinking=False, add_generation_prompt=True) -> str:
    """The canonical template rendered straight with jinja2, on messages already in its own shape."""
    return _canonical().render(messages=messages, tools=tools, bos_token="<bos>", enable_thinking=enable_thinking,
                           add_generation_prompt=add_generation_prompt)


def _as_openai(messages):
    """The OpenAI wire form of template-shaped messages: arguments as JSON text, tool results unnamed."""
    wire = copy.deepcopy(messages)
    for message in wire:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        if message["role"] == "tool":
            message.pop("name", None)
    return wire


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Find flights; prices in EUR",
    "parameters": {
        "type": "object",
        "properties": {
            "origin": {"type": "string", "description": "IATA code, e.g. \"CDG\""},
            "cabin": {"type": "string", "enum": ["economy", "business"], "description": "Cabin class"},
            "passengers": {"type": "integer", "nullable": True},
            "max_price": {"type": "number"},
            "direct": {"type": "boolean"},
            "stops": {"type": "array", "items": {"type": "string"}},
            "window": {"type": "object", "description": "Dates", "properties": {
                "start": {"type": "string"}, "end": {"type": "string"}}, "required": ["start"]},
            "legs": {"type": "array", "items": {"type": "object", "properties": {
                "from": {"type": "string"}, "to": {"type": "string"}}, "required": ["from", "to"]}},
        },
        "required": ["origin", "cabin"],
    },
    "response": {"description": "Matching flights", "type": "object"}}}
NO_PARAMS = {"type": "function", "function": {"name": "now", "description": "Current time"}}

USER_PARIS = {"role": "user", "content": "What is the weather in Paris right now?"}
CALL_PARIS = _call("call_1", "get_weather", {"city": "Paris"})

# Conversations in the template's own shape (arguments as mappings, tool results named).
CONVERSATIONS = {
    "user": dict(messages=[{"role": "user", "content": "Hello"}]),
    "system": dict(messages=[{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": " Hi "}]),
    "multi_turn_strips_old_thoughts": dict(messages=[
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<|channel>thought\nadd them<channel|>4", "reasoning_content": "add them"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Thanks"},
    ]),
    "tools_nested_schema": dict(messages=[{"role": "user", "content": "Flights CDG to JFK"}],
                                tools=[WEATHER, SEARCH, NO_PARAMS]),
    "tool_round_trip_string": dict(messages=[
        USER_PARIS, {"role": "assistant", "content": None, "tool_calls": [CALL_PARIS]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 18}'},
    ], tools=[WEATHER]),
    "parallel_calls_then_answer": dict(messages=[
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "",
         "tool_calls": [CALL_PARIS, _call("call_2", "get_weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": [{"type": "text", "text": "3 C"}]},
        {"role": "assistant", "content": "Paris 18 C, Oslo 3 C."},
        {"role": "user", "content": "And Rome?"},
    ], tools=[WEATHER]),
    "pending_call": dict(messages=[USER_PARIS, {"role": "assistant", "tool_calls": [CALL_PARIS]}], tools=[WEATHER]),
    "rich_arguments_unicode": dict(messages=[
        {"role": "user", "content": "Réserve un vol 🚀 pour 東京"},
        {"role": "assistant", "tool_calls": [_call("c", "search_flights", {
            "origin": "CDG", "cabin": "economy", "passengers": None, "max_price": 1e3, "direct": False,
            "stops": ["HEL", "東京"], "window": {"start": "2026-08-01", "end": None},
            "legs": [{"from": "CDG", "to": "HND"}], "note": "a {b}, \"c\": d"})]},
        {"role": "tool", "tool_call_id": "c", "name": "search_flights", "content": "aucun vol — désolé"},
    ], tools=[SEARCH]),
    "thinking_with_tools": dict(messages=[{"role": "system", "content": "Think."}, USER_PARIS],
                                tools=[WEATHER], enable_thinking=True),
    "thinking_kept_within_tool_turn": dict(messages=[
        USER_PARIS,
        {"role": "assistant", "reasoning_content": "I need the weather tool.", "tool_calls": [CALL_PARIS]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
    ], tools=[WEATHER], enable_thinking=True),
    "text_parts": dict(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Part A. "}, {"type": "text", "text": "Part B."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<|channel>thought\nx<channel|>Done."}]},
        {"role": "user", "content": "ok"},
    ]),
    "no_generation_prompt": dict(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        add_generation_prompt=False),
}


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_render_matches_canonical_template(name):
    case = CONVERSATIONS[name]
    options = {k: v for k, v in case.items() if k != "messages"}
    assert render_prompt(_as_openai(case["messages"]), **options) == _direct(case["messages"], **options)


def test_render_accepts_mapping_arguments_too():
    case = CONVERSATIONS["tool_round_trip_string"]
    assert render_prompt(case["messages"], tools=case["tools"]) == _direct(case["messages"], tools=case["tools"])


def test_spec_user_hello():
    assert render_prompt([{"role": "user", "content": "Hello"}]) == "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"


def test_spec_tool_request_and_result():
    """§7.8 B and C, and §12: the result continues the same model turn."""
    declaration = ('<|tool>declaration:get_weather{description:<|"|>Current weather for a city<|"|>,'
                   'parameters:{properties:{city:{type:<|"|>STRING<|"|>}},required:[<|"|>city<|"|>],'
                   'type:<|"|>OBJECT<|"|>}}<tool|>')
    head = (f"<bos><|turn>system\n{declaration}<turn|>\n"
            "<|turn>user\nWhat is the weather in Paris right now?<turn|>\n<|turn>model\n")
    assert render_prompt([USER_PARIS], tools=[WEATHER]) == head
    messages = _as_openai(CONVERSATIONS["tool_round_trip_string"]["messages"])
    assert render_prompt(messages, tools=[WEATHER]) == head + (
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>{"temp_c": 18}<|"|>}<tool_response|>')


def test_spec_thinking():
    """§7.8 D."""
    messages = [{"role": "system", "content": "You are concise."},
                {"role": "user", "content": "Which is larger, 9.11 or 9.9?"}]
    assert render_prompt(messages, enable_thinking=True) == (
        "<bos><|turn>system\n<|think|>\nYou are concise.<turn|>\n"
        "<|turn>user\nWhich is larger, 9.11 or 9.9?<turn|>\n<|turn>model\n")
    after_tool = render_prompt(_as_openai(CONVERSATIONS["thinking_kept_within_tool_turn"]["messages"]),
                               tools=[WEATHER], enable_thinking=True)
    assert "<|channel>thought\nI need the weather tool.\n<channel|><|tool_call>" in after_tool
    assert after_tool.endswith("<tool_response|><|channel>thought\n")


def test_tool_result_object_and_name_fallback():
    """An object result renders as `response:NAME{key:value,...}` (keys sorted), a string as `{value:...}`."""
    messages = [USER_PARIS, {"role": "assistant", "tool_calls": [CALL_PARIS, _call("call_2", "get_time", "{}")]},
                {"role": "tool", "tool_call_id": "call_1",
                 "content": {"temp_c": 18, "sky": "clear", "wind": {"kmh": 12.5}}},
                {"role": "tool", "name": "get_time", "content": "noon"}]
    assert render_prompt(messages, tools=[WEATHER]).endswith(
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:get_time{}<tool_call|>'
        '<|tool_response>response:get_weather{sky:<|"|>clear<|"|>,temp_c:18,wind:{kmh:12.5}}<tool_response|>'
        '<|tool_response>response:get_time{value:<|"|>noon<|"|>}<tool_response|>')


def test_old_thoughts_are_stripped():
    text = render_prompt(CONVERSATIONS["multi_turn_strips_old_thoughts"]["messages"])
    assert "add them" not in text and "<|channel>" not in text
    assert "<|turn>model\n4<turn|>\n" in text


def test_developer_is_system():
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_prompt(messages) == _direct([{"role": "system", "content": "Be brief."}, messages[1]])
    later = render_prompt([messages[1], {"role": "assistant", "content": "Hello"}, messages[0], messages[1]])
    assert "<|turn>system\nBe brief.<turn|>" in later and "developer" not in later


def test_custom_template():
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ tools | length }}"
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert render_prompt(messages, tools=[WEATHER], template=template) == "<bos>[system:d][user:u]1"


def test_packaged_template_is_canonical():
    assert sha256_of(default_chat_template()) == CANONICAL_TEMPLATE_SHA256


@pytest.mark.parametrize("messages,tools,field", [
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], None, r"messages\[1\]\.role 'robot'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_call("x", "f", "{}")]},
      {"role": "tool", "tool_call_id": "y", "content": "r"}], None, r"messages\[2\]\.tool_call_id 'y' matches no call"),
    ([{"role": "assistant", "tool_calls": [_call("x", "f", "{}")]}, {"role": "tool", "content": "r"}], None,
     r"messages\[1\]\.tool_call_id is missing"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "x", "content": "r"}], None,
     r"messages\[1\] is a tool result that does not follow an assistant message with tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "f"}}]}], None,
     r"messages\[0\]\.tool_calls\[0\]\.id must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [_call("x", "f", "{city: 1}")]}], None,
     r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON$"),
    ([{"role": "assistant", "tool_calls": [_call("x", "f", "[1, 2]")]}], None,
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}], None,
     r"messages\[0\]\.tool_calls\[0\]\.function\.name is missing"),
    ([{"role": "assistant", "tool_calls": "f()"}], None, r"messages\[0\]\.tool_calls must be a list"),
    ([{"role": "user"}], None, r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 5}], None, r"messages\[0\]\.content must be"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}], None,
     r"messages\[0\]\.content\[1\] has type 'image_url'"),
    ([{"role": "user", "content": [{"type": "text"}]}], None, r"messages\[0\]\.content\[0\]\.text"),
    (["hello"], None, r"messages\[0\] is not an object"),
    ([], None, "messages must be a non-empty list"),
    ([{"role": "user", "content": "a"}], [{"type": "function", "function": {"description": "x"}}],
     r"tools\[0\]\.function\.name is missing"),
    ([{"role": "user", "content": "a"}], [WEATHER, {"type": "retrieval"}], r"tools\[1\]\.type 'retrieval'"),
    ([{"role": "user", "content": "a"}], [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
     r"tools\[0\]\.function\.parameters must be a JSON object"),
    ([{"role": "user", "content": "a"}], "tools", "tools must be a list"),
])
def test_render_errors_name_the_field(messages, tools, field):
    with pytest.raises(Qat4Error, match=field):
        render_prompt(messages, tools=tools)


def test_template_errors_are_qat4_errors():
    with pytest.raises(Qat4Error, match="rejected the conversation: no way"):
        render_prompt([{"role": "user", "content": "a"}], template="{{ raise_exception('no way') }}")
    with pytest.raises(Qat4Error, match="not valid jinja"):
        render_prompt([{"role": "user", "content": "a"}], template="{% for %}")


def test_render_does_not_modify_the_request():
    messages = _as_openai(CONVERSATIONS["parallel_calls_then_answer"]["messages"])
    before = copy.deepcopy(messages)
    render_prompt(messages, tools=[WEATHER])
    assert messages == before


# ---------------------------------------------------------------------------------------------
# parse_reply and ReplyStream
# ---------------------------------------------------------------------------------------------

D = '<|"|>'
ALL_VALUES = (f'call:set{{i:42,neg:-7,f:3.25,nf:-0.5,e:1e-3,E:-2.5E+4,t:true,fa:false,n:null,py:None,'
              f's:{D}a {{b}}, "c": d{D},empty:{D}{D},lst:[1,{D}x{D},[],{{}}],obj:{{k:{{deep:[true,null]}}}},'
              f'multi:{D}line 1\nline 2{D}}}')
ALL_ARGS = {"i": 42, "neg": -7, "f": 3.25, "nf": -0.5, "e": 1e-3, "E": -2.5e4, "t": True, "fa": False, "n": None,
            "py": None, "s": 'a {b}, "c": d', "empty": "", "lst": [1, "x", [], {}],
            "obj": {"k": {"deep": [True, None]}}, "multi": "line 1\nline 2"}
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
UNFINISHED = "the call ends before its closing <tool_call|>"


def _invalid(name: str, arguments: str, error: str) -> dict[str, str]:
    """An invalid call as the parser reports it; `error` is the parser's complaint for a closed call."""
    return {"name": name, "arguments": arguments,
            "error": error if error == UNFINISHED else f"the call does not parse: {error}"}

CALL_TEXT = f"<|tool_call>call:get_weather{{city:{D}Paris{D}}}<tool_call|>"

# (raw reply, thinking, expected)
REPLIES = {
    "plain": ("Paris is the capital.<turn|>", False, Reply("Paris is the capital.")),
    "no_stop_marker": ("  Hi there \n", False, Reply("Hi there")),
    "after_stop_ignored": ("Done.<turn|>\n<|turn>user\nmore", False, Reply("Done.")),
    "eos": ("Bye<eos>", False, Reply("Bye")),
    "empty": ("<turn|>", False, Reply()),
    "empty_thought": ("<|channel>thought\n<channel|>The answer.<turn|>", False, Reply("The answer.")),
    "thought": ("<|channel>thought\nCompare 9.11 and 9.9.\n<channel|>9.9 is larger.<turn|>", True,
                Reply("9.9 is larger.", "Compare 9.11 and 9.9.")),
    "thought_when_off_dropped": ("<|channel>thought\nhmm<channel|>ok", False, Reply("ok")),
    "thinking_on_no_thought": ("Just an answer.<turn|>", True, Reply("Just an answer.")),
    "unterminated_thought_on": ("<|channel>thought\nStill thinking about", True, Reply(None, "Still thinking about")),
    "unterminated_thought_off_dropped": ("<|channel>thought\nStill thinking about", False, Reply()),
    "thought_cut_by_stop": ("<|channel>thought\nabc<turn|>", True, Reply(None, "abc")),
    "label_only_prefix": ("<|channel>tho", True, Reply(None, "tho")),
    "label_only": ("<|channel>thought", True, Reply()),
    "prompt_opened_thought": ("<|channel>thought\nuse the result<channel|>It is 18 C.", True,
                              Reply("It is 18 C.", "use the result")),
    "thoughtful_is_not_the_label": ("<|channel>thoughtful<channel|>ok", True, Reply("ok", "thoughtful")),
    "label_then_close": ("<|channel>thought<channel|>ok", True, Reply("ok")),
    "label_then_close_off": ("<|channel>thought<channel|>ok", False, Reply("ok")),
    "doubled_open": ("<|channel><|channel>thought\nx<channel|>ok", True, Reply("ok", "x")),
    "doubled_open_off": ("<|channel><|channel>thought\nx<channel|>ok", False, Reply("ok")),
    "doubled_open_after_label": ("<|channel>thought\n<|channel>thought\nx<channel|>ok", True, Reply("ok", "x")),
    "stray_thought_close": ("<|channel>thought\nx<channel|>a<channel|>b", True, Reply("ab", "x")),
    "stray_close_without_opener": ("Some text<channel|> more", True, Reply("Some text more")),
    "stray_close_before_call": ("<|channel>thought\n<channel|>I will check.<channel|>" + CALL_TEXT, True,
                                Reply("I will check.", None, [WEATHER_CALL])),
    "multiple_thoughts": ("<|channel>first thought<channel|><|channel>second thought<channel|>Final answer.", True,
                          Reply("Final answer.", "first thoughtsecond thought")),
    "thought_only": ("<|channel>just thinking<channel|>", True, Reply(None, "just thinking")),
    "thought_label_diverges": ("<|channel>thousand reasons<channel|>Done", True, Reply("Done", "thousand reasons")),
    "text_around_thought": ("Before\n<|channel>a reasoning section<channel|>\nthe rest", True,
                            Reply("Before\n\nthe rest", "a reasoning section")),
    "thought_cut_by_call": ("<|channel>thought\nneed weather" + CALL_TEXT, True, Reply(None, "need weather", [WEATHER_CALL])),
    "thought_cut_by_call_off": ("<|channel>thought\nneed weather" + CALL_TEXT, False, Reply(None, None, [WEATHER_CALL])),
    "stray_call_close_in_thought": ("<|channel>thought\na<tool_call|>b<channel|>ok", True, Reply("ok", "ab")),
    "dangling_open_after_call": (CALL_TEXT + "<|channel> ", True, Reply(None, None, [WEATHER_CALL])),
    # The bare label `thought` opening the reply: a thought block without its `<|channel>` once
    # `<channel|>` or a call ends it, else a spurious label before the answer.
    **{f"bare_label_{name}{'_on' if thinking else '_off'}": (text, thinking, expected(thinking))
       for name, (text, expected) in {
        "then_close": ("thought\n<channel|>The answer.", lambda on: Reply("The answer.")),
        "directly_closed": ("thought<channel|>The answer.", lambda on: Reply("The answer.")),
        "thought": (" thought\nweigh it\n<channel|>The answer.", lambda on: Reply("The answer.", "weigh it" if on else None)),
        "then_call": ("thought\nneed weather" + CALL_TEXT, lambda on: Reply(None, "need weather" if on else None,
                                                                             [WEATHER_CALL])),
        "closed_then_call": ("thought\nneed weather<channel|>" + CALL_TEXT,
                             lambda on: Reply(None, "need weather" if on else None, [WEATHER_CALL])),
        "spurious": ("thought\nThe answer is 42.<turn|>", lambda on: Reply("The answer is 42.")),
        "word_not_label": ("thought about it, and no.", lambda on: Reply("thought about it, and no.")),
        "longer_word": ("thoughtful answer", lambda on: Reply("thoughtful answer")),
        "cut_short": ("thoug", lambda on: Reply("thoug")),
    }.items() for thinking in (False, True)},
    "tool_call": (CALL_TEXT + "<|tool_response>", False, Reply(None, None, [WEATHER_CALL])),
    "extra_call_close": (CALL_TEXT + "<tool_call|>", False, Reply(None, None, [WEATHER_CALL])),
    "extra_call_close_then_text": (CALL_TEXT + "\n<tool_call|> Done.", False, Reply("Done.", None, [WEATHER_CALL])),
    "text_after_tool_response": (CALL_TEXT + "<|tool_response>Done.", False, Reply(None, None, [WEATHER_CALL])),
    "text_then_call": ("Let me check. " + CALL_TEXT, False, Reply("Let me check.", None, [WEATHER_CALL])),
    "thought_then_call": ("<|channel>thought\nneed weather<channel|>" + CALL_TEXT + "<|tool_response>", True,
                          Reply(None, "need weather", [WEATHER_CALL])),
    "parallel_calls": (CALL_TEXT + f"<|tool_call>call:get_time{{tz:{D}Europe/Paris{D}}}<tool_call|>"
                       + "<|tool_response>", False,
                       Reply(None, None, [WEATHER_CALL, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}])),
    "all_values": (f"<|tool_call>{ALL_VALUES}<tool_call|>", False,
                   Reply(None, None, [{"name": "set", "arguments": ALL_ARGS}])),
    "json_quoted": ('<|tool_call>call:f{"q": "say \\"hi\\"\\n", "n": [1, 2.5], "o": {"k": "v"}}<tool_call|>', False,
                    Reply(None, None, [{"name": "f",
                                        "arguments": {"q": 'say "hi"\n', "n": [1, 2.5], "o": {"k": "v"}}}])),
    "delimited_keys_and_spaces": (f"<|tool_call> call:f {{ {D}a b{D} : 1 , c : [ 2 , 3 , ] , }}\n<tool_call|>", False,
                                  Reply(None, None, [{"name": "f", "arguments": {"a b": 1, "c": [2, 3]}}])),
    "no_arguments": ("<|tool_call>call:now{}<tool_call|>", False,
                     Reply(None, None, [{"name": "now", "arguments": {}}])),
    "unicode": (f"<|tool_call>call:search{{q:{D}東京 🚀{D}}}<tool_call|>", False,
                Reply(None, None, [{"name": "search", "arguments": {"q": "東京 🚀"}}])),
    "bare_word_value": ("<|tool_call>call:f{unit:celsius}<tool_call|>", False,
                        Reply(None, None, [{"name": "f", "arguments": {"unit": "celsius"}}])),
    "call_closed_by_stop": (f"<|tool_call>call:f{{a:1}}<|tool_response>", False,
                            Reply(None, None, [{"name": "f", "arguments": {"a": 1}}])),
    "call_closed_by_next_call": ("<|tool_call>call:f{a:1}<|tool_call>call:g{}<tool_call|>", False,
                                 Reply(None, None, [{"name": "f", "arguments": {"a": 1}},
                                                    {"name": "g", "arguments": {}}])),
    "stray_close_dropped": ("a<channel|>b<tool_call|>c", False, Reply("abc")),
    "partial_marker_at_end": ("Hello <|tool", False, Reply("Hello <|tool")),
    # Calls that are cut off or do not parse: never content, reported as invalid calls.
    "cut_by_length": ("Sure. <|tool_call>call:get_weather{city:" + D + "Par", False,
                      Reply("Sure.", invalid_tool_calls=[_invalid("get_weather", "{city:" + D + "Par", UNFINISHED)])),
    "cut_in_the_name": ("<|tool_call>call:get_wea", False, Reply(invalid_tool_calls=[_invalid("get_wea", "", UNFINISHED)])),
    "cut_by_stop_marker": ("<|tool_call>call:f{a:[1,2<turn|>", False,
                           Reply(invalid_tool_calls=[_invalid("f", "{a:[1,2", UNFINISHED)])),
    "cut_by_next_call": ("<|tool_call>call:f{a:<|tool_call>call:g{}<tool_call|>", False,
                         Reply(tool_calls=[{"name": "g", "arguments": {}}],
                               invalid_tool_calls=[_invalid("f", "{a:", UNFINISHED)])),
    "text_around_malformed": ("x<|tool_call>call:f{a 1}<tool_call|> y", False,
                              Reply("x y", invalid_tool_calls=[_invalid("f", "{a 1}", "expected ':' at 10")])),
    # Slips the model makes in a call it ended itself are repaired; a call cut off is not guessed at.
    **{f"repaired_{name}": (f"<|tool_call>{body}{end}", False, Reply(None, None, [{"name": "f", "arguments": args}]))
       for name, (body, end, args) in {
        "unclosed_string": (f"call:f{{a:{D}hello}}", "<tool_call|>", {"a": "hello"}),
        "unclosed_last_string": (f"call:f{{path:{D}/tmp{D},cmd:{D}ls -l }}\n", "<tool_call|>",
                                 {"path": "/tmp", "cmd": "ls -l "}),
        "unclosed_string_stopped": (f"call:f{{a:{D}hello}}", "<|tool_response>", {"a": "hello"}),
    }.items()},
    **{f"single_quoted_{name}": (f"<|tool_call>call:f{{{body}}}<tool_call|>", False,
                                 Reply(None, None, [{"name": "f", "arguments": args}]))
       for name, (body, args) in {
        "value": ("pattern:':\\s*\\w+'", {"pattern": ":\\s*\\w+"}),
        "dangling_delimiter": (f"a:'abc'{D}", {"a": "abc"}),
        "apostrophe_inside": ("q:'it's, he said', n:1", {"q": "it's, he said", "n": 1}),
        "in_an_array": (f"a:[ 'x' , 'y'{D} ]", {"a": ["x", "y"]}),
    }.items()},
    # Calls as upstream parsers' tests write them (ollama's gemma4_test.go, vLLM's Gemma 4 tool parser tests).
    **{f"call_{name}": (f"<|tool_call>{body}<tool_call|>", False, Reply(None, None, [call]))
       for name, (body, call) in {
        "multiline_string": (f"call:bash{{command:{D}date\n{D}}}", {"name": "bash", "arguments": {"command": "date\n"}}),
        "escaped_quotes_verbatim": (rf'call:search{{query:{D}say \"hello\"{D}}}',
                                    {"name": "search", "arguments": {"query": r'say \"hello\"'}}),
        "quotes_and_commas": (f'call:search{{query:{D}say "hello", then "goodbye"{D}}}',
                              {"name": "search", "arguments": {"query": 'say "hello", then "goodbye"'}}),
        "quoted_url": (f'call:exec{{command:{D}fetch "https://ollama.com/library/gemma4" --extract{D}}}',
                       {"name": "exec", "arguments": {"command": 'fetch "https://ollama.com/library/gemma4" --extract'}}),
        "json_and_delimited": (rf'call:search{{query:"raw \"quoted\"",note:{D}gemma "quoted"{D}}}',
                               {"name": "search", "arguments": {"query": 'raw "quoted"', "note": 'gemma "quoted"'}}),
        "json_string_with_key_like_text": (f'call:f{{q:"keep , oldText: literal",note:{D}ok{D}}}',
                                           {"name": "f", "arguments": {"q": "keep , oldText: literal", "note": "ok"}}),
        "objects_in_array": (rf'call:plan{{steps:[{{title:{D}step "one"{D},done:false}},'
                             rf'{{title:{D}step \"two\"{D},done:true}}]}}',
                             {"name": "plan", "arguments": {"steps": [{"title": 'step "one"', "done": False},
                                                                      {"title": r'step \"two\"', "done": True}]}}),
        "multiline_edits": (f"call:edit{{edits:[\n  {{newText:{D}# Guide\n\nUse \"nvfp4\".\n{D},\n"
                            f"   oldText:{D}# Guide\n{D}}},\n  {{newText:{D}## 14\n{D}, oldText:{D}## 13\n{D}}}\n]}}",
                            {"name": "edit", "arguments": {"edits": [
                                {"newText": '# Guide\n\nUse "nvfp4".\n', "oldText": "# Guide\n"},
                                {"newText": "## 14\n", "oldText": "## 13\n"}]}}),
        "backslashes_verbatim": (rf"call:open_file{{path:{D}C:\users\bob\file.txt{D},url:{D}https:\/\/a.b\/c{D},"
                                 rf"s:{D}snowman:\u2603 \x{D}}}",
                                 {"name": "open_file", "arguments": {"path": r"C:\users\bob\file.txt",
                                                                     "url": r"https:\/\/a.b\/c", "s": r"snowman:\u2603 \x"}}),
        "structural_text_in_strings": (f"call:f{{query:{D}a,b:{{c}}[d]{D},q:\"a,b:c\"}}",
                                       {"name": "f", "arguments": {"query": "a,b:{c}[d]", "q": "a,b:c"}}),
        "nested_nulls": ("call:set_optional{value:null,nested:{value:null}}",
                         {"name": "set_optional", "arguments": {"value": None, "nested": {"value": None}}}),
        "quoted_scalars_stay_strings": (f"call:foo{{n:{D}1{D},b:{D}true{D},z:{D}null{D}}}",
                                        {"name": "foo", "arguments": {"n": "1", "b": "true", "z": "null"}}),
        "reference_example": (f"call:get_current_temperature{{detail_level:0,location:{D}Paris, France{D},"
                              f"unit:{D}celsius{D}}}",
                              {"name": "get_current_temperature",
                               "arguments": {"detail_level": 0, "location": "Paris, France", "unit": "celsius"}}),
        "hyphenated_name": (f"call:get-weather{{location:{D}London{D}}}",
                            {"name": "get-weather", "arguments": {"location": "London"}}),
        "dotted_name": (f"call:weather.get{{location:{D}London{D}}}",
                        {"name": "weather.get", "arguments": {"location": "London"}}),
        "delimited_keys_nested": (f"call:f{{outer:{{inner:{{{D}3{D}:{D}new text{D}}}}}}}",
                                  {"name": "f", "arguments": {"outer": {"inner": {"3": "new text"}}}}),
        "number_ending_in_a_point": ("call:f{left:108.,right:22.8}", {"name": "f", "arguments": {"left": 108.0, "right": 22.8}}),
        "bracket_in_array_string": (f"call:f{{a:[[{D}a]b{D},{D}c{D}],{D}tail{D}]}}",
                                    {"name": "f", "arguments": {"a": [["a]b", "c"], "tail"]}}),
        "html_in_string": (f'call:write_file{{path:{D}index.html{D},content:{D}<!DOCTYPE html>\n<html lang="zh-CN">\n'
                           f'<head>\n    <meta charset="UTF-8">\n{D}}}',
                           {"name": "write_file", "arguments": {"path": "index.html", "content":
                               '<!DOCTYPE html>\n<html lang="zh-CN">\n<head>\n    <meta charset="UTF-8">\n'}}),
        "colon_before_call": (f":call:bash{{command:{D}pytest{D}}}", {"name": "bash", "arguments": {"command": "pytest"}}),
        # Repairs of a call the model closed (ollama's TestRepairGemma4* and issue 15315 cases).
        "unclosed_string_and_object": (f"call:bash{{command:{D}ls", {"name": "bash", "arguments": {"command": "ls"}}),
        "unclosed_string_after_others": (f"call:bash{{path:{D}/tmp{D},command:{D}ls}}",
                                         {"name": "bash", "arguments": {"path": "/tmp", "command": "ls"}}),
        "single_quoted_between": (f"call:grep{{include:{D}*.py{D},pattern:'abc',path:{D}/tmp{D}}}",
                                  {"name": "grep", "arguments": {"include": "*.py", "pattern": "abc", "path": "/tmp"}}),
        "single_quoted_issue_15315": (f"call:grep{{include:{D}*.py{D},output_mode:{D}content{D},"
                                      f"path:{D}/data/robotics/experiment1{D},pattern:':\\s*\\w+'{D}}}",
                                      {"name": "grep", "arguments": {"include": "*.py", "output_mode": "content",
                                                                     "path": "/data/robotics/experiment1",
                                                                     "pattern": r":\s*\w+"}}),
    }.items()},
    "call_without_close_at_the_end": (f'<|tool_call>call:search{{query:{D}say "hello" and "bye"{D}}}', False,
                                      Reply(None, None, [{"name": "search",
                                                          "arguments": {"query": 'say "hello" and "bye"'}}])),
    "call_closed_by_turn_end": (f"<|tool_call>call:gdb{{args:{D}-batch -ex run /tmp/poc{D}}}<turn|>", False,
                                Reply(None, None, [{"name": "gdb", "arguments": {"args": "-batch -ex run /tmp/poc"}}])),
    "markup_like_text_after_call": (CALL_TEXT + "<div>", False, Reply("<div>", None, [WEATHER_CALL])),
    "only_the_call_open": ("<|tool_call>", False, Reply(invalid_tool_calls=[_invalid("", "", UNFINISHED)])),
    "empty_reply": ("", True, Reply()),
    "empty_thought_only": ("<|channel>thought\n<channel|>", True, Reply()),
    "multiline_thought": ("<|channel>This\nThat<channel|>This is the rest\nThat", True,
                          Reply("This is the rest\nThat", "This\nThat")),
    "sentinels_after_answer": ("final answer <eos> <turn|>", False, Reply("final answer")),
    "unclosed_string_cut": (f"<|tool_call>call:f{{a:{D}x{{}}", False,
                            Reply(invalid_tool_calls=[_invalid("f", f"{{a:{D}x{{}}", UNFINISHED)])),
    **{f"malformed_{name}": (f"<|tool_call>{body}<tool_call|>", False,
                             Reply(invalid_tool_calls=[_invalid(call_name, arguments, error)]))
       for name, (body, call_name, arguments, error) in {
        "unclosed_object": ("call:f{a:1", "f", "{a:1", "expected '}' at 10"),
        "name": ("call:bad name{}", "bad name", "{}", "bad function name 'bad name'"),
        "trailing_text": ("call:f{} extra", "f", "{} extra", "text after the arguments"),
        "missing_colon": ("call:f{a 1}", "f", "{a 1}", "expected ':' at 10"),
        "unclosed_inner_string": (f"call:f{{a:{D}one,b:{D}two{D}}}", "f", f"{{a:{D}one,b:{D}two{D}}}",
                                  "expected '}' at 25"),
        "missing_comma": ("call:f{a:1 b:2}", "f", "{a:1 b:2}", "unexpected '1 b:2' at 14"),
        "bad_escape": ('call:f{a:"\\q"}', "f", '{a:"\\q"}', "Invalid \\escape: line 1 column 2 (char 1)"),
        "json_string_bad_escape": (r'call:open_file{path:"C:\users\bob"}', "open_file", r'{path:"C:\users\bob"}',
                                   "Invalid \\uXXXX escape: line 1 column 5 (char 4)"),
        "unclosed_string_in_a_nested_object": (f"call:f{{a:{{b:{D}x", "f", f"{{a:{{b:{D}x", "unterminated string"),
        "empty_value": ("call:f{key:}", "f", "{key:}", "unexpected '' at 11"),
        "too_deep": ("call:f{a:" + "[" * 3000 + "]" * 3000 + "}", "f", "{a:" + "[" * 3000 + "]" * 3000 + "}",
                     "its values are nested too deeply"),
    }.items()},
}


@pytest.mark.parametrize("name", REPLIES)
def test_parse_reply(name):
    text, thinking, expected = REPLIES[name]
    reply = parse_reply(text, thinking=thinking)
    assert reply.invalid_tool_calls == expected.invalid_tool_calls  # the parser's message, shown first
    assert reply == expected


def _chunkings(text: str, seed: str) -> list[list[str]]:
    """Ways to cut a reply into deltas: characters, pieces of 2, 3 and 7 characters, random cuts, whole."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
    sized = [[text[i:i + size] for i in range(0, len(text), size)] for size in (1, 2, 3, 7)]
    return [*sized, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], [text]]


def _stream(chunks, thinking, tools=None):
    """Feed chunks; returns (reply, concatenated content deltas, reasoning deltas, streamed calls)."""
    stream = ReplyStream(thinking, tools)
    events = [event for chunk in chunks for event in stream.feed(chunk)] + stream.flush()
    text = {kind: "".join(e.text for e in events if e.kind == kind) for kind in ("content", "reasoning")}
    calls = {kind: [e.tool_call for e in events if e.kind == kind] for kind in ("tool_call", "invalid_tool_call")}
    return stream.finish(), text["content"], text["reasoning"], calls["tool_call"], calls["invalid_tool_call"]


@pytest.mark.parametrize("name", REPLIES)
def test_stream_matches_parse_reply(name):
    text, thinking, expected = REPLIES[name]
    for chunks in _chunkings(text, name):
        reply, content, reasoning, calls, invalid_calls = _stream(chunks, thinking)
        assert reply == expected
        streamed = (content or None, reasoning or None, calls, invalid_calls)
        assert streamed == (expected.content, expected.reasoning, expected.tool_calls, expected.invalid_tool_calls)


def test_stream_holds_partial_markers():
    stream = ReplyStream()
    assert [e.text for e in stream.feed("Hello <|tool")] == ["Hello"]
    assert stream.feed("_call>call:f{a:") == []
    events = stream.feed("1}<tool_call|>")
    assert [(e.kind, e.tool_call) for e in events] == [("tool_call", {"name": "f", "arguments": {"a": 1}})]
    assert stream.feed("<|tool_response>") == [] and stream.feed("ignored") == []
    assert stream.finish() == Reply("Hello", None, [{"name": "f", "arguments": {"a": 1}}])


def test_stream_reasoning_is_live_when_thinking_and_dropped_when_not():
    live = ReplyStream(thinking=True)
    assert [(e.kind, e.text) for e in live.feed("<|channel>thought\nStep one. ")] == [("reasoning", "Step one.")]
    events = live.feed("Step two.<channel|>A")
    assert [(e.kind, e.text) for e in events] == [("reasoning", " Step two."), ("content", "A")]
    off = ReplyStream(thinking=False)
    assert off.feed("<|channel>thought\nStep one. ") == []
    assert [(e.kind, e.text) for e in off.feed("Step two.<channel|>A")] == [("content", "A")]


def test_stream_holds_a_bare_label_until_it_is_known():
    """A reply opening with the bare label streams nothing until `<channel|>` shows it was a thought
    block (one reasoning delta) or the reply ends without one (the rest is content)."""
    for thinking in (True, False):
        closed = ReplyStream(thinking)
        assert closed.feed("thought\nStep one. ") == [] and closed.feed("Step two.") == []
        expected = [("reasoning", "Step one. Step two.")] if thinking else []
        assert [(e.kind, e.text) for e in closed.feed("<channel|>A")] == [*expected, ("content", "A")]
        spurious = ReplyStream(thinking)
        assert spurious.feed("thought\nThe answer") == []
        assert [(e.kind, e.text) for e in spurious.flush()] == [("content", "The answer")]
    plain = ReplyStream(thinking=True)
    assert plain.feed("though") == []
    assert [(e.kind, e.text) for e in plain.feed("t it was")] == [("content", "thought it was")]


def test_stream_prompt_prefix():
    """A prompt that ends inside an open thought channel: its tail is fed before the reply."""
    stream = ReplyStream(thinking=True)
    assert stream.feed("<|channel>thought\n") == []
    assert [e.text for e in stream.feed("noted<channel|>It is 18 C.")] == ["noted", "It is 18 C."]
    assert stream.finish() == Reply("It is 18 C.", "noted")


def test_a_template_from_a_checkpoint_renders_in_the_sandbox():
    """Only the shipped template renders unsandboxed; any other text cannot reach Python internals."""
    with pytest.raises(Qat4Error, match="chat template"):
        render_prompt([{"role": "user", "content": "hi"}], template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    shipped = render_prompt([{"role": "user", "content": "hi"}])
    assert render_prompt([{"role": "user", "content": "hi"}], template=default_chat_template()) == shipped


WRITE_TOOL = {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "content": {"type": "string"}, "mode": {"type": "string"}, "n": {"type": "number"}}}}}

# A value written without delimiters is a string only where the tool's schema types the property as
# one, and only in a call the model closed: (raw reply, expected).
SCHEMA_REPLIES = {
    "raw_terminal_multiline": (f"<|tool_call>call:write{{content:\n\n# Title, with: colons}}<tool_call|>",
                               Reply(tool_calls=[{"name": "write", "arguments": {"content": "\n\n# Title, with: colons"}}])),
    "raw_before_next_property": (f"<|tool_call>call:write{{content:hello, world,mode:{D}fast{D}}}<tool_call|>",
                                 Reply(tool_calls=[{"name": "write", "arguments": {"content": "hello, world",
                                                                                   "mode": "fast"}}])),
    "raw_without_object_close": ("<|tool_call>call:write{content:hello, world<tool_call|><|tool_response>",
                                 Reply(tool_calls=[{"name": "write", "arguments": {"content": "hello, world"}}])),
    "raw_in_content_then_text": ("<|tool_call>call:write{content:a, b}<tool_call|>Done.",
                                 Reply("Done.", tool_calls=[{"name": "write", "arguments": {"content": "a, b"}}])),
    "number_property_not_repaired": ("<|tool_call>call:write{n:hello, world}<tool_call|>",
                                     Reply(invalid_tool_calls=[_invalid("write", "{n:hello, world}", "expected ':' at 25")])),
    "unknown_function_not_repaired": ("<|tool_call>call:other{content:hello, world}<tool_call|>",
                                      Reply(invalid_tool_calls=[_invalid("other", "{content:hello, world}",
                                                                         "expected ':' at 31")])),
    "literal_start_stays_a_number": ("<|tool_call>call:write{content:123}<tool_call|>",
                                     Reply(tool_calls=[{"name": "write", "arguments": {"content": 123}}])),
    "cut_off_not_guessed": ("<|tool_call>call:write{content:hello, world",
                            Reply(invalid_tool_calls=[_invalid("write", "{content:hello, world", UNFINISHED)])),
}


@pytest.mark.parametrize("name", SCHEMA_REPLIES)
def test_schema_gated_repairs(name):
    text, expected = SCHEMA_REPLIES[name]
    assert parse_reply(text, tools=[WRITE_TOOL]) == expected
    for chunks in _chunkings(text, name):
        reply, content, _, calls, invalid_calls = _stream(chunks, False, [WRITE_TOOL])
        assert reply == expected
        assert (content or None, calls, invalid_calls) == (expected.content, expected.tool_calls,
                                                          expected.invalid_tool_calls)


def test_raw_strings_need_the_schema():
    text = "<|tool_call>call:write{content:hello, world<tool_call|>"
    assert parse_reply(text).invalid_tool_calls and not parse_reply(text).tool_calls
