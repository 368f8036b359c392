"""Gemma 4 chat markup: OpenAI messages rendered into a prompt, and the model's reply parsed back.

Prompt side: `render_prompt` adapts OpenAI chat messages and tools to what the Gemma 4 chat template
expects and renders the template (the checkpoint's own, or the canonical one shipped in
`qat4/data`) with jinja2.

Reply side: the model's raw output, decoded with special tokens kept, looks like

    <|channel>thought\\n...reasoning...<channel|>answer text<turn|>
    <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>

`parse_reply` splits it into content, reasoning and tool calls; `ReplyStream` does the same on text
deltas as they are generated (`parse_reply` is a `ReplyStream` fed the whole text at once). Markup
never reaches content or reasoning: a call that is cut off or does not parse is reported apart, as
an invalid tool call.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qat4.errors import Qat4Error

BOS = "<bos>"
THOUGHT_OPEN = "<|channel>"
THOUGHT_CLOSE = "<channel|>"
THOUGHT_LABEL = "thought"
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
CALL_PREFIX = "call:"
STRING_DELIM = '<|"|>'
TURN_CLOSE = "<turn|>"
RESPONSE_OPEN = "<|tool_response>"
EOS_TEXT = "<eos>"
STOP_MARKERS = (TURN_CLOSE, RESPONSE_OPEN, EOS_TEXT)

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_RESOURCE = "chat_template.jinja"
MAX_ARGUMENT_DEPTH = 64  # nesting levels of tool-call arguments the template renders (it recurses per level)


# ---------------------------------------------------------------------------------------------
# Prompt rendering
# ---------------------------------------------------------------------------------------------

def render_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                  enable_thinking: bool = False, add_generation_prompt: bool = True,
                  template: str | None = None) -> str:
    """The prompt text for an OpenAI-style conversation, `<bos>` included.

    Messages have roles system, developer (rendered as system), user, assistant and tool; content
    is a string or a list of `{"type": "text", "text": ...}` parts. Assistant `tool_calls` carry
    `function.arguments` as a JSON string (or an object); tool messages name their call with
    `tool_call_id`. `template` is a jinja chat template (default: the canonical Gemma 4 one).
    Raises Qat4Error naming the field for a malformed message or tool.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise Qat4Error("messages must be a non-empty list of messages")
    template = default_chat_template() if template is None else template
    compiled = _compile(template, template != default_chat_template())
    context = {
        "messages": _adapt_messages(messages),
        "tools": _adapt_tools(tools) or None,
        "enable_thinking": enable_thinking,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": BOS,
    }
    try:
        return compiled.render(**context)
    except jinja2.TemplateError as exc:
        raise Qat4Error(f"the chat template rejected the conversation: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        # a value of a shape the template does not expect (a tool schema's nested "type": 5, say)
        raise Qat4Error(f"the chat template cannot render the conversation ({type(exc).__name__}: {exc}); "
                        "check the tools' parameter schemas and the messages") from None


@functools.cache
def default_chat_template() -> str:
    """The canonical Gemma 4 E2B chat template shipped with qat4."""
    return (resources.files("qat4") / "data" / TEMPLATE_RESOURCE).read_text(encoding="utf-8")


def _raise_template_error(message: str) -> None:
    """`raise_exception(...)` as chat templates call it."""
    raise jinja2.TemplateError(message)


@functools.cache
def _environment(sandboxed: bool) -> jinja2.Environment:
    """The jinja2 environment chat templates are written for: sandboxed for a template that came
    with a checkpoint; plain for the canonical one shipped with qat4, which renders the same text
    about 12 times faster (the sandbox checks every attribute access, and Gemma 4's template
    scans the messages after each message, so its cost grows with their square: 1,000 short
    messages took 5.2 s sandboxed, 0.47 s plain)."""
    kind = ImmutableSandboxedEnvironment if sandboxed else jinja2.Environment
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_template_error
    return env


@functools.lru_cache(maxsize=8)
def _compile(source: str, sandboxed: bool) -> jinja2.Template:
    """A chat template compiled once per distinct text."""
    try:
        return _environment(sandboxed).from_string(source)
    except jinja2.TemplateError as exc:
        raise Qat4Error(f"the chat template is not valid jinja: {exc}") from None


def _adapt_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validated copies of OpenAI messages in the shape the Gemma 4 template reads.

    Tool results travel as `tool_responses` (`{"name", "response"}`) of the assistant message that
    made the calls, the form every Gemma 4 template revision renders, so object results render as
    `response:NAME{key:value,...}`.
    """
    adapted: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise Qat4Error(f"{where} is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise Qat4Error(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        if role == "tool":
            _attach_tool_result(message, where, adapted)
        elif role == "assistant":
            adapted.append(_adapt_assistant(message, where))
        else:
            adapted.append({"role": "user" if role == "user" else "system", "content": _content(message, where)})
    return adapted


def _content(message: Mapping[str, Any], where: str, *, optional: bool = False,
             allow_object: bool = False) -> str | list[dict[str, str]] | dict[str, Any] | None:
    """A message's content: a string, a list of text parts, None when `optional`, an object when allowed."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if optional:
            return None
        raise Qat4Error(f"{where}.content is missing")
    if allow_object and isinstance(content, Mapping):
        return dict(content)
    if isinstance(content, Sequence):
        return [_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    raise Qat4Error(f"{where}.content must be a string or a list of text parts")


def _text_part(part: Any, where: str) -> dict[str, str]:
    """One `{"type": "text", "text": ...}` content part."""
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise Qat4Error(f"{where} has type {kind!r}; only text parts are supported")
    if not isinstance(part.get("text"), str):
        raise Qat4Error(f"{where}.text must be a string")
    return {"type": "text", "text": part["text"]}


def _adapt_assistant(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An assistant message with its tool-call arguments parsed."""
    adapted: dict[str, Any] = {"role": "assistant", "content": _content(message, where, optional=True)}
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str):
            adapted[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence):
            raise Qat4Error(f"{where}.tool_calls must be a list")
        adapted["tool_calls"] = [_adapt_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    return adapted


def _adapt_tool_call(call: Any, where: str) -> dict[str, Any]:
    """One OpenAI tool call with `arguments` as a mapping."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise Qat4Error(f"{where}.function is missing")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise Qat4Error(f"{where}.function.name is missing")
    arguments = _arguments(function.get("arguments"), f"{where}.function.arguments")
    if not isinstance(call.get("id"), (str, type(None))):
        raise Qat4Error(f"{where}.id must be a string")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(arguments: Any, where: str) -> dict[str, Any]:
    """Tool-call arguments as a dict: a JSON object text or a mapping; absent or blank means none."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise Qat4Error(f"{where} is not valid JSON") from None
        except RecursionError:
            raise Qat4Error(f"{where} nests deeper than {MAX_ARGUMENT_DEPTH} levels") from None
    if not isinstance(arguments, Mapping):
        raise Qat4Error(f"{where} is not a JSON object")
    if _deeper_than(arguments, MAX_ARGUMENT_DEPTH):
        raise Qat4Error(f"{where} nests deeper than {MAX_ARGUMENT_DEPTH} levels")
    return dict(arguments)


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether lists and objects in ``value`` nest deeper than ``levels`` (without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > levels:
            return True
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def _attach_tool_result(message: Mapping[str, Any], where: str, adapted: list[dict[str, Any]]) -> None:
    """Add a tool message to the `tool_responses` of the assistant message whose call it answers."""
    if not adapted or not adapted[-1].get("tool_calls"):
        raise Qat4Error(f"{where} is a tool result that does not follow an assistant message with tool_calls")
    call_names = {call["id"]: call["function"]["name"] for call in adapted[-1]["tool_calls"]}
    call_id = message.get("tool_call_id")
    if isinstance(call_id, str) and call_id in call_names:
        name = call_names[call_id]
    elif call_id is None and isinstance(message.get("name"), str):
        name = message["name"]
    elif call_id is None:
        raise Qat4Error(f"{where}.tool_call_id is missing")
    else:
        raise Qat4Error(f"{where}.tool_call_id {call_id!r} matches no call of the assistant message before it")
    content = _content(message, where, allow_object=True)
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    adapted[-1].setdefault("tool_responses", []).append({"name": name, "response": content})


def _adapt_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Validated copies of OpenAI function tools."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise Qat4Error("tools must be a list")
    return [_adapt_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _adapt_tool(tool: Any, where: str) -> dict[str, Any]:
    """One `{"type": "function", "function": {name, description, parameters}}` tool."""
    if not isinstance(tool, Mapping):
        raise Qat4Error(f"{where} is not an object")
    if tool.get("type", "function") != "function":
        raise Qat4Error(f"{where}.type {tool.get('type')!r} is not 'function'")
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise Qat4Error(f"{where}.function.name is missing")
    if not isinstance(function.get("parameters", {}), (Mapping, type(None))):
        raise Qat4Error(f"{where}.function.parameters must be a JSON object")
    return {"type": "function", "function": dict(function)}


# ---------------------------------------------------------------------------------------------
# Reply parsing
# ---------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """A parsed reply: answer text, reasoning text, tool calls `{"name", "arguments"}` and invalid
    tool calls `{"name", "arguments", "error"}`: calls cut off before their closing marker (by the
    token cap, a stop string or the next call) or that do not parse, with `arguments` the text the
    model wrote after the name (not JSON) and `error` saying what is wrong."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ReplyEvent:
    """What one `ReplyStream.feed` learned: a content or reasoning delta, a complete tool call, or
    an invalid one (in `tool_call`, shaped as in `Reply.invalid_tool_calls`)."""

    kind: Literal["content", "reasoning", "tool_call", "invalid_tool_call"]
    text: str = ""
    tool_call: dict[str, Any] | None = None


def parse_reply(text: str, thinking: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> Reply:
    """Split raw model output (special tokens kept as text) into content, reasoning and tool calls.

    `thinking` says thinking was enabled: a thought block left unterminated is then reasoning
    (otherwise it is content). A closed thought block is reasoning either way, not dropped: it stays
    out of content, a client that does not read reasoning loses nothing by it, and one that does sees
    what the tokens it is billed for said. Text from the first stop marker (`<turn|>`, `<|tool_response>`,
    `<eos>`) on is ignored. A tool call that is cut off or does not parse is an invalid tool call.
    `tools` (OpenAI function tools) lets the call parser repair by the parameters' schemas (see
    `_CallParser`).
    """
    stream = ReplyStream(thinking, tools)
    stream.feed(text)
    return stream.finish()


class _State(enum.Enum):
    """Where the parser is: answer text, a thought block, a tool call, or past a stop marker."""

    CONTENT = "content"
    THOUGHT = "thought"
    CALL = "call"
    DONE = "done"


# The markers that end the text of each state. Stray closing markers in content and a doubled
# opener in a thought block are dropped.
_MARKERS = {
    _State.CONTENT: (THOUGHT_OPEN, CALL_OPEN, THOUGHT_CLOSE, CALL_CLOSE, *STOP_MARKERS),
    _State.THOUGHT: (THOUGHT_OPEN, THOUGHT_CLOSE, *STOP_MARKERS),
    _State.CALL: (CALL_CLOSE, CALL_OPEN, *STOP_MARKERS),
}


class ReplyStream:
    """Incremental `parse_reply`: feed text deltas, get events as soon as they are certain.

    Content and reasoning deltas carry no markup: text that could be the start of a marker is held
    back until the next delta decides it, and surrounding whitespace of each field is trimmed
    (trailing whitespace is held until more text follows). A tool call is emitted once its closing
    marker arrives, an invalid one once it is known to be invalid. With thinking off, a thought
    block is emitted as one reasoning delta when it closes. If the prompt ends inside an open
    thought channel, feed that `<|channel>thought\\n` first. `finish()` returns the same Reply
    `parse_reply` gives for the concatenated deltas.
    """

    def __init__(self, thinking: bool = False, tools: Sequence[Mapping[str, Any]] | None = None):
        """`thinking`: whether thinking was enabled; `tools`: the request's function tools (see `parse_reply`)."""
        self._thinking = thinking
        self._parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools or ()
                            if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)}
        self._state = _State.CONTENT
        self._pending = ""
        self._label_pending = False
        self._thought = ""
        self._call = ""
        self._content = _Field()
        self._reasoning = _Field()
        self._tool_calls: list[dict[str, Any]] = []
        self._invalid_tool_calls: list[dict[str, Any]] = []
        self._events: list[ReplyEvent] = []

    def feed(self, delta: str) -> list[ReplyEvent]:
        """Add generated text; returns the events it completes."""
        if self._state is not _State.DONE:
            self._pending += delta
        return self._advance(final=False)

    def flush(self) -> list[ReplyEvent]:
        """End of generation: returns the events of everything still held back."""
        return self._advance(final=True)

    def finish(self) -> Reply:
        """End of generation: the whole reply (held-back text included)."""
        self.flush()
        return Reply(self._content.value, self._reasoning.value, list(self._tool_calls),
                     list(self._invalid_tool_calls))

    def _advance(self, final: bool) -> list[ReplyEvent]:
        """Consume pending text as far as it is decided; everything when `final`."""
        self._events = []
        while self._state is not _State.DONE and self._step(final):
            pass
        return self._events

    def _step(self, final: bool) -> bool:
        """Handle the text up to the next marker; False when the rest must wait (or all is done)."""
        if self._label_pending and not self._drop_label(final):
            return False
        markers = _MARKERS[self._state]
        index, marker = _first_marker(self._pending, markers)
        if marker is None:
            cut = len(self._pending) - (0 if final else _partial_marker_length(self._pending, markers))
            self._take(self._pending[:cut])
            self._pending = self._pending[cut:]
            if final:
                self._end(None)
            return False
        self._take(self._pending[:index])
        self._pending = self._pending[index + len(marker):]
        self._on_marker(marker)
        return True

    def _drop_label(self, final: bool) -> bool:
        """Drop the channel name `thought` that opens a thought block; False while the text so far
        cannot tell. It is the name only as a whole word: `thoughtful` is reasoning."""
        label_and_next = self._pending[:len(THOUGHT_LABEL) + 1]
        if not final and len(label_and_next) <= len(THOUGHT_LABEL) and THOUGHT_LABEL.startswith(label_and_next):
            return False
        self._label_pending = False
        if label_and_next.startswith(THOUGHT_LABEL) and not _is_word_char(label_and_next[len(THOUGHT_LABEL):]):
            self._pending = self._pending[len(THOUGHT_LABEL):]
        return True

    def _take(self, text: str) -> None:
        """Text between markers, attributed to the current state."""
        if self._state is _State.CONTENT:
            self._emit("content", self._content.push(text))
        elif self._state is _State.CALL:
            self._call += text
        elif self._thinking:
            self._emit("reasoning", self._reasoning.push(text))
        else:
            self._thought += text

    def _on_marker(self, marker: str) -> None:
        """Change state on a complete marker."""
        if marker in STOP_MARKERS:
            self._end(marker)
        elif marker == THOUGHT_OPEN and self._state is _State.THOUGHT:
            self._label_pending = True
        elif self._state is _State.THOUGHT:
            self._emit("reasoning", self._reasoning.push(self._thought))
            self._thought = ""
            self._state = _State.CONTENT
        elif self._state is _State.CALL:
            self._end_call(marker)
            if marker == CALL_CLOSE:
                self._state = _State.CONTENT
        elif marker == THOUGHT_OPEN:
            self._state = _State.THOUGHT
            self._label_pending = True
        elif marker == CALL_OPEN:
            self._state = _State.CALL

    def _end(self, marker: str | None) -> None:
        """Stop `marker` or end of text (None): an open thought block (thinking off) becomes content, an
        open call is tried."""
        if self._state is _State.THOUGHT:
            self._emit("content", self._content.push(self._thought))
            self._thought = ""
        elif self._state is _State.CALL:
            self._end_call(marker)
        self._state = _State.DONE
        self._pending = ""

    def _end_call(self, marker: str | None) -> None:
        """Parse the collected call, ended by `marker` (None: by the end of the text); one that does not
        parse is an invalid call, named as far as it goes.

        Only a call the model ended with a marker gets its slips repaired (see `_CallParser`): the end
        of the text may be the token cap, and a call cut there is reported, not guessed at.
        """
        try:
            call = _CallParser(self._call, repair=marker is not None, parameters=self._parameters).call()
        except (ValueError, RecursionError) as exc:
            error = (f"the call does not parse: {_reason(exc)}" if marker == CALL_CLOSE
                     else f"the call ends before its closing {CALL_CLOSE}")
            invalid = {**_name_and_arguments(self._call), "error": error}
            self._invalid_tool_calls.append(invalid)
            self._events.append(ReplyEvent("invalid_tool_call", tool_call=invalid))
        else:
            self._tool_calls.append(call)
            self._events.append(ReplyEvent("tool_call", tool_call=call))
        self._call = ""

    def _emit(self, kind: Literal["content", "reasoning"], text: str) -> None:
        """Record a non-empty text delta."""
        if text:
            self._events.append(ReplyEvent(kind, text))


class _Field:
    """One text field of a reply, its surrounding whitespace trimmed as it streams in."""

    def __init__(self):
        self.text = ""
        self._held = ""

    def push(self, text: str) -> str:
        """Append raw text; returns the part that is final now (trailing whitespace is held back)."""
        text = self._held + text if self.text else text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        self.text += body
        return body

    @property
    def value(self) -> str | None:
        """The trimmed text, None when empty."""
        return self.text or None


def _first_marker(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """Index and text of the earliest marker in `text` (no marker is a prefix of another)."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (len(text), None)


def _partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is an incomplete start of a marker."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _is_word_char(char: str) -> bool:
    """Whether `char` (one character, or none) continues a word."""
    return char.isalnum() or char == "_"


def _name_and_arguments(body: str) -> dict[str, str]:
    """The name and the raw argument text of a call's body, `call:NAME{...`, however far it got."""
    name, brace, arguments = body.strip().removeprefix(CALL_PREFIX).partition("{")
    return {"name": name.strip(), "arguments": brace + arguments}


def _reason(exc: Exception) -> str:
    return "its values are nested too deeply" if isinstance(exc, RecursionError) else str(exc)


class _Malformed(ValueError):
    """The text is not a tool call."""


def _is_string(schema: Any) -> bool:
    """Whether a property's JSON Schema types it as a string (and nothing else)."""
    return isinstance(schema, Mapping) and schema.get("type") == "string"


_SINGLE_QUOTE_END = re.compile(r"'(?:" + re.escape(STRING_DELIM) + r")?(?=\s*[,}\]])")
_NUMBER = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None, "None": None}
_NAME_FORBIDDEN = frozenset('{}[],:"<>') | frozenset(" \t\r\n")


class _CallParser:
    """Recursive-descent parser of one call, `call:NAME{key:value,...}`.

    Values are `<|"|>`-delimited strings (verbatim: `{}`, `,`, `"` and `:` are literal inside),
    JSON strings, numbers, true/false/null/None, `[...]` arrays and `{...}` objects whose keys are
    bare, `<|"|>`-delimited or JSON-quoted. Any other bare word is taken as a string. The model
    sometimes quotes a value Python-style, `'text'`, at times with a stray `<|"|>` after it: that is
    the string `text`, verbatim, its end the quote that a `,`, `}` or `]` follows.

    With `repair`, slips Gemma 4 is known to make are mended: a `<|"|>` string left open runs to the
    call's final `}` (`{a:<|"|>hello}` is `{"a": "hello"}`); and where the function's schema (in
    `parameters`, by function name) types a property as a string, a value written without any
    delimiter is that string, verbatim (commas, colons, line breaks and all), up to the next
    `,KEY:` of a property of the same object, or for the arguments' last property up to their final
    `}` or, when that is missing too, the end of the call (`{content:# Title\n\nText, more` is
    `{"content": "# Title\n\nText, more"}`). A value that starts like a number, literal, string,
    list or object is never taken raw.
    """

    def __init__(self, text: str, repair: bool = False, parameters: Mapping[str, Any] | None = None):
        self._text = text
        self._pos = 0
        self._repair = repair
        self._parameters = parameters or {}

    def call(self) -> dict[str, Any]:
        """The whole body: name and argument object, nothing after it but whitespace."""
        self._skip_space()
        self._accept(CALL_PREFIX)
        name = self._until("{").strip()
        if not name or _NAME_FORBIDDEN.intersection(name):
            raise _Malformed(f"bad function name {name!r}")
        arguments = self._object(self._parameters.get(name), outermost=True)
        self._skip_space()
        if self._pos != len(self._text):
            raise _Malformed("text after the arguments")
        return {"name": name, "arguments": arguments}

    def _value(self, schema: Any = None) -> Any:
        """Any value (of `schema`, when known)."""
        self._skip_space()
        if self._text.startswith(STRING_DELIM, self._pos):
            return self._delimited_string()
        first = self._text[self._pos:self._pos + 1]
        if first == '"':
            return self._json_string()
        if first == "{":
            return self._object(schema)
        if first == "[":
            return self._array(schema.get("items") if isinstance(schema, Mapping) else None)
        if first == "'" and (quoted := self._single_quoted_string()) is not None:
            return quoted
        return self._scalar()

    def _object(self, schema: Any = None, outermost: bool = False) -> dict[str, Any]:
        """`{key:value,...}`, of `schema` when known (see the class on repairs)."""
        self._expect("{")
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        properties = properties if isinstance(properties, Mapping) else {}
        result: dict[str, Any] = {}
        for _ in self._items("}"):
            key = self._key()
            self._skip_space()
            self._expect(":")
            sub = properties.get(key)
            raw = self._raw_string(properties, outermost) if self._repair and _is_string(sub) else None
            if raw is not None:
                result[key] = raw
                if self._pos == len(self._text):  # the arguments' closing brace is missing too
                    return result
            else:
                result[key] = self._value(sub)
        return result

    def _raw_string(self, properties: Mapping[str, Any], outermost: bool) -> str | None:
        """A string-typed value written without delimiters (see the class), or None when the value
        is not one."""
        rest = self._text[self._pos:]
        head = rest.lstrip()
        if not head or head.startswith((STRING_DELIM, '"', "'", "{", "[")):
            return None
        word = re.match(r"[^,}\]]*", head).group().strip()
        if word in _LITERALS or _NUMBER.fullmatch(word):
            return None
        keys = "|".join(re.escape(k) for k in sorted(properties, key=len, reverse=True))
        after = re.search(rf",\s*(?:{keys})\s*:", rest) if keys else None
        if after is not None:
            end = after.start()
        elif not outermost:
            return None
        else:
            body = rest.rstrip()
            end = len(body) - 1 if body.endswith("}") else len(rest)
        self._pos += end
        return rest[:end]

    def _array(self, items: Any = None) -> list[Any]:
        """`[value,...]` (of the item schema `items`, when known)."""
        self._expect("[")
        return [self._value(items) for _ in self._items("]")]

    def _items(self, close: str) -> Iterator[None]:
        """Yield once per comma-separated item (parsed by the caller) until `close`, which it consumes.

        A trailing comma before `close` is tolerated.
        """
        self._skip_space()
        while not self._accept(close):
            yield
            self._skip_space()
            if not self._accept(","):
                self._expect(close)
                return
            self._skip_space()

    def _key(self) -> str:
        """An object key: bare, `<|"|>`-delimited or JSON-quoted."""
        self._skip_space()
        if self._text.startswith(STRING_DELIM, self._pos):
            return self._delimited_string()
        if self._text.startswith('"', self._pos):
            return self._json_string()
        key = self._until(':,{}[]"').strip()
        if not key:
            raise _Malformed(f"missing key at {self._pos}")
        return key

    def _scalar(self) -> Any:
        """A number, literal or bare word, ending at `,`, `}` or `]`."""
        word = self._until(",}]").strip()
        if word in _LITERALS:
            return _LITERALS[word]
        if _NUMBER.fullmatch(word):
            return int(word) if word.lstrip("-").isdigit() else float(word)
        if not word or set('{[:"').intersection(word):
            raise _Malformed(f"unexpected {word!r} at {self._pos}")
        return word

    def _delimited_string(self) -> str:
        """`<|"|>text<|"|>`, taken verbatim (an unterminated one is repaired, see the class)."""
        start = self._pos + len(STRING_DELIM)
        end = self._text.find(STRING_DELIM, start)
        if end >= 0:
            self._pos = end + len(STRING_DELIM)
            return self._text[start:end]
        final_brace = len(self._text.rstrip()) - 1
        if not self._repair or final_brace < start or self._text[final_brace] != "}":
            raise _Malformed("unterminated string")
        self._pos = final_brace
        return self._text[start:final_brace]

    def _single_quoted_string(self) -> str | None:
        """`'text'` (a `<|"|>` right after it dropped); None when no quote ends the value."""
        end = _SINGLE_QUOTE_END.search(self._text, self._pos + 1)
        if end is None:
            return None
        text = self._text[self._pos + 1:end.start()]
        self._pos = end.end()
        return text

    def _json_string(self) -> str:
        """A JSON string literal with its escapes."""
        end = self._pos + 1
        while end < len(self._text) and self._text[end] != '"':
            end += 2 if self._text[end] == "\\" else 1
        if end >= len(self._text):
            raise _Malformed("unterminated string")
        literal = self._text[self._pos:end + 1]
        self._pos = end + 1
        return json.loads(literal, strict=False)

    def _until(self, stops: str) -> str:
        """The text up to (not including) the next character in `stops`, or to the end."""
        start = self._pos
        while self._pos < len(self._text) and self._text[self._pos] not in stops:
            self._pos += 1
        return self._text[start:self._pos]

    def _skip_space(self) -> None:
        while self._pos < len(self._text) and self._text[self._pos].isspace():
            self._pos += 1

    def _accept(self, token: str) -> bool:
        """Consume `token` if the text continues with it."""
        if self._text.startswith(token, self._pos):
            self._pos += len(token)
            return True
        return False

    def _expect(self, token: str) -> None:
        if not self._accept(token):
            raise _Malformed(f"expected {token!r} at {self._pos}")
