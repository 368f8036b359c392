"""A scripted OpenAI-compatible server for the eval tests: each chat completion's message comes
from a function of the request body, so a test decides exactly what every question gets back."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from server_harness import LiveServer

# The data sets beside the project (../shared/data from its root, or $QAT4_SHARED_DATA); qat4 ships
# none, so a clone without them skips the tests that read them.
SHARED_DATA = Path(os.environ.get("QAT4_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"the data sets are not at {SHARED_DATA}")

# A responder returns the reply message ({"content": ..., "tool_calls": [...]}) or a JSONResponse.
Responder = Callable[[dict[str, Any]], Any]


def scripted_app(responder: Responder) -> FastAPI:
    """/v1/models naming one model, and /v1/chat/completions answering with `responder(body)`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        reply = responder(await request.json())
        if isinstance(reply, JSONResponse):
            return reply
        message = {"role": "assistant", "content": reply.get("content"), **({"tool_calls": reply["tool_calls"]}
                                                                          if reply.get("tool_calls") else {})}
        return {"id": "x", "object": "chat.completion", "model": "scripted",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    return app


def scripted_server(responder: Responder) -> LiveServer:
    """A LiveServer (use it in a with block) answering with `responder`."""
    return LiveServer(scripted_app(responder))


def last_user_text(body: dict[str, Any]) -> str:
    return [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
