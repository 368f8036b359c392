"""What one request may ask the server to do, checked before any of it is done.

The chat template's cost grows with the square of the messages (Gemma 4's template scans the
messages after each message), tokenizing with the characters, and both run on the host beside
the engine: a 340 KB body of 10,000 one-letter messages once held a server for minutes. Each limit
is a 400 naming it and the flag that raises it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qat4.server.errors import bad_request

DEFAULT_MAX_MESSAGES = 1024  # 0.5 s of template rendering at most
DEFAULT_MAX_TOOLS = 128
CHARS_PER_CONTEXT_TOKEN = 8  # default prompt characters per token of context: more text than fits
CALL_CHARS = 16  # what a tool call's markup counts for beyond its name and arguments (an empty call is not free)


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on a request's messages, tools and prompt characters (text of every message and tool)."""

    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_prompt_chars: int = CHARS_PER_CONTEXT_TOKEN * 131_072

    @classmethod
    def for_context(cls, max_ctx: int, *, max_messages: int | None = None, max_tools: int | None = None,
                    max_prompt_chars: int | None = None) -> "RequestLimits":
        """The defaults for a context of max_ctx tokens, with any limit given instead."""
        return cls(max_messages or DEFAULT_MAX_MESSAGES, max_tools or DEFAULT_MAX_TOOLS,
                   max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * max_ctx)

    def check_chat(self, req: Any) -> None:
        """400 for a chat request over a limit, before its prompt is rendered: the text of every
        message, tool call, tool and response schema counts."""
        if len(req.messages) > self.max_messages:
            raise bad_request(f"The request has {len(req.messages)} messages; this server takes at most "
                              f"{self.max_messages} (qat4 serve --max-messages).", param="messages")
        tools = req.tools or []
        if len(tools) > self.max_tools:
            raise bad_request(f"The request has {len(tools)} tools; this server takes at most {self.max_tools} "
                              "(qat4 serve --max-tools).", param="tools")
        chars = sum(_chars(m.content) + _chars(m.reasoning_content) + _chars(m.reasoning) + _chars(m.name)
                    + sum(CALL_CHARS + _chars(c.function.name) + _chars(c.function.arguments) for c in m.tool_calls or [])
                    for m in req.messages)
        chars += sum(_chars(t.function.name) + _chars(t.function.description) + _chars(t.function.parameters)
                     for t in tools)
        if req.response_format is not None and req.response_format.json_schema is not None:
            chars += _chars(req.response_format.json_schema.schema_)
        self._check_chars(chars, "messages")

    def check_text(self, prompt: Any, param: str = "prompt") -> None:
        """400 for a text prompt over the character limit, before it is tokenized."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt), param)

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise bad_request(f"The prompt has {chars:,} characters; this server takes at most "
                              f"{self.max_prompt_chars:,} (qat4 serve --max-prompt-chars).", param=param)


def _chars(value: Any) -> int:
    """Characters of the text in a message field: a string, text parts, or JSON-like values."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + _chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return len(str(value))
