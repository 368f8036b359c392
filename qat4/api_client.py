"""The client side of the OpenAI-compatible API, as `qat4 ask`, `qat4 bench serve`, `qat4 eval` and
`qat4 mcp` talk to a server (qat4's own, llama.cpp's llama-server or vLLM): the key's header, an
async client whose replies may take as long as they take, the model a server lists, the events of
a streamed reply, and the message of an error body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

from qat4.errors import Qat4Error

CONNECT_TIMEOUT_S = 30.0  # replies themselves have no time limit: at high concurrency they wait in the server's queue
PROBE_TIMEOUT_S = 10.0


class StreamError(Qat4Error):
    """A streamed reply that broke off: an event that is not a JSON object, or an error event."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header of `api_key`; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def async_client(url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    """A client of the server at `url` (no /v1) for `connections` requests at once; connecting is
    bounded by CONNECT_TIMEOUT_S, replies are not, since they may wait in the server's queue."""
    return httpx.AsyncClient(base_url=url, headers=auth_headers(api_key),
                             timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None, write=None, pool=None),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def served_model(url: str, api_key: str | None = None) -> str | None:
    """The first model id `url/v1/models` lists (None when it lists none or does not answer with JSON);
    Qat4Error when nothing answers at `url` at all."""
    try:
        reply = httpx.get(f"{url.rstrip('/')}/v1/models", headers=auth_headers(api_key), timeout=PROBE_TIMEOUT_S)
    except httpx.TransportError as exc:
        raise Qat4Error(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    except httpx.InvalidURL as exc:
        raise Qat4Error(f"cannot reach {url}: {exc}") from None
    try:
        return str(reply.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}} or vLLM's {"message"}), else the text."""
    try:
        data = json.loads(body)
        error = data.get("error", data)
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError, AttributeError):
        return body.decode(errors="replace").strip()[:300] or "no details"


def _event(line: str) -> dict[str, Any] | None:
    """The JSON event of one line of a streamed reply; None for a line that carries none (blank
    lines, comments). StreamError for an event that is not a JSON object and for an error event."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    try:
        event = json.loads(data)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise StreamError(f"the server sent an event that is not a JSON object: {data[:80]!r}")
    if "error" in event:
        raise StreamError(f"error event mid-reply: {error_message(data.encode())}")
    return event


def _done(line: str) -> bool:
    return line.startswith("data:") and line[5:].strip() == "[DONE]"


def stream_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed (server-sent events) reply's lines, up to `data: [DONE]`;
    StreamError for an event that is not a JSON object and for an error event, with the server's message."""
    for line in lines:
        if _done(line):
            return
        if (event := _event(line)) is not None:
            yield event


async def astream_events(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """:func:`stream_events` of an async reply. Leaving at `[DONE]`, before the body's end, makes the
    client close the connection rather than reuse it, so every timed request starts on a fresh one."""
    async for line in lines:
        if _done(line):
            return
        if (event := _event(line)) is not None:
            yield event
