"""transformers' own Gemma 4 holding the dense, dequantised weights of a PackedModel: the reference
the engine is checked against (CPU parity tests, GPU tests) and the `qat4 bench --peers hf` peer.
Needs `transformers`, a test and benchmark dependency rather than a runtime one."""

from __future__ import annotations

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.initialization import no_init_weights

from qat4.checkpoint.packed_model import PackedModel
from qat4.checkpoint.packing import PackedTensor


def hf_config(packed: PackedModel) -> Gemma4TextConfig:
    config = Gemma4TextConfig(**packed.config.to_hf_text_dict())
    config._attn_implementation = "eager"
    config.tie_word_embeddings = packed.lm_head is None
    return config


@torch.no_grad()
def hf_model(packed: PackedModel, device: str | torch.device = "cpu") -> Gemma4ForCausalLM:
    """An fp32 ``Gemma4ForCausalLM`` (eager attention) with every weight of ``packed`` dequantised.

    Built on ``device`` without transformers' random initialisation (every parameter is
    overwritten; 5 s of a tiny model's 262,144-token vocabulary on a CPU) and filled tensor by
    tensor, so no second dense copy is ever held.
    """
    with torch.device(device), no_init_weights():
        model = Gemma4ForCausalLM(hf_config(packed))
    model.tie_weights()  # which the skipped initialisation would have done
    params = dict(model.named_parameters())
    targets = params | dict(model.named_buffers())
    unwritten = set(params)
    for name, t in packed.tensors.items():
        key = "model." + name + ("" if name.endswith("layer_scalar") else ".weight")
        targets[key].copy_(t.dequantize(torch.float32) if isinstance(t, PackedTensor) else t.float())
        unwritten.discard(key)
    if packed.lm_head is not None:
        model.lm_head.weight.copy_(packed.lm_head.dequantize(torch.float32))
    assert packed.lm_head is not None or model.lm_head.weight is model.model.embed_tokens.weight
    assert unwritten <= {"lm_head.weight"}, f"parameters the checkpoint does not fill: {sorted(unwritten)}"
    return model.eval()


def cast(model: Gemma4ForCausalLM, dtype: torch.dtype) -> Gemma4ForCausalLM:
    """``model.to(dtype)`` in place, with the RoPE inverse frequencies kept in fp32 as a model
    loaded with ``from_pretrained(..., dtype=dtype)`` has them."""
    rotary = model.model.rotary_emb
    saved = {name: buf.clone() for name, buf in rotary.named_buffers()}
    model.to(dtype)
    for name, buf in saved.items():
        setattr(rotary, name, buf)
    return model


def rel_max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
