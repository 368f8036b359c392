"""`qat4 repack` and `qat4 verify`: round trips between every format keep every code and step; a
failed, off-grid or interrupted run leaves nothing behind; the CLI speaks in one-line errors."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_fixtures import SMALL, write_small
from qat4.checkpoint.gguf import writer as gguf_writer
from qat4.checkpoint import repack as repack_module
from qat4.checkpoint.loader import open_checkpoint
from qat4.checkpoint import packing
from qat4.checkpoint.packed_model import expected_tensors
from qat4.checkpoint.packing import PackedTensor
from qat4.checkpoint.repack import repack
from qat4.checkpoint.safetensors_io import SafetensorsWriter
from qat4.checkpoint.synth import synthetic_tensors
from qat4.checkpoint.verify import Comparison, compare
from qat4.cli import main
from qat4.errors import Qat4Error

OUT_NAME = {"ct": "ct", "ct-emb4": "emb4", "gguf": "model.gguf"}
BF16_UP = "model.language_model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    """The SMALL synthetic model as Google's dense bf16 QAT checkpoint."""
    return write_small(tmp_path_factory.mktemp("src") / "bf16", "qat-bf16")


def assert_same_codes(a: Path, b: Path) -> Comparison:
    result = compare(open_checkpoint(a), open_checkpoint(b))
    assert not result.problems
    assert result.total.int4_codes_disagreeing == 0 and result.total.int4_codes > 2_000_000
    assert result.total.elements_differing == 0  # synthetic steps are exact in bf16 and fp16 alike
    return result


def leftovers(folder: Path, *keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_round_trips_between_all_formats_keep_every_code(bf16, tmp_path):
    chain = [("qat-bf16", "ct"), ("ct", "ct-emb4"), ("ct-emb4", "gguf"), ("gguf", "ct"), ("ct", "gguf"),
             ("gguf", "ct-emb4"), ("ct-emb4", "ct")]
    src = bf16
    for step, (fmt, to) in enumerate(chain):
        out = tmp_path / f"{step}-{OUT_NAME[to]}"
        result = repack(src, out, to)
        assert result.out == out and result.bytes > 0
        assert result.tensors == (164 if to == "ct-emb4" else 163)  # emb4 holds an lm_head copy
        written = open_checkpoint(out)
        assert open_checkpoint(src).format == fmt and written.format == to
        assert assert_same_codes(bf16, out).total.tensors == result.tensors  # verify counts what repack wrote
        src = out
    emb4 = open_checkpoint(tmp_path / "1-emb4")
    assert "lm_head" in emb4.names() and emb4.config.tie_word_embeddings is False
    assert leftovers(tmp_path) == sorted(f"{i}-{OUT_NAME[to]}" for i, (_, to) in enumerate(chain))


def test_qat_bf16_straight_to_gguf_and_emb4(bf16, tmp_path):
    for to in ("gguf", "ct-emb4"):
        repack(bf16, tmp_path / OUT_NAME[to], to)
        assert_same_codes(bf16, tmp_path / OUT_NAME[to])


def test_large_matrices_stream_in_row_blocks_and_keep_every_code(bf16, tmp_path, monkeypatch):
    """With the threshold at 0 every matrix of every reader comes as PackedBlocks of a few rows
    (16-bit recovery, packed safetensors rows, Q4_0 rows) into every writer (packed, dense, Q4_0)."""
    monkeypatch.setattr(packing, "STREAM_BYTES", 0)
    monkeypatch.setattr(packing, "_BLOCK_BYTES", 4096)
    made = []
    init = packing.PackedBlocks.__init__
    monkeypatch.setattr(packing.PackedBlocks, "__init__", lambda self, *a: made.append(a[0]) or init(self, *a))
    matrices = sum(spec.packed for spec in expected_tensors(SMALL).values())
    src = bf16
    for step, to in enumerate(["ct-emb4", "gguf", "ct", "gguf"]):
        out = tmp_path / f"{step}-{OUT_NAME[to]}"
        made.clear()
        repack(src, out, to)
        assert len(made) >= matrices  # the reader handed over every matrix in blocks
        assert_same_codes(bf16, out)
        src = out


def test_off_grid_group_in_a_streamed_matrix_names_its_row(bf16, tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "STREAM_BYTES", 0)
    monkeypatch.setattr(packing, "_BLOCK_BYTES", 4096)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bf16.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    rows = tensors[BF16_UP].shape[0]
    tensors[BF16_UP][rows - 2, 40] *= 1.37  # in the last block of rows
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Qat4Error, match=rf"layers\.1\.mlp\.up_proj.* row {rows - 2}, group 1"):
        repack(broken, tmp_path / "out.gguf", "gguf")
    assert leftovers(tmp_path) == ["broken"]


