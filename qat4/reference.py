"""transformers' own Gemma 4 on a PackedModel's weights: the yardstick for parity tests and the
`--peers hf` benchmark. Needs `transformers` (a test and benchmark dependency, not a runtime one).
"""

from __future__ import annotations

import torch

from qat4.checkpoint.packed_model import PackedModel
from qat4.checkpoint.packing import PackedTensor


def hf_state_dict(model: PackedModel, dtype: torch.dtype, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Dense weights under `Gemma4ForCausalLM` names; 4-bit matrices dequantised (exact for on-grid values)."""
    out = {}
    for name, t in model.tensors.items():
        dense = t.to(device).dequantize(dtype) if isinstance(t, PackedTensor) else t.to(device, dtype)
        key = f"model.{name}" if name.endswith("layer_scalar") else f"model.{name}.weight"
        out[key] = dense
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.to(device).dequantize(dtype)
    return out


def hf_model(model: PackedModel, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             attn_implementation: str = "eager"):
    """A transformers `Gemma4ForCausalLM` holding exactly the PackedModel's values, in eval mode."""
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    text = model.config.to_hf_text_dict()
    text.pop("model_type")
    text["tie_word_embeddings"] = model.lm_head is None
    config = Gemma4TextConfig(**text)
    config._attn_implementation = attn_implementation
    with torch.device(device):
        hf = Gemma4ForCausalLM(config).to(dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model, dtype, device), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.eval()
