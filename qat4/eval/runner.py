"""Send a task's questions to a server through a fixed number of concurrent clients and score each
reply as it comes back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qat4.eval.client import Reply, Server, chat, request_body
from qat4.eval.records import Record, Verdict


@dataclass(frozen=True)
class Question:
    """One request of a task and what it is scored against."""

    id: str
    messages: list[dict[str, Any]]
    expected: Any
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    thinking: bool | None = None  # None leaves the server's default
    extra: dict[str, Any] = field(default_factory=dict)  # what the task keeps beside the record (depth, seed)

    @property
    def prompt(self) -> Any:
        """What the record keeps of the request: the messages, and the tools when there are any."""
        return {"messages": self.messages, "tools": self.tools} if self.tools else self.messages


Scorer = Callable[[Question, Reply], Verdict]


def record_of(question: Question, reply: Reply, score: Scorer) -> Record:
    """The record of one answered question; a failed request is wrong, its error the reason."""
    if not reply.ok:
        return Record(question.id, question.prompt, None, question.expected, None, False, reply.error, question.extra)
    verdict = score(question, reply)
    shown: Any = reply.content if not reply.tool_calls else {"content": reply.content, "tool_calls": reply.tool_calls}
    return Record(question.id, question.prompt, shown, question.expected, verdict.answer, verdict.correct,
                  verdict.reason, question.extra)


def run(server: Server, questions: Sequence[Question], score: Scorer, concurrency: int,
        on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Every question through exactly `concurrency` clients (each sends its next question when its
    last reply came back); the records in question order. `on_record` sees each as it is scored."""
    records: list[Record | None] = [None] * len(questions)
    queue = iter(enumerate(questions))  # shared by the clients

    async def clients() -> None:
        async with server.client(concurrency) as client:
            async def one_client() -> None:
                for i, question in queue:
                    body = request_body(server, question.messages, question.max_tokens, tools=question.tools,
                                        thinking=question.thinking)
                    records[i] = record_of(question, await chat(client, body), score)
                    if on_record is not None:
                        on_record(records[i])

            await asyncio.gather(*(one_client() for _ in range(concurrency)))

    asyncio.run(clients())
    return records
