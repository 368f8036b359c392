"""GSM8K: grade-school maths problems, each asked through the chat template, greedy, and the final
number of the reply compared with the reference's `#### N`."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qat4.errors import Qat4Error
from qat4.eval.client import Reply
from qat4.eval.records import Verdict
from qat4.eval.runner import Question

INSTRUCTION = "Solve the problem step by step. End with the final answer as a number on its own line: \"#### N\"."
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
# Where a reply states its answer, most explicit first; failing all, its last number counts.
_ANSWER_PATTERNS = [re.compile(p) for p in (rf"####\s*({_NUMBER})", rf"\\boxed\{{\s*({_NUMBER})",
                                            rf"(?i)answer is\s*:?\s*\**\s*({_NUMBER})")]
_ANY_NUMBER = re.compile(_NUMBER)


def load(path: Path, limit: int | None, max_tokens: int) -> list[Question]:
    """The first `limit` problems (all when None) of a GSM8K JSONL file ({"question", "answer"} a line),
    each allowed a reply of `max_tokens`."""
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if limit is not None and len(questions) >= limit:
            break
        try:
            row = json.loads(line)
            expected = reference_answer(row["answer"])
            content = f"{row['question']}\n\n{INSTRUCTION}"
        except (ValueError, KeyError, TypeError):
            raise Qat4Error(f"{path} line {number} is not a GSM8K problem "
                            "(a question, and an answer ending in #### N)") from None
        questions.append(Question(f"gsm8k_{number - 1}", [{"role": "user", "content": content}], expected, max_tokens))
    return questions


def reference_answer(solution: str) -> str:
    """The number after the reference solution's `####`, normalised."""
    _, mark, tail = solution.rpartition("####")
    if not mark:
        raise ValueError("no #### in the reference solution")
    number = normalise(tail.strip())
    if number is None:
        raise ValueError("no number after ####")
    return number


def normalise(text: str) -> str | None:
    """A number as digits without commas, dollar sign, or trailing zero decimals ('1,000.00' -> '1000');
    None when `text` is not a number."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def extract(reply: str) -> str | None:
    """The reply's final answer: the last `#### N`, `\\boxed{N}` or `answer is N`, else its last number."""
    for pattern in _ANSWER_PATTERNS:
        found = pattern.findall(reply)
        if found:
            return normalise(found[-1])
    numbers = _ANY_NUMBER.findall(reply)
    return normalise(numbers[-1]) if numbers else None


def score(question: Question, reply: Reply) -> Verdict:
    """Right when the reply's final number is the reference's."""
    answer = extract(reply.content)
    if answer is None:
        return Verdict(None, False, "no number in the reply")
    if answer != question.expected:
        return Verdict(answer, False, f"{answer} is not {question.expected}")
    return Verdict(answer, True)
