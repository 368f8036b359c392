"""Gemma 4 tool calls, `call:NAME{key:value,...}`, read into a name and JSON arguments.

The syntax (`<|"|>`-delimited strings, bare keys) and the slips the model is known to make in it,
which the parser mends in a call the model closed itself, are described at `_CallParser`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from qat4.chat.markup import CALL_PREFIX, STRING_DELIM


def parse_call(body: str, repair: bool = False, parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The call `call:NAME{...}` in ``body`` as `{"name", "arguments"}`; `repair` mends the slips
    described at `_CallParser`, `parameters` (JSON Schemas by function name) guide it. Raises
    ValueError (or RecursionError, nested too deep) when the text is not a call."""
    return _CallParser(body, repair, parameters).call()


def call_name_and_arguments(body: str) -> dict[str, str]:
    """The name and the raw argument text of a call's body, `call:NAME{...`, however far it got."""
    text = body.strip()
    name, brace, arguments = text[_prefix_length(text):].partition("{")
    return {"name": name.strip(), "arguments": brace + arguments}


def _prefix_length(text: str) -> int:
    """Length of the `call:` that starts a call's body, with the stray `:` the model sometimes writes
    before it (`<|tool_call>:call:NAME{...}`); 0 without one."""
    for prefix in (":" + CALL_PREFIX, CALL_PREFIX):
        if text.startswith(prefix):
            return len(prefix)
    return 0


def failure_reason(exc: Exception) -> str:
    """Why ``parse_call`` refused a text, in words."""
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
    """Recursive-descent parser of one call, `call:NAME{key:value,...}` (a stray `:` before `call:`
    is skipped).

    Values are `<|"|>`-delimited strings (verbatim: `{}`, `,`, `"` and `:` are literal inside),
    JSON strings, numbers, true/false/null/None, `[...]` arrays and `{...}` objects whose keys are
    bare, `<|"|>`-delimited or JSON-quoted. Any other bare word is taken as a string. The model
    sometimes quotes a value Python-style, `'text'`, at times with a stray `<|"|>` after it: that is
    the string `text`, verbatim, its end the quote that a `,`, `}` or `]` follows.

    With `repair`, slips Gemma 4 is known to make are mended: a `<|"|>` string left open runs to the
    call's final `}` (`{a:<|"|>hello}` is `{"a": "hello"}`) or, when that is missing too, to the end
    of the call, where the arguments close (`{a:<|"|>hello` is `{"a": "hello"}`; an object or list
    inside them left open is not closed); and where the function's schema (in
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
        self._ran_to_end = False  # a repaired value ran to the end of the text, its object's `}` missing

    def call(self) -> dict[str, Any]:
        """The whole body: name and argument object, nothing after it but whitespace."""
        self._skip_space()
        self._pos += _prefix_length(self._text[self._pos:])
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
            result[key] = raw if raw is not None else self._value(sub)
            if self._ran_to_end:  # only the arguments' own `}` may be missing
                if not outermost:
                    raise _Malformed("unterminated string")
                return result
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
            self._ran_to_end = end == len(rest)
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
        if not self._repair:
            raise _Malformed("unterminated string")
        end = len(self._text.rstrip())
        if self._text[start:end].endswith("}"):
            end -= 1
        else:
            self._ran_to_end = True
        self._pos = end
        return self._text[start:end]

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
