"""Each `qat4 eval` server task end to end with --limit against a real `qat4 serve` of the tiny
synthetic model on the CPU (its weights are random, so its scores are near zero): gsm8k with a
server it starts itself, bfcl and recall against one already running."""

from __future__ import annotations

import json
import signal

import pytest
from eval_harness import SHARED_DATA, needs_shared_data
from server_harness import tiny_serve_process

from qat4.cli import main
from qat4.eval.records import read_jsonl

TINY = ["--data", str(SHARED_DATA), "--max-tokens", "8"]


@pytest.fixture(autouse=True)
def _sigterm_handler_restored():
    """qat4.cli.main, called in process here, turns SIGTERM into KeyboardInterrupt; pytest gets its own back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def served():
    with tiny_serve_process() as url:
        yield url


def _ran(tmp_path, task: str, questions: int) -> tuple[dict, list]:
    summary = json.loads((tmp_path / f"{task}.json").read_text())
    records = read_jsonl(tmp_path / f"{task}.jsonl")
    assert summary["questions"] == len(records) == questions and summary["failed_requests"] == 0
    assert 0 <= summary["accuracy"] <= 1 and all(r.reply is not None for r in records)
    return summary, records


def _files(tmp_path, task: str) -> list[str]:
    return ["--jsonl", str(tmp_path / f"{task}.jsonl"), "--json", str(tmp_path / f"{task}.json")]


@needs_shared_data
def test_gsm8k_starts_its_own_qat4_serve(tmp_path):
    assert main(["eval", "gsm8k", "--model", "synthetic:tiny", "--device", "cpu", "--limit", "2",
                 "--concurrency", "2", *TINY, *_files(tmp_path, "gsm8k")]) == 0
    summary, records = _ran(tmp_path, "gsm8k", 2)
    assert summary["model"] == "synthetic:tiny" and records[0].expected == "18"


@needs_shared_data
def test_bfcl_against_a_running_qat4_serve(served, tmp_path):
    assert main(["eval", "bfcl", "--url", served, "--limit", "2", "--categories", "simple_python,irrelevance",
                 *TINY, *_files(tmp_path, "bfcl")]) == 0
    summary, _ = _ran(tmp_path, "bfcl", 4)
    assert set(summary["by_category"]) == {"simple_python", "irrelevance"}


def test_recall_against_a_running_qat4_serve(served, tmp_path):
    assert main(["eval", "recall", "--url", served, "--depths", "1k", "--seeds", "0,1", *TINY,
                 *_files(tmp_path, "recall")]) == 0
    summary, records = _ran(tmp_path, "recall", 2)
    assert summary["by_depth"]["1024"]["right"] + summary["by_depth"]["1024"]["wrong"] == 2
    assert records[0].extra["prompt_tokens"] <= 1024 - 8
