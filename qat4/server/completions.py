"""Chat and text completions: request -> prompt ids -> queued generation -> OpenAI JSON or SSE.

Chat replies go through the chat module's parser, so thinking comes back as `reasoning_content`
and tool calls as `tool_calls`, in whole responses and in streamed deltas alike. A call the model
left unfinished (cut off by `max_tokens`) or wrote malformed is still listed in `tool_calls`, its
`arguments` the text it wrote (not JSON, so clients such as LangChain file it as invalid), and the
finish reason is then the generation's own (`length`), not `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from qat4.chat import Reply, ReplyEvent, ReplyStream
from qat4.errors import Qat4Error
from qat4.server.chat_prompt import ChatPrompt, build_chat_prompt
from qat4.server.errors import APIError, bad_request
from qat4.server.generation import EngineLoop, Finished, Generation, GenerationParams, QueueFull, ShuttingDown
from qat4.server.limits import RequestLimits
from qat4.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from qat4.server.structured import chat_constraint, check_constrainable, completion_constraint


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready to queue."""

    prompt_ids: list[int]
    params: GenerationParams
    include_usage: bool
    reply_prefix: str = ""
    thinking: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # the request's function tools, whose schemas guide the call parser's repairs


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(done: Finished) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.timings.cache_n}}


_CALL_EVENTS = ("tool_call", "invalid_tool_call")


def _tool_call(event: ReplyEvent, index: int | None = None) -> dict[str, Any]:
    """A parsed call as OpenAI's tool call: valid arguments as JSON text, an invalid call's as written."""
    call = event.tool_call
    arguments = call["arguments"] if event.kind == "invalid_tool_call" else json.dumps(call["arguments"], ensure_ascii=False)
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": arguments}}
    return out if index is None else {"index": index, **out}


def _finish_reason(done: Finished, calls: int, invalid_calls: int) -> str:
    """`tool_calls` when the reply holds calls and all of them are whole; otherwise the generation's."""
    return "tool_calls" if calls and not invalid_calls else done.finish_reason


def _parse_whole(text: str, thinking: bool, tools: tuple[dict[str, Any], ...]) -> tuple[Reply, list[ReplyEvent]]:
    """The parsed reply and its calls, valid and invalid, in the order the model wrote them."""
    stream = ReplyStream(thinking, tools)
    events = stream.feed(text) + stream.flush()
    return stream.finish(), [e for e in events if e.kind in _CALL_EVENTS]


async def _collect(gen: Generation) -> tuple[str, Finished]:
    """All the text of a generation, and how it finished."""
    parts: list[str] = []
    async with aclosing(gen.events()) as events:
        async for item in events:
            if isinstance(item, Finished):
                return "".join(parts), item
            parts.append(item)
    raise RuntimeError("the generation ended without finishing")


