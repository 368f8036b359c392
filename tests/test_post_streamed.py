"""qat4.api_client.post_streamed, the lean streamed POST of `qat4 bench serve`, against raw replies."""

from __future__ import annotations

import asyncio
import json

import pytest

from qat4.api_client import WireError, post_streamed


async def _serve_once(reply: bytes, seen: list[bytes]):
    """A server that reads one request, answers ``reply`` byte for byte in small pieces, and closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        seen.append(head + await reader.readexactly(length))
        for i in range(0, len(reply), 7):  # pieces that cut lines, chunk sizes and line ends
            writer.write(reply[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _roundtrip(reply: bytes, read: str = "lines", api_key: str | None = None):
    async def go():
        seen: list[bytes] = []
        server = await _serve_once(reply, seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            async with post_streamed(f"http://127.0.0.1:{port}/base", "/v1/completions", {"prompt": [1, 2]},
                                     api_key) as answer:
                body = [line async for line in answer.lines()] if read == "lines" else await answer.body()
                return answer.status, answer.headers, body, seen[0]
    return asyncio.run(go())


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def test_chunked_events_come_back_as_lines_whatever_the_chunks_cut():
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "\xc3\xa9"}]}\r\n\r\n',
              b"data: [DONE]\n\n"]
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, headers, lines, request = _roundtrip(reply + _chunked(events[0][:9], events[0][9:] + events[1][:5],
                                                                  events[1][5:], events[2]), api_key="k")
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert lines == ['data: {"choices": [{"text": "a"}]}', "", 'data: {"choices": [{"text": "é"}]}', "",
                     "data: [DONE]", ""]
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k" in head and json.loads(body) == {"prompt": [1, 2]}


def test_interim_replies_are_skipped():
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    status, headers, lines, _ = _roundtrip(reply + b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\ndata: 1")
    assert (status, headers, lines) == (200, {"content-length": "7"}, ["data: 1"])


def test_a_sized_error_body_and_a_body_up_to_the_close_are_read_whole():
    body = json.dumps({"error": {"message": "no"}}).encode()
    status, _, read, _ = _roundtrip(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), "body")
    assert (status, read) == (400, body)
    status, _, lines, _ = _roundtrip(b"HTTP/1.0 200 OK\r\n\r\ndata: 1\n\ndata: 2")
    assert (status, lines) == (200, ["data: 1", "", "data: 2"])


def test_what_is_not_http_or_stops_mid_chunk_raises():
    with pytest.raises(WireError, match="not an HTTP reply"):
        _roundtrip(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(WireError, match="bad chunk size"):
        _roundtrip(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    with pytest.raises(WireError, match="bad Content-Length"):
        _roundtrip(b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\nabc")
    with pytest.raises(WireError, match="closed the connection before the reply's end"):
        _roundtrip(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
    with pytest.raises(asyncio.IncompleteReadError):
        _roundtrip(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\ndata: cut")


def test_bytes_that_are_not_utf8_do_not_stop_the_lines():
    status, _, lines, _ = _roundtrip(b"HTTP/1.1 200 OK\r\n\r\ndata: \xff\n\ndata: 2\n")
    assert lines == ["data: \ufffd", "", "data: 2"]


def test_nothing_listening_is_an_os_error():
    from qat4.serve_process import free_port

    async def go():
        async with post_streamed(f"http://127.0.0.1:{free_port()}", "/v1/completions", {}, None):
            pass
    with pytest.raises(OSError):
        asyncio.run(go())
