"""`qat4 doctor`: one line per check, --json, the exit status, and each check on a CPU machine with
its memory, disks and Hugging Face cache made deterministic."""

from __future__ import annotations

import json
import re
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch

from qat4 import doctor
from qat4.checkpoint.hub import hub_cache_dir
from qat4.cli import main
from qat4.doctor import GIB, MIB, STATUSES, diagnose

ICONS = ("✅ ", "⚠️ ", "❌ ")
NAMES = ["python", "torch", "triton", "gpu", "compute path", "disk: checkpoints", "disk: hugging face cache",
         "model", "context"]
ROOMY = 64 * GIB


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    """No GPU, 64 GiB of RAM available and 64 GiB free on every disk, whatever runs the tests."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "available_ram", lambda: (ROOMY, "MemAvailable"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2 * ROOMY, used=ROOMY, free=ROOMY))


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def context_tokens(check) -> int:
    return int(re.search(r"up to ([\d,]+) tokens", check.detail).group(1).replace(",", ""))


def run_json(capsys, *flags: str) -> tuple[int, dict]:
    status = main(["doctor", "--json", *flags])
    return status, json.loads(capsys.readouterr().out)


def test_doctor_on_a_cpu_machine_warns_of_the_reference_ops_and_exits_0(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(NAMES) + 1
    assert all(line.startswith(ICONS) for line in lines[:-1])
    assert all(line.split(" ", 1)[1].startswith(f"{name}: ") for line, name in zip(lines, NAMES))
    gpu = next(line for line in lines if " gpu: " in line)
    assert gpu.startswith("⚠️ ") and "no CUDA GPU" in gpu and "torch reference ops" in gpu
    assert "for Gemma 4 E2B" in next(line for line in lines if " context: " in line)
    icons = [line.split(" ", 1)[0] for line in lines[:-1]]
    assert "❌" not in icons
    assert lines[-1] == f"{icons.count('✅')} ok, {icons.count('⚠️')} warn, 0 fail: qat4 will run here; the ⚠️ lines say how"


def test_json_has_every_check_with_an_allowed_status(capsys):
    status, report = run_json(capsys)
    assert set(report) == {"checks", "ok"}
    assert [c["name"] for c in report["checks"]] == NAMES
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail"} and c["status"] in STATUSES and c["detail"]
    assert report["ok"] is (status == 0) is all(c["status"] != "fail" for c in report["checks"])


def test_a_model_that_is_neither_a_path_nor_a_hub_id_fails_with_exit_1(capsys):
    status, report = run_json(capsys, "--model", "/nonexistent/path")
    assert status == 1 and report["ok"] is False
    model = by_name(doctor.Check(**c) for c in report["checks"])["model"]
    assert model.status == "fail"
    assert model.detail == ("--model /nonexistent/path: there is no such folder or file, and it is not a Hugging Face "
                            "model id (org/name)")
    assert main(["doctor", "--model", "/nonexistent/path"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("❌ model: --model /nonexistent/path") for line in lines)
    assert "1 fail" in lines[-1]


def test_a_file_that_is_no_checkpoint_fails_in_one_sentence(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    model = by_name(diagnose(str(bad)))["model"]
    assert model.status == "fail" and model.detail.startswith(f"--model {bad}: ") and "GGUF" in model.detail


def test_a_local_synthetic_checkpoint_is_found_and_its_context_worked_out(tmp_path):
    out = tmp_path / "ckpts" / "tiny"
    assert main(["synth", "--preset", "tiny", "--format", "ct-emb4", "--out", str(out)]) == 0
    checks = by_name(diagnose(str(out)))
    assert checks["model"].status == "ok"
    assert checks["model"].detail.startswith(f"ct-emb4 checkpoint at {out}: 10 layers")
    assert checks["context"].status == "ok" and f"for {out}" in checks["context"].detail
    assert context_tokens(checks["context"]) == 4096  # the tiny preset's maximum, with room to spare
    assert checks["disk: checkpoints"].detail.endswith(f"free at {out}")


def test_synthetic_presets_need_no_file_and_unknown_ones_fail():
    assert by_name(diagnose("synthetic:e2b"))["model"].status == "ok"
    model = by_name(diagnose("synthetic:huge"))["model"]
    assert model.status == "fail" and "unknown synthetic preset" in model.detail


def test_short_memory_lowers_the_context_to_the_largest_the_plan_fits(monkeypatch):
    full = by_name(diagnose("synthetic:e2b"))["context"]
    assert full.status == "ok" and context_tokens(full) == 131_072
    monkeypatch.setattr(doctor, "available_ram", lambda: (3500 * MIB, "MemAvailable"))
    capped = by_name(diagnose("synthetic:e2b"))["context"]
    tokens = context_tokens(capped)
    assert 0 < tokens < 131_072 and tokens % 16 == 0
    assert capped.status == "warn" and f"pass --max-ctx {tokens}" in capped.detail
    assert "3,500 MiB RAM available (MemAvailable)" in capped.detail
    # the largest: one more KV block does not fit
    shapes, cpu, budget = doctor.shape_model(doctor.E2B), torch.device("cpu"), (3500 * MIB, "RAM available")
    doctor.fit(shapes, cpu, tokens, None, budget)
    with pytest.raises(doctor.Qat4Error, match="need"):
        doctor.fit(shapes, cpu, tokens + 16, None, budget)


def test_max_ctx_that_does_not_fit_fails_and_one_that_does_passes(monkeypatch):
    monkeypatch.setattr(doctor, "available_ram", lambda: (3500 * MIB, "MemAvailable"))
    assert by_name(diagnose("synthetic:e2b", max_ctx=131_072))["context"].status == "fail"
    assert by_name(diagnose("synthetic:e2b", max_ctx=4096))["context"].status == "ok"


def test_max_ctx_above_the_models_maximum_is_capped_as_the_engine_caps_it():
    context = by_name(diagnose("synthetic:tiny", max_ctx=1_000_000))["context"]
    assert context.status == "ok"
    assert context.detail.startswith("--max-ctx 1,000,000 (capped at the model's maximum, 4,096) fits; ")


def test_memory_too_small_for_the_model_fails_with_the_numbers(monkeypatch):
    monkeypatch.setattr(doctor, "available_ram", lambda: (10 * MIB, "MemAvailable"))
    context = by_name(diagnose("synthetic:tiny"))["context"]
    assert context.status == "fail"
    assert context.detail.startswith("not even 16 tokens fit for synthetic:tiny: the model (")
    assert "only 10 MiB RAM available (MemAvailable)" in context.detail


def test_a_memory_cap_off_a_gpu_fails_as_qat4_serve_refuses_it():
    context = by_name(diagnose("synthetic:tiny", memory_cap_mib=3500, device="cpu"))["context"]
    assert (context.status, context.detail) == ("fail", "--memory-cap-mib applies to CUDA devices only; qat4 serve "
                                                        "on cpu refuses it")


def test_a_cap_above_the_gpus_memory_is_a_failed_context_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * GIB, 24 * GIB))
    found = doctor.inspect_model("synthetic:tiny")
    context = doctor.check_context(found, torch.device("cuda", 0), memory_cap_mib=10**6, max_ctx=None)
    assert (context.status, context.detail) == ("fail", "--memory-cap-mib is 1e+06; the GPU has 24,576 MiB")


def test_synthetic_presets_live_beside_the_presets():
    from qat4.config import PRESETS, synthetic_config

    assert synthetic_config("synthetic:tiny") is PRESETS["tiny"]


def test_largest_context_bisects_over_multiples_of_the_block():
    assert doctor.largest_context(lambda ctx: ctx <= 1000, 4096, 16) == 992
    assert doctor.largest_context(lambda ctx: True, 4096, 16) == 4096
    assert doctor.largest_context(lambda ctx: False, 4096, 16) == 0


def test_disk_checks_measure_each_path_on_its_own(tmp_path, monkeypatch):
    work, hf = tmp_path / "work", tmp_path / "hf"
    work.mkdir()
    hf.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf / "hub"))  # not made yet: measured at its parent
    free = {work: 50 * GIB, hf: 5 * GIB}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=ROOMY, used=0, free=free[path]))
    checks = by_name(diagnose())
    assert checks["disk: checkpoints"].status == "ok"
    assert checks["disk: checkpoints"].detail == f"50.0 GiB free at {work}"
    assert checks["disk: hugging face cache"].status == "warn"
    assert checks["disk: hugging face cache"].detail.startswith(f"5.0 GiB free at {hf} (for {hf / 'hub'}, not made yet)")
    assert "under 10 GiB" in checks["disk: hugging face cache"].detail
    free[hf] = 1 * GIB
    assert by_name(diagnose())["disk: hugging face cache"].status == "fail"


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """An empty Hugging Face cache, HF_HUB_OFFLINE, and every connection attempt recorded and refused."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def test_a_hub_id_not_in_the_cache_warns_of_the_download_without_any_network(no_network):
    model = by_name(diagnose("google/gemma-4-E2B-it"))["model"]
    assert model.status == "warn"
    assert f"the Hugging Face cache ({hub_cache_dir()}) does not hold it" in model.detail
    assert "will download it" in model.detail and "GiB with 4-bit weights" in model.detail
    assert no_network == []


