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
(GBNF grammars); "json", which also leaves out tokens holding a control character (JSON without
whitespace never needs one raw, and xgrammar's rule for a string with `maxLength` lets them
through); and "markup", in which `<|tool_call>`, `<tool_call|>`, `<|"|>`, `<|channel>` and
`<channel|>` are their text, for grammars that need markers (tool calls, thinking before JSON). After a grammar is complete
only the stop tokens (`<eos>`, `<turn|>`, `<|tool_response>`) may follow.

Compiled grammars are cached per tokenizer and grammar (xgrammar's compiled form is shared by every
sequence that uses it); each sequence holds one :class:`GrammarConstraint`, dropped when it ends.
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

MARKERS = (CALL_OPEN, CALL_CLOSE, STRING_DELIM, THOUGHT_OPEN, THOUGHT_CLOSE)
_UNUSED_TOKEN = re.compile(r"<unused\d+>")
COMPILED_CACHE = 64  # compiled grammars kept per tokenizer, least recently used out first
_THOUGHT = f"{literal(THOUGHT_OPEN)} ([^<] | \"<\" [^c])* {literal(THOUGHT_CLOSE)}"


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
    """Grammar compilation over one tokenizer's vocabulary, cached (:func:`grammars_for`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.call_open = tokenizer.token_to_id(CALL_OPEN)
        stops = list(dict.fromkeys(tokenizer.stop_ids))
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
                    return self._compilers["json"].compile_json_schema(text, any_whitespace=False, strict_mode=True)
                if kind == "gbnf":
                    return self._compilers["text"].compile_grammar(text)
                grammar = xgrammar.Grammar.from_ebnf(text) if kind == "ebnf" else xgrammar.Grammar.concat(
                    xgrammar.Grammar.from_ebnf(f"root ::= ({_THOUGHT})?"),
                    xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True))
                return self._compilers["markup"].compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None


_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_tokenizer_lock = threading.Lock()


def grammars_for(tokenizer) -> Grammars:
    """The (cached) grammar compiler of a tokenizer; building one takes about a second."""
    with _by_tokenizer_lock:
        grammars = _by_tokenizer.get(tokenizer)
        if grammars is None:
            grammars = _by_tokenizer[tokenizer] = Grammars(tokenizer)
        return grammars


def _vocabularies(tokenizer) -> dict[str, list[bytes]]:
    """Each token's bytes, special tokens empty, in the three views of the module docstring."""
    added = tokenizer.added_tokens()
    views: dict[str, list[bytes]] = {"text": [], "json": [], "markup": []}
    for i, piece in enumerate(tokenizer.pieces()):
        if i in added or _UNUSED_TOKEN.fullmatch(piece):
            text = b""
            markup = piece.encode() if piece in MARKERS else b""
        else:
            text = markup = piece_bytes(piece)
        views["text"].append(text)
        views["json"].append(b"" if any(b < 0x20 for b in text) else text)
        views["markup"].append(markup)
    return views
