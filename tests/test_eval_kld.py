"""`qat4 eval kld`: llama.cpp's logits file written and read back, the divergence of the tiny model
from itself (zero) and from a perturbed copy (positive), and the command end to end."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from eval_harness import SHARED_DATA, needs_shared_data

from qat4.checkpoint.synth import synthetic_model
from qat4.cli import main
from qat4.config import TINY
from qat4.engine import Engine
from qat4.errors import Qat4Error
from qat4.eval import kld
from qat4.eval.logits_file import LOG_PROB_RANGE, LogitsFile, LogitsWriter, decode, encode, first_scored, record_width

N_CTX = 32


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(TINY, seed=0)


@pytest.fixture(scope="module")
def engine(packed):
    return Engine.from_packed(packed, "cpu", max_ctx=N_CTX, max_num_seqs=1)


@pytest.fixture(scope="module")
def chunks():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, TINY.vocab_size, (N_CTX,), generator=g).tolist() for _ in range(2)]


def test_stored_log_probs_are_within_half_a_step_and_cut_16_below_the_top():
    logits = torch.randn(5, 1001) * 6  # an odd vocabulary is padded to an even record
    records = encode(logits)
    assert records.shape == (5, record_width(1001)) == (5, 1006) and records.dtype == np.uint16
    exact = torch.log_softmax(logits, dim=-1)
    stored = decode(records, 1001)
    kept = logits > logits.max(dim=-1, keepdim=True).values - LOG_PROB_RANGE
    step = (logits.max(dim=-1, keepdim=True).values - logits.min(dim=-1, keepdim=True).values).clamp(max=16) / 65535
    assert ((stored - exact).abs() <= step / 2 + 1e-5)[kept].all()
    assert (stored[~kept] <= -LOG_PROB_RANGE).all()
    flat = decode(encode(torch.zeros(1, 4)), 4)  # every logit equal: no scale, all log(1/4)
    assert torch.allclose(flat, torch.full((1, 4), -np.log(4.0)))


def test_a_logits_file_reads_back_as_written(tmp_path, chunks):
    path = tmp_path / "base.kld"
    logits = [torch.randn(N_CTX, 999) for _ in chunks]
    with LogitsWriter(path, N_CTX, 999, chunks) as writer:
        for one in logits:
            writer.add_chunk(one)
    positions = N_CTX - 1 - first_scored(N_CTX)
    assert path.stat().st_size == 8 + 12 + 4 * 2 * N_CTX + 2 * 2 * positions * record_width(999)
    assert path.read_bytes()[:8] == b"_logits_"
    base = LogitsFile.open(path)
    assert (base.n_ctx, base.n_vocab, base.chunks) == (N_CTX, 999, chunks)
    for i, one in enumerate(logits):
        assert torch.equal(base.log_probs(i), decode(encode(one[first_scored(N_CTX):N_CTX - 1]), 999))


def test_a_file_that_is_not_a_whole_logits_file_is_one_sentence(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(Qat4Error, match="is not a llama.cpp logits file"):
        LogitsFile.open(tmp_path / "other.bin")
    with LogitsWriter(tmp_path / "cut.kld", N_CTX, 10, [[1] * N_CTX]) as writer:
        writer.add_chunk(torch.randn(N_CTX, 10))
    (tmp_path / "cut.kld").write_bytes((tmp_path / "cut.kld").read_bytes()[:-2])
    with pytest.raises(Qat4Error, match="is not a whole llama.cpp logits file"):
        LogitsFile.open(tmp_path / "cut.kld")
    with pytest.raises(Qat4Error, match="cannot read"):
        LogitsFile.open(tmp_path / "missing.kld")


def test_the_model_against_itself_is_zero(engine, chunks):
    report = kld.run(engine.logits, chunks, TINY.bos_token_id, kld.reference_of(engine.logits), "itself")
    assert report.positions == 2 * (N_CTX - 1 - first_scored(N_CTX))
    assert report.mean_kld == pytest.approx(0, abs=1e-9) and report.kld_p99 == pytest.approx(0, abs=1e-9)
    assert report.same_top == 1.0 and report.ppl_ratio == pytest.approx(1.0)


def test_a_perturbed_copy_diverges(packed, engine, chunks):
    perturbed = copy.copy(packed)
    perturbed.tensors = dict(packed.tensors)
    name = next(n for n, t in packed.tensors.items() if n.endswith("norm") and isinstance(t, torch.Tensor))
    weight = packed.tensors[name]
    perturbed.tensors[name] = weight + (0.5 * torch.randn_like(weight.float())).to(weight.dtype)
    other = Engine.from_packed(perturbed, "cpu", max_ctx=N_CTX, max_num_seqs=1)
    report = kld.run(other.logits, chunks, TINY.bos_token_id, kld.reference_of(engine.logits), "original")
    assert report.mean_kld > 1e-4 and report.ppl_ratio != pytest.approx(1.0)
    alone = kld.run(other.logits, chunks, TINY.bos_token_id)
    assert alone.mean_kld is None and alone.perplexity == pytest.approx(report.perplexity)


@needs_shared_data
def test_kld_command_round_trips_its_own_logits_file_and_matches_transformers(tmp_path, capsys):
    common = ["eval", "kld", "--model", "synthetic:tiny", "--device", "cpu", "--data", str(SHARED_DATA)]
    base = tmp_path / "qat4.kld"
    assert main([*common, "--chunks", "2", "--ctx", str(N_CTX), "--save-logits", str(base),
                 "--reference", "hf", "--reference-dtype", "fp32", "--json", str(tmp_path / "hf.json")]) == 0
    against_hf = json.loads((tmp_path / "hf.json").read_text())
    assert against_hf["chunks"] == 2 and against_hf["mean_kld"] < 1e-6 and against_hf["same_top"] == 1.0
    assert "Mean KLD:" in capsys.readouterr().out
    assert LogitsFile.open(base).chunks[0][0] == TINY.bos_token_id  # the text's first chunk starts with BOS
    assert main([*common, "--reference", str(base), "--json", str(tmp_path / "file.json")]) == 0
    against_file = json.loads((tmp_path / "file.json").read_text())
    assert against_file["positions"] == against_hf["positions"] and against_file["mean_kld"] < 1e-6
    assert against_file["same_top"] == 1.0 and against_file["perplexity"] == pytest.approx(against_hf["perplexity"])
    assert against_file["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