def test_a_hub_id_in_the_cache_is_read_from_there(tmp_path, no_network):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-cache" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    assert main(["synth", "--preset", "tiny", "--format", "ct-emb4", "--out", str(repo / "snapshots" / commit)]) == 0
    checks = by_name(diagnose("org/tiny"))
    assert checks["model"].status == "ok"
    assert checks["model"].detail.startswith("org/tiny is in the Hugging Face cache: ct-emb4 checkpoint at")
    assert context_tokens(checks["context"]) == 4096
    assert no_network == []


def test_triton_is_optional_on_the_cpu_and_needed_where_kernels_run(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(doctor, "TRITON_VERSION", None)
    missing = doctor.check_triton(cpu)
    assert missing.status == "ok" and "not installed" in missing.detail and "torch reference ops" in missing.detail
    monkeypatch.setenv("QAT4_OPS", "triton")  # kernels asked for everywhere
    needed = doctor.check_triton(cpu)
    assert needed.status == "fail" and "cannot run" in needed.detail


def test_compute_path_names_the_settings_that_steer_it(monkeypatch):
    monkeypatch.setenv("QAT4_OPS", "reference")
    monkeypatch.setenv("QAT4_PDL", "0")
    path = doctor.check_compute_path(torch.device("cpu"))
    assert path.detail == ("cpu: fp32 activations, torch reference ops, prefill GEMM in fp32, PDL off, CUDA graphs off "
                           "(set: QAT4_OPS=reference, QAT4_PDL=0)")


def test_device_cuda_without_a_gpu_is_a_failed_check(capsys):
    status, report = run_json(capsys, "--device", "cuda")
    assert status == 1
    gpu = by_name(doctor.Check(**c) for c in report["checks"])["gpu"]
    assert gpu.status == "fail" and "--device cuda was asked for but no CUDA GPU is visible" in gpu.detail


@pytest.mark.parametrize("flags, message", [
    (["--memory-cap-mib", "-5"], "--memory-cap-mib is -5; it must be a finite positive number of MiB"),
    (["--memory-cap-mib", "inf"], "--memory-cap-mib is inf; it must be a finite positive number of MiB"),
    (["--memory-cap-mib", "1e400"], "--memory-cap-mib is inf; it must be a finite positive number of MiB"),
    (["--max-ctx", "0"], "--max-ctx is 0; it must be at least 1 token"),
])
def test_bad_flags_are_one_line(flags, message, capsys):
    assert main(["doctor", *flags]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"qat4 doctor: {message}\n"


def test_the_footprint_counts_the_16_bit_weight_copies_where_the_plan_keeps_them():
    from dataclasses import replace

    from qat4.checkpoint.synth import synthetic_model
    from qat4.config import TINY
    from qat4.engine.config import EngineConfig
    from qat4.engine.memory import plan
    from qat4.model import dense_nbytes

    shapes = synthetic_model(TINY, seed=0)
    resolved = plan(shapes, torch.device("cpu"), EngineConfig(max_ctx=64))
    assert "16-bit weight copies" not in doctor.footprint(shapes, resolved, 16)
    kept = doctor.footprint(shapes, replace(resolved, dense=True), 16)
    assert kept["16-bit weight copies"] == dense_nbytes(TINY, resolved.dtype) > 0
