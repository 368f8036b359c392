"""The FastAPI application: OpenAI-compatible routes, llama.cpp-style utility routes, the chat page.

Every error is OpenAI's JSON shape. Unexpected exceptions become a logged 500 and the server
carries on. With an API key every route but `/` and `/health` needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qat4.errors import Qat4Error
from qat4.server.completions import Completions
from qat4.server.errors import APIError, bad_request
from qat4.server.generation import EngineLoop, Generation
from qat4.server.limits import RequestLimits
from qat4.server.metrics import Metrics
from qat4.server.process_info import ProcessInfo
from qat4.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, Model,
                                 TokenizeRequest, parse_body)

log = logging.getLogger("qat4.server")

PUBLIC_PATHS = frozenset({"/", "/health"})
MAX_BODY_BYTES = 64 << 20
# What a request may hold to be parsed and prepared on the event loop (_prepared_inline), each about
# a millisecond's work at most on a slow core:
INLINE_IDS_BYTES = 16 << 10  # a text completion's body whose prompt is token ids (nothing to encode)
INLINE_TEXT_BYTES = 2 << 10  # any other body (text the tokenizer splits a piece a character: 2 µs a byte)
INLINE_MESSAGES = 16  # the messages of a chat (its rendering grows with the square of their count)
BODY_TIMEOUT_S = 60.0  # a body that trickles in slower holds a connection for nothing
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = 499  # status recorded for requests whose client disconnected (nginx's convention)
MODEL_ROUTE = "/v1/models/{id}"  # the endpoint label of every /v1/models/ID request


Result = TypeVar("Result")


def _prepared_inline(req: Model, size: int) -> bool:
    """Whether preparing a request of a ``size``-byte body is a millisecond's work at most, fit for
    the event loop: no grammar to compile, no tool calls to render (their arguments cost the
    template some 3 µs a byte), at most INLINE_MESSAGES messages, and at most INLINE_TEXT_BYTES of
    body, or INLINE_IDS_BYTES for a prompt of token ids that is not echoed."""
    messages = getattr(req, "messages", None) or ()
    if getattr(req, "constrained", False) or len(messages) > INLINE_MESSAGES or any(m.tool_calls for m in messages):
        return False
    ids = isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and not req.echo
    return size <= (INLINE_IDS_BYTES if ids else INLINE_TEXT_BYTES)


def _is_loopback(host: str) -> bool:
    """Whether a Host header names this machine's loopback, any port: localhost (and *.localhost,
    which browsers resolve to loopback themselves), or a loopback address (127.0.0.0/8, [::1]).
    A DNS name that merely starts with 127. is a name like any other."""
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] if host.count(":") == 1 else host
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Gate:
    """ASGI middleware, in order: the Host and Origin rules that keep web pages on other sites
    away from a local server, the API-key check, JSON-only POST bodies; request metrics and a
    JSON 500 for unexpected exceptions.

    - ``loopback_only`` (a server listening on loopback): a Host that does not name loopback is
      refused (403), so a web page whose DNS name is rebound to 127.0.0.1 reaches nothing.
    - A request with an ``Origin`` other than the server's own (a browser sends it from every other
      site's page) is refused (403) unless ``allowed_origins`` lists it, or holds ``*``.
    - A POST whose Content-Type is not ``application/json`` is refused (415): a browser sends
      ``text/plain`` across origins without asking first, JSON only after a preflight.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics: Metrics, endpoints: frozenset[str],
                 allowed_origins: frozenset[str] = frozenset(), loopback_only: bool = False):
        self.app, self.api_key, self.metrics, self.endpoints = app, api_key, metrics, endpoints
        self.allowed_origins, self.loopback_only = allowed_origins, loopback_only

    def _refusal(self, scope: Scope) -> APIError | None:
        headers: dict[bytes, list[str]] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key, []).append(value.decode("latin-1"))
        host = (headers.get(b"host") or [""])[0]
        if self.loopback_only and not _is_loopback(host):
            return APIError(403, f"The Host {host!r} is refused: this server listens on loopback and answers only "
                                 "to localhost, 127.0.0.1 or [::1].", type="permission_error")
        origin = (headers.get(b"origin") or [None])[0]
        if origin is not None and not (origin in self.allowed_origins or "*" in self.allowed_origins
                                       or urlsplit(origin).netloc.lower() == host.lower()):
            return APIError(403, f"Requests from pages at {origin} are refused; start qat4 serve with "
                                 f"--allowed-origins {origin} to allow them.", type="permission_error")
        auth = headers.get(b"authorization", [])
        if len(auth) > 1:
            return bad_request("The request has more than one Authorization header.")
        if self.api_key and scope["path"] not in PUBLIC_PATHS:
            scheme, _, token = (auth or [""])[0].partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())):
                return APIError(401, "Missing or wrong API key; send 'Authorization: Bearer KEY'.",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        media = (headers.get(b"content-type") or [""])[0].partition(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            return APIError(415, f"POST bodies must be JSON, sent with 'Content-Type: application/json' "
                                 f"(this one came as {media or 'no type'!r}).")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, state = time.perf_counter(), {"status": 500, "started": False}

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, tracked_send)
            else:
                await refusal.response()(scope, receive, tracked_send)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            state["status"] = CLIENT_GONE
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope.get("method"), scope["path"])
            if not state["started"]:
                error = APIError(500, f"Internal server error ({type(exc).__name__}); the server logged it.",
                                 type="server_error")
                await error.response()(scope, receive, tracked_send)
        finally:
            path = scope["path"]
            endpoint = path if path in self.endpoints else MODEL_ROUTE if path.startswith("/v1/models/") else "other"
            self.metrics.requests.inc(endpoint, str(state["status"]))
            self.metrics.latency.observe(time.perf_counter() - start)


