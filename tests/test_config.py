"""Gemma 4 config parsing and per-layer facts."""

import json

import pytest

from qat4.config import E2B, FULL, SLIDING, TINY, Gemma4Config
from qat4.checkpoint.packed_model import expected_tensors
from qat4.errors import Qat4Error


def test_e2b_layer_facts_match_the_spec():
    full = [i for i in range(35) if not E2B.is_sliding(i)]
    assert full == [4, 9, 14, 19, 24, 29, 34]
    assert [E2B.kv_source(i) for i in (15, 18, 19, 20, 34)] == [13, 13, 14, 13, 14]
    assert sum(E2B.owns_kv(i) for i in range(35)) == 15
    assert [E2B.mlp_width(i) for i in (14, 15)] == [6144, 12288]
    assert [E2B.layer_head_dim(i) for i in (3, 4)] == [256, 512]


def test_e2b_tensor_inventory_matches_the_spec_counts():
    specs = expected_tensors(E2B)
    packed = {n: s for n, s in specs.items() if s.packed}
    layer_mats = [n for n in packed if n.startswith("layers.")]
    assert len(layer_mats) == 275
    linear_params = sum(s.shape[0] * s.shape[1] for n, s in packed.items() if n not in ("embed_tokens", "embed_tokens_per_layer"))
    assert linear_params == 1_876_819_968
    total = sum(int(__import__("math").prod(s.shape)) for s in specs.values())
    assert total == 4_628_569_379


def test_tiny_keeps_every_structural_feature():
    assert TINY.layer_types == (SLIDING,) * 4 + (FULL,) + (SLIDING,) * 4 + (FULL,)
    assert [TINY.kv_source(i) for i in range(6, 10)] == [5, 5, 5, 4]
    assert TINY.mlp_width(9) == 2 * TINY.mlp_width(0)
    assert TINY.vocab_size == 262_144 and TINY.sliding_window == 8


def test_google_nested_and_top_level_spellings_agree():
    text = E2B.to_hf_text_dict()
    nested = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    assert Gemma4Config.from_hf_dict(nested) == E2B
    assert Gemma4Config.from_hf_dict(text) == E2B


def test_transformers_diff_config_with_per_layer_config():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    hf = Gemma4TextConfig(**{k: v for k, v in E2B.to_hf_text_dict().items() if k not in ("model_type",)})
    saved = hf.to_diff_dict()
    assert "global_head_dim" not in saved
    assert Gemma4Config.from_hf_dict(json.loads(json.dumps(saved))) == E2B


def test_bad_config_names_the_file_and_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(Qat4Error, match="config.json is not valid JSON"):
        Gemma4Config.from_file(path)
    path.write_text(json.dumps({**E2B.to_hf_text_dict(), "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(Qat4Error, match="layer_types has 3 entries"):
        Gemma4Config.from_file(path)
