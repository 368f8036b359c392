"""EleutherAI's lm-evaluation-harness against a real `qat4 serve` of the tiny synthetic model on the
CPU, run as a user runs it: the `lm_eval` command line, given only the server's URL (it tokenizes
through /tokenize), a likelihood task with `local-completions` and a generation task with
`local-chat-completions`, `--limit 5`. The tasks and their data are written here (the Hub is never
reached); the likelihoods the harness reports are the model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_harness import tiny_engine, tiny_serve_process


pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")

QUESTIONS = [{"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(2 * i + 1)], "answer": 0}
             for i in range(8)]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
CHOICE = """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATION = """output_type: generate_until
doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served():
    with tiny_serve_process() as url:
        yield url


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A folder of two tasks over a local JSON Lines data set: qat4_sums_choice (multiple choice,
    scored by likelihood) and qat4_sums_gen (generation, scored by exact match)."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "choice.yaml").write_text(TASK.format(name="qat4_sums_choice", data=data) + CHOICE)
    (folder / "gen.yaml").write_text(TASK.format(name="qat4_sums_gen", data=data) + GENERATION)
    return folder


def lm_eval(tasks: Path, out: Path, task: str, model: str, url: str, *more: str) -> tuple[dict, list[dict]]:
    """Run `lm_eval` on ``task`` with ``--limit 5``, offline -> (its results, its logged samples)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args",
                    f"model=tiny,base_url={url}", "--tasks", task, "--include_path", str(tasks), "--limit", "5",
                    "--output_path", str(out), "--log_samples", *more],
                   env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, samples


def test_a_likelihood_task_with_local_completions(served, tasks, tmp_path):
    results, samples = lm_eval(tasks, tmp_path, "qat4_sums_choice", "local-completions", served + "/v1/completions")
    assert results["sample_len"] == 5 and 0 <= results["acc,none"] <= 1
    engine, sample = tiny_engine(), samples[0]
    for request, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
        # the harness reads the continuation's tokens after the context's, as the server's /tokenize gives them
        context = engine.tokenizer.encode(request["arg_0"])
        tokens = engine.tokenizer.encode(request["arg_0"] + request["arg_1"])
        rows = torch.log_softmax(engine.logits(tokens), dim=-1)
        likelihood = sum(float(rows[i - 1, tokens[i]]) for i in range(len(context), len(tokens)))
        assert abs(float(response[0][0]) - likelihood) < 1e-3


def test_a_generation_task_with_local_chat_completions(served, tasks, tmp_path):
    results, samples = lm_eval(tasks, tmp_path, "qat4_sums_gen", "local-chat-completions",
                               served + "/v1/chat/completions", "--apply_chat_template")
    assert results["sample_len"] == 5 and 0 <= results["exact_match,none"] <= 1
    assert len(samples) == 5 and all(isinstance(s["resps"][0][0], str) for s in samples)
