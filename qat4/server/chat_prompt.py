"""A chat request turned into the engine's prompt text.

How request options reach the model:

- `tool_choice: "none"` leaves the tools out of the prompt.
- `tool_choice: "required"` appends `<|tool_call>call:` to the prompt, so the reply must start with a
  call (the model picks the function); a named function appends `<|tool_call>call:NAME{`, so the
  model writes that function's arguments. Both skip thinking, since the reply starts with the call.
  The calls are then constrained to Gemma 4's call syntax and the functions' parameter schemas
  (:mod:`qat4.chat.call_grammar`), one call or, with `parallel_tool_calls` (the default), several.
- With tools offered and `tool_choice` "auto" (or unset), a call the model opens (`<|tool_call>`) is
  constrained the same way from there on (without `parallel_tool_calls`, the reply ends after it).
- `response_format` `json_object` / `json_schema` adds an instruction to the system turn (with the
  schema, when given) and, when thinking is off and no tools are offered, appends `{` so the reply
  starts as a JSON object. The reply is constrained to JSON matching the schema (any object for
  `json_object`), after a thought block when thinking is on (continuing the one the template opens
  after a tool result); such a reply calls no tool unless
  `tool_choice` forces one, which then takes precedence.
- Thinking is on with `chat_template_kwargs.enable_thinking` or any `reasoning_effort` but "none".

Whatever is appended belongs to the reply: `reply_prefix` (with any thought channel the template
itself opened) is fed to the reply parser before the generated text, so it shows up in the answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qat4.chat import render_prompt
from qat4.errors import Qat4Error
from qat4.server.errors import bad_request
from qat4.server.schemas import ChatCompletionRequest

THOUGHT_OPEN = "<|channel>thought\n"
THOUGHT_CLOSE = "<channel|>"
TOOL_CALL_OPEN = "<|tool_call>call:"
JSON_INSTRUCTION = "Answer with a single valid JSON object and nothing else: no code fences, no text around it."


@dataclass(frozen=True)
class ReplyGrammar:
    """What the reply is constrained to: ``kind`` "json" (``schema``, None for any object, after an
    optional thought block when ``thinking``; its first ``prefix`` characters are in the prompt) or
    "calls" (``tools``' calls from ``start`` on, of ``names`` when given, several when ``parallel``;
    see :meth:`qat4.chat.call_grammar.CallGrammar.text`)."""

    kind: str
    schema: dict[str, Any] | None = None
    thinking: bool = False
    prefix: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    start: str = ""
    names: tuple[str, ...] | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ChatPrompt:
    """The text the engine reads, the part of it that is already the reply's beginning, and what
    the rest of the reply is constrained to (None: nothing)."""

    text: str
    reply_prefix: str
    thinking: bool
    grammar: ReplyGrammar | None = None


def _json_instruction(req: ChatCompletionRequest) -> str | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema else None
    return JSON_INSTRUCTION + (f" It must match this JSON schema: {json.dumps(schema)}" if schema else "")


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Append `text` to the leading system/developer message, or add a system message holding it."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": text}]
        else:
            first["content"] = f"{content}\n\n{text}" if content else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _forced_call(req: ChatCompletionRequest) -> str:
    """The call opening that tool_choice forces ("" when the model is free)."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return ""
    names = [t.function.name for t in req.tools or []]
    if not names:
        raise bad_request("tool_choice requires a non-empty 'tools' list.", param="tool_choice")
    if choice == "required":
        return TOOL_CALL_OPEN
    name = choice["function"]["name"]
    if name not in names:
        raise bad_request(f"tool_choice names function '{name}', which is not in 'tools'.", param="tool_choice")
    return f"{TOOL_CALL_OPEN}{name}{{"


def build_chat_prompt(req: ChatCompletionRequest, template: str | None = None) -> ChatPrompt:
    """Render the request with the chat template and append what tool_choice/response_format force."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    instruction = _json_instruction(req)
    if instruction:
        messages = _with_system_text(messages, instruction)
    offer_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if offer_tools else None
    thinking = req.thinking()
    forced = _forced_call(req)
    try:
        text = render_prompt(messages, tools=tools, enable_thinking=thinking, add_generation_prompt=True, template=template)
    except Qat4Error as exc:
        raise bad_request(str(exc), param="messages") from None
    if not forced and instruction and not thinking and not offer_tools:
        forced = "{"
    opened = THOUGHT_OPEN if text.endswith(THOUGHT_OPEN) else ""
    grammar = _reply_grammar(req, tools, forced, opened, thinking)
    if forced and opened:
        forced = THOUGHT_CLOSE + forced
    return ChatPrompt(text + forced, opened + forced, thinking, grammar)


def _reply_grammar(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, forced: str, opened: str,
                   thinking: bool) -> ReplyGrammar | None:
    """The constraint on the reply after the prompt's ``forced`` opening (module docstring); ``opened``
    is the thought channel the template itself opened, which a JSON reply's thought block continues."""
    if forced.startswith(TOOL_CALL_OPEN):
        named = forced != TOOL_CALL_OPEN
        names = (req.tool_choice["function"]["name"],) if named else None
        return ReplyGrammar("calls", tools=tuple(tools), start="arguments" if named else "name", names=names,
                            parallel=req.parallel_tool_calls)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else None
        return ReplyGrammar("json", schema=schema, thinking=thinking, prefix=opened + forced)
    if tools:
        return ReplyGrammar("calls", tools=tuple(tools), start="open", parallel=req.parallel_tool_calls)
    return None
