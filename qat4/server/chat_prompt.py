"""A chat request turned into the engine's prompt text.

How request options reach the model:

- `tool_choice: "none"` leaves the tools out of the prompt.
- `tool_choice: "required"` appends `<|tool_call>call:` to the prompt, so the reply must start with a
  call (the model picks the function); a named function appends `<|tool_call>call:NAME{`, so the
  model writes that function's arguments. Both skip thinking, since the reply starts with the call.
- `response_format` `json_object` / `json_schema` adds an instruction to the system turn (with the
  schema, when given) and, when thinking is off and no tools are offered, appends `{` so the reply
  starts as a JSON object. The output is not checked against the schema.
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
class ChatPrompt:
    """The text the engine reads, and the part of it that is already the reply's beginning."""

    text: str
    reply_prefix: str
    thinking: bool


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
    if forced and opened:
        forced = THOUGHT_CLOSE + forced
    return ChatPrompt(text + forced, opened + forced, thinking)
