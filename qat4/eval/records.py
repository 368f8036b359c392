"""What every task writes: one record per question (JSONL) and a summary (JSON), and reading them back."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qat4.errors import Qat4Error


@dataclass(frozen=True)
class Verdict:
    """A task's judgement of one reply: the answer it extracted (None when it found none), whether
    that answer is right, and why not when it is not."""

    answer: Any
    correct: bool
    reason: str = ""


@dataclass
class Record:
    """One question of a run: what was asked, what came back, and the verdict."""

    id: str
    prompt: Any  # the messages sent (and tools, where the task sends any)
    reply: Any  # the reply's text, or its tool calls; None when the request failed
    expected: Any
    answer: Any
    correct: bool
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_jsonl(records: Iterable[Record], path: str | Path) -> None:
    """One record a line."""
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[Record]:
    """The records of a JSONL file that `qat4 eval` wrote; Qat4Error naming the file and line when
    it is missing or is not such a file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise Qat4Error(f"cannot read {path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            records.append(Record(id=str(data["id"]), prompt=data.get("prompt"), reply=data.get("reply"),
                                  expected=data.get("expected"), answer=data.get("answer"),
                                  correct=_boolean(data["correct"]), reason=data.get("reason") or "",
                                  extra=data.get("extra") or {}))
        except (ValueError, KeyError, TypeError):
            raise Qat4Error(f"{path} line {number} is not a qat4 eval record (a JSON object with id and correct)") from None
    return records


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("correct must be true or false")
    return value


def accuracy(records: Sequence[Record]) -> float | None:
    """The fraction of records answered right; None for no records."""
    return sum(r.correct for r in records) / len(records) if records else None


def summary(task: str, records: Sequence[Record], **details: Any) -> dict[str, Any]:
    """The run's figures: questions, right, accuracy, failed requests, and the task's own `details`."""
    return {"task": task, "questions": len(records), "right": sum(r.correct for r in records),
            "accuracy": accuracy(records), "failed_requests": sum(r.reply is None for r in records), **details}
