"""Constrained decoding: grammars compiled over the Gemma 4 vocabulary, and the per-sequence state
that says which tokens may come next.

xgrammar does the work. Measured on a 2-core x86 CPU over the real 262,144-token vocabulary,
walking a 51-token JSON object through a schema with nested objects, arrays, enums and bounded
numbers (median / 90th percentile per token to fill the next-token bitmask): xgrammar 0.2.9
3 / 32 µs (any JSON object 8 / 26 µs); llguidance 1.9.1 44 / 94 µs (any object 36 / 60 µs).
Compiling that schema took xgrammar 45 ms, building its vocabulary 0.15 s (llguidance 1.0 s).
Both keep the per-token cost far below a decode step, and xgrammar's is ten times lower, which is
what a batch of constrained rows pays on the host every step; the bitmask is applied on the device
by :func:`qat4.engine.sampler.mask_logits`.

The vocabulary is given to xgrammar as raw bytes: `▁` is a space, `<0xNN>` the byte NN. Control
tokens, unused ids and the chat template's markers are *special* (never part of grammar text), so a
JSON string can never hold `<turn|>` or open a tool call. Three views of the vocabulary: "text"
(JSON without thinking, GBNF grammars); "markup", in which `<|tool_call>`, `<tool_call|>` and
`<|"|>` are their text, for tool calls; and "thought", for JSON after a thought block, in which
only `<|channel>` and `<channel|>` are text, each spelled behind a control character (`\\x01`).
After a grammar is complete only a stop token may follow: one of the ids the engine stops on, which
come from the checkpoint (:attr:`qat4.engine.Engine.stop_token_ids`; for Gemma 4 `<eos>`, `<turn|>`
and `<|tool_response>`).

A JSON string never holds a raw control character, whatever view its grammar is compiled over:
xgrammar's rule for the characters of a string with `minLength` or `maxLength` lets everything
but `"`, `\\` and line breaks through (a tab, a NUL, ...), and :func:`json_grammar` narrows it.
That is also what keeps the thought channel's markers out of the JSON after a thought block: the
"thought" view spells them with a control character first, so no JSON string can take them (as
plain text, `<|channel>` would be a string's text like any other, and the reply's parser would
read it as a thought block opening inside the answer).

Compiled grammars are cached per tokenizer, stop tokens and grammar (xgrammar's compiled form is
shared by every sequence that uses it); each sequence holds one :class:`GrammarConstraint`,
dropped when it ends.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xgrammar

from qat4.chat.call_grammar import CallGrammar, literal
from qat4.chat.markup import CALL_CLOSE, CALL_OPEN, STRING_DELIM, THOUGHT_CLOSE, THOUGHT_OPEN
from qat4.errors import Qat4Error
from qat4.tokenizer import piece_bytes

_CALL_MARKERS = (CALL_OPEN, CALL_CLOSE, STRING_DELIM)
_UNUSED_TOKEN = re.compile(r"<unused\d+>")
COMPILED_CACHE = 64  # compiled grammars kept per tokenizer, least recently used out first
# The thought channel's markers in the "thought" view, and the optional thought block before JSON in it.
_SPELLED = {marker: "\x01" + marker for marker in (THOUGHT_OPEN, THOUGHT_CLOSE)}
_THOUGHT = f"{literal(_SPELLED[THOUGHT_OPEN])} ([^<\\x01] | \"<\" [^c\\x01])* {literal(_SPELLED[THOUGHT_CLOSE])}"
# xgrammar's character class for the characters of a string with a length bound, and the one JSON allows
_LENGTH_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


class GrammarConstraint:
    """One sequence's place in a compiled grammar (the engine's ``TokenConstraint``).

    With a ``trigger`` token the constraint starts inactive (the sequence picks freely) and becomes
    active when the trigger is accepted: a tool call that the model opens (`<|tool_call>`) in a free
    reply is then written to the call grammar. Once the grammar is complete it is inactive again,
    waiting for the next trigger, when ``rearm``; otherwise it stays active, and only a stop token
    may follow. Without a trigger it is active from the first token on.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, trigger: int | None = None, prefix: str = "",
                 rearm: bool = True):
        """``prefix``: text of the reply that the prompt already holds (the grammar starts before it)."""
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._trigger = trigger
        self._rearm = rearm
        self.active = trigger is None
        if prefix and not self._matcher.accept_string(prefix):
            raise ValueError(f"the reply's opening {prefix!r} does not follow the grammar")

    def fill(self, bitmasks: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmasks[row]`` (int32 words, bit j of word i for
        token 32 i + j)."""
        self._matcher.fill_next_token_bitmask(bitmasks, row)

    def accept(self, token: int) -> None:
        """Advance past a token the sequence took."""
        if not self.active:
            self.active = token == self._trigger
            return
        if not self._matcher.accept_token(token):
            raise Qat4Error(f"token {token} does not follow the grammar; it was picked without its mask")
        if self._trigger is not None and self._rearm and self._matcher.is_completed():
            self._matcher.reset()
            self.active = False


class Grammars:
    """Grammar compilation over one tokenizer's vocabulary for generations that end on ``stop_ids``,
    cached (:func:`grammars_for`)."""

    def __init__(self, tokenizer, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.call_open = tokenizer.token_to_id(CALL_OPEN)
        stops = list(dict.fromkeys(stop_ids))
        self._compilers = {
            view: xgrammar.GrammarCompiler(
                xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.RAW, vocab_size=self.vocab_size,
                                       stop_token_ids=stops), max_threads=2)
            for view, vocab in _vocabularies(tokenizer).items()
        }
        self._lock = threading.Lock()
        self.compiled = functools.lru_cache(maxsize=COMPILED_CACHE)(self._compile)

    def json(self, schema: Mapping[str, Any] | None, thinking: bool = False, prefix: str = "") -> GrammarConstraint:
        """A reply that is one JSON value matching ``schema`` (None: any JSON object), without
        line breaks or indents (xgrammar's separators `, ` and `: `); with ``thinking`` a thought
        block may come first; ``prefix``: its opening the prompt holds. Raises ValueError for a
        schema xgrammar cannot compile."""
        text = json.dumps({"type": "object"} if schema is None else schema)  # property order is the order written
        if thinking:
            for marker, spelled in _SPELLED.items():
                prefix = prefix.replace(marker, spelled)
        return GrammarConstraint(self.compiled("json_thinking" if thinking else "json", text), prefix=prefix)

    def gbnf(self, grammar: str) -> GrammarConstraint:
        """A reply in a GBNF grammar (llama.cpp's notation, which xgrammar reads; start rule
        `root`) over plain text. Raises ValueError for a grammar it cannot compile."""
        return GrammarConstraint(self.compiled("gbnf", grammar))

    def tool_calls(self, tools: Sequence[Mapping[str, Any]], start: str, names: Sequence[str] | None = None,
                   parallel: bool = True) -> GrammarConstraint:
        """Tool calls of ``tools`` from ``start`` on (:meth:`qat4.chat.call_grammar.CallGrammar.text`);
        ``start`` "open" gives a constraint that activates at the `<|tool_call>` the model writes,
        and without ``parallel`` ends the reply after that one call."""
        text = CallGrammar(tools).text(start, names, parallel)
        trigger = self.call_open if start == "open" else None
        return GrammarConstraint(self.compiled("ebnf", text), trigger, rearm=parallel)

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``kind`` ("json", "json_thinking", "ebnf", "gbnf") and its text; raises
        ValueError for a schema or grammar xgrammar cannot compile."""
        try:
            with self._lock:
                if kind == "json":
                    return self._compilers["text"].compile_grammar(json_grammar(text))
                if kind == "gbnf":
                    return self._compilers["text"].compile_grammar(text)
                grammar = xgrammar.Grammar.from_ebnf(text) if kind == "ebnf" else xgrammar.Grammar.concat(
                    xgrammar.Grammar.from_ebnf(f"root ::= ({_THOUGHT})?"), json_grammar(text))
                return self._compilers["markup" if kind == "ebnf" else "thought"].compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None


def json_grammar(schema: str) -> xgrammar.Grammar:
    """xgrammar's grammar of JSON matching ``schema`` (JSON Schema text), without whitespace, its
    strings free of raw control characters (see the module docstring)."""
    text = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return xgrammar.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_tokenizer_lock = threading.Lock()


def grammars_for(tokenizer, stop_ids: Sequence[int]) -> Grammars:
    """The (cached) grammar compiler of a tokenizer whose generations end on ``stop_ids`` (the
    engine's ``stop_token_ids``); building one takes about a second."""
    stops = tuple(stop_ids)
    with _by_tokenizer_lock:
        by_stops = _by_tokenizer.setdefault(tokenizer, {})
        grammars = by_stops.get(stops)
        if grammars is None:
            grammars = by_stops[stops] = Grammars(tokenizer, stops)
        return grammars


def _vocabularies(tokenizer) -> dict[str, list[bytes]]:
    """Each token's bytes, special tokens empty, in the three views of the module docstring."""
    added = tokenizer.added_tokens()
    views: dict[str, list[bytes]] = {"text": [], "markup": [], "thought": []}
    for i, piece in enumerate(tokenizer.pieces()):
        if i in added or _UNUSED_TOKEN.fullmatch(piece):
            text = b""
            markup = piece.encode() if piece in _CALL_MARKERS else b""
            thought = _SPELLED[piece].encode() if piece in _SPELLED else b""
        else:
            text = markup = thought = piece_bytes(piece)
        views["text"].append(text)
        views["markup"].append(markup)
        views["thought"].append(thought)
    return views
