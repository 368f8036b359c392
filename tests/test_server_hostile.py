"""Hostile input against qat4's server on the tiny model (CPU): every malformed value is a 400 naming
the field, a flood of messages is refused before any rendering, web pages on other origins and
rebound DNS names reach nothing, and a seeded fuzz of over a thousand requests over every POST
route gets no 5xx and no hang.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest
from server_harness import LiveServer, tiny_engine, wait_until

from qat4.server import app as server_app
from qat4.server.app import create_app

JSON = {"Content-Type": "application/json"}
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(tiny_engine(), model_name="tiny", loopback_only=True,
                               allowed_origins=["http://localhost:3000"])) as live:
        yield live


def post(server, path: str, body, *, headers=None, timeout=15.0) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=raw, headers={**JSON, **(headers or {})}, timeout=timeout)


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/apply-template", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    ("/tokenize", b'{"content": "\\ud83d"}', "content"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": '
                             b'{"type": "function", "function": {"name": "\\ud800"}}}', "tool_choice.function.name"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', "body"),
])
def test_strings_that_are_not_unicode_are_400_naming_the_field(server, path, raw, param):
    resp = post(server, path, raw)
    assert resp.status_code == 400 and error_of(resp)["param"] == param


def test_numbers_out_of_range_are_400(server):
    huge = b"1" * 5000
    for raw in (b'{"prompt": "x", "max_tokens": 2, "unused": ' + huge + b"}",
                b'{"prompt": "x", "max_tokens": ' + huge + b"}"):
        resp = post(server, "/v1/completions", raw)
        assert resp.status_code == 400 and "digits" in error_of(resp)["message"]
    for stream in (False, True):
        for seed in (2**64, -2):
            resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed, "stream": stream})
            assert resp.status_code == 400 and error_of(resp)["param"] == "seed"
    for seed in (2**64 - 1, -1):  # -1: llama.cpp's "random"
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed}).status_code == 200
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": 10**30})
    assert resp.status_code == 400 and error_of(resp)["param"] == "top_k"


@pytest.mark.parametrize("levels, as_text", [(1500, True), (100, True), (500, False)])
def test_deeply_nested_tool_arguments_are_400(server, levels, as_text):
    """As text past json.loads's recursion limit or within it (the template recurses per level),
    or as an object (the body's own depth limit); within the tiny server's 4,096 characters."""
    deep = "[" * levels + "]" * levels
    arguments = '{"a": ' + deep + "}" if as_text else {"a": json.loads(deep)}
    body = {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400 and "deeper than 64 levels" in error_of(resp)["message"]


@pytest.mark.parametrize("parameters, what", [
    ({"type": "object", "properties": "city"}, "properties"),
    ({"type": "object", "properties": {"city": "string"}}, "properties"),
    ({"type": "object", "properties": {}, "required": "city"}, "required"),
    ({"type": "string"}, "type"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": 5}}}}, "tools"),
    ({"type": "object", "properties": {"a": {"type": "object", "required": 5}}}, "tools"),
])
def test_tool_parameters_that_are_not_a_json_schema_object_are_400(server, parameters, what):
    body = {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
    resp = post(server, "/v1/chat/completions", body)
    err = error_of(resp)
    assert resp.status_code == 400 and what in err["message"]
    assert err["param"] == ("messages" if what == "tools" else "tools[0].function.parameters")


def test_a_flood_of_messages_is_refused_at_once_and_others_are_served(server):
    flood = {"messages": [{"role": "user", "content": "a"} for _ in range(10_000)], "max_tokens": 1}
    start = time.perf_counter()
    resp = post(server, "/v1/chat/completions", flood)
    assert resp.status_code == 400 and "--max-messages" in error_of(resp)["message"]
    assert time.perf_counter() - start < 3
    resp = post(server, "/apply-template", flood)
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"
    long_text = {"prompt": "x" * (8 * 512 + 1), "max_tokens": 1}  # the tiny server's context: 512 tokens
    resp = post(server, "/v1/completions", long_text)
    assert resp.status_code == 400 and "--max-prompt-chars" in error_of(resp)["message"]
    calls = [{"id": str(i), "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2000)]
    resp = post(server, "/v1/chat/completions", {"messages": [*HELLO, {"role": "assistant", "tool_calls": calls}]})
    assert resp.status_code == 400 and "--max-prompt-chars" in error_of(resp)["message"]
    resp = post(server, "/tokenize", {"content": "x" * 5000})
    assert resp.status_code == 400 and error_of(resp)["param"] == "content"
    resp = post(server, "/v1/completions", {"prompt": "x", "stop": "y" * 600})
    assert resp.status_code == 400 and error_of(resp)["param"] == "stop"
    assert post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_browsers_on_other_sites_and_rebound_names_reach_nothing(server):
    body = {"messages": HELLO, "max_tokens": 1}
    # a cross-origin form or fetch without a preflight can only send text/plain
    resp = post(server, "/v1/chat/completions", json.dumps(body).encode(), headers={"Content-Type": "text/plain"})
    assert resp.status_code == 415 and "application/json" in error_of(resp)["message"]
    resp = post(server, "/v1/chat/completions", body, headers={"Origin": "https://evil.example"})
    assert resp.status_code == 403 and "--allowed-origins" in error_of(resp)["message"]
    resp = post(server, "/v1/chat/completions", body, headers={"Origin": "null"})
    assert resp.status_code == 403
    # the chat page's own origin, and an origin given with --allowed-origins
    assert post(server, "/v1/chat/completions", body, headers={"Origin": server.url}).status_code == 200
    assert post(server, "/v1/chat/completions", body, headers={"Origin": "http://localhost:3000"}).status_code == 200
    # a DNS name rebound to 127.0.0.1 still sends its own Host
    for host in (f"evil.example:{server.port}", f"127.evil.example:{server.port}", f"127.0.0.1.nip.io:{server.port}"):
        assert httpx.get(server.url + "/", headers={"Host": host}).status_code == 403
        assert post(server, "/v1/chat/completions", body, headers={"Host": host, "Origin": f"http://{host}"}).status_code == 403
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "localhost", f"127.0.0.2:{server.port}",
                 f"[::1]:{server.port}", "LOCALHOST."):
        assert httpx.get(server.url + "/", headers={"Host": host}).status_code == 200


def test_two_authorization_headers_and_head_health(server):
    resp = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
                      headers=[("Content-Type", "application/json"), ("Authorization", "Bearer a"),
                               ("Authorization", "Bearer b")])
    assert resp.status_code == 400 and "Authorization" in error_of(resp)["message"]
    assert httpx.head(server.url + "/health").status_code == 200


def test_a_body_that_trickles_in_is_cut_off(server, monkeypatch):
    monkeypatch.setattr(server_app, "BODY_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        start = time.perf_counter()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.perf_counter() - start < 5


# ---- the fuzz ---------------------------------------------------------------------------------------

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/tokenize": {"content": "hello"},
    "/detokenize": {"tokens": [2, 100]},
    "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
}
ODD_VALUES = [None, True, -1, 0, 2**64, -(2**63) - 1, 1e308, float("nan"), "", "\ud800", "x" * 5000, [], {}, [[[]]],
              {"a": {"b": {"c": None}}}, [1, "a", None], "<|turn>", "\u0000", 3.5, "1", {"type": "function"},
              {"type": 5}, {"properties": {"a": {"required": 5}}}, {"items": {"type": [1]}}, "y" * 600]


def _mutate(body, rng: random.Random):
    """A copy of a JSON value with one leaf or key changed, added or removed."""
    if isinstance(body, dict) and body and rng.random() < 0.8:
        key = rng.choice(list(body))
        out = dict(body)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.3:
            out[rng.choice(["stream", "seed", "tools", "tool_choice", "stop", "top_k", "n", "response_format",
                            "chat_template_kwargs", "stream_options", "logprobs", "top_logprobs", "echo",
                            "\ud800"])] = rng.choice(ODD_VALUES)
        else:
            out[key] = _mutate(out[key], rng)
        return out
    if isinstance(body, list) and body and rng.random() < 0.8:
        out = list(body)
        i = rng.randrange(len(out))
        out[i] = _mutate(out[i], rng) if rng.random() < 0.7 else rng.choice(ODD_VALUES)
        return out
    return rng.choice(ODD_VALUES)


def _encode(body, rng: random.Random) -> bytes:
    """JSON text of a body, now and then cut short, nested deep or sent as non-UTF-8 bytes."""
    text = json.dumps(body, allow_nan=True)
    roll = rng.random()
    if roll < 0.05:
        return text[: rng.randrange(len(text))].encode()
    if roll < 0.08:
        return ("[" * 2000 + "]" * 2000).encode()
    if roll < 0.1:
        return b"\xff\xfe" + text.encode("utf-16-le")
    return text.encode("utf-8", "surrogatepass")


def test_a_seeded_fuzz_of_every_post_route_gets_no_5xx_and_no_hang(server):
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=15.0) as client:
        for i in range(1200):
            path = rng.choice(list(ROUTES))
            body = ROUTES[path]
            for _ in range(rng.randint(1, 3)):
                body = _mutate(body, rng)
            if isinstance(body, dict) and path in ("/v1/chat/completions", "/v1/completions"):
                body.setdefault("max_tokens", 2)  # keep the valid ones short
            headers = dict(JSON)
            if i % 50 == 0:
                headers["Content-Type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
            start = time.perf_counter()
            resp = client.post(path, content=_encode(body, rng), headers=headers)
            slowest = max(slowest, time.perf_counter() - start)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (path, body, resp.text[:300])
            if resp.status_code >= 400:
                error_of(resp)
            elif resp.headers["content-type"].startswith("text/event-stream"):
                assert "data: [DONE]" in resp.text
    assert sum(statuses.values()) == 1200 and statuses.get(400, 0) > 300 and statuses.get(200, 0) > 50
    assert slowest < 15


@pytest.mark.parametrize("name", ["H11HeaderTimeout", "HttpToolsHeaderTimeout"])
def test_a_client_that_trickles_its_headers_is_disconnected(monkeypatch, name):
    """qat4 serve's protocol (httptools' parser, or h11's where httptools is missing) closes a
    connection whose headers have not all arrived in time, and keeps serving whole requests on
    the same server."""
    import threading

    import uvicorn

    from qat4.commands import serve
    from qat4.server import protocol

    assert serve.HeaderTimeoutProtocol is protocol.HttpToolsHeaderTimeout  # httptools is a dependency
    monkeypatch.setattr(protocol, "HEADER_TIMEOUT_S", 0.5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(tiny_engine(), model_name="tiny"), log_level="warning",
                            http=getattr(protocol, name))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=30)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            start = time.perf_counter()
            assert slow.recv(4096) == b""  # closed by the server
            assert time.perf_counter() - start < 5
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
