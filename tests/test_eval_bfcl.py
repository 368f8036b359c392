"""`qat4 eval bfcl`: the Berkeley checker scores the ground truth's own calls 1.0 in every category,
wrong calls 0, malformed ones wrong with their reason; the tools sent are JSON Schema."""

from __future__ import annotations

import json

import pytest
from eval_harness import SHARED_DATA, needs_shared_data, scripted_server

from qat4.cli import main
from qat4.errors import Qat4Error
from qat4.eval import bfcl
from qat4.eval.client import Reply, Server
from qat4.eval.records import read_jsonl
from qat4.eval.runner import run

pytestmark = needs_shared_data

LIMIT = 6


@pytest.fixture(scope="module")
def questions():
    return bfcl.load(SHARED_DATA, bfcl.CATEGORIES, LIMIT, 256)


def _calls_of(ground_truth) -> list[dict]:
    """Tool calls that give each function of the ground truth the first value it allows
    (leaving out a parameter whose first allowed value is "", BFCL's mark of an optional one)."""
    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": name.replace(".", "_"),
                          "arguments": json.dumps({k: v[0] for k, v in args.items() if v[0] != ""})}}
            for i, call in enumerate(ground_truth) for name, args in call.items()]


def _run(questions, reply) -> list:
    by_id = {q.id: q for q in questions}

    def respond(body):
        question = next(q for q in questions if q.messages == body["messages"] and q.tools == body.get("tools"))
        return reply(by_id[question.id])

    with scripted_server(respond) as server:
        return run(Server(server.url), questions, bfcl.score, concurrency=4)


def test_tools_are_json_schema_with_openai_names(questions):
    def types_in(schema):
        yield schema.get("type")
        for value in (schema.get("properties") or {}).values():
            yield from types_in(value)
        if isinstance(schema.get("items"), dict):
            yield from types_in(schema["items"])

    sent = [t["function"] for q in questions for t in q.tools]
    assert all(t["parameters"]["type"] == "object" for t in sent)
    assert not {"dict", "float", "tuple", "any"} & {t for tool in sent for t in types_in(tool["parameters"])}
    assert all("." not in t["name"] for t in sent)
    assert {q.extra["category"] for q in questions} == set(bfcl.CATEGORIES) and len(questions) == 5 * LIMIT


def test_the_ground_truths_calls_score_one_in_every_category(questions):
    records = _run(questions, lambda q: {"content": "No function fits."} if q.extra["category"] == "irrelevance"
                   else {"content": None, "tool_calls": _calls_of(q.expected)})
    assert [r.reason for r in records if not r.correct] == []
    assert bfcl.by_category(records) == {c: {"questions": LIMIT, "right": LIMIT, "accuracy": 1.0} for c in bfcl.CATEGORIES}


def test_wrong_calls_score_zero(questions):
    def wrong(q):
        tool = q.tools[0]["function"]["name"]
        call = {"id": "c", "type": "function", "function": {"name": tool, "arguments": "{}"}}
        return {"content": None, "tool_calls": [call]}

    records = _run(questions, wrong)
    assert not any(r.correct for r in records)
    irrelevant = [r for r in records if r.extra["category"] == "irrelevance"]
    assert all(r.reason == "called a function where none fits" for r in irrelevant)
    assert all(r.reason.startswith("simple_function_checker:missing_required") for r in records
               if r.extra["category"] == "simple_python")


def test_malformed_replies_are_wrong_with_their_reason(questions):
    simple = next(q for q in questions if q.extra["category"] == "simple_python")
    bad_json = Reply(tool_calls=[{"name": "f", "arguments": "{not json"}])
    assert bfcl.score(simple, bad_json).reason == "the arguments of a tool call are not JSON"
    assert bfcl.score(simple, Reply(content="The area is 25.")).reason == "no tool call in the reply"
    listed = Reply(tool_calls=[{"name": "f", "arguments": "[1, 2]"}])
    assert bfcl.score(simple, listed).reason == "the tool calls' arguments are not JSON objects"
    irrelevance = next(q for q in questions if q.extra["category"] == "irrelevance")
    assert bfcl.score(irrelevance, bad_json).correct  # not a call the checker can decode: no call


def test_bfcl_command_writes_records_per_category(tmp_path, capsys):
    questions = bfcl.load(SHARED_DATA, ["simple_python", "irrelevance"], 2, 256)
    with scripted_server(lambda body: {"content": "I cannot help with that."}) as server:
        assert main(["eval", "bfcl", "--url", server.url, "--data", str(SHARED_DATA), "--limit", "2",
                     "--categories", "simple_python,irrelevance", "--jsonl", str(tmp_path / "b.jsonl"),
                     "--json", str(tmp_path / "b.json")]) == 0
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["by_category"] == {"simple_python": {"questions": 2, "right": 0, "accuracy": 0.0},
                                      "irrelevance": {"questions": 2, "right": 2, "accuracy": 1.0}}
    assert [r.id for r in read_jsonl(tmp_path / "b.jsonl")] == [q.id for q in questions]
    with pytest.raises(Qat4Error, match="--categories takes some of"):
        bfcl.parse_categories("simple,java")


def test_the_checker_leaves_the_process_its_ipv6_name_resolution():
    """bfcl-eval's import (its qwen-agent) swaps socket.getaddrinfo for an IPv4-only one; qat4 puts
    the standard one back, so a server on [::1] stays reachable after a BFCL run."""
    import socket

    bfcl._bfcl()
    assert socket.getaddrinfo.__module__ == "socket"
    assert any(family == socket.AF_INET6 for family, *_ in socket.getaddrinfo("::1", 80))
