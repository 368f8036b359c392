"""The client side of the OpenAI-compatible API, as `qat4 ask`, `qat4 bench serve`, `qat4 eval` and
`qat4 mcp` talk to a server (qat4's own, llama.cpp's llama-server or vLLM): the key's header, an
async client whose replies may take as long as they take, the model a server lists, the events of
a streamed reply, and the message of an error body.

`post_streamed` is the lean path `qat4 bench serve` times its requests on: one HTTP/1.1 POST on a
connection of its own, its reply read line by line straight from asyncio's stream. httpx's
streamed reply cost the benchmark's client about half as much CPU again per token (150 against
100 µs on a 2-core host), and at thousands of tokens a second it fell behind and read tokens in
late bursts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from qat4.errors import Qat4Error

CONNECT_TIMEOUT_S = 30.0  # replies themselves have no time limit: at high concurrency they wait in the server's queue
PROBE_TIMEOUT_S = 10.0


class StreamError(Qat4Error):
    """A streamed reply that broke off: an event that is not a JSON object, or an error event."""


class WireError(Exception):
    """A reply :func:`post_streamed` could not read as HTTP/1.1."""


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


@dataclass
class StreamedReply:
    """The status and headers of a reply to :func:`post_streamed`, and its body to read once:
    whole (:meth:`body`) or line by line (:meth:`lines`), chunked, sized or up to the close."""

    status: int
    headers: dict[str, str]  # lower-case names
    _reader: asyncio.StreamReader

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                line = await _line(reader)
                size = _number(line.split(b";")[0], 16, "chunk size")
                if size == 0:
                    return
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        elif "content-length" in self.headers:
            yield await reader.readexactly(_number(self.headers["content-length"].encode(), 10, "Content-Length"))
        else:
            while piece := await reader.read(1 << 16):
                yield piece

    async def body(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines, without their line ends; the last one even without a line end."""
        held = b""
        async for piece in self._pieces():
            held += piece
            if b"\n" in held:
                *complete, held = held.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r").decode(errors="replace")
        if held:
            yield held.rstrip(b"\r").decode(errors="replace")


async def _line(reader: asyncio.StreamReader) -> bytes:
    """One line of the reply's head or chunk framing; WireError when the server closed instead or
    the line outgrows the reader's buffer."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError, as readline raises it
        raise WireError("a line of the reply's framing is longer than 1 MiB") from None
    if not line:
        raise WireError("the server closed the connection before the reply's end")
    return line


def _number(text: bytes, base: int, what: str) -> int:
    try:
        value = int(text, base)
    except ValueError:
        value = -1
    if value < 0:
        raise WireError(f"bad {what} {text[:40]!r} in the reply")
    return value


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS context of https requests, made once (reading the CA bundle takes milliseconds):
    certifi's certificates, as httpx trusts, where it is installed."""
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


@asynccontextmanager
async def post_streamed(url: str, path: str, payload: dict[str, Any], api_key: str | None) -> AsyncIterator[StreamedReply]:
    """POST `payload` as JSON to `url` + `path` (`url` as :func:`async_client` takes it: http or
    https, no /v1; proxies are not used) on a connection of its own, closed on the way out;
    connecting is bounded by CONNECT_TIMEOUT_S, the reply is not. Interim (1xx) replies are
    skipped. Raises OSError (connecting, a broken connection), asyncio.IncompleteReadError (a
    reply cut short) and WireError (a reply that is not HTTP/1.1 or ends before its head does)."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if secure else 80)
    connecting = asyncio.open_connection(host, port, ssl=_tls() if secure else None, limit=1 << 20)
    try:
        reader, writer = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise OSError(f"no connection to {host}:{port} within {CONNECT_TIMEOUT_S:g} s") from None
    try:
        body = json.dumps(payload).encode()
        named_host = f"[{host}]" if ":" in host else host
        head = {"Host": named_host if parts.port is None else f"{named_host}:{parts.port}",
                "Content-Type": "application/json", "Accept": "text/event-stream",
                "Content-Length": str(len(body)), "Connection": "close", **auth_headers(api_key)}
        target = parts.path.rstrip("/") + path
        writer.write(f"POST {target} HTTP/1.1\r\n".encode()
                     + "".join(f"{name}: {value}\r\n" for name, value in head.items()).encode() + b"\r\n" + body)
        status = 100
        while 100 <= status < 200:  # interim replies (100 Continue, 103 Early Hints) come before the reply
            status_line = await _line(reader)
            version, _, rest = status_line.decode("latin-1").partition(" ")
            if not version.startswith("HTTP/") or not rest[:3].isdigit():
                raise WireError(f"not an HTTP reply: {status_line[:40]!r}")
            status, headers = int(rest[:3]), {}
            while (line := await _line(reader)) not in (b"\r\n", b"\n"):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        yield StreamedReply(status, headers, reader)
    finally:
        writer.close()
