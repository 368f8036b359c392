"""PackedModel: what every reader produces and every writer, the model and the engine consume.

Tensor names are the transformers text-model names without any prefix (`embed_tokens`,
`layers.3.self_attn.q_proj`, `layers.3.layer_scalar`, `norm`, ...), without `.weight`. Every
matrix (all linears and both vocabulary tables) is a PackedTensor; norms and `layer_scalar` are
small dense tensors. `lm_head` is absent when the output layer is the token embedding (tied, or
an untied copy that holds identical codes and steps). :func:`stop_token_ids` reads the ids that
end a generation from a checkpoint's generation_config and config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qat4.checkpoint.packing import PackedBlocks, PackedTensor
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

Tensor = PackedTensor | torch.Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape of one text tensor, and whether it is a 4-bit matrix."""

    shape: tuple[int, ...]
    packed: bool


def layer_linears(config: Gemma4Config, i: int) -> dict[str, tuple[int, int]]:
    """Linear weights of layer i: name -> [out, in]."""
    d, hd, heads, mlp = config.hidden_size, config.layer_head_dim(i), config.num_attention_heads, config.mlp_width(i)
    p = f"layers.{i}."
    out = {p + "self_attn.q_proj": (heads * hd, d)}
    if config.owns_kv(i):
        out[p + "self_attn.k_proj"] = (hd, d)
        out[p + "self_attn.v_proj"] = (hd, d)
    out[p + "self_attn.o_proj"] = (d, heads * hd)
    out[p + "mlp.gate_proj"] = (mlp, d)
    out[p + "mlp.up_proj"] = (mlp, d)
    out[p + "mlp.down_proj"] = (d, mlp)
    out[p + "per_layer_input_gate"] = (config.hidden_size_per_layer_input, d)
    out[p + "per_layer_projection"] = (d, config.hidden_size_per_layer_input)
    return out


def expected_tensors(config: Gemma4Config) -> dict[str, TensorSpec]:
    """Every tensor the text decoder needs, in checkpoint order."""
    d = config.hidden_size
    specs = {
        "embed_tokens": TensorSpec((config.vocab_size, d), True),
        "embed_tokens_per_layer": TensorSpec((config.vocab_size_per_layer_input, config.per_layer_width), True),
        "per_layer_model_projection": TensorSpec((config.per_layer_width, d), True),
        "per_layer_projection_norm": TensorSpec((config.hidden_size_per_layer_input,), False),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            specs[p + name] = TensorSpec((d,), False)
        specs[p + "self_attn.q_norm"] = TensorSpec((config.layer_head_dim(i),), False)
        if config.owns_kv(i):
            specs[p + "self_attn.k_norm"] = TensorSpec((config.layer_head_dim(i),), False)
        for name, shape in layer_linears(config, i).items():
            specs[name] = TensorSpec(shape, True)
        specs[p + "layer_scalar"] = TensorSpec((1,), False)
    specs["norm"] = TensorSpec((d,), False)
    return specs


_SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)$")


def is_unused_shared_kv(config: Gemma4Config, name: str) -> bool:
    """k_proj / v_proj / k_norm of KV-shared layers: present in some exports, never used."""
    m = _SHARED_KV.match(name)
    return bool(m) and not config.owns_kv(int(m.group(1)))


def check_tensor(name: str, tensor: Tensor | PackedBlocks, spec: TensorSpec, where: str | None = None) -> None:
    """Raise Qat4Error unless `tensor` has the kind (4-bit or dense) and shape `spec` gives."""
    place = f" in {where}" if where else ""
    if spec.packed != isinstance(tensor, (PackedTensor, PackedBlocks)):
        kind = "a 4-bit matrix" if spec.packed else "a dense tensor"
        raise Qat4Error(f"tensor {name}{place} should be {kind}")
    shape = tuple(tensor.shape)
    if shape != spec.shape:
        raise Qat4Error(f"tensor {name}{place} has shape {list(shape)}; the config expects {list(spec.shape)}")


@dataclass
class PackedModel:
    """A Gemma 4 text model with every matrix on the 4-bit grid, ready for qat4.model."""

    config: Gemma4Config
    tensors: dict[str, Tensor]
    source: Path | None = None  # folder or file it was read from (tokenizer, chat template, generation config)
    lm_head: PackedTensor | None = None  # only when an untied output layer differs from embed_tokens
    generation_config: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def validate(self, where: str) -> None:
        """Check every expected tensor is present with its shape; raise naming the first fault."""
        for name, spec in expected_tensors(self.config).items():
            t = self.tensors.get(name)
            if t is None:
                raise Qat4Error(f"{where} has no tensor for {name}")
            check_tensor(name, t, spec, where)
        if self.lm_head is not None and self.lm_head.shape != (self.config.vocab_size, self.config.hidden_size):
            raise Qat4Error(f"tensor lm_head in {where} has shape {list(self.lm_head.shape)}, expected {[self.config.vocab_size, self.config.hidden_size]}")

    def set_output_layer(self, lm_head: PackedTensor) -> None:
        """Keep an untied lm_head only if it differs from the token embedding (emb4 stores a copy)."""
        emb = self.tensors["embed_tokens"]
        same = (
            lm_head.shape == emb.shape
            and torch.equal(lm_head.packed, emb.packed)
            and torch.equal(lm_head.scales.to(torch.float32), emb.scales.to(torch.float32))
        )
        self.lm_head = None if same else lm_head


def stop_token_ids(generation_config: dict, eos_token_id: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a generation: the checkpoint's generation_config ``eos_token_id`` (an id or
    a list), else its config's (for Gemma 4 <eos>, <turn|> and <|tool_response>; a GGUF's come
    from its metadata, see :func:`qat4.checkpoint.gguf.metadata.config_from_gguf`)."""
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and eos and all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        return tuple(dict.fromkeys(eos))
    return tuple(eos_token_id)