async def parse(model: type[Model], request: Request, then: Callable[[Model], Result]) -> Result:
    """``then(request body validated as model)``. The body (at most MAX_BODY_BYTES, sent within
    BODY_TIMEOUT_S) is parsed, checked and handed to ``then`` on the event loop when that is a
    millisecond's work at most (:func:`_prepared_inline`), else in one worker thread. Under load a
    hop to a thread and back waits its turn for the interpreter, which delayed every request by
    milliseconds before the engine saw it; a grammar's compilation or a long prompt's encoding
    must not hold the streams of everyone else."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise APIError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB.")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {BODY_TIMEOUT_S:g} s.") from None
    raw = b"".join(chunks)
    if size > max(INLINE_IDS_BYTES, INLINE_TEXT_BYTES):
        return await asyncio.to_thread(lambda: then(parse_body(model, raw)))
    req = parse_body(model, raw)
    return then(req) if _prepared_inline(req, size) else await asyncio.to_thread(then, req)


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (the body must be read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> Response:
    """Run `work` (a whole, non-streamed answer), cancelling it if the client goes away first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_GONE)  # nobody is listening any more
    return JSONResponse(task.result())


async def respond(request: Request, gen: Generation, streamed: bool,
                  stream: Callable[[], AsyncIterator[str]], whole: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
    """Send a queued generation as SSE or as one JSON object; whatever happens to the request
    (finished, failed, client gone before or during the answer), the generation is dropped after."""
    if streamed:
        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(gen.cancel))
    try:
        return await _unless_disconnected(request, whole())
    finally:
        gen.cancel()