def test_aux_files_travel(bf16, tmp_path):
    gguf = repack(bf16, tmp_path / "m.gguf", "gguf").out
    back = repack(gguf, tmp_path / "ct", "ct").out
    original, final = open_checkpoint(bf16).aux(), open_checkpoint(back).aux()
    assert final.chat_template == original.chat_template
    assert final.generation_config == original.generation_config
    assert json.loads(final.tokenizer_json)["model"]["vocab"] == json.loads(original.tokenizer_json)["model"]["vocab"]


def test_off_grid_source_aborts_naming_tensor_and_group_and_leaves_nothing(bf16, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bf16.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    tensors[BF16_UP][3, 40] *= 1.37  # row 3, group 1 leaves the 4-bit grid
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Qat4Error, match=r"layers\.1\.mlp\.up_proj.* row 3, group 1"):
        repack(broken, tmp_path / "out", "ct")
    assert leftovers(tmp_path) == ["broken"]


@pytest.mark.parametrize("to", ["ct", "gguf"])
@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_write_leaves_no_output_and_no_temporary_folder(bf16, tmp_path, monkeypatch, to, failure):
    calls = []

    def fail_after_five(original):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) > 5:
                raise failure("injected")
            return original(*args, **kwargs)
        return wrapper

    if to == "ct":
        monkeypatch.setattr(SafetensorsWriter, "write", fail_after_five(SafetensorsWriter.write))
    else:
        monkeypatch.setattr(gguf_writer, "_write_at", fail_after_five(gguf_writer._write_at))
    with pytest.raises(failure):
        repack(bf16, tmp_path / OUT_NAME[to], to)
    assert len(calls) == 6
    assert leftovers(tmp_path) == []


