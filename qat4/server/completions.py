"""Chat and text completions: request -> prompt ids -> queued generation -> OpenAI JSON or SSE.

Chat replies go through the chat module's parser, so thinking comes back as `reasoning_content`
and tool calls as `tool_calls`, in whole responses and in streamed deltas alike. A call the model
left unfinished (cut off by `max_tokens`) or wrote malformed is still listed in `tool_calls`, its
`arguments` the text it wrote (not JSON, so clients such as LangChain file it as invalid), and the
finish reason is then the generation's own (`length`), not `tool_calls`.

Logprobs (:mod:`qat4.server.logprobs`) cover every token of a reply up to a stop token: in a chat
reply its thinking and tool-call markup too. A text completion's `echo` puts the prompt before its
text, and with `logprobs` the prompt tokens' logprobs before the text's, scored on the engine
thread between steps (:meth:`qat4.engine.Engine.prompt_logprobs`); `max_tokens` 0 asks for those
alone.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from qat4.chat import Reply, ReplyEvent, ReplyStream
from qat4.engine.engine import CheckedIds
from qat4.engine.logprobs import TokenLogprobs
from qat4.errors import Qat4Error
from qat4.server.chat_prompt import ChatPrompt, build_chat_prompt
from qat4.server.errors import APIError, bad_request
from qat4.server.generation import (
    Detokenizer, EngineLoop, Finished, Generation, GenerationParams, QueueFull, ShuttingDown,
)
from qat4.server.limits import RequestLimits
from qat4.server.logprobs import CompletionLogprobs, TokenTexts
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
    echo: str | None = None  # the prompt text a text completion puts before its own
    unseen: int = 0  # prompt tokens not in the echoed text (the <bos> put before a text prompt)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


TEXT_SLOT = "\ufdd0"  # a noncharacter: where sse_of_text puts each string


def sse_of_text(event_of: Callable[[str], str]) -> Callable[[str], str]:
    """``event_of`` (a string to its event) made fast: the event is rendered once around
    TEXT_SLOT and each string spliced in. A streamed reply's chunks differ only in their text, and
    rendering the rest again for every token cost a tenth of the server's CPU per token."""
    rendered = event_of(TEXT_SLOT)
    slot = json.dumps(TEXT_SLOT, ensure_ascii=False)
    if rendered.count(slot) != 1:  # another string of the event is the slot itself (a model so named)
        return event_of
    before, _, after = rendered.partition(slot)
    return lambda text: before + json.dumps(text, ensure_ascii=False) + after


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


async def _collect(gen: Generation) -> tuple[str, Finished, list[TokenLogprobs]]:
    """All the text of a generation, how it finished, and its tokens' logprobs (when asked for)."""
    parts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    async with aclosing(gen.events()) as events:
        async for item in events:
            if isinstance(item, Finished):
                return "".join(parts), item, logprobs
            parts.append(item.text)
            logprobs += item.logprobs
    raise RuntimeError("the generation ended without finishing")


