"""compressed-tensors `pack-quantized` W4A16 checkpoints: reader and writer.

Covers the text-only repack (`-ct-text`: top-level text config, `model.language_model.*` names,
bf16 tables recovered onto the grid on read), its `-emb4` variant (both tables and an untied
`lm_head` packed, fp16 table steps, `tie_word_embeddings: false`) and Google's multimodal
`-qat-w4a16-ct` (nested `text_config`, tower tensors present and skipped). Whether a tensor is
packed or dense is decided per tensor. Layout of a packed module `M`:
`M.weight_packed` I32 [rows, cols/8], `M.weight_scale` BF16/F16 [rows, cols/32],
`M.weight_shape` I64 [2].
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterable, Mapping

import torch

from qat4.checkpoint.hf_layout import (
    LM_HEAD,
    TOWER_IGNORE,
    SafetensorsFolderSource,
    Stored,
    causal_lm_config,
    conditional_generation_config,
    text_plan,
    write_folder,
)
from qat4.checkpoint.packed_model import Tensor
from qat4.checkpoint.packing import GROUP
from qat4.checkpoint.safetensors_io import DEFAULT_SHARD_BYTES
from qat4.checkpoint.source import AuxFiles
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

TABLES = ("embed_tokens", "embed_tokens_per_layer")
# The config groups -emb4 adds: deep copies of group_0 with these targets.
EMB4_GROUPS = {
    "group_embed_tokens_per_layer": "re:.*\\.embed_tokens_per_layer$",
    "group_embed_tokens": "re:.*\\.embed_tokens$",
    "group_lm_head": "re:^lm_head$",
}
# quantization_config fields qat4 can read, and the one value each must have.
_TOP_LEVEL = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}


def _weights_scheme() -> dict:
    return {
        **_WEIGHTS,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": None,
        "observer_kwargs": {},
    }


def quantization_config(*, emb4: bool, towers: bool) -> dict:
    """The `quantization_config` of the published repacks (`towers`: Google's multimodal layout,
    whose vision and audio linears must be ignored)."""
    group = {
        "targets": ["Linear"],
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "weights": _weights_scheme(),
    }
    groups = {"group_0": group}
    ignore = ["lm_head"]
    if emb4:
        groups.update({name: {**copy.deepcopy(group), "targets": [target]} for name, target in EMB4_GROUPS.items()})
        ignore = []
    if towers:
        ignore.append(TOWER_IGNORE)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _expect_field(value, wanted, field: str, where: Path) -> None:
    if value != wanted or type(value) is not type(wanted):
        raise Qat4Error(f"{where} field {field} is {value!r}; qat4 reads only {wanted!r}")


def check_quantization_config(raw: dict, where: Path) -> None:
    """Raise naming the first field outside symmetric int4 group-32 pack-quantized W4A16."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict):
        raise Qat4Error(f"{where} has no quantization_config object")
    for key, wanted in _TOP_LEVEL.items():
        _expect_field(qc.get(key), wanted, f"quantization_config.{key}", where)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Qat4Error(f"{where} field quantization_config.config_groups is missing or empty")
    for name, group in groups.items():
        field = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise Qat4Error(f"{where} field {field}.weights is missing")
        if group.get("format") is not None:
            _expect_field(group["format"], "pack-quantized", f"{field}.format", where)
        if group.get("input_activations") is not None:
            raise Qat4Error(f"{where} field {field}.input_activations is set; qat4 reads only weight-only (W4A16) schemes")
        for key, wanted in _WEIGHTS.items():
            _expect_field(group["weights"].get(key), wanted, f"{field}.weights.{key}", where)


class CompressedTensorsSource(SafetensorsFolderSource):
    """A compressed-tensors W4A16 folder; `format` is `ct-emb4` when the token table is packed."""

    def __init__(self, folder: str | Path):
        super().__init__(folder)
        check_quantization_config(self.raw_config, self.folder / "config.json")
        self.format = "ct-emb4" if self.is_packed("embed_tokens") else "ct"


def write_ct(
    out_dir: str | Path,
    config: Gemma4Config,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    aux: AuxFiles,
    *,
    emb4: bool,
    scale_dtype: torch.dtype | None = None,
    text_only: bool = True,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write a compressed-tensors checkpoint laid out like the published repacks.

    `tensors`: canonical text tensors (PackedModel form), streamed in any order; k/v of KV-shared
    layers are skipped. Linears are packed; the tables are dense bf16 (`-ct-text`) or, with
    `emb4`, packed together with an `lm_head` copy of `embed_tokens`. `scale_dtype` sets every
    stored step's dtype; None keeps the published mix (bf16 for linears, fp16 for emb4 tables).
    `text_only=False` writes Google's multimodal config layout (no tower tensors).
    """
    linear_scale = scale_dtype or torch.bfloat16
    table_scale = (scale_dtype or torch.float16) if emb4 else None
    plan = text_plan(config, lambda name: table_scale if name in TABLES else linear_scale)
    if emb4:
        plan["embed_tokens"].append(Stored(LM_HEAD, plan["embed_tokens"][0].spec, table_scale))
    make_config = causal_lm_config if text_only else conditional_generation_config
    config_json = make_config(config, tie=not emb4)
    config_json["quantization_config"] = quantization_config(emb4=emb4, towers=not text_only)
    write_folder(out_dir, config, config_json, plan, tensors, aux, overwrite=overwrite, shard_bytes=shard_bytes)
