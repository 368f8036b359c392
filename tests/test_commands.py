"""What every model-loading command checks before it loads anything: a one-line error, exit 1."""

from __future__ import annotations

import pytest
import torch

from qat4.cli import main

MISSING_MODEL = "no-such-checkpoint-folder"  # were the model read first, its error would come instead


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["serve"],
    ["bench"],
])
def test_cuda_without_a_gpu_is_one_line(command, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*command, "--model", MISSING_MODEL, "--device", "cuda"]) == 1
    assert "--device cuda was asked for but no CUDA GPU is visible; use --device cpu" in _one_line_error(capsys)


@pytest.mark.parametrize("max_new", ["0", "-1"])
def test_generate_refuses_max_new_below_one_before_loading(max_new, capsys):
    assert main(["generate", "--model", MISSING_MODEL, "--prompt", "hi", "--max-new", max_new, "--device", "cpu"]) == 1
    assert f"--max-new is {max_new}; it must be at least 1" in _one_line_error(capsys)


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "eagle"], "--speculative 'eagle' is not known; the choices are: ngram, mtp:PATH|ID"),
    (["--spec-tokens", "3"], "--spec-tokens sets how many drafts speculative decoding verifies; it needs --speculative"),
    (["--speculative", "ngram", "--spec-tokens", "9"], "--spec-tokens is 9; it must be 1 to 8"),
])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_speculative_flags_are_checked_before_loading(command, flags, message, capsys):
    assert main([*command, "--model", MISSING_MODEL, "--device", "cpu", *flags]) == 1
    assert message in _one_line_error(capsys)