def create_app(engine: Any, *, api_key: str | None = None, max_queue: int = 64,
               model_name: str = "gemma-4-e2b-it", limits: RequestLimits | None = None,
               allowed_origins: Sequence[str] = (), loopback_only: bool = False) -> FastAPI:
    """The server app over a loaded engine (anything with the Engine's encode / add_request / step /
    abort / tokenizer / config / max_ctx surface). At most `max_queue` requests wait to join the
    running batch; more get 429. `limits` bound each request (default: RequestLimits for the
    engine's context); `allowed_origins` and `loopback_only` as :class:`Gate` says."""
    if engine.tokenizer is None:
        raise Qat4Error("the model has no tokenizer; the server needs one to render chats and decode replies")
    metrics = Metrics()
    loop = EngineLoop(engine, engine.stop_token_ids, max_queue, metrics)
    completions = Completions(engine, loop, model_name, limits or RequestLimits.for_context(engine.max_ctx))
    # the chat template compiled now, not on the event loop in the first chat (some 90 ms on a slow core);
    # one that cannot render fails each chat request with its own message, as it would without this
    with contextlib.suppress(Exception):
        completions.render(ChatCompletionRequest(messages=[{"role": "user", "content": ""}]))
    tokenizer = engine.tokenizer
    process = ProcessInfo(engine.device)
    page = resources.files("qat4.server").joinpath("static/index.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        loop.close()

    app = FastAPI(title="qat4", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.model_name, app.state.metrics, app.state.engine_loop = model_name, metrics, loop

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Qat4Error)
    async def _qat4_error(request: Request, exc: Qat4Error) -> JSONResponse:
        return bad_request(str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}.", type=kind).response()

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        about = {**process.identity(), "max_ctx": engine.max_ctx, "max_num_seqs": engine.max_num_seqs}
        if loop.failure is not None:
            return JSONResponse({"status": "error", "model": model_name, "error": str(loop.failure), **about},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": model_name, "queue_depth": loop.waiting(),
                             "running": len(engine.scheduler.running), "busy": bool(engine.scheduler.running),
                             "kv_pool_usage": engine.pool.usage(), **about, "memory": process.memory()})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "qat4",
                "max_model_len": engine.max_ctx, "context_length": engine.max_ctx}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server has '{model_name}'.",
                           type="not_found_error", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req, prepared = await parse(ChatCompletionRequest, request, lambda req: (req, completions.prepare_chat(req)))
        gen = completions.start(prepared)
        return await respond(request, gen, req.stream, partial(completions.chat_stream, prepared, gen),
                             partial(completions.chat, prepared, gen))

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        req, prepared = await parse(CompletionRequest, request, lambda req: (req, completions.prepare_text(req)))
        gen = completions.start(prepared)
        return await respond(request, gen, req.stream, partial(completions.text_stream, prepared, gen),
                             partial(completions.text, prepared, gen))

    def encode(req: TokenizeRequest) -> list[int]:
        text, param = req.text()
        completions.limits.check_text(text, param)
        return tokenizer.encode(text, add_bos=req.with_bos())

    def decode(req: DetokenizeRequest) -> str:
        vocab = engine.config.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {req.tokens[bad]} at tokens[{bad}] is outside the vocabulary of {vocab}.",
                              param=f"tokens[{bad}]")
        return tokenizer.decode(req.tokens, skip_special=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        ids = await parse(TokenizeRequest, request, encode)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_ctx}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        text = await parse(DetokenizeRequest, request, decode)
        return {"content": text, "prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's answer: what clients that tokenize through /tokenize need (lm-evaluation-harness)."""
        return {"tokenizer_class": "GemmaTokenizer", "bos_token": tokenizer.decode([tokenizer.bos_id]),
                "eos_token": tokenizer.decode([tokenizer.eos_id]), "pad_token": None,
                "chat_template": tokenizer.chat_template, "model_max_length": engine.max_ctx}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        return {"prompt": (await parse(ChatCompletionRequest, request, completions.render)).text}

    endpoints = frozenset(r.path for r in app.routes if hasattr(r, "path")) - {"/v1/models/{model_id:path}"}
    app.add_middleware(Gate, api_key=api_key, metrics=metrics, endpoints=endpoints,
                       allowed_origins=frozenset(o.rstrip("/") for o in allowed_origins), loopback_only=loopback_only)
    return app
