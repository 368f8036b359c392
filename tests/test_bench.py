"""`qat4 bench`: the byte counts behind the roofline, and the command end to end on the CPU."""

import json
import subprocess
import sys

import pytest
import torch

from qat4.bench import kv_bytes_per_token, weight_bytes_per_token
from qat4.cli import main
from qat4.config import E2B


def test_weight_bytes_per_token_is_the_all_int4_e2b_figure():
    # Every layer matrix, per_layer_model_projection and the int4 output layer, fp16 steps.
    assert weight_bytes_per_token(E2B) == 1_282_203_648


def test_kv_bytes_read_follow_the_window_and_the_full_layers():
    class FakeEngine:
        config, dtype = E2B, torch.bfloat16

    n = 32_768
    # 7 full layers read n + 1 positions of 512-wide K and V; 28 sliding layers read the 512-slot window.
    expected = 7 * (n + 1) * 2 * 512 * 2 + 28 * 512 * 2 * 256 * 2
    assert kv_bytes_per_token(FakeEngine, n) == expected
    assert kv_bytes_per_token(FakeEngine, 0) == 7 * 2 * 512 * 2 + 28 * 2 * 256 * 2


def test_bench_command_on_the_cpu(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "qat4.cli", "bench", "--model", "synthetic:tiny", "--device", "cpu",
         "--depths", "0,16", "--new", "2", "--prompt", "16", "--batch", "8", "--batch-context", "16",
         "--json", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "decode tok/s" in proc.stdout and "of roofline" in proc.stdout
    report = json.loads(out.read_text())
    assert [d["depth"] for d in report["depths"]] == [0, 16]
    assert all(d["decode_tok_s"] > 0 and 0 < d["roofline_fraction"] for d in report["depths"])
    # 8 sequences whose prompts are read while the first ones decode still fit the context it sized
    assert [(b["batch"], b["context"]) for b in report["batches"]] == [(8, 16)]
    assert plot.stat().st_size > 1000


def test_bench_peers_hf_runs_transformers_on_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qat4.cli", "bench", "--model", "synthetic:tiny", "--device", "cpu",
         "--depths", "0", "--new", "3", "--prompt", "16", "--peers", "hf", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "transformers-bf16" in proc.stdout and "qat4 decode (depth 0)" in proc.stdout
    report = json.loads(out.read_text())
    peer = report["peers"]["transformers-bf16"]
    assert peer["decode_tok_s"] > 0 and peer["prompt_tok_s"] > 0
    ours = report["depths"][0]["decode_tok_s"]
    assert peer["qat4_decode_ratio"] == pytest.approx(ours / peer["decode_tok_s"])
    assert peer["qat4_prompt_ratio"] == pytest.approx(report["prompt_tok_s"] / peer["prompt_tok_s"])


def test_bench_speculative_on_the_cpu(tmp_path):
    """The replay drafter at acceptance 1 has every draft kept and at 0 none; the step costs cover
    k = 0 .. --spec-tokens."""
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qat4.cli", "bench", "speculative", "--model", "synthetic:tiny", "--device", "cpu",
         "--batch", "1", "--acceptance", "0,1", "--k", "2", "--new", "6", "--context", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "a step verifying k drafts" in proc.stdout and "adaptive" in proc.stdout
    report = json.loads(out.read_text())
    assert len(report["step_us"]["1"]) == 3 and report["plain_tok_s"]["1"] > 0
    fixed = {p["acceptance"]: p for p in report["curve"] if p["spec_tokens"] == 2}
    assert fixed[1.0]["seen_acceptance"] == 1.0 and fixed[1.0]["tokens_per_step"] > 2
    assert fixed[0.0]["seen_acceptance"] == 0.0 and fixed[0.0]["tokens_per_step"] == 1.0
    assert fixed[0.0]["verifications"] > 0


@pytest.mark.parametrize("args, message", [
    (["--acceptance", "0,2"], "--acceptance values must be between 0 and 1"),
    (["--k", "4", "--spec-tokens", "2"], "--k 4 is more than --spec-tokens 2"),
    (["--batch", "17"], "--batch 17 is more than 16, the most sequences that speculate together"),
])
def test_bench_speculative_bad_arguments_are_one_line(args, message, capsys):
    base = ["bench", "speculative", "--model", "synthetic:tiny", "--device", "cpu"]
    assert main([*base, *args]) == 1  # in this process: the commands above run `python -m qat4.cli` itself
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--depths", "0,x"], "--depths must be comma-separated integers"),
    (["--model", "synthetic:huge"], "unknown synthetic preset"),
    (["--tune"], "--tune times CUDA-graph replays; it needs --device cuda"),
])
def test_bench_bad_arguments_are_one_line(args, message, capsys):
    base = ["bench", "--model", "synthetic:tiny", "--device", "cpu"]
    assert main([*base, *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_speculative_with_an_mtp_drafter_pays_its_drafts_and_reports_their_cost(tmp_path):
    """--mtp: the drafter's cost for k = 1 .. --spec-tokens, the replayed curve with its drafts run
    and paid, and one run with its own drafts."""
    from qat4.checkpoint.assistant import write_synthetic_assistant
    from qat4.config import TINY

    drafter = write_synthetic_assistant(tmp_path / "mtp", TINY)
    out = tmp_path / "spec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "qat4.cli", "bench", "speculative", "--model", "synthetic:tiny", "--device", "cpu",
         "--batch", "1", "--acceptance", "1", "--k", "2", "--new", "6", "--context", "16", "--mtp", str(drafter),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "the MTP drafter's k drafts" in proc.stdout
    report = json.loads(out.read_text())
    assert len(report["draft_us"]["1"]) == 2 and all(us > 0 for us in report["draft_us"]["1"])
    replay = next(p for p in report["curve"] if p["drafter"] == "replay" and p["spec_tokens"] == 2)
    assert replay["seen_acceptance"] == 1.0
    own = [p for p in report["curve"] if p["drafter"] == "mtp"]
    assert len(own) == 1 and own[0]["acceptance"] is None and own[0]["decode_tok_s"] > 0


def test_every_timed_prompt_is_read_cold_not_from_the_prompt_cache():
    import torch

    from qat4 import bench
    from qat4.checkpoint.synth import synthetic_model
    from qat4.config import TINY
    from qat4.engine import Engine

    engine = Engine.from_packed(synthetic_model(TINY, seed=0), "cpu", max_ctx=256)
    generate, cached = engine.generate, []

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        cached.append(out.cached_tokens)
        return out

    engine.generate = recorded
    bench.time_prompt(engine, 64, torch.Generator().manual_seed(0))
    assert cached == [0, 0, 0]


def test_every_sequence_of_a_timed_batch_is_still_decoding_when_the_timing_starts(monkeypatch):
    """Prompts read a chunk a step: the first sequences decode meanwhile and must not run out of
    tokens before the timed steps."""
    import torch

    from qat4 import bench
    from qat4.checkpoint.synth import synthetic_model
    from qat4.config import TINY
    from qat4.engine import Engine

    engine = Engine.from_packed(synthetic_model(TINY, seed=0), "cpu", max_ctx=512, prefill_chunk=16)
    timed = []
    real = bench._timed

    def checking(device, fn, times=1):
        timed.append(len(engine.scheduler.running))
        return real(device, fn, times)

    monkeypatch.setattr(bench, "_timed", checking)
    result = bench.time_batch(engine, 4, 64, 6, torch.Generator().manual_seed(0))
    assert timed == [4] and result.decode_tok_s > 0
