"""`qat4 ask`: put a question to a running `qat4 serve` and stream the answer.

Standard input is the material and the words are the instruction (`git log | qat4 ask summarize`).
With no words and a terminal on stdin it is an interactive chat that keeps the conversation.
The answer goes to stdout; thinking (with -T) and the timing line go to stderr, thinking dimmed
when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from qat4.api_client import auth_headers, error_message, stream_events
from qat4.errors import Qat4Error

DEFAULT_URL = "http://127.0.0.1:8100"
DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ask", help="ask a running qat4 server; stdin is the material, the words the instruction",
        description="Stream an answer from a running `qat4 serve`. Standard input is the material and the "
                    "words are the instruction (git log | qat4 ask summarize). With no words and no piped "
                    "input: an interactive chat (`!` clears the conversation, Ctrl-D quits).")
    p.add_argument("words", nargs="*", help="the instruction or question")
    p.add_argument("-T", "--think", action="store_true", help="turn thinking on and show it, dimmed, before the answer")
    p.add_argument("-q", "--quiet", action="store_true", help="no timing line at the end")
    p.add_argument("--url", default=os.environ.get("QAT4_URL", DEFAULT_URL),
                   help=f"server address (default: $QAT4_URL or {DEFAULT_URL})")
    p.add_argument("--api-key", default=os.environ.get("QAT4_API_KEY"),
                   help="bearer key for a server started with --api-key (default: $QAT4_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on generated tokens (default: the rest of the context)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's, 1.0)")
    p.set_defaults(run=run)


@dataclass
class Answer:
    """What one streamed reply produced."""

    content: str
    completion_tokens: int
    tok_per_s: float | None


class Client:
    """A chat session with the server over streamed HTTP (SSE)."""

    def __init__(self, args: argparse.Namespace):
        self.url = args.url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=auth_headers(args.api_key), timeout=httpx.Timeout(10.0, read=None))
        self.think, self.max_tokens, self.temperature = args.think, args.max_tokens, args.temperature
        self.dim = sys.stderr.isatty()

    def _events(self, messages: list[dict]) -> Iterator[dict]:
        body: dict = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                      "chat_template_kwargs": {"enable_thinking": self.think}}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise Qat4Error(f"the server answered {response.status_code}: {error_message(response.read())}")
                yield from stream_events(response.iter_lines())  # a broken-off reply raises StreamError, a Qat4Error
        except httpx.ConnectError:
            raise Qat4Error(f"cannot connect to {self.url}; is `qat4 serve` running there? (--url or QAT4_URL sets the address)") from None
        except httpx.TransportError as exc:
            raise Qat4Error(f"the connection to {self.url} failed: {exc}") from None

    def ask(self, messages: list[dict]) -> Answer:
        """Stream one reply: thinking to stderr (dimmed), the answer to stdout."""
        content, tokens, speed, in_thought = "", 0, None, False
        for event in self._events(messages):
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content") and self.think:
                    if not in_thought and self.dim:
                        sys.stderr.write(DIM)
                    in_thought = True
                    sys.stderr.write(delta["reasoning_content"])
                    sys.stderr.flush()
                if delta.get("content"):
                    if in_thought:
                        sys.stderr.write((RESET if self.dim else "") + "\n")
                        in_thought = False
                    content += delta["content"]
                    sys.stdout.write(delta["content"])
                    sys.stdout.flush()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("timings"):
                speed = event["timings"].get("decode_tok_per_s")
        if in_thought:
            sys.stderr.write((RESET if self.dim else "") + "\n")
        if not content.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        return Answer(content, tokens, speed)


def _timing_line(answer: Answer, seconds: float) -> str:
    speed = f", {answer.tok_per_s:.1f} tok/s" if answer.tok_per_s else ""
    return f"[{answer.completion_tokens} tokens{speed}, {seconds:.2f} s]"


def _ask_once(client: Client, messages: list[dict], quiet: bool) -> Answer:
    start = time.perf_counter()
    answer = client.ask(messages)
    if not quiet:
        print(_timing_line(answer, time.perf_counter() - start), file=sys.stderr)
    return answer


def _chat(client: Client, quiet: bool) -> int:
    """Interactive chat: keeps the conversation; `!` clears it, Ctrl-D quits."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"qat4 chat with {client.url}; `!` clears the conversation, Ctrl-D quits.", file=sys.stderr)
    messages: list[dict] = []
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line == "!":
            messages.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _ask_once(client, messages, quiet)
        except KeyboardInterrupt:
            messages.pop()
            print("\n(answer interrupted)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer.content})


def run(args: argparse.Namespace) -> int:
    client = Client(args)
    instruction = " ".join(args.words).strip()
    material = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if not instruction and not material.strip():
        if sys.stdin is not None and sys.stdin.isatty():
            return _chat(client, args.quiet)
        raise Qat4Error("nothing to ask: give words, pipe material on stdin, or both")
    question = "\n\n".join(part for part in (instruction, material.strip()) if part)
    _ask_once(client, [{"role": "user", "content": question}], args.quiet)
    return 0
