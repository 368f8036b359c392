"""The grammar of Gemma 4 tool calls, `<|tool_call>call:NAME{key:value,...}<tool_call|>`, written
from the tools' JSON Schemas as xgrammar EBNF.

The syntax is the one qat4's call parser reads (:mod:`qat4.chat.tool_calls`): no whitespace; bare keys
(a key that is not a plain word is `<|"|>`-delimited); strings between `<|"|>` delimiters; numbers,
`true`, `false` and `null` as in JSON; `[...]` arrays and `{...}` objects. Per schema:

- `properties`: the declared properties in declared order, `required` ones always, the others
  optional; no other key (additional properties are not generated). An object schema without
  properties takes any object.
- `enum` and `const` (values of any type), `anyOf` / `oneOf` and lists of types as alternatives.
- strings: `minLength` / `maxLength` (then no `<` inside); an unbounded string never holds `<|`,
  `<t` or `<e`, the starts of the markers that would end it or the call (`<|"|>`, `<tool_call|>`,
  `<turn|>`, `<eos>`, ...).
- integers and numbers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, as xgrammar
  writes them for JSON.
- arrays: `items`, `minItems`, `maxItems`.

Anything else (`$ref`, `pattern`, `format`, `not`, ...) is not enforced: such a value may be any value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import xgrammar

from qat4.chat.markup import CALL_CLOSE, CALL_OPEN, CALL_PREFIX, STRING_DELIM

BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_EMBEDDED_RULE = re.compile(r"\b(root(?:_\d+)*|basic_\w+)\b")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# Rules every call grammar shares: strings, numbers and any value.
_COMMON = rf"""
str_char ::= [^<] | "<" [^<|te]
str ::= {json.dumps(STRING_DELIM)} str_char* {json.dumps(STRING_DELIM)}
int ::= "-"? ("0" | [1-9] [0-9]*)
num ::= int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
any_key ::= [A-Za-z_] [A-Za-z0-9_]* | str
any_pair ::= any_key ":" any
any_object ::= "{{" (any_pair ("," any_pair)*)? "}}"
any_array ::= "[" (any ("," any)*)? "]"
any ::= str | num | "true" | "false" | "null" | any_array | any_object
"""


def literal(text: str) -> str:
    """An EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def render_value(value: Any) -> str:
    """A JSON value in call syntax (what an `enum` or `const` value must look like)."""
    if isinstance(value, str):
        return STRING_DELIM + value + STRING_DELIM
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{render_key(k)}:{render_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render_value(v) for v in value) + "]"
    return json.dumps(value)


def render_key(key: str) -> str:
    """An object key in call syntax: bare when it is a plain word, else delimited."""
    return key if BARE_KEY.fullmatch(key) else STRING_DELIM + key + STRING_DELIM


