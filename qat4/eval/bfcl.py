"""BFCL v4 (Berkeley Function Calling Leaderboard): each question's functions go as `tools`, and
the reply's tool calls are scored by the Berkeley checker itself (the bfcl-eval package), as the
leaderboard scores an OpenAI-style function-calling model.

The functions are turned into tools by bfcl-eval's own converter, which writes BFCL's parameter
types as JSON Schema's ("dict" as "object", "float" as "number") and, as OpenAI's API requires,
"." in a function name as "_"; the checker is told so through the model entry it looks names up
under. An irrelevance question is right when the reply calls no function.
"""

from __future__ import annotations

import functools
import json
import socket
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qat4.errors import Qat4Error
from qat4.eval.client import Reply
from qat4.eval.data import required
from qat4.eval.records import Record, Verdict
from qat4.eval.runner import Question

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
NO_ANSWER_FILE = {"irrelevance"}  # right means no call, so the set has no possible answers
# bfcl-eval's model entry for OpenAI-style function calling: names sent with "_" for "."
CHECKER_MODEL = "gpt-4o-2024-11-20-FC"


@functools.cache
def _bfcl() -> types.SimpleNamespace:
    """bfcl-eval's converter and checker (importing them takes seconds: the package loads every
    model handler it knows). One of those, qwen-agent's image search, replaces socket.getaddrinfo
    for the whole process with one that drops IPv6 addresses, after which nothing here could reach
    a server on [::1]; the original is put back."""
    getaddrinfo = socket.getaddrinfo
    try:
        from bfcl_eval.constants.enums import Language, ModelStyle
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.model_handler.utils import convert_to_tool
        from bfcl_eval.utils import is_empty_output, is_function_calling_format_output
    except ImportError as exc:
        raise Qat4Error(f"qat4 eval bfcl scores with the Berkeley checker, which needs the bfcl-eval package "
                        f"(pip install 'qat4[eval]'; {exc})") from None
    finally:
        socket.getaddrinfo = getaddrinfo
    return types.SimpleNamespace(Language=Language, ModelStyle=ModelStyle, GORILLA_TO_OPENAPI=GORILLA_TO_OPENAPI,
                                 ast_checker=ast_checker, convert_to_tool=convert_to_tool,
                                 is_empty_output=is_empty_output,
                                 is_function_calling_format_output=is_function_calling_format_output)


def parse_categories(text: str) -> list[str]:
    """--categories: comma-separated BFCL categories."""
    categories = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in categories if c not in CATEGORIES]
    if not categories or unknown:
        raise Qat4Error(f"--categories takes some of {', '.join(CATEGORIES)}; got {text!r}")
    return categories


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise Qat4Error(f"{path} line {number} is not JSON") from None
    return rows


def load(root: Path, categories: Sequence[str], limit: int | None, max_tokens: int) -> list[Question]:
    """The first `limit` questions (all when None) of each category under root/bfcl, with their tools."""
    bfcl = _bfcl()
    questions = []
    for category in categories:
        name = f"BFCL_v4_{category}.json"
        entries = _json_lines(required(root / "bfcl" / name, f"BFCL's {category} questions"))[:limit]
        answers = {}
        if category not in NO_ANSWER_FILE:
            answer_file = required(root / "bfcl" / "possible_answer" / name, f"BFCL's {category} answers")
            answers = {row["id"]: row["ground_truth"] for row in _json_lines(answer_file)}
        for entry in entries:
            try:
                tools = bfcl.convert_to_tool(entry["function"], bfcl.GORILLA_TO_OPENAPI, bfcl.ModelStyle.OPENAI_COMPLETIONS)
                questions.append(Question(entry["id"], entry["question"][0], answers.get(entry["id"], []), max_tokens,
                                          tools=tools, extra={"category": category, "functions": entry["function"]}))
            except (KeyError, IndexError, TypeError, AttributeError):
                raise Qat4Error(f"{name} entry {entry.get('id', '?')} is not a BFCL question") from None
    return questions


def decoded_calls(reply: Reply) -> list[dict[str, Any]]:
    """The reply's tool calls as BFCL writes them, [{name: {argument: value}}]; ValueError when an
    argument string is not JSON."""
    return [{call["name"]: json.loads(call["arguments"])} for call in reply.tool_calls]


def score(question: Question, reply: Reply) -> Verdict:
    """The Berkeley checker's verdict on the reply's tool calls (for irrelevance: right when there are none)."""
    bfcl = _bfcl()
    category = question.extra["category"]
    try:
        calls = decoded_calls(reply)
    except ValueError:
        calls = None
    if category == "irrelevance":
        if calls is None or bfcl.is_empty_output(calls):
            return Verdict(calls, True)
        return Verdict(calls, False, "called a function where none fits")
    if calls is None:
        return Verdict(None, False, "the arguments of a tool call are not JSON")
    if not calls:
        return Verdict(None, False, "no tool call in the reply")
    if not bfcl.is_function_calling_format_output(calls):
        return Verdict(calls, False, "the tool calls' arguments are not JSON objects")
    result = bfcl.ast_checker(question.extra["functions"], calls, question.expected, bfcl.Language.PYTHON, category,
                              CHECKER_MODEL)
    if result["valid"]:
        return Verdict(calls, True)
    return Verdict(calls, False, f"{result.get('error_type', 'checker')}: {'; '.join(map(str, result.get('error', [])))}")


def by_category(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Questions, right and accuracy of each category, in the order they came."""
    table: dict[str, dict[str, Any]] = {}
    for r in records:
        row = table.setdefault(r.extra["category"], {"questions": 0, "right": 0})
        row["questions"] += 1
        row["right"] += r.correct
    for row in table.values():
        row["accuracy"] = row["right"] / row["questions"]
    return table
