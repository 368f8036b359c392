"""Synthetic checkpoints: values exactly on the grid, deterministic per (seed, name), and the
`qat4 synth` command with its one-line errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import tokenizers
import torch

from qat4.checkpoint.loader import load_packed
from qat4.checkpoint.packing import PackedTensor, recover_grid
from qat4.checkpoint.synth import (
    GENERATION_CONFIG,
    LINEAR_STEP_EXPONENTS,
    TABLE_STEP_EXPONENTS,
    synthetic_aux,
    synthetic_packed,
    synthetic_tensors,
    tensor_generator,
    write_synthetic,
)
from qat4.config import TINY
from vocab_fixtures import CANONICAL_TEMPLATE_SHA256, official_vectors, sha256_of


def qat4_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qat4.cli", *args], capture_output=True, text=True, cwd=cwd)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("qat4 synth: ")
    for needle in needles:
        assert needle in lines[0]


def assert_holds(model, tensors) -> None:
    """Every tensor of `model` equals `tensors`: codes, steps as fp32 values, dense values."""
    assert model.tensors.keys() == tensors.keys()
    for name, want in tensors.items():
        got = model.tensors[name]
        if isinstance(want, PackedTensor):
            assert torch.equal(got.packed, want.packed) and torch.equal(got.scales.float(), want.scales.float()), name
        else:
            assert torch.equal(got.float(), want.float()), name


@pytest.fixture(scope="module")
def tiny():
    return dict(synthetic_tensors(TINY, seed=3))


def test_deterministic_per_seed_and_name(tiny):
    again = dict(synthetic_tensors(TINY, seed=3))
    other = dict(synthetic_tensors(TINY, seed=4))
    for name, t in tiny.items():
        if isinstance(t, PackedTensor):
            assert torch.equal(t.packed, again[name].packed) and torch.equal(t.scales, again[name].scales)
            assert not torch.equal(t.packed, other[name].packed)
        else:
            assert torch.equal(t, again[name]) and not torch.equal(t, other[name])
    alone = synthetic_packed(128, 128, LINEAR_STEP_EXPONENTS, tensor_generator(3, "layers.2.mlp.up_proj"))
    assert torch.equal(alone.packed, tiny["layers.2.mlp.up_proj"].packed)


def test_matrices_are_on_the_grid_with_realistic_steps(tiny):
    for name, t in tiny.items():
        if not isinstance(t, PackedTensor):
            continue
        head = PackedTensor(t.packed[:2048], t.scales[:2048])  # the tables' first rows are enough
        levels = head.levels().reshape(head.rows, -1, 32)
        assert set(levels[..., 0].unique().tolist()) == {-1, 1}, name  # makes recovery unique
        assert levels.min() >= -8 and levels.max() <= 7
        steps = t.scales.float()
        lo, hi = TABLE_STEP_EXPONENTS if name.startswith("embed_tokens") else LINEAR_STEP_EXPONENTS
        assert steps.min() >= 2.0**lo and steps.max() < 2.0 ** (hi + 1), name
        mantissa = steps / torch.exp2(torch.floor(torch.log2(steps))) * 8  # 8..15: four significant bits
        assert torch.equal(mantissa, mantissa.round()), name
        assert steps.to(torch.bfloat16).float().equal(steps)
    std = tiny["layers.0.mlp.down_proj"].dequantize().std().item()
    assert 0.02 < std < 0.05


def test_norms_and_scalars_are_random(tiny):
    scalars = torch.cat([t.float() for n, t in tiny.items() if n.endswith("layer_scalar")])
    assert scalars.min() >= 0.02 and scalars.max() <= 0.8 and scalars.unique().numel() == TINY.num_hidden_layers
    norms = {n: t for n, t in tiny.items() if not isinstance(t, PackedTensor) and not n.endswith("layer_scalar")}
    assert "per_layer_projection_norm" in norms and "layers.0.self_attn.k_norm" in norms
    for name, t in norms.items():
        assert t.dtype == torch.bfloat16 and t.float().std() > 0.1, name
    means = torch.tensor([t.float().mean() for t in norms.values()])
    assert means.std() > 0.1  # a mean of its own per tensor


def test_dense_values_recover_to_the_same_levels_and_steps(tiny):
    t = tiny["layers.4.self_attn.q_proj"]
    got, report = recover_grid(t.dequantize(torch.bfloat16), "q_proj")
    assert torch.equal(got.packed, t.packed) and torch.equal(got.scales.float(), t.scales.float())
    assert report.exact == report.elements


def test_shipped_tokenizer_encodes_the_reference_strings():
    data = resources.files("qat4") / "data" / "tokenizer.json.gz"
    tok = tokenizers.Tokenizer.from_str(gzip.decompress(data.read_bytes()).decode())
    assert tok.get_vocab_size() == 262_144
    for text, ids in official_vectors():
        assert tok.encode(text, add_special_tokens=False).ids == ids, repr(text)


def test_synthetic_aux():
    aux = synthetic_aux()
    assert sha256_of(aux.chat_template) == CANONICAL_TEMPLATE_SHA256
    assert aux.generation_config == GENERATION_CONFIG
    assert json.loads(aux.extra["tokenizer_config.json"])["bos_token"] == "<bos>"


# ---- the command -------------------------------------------------------------------------------------


def test_synth_command_writes_a_loadable_checkpoint(tmp_path, tiny):
    out = tmp_path / "tiny-emb4"
    result = qat4_cli("synth", "--preset", "tiny", "--format", "ct-emb4", "--out", str(out), "--seed", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    assert_holds(load_packed(out), tiny)
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION_CONFIG
    assert (out / "tokenizer.json").stat().st_size > 10_000_000

    refused = qat4_cli("synth", "--format", "ct-emb4", "--out", str(out), cwd=tmp_path)
    assert_one_line_error(refused, str(out), "--force")
    replaced = qat4_cli("synth", "--format", "ct-emb4", "--out", str(out), "--seed", "4", "--force", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert not torch.equal(load_packed(out).tensors["norm"], tiny["norm"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-emb4"]  # no partial folders left


def test_gguf_holds_the_same_levels_and_steps(tmp_path, tiny):
    out = write_synthetic(tmp_path / "tiny.gguf", TINY, "gguf", seed=3)
    model = load_packed(out)
    assert model.config == TINY
    assert_holds(model, tiny)


def test_synth_command_errors(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert_one_line_error(qat4_cli("synth", "--format", "ct", "--out", str(blocker / "sub"), cwd=tmp_path), str(blocker / "sub"))
    assert_one_line_error(qat4_cli("synth", "--format", "gguf", "--out", str(tmp_path / "m.bin"), cwd=tmp_path), ".gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
