"""GGUF tensor names: qat4's canonical names <-> llama.cpp's gemma4 names."""

from __future__ import annotations

import re

from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.errors import Qat4Error

ROPE_FREQS = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "embed_tokens": "token_embd",
    "embed_tokens_per_layer": "per_layer_token_embd",
    "per_layer_model_projection": "per_layer_model_proj",
    "per_layer_projection_norm": "per_layer_proj_norm",
    "norm": "output_norm",
    LM_HEAD: "output",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "layer_scalar": "layer_output_scale",
}
_FROM_GLOBAL = {f"{v}.weight": k for k, v in _GLOBAL_NAMES.items()}
_FROM_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_CANONICAL_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)\.weight$")


def gguf_name(name: str) -> str:
    """Canonical qat4 name -> llama.cpp tensor name (`layers.3.mlp.up_proj` -> `blk.3.ffn_up.weight`)."""
    m = _CANONICAL_LAYER.match(name)
    short = _LAYER_NAMES.get(m.group(2)) if m else _GLOBAL_NAMES.get(name)
    if short is None:
        raise Qat4Error(f"tensor {name} has no llama.cpp gemma4 name")
    return f"blk.{m.group(1)}.{short}.weight" if m else f"{short}.weight"


def canonical_name(name: str) -> str | None:
    """llama.cpp tensor name -> canonical qat4 name, or None for tensors qat4 does not read."""
    m = _GGUF_LAYER.match(name)
    if m is None:
        return _FROM_GLOBAL.get(name)
    short = _FROM_LAYER.get(m.group(2))
    return f"layers.{m.group(1)}.{short}" if short else None
