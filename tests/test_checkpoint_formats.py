"""Checkpoint formats: compressed-tensors (-ct-text, -emb4, multimodal), Google's bf16 QAT layout,
sharded safetensors, the three config spellings, and one-sentence errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma4TextConfig

from checkpoint_fixtures import SMALL, small_aux
from qat4.checkpoint.compressed_tensors import CompressedTensorsSource, write_ct
from qat4.checkpoint.loader import detect_format, load_packed, open_checkpoint, read_packed
from qat4.checkpoint.packing import PackedTensor
from qat4.checkpoint.qat_bf16 import QatBf16Source, write_qat_bf16
from qat4.checkpoint.safetensors_io import INDEX_FILE, SafetensorsReader
from qat4.checkpoint.source import AuxFiles
from qat4.checkpoint.synth import GENERATION_CONFIG, synthetic_aux, synthetic_model, synthetic_tensors
from qat4.config import TINY, Gemma4Config
from qat4.errors import Qat4Error

SEED = 7
P = "model.language_model."
GROUP_0 = {
    "targets": ["Linear"],
    "format": "pack-quantized",
    "input_activations": None,
    "output_activations": None,
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {}},
}
CT_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": GROUP_0},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
}
EMB4_QUANTIZATION = {
    **CT_QUANTIZATION,
    "config_groups": {
        "group_0": GROUP_0,
        "group_embed_tokens_per_layer": {**GROUP_0, "targets": ["re:.*\\.embed_tokens_per_layer$"]},
        "group_embed_tokens": {**GROUP_0, "targets": ["re:.*\\.embed_tokens$"]},
        "group_lm_head": {**GROUP_0, "targets": ["re:^lm_head$"]},
    },
    "ignore": [],
}
TOWERS = {
    "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight": torch.randn(64, 48).to(torch.bfloat16),
    "model.vision_tower.encoder.layers.0.input_layernorm.weight": torch.randn(48).to(torch.bfloat16),
    "model.audio_tower.layers.0.self_attn.k_proj.weight": torch.randn(16, 40).to(torch.bfloat16),
    "model.audio_tower.layers.1.mlp.gate_proj.weight_packed": torch.zeros(8, 4, dtype=torch.int32),
    "model.embed_vision.embedding_projection.weight": torch.randn(128, 48).to(torch.bfloat16),
}


# ---- fixtures: two synthetic models, each written once per format -----------------------------------


def write_formats(root, config: Gemma4Config, aux: AuxFiles) -> dict:
    """ct, ct-emb4 and qat-bf16 folders under `root` of `config`'s synthetic model (seed SEED); the
    bf16 one (Google's multimodal layout) also holds fake vision/audio tower tensors."""
    write_ct(root / "ct", config, synthetic_tensors(config, SEED), aux, emb4=False)
    write_ct(root / "ct-emb4", config, synthetic_tensors(config, SEED), aux, emb4=True)
    write_qat_bf16(root / "qat-bf16", config, synthetic_tensors(config, SEED), aux)
    save_file(TOWERS, root / "qat-bf16" / "towers.safetensors")
    return {fmt: root / fmt for fmt in ("ct", "ct-emb4", "qat-bf16")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The three formats of the tiny preset with the real vocabulary and tokenizer: the published
    layouts, and the folders the bad-input tests break."""
    return write_formats(tmp_path_factory.mktemp("formats"), TINY, synthetic_aux())


@pytest.fixture(scope="module")
def small_folders(tmp_path_factory):
    """The three formats of SMALL (a 1,024-token vocabulary), which the tests read back whole:
    recovering the real vocabulary's 16-bit tables onto the grid takes seconds a format."""
    return write_formats(tmp_path_factory.mktemp("small-formats"), SMALL, small_aux())


@pytest.fixture(scope="module")
def reference():
    return synthetic_model(SMALL, SEED)


@pytest.fixture(scope="module")
def sources(small_folders):
    return {fmt: open_checkpoint(path) for fmt, path in small_folders.items()}


@pytest.fixture(scope="module")
def loaded(sources):
    """Each format read once (recovering 16-bit matrices onto the grid is the slow part)."""
    return {fmt: read_packed(source) for fmt, source in sources.items()}


def assert_same_model(got, want):
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if isinstance(w, PackedTensor):
            assert isinstance(g, PackedTensor), name
            assert torch.equal(g.packed, w.packed), name
            assert torch.equal(g.scales.float(), w.scales.float()), name
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), name


def copy_folder(src, dst):
    """A writable copy whose large files are hard links (rewrite, never modify, a linked file)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def rewrite_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.unlink()
    path.write_text(json.dumps(data))


def rewrite_tensors(folder, change):
    """Replace model.safetensors by `change(dict of its tensors)`."""
    path = folder / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    change(tensors)
    path.unlink()
    save_file(tensors, path)


def error_of(call) -> str:
    with pytest.raises(Qat4Error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ---- every format holds the same model --------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["ct", "ct-emb4", "qat-bf16"])
def test_format_loads_the_same_levels_and_steps(fmt, small_folders, loaded, reference):
    model = loaded[fmt]
    assert detect_format(small_folders[fmt]) == fmt
    assert model.config == SMALL.replace(tie_word_embeddings=fmt != "ct-emb4")
    assert_same_model(model.tensors, reference.tensors)
    assert model.lm_head is None  # emb4's untied copy is identical, so one matrix serves both
    assert model.generation_config == GENERATION_CONFIG
    assert model.source == small_folders[fmt]


def test_every_format_gives_identical_logits(loaded, reference, tmp_path):
    """The same synthetic weights saved as ct, ct-emb4, bf16 QAT and Q4_0 GGUF: bit-identical logits."""
    from qat4.checkpoint.gguf.writer import write_gguf
    from qat4.engine import Engine

    gguf = tmp_path / "small.gguf"
    write_gguf(gguf, SMALL, synthetic_tensors(SMALL, SEED), small_aux())
    models = {**loaded, "gguf": load_packed(gguf)}
    ids = [2, 651, 437, 1007, 764, 3, 42, 107, 259, 902, 108, 106]
    logits = {fmt: Engine.from_packed(model).logits(ids) for fmt, model in models.items()}
    first = logits.pop("ct")
    assert first.shape == (len(ids), SMALL.vocab_size) and torch.isfinite(first).all()
    for fmt, got in logits.items():
        assert torch.equal(got, first), fmt


def test_grid_reports_cover_every_recovered_matrix(sources, loaded):
    for fmt in ("ct", "qat-bf16"):
        reports = sources[fmt].grid_reports()
        recovered = [n for n in loaded[fmt].tensors if not sources[fmt].is_packed(n) and isinstance(loaded[fmt][n], PackedTensor)]
        assert sorted(reports) == sorted(recovered)
        for name in recovered:
            t = loaded[fmt][name]
            assert reports[name].name.endswith(name + ".weight")
            assert reports[name].elements == reports[name].exact == t.rows * t.cols and reports[name].worst_ulp_steps == 0
    assert sorted(sources["ct"].grid_reports()) == ["embed_tokens", "embed_tokens_per_layer"]
    assert sources["ct-emb4"].grid_reports() == {}


def test_towers_are_skipped(sources):
    source = sources["qat-bf16"]
    assert isinstance(source, QatBf16Source) and source.prefix == P
    assert not any("tower" in name or "vision" in name for name in source.names())
    assert "layers.0.self_attn.q_proj" in source.names()


def test_aux_files_travel(folders):
    aux = open_checkpoint(folders["ct-emb4"]).aux()
    shipped = synthetic_aux()
    assert aux.tokenizer_json == shipped.tokenizer_json
    assert aux.chat_template == shipped.chat_template
    assert aux.generation_config == GENERATION_CONFIG
    assert aux.extra["tokenizer_config.json"] == shipped.extra["tokenizer_config.json"]


# ---- the published layouts ---------------------------------------------------------------------------


def test_ct_text_layout(folders):
    config = json.loads((folders["ct"] / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"] and config["model_type"] == "gemma4_text"
    assert config["quantization_config"] == CT_QUANTIZATION
    assert config["tie_word_embeddings"] is True and config["global_head_dim"] == 64
    files = SafetensorsReader(folders["ct"])
    q = P + "layers.0.self_attn.q_proj."
    assert (files.dtype(q + "weight_packed"), files.shape(q + "weight_packed")) == ("I32", [256, 16])
    assert (files.dtype(q + "weight_scale"), files.shape(q + "weight_scale")) == ("BF16", [256, 4])
    assert files.dtype(q + "weight_shape") == "I64" and files.get(q + "weight_shape").tolist() == [256, 128]
    assert (files.dtype(P + "embed_tokens.weight"), files.shape(P + "embed_tokens.weight")) == ("BF16", [262_144, 128])
    assert files.dtype(P + "embed_tokens_per_layer.weight") == "BF16"
    assert files.dtype(P + "per_layer_model_projection.weight_packed") == "I32"
    assert P + "layers.3.layer_scalar" in files and P + "layers.3.input_layernorm.weight" in files
    assert P + "layers.6.self_attn.k_proj.weight_packed" not in files  # KV-shared layer
    assert not any(key.startswith("lm_head") for key in files.keys())
    assert sorted(p.name for p in folders["ct"].iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]


def test_emb4_layout(folders):
    config = json.loads((folders["ct-emb4"] / "config.json").read_text())
    assert config["quantization_config"] == EMB4_QUANTIZATION
    assert config["tie_word_embeddings"] is False
    files = SafetensorsReader(folders["ct-emb4"])
    e = P + "embed_tokens."
    assert (files.dtype(e + "weight_packed"), files.shape(e + "weight_packed")) == ("I32", [262_144, 16])
    assert (files.dtype(e + "weight_scale"), files.shape(e + "weight_scale")) == ("F16", [262_144, 4])
    assert files.dtype(P + "embed_tokens_per_layer.weight_scale") == "F16"
    assert files.dtype(P + "layers.0.mlp.up_proj.weight_scale") == "BF16"
    for part in ("weight_packed", "weight_scale", "weight_shape"):
        assert files.dtype("lm_head." + part) == files.dtype(e + part)
        assert torch.equal(files.get("lm_head." + part), files.get(e + part))
    assert P + "embed_tokens.weight" not in files


def test_sharded_folder_round_trip(tmp_path, reference):
    out = tmp_path / "sharded"
    write_ct(out, SMALL, reference.tensors, AuxFiles(), emb4=True, shard_bytes=1 << 20)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        sum(t.numel() * t.element_size() for t in (f.get_tensor(k) for k in f.keys()))
        for f in (safe_open(out / s, framework="pt") for s in shards))
    assert_same_model(load_packed(out).tensors, reference.tensors)


def test_multimodal_ct_with_towers(tmp_path, reference):
    out = tmp_path / "w4a16-ct"
    write_ct(out, SMALL, reference.tensors, AuxFiles(), emb4=True, text_only=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config["model_type"] == "gemma4"
    assert config["text_config"]["tie_word_embeddings"] is False and config["tie_word_embeddings"] is False
    assert any("vision_tower" in entry for entry in config["quantization_config"]["ignore"])
    save_file(TOWERS, out / "towers.safetensors")
    source = open_checkpoint(out)
    assert isinstance(source, CompressedTensorsSource) and source.format == "ct-emb4"
    assert_same_model(load_packed(out).tensors, reference.tensors)


# ---- config spellings ----------------------------------------------------------------------------------


def test_config_spellings(folders, tmp_path):
    nested = json.loads((folders["qat-bf16"] / "config.json").read_text())
    assert "text_config" in nested and nested["text_config"]["global_head_dim"] == 64
    assert Gemma4Config.from_hf_dict(nested) == TINY
    top_level = json.loads((folders["ct"] / "config.json").read_text())
    assert Gemma4Config.from_hf_dict(top_level) == TINY

    kwargs = {k: v for k, v in TINY.to_hf_text_dict().items() if k != "model_type"}
    Gemma4TextConfig(**kwargs).save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "global_head_dim" not in saved and saved["per_layer_config"]
    assert Gemma4Config.from_hf_dict(saved) == TINY
    defaults = Gemma4TextConfig().to_dict()
    diff = {k: v for k, v in saved.items() if k == "model_type" or defaults.get(k, object()) != v}
    assert "vocab_size" not in diff and "rms_norm_eps" not in diff
    assert Gemma4Config.from_hf_dict(diff) == TINY


def test_transformers_saved_config_loads(folders, tmp_path):
    out = copy_folder(folders["ct-emb4"], tmp_path / "hf-config")
    kwargs = {k: v for k, v in TINY.to_hf_text_dict().items() if k != "model_type"}
    Gemma4TextConfig(**{**kwargs, "tie_word_embeddings": False}).save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    rewrite_json(out / "config.json", lambda c: (c.clear(), c.update(saved, quantization_config=EMB4_QUANTIZATION)))
    assert load_packed(out).config == TINY.replace(tie_word_embeddings=False)


# ---- bad input: one sentence naming the file and the tensor or field -------------------------------------


def truncated_copy(folder, out):
    out.mkdir()
    shutil.copy(folder / "config.json", out)
    data = (folder / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) - 1000])
    return out


def test_truncated_file(folders, tmp_path):
    out = truncated_copy(folders["ct-emb4"], tmp_path / "truncated")
    message = error_of(lambda: load_packed(out))
    assert str(out / "model.safetensors") in message and "truncated" in message


def test_missing_tensor(folders, tmp_path):
    out = copy_folder(folders["ct-emb4"], tmp_path / "missing")
    rewrite_tensors(out, lambda t: [t.pop(P + "layers.3.mlp.up_proj." + p) for p in ("weight_packed", "weight_scale", "weight_shape")])
    message = error_of(lambda: load_packed(out))
    assert str(out) in message and "layers.3.mlp.up_proj" in message


def test_missing_packed_part(folders, tmp_path):
    out = copy_folder(folders["ct-emb4"], tmp_path / "no-scale")
    rewrite_tensors(out, lambda t: t.pop(P + "layers.2.mlp.down_proj.weight_scale"))
    message = error_of(lambda: open_checkpoint(out))
    assert "layers.2.mlp.down_proj" in message and "weight_scale" in message and "model.safetensors" in message


@pytest.mark.parametrize(
    "key, value, expect",
    [
        (P + "layers.1.mlp.gate_proj.weight_packed", torch.zeros(128, 15, dtype=torch.int32), "expected I32 [128, 16]"),
        (P + "layers.1.mlp.gate_proj.weight_packed", torch.zeros(128, 16, dtype=torch.float32), "expected I32 [128, 16]"),
        (P + "layers.1.mlp.gate_proj.weight_scale", torch.zeros(128, 3, dtype=torch.bfloat16), "expected BF16 or F16 [128, 4]"),
        (P + "layers.1.mlp.gate_proj.weight_shape", torch.tensor([128, 96]), "the config expects [128, 128]"),
        (P + "layers.1.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16), "the config expects [128]"),
    ],
)
def test_wrong_shape(folders, tmp_path, key, value, expect):
    out = copy_folder(folders["ct-emb4"], tmp_path / "shape")

    def change(tensors):
        tensors[key] = value

    rewrite_tensors(out, change)
    message = error_of(lambda: load_packed(out))
    assert key in message and str(out / "model.safetensors") in message and expect in message


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda q: q.update(format="marlin-24"), "quantization_config.format"),
        (lambda q: q.update(quant_method="gptq"), "quantization_config.quant_method"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "config_groups.group_0.weights.num_bits"),
        (lambda q: q["config_groups"]["group_lm_head"]["weights"].update(group_size=128), "group_lm_head.weights.group_size"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "group_0.weights.symmetric"),
        (lambda q: q["config_groups"]["group_0"].update(format="float-quantized"), "group_0.format"),
        (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "group_0.input_activations"),
    ],
)
def test_unknown_quantization(folders, tmp_path, change, field):
    out = copy_folder(folders["ct-emb4"], tmp_path / "quant")
    rewrite_json(out / "config.json", lambda c: change(c["quantization_config"]))
    message = error_of(lambda: load_packed(out))
    assert str(out / "config.json") in message and field in message


def test_off_grid_group(folders, tmp_path):
    out = copy_folder(folders["qat-bf16"], tmp_path / "off-grid")
    key = P + "layers.1.mlp.down_proj.weight"

    def change(tensors):
        w = tensors[key].float()
        w[5, 70] += w[5, 64:96].abs().max() * 0.3  # row 5, group 2
        tensors[key] = w.to(torch.bfloat16)

    rewrite_tensors(out, change)
    message = error_of(lambda: QatBf16Source(out).read("layers.1.mlp.down_proj"))
    assert key in message and str(out / "model.safetensors") in message and "row 5, group 2" in message


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "is not a checkpoint" in error_of(lambda: load_packed(tmp_path / "notes.txt"))
    assert "holds neither" in error_of(lambda: load_packed(tmp_path))
    assert "does not exist" in error_of(lambda: load_packed(tmp_path / "nowhere"))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.gguf").write_bytes(b"")
    assert detect_format(tmp_path / "gguf") == detect_format(tmp_path / "gguf" / "model.gguf") == "gguf"


def test_writer_rejects_incomplete_or_foreign_tensors(reference, tmp_path):
    partial = {k: v for k, v in reference.tensors.items() if k != "layers.2.mlp.up_proj"}
    assert "layers.2.mlp.up_proj" in error_of(lambda: write_ct(tmp_path / "a", SMALL, partial, AuxFiles(), emb4=True))
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())
    foreign = {"layers.99.mlp.up_proj": reference.tensors["layers.2.mlp.up_proj"], **reference.tensors}
    assert "layers.99.mlp.up_proj" in error_of(lambda: write_ct(tmp_path / "b", SMALL, foreign, AuxFiles(), emb4=True))
    wrong = {"norm": torch.ones(64, dtype=torch.bfloat16)}  # first, so the write fails at once
    wrong.update((k, v) for k, v in reference.tensors.items() if k != "norm")
    assert "tensor norm has shape [64]" in error_of(lambda: write_qat_bf16(tmp_path / "c", SMALL, wrong, AuxFiles()))
    assert not list(tmp_path.iterdir())


def test_bad_checkpoints_through_the_cli(folders, tmp_path):
    """A command that opens checkpoints exits non-zero with one line on stderr, no traceback."""
    truncated = truncated_copy(folders["ct-emb4"], tmp_path / "truncated")
    unknown = copy_folder(folders["ct-emb4"], tmp_path / "unknown")
    rewrite_json(unknown / "config.json", lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    cases = [
        (truncated, str(truncated / "model.safetensors")),
        (unknown, "quantization_config.format"),
        ("google/gemma-4-E2B-it", "HF_HUB_OFFLINE"),
    ]
    for bad, needle in cases:
        result = subprocess.run([sys.executable, "-m", "qat4.cli", "verify", str(bad), str(folders["ct-emb4"])],
                                capture_output=True, text=True, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith("qat4 verify: ") and needle in lines[0]
