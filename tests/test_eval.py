"""`qat4 eval` gsm8k, recall and compare: scoring proven on known answers through a scripted server,
the paired figures on constructed runs, the data locations, and one-sentence errors."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from eval_harness import SHARED_DATA, last_user_text, needs_shared_data, scripted_server
from fastapi.responses import JSONResponse

from qat4.cli import main
from qat4.errors import Qat4Error
from qat4.eval import compare, data, gsm8k, recall
from qat4.eval.client import Reply, Server
from qat4.eval.records import Record, Verdict, read_jsonl
from qat4.eval.runner import run
from qat4.commands.model_args import synthetic_tokenizer

GSM8K = SHARED_DATA / "gsm8k" / "test.jsonl"
LIMIT = 12


@pytest.fixture(autouse=True)
def _sigterm_handler_restored():
    """qat4.cli.main, called in process here, turns SIGTERM into KeyboardInterrupt; pytest gets its own back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _solutions() -> dict[str, str]:
    """Each GSM8K question's text as the prompt carries it, to its reference solution."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:LIMIT]]
    return {f"{r['question']}\n\n{gsm8k.INSTRUCTION}": r["answer"] for r in rows}


def _gsm8k_run(reply) -> list[Record]:
    solutions = _solutions()
    with scripted_server(lambda body: reply(solutions[last_user_text(body)])) as server:
        return run(Server(server.url), gsm8k.load(GSM8K, LIMIT, 64), gsm8k.score, concurrency=3)


# ---- gsm8k -----------------------------------------------------------------------------------------


@needs_shared_data
def test_gsm8k_reference_solutions_score_one():
    records = _gsm8k_run(lambda solution: {"content": solution})
    assert len(records) == LIMIT and all(r.correct for r in records)
    assert records[0].expected == "18" and records[0].answer == "18"
    assert [r.id for r in records] == [f"gsm8k_{i}" for i in range(LIMIT)]


@needs_shared_data
def test_gsm8k_wrong_numbers_score_zero():
    records = _gsm8k_run(lambda solution: {"content": f"The answer is {int(gsm8k.reference_answer(solution)) + 1}."})
    assert not any(r.correct for r in records)
    assert records[0].reason == "19 is not 18"


@needs_shared_data
def test_gsm8k_malformed_and_failed_replies_are_wrong_with_their_reason():
    def reply(solution):
        if solution.endswith("#### 18"):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if solution.endswith("#### 3"):
            return JSONResponse({"choices": []})
        return {"content": "I cannot say."}

    records = _gsm8k_run(reply)
    assert not any(r.correct for r in records)
    assert records[0].reply is None and records[0].reason == "HTTP 503: overloaded"
    assert records[1].reply is None and records[1].reason.startswith("the server's answer is not a chat completion")
    assert records[2].answer is None and records[2].reason == "no number in the reply"


@pytest.mark.parametrize("reply, answer", [
    ("so she makes $1,000.00 a day.\n#### 1,000", "1000"),
    ("The answer is: **42**", "42"),
    ("\\boxed{ -3.5 } and later 7", "-3.5"),
    ("3 apples and 4 pears make 7", "7"),
    ("no digits here", None),
])
def test_gsm8k_answer_extraction(reply, answer):
    assert gsm8k.extract(reply) == answer


# ---- recall ----------------------------------------------------------------------------------------


def _code_table(prompt: str) -> dict[int, str]:
    return {int(n): code for n, code in re.findall(r"Record (\d+): the code of record \d+ is (\d{6})", prompt)}


def test_recall_prompts_fit_their_depth_and_ask_a_quarter_in():
    tokenizer = synthetic_tokenizer()
    question = recall.build(2048, 7, tokenizer, 16)
    assert 2048 - 16 - 40 <= question.extra["prompt_tokens"] <= 2048 - 16
    table = _code_table(question.messages[0]["content"])
    assert len(table) == question.extra["records"] and len(set(table.values())) == len(table)
    assert question.extra["target"] == len(table) // 4 and question.expected == table[question.extra["target"]]
    assert question.thinking is False
    assert recall.build(2048, 7, tokenizer, 16) == question  # a seed always draws the same codes
    assert recall.build(2048, 8, tokenizer, 16).expected != question.expected
    assert recall.parse_depths("4k, 512") == [4096, 512]
    with pytest.raises(Qat4Error, match="--depths takes token counts"):
        recall.parse_depths("4q")


def _recall_run(reply) -> list[Record]:
    """Recall at two depths and two seeds against a server answering reply(code table, target)."""
    def respond(body):
        prompt = last_user_text(body)
        return {"content": reply(_code_table(prompt), int(re.search(r"code of record (\d+)\?", prompt).group(1)))}

    questions = recall.questions([1024, 1536], [0, 1], synthetic_tokenizer(), 16)
    with scripted_server(respond) as server:
        return run(Server(server.url), questions, recall.score, concurrency=2)


def test_recall_right_codes_score_one():
    records = _recall_run(lambda table, target: table[target])
    assert len(records) == 4 and all(r.correct for r in records)
    assert recall.by_depth(records) == {"1024": {"right": 2, "wrong": 0, "wrong_replies": []},
                                        "1536": {"right": 2, "wrong": 0, "wrong_replies": []}}


def test_recall_names_the_record_whose_code_came_back():
    records = _recall_run(lambda table, target: f"It is {table[target + 1]}.")
    assert not any(r.correct for r in records)
    assert [r.reason for r in records] == [f"the code of record {r.extra['target'] + 1}" for r in records]
    row = recall.by_depth(records)["1024"]
    assert row["wrong"] == 2 and row["wrong_replies"][0]["gave"] == records[0].reason


def test_recall_malformed_replies_are_wrong_with_their_reason():
    question = recall.build(1024, 0, synthetic_tokenizer(), 16)
    stranger = next(str(c) for c in range(100_000, 1_000_000) if str(c) not in question.extra["codes"])
    assert recall.score(question, Reply(content="I do not know")) == Verdict(None, False, "no six-digit code in the reply")
    assert recall.score(question, Reply(content=f"{stranger}")) == Verdict(stranger, False, "the code of no record")
    assert recall.score(question, Reply(content=f"Code: {question.expected}, I think")).correct


# ---- compare ---------------------------------------------------------------------------------------


def _records(verdicts: str, prefix: str = "q") -> list[Record]:
    """One record per character: R right, W wrong."""
    return [Record(f"{prefix}{i}", "p", "r", "1", "1", v == "R") for i, v in enumerate(verdicts)]


def test_compare_counts_each_way_and_the_difference():
    a = _records("RRRRWWRW" + "R" * 92)
    b = _records("RRWWRRRR" + "R" * 92)
    c = compare.pair(a, b)
    assert (c.questions, c.both_right, c.a_only, c.b_only, c.neither) == (100, 95, 2, 3, 0)
    assert (c.accuracy_a, c.accuracy_b) == (0.97, 0.98) and c.difference == pytest.approx(0.01)
    assert c.mcnemar_p == 1.0  # 2 against 3 is no evidence either way


def test_compare_interval_is_the_paired_bootstrap():
    # 26 questions go each way of 1,319: the normal approximation gives +-1.96 * sqrt(52) / 1319 = +-0.0107.
    a = _records("R" * 26 + "W" * 26 + "R" * 1000 + "W" * 267)
    b = _records("W" * 26 + "R" * 26 + "R" * 1000 + "W" * 267)
    c = compare.pair(a, b)
    assert c.difference == 0.0
    low, high = c.interval
    assert low == pytest.approx(-0.0107, abs=0.0012) and high == pytest.approx(0.0107, abs=0.0012)
    assert compare.pair(a, b).interval == c.interval  # a fixed seed
    same = compare.pair(a, a)
    assert same.interval == (0.0, 0.0) and same.mcnemar_p == 1.0
    all_a = compare.pair(_records("RRRRRR"), _records("WWWWWW"))
    assert all_a.difference == -1.0 and all_a.interval == (-1.0, -1.0)
    assert all_a.mcnemar_p == pytest.approx(2 / 2**6)  # six discordant pairs, all one way


def test_compare_pairs_by_id_and_reports_the_unpaired():
    c = compare.pair(_records("RRW"), _records("RRWR"))
    assert c.questions == 3 and c.only_in_a == 0 and c.only_in_b == 1
    with pytest.raises(Qat4Error, match="no question in common"):
        compare.pair(_records("R", "a"), _records("R", "b"))


def test_compare_command_prints_the_paired_table(tmp_path, capsys):
    from qat4.eval.records import write_jsonl

    write_jsonl(_records("RRRW"), tmp_path / "llama.jsonl")
    write_jsonl(_records("RRWW"), tmp_path / "qat4.jsonl")
    assert main(["eval", "compare", str(tmp_path / "llama.jsonl"), str(tmp_path / "qat4.jsonl"),
                 "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "-0.250" in out and "2 both right, 1 only llama, 0 only qat4, 1 neither" in out
    assert json.loads((tmp_path / "c.json").read_text())["a_only"] == 1


# ---- data and errors -------------------------------------------------------------------------------


def test_data_folder_comes_from_the_flag_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    assert data.data_dir("~/elsewhere") == Path.home() / "elsewhere"
    assert data.data_dir(None) == tmp_path
    monkeypatch.delenv(data.DATA_ENV)
    assert data.data_dir(None) == data.DEFAULT_DATA_DIR.expanduser()


@needs_shared_data
def test_gsm8k_is_fetched_from_the_hub_when_missing(monkeypatch, tmp_path):
    import huggingface_hub
    import pyarrow
    import pyarrow.parquet

    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:3]]
    parquet = tmp_path / "hub.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), parquet)
    asked = []

    def fake_download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename, kwargs["repo_type"]))
        return str(parquet)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    path = data.gsm8k_file(tmp_path / "data")
    assert asked == [(data.GSM8K_REPO, data.GSM8K_PARQUET, "dataset")]
    assert path == tmp_path / "data" / "gsm8k" / "test.jsonl"
    assert [q.expected for q in gsm8k.load(path, None, 8)] == [q.expected for q in gsm8k.load(GSM8K, 3, 8)]
    assert data.gsm8k_file(tmp_path / "data") == path and len(asked) == 1  # the second time it is local


def test_an_empty_data_file_is_one_sentence(tmp_path, capsys):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("")
    assert main(["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--data", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == "qat4 eval: the gsm8k data has no questions"


def test_gsm8k_offline_without_a_local_copy_is_one_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--data", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qat4 eval: the GSM8K test split is not at") and "\n" not in err


@needs_shared_data
@pytest.mark.parametrize("argv, message", [
    (["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--data", str(SHARED_DATA), "--limit", "1"],
     "cannot reach http://127.0.0.1:9"),
    (["eval", "gsm8k", "--url", "not a url", "--data", str(SHARED_DATA), "--limit", "1"], "cannot reach not a url"),
    (["eval", "gsm8k", "--data", str(SHARED_DATA)], "needs --url of a running server, or --model"),
    (["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency must be at least 1"),
    (["eval", "recall", "--url", "http://127.0.0.1:9", "--depths", "4k,x"], "--depths takes token counts"),
    (["eval", "compare", "/nonexistent/a.jsonl", "/nonexistent/b.jsonl"], "cannot read /nonexistent/a.jsonl"),
    (["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--data", str(SHARED_DATA), "--jsonl", "/nonexistent/r.jsonl"],
     "cannot write /nonexistent/r.jsonl: there is no folder /nonexistent"),
])
def test_bad_input_is_one_sentence(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_a_jsonl_that_is_not_records_is_refused_with_its_line(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"id": "q0", "correct": True}) + "\n")
    for bad_line in ("not json", json.dumps({"id": "q0"}), json.dumps({"id": "q0", "correct": "yes"})):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"id": "q1", "correct": False}) + "\n" + bad_line + "\n")
        assert main(["eval", "compare", str(good), str(tmp_path / "bad.jsonl")]) == 1
        assert "bad.jsonl line 2 is not a qat4 eval record" in capsys.readouterr().err
    assert read_jsonl(good)[0].correct is True


@needs_shared_data
def test_gsm8k_command_against_a_scripted_server_writes_records_and_summary(tmp_path, capsys):
    solutions = _solutions()
    with scripted_server(lambda body: {"content": solutions[last_user_text(body)]}) as server:
        assert main(["eval", "gsm8k", "--url", server.url + "/v1", "--data", str(SHARED_DATA), "--limit", "5",
                     "--jsonl", str(tmp_path / "run.jsonl"), "--json", str(tmp_path / "run.json")]) == 0
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["questions"] == 5 and summary["accuracy"] == 1.0 and summary["model"] == "scripted"
    assert json.loads(capsys.readouterr().out)["right"] == 5
    records = read_jsonl(tmp_path / "run.jsonl")
    assert [r.id for r in records] == [f"gsm8k_{i}" for i in range(5)] and records[0].prompt[0]["role"] == "user"