def test_output_that_does_not_read_back_equal_is_never_moved_into_place(bf16, tmp_path, monkeypatch):
    real_write_ct = repack_module.write_ct

    def write_then_corrupt(out_dir, *args, **kwargs):
        real_write_ct(out_dir, *args, **kwargs)
        tensors = load_file(Path(out_dir) / "model.safetensors")
        tensors["model.language_model.norm.weight"] += 1
        save_file(tensors, Path(out_dir) / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(repack_module, "write_ct", write_then_corrupt)
    with pytest.raises(Qat4Error, match="tensor norm of the written .* does not read back equal"):
        repack(bf16, tmp_path / "ct", "ct")
    assert leftovers(tmp_path) == []


def test_steps_the_output_cannot_hold_are_refused(tmp_path):
    tensors = dict(synthetic_tensors(SMALL, 0))
    up = tensors["layers.2.mlp.up_proj"]
    scales = up.scales.clone()
    scales[5, 3] = 0.0078125 * (1 + 2**-10)  # exact in fp16, not in bf16
    tensors["layers.2.mlp.up_proj"] = PackedTensor(up.packed, scales)
    gguf = write_small(tmp_path / "fine.gguf", "gguf", tensors=tensors)
    with pytest.raises(Qat4Error, match=r"layers\.2\.mlp\.up_proj .* row 5, group 3, which bfloat16 cannot hold .* --scale-dtype fp16"):
        repack(gguf, tmp_path / "ct-bf16", "ct", scale_dtype=torch.bfloat16)
    # The default keeps fp16 steps, also when the next repack starts from that ct folder.
    repack(repack(gguf, tmp_path / "ct", "ct").out, tmp_path / "emb4", "ct-emb4")
    assert open_checkpoint(tmp_path / "emb4").read("layers.2.mlp.up_proj").scales[5, 3].item() == scales[5, 3].item()
    assert leftovers(tmp_path) == ["ct", "emb4", "fine.gguf"]


def test_text_only_writes_the_causal_lm_layout(bf16, tmp_path):
    kept = json.loads((repack(bf16, tmp_path / "kept", "ct").out / "config.json").read_text())
    text = json.loads((repack(bf16, tmp_path / "text", "ct", text_only=True).out / "config.json").read_text())
    assert kept["architectures"] == ["Gemma4ForConditionalGeneration"] and "text_config" in kept
    assert text["architectures"] == ["Gemma4ForCausalLM"] and text["num_hidden_layers"] == SMALL.num_hidden_layers


def test_untied_lm_head_goes_to_gguf_only(tmp_path):
    tensors = dict(synthetic_tensors(SMALL, 0))
    tensors["lm_head"] = next(synthetic_tensors(SMALL, 1))[1]
    untied = write_small(tmp_path / "untied.gguf", "gguf", tensors=tensors)
    with pytest.raises(Qat4Error, match="lm_head that differs from embed_tokens; ct-emb4 ties them"):
        repack(untied, tmp_path / "emb4", "ct-emb4")
    repack(untied, tmp_path / "again.gguf", "gguf")
    assert compare(open_checkpoint(untied), open_checkpoint(tmp_path / "again.gguf")).identical_codes


# ---- command line --------------------------------------------------------------------------------


def test_cli_repack_reports_progress_and_result(bf16, tmp_path, capsys):
    assert main(["repack", str(bf16), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 0
    captured = capsys.readouterr()
    assert "tensor 163/163" in captured.err and "GB written" in captured.err
    assert captured.out.startswith(f"wrote {tmp_path / 'm.gguf'}: gguf, 163 tensors")
    assert "peak RSS" in captured.out and "100.00% of" in captured.out


@pytest.mark.parametrize("to", ["ct-emb4", "gguf"])
def test_cli_terminated_mid_write_leaves_nothing(bf16, tmp_path, monkeypatch, capsys, to):
    """SIGTERM (a killed job, a closed terminal) unwinds like Ctrl-C: no output, no temporary folder."""
    from qat4.commands.progress import ProgressLine

    update, calls = ProgressLine.update, []

    def update_then_terminate(self, text):
        calls.append(text)
        if len(calls) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        update(self, text)

    monkeypatch.setattr(ProgressLine, "update", update_then_terminate)
    out_root = tmp_path / "out"
    out_root.mkdir()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["repack", str(bf16), str(out_root / OUT_NAME[to]), "--to", to]) == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.endswith("qat4 repack: interrupted\n")
    assert len(calls) >= 20 and leftovers(out_root) == []


def test_cli_refuses_an_existing_output_without_force(bf16, tmp_path, capsys):
    out = tmp_path / "ct"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    assert main(["repack", str(bf16), str(out), "--to", "ct"]) == 1
    err = capsys.readouterr().err
    assert err == f"qat4 repack: {out} already exists; pass --force to replace it\n"
    assert (out / "old.txt").read_text() == "keep me"
    assert main(["repack", str(bf16), str(out), "--to", "ct", "--force"]) == 0
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
    assert leftovers(tmp_path) == ["ct"]


def test_cli_errors_are_one_line(bf16, tmp_path, capsys):
    assert main(["repack", str(tmp_path / "missing"), str(tmp_path / "x"), "--to", "ct"]) == 1
    assert main(["repack", str(bf16), str(tmp_path / "x.bin"), "--to", "gguf"]) == 1
    assert main(["repack", str(bf16), str(tmp_path / "x.gguf"), "--to", "gguf", "--scale-dtype", "bf16"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("qat4 repack: ") for line in err)
    assert "Traceback" not in "".join(err)


def test_cli_verify_exit_codes_and_json(bf16, tmp_path, capsys):
    same = repack(bf16, tmp_path / "m.gguf", "gguf").out
    other = write_small(tmp_path / "other.gguf", "gguf", seed=1)
    assert main(["verify", str(bf16), str(same)]) == 0
    table = capsys.readouterr().out
    assert table.endswith("\nidentical int4 codes\n") and "embed_tokens_per_layer" in table and "total" in table
    assert main(["verify", str(same), str(other), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["identical_codes"] is False
    assert report["total"]["int4_codes_disagreeing"] > 0 and report["groups"]["mlp"]["worst_diff_steps"] > 0
    assert report["groups"]["norms and scalars"]["elements_differing"] > 0


def test_cli_verify_counts_recovered_values_and_missing_tensors(bf16, tmp_path, capsys):
    emb4 = repack(bf16, tmp_path / "emb4", "ct-emb4").out
    assert main(["verify", str(bf16), str(emb4)]) == 0  # the same codes; emb4 unties the output layer
    *_, note, verdict = capsys.readouterr().out.splitlines()
    assert note == "config field tie_word_embeddings differs: True in A, False in B"
    assert verdict == "identical int4 codes, but the configs differ (1 field, above)"
    assert main(["verify", str(bf16), str(emb4), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["groups"]["embed_tokens"]["exact_share_a"] == 1.0 and report["groups"]["embed_tokens"]["exact_share_b"] is None
    assert report["groups"]["lm_head"]["int4_codes_disagreeing"] == 0
    shared = tmp_path / "pruned"
    shared.mkdir()
    for f in emb4.iterdir():
        (shared / f.name).write_bytes(f.read_bytes())
    tensors = load_file(shared / "model.safetensors")
    del tensors["model.language_model.layers.3.post_attention_layernorm.weight"]
    save_file(tensors, shared / "model.safetensors", metadata={"format": "pt"})
    assert main(["verify", str(emb4), str(shared)]) == 1
    assert "tensor layers.3.post_attention_layernorm is only in A" in capsys.readouterr().out


def test_cli_help_states_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "Exit status: 0 when every int4 code is identical" in " ".join(capsys.readouterr().out.split())
