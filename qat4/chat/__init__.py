"""Gemma 4 chat markup: OpenAI messages rendered into a prompt, the model's reply parsed back, and
the grammars that constrain a reply.

- :mod:`qat4.chat.markup`: the chat format's markers.
- :mod:`qat4.chat.template`: `render_prompt`, the prompt of an OpenAI conversation.
- :mod:`qat4.chat.reply`: `parse_reply` / `ReplyStream`, content, reasoning and tool calls of a reply.
- :mod:`qat4.chat.tool_calls`: one tool call's text read into its name and arguments.
- :mod:`qat4.chat.call_grammar` and :mod:`qat4.chat.grammars`: constrained decoding (JSON Schema,
  tool calls, GBNF) with xgrammar.
"""

from qat4.chat.markup import (BOS, CALL_CLOSE, CALL_OPEN, CALL_PREFIX, EOS_TEXT, RESPONSE_OPEN, STOP_MARKERS,
                              STRING_DELIM, THOUGHT_CLOSE, THOUGHT_LABEL, THOUGHT_OPEN, TURN_CLOSE)
from qat4.chat.reply import Reply, ReplyEvent, ReplyStream, parse_reply
from qat4.chat.template import default_chat_template, render_prompt

__all__ = ["BOS", "CALL_CLOSE", "CALL_OPEN", "CALL_PREFIX", "EOS_TEXT", "RESPONSE_OPEN", "STOP_MARKERS", "STRING_DELIM",
           "THOUGHT_CLOSE", "THOUGHT_LABEL", "THOUGHT_OPEN", "TURN_CLOSE", "Reply", "ReplyEvent", "ReplyStream",
           "default_chat_template", "parse_reply", "render_prompt"]