def _error_event(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return exc.body()
    kind = "invalid_request_error" if isinstance(exc, Qat4Error) else "server_error"
    return {"error": {"message": str(exc), "type": kind, "param": None, "code": None}}


class Completions:
    """The OpenAI completion endpoints over one engine and its step loop."""

    def __init__(self, engine: Any, loop: EngineLoop, model_name: str, limits: RequestLimits = RequestLimits()):
        self.engine, self.loop, self.model_name, self.limits = engine, loop, model_name, limits
        self.tokenizer = engine.tokenizer

    # ---- requests -> prompt ids ----------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        """Token ids to text with special tokens kept (the reply parser needs them)."""
        return self.tokenizer.decode(ids, skip_special=False)

    def _params(self, req: SamplingRequest, prompt_n: int, max_tokens: int | None, param: str,
                prompt_param: str) -> GenerationParams:
        """Sampling for the engine; 400 stating both numbers when the prompt and the reply do not fit."""
        room = self.engine.max_ctx - prompt_n
        if max_tokens is None:
            if room < 1:
                raise bad_request(f"The prompt has {prompt_n} tokens, which leaves no room in the context of "
                                  f"{self.engine.max_ctx} tokens.", param=prompt_param, code="context_length_exceeded")
            max_tokens = room
        elif prompt_n + max_tokens > self.engine.max_ctx:
            raise bad_request(f"The prompt has {prompt_n} tokens and {param} asks for {max_tokens} more, "
                              f"{prompt_n + max_tokens} in all, but the context holds {self.engine.max_ctx} tokens.",
                              param=param, code="context_length_exceeded")
        try:
            self.engine.check_request(prompt_n, max_tokens)
        except Qat4Error as exc:
            raise bad_request(f"{str(exc)[0].upper()}{str(exc)[1:]}.", param=param, code="context_length_exceeded") from None
        return GenerationParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                              seed=req.seed, stop=tuple(req.stop_strings()), ignore_eos=req.ignore_eos)

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            return self.engine.encode(prompt)
        except Qat4Error as exc:
            raise bad_request(str(exc), param=param) from None

    def render(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The prompt a chat request becomes, with the checkpoint's chat template, once the request
        is within the limits (the template's cost grows with the square of the messages)."""
        self.limits.check_chat(req)
        return build_chat_prompt(req, self.tokenizer.chat_template)

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        """Render and encode a chat request and check it fits the context (CPU work: call off the loop)."""
        prompt = self.render(req)
        ids = self._encode(prompt.text, "messages")
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(req, len(ids), req.token_limit(), param, "messages")
        if prompt.grammar is not None:
            if prompt.grammar.kind == "json" or req.tool_choice not in (None, "auto"):
                check_constrainable(req, "response_format" if prompt.grammar.kind == "json" else "tool_choice")
            if not req.ignore_eos:  # a free reply with tools runs past calls under ignore_eos, unconstrained
                constraint = chat_constraint(self.tokenizer, self.engine.stop_token_ids, prompt.grammar)
                params = dataclasses.replace(params, constraint=constraint)
        tools = tuple(t.model_dump(exclude_none=True) for t in req.tools or ())
        return Prepared(ids, params, req.include_usage, prompt.reply_prefix, prompt.thinking, tools)

    def prepare_text(self, req: CompletionRequest) -> Prepared:
        """Encode a raw prompt and check it fits the context (CPU work: call off the loop)."""
        self.limits.check_text(req.prompt)
        ids = self._encode(req.prompt, "prompt")
        params = self._params(req, len(ids), req.max_tokens, "max_tokens", "prompt")
        constraint = completion_constraint(self.tokenizer, self.engine.stop_token_ids, req)
        return Prepared(ids, dataclasses.replace(params, constraint=constraint), req.include_usage)

    def start(self, prepared: Prepared) -> Generation:
        """Queue the generation; 429 with Retry-After when the queue is full, 503 when shutting down."""
        try:
            return self.loop.submit(prepared.prompt_ids, prepared.params, self.decode)
        except QueueFull as exc:
            raise APIError(429, f"{exc} {self.loop.max_waiting} requests are already waiting.",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), type="server_error", code="shutting_down") from None

    # ---- chat ------------------------------------------------------------------------------------

    def _envelope(self, kind: str, rid: str, created: int) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": created, "model": self.model_name}

    async def chat(self, prepared: Prepared, gen: Generation) -> dict[str, Any]:
        """The whole chat.completion object."""
        text, done = await _collect(gen)
        reply, call_events = _parse_whole(prepared.reply_prefix + text, prepared.thinking, prepared.tools)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content,
                                   "reasoning_content": reply.reasoning}
        if call_events:
            message["tool_calls"] = [_tool_call(event) for event in call_events]
        reason = _finish_reason(done, len(reply.tool_calls), len(reply.invalid_tool_calls))
        return {**self._envelope("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", int(time.time())),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                "usage": _usage(done), "timings": done.timings.as_dict()}

    async def chat_stream(self, prepared: Prepared, gen: Generation) -> AsyncIterator[str]:
        """chat.completion.chunk events: the role, then reasoning/content/tool-call deltas, the finish
        reason with timings, the usage (when asked) and [DONE]. An error mid-stream is sent as an
        error event before [DONE]."""
        head = self._envelope("chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

        parser, calls, invalid_calls, done = ReplyStream(prepared.thinking, prepared.tools), 0, 0, None
        try:
            yield chunk({"role": "assistant", "content": ""})
            async with aclosing(gen.events()) as events:
                parsed = parser.feed(prepared.reply_prefix)
                async for item in events:
                    if isinstance(item, Finished):
                        done, parsed = item, parsed + parser.flush()
                    else:
                        parsed += parser.feed(item)
                    for event in parsed:
                        if event.kind in _CALL_EVENTS:
                            yield chunk({"tool_calls": [_tool_call(event, calls + invalid_calls)]})
                            calls += event.kind == "tool_call"
                            invalid_calls += event.kind == "invalid_tool_call"
                        else:
                            yield chunk({"content" if event.kind == "content" else "reasoning_content": event.text})
                    parsed = []
            reason = _finish_reason(done, calls, invalid_calls)
            yield chunk({}, reason, timings=done.timings.as_dict())
            if prepared.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(done), "timings": done.timings.as_dict()})
        except Exception as exc:  # the status line is sent already: report in-band
            yield sse(_error_event(exc))
        yield sse("[DONE]")

    # ---- text ------------------------------------------------------------------------------------

    async def text(self, prepared: Prepared, gen: Generation) -> dict[str, Any]:
        """The whole text_completion object."""
        text, done = await _collect(gen)
        return {**self._envelope("text_completion", f"cmpl-{uuid.uuid4().hex}", int(time.time())),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}],
                "usage": _usage(done), "timings": done.timings.as_dict()}

    async def text_stream(self, prepared: Prepared, gen: Generation) -> AsyncIterator[str]:
        """text_completion chunks, the usage (when asked) and [DONE]."""
        head = self._envelope("text_completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()))

        def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
            return sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra})

        try:
            async with aclosing(gen.events()) as events:
                async for item in events:
                    if isinstance(item, Finished):
                        yield chunk("", item.finish_reason, timings=item.timings.as_dict())
                        if prepared.include_usage:
                            yield sse({**head, "choices": [], "usage": _usage(item)})
                    else:
                        yield chunk(item)
        except Exception as exc:
            yield sse(_error_event(exc))
        yield sse("[DONE]")