class CallGrammar:
    """EBNF for calls of a list of OpenAI function tools; :meth:`text` gives a whole grammar."""

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        self._rules: list[str] = []
        self._by_schema: dict[str, str] = {}
        self._arguments: dict[str, str] = {}  # function name -> its argument object's rule
        for tool in tools:
            function = tool["function"]
            self._arguments[function["name"]] = self._object(function.get("parameters") or {})

    def text(self, start: str, names: Sequence[str] | None = None, parallel: bool = True) -> str:
        """The grammar of what follows `start`, which is where the reply's text begins:

        - ``"open"``: after `<|tool_call>`: `call:NAME{...}<tool_call|>`, one call (auto mode);
        - ``"name"``: after `<|tool_call>call:`: a call's name and arguments, its close, and with
          ``parallel`` more calls;
        - ``"arguments"``: after `<|tool_call>call:NAME{` (``names`` holds NAME): the rest of its
          arguments, its close, and with ``parallel`` more calls of that function.

        ``names`` limits the functions called (default: every tool's).
        """
        names = list(self._arguments) if names is None else list(names)
        body = " | ".join(f"{literal(name)} {self._arguments[name]}" for name in names)
        rules = [f"call_body ::= {body}"]
        more = f"({literal(CALL_OPEN + CALL_PREFIX)} call_body {literal(CALL_CLOSE)})*" if parallel else '""'
        if start == "open":
            root = f"{literal(CALL_PREFIX)} call_body {literal(CALL_CLOSE)}"
        elif start == "name":
            root = f"call_body {literal(CALL_CLOSE)} {more}"
        elif start == "arguments":
            (name,) = names
            root = f"{self._arguments[name]}_rest {literal(CALL_CLOSE)} {more}"
        else:
            raise ValueError(f"unknown start {start!r}")
        return "\n".join([f"root ::= {root}", *rules, *self._rules, _COMMON])

    # ---- rules per schema --------------------------------------------------------------------

    def _rule(self, schema: Any, build) -> str:
        """The name of the rule for ``schema``, built once by ``build(name) -> rule lines``."""
        key = json.dumps(schema)
        if key not in self._by_schema:
            name = f"v{len(self._by_schema)}"
            self._by_schema[key] = name
            self._rules.extend(build(name))
        return self._by_schema[key]

    def _value(self, schema: Any) -> str:
        """An expression for one value of ``schema``."""
        if not isinstance(schema, Mapping):
            return "any"
        if "const" in schema:
            return literal(render_value(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(literal(render_value(v)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self._value(s) for s in schema[key]) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self._value({**schema, "type": k}) for k in kind) + ")"
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            return self._number(schema, kind)
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema)
        if kind == "object" or "properties" in schema:
            return self._object(schema)
        return "any"

    def _string(self, schema: Mapping[str, Any]) -> str:
        low, high = schema.get("minLength"), schema.get("maxLength")
        if not isinstance(low, int) and not isinstance(high, int):
            return "str"
        low = low if isinstance(low, int) and low > 0 else 0
        count = f"{{{low},{high}}}" if isinstance(high, int) else f"{{{low},}}"
        delim = literal(STRING_DELIM)
        return self._rule(schema, lambda name: [f"{name} ::= {delim} [^<]{count} {delim}"])

    def _number(self, schema: Mapping[str, Any], kind: str) -> str:
        leaf = {"type": kind, **{k: schema[k] for k in _NUMBER_BOUNDS if isinstance(schema.get(k), (int, float))}}
        if len(leaf) == 1:
            return "int" if kind == "integer" else "num"
        return self._rule(leaf, lambda name: _embedded_json_rules(leaf, name))

    def _array(self, schema: Mapping[str, Any]) -> str:
        def build(name: str) -> list[str]:
            item = self._value(schema.get("items"))
            low = max(0, schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0)
            high = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
            if high is not None and high < 1:
                return [f'{name} ::= "[" "]"']
            rest = f"{{{max(0, low - 1)},{high - 1}}}" if high is not None else f"{{{max(0, low - 1)},}}"
            items = f'{item} ("," {item}){rest}'
            return [f'{name} ::= "[" {items if low else f"({items})?"} "]"']

        return self._rule({"array": schema}, build)

    def _object(self, schema: Mapping[str, Any]) -> str:
        """The rule of an object; its `NAME_rest` rule is the object after its `{`."""
        def build(name: str) -> list[str]:
            properties = schema.get("properties")
            if not isinstance(properties, Mapping) or not properties:
                return [f'{name} ::= "{{" {name}_rest', f'{name}_rest ::= (any_pair ("," any_pair)*)? "}}"']
            required = set(schema.get("required") or [])
            items = list(properties.items())
            lines = [f'{name} ::= "{{" {name}_rest', f'{name}_rest ::= {name}_a0 "}}"']
            # a<i>: properties i.. with none written yet; b<i>: the same after one was written (comma first)
            for i, (key, sub) in reversed(list(enumerate(items))):
                pair = f"{literal(render_key(key) + ':')} {self._value(sub)}"
                after = f"{name}_b{i + 1}" if i + 1 < len(items) else '""'
                skip_a = f"{name}_a{i + 1}" if i + 1 < len(items) else '""'
                first, later = f"{pair} {after}", f'"," {pair} {after}'
                if key not in required:
                    first, later = f"{first} | {skip_a}", f"{later} | {after}"
                lines += [f"{name}_a{i} ::= {first}", f"{name}_b{i} ::= {later}"]
            return lines

        return self._rule({"object": schema}, build)


def _embedded_json_rules(schema: Mapping[str, Any], name: str) -> list[str]:
    """xgrammar's own rules for a JSON number or integer schema (its bounds), renamed under
    ``name``: numbers are written in call syntax as in JSON."""
    text = str(xgrammar.Grammar.from_json_schema(json.dumps(schema)))
    renamed = _EMBEDDED_RULE.sub(lambda m: f"{name}_{m.group(1)}", text)
    return [line for line in renamed.splitlines() if line.strip()] + [f"{name} ::= {name}_root"]
