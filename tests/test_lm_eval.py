"""EleutherAI's lm-evaluation-harness against a real `qat4 serve` of the tiny synthetic model on the
CPU, given only the server's URL (it tokenizes through /tokenize): a likelihood task with
`local-completions` and a generation task with `local-chat-completions`, 5 documents each, through
the harness's `simple_evaluate` in a process of its own, as `lm_eval run` calls it. The tasks and
their data are written here (the Hub is never reached) and only they are indexed (the command line
indexes every built-in task first: 14,000 YAML files, 17 s a run on a 2-core CPU); the likelihoods
the harness reports are the model's."""

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


# simple_evaluate on one task of a folder, offline; writes {"results": ..., "samples": ...} as JSON
EVALUATE = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
tasks, task, model, url, chat, out = sys.argv[1:]
done = simple_evaluate(model=model, model_args=f"model=tiny,base_url={url}", tasks=[task], limit=5,
                       task_manager=TaskManager(include_path=tasks, include_defaults=False),
                       apply_chat_template=chat == "chat", log_samples=True)
with open(out, "w") as f:
    json.dump({"results": done["results"][task], "samples": done["samples"][task]}, f, default=str)
"""


def lm_eval(tasks: Path, out: Path, task: str, model: str, url: str, chat: bool = False) -> tuple[dict, list[dict]]:
    """The harness on 5 documents of ``task``, offline -> (its results, its samples)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf")}
    subprocess.run([sys.executable, "-c", EVALUATE, str(tasks), task, model, url, "chat" if chat else "",
                    str(out / "done.json")], env=env, check=True, timeout=600, stdout=subprocess.DEVNULL)
    done = json.loads((out / "done.json").read_text())
    return done["results"], done["samples"]


def test_a_likelihood_task_with_local_completions(served, tasks, tmp_path):
    results, samples = lm_eval(tasks, tmp_path, "qat4_sums_choice", "local-completions", served + "/v1/completions")
    assert results["sample_len"] == 5 and 0 <= results["acc,none"] <= 1
    engine, sample = tiny_engine(), samples[0]
    for (text, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
        # the harness reads the continuation's tokens after the context's, as the server's /tokenize gives them
        context = engine.tokenizer.encode(text)
        tokens = engine.tokenizer.encode(text + continuation)
        rows = torch.log_softmax(engine.logits(tokens), dim=-1)
        likelihood = sum(float(rows[i - 1, tokens[i]]) for i in range(len(context), len(tokens)))
        assert abs(float(response[0][0]) - likelihood) < 1e-3


def test_a_generation_task_with_local_chat_completions(served, tasks, tmp_path):
    results, samples = lm_eval(tasks, tmp_path, "qat4_sums_gen", "local-chat-completions",
                               served + "/v1/chat/completions", chat=True)
    assert results["sample_len"] == 5 and 0 <= results["exact_match,none"] <= 1
    assert len(samples) == 5 and all(isinstance(s["resps"][0][0], str) for s in samples)