def _unavailable(exc: ShuttingDown) -> APIError:
    return APIError(503, str(exc), type="server_error", code="shutting_down")


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
        self.texts = TokenTexts(engine.tokenizer)
        self.detokenizer = Detokenizer(self.decode)

    # ---- requests -> prompt ids ----------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        """Token ids to text with special tokens kept (the reply parser needs them)."""
        return self.tokenizer.decode(ids, skip_special=False)

    def _params(self, req: SamplingRequest, prompt_n: int, max_tokens: int | None, param: str,
                prompt_param: str, logprobs: int | None) -> GenerationParams:
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
            self.engine.check_request(prompt_n, max(max_tokens, 1))  # 0 (echo alone) still reads the prompt
        except Qat4Error as exc:
            raise bad_request(f"{str(exc)[0].upper()}{str(exc)[1:]}.", param=param, code="context_length_exceeded") from None
        return GenerationParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                seed=req.seed, stop=tuple(req.stop_strings()), ignore_eos=req.ignore_eos,
                                logprobs=logprobs)

    def _encode(self, prompt: str | list[int], param: str) -> CheckedIds:
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
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
        prompt = self.render(req)
        ids = self._encode(prompt.text, "messages")
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(req, len(ids), req.token_limit(), param, "messages",
                              (req.top_logprobs or 0) if req.logprobs else None)
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
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens is 0, which only echo allows (the prompt alone); ask for at least 1 token.",
                              param="max_tokens")
        ids = self._encode(req.prompt, "prompt")
        params = self._params(req, len(ids), req.max_tokens, "max_tokens", "prompt", req.logprobs)
        constraint = completion_constraint(self.tokenizer, self.engine.stop_token_ids, req)
        echo, unseen = None, 0
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else self.decode(ids)
            unseen = int(isinstance(req.prompt, str) and not req.prompt.startswith(self.decode(ids[:1])))
        return Prepared(ids, dataclasses.replace(params, constraint=constraint), req.include_usage, echo=echo,
                        unseen=unseen)

    def start(self, prepared: Prepared) -> Generation:
        """Queue the generation; 429 with Retry-After when the queue is full, 503 when shutting down."""
        try:
            return self.loop.submit(prepared.prompt_ids, prepared.params, self.detokenizer)
        except QueueFull as exc:
            raise APIError(429, f"{exc} {self.loop.max_waiting} requests are already waiting.",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except ShuttingDown as exc:
            raise _unavailable(exc) from None

    # ---- chat ------------------------------------------------------------------------------------

    def _envelope(self, kind: str, rid: str, created: int) -> dict[str, Any]:
        return {"id": rid, "object": kind, "created": created, "model": self.model_name}

    async def chat(self, prepared: Prepared, gen: Generation) -> dict[str, Any]:
        """The whole chat.completion object."""
        text, done, logprobs = await _collect(gen)
        reply, call_events = _parse_whole(prepared.reply_prefix + text, prepared.thinking, prepared.tools)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content,
                                   "reasoning_content": reply.reasoning}
        if call_events:
            message["tool_calls"] = [_tool_call(event) for event in call_events]
        reason = _finish_reason(done, len(reply.tool_calls), len(reply.invalid_tool_calls))
        return {**self._envelope("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", int(time.time())),
                "choices": [{"index": 0, "message": message, "logprobs": self._chat_logprobs(prepared, logprobs),
                             "finish_reason": reason}],
                "usage": _usage(done), "timings": done.timings.as_dict()}

    async def chat_stream(self, prepared: Prepared, gen: Generation) -> AsyncIterator[str]:
        """chat.completion.chunk events: the role, then reasoning/content/tool-call deltas, the finish
        reason with timings, the usage (when asked) and [DONE]. An error mid-stream is sent as an
        error event before [DONE]."""
        head = self._envelope("chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))

        scored: list[TokenLogprobs] = []  # the logprobs of tokens read and not yet sent

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            logprobs = self._chat_logprobs(prepared, scored) if scored else None
            scored.clear()
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        content_chunk = sse_of_text(lambda text: chunk({"content": text}))  # for chunks without logprobs

        parser, calls, invalid_calls, done = ReplyStream(prepared.thinking, prepared.tools), 0, 0, None
        try:
            yield chunk({"role": "assistant", "content": ""})
            async with aclosing(gen.events()) as events:
                parsed = parser.feed(prepared.reply_prefix)
                async for item in events:
                    if isinstance(item, Finished):
                        done, parsed = item, parsed + parser.flush()
                    else:
                        parsed += parser.feed(item.text)
                        scored += item.logprobs
                    for event in parsed:
                        if event.kind in _CALL_EVENTS:
                            yield chunk({"tool_calls": [_tool_call(event, calls + invalid_calls)]})
                            calls += event.kind == "tool_call"
                            invalid_calls += event.kind == "invalid_tool_call"
                        elif event.kind == "content" and not scored:
                            yield content_chunk(event.text)
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

    def _chat_logprobs(self, prepared: Prepared, scored: list[TokenLogprobs]) -> dict[str, Any] | None:
        """A chat choice's or chunk's `logprobs`: of these tokens when the request asks for them."""
        return None if prepared.params.logprobs is None else self.texts.chat(scored)

    # ---- text ------------------------------------------------------------------------------------

    async def _echoed(self, prepared: Prepared, logprobs: CompletionLogprobs | None) -> tuple[str, dict | None]:
        """The text a completion starts with (the prompt, with echo) and its tokens' logprobs
        (with echo and logprobs; else None)."""
        if prepared.echo is None:
            return "", None
        if logprobs is None:
            return prepared.echo, None
        ids, k = prepared.prompt_ids, prepared.params.logprobs
        try:
            scored = await self.loop.call(lambda engine: engine.prompt_logprobs(ids, k))
        except ShuttingDown as exc:
            raise _unavailable(exc) from None
        return prepared.echo, logprobs.of(ids, scored)

    def _text_logprobs(self, prepared: Prepared) -> CompletionLogprobs | None:
        """The builder of a completion's `logprobs` objects, when the request asks for them."""
        return None if prepared.params.logprobs is None else CompletionLogprobs(self.texts, prepared.unseen)

    async def text(self, prepared: Prepared, gen: Generation) -> dict[str, Any]:
        """The whole text_completion object."""
        builder = self._text_logprobs(prepared)
        echoed, prompt_logprobs = await self._echoed(prepared, builder)
        text, done, scored = await _collect(gen)
        logprobs = None
        if builder is not None:
            logprobs = builder.of([e.token for e in scored], scored)
            if prompt_logprobs is not None:
                logprobs = {key: prompt_logprobs[key] + logprobs[key] for key in logprobs}
        return {**self._envelope("text_completion", f"cmpl-{uuid.uuid4().hex}", int(time.time())),
                "choices": [{"index": 0, "text": echoed + text, "logprobs": logprobs,
                             "finish_reason": done.finish_reason}],
                "usage": _usage(done), "timings": done.timings.as_dict()}

    async def text_stream(self, prepared: Prepared, gen: Generation) -> AsyncIterator[str]:
        """text_completion chunks (the first the echoed prompt, with echo), the usage (when
        asked) and [DONE]."""
        head = self._envelope("text_completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()))
        builder = self._text_logprobs(prepared)

        def chunk(text: str, finish: str | None = None, logprobs: dict | None = None, **extra: Any) -> str:
            return sse({**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                        **extra})

        text_chunk = sse_of_text(chunk) if builder is None else chunk  # with logprobs each chunk renders whole

        try:
            echoed, prompt_logprobs = await self._echoed(prepared, builder)
            if prepared.echo is not None:
                yield chunk(echoed, logprobs=prompt_logprobs)
            async with aclosing(gen.events()) as events:
                async for item in events:
                    if isinstance(item, Finished):
                        yield chunk("", item.finish_reason, timings=item.timings.as_dict())
                        if prepared.include_usage:
                            yield sse({**head, "choices": [], "usage": _usage(item)})
                    else:
                        if builder is None:
                            yield text_chunk(item.text)
                        else:
                            yield chunk(item.text, logprobs=builder.of([e.token for e in item.logprobs], item.logprobs))
        except Exception as exc:
            yield sse(_error_event(exc))
        yield sse("[DONE]")
