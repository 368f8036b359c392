"""The model's reply parsed into content, reasoning and tool calls, whole or as it streams.

The model's raw output, decoded with special tokens kept, looks like

    <|channel>thought\\n...reasoning...<channel|>answer text<turn|>
    <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>

`parse_reply` splits it into content, reasoning and tool calls; `ReplyStream` does the same on text
deltas as they are generated (`parse_reply` is a `ReplyStream` fed the whole text at once). Markup
never reaches content or reasoning: a call that is cut off or does not parse is reported apart, as
an invalid tool call. The calls themselves are read by :mod:`qat4.chat.tool_calls`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qat4.chat.markup import CALL_CLOSE, CALL_OPEN, STOP_MARKERS, THOUGHT_CLOSE, THOUGHT_LABEL, THOUGHT_OPEN
from qat4.chat.tool_calls import call_name_and_arguments, failure_reason, parse_call


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

    `thinking` says thinking was enabled: a thought block (`<|channel>thought\\n...<channel|>`, or
    left open at the end) is then reasoning; with thinking off it is dropped, as ollama does: it is
    never content, and the client did not ask for reasoning. A thought block ends at `<channel|>`
    or at a `<|tool_call>` the model opens inside it. Slips the model makes around thought blocks are
    read as it meant them: a doubled `<|channel>`, a stray `<channel|>` or `<tool_call|>` (dropped),
    and a reply that opens with the bare label `thought` and a line break (or `<channel|>`) but no
    `<|channel>`: a thought block whose opening marker is missing once a `<channel|>` or a call
    closes it, a spurious label before the answer (dropped, the rest content) if none does. Text
    from the first stop marker (`<turn|>`, `<|tool_response>`, `<eos>`) on is ignored. A tool call
    that is cut off or does not parse is an invalid tool call. `tools` (OpenAI function tools) lets
    the call parser repair by the parameters' schemas (see :mod:`qat4.chat.tool_calls`).
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


# The markers that end the text of each state. Stray closing markers and a doubled opener in a
# thought block are dropped.
_MARKERS = {
    _State.CONTENT: (THOUGHT_OPEN, CALL_OPEN, THOUGHT_CLOSE, CALL_CLOSE, *STOP_MARKERS),
    _State.THOUGHT: (THOUGHT_OPEN, THOUGHT_CLOSE, CALL_OPEN, CALL_CLOSE, *STOP_MARKERS),
    _State.CALL: (CALL_CLOSE, CALL_OPEN, *STOP_MARKERS),
}
# How a reply opens a thought block whose `<|channel>` is missing: the bare label, then a line break
# or the block's end.
_BARE_OPENINGS = (THOUGHT_LABEL + "\n", THOUGHT_LABEL + THOUGHT_CLOSE)


class ReplyStream:
    """Incremental `parse_reply`: feed text deltas, get events as soon as they are certain.

    Content and reasoning deltas carry no markup: text that could be the start of a marker is held
    back until the next delta decides it, and surrounding whitespace of each field is trimmed
    (trailing whitespace is held until more text follows). A tool call is emitted once its closing
    marker arrives, an invalid one once it is known to be invalid. A reply that opens with the bare
    `thought` label is held back until it is known whether that was a thought block (then one
    reasoning delta) or not (content). If the prompt ends inside an open thought channel, feed that
    `<|channel>thought\\n` first. `finish()` returns the same Reply `parse_reply` gives for the
    concatenated deltas.
    """

    def __init__(self, thinking: bool = False, tools: Sequence[Mapping[str, Any]] | None = None):
        """`thinking`: whether thinking was enabled; `tools`: the request's function tools (see `parse_reply`)."""
        self._thinking = thinking
        self._parameters = {t["function"]["name"]: t["function"].get("parameters") for t in tools or ()
                            if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)}
        self._state = _State.CONTENT
        self._pending = ""
        self._at_start = True
        self._label_pending = False
        self._bare_thought: str | None = None  # the text of a thought block opened by its bare label
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
        if self._at_start and not self._read_opening(final):
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

    def _read_opening(self, final: bool) -> bool:
        """At the start of the reply: enter a thought block when it opens with a bare label (see
        `parse_reply`); False while the text so far cannot tell."""
        head = self._pending.lstrip()
        if not final and any(opening.startswith(head) and opening != head for opening in _BARE_OPENINGS):
            return False
        self._at_start = False
        if head.startswith(_BARE_OPENINGS):
            self._pending = head[len(THOUGHT_LABEL):].removeprefix("\n")
            self._state = _State.THOUGHT
            self._bare_thought = ""
        return True

    def _take(self, text: str) -> None:
        """Text between markers, attributed to the current state."""
        if self._state is _State.CONTENT:
            self._emit("content", self._content.push(text))
        elif self._state is _State.CALL:
            self._call += text
        elif self._bare_thought is not None:
            self._bare_thought += text
        elif self._thinking:
            self._emit("reasoning", self._reasoning.push(text))

    def _on_marker(self, marker: str) -> None:
        """Change state on a complete marker."""
        if marker in STOP_MARKERS:
            self._end(marker)
        elif self._state is _State.THOUGHT:
            if marker == THOUGHT_OPEN:
                self._label_pending = True
            elif marker != CALL_CLOSE:
                self._end_thought()
                self._state = _State.CALL if marker == CALL_OPEN else _State.CONTENT
        elif self._state is _State.CALL:
            self._end_call(marker)
            if marker == CALL_CLOSE:
                self._state = _State.CONTENT
        elif marker == THOUGHT_OPEN:
            self._state = _State.THOUGHT
            self._label_pending = True
        elif marker == CALL_OPEN:
            self._state = _State.CALL

    def _end_thought(self) -> None:
        """A thought block closed: one its bare label opened is reasoning now that it is known to be one."""
        if self._bare_thought is not None and self._thinking:
            self._emit("reasoning", self._reasoning.push(self._bare_thought))
        self._bare_thought = None

    def _end(self, marker: str | None) -> None:
        """Stop `marker` or end of text (None): a thought block that only a bare label opened was not one (its
        text is content), an open call is tried."""
        if self._bare_thought is not None:
            self._emit("content", self._content.push(self._bare_thought))
            self._bare_thought = None
        elif self._state is _State.CALL:
            self._end_call(marker)
        self._state = _State.DONE
        self._pending = ""

    def _end_call(self, marker: str | None) -> None:
        """Parse the collected call, ended by `marker` (None: by the end of the text); one that does not
        parse is an invalid call, named as far as it goes.

        Only a call the model ended with a marker gets its slips repaired (see :mod:`qat4.chat.tool_calls`): the end
        of the text may be the token cap, and a call cut there is reported, not guessed at.
        """
        try:
            call = parse_call(self._call, repair=marker is not None, parameters=self._parameters)
        except (ValueError, RecursionError) as exc:
            error = (f"the call does not parse: {failure_reason(exc)}" if marker == CALL_CLOSE
                     else f"the call ends before its closing {CALL_CLOSE}")
            invalid = {**call_name_and_arguments(self._call), "error": error}
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
