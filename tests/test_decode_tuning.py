"""Decode GEMV tilings chosen by whole-step time: the descent, the saved table, and pinning.

Timing whole steps needs CUDA graphs; here the descent runs on a made-up cost and pinning is checked
on the GEMV itself (under the Triton interpreter through test_ops_w4's subprocess, or on CUDA).
"""

import json

import pytest
import torch

from qat4.engine import tuning as dt

A, B = ("a",), ("b",)


def tiling(split):
    return {"RR": 8, "TR": 2, "BLOCK_G": 16, "SPLIT_K": split}


def test_descent_keeps_only_clear_gains_one_shape_at_a_time():
    cost = {A: {1: 50.0, 2: 40.0, 3: 39.9}, B: {1: 30.0, 2: 29.9, 4: 10.0}}
    calls = []

    def measure(tilings):
        calls.append(tilings)
        return sum(cost[key][t["SPLIT_K"]] for key, t in tilings.items())

    start = {A: tiling(1), B: tiling(1)}
    best, value, first = dt.descend(start, {A: [tiling(1), tiling(2), tiling(3)], B: [tiling(2), tiling(4)]}, measure)
    # A: 2 wins (80 -> 70); 3 is not 1 % better than 2. B: 2 is no clear gain, 4 wins (70 -> 50).
    assert best == {A: tiling(2), B: tiling(4)} and value == 50.0 and first == 80.0
    assert len(calls) == 5  # the start, then each candidate that differs from the current tiling once
    assert start == {A: tiling(1), B: tiling(1)}


def test_saved_tilings_are_kept_per_machine_and_survive_a_bad_file(tmp_path):
    path = tmp_path / "sub" / "tilings.json"
    cpu = torch.device("cpu")
    table = {(1536, 48, 1, 0, True, "bfloat16"): tiling(6), (2560, 48, 1, 0, False, "bfloat16"): tiling(1)}
    assert dt.save_tilings(table, cpu, torch.bfloat16, path) == path
    dt.save_tilings({A: tiling(2)}, cpu, torch.float16, path)
    assert dt.load_tilings(cpu, torch.bfloat16, path) == table
    assert dt.load_tilings(cpu, torch.float16, path) == {A: tiling(2)}
    assert len(json.loads(path.read_text())) == 2
    assert dt.load_tilings(cpu, torch.float32, path) == {}
    path.write_text("{not json")
    assert dt.load_tilings(cpu, torch.bfloat16, path) == {}
    assert not path.with_suffix(".tmp").exists()


def test_tilings_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("QAT4_TILINGS", str(tmp_path / "t.json"))
    assert dt.tilings_path() == tmp_path / "t.json"


def test_a_machine_without_tilings_of_its_own_takes_the_shipped_ones(monkeypatch, tmp_path):
    cpu, own, shipped = torch.device("cpu"), tmp_path / "own.json", tmp_path / "shipped.json"
    dt.save_tilings({A: tiling(3)}, cpu, torch.bfloat16, shipped)
    monkeypatch.setattr(dt, "SHIPPED_TILINGS", shipped)
    monkeypatch.setenv("QAT4_TILINGS", str(own))
    assert dt.tilings_for(cpu, torch.bfloat16) == ({A: tiling(3)}, (shipped,))
    assert dt.tilings_for(cpu, torch.float16) == ({}, ())  # none shipped for this dtype: the autotuner's
    dt.save_tilings({A: tiling(1), B: tiling(2)}, cpu, torch.bfloat16)  # once the machine tunes, its own win
    assert dt.tilings_for(cpu, torch.bfloat16) == ({A: tiling(1), B: tiling(2)}, (own, shipped))
    dt.save_tilings({B: tiling(2)}, cpu, torch.bfloat16)  # shapes of another model: the shipped ones stay
    assert dt.tilings_for(cpu, torch.bfloat16) == ({A: tiling(3), B: tiling(2)}, (own, shipped))
    note = dt.pinned_tilings_note(2, 2, (own, shipped))
    assert note == f"decode GEMV tilings: 2 of 2 shapes pinned from {own} and {shipped}"


def test_the_shipped_tilings_cover_the_decode_step_of_e2b_on_an_h200():
    """Every GEMV shape of a one-row E2B decode step (13), as `qat4 bench --tune` saved them."""
    h200 = json.loads(dt.SHIPPED_TILINGS.read_text())["NVIDIA H200 | bfloat16 | triton 3.6.0"]
    rows_groups = {tuple(json.loads(key))[:2] for key in h200}  # (N, K / 32) of each W
    assert rows_groups == {(2560, 48), (2048, 48), (4096, 48), (5120, 48), (12288, 48), (24576, 48), (256, 48),
                           (8960, 48), (1536, 8), (1536, 64), (1536, 128), (1536, 192), (1536, 384)}
    assert all(set(t) == {"RR", "TR", "BLOCK_G", "SPLIT_K"} for t in h200.values())


def test_tuning_refuses_an_engine_without_graphs(tmp_path):
    from qat4.checkpoint.synth import write_synthetic
    from qat4.config import TINY
    from qat4.engine import Engine
    from qat4.errors import Qat4Error

    engine = Engine.load(write_synthetic(tmp_path / "ckpt", TINY, "ct-emb4", seed=1), max_ctx=64)
    with pytest.raises(Qat4Error, match="CUDA"):
        engine.tune_decode()


def test_describe_tilings_lists_each_shape_once_in_order():
    lines = dt.describe_tilings({(2560, 48, 1, 0, False, "bfloat16"): tiling(1), (1536, 48, 1, 0, True, "bfloat16"): tiling(6)})
    assert lines[0].startswith("(N, K/32") and len(lines) == 3
    assert lines[1] == f"(1536, 48, 1, 0, True, 'bfloat16') -> {tuple(tiling(6)[k] for k in ('RR', 'TR', 'BLOCK_G', 'SPLIT_K'))}"
    assert lines[2].startswith("(2560, 48, 1, 0, False, 'bfloat16') -> ")


def test_pinned_tilings_note_counts_the_pinned_shapes_and_says_what_to_do_about_the_rest(monkeypatch, tmp_path):
    monkeypatch.setenv("QAT4_TILINGS", str(tmp_path / "t.json"))
    assert dt.pinned_tilings_note(13, 13) == f"decode GEMV tilings: 13 of 13 shapes pinned from {tmp_path / 't.json'}"
    stale = dt.pinned_tilings_note(0, 13)
    assert stale.startswith("decode GEMV tilings: 0 of 13 shapes pinned") and "qat4 bench --tune" in stale
