"""Structured output: the grammar constraint a request asks for, or a 400 naming the field.

Chat requests get theirs from their prompt (:class:`qat4.server.chat_prompt.ReplyGrammar`: JSON for
`response_format`, Gemma 4 tool calls for `tools`); text completions from `response_format`,
llama.cpp's `json_schema` or its GBNF `grammar` (one of them). The grammars themselves are
:mod:`qat4.chat.grammars`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qat4.server.chat_prompt import ReplyGrammar
from qat4.server.errors import bad_request
from qat4.server.schemas import CompletionRequest, SamplingRequest

if TYPE_CHECKING:
    from qat4.chat.grammars import GrammarConstraint, Grammars


def check_constrainable(req: SamplingRequest, param: str) -> None:
    """A constrained reply ends when its grammar is complete: ignore_eos cannot run past that."""
    if req.ignore_eos:
        raise bad_request(f"ignore_eos cannot be combined with '{param}': a constrained reply ends where its grammar "
                          "ends.", param="ignore_eos")


def _grammars(tokenizer: Any, stop_ids: Sequence[int]) -> Grammars:
    """:func:`qat4.chat.grammars.grammars_for`, imported with the first constrained request: xgrammar
    imports transformers, which would add about 1.5 s to every server start."""
    from qat4.chat.grammars import grammars_for

    return grammars_for(tokenizer, stop_ids)


def chat_constraint(tokenizer: Any, stop_ids: Sequence[int], grammar: ReplyGrammar) -> GrammarConstraint:
    """The constraint of a chat reply that ends on ``stop_ids`` (the engine's)."""
    grammars = _grammars(tokenizer, stop_ids)
    if grammar.kind == "calls":
        try:
            return grammars.tool_calls(grammar.tools, grammar.start, grammar.names, grammar.parallel)
        except ValueError as exc:
            raise bad_request(f"The tools' parameter schemas cannot be enforced: {exc}.", param="tools") from None
    try:
        return grammars.json(grammar.schema, grammar.thinking, grammar.prefix)
    except ValueError as exc:
        raise bad_request(f"response_format.json_schema.schema cannot be enforced: {exc}.",
                          param="response_format.json_schema.schema") from None


def completion_constraint(tokenizer: Any, stop_ids: Sequence[int], req: CompletionRequest) -> GrammarConstraint | None:
    """The constraint of a text completion that ends on ``stop_ids`` (the engine's): `response_format`,
    `json_schema` or `grammar`, at most one."""
    given = req.constraint_fields()
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"Give one of {' and '.join(given)}, not both: each constrains the whole text.", param=given[1])
    check_constrainable(req, given[0])
    grammars = _grammars(tokenizer, stop_ids)
    try:
        if req.grammar is not None:
            return grammars.gbnf(req.grammar)
        if req.json_schema is not None:
            return grammars.json(req.json_schema)
        fmt = req.response_format
        return grammars.json(fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else None)
    except ValueError as exc:
        param = {"response_format": "response_format.json_schema.schema"}.get(given[0], given[0])
        raise bad_request(f"{param} cannot be enforced: {exc}.", param=param) from None
