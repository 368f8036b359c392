"""Request bodies of every endpoint, validated strictly (no silent type coercion).

`parse_body` turns raw bytes into a model or raises an APIError whose one sentence names the
field at fault, e.g. `Invalid value for 'messages[0].role': Input should be 'system', ...`.
Unknown fields are ignored, so clients that send extra OpenAI parameters keep working.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qat4.engine.logprobs import TOP_LOGPROBS
from qat4.server.errors import APIError, bad_request

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One OpenAI chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string, a list of text parts or null")
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError('only text content parts ({"type": "text", "text": "..."}) are supported')
        return value


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A JSON Schema object: properties an object of schemas, required a list of their names."""
        if value is None:
            return value
        if value.get("type", "object") not in ("object", "dict"):
            raise ValueError('must be a JSON Schema of "type": "object"')
        properties = value.get("properties", {})
        if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
            raise ValueError("properties must be an object whose values are JSON Schemas (objects)")
        required = value.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("required must be a list of property names")
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


MAX_STOP_CHARS = 512  # a stop string is matched against the reply's end at every token, in time ~ its length squared


def _check_stop(value: Any) -> Any:
    strings = [value] if isinstance(value, str) else value
    if value is None or (isinstance(strings, list) and len(strings) <= 16
                         and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in strings)):
        return value
    raise ValueError(f"must be a string or a list of at most 16 non-empty strings of at most {MAX_STOP_CHARS} characters")


class SamplingRequest(_Strict):
    """Parameters shared by chat and text completions; unset sampling options come from the
    checkpoint's generation_config (Gemma 4: temperature 1.0, top_k 64, top_p 0.95)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    seed: int | None = Field(default=None, ge=-1, le=2**64 - 1)
    """0 .. 2^64 - 1; -1 (llama.cpp's "random") is the same as none."""
    stop: Any = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    """Generate through end-of-turn tokens until max_tokens (llama.cpp's and vLLM's option; benchmarks use it)."""

    _stop = field_validator("stop")(_check_stop)

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions (and /apply-template, which renders the same prompt)."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    """Each reply token's logprob in the choice's `logprobs.content`."""
    top_logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS)
    """With logprobs: this many most likely tokens at each position beside it."""

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("auto", "none", "required"):
            return value
        if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
                and isinstance(value["function"].get("name"), str)):
            return value
        raise ValueError('must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
            raise ValueError("enable_thinking must be true or false")
        return value

    @property
    def constrained(self) -> bool:
        """Whether the reply may follow a grammar, compiled when the request is prepared: tools or a JSON format."""
        return bool(self.tools) or (self.response_format is not None and self.response_format.type != "text")

    def token_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (the rest of the context)."""
        return self.max_completion_tokens or self.max_tokens

    def thinking(self) -> bool:
        """Thinking is on with chat_template_kwargs.enable_thinking, or any reasoning_effort but "none"."""
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            return kwargs["enable_thinking"]
        return self.reasoning_effort is not None and self.reasoning_effort != "none"


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a raw prompt (text or token ids), no chat template."""

    prompt: Any
    max_tokens: int | None = Field(default=16, ge=0, le=2**31 - 1)
    """0 only with echo: the prompt's logprobs alone."""
    logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS)
    """Each token's logprob and this many most likely tokens beside it (OpenAI's legacy shape)."""
    echo: bool = False
    """The prompt before the text, and with logprobs its tokens' logprobs before the text's."""
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    """llama.cpp's field: the text is JSON matching this JSON Schema."""
    grammar: str | None = Field(default=None, min_length=1)
    """llama.cpp's field: the text follows this GBNF grammar (start rule `root`)."""

    def constraint_fields(self) -> list[str]:
        """The fields given that constrain the text (a grammar, compiled when the request is
        prepared): `response_format` other than text, `json_schema`, `grammar`, in that order."""
        fmt = self.response_format
        return [name for name, given in (("response_format", fmt is not None and fmt.type != "text"),
                                         ("json_schema", self.json_schema is not None),
                                         ("grammar", self.grammar is not None)) if given]

    @property
    def constrained(self) -> bool:
        """Whether the text follows a grammar, compiled when the request is prepared."""
        return bool(self.constraint_fields())

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one prompt (lm-evaluation-harness sends its prompts so)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        raise ValueError("must be one prompt, a string or a non-empty list of token ids, alone or in a list of one "
                         "(batches of prompts are not served)")


class TokenizeRequest(_Strict):
    """llama.cpp's fields (content, add_special) or vLLM's (prompt, add_special_tokens)."""

    content: str | None = None
    prompt: str | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None

    def text(self) -> tuple[str, str]:
        """The text to tokenize and the name of its field; a 400 when neither field is given."""
        if self.content is not None:
            return self.content, "content"
        if self.prompt is not None:
            return self.prompt, "prompt"
        raise bad_request("Missing required parameter 'content' (or vLLM's 'prompt').", param="content")

    def with_bos(self) -> bool:
        """Whether the ids start with <bos>: add_special, else add_special_tokens, else no."""
        return bool(self.add_special if self.add_special is not None else self.add_special_tokens)


class DetokenizeRequest(_Strict):
    tokens: list[int]


Model = TypeVar("Model", bound=BaseModel)
MAX_JSON_DEPTH = 64  # nesting levels a request body may have (tool arguments and schemas included)


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def parse_body(model: type[Model], raw: bytes) -> Model:
    """Decode a JSON body into `model`; any problem becomes a 400 naming the field."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).") from None
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8 JSON.") from None
    except RecursionError:
        raise bad_request(f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise bad_request("The request body holds a number with more digits than any parameter takes.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    check_values(data, raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_values(data: Any, raw: bytes) -> None:
    """Refuse, naming the field, what no parameter can hold and later code should never see:
    nesting deeper than MAX_JSON_DEPTH and strings (keys too) that are not valid Unicode (lone
    surrogates: JSON's \\u escapes are the only way to spell them, so the strings are looked at
    only when ``raw`` holds one). Walks the containers without recursion; the field's path is
    worked out only for the refusal."""
    strings = bool(_SURROGATE_ESCAPE.search(raw))
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH or (strings and not _valid_text(value)):
            raise _refusal(data, strings)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)) or (strings and isinstance(item, str)))


def _valid_text(value: Any) -> bool:
    """Whether a value's own text (a string, or a dict's keys) is valid Unicode."""
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, dict) else []
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refusal(data: Any, strings: bool) -> APIError:
    """The 400 for the first value check_values refuses, with its path (a second, slower walk)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > MAX_JSON_DEPTH:
            param = _field_path(loc[:MAX_JSON_DEPTH])
            return bad_request(f"Invalid value for '{param}': it nests deeper than {MAX_JSON_DEPTH} levels.", param=param)
        if strings and not _valid_text(value):
            param = _field_path(loc) or "body"
            return bad_request(f"Invalid value for '{param}': the string is not valid Unicode (a lone surrogate "
                               "escape such as \\ud800).", param=param)
        if isinstance(value, dict):
            stack.extend((item, (*loc, key)) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))
    return bad_request("The request body holds a value that no parameter takes.")


def validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as one sentence naming the field."""
    err = exc.errors(include_url=False)[0]
    param = _field_path(tuple(err["loc"]))
    if err["type"] == "missing":
        return bad_request(f"Missing required parameter '{param}'.", param=param)
    message = str(err["msg"]).removeprefix("Value error, ").rstrip(".")
    return bad_request(f"Invalid value for '{param}': {message}.", param=param)
