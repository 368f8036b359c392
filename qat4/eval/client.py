"""One chat completion at a time over HTTP: the request body every task sends and the parts of the
reply they score (text, tool calls), with failures as one sentence rather than an exception."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from qat4.api_client import async_client, error_message


@dataclass(frozen=True)
class Server:
    """Where the questions go: an OpenAI-compatible server's base URL (no /v1), the model name sent
    (None leaves it out) and the API key (None sends none)."""

    url: str
    model: str | None = None
    api_key: str | None = None

    def client(self, connections: int) -> httpx.AsyncClient:
        """An HTTP client for `connections` requests at once; replies have no time limit, since they
        may wait in the server's queue."""
        return async_client(self.url, self.api_key, connections)


@dataclass
class Reply:
    """The first choice of a chat completion, or the error that stood in its way."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # each {"name", "arguments" (JSON text)}
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def request_body(server: Server, messages: list[dict[str, Any]], max_tokens: int, *,
                 tools: list[dict[str, Any]] | None = None, thinking: bool | None = None) -> dict[str, Any]:
    """A greedy, unstreamed /v1/chat/completions body; `thinking` set sends
    chat_template_kwargs.enable_thinking (qat4, llama-server and vLLM read it)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": False}
    if server.model is not None:
        body["model"] = server.model
    if tools:
        body["tools"] = tools
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    return body


async def chat(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    """POST `body` to /v1/chat/completions; HTTP errors, broken connections and replies that are
    not a chat completion come back as a Reply with `error`."""
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return Reply(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if response.status_code != 200:
        return Reply(error=f"HTTP {response.status_code}: {error_message(response.content)}")
    try:
        message = response.json()["choices"][0]["message"]
        calls = [{"name": call["function"]["name"], "arguments": call["function"].get("arguments") or "{}"}
                 for call in message.get("tool_calls") or []]
        return Reply(content=message.get("content") or "", tool_calls=calls)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return Reply(error=f"the server's answer is not a chat completion: {response.text[:200]!r}")
