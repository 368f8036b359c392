"""GGUF metadata of a gemma4 file, both ways: the config read from it (config_from_gguf) and the
model, tokenizer and generation metadata written into it as llama.cpp's gemma4 converter writes
them; the generation settings read back as generation_config.json's fields."""

from __future__ import annotations

import json
import re

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType

from qat4.checkpoint.gguf.container import GGUFFile, Value
from qat4.checkpoint.gguf.names import ROPE_FREQS
from qat4.checkpoint.source import AuxFiles
from qat4.config import FULL, SLIDING, Gemma4Config
from qat4.errors import Qat4Error

ARCH = "gemma4"

_U32, _I32, _F32, _BOOL, _STR, _ARRAY = (
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
    GGUFValueType.BOOL, GGUFValueType.STRING, GGUFValueType.ARRAY,
)


# ---- config and model metadata -------------------------------------------------------------------


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _uniform(f: GGUFFile, key: str) -> int:
    value = f.require(key)
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise Qat4Error(f"{f.path} metadata {key} varies by layer ({sorted(values)}), which qat4 does not support")
    return int(values.pop())


def _rope_partial_factor(f: GGUFFile, global_head_dim: int) -> float:
    """Share of a global head's dims that rotate, from rope_freqs (1 = rotate, 1e30 = pass through)."""
    info = f.tensors.get(ROPE_FREQS)
    if info is None:
        return 1.0
    freqs = f.data(info).view(np.float32) if info.type == GGMLQuantizationType.F32 else np.zeros(0)
    ones = int((freqs == 1.0).sum())
    if len(freqs) != global_head_dim // 2 or not (freqs[:ones] == 1.0).all() or not (freqs[ones:] > 1e29).all():
        raise Qat4Error(f"tensor {ROPE_FREQS} in {f.path} is not {global_head_dim // 2} F32 factors of 1 then 1e30, the only RoPE qat4 runs")
    return 2.0 * ones / global_head_dim


def _stop_ids(f: GGUFFile) -> tuple[int, ...]:
    """End-of-generation ids: the file's eos (and eot/eom), plus `<turn|>` and `<|tool_response>`,
    which transformers' GGUF loader adds for gemma4."""
    ids = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = f.get("tokenizer.ggml.tokens") or []
    index = {t: i for i, t in enumerate(tokens) if t in ("<turn|>", "<|tool_response>")}
    ids += [index.get("<turn|>"), index.get("<|tool_response>")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None)) or (1,)


def config_from_gguf(f: GGUFFile) -> Gemma4Config:
    """Gemma4Config from `gemma4.*` metadata, the rope_freqs tensor and the vocabulary tables' shapes."""
    arch = f.get("general.architecture")
    if arch != ARCH:
        raise Qat4Error(f"{f.path} is a GGUF for architecture {arch!r}; qat4 reads {ARCH!r}")
    key = lambda name: f.require(f"{ARCH}.{name}")  # noqa: E731
    n_layers = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise Qat4Error(f"{f.path} metadata {ARCH}.attention.sliding_window_pattern is not one flag per layer")
    widths = key("feed_forward_length")
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * n_layers
    global_head_dim = int(key("attention.key_length"))
    rows = {}
    for name in ("token_embd.weight", "per_layer_token_embd.weight"):
        if name not in f.tensors:
            raise Qat4Error(f"{f.path} has no tensor {name}")
        rows[name] = f.tensors[name].shape[0]
    softcap = f.get(f"{ARCH}.final_logit_softcapping")
    rope = {
        SLIDING: {"rope_type": "default", "rope_theta": _f32(f.get(f"{ARCH}.rope.freq_base_swa", 10_000.0))},
        FULL: {
            "rope_type": "proportional",
            "partial_rotary_factor": _rope_partial_factor(f, global_head_dim),
            "rope_theta": _f32(key("rope.freq_base")),
        },
    }
    config = Gemma4Config(
        vocab_size=rows["token_embd.weight"],
        hidden_size=int(key("embedding_length")),
        intermediate_size=min(widths),
        num_hidden_layers=n_layers,
        num_attention_heads=_uniform(f, f"{ARCH}.attention.head_count"),
        num_key_value_heads=_uniform(f, f"{ARCH}.attention.head_count_kv"),
        head_dim=int(key("attention.key_length_swa")),
        global_head_dim=global_head_dim,
        layer_types=tuple(SLIDING if s else FULL for s in pattern),
        sliding_window=int(key("attention.sliding_window")),
        rope_parameters=rope,
        max_position_embeddings=int(key("context_length")),
        hidden_size_per_layer_input=int(key("embedding_length_per_layer_input")),
        vocab_size_per_layer_input=rows["per_layer_token_embd.weight"],
        num_kv_shared_layers=int(f.get(f"{ARCH}.attention.shared_kv_layers", 0)),
        use_double_wide_mlp=max(widths) != min(widths),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        final_logit_softcapping=None if softcap is None else _f32(softcap),
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=int(f.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=_stop_ids(f),
        pad_token_id=int(f.get("tokenizer.ggml.padding_token_id", 0)),
    )
    if [config.mlp_width(i) for i in range(n_layers)] != widths:
        raise Qat4Error(f"{f.path} metadata {ARCH}.feed_forward_length {widths} is not one width, doubled on the KV-shared layers")
    return config


def n_rotated_pairs(config: Gemma4Config) -> int:
    """Frequency pairs that rotate on global layers (HF's proportional RoPE: factor x head_dim // 2);
    the writer's `rope_freqs.weight` lets these rotate and holds the rest still."""
    full, sliding = config.rope_parameters[FULL], config.rope_parameters[SLIDING]
    if sliding.get("rope_type", "default") != "default" or sliding.get("partial_rotary_factor", 1.0) != 1.0:
        raise Qat4Error("config field rope_parameters.sliding_attention is not a full default RoPE, which GGUF cannot express")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise Qat4Error(f"config field rope_parameters.full_attention.rope_type {full['rope_type']!r} cannot be expressed in GGUF")
    return int(full.get("partial_rotary_factor", 1.0) * config.global_head_dim // 2)


def model_metadata(config: Gemma4Config) -> dict[str, Value]:
    """`general.*` and `gemma4.*` keys as llama.cpp's gemma4 converter writes them."""
    n = config.num_hidden_layers
    meta: dict[str, Value] = {
        "general.architecture": (_STR, ARCH),
        "general.type": (_STR, "model"),
        "general.file_type": (_U32, LlamaFileType.MOSTLY_Q4_0),
        "general.quantization_version": (_U32, GGML_QUANT_VERSION),
    }
    arch = {
        "block_count": (_U32, n),
        "context_length": (_U32, config.max_position_embeddings),
        "embedding_length": (_U32, config.hidden_size),
        "feed_forward_length": (_ARRAY, (_I32, [config.mlp_width(i) for i in range(n)])),
        "attention.head_count": (_U32, config.num_attention_heads),
        "attention.head_count_kv": (_U32, config.num_key_value_heads),
        "attention.key_length": (_U32, config.global_head_dim),
        "attention.value_length": (_U32, config.global_head_dim),
        "attention.key_length_swa": (_U32, config.head_dim),
        "attention.value_length_swa": (_U32, config.head_dim),
        "attention.sliding_window": (_U32, config.sliding_window),
        "attention.sliding_window_pattern": (_ARRAY, (_BOOL, [t == SLIDING for t in config.layer_types])),
        "attention.shared_kv_layers": (_U32, config.num_kv_shared_layers),
        "embedding_length_per_layer_input": (_U32, config.hidden_size_per_layer_input),
        "rope.dimension_count": (_U32, config.global_head_dim),
        "rope.dimension_count_swa": (_U32, config.head_dim),
        "rope.freq_base": (_F32, config.rope_parameters[FULL]["rope_theta"]),
        "rope.freq_base_swa": (_F32, config.rope_parameters[SLIDING]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (_F32, config.rms_norm_eps),
    }
    if config.final_logit_softcapping is not None:
        arch["final_logit_softcapping"] = (_F32, config.final_logit_softcapping)
    meta.update((f"{ARCH}.{k}", v) for k, v in arch.items())
    return meta


# ---- tokenizer and generation settings -----------------------------------------------------------

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>$")
_BPE_SCORE = -1000.0  # BPE ranks by merges; llama.cpp's Gemma 4 vocabulary carries this score for every token
_SAMPLING_KEYS = {"temperature": ("general.sampling.temp", _F32), "top_k": ("general.sampling.top_k", _I32),
                  "top_p": ("general.sampling.top_p", _F32)}


def tokenizer_metadata(tokenizer_json: str, config: Gemma4Config) -> dict[str, Value]:
    """Tokens, merges, token types and special ids from a tokenizers BPE JSON, as llama.cpp reads them.

    Added tokens marked special become CONTROL, other added tokens USER_DEFINED (rendered in output
    text), `<0xNN>` byte-fallback tokens BYTE, everything else NORMAL.
    """
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise Qat4Error(f"tokenizer.json has a {model.get('type')!r} model; a gemma4 GGUF needs BPE")
    by_id = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in spec.get("added_tokens", [])}
    by_id.update((i, a["content"]) for i, a in added.items())
    if sorted(by_id) != list(range(config.vocab_size)):
        raise Qat4Error(f"tokenizer.json does not hold exactly the ids 0..{config.vocab_size - 1} of the model's vocabulary")
    tokens = [by_id[i] for i in range(config.vocab_size)]
    types = [
        (TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED) if i in added
        else TokenType.BYTE if _BYTE_TOKEN.match(t) else TokenType.NORMAL
        for i, t in enumerate(tokens)
    ]
    index = {t: i for i, t in enumerate(tokens)}
    meta: dict[str, Value] = {
        "tokenizer.ggml.model": (_STR, ARCH),
        "tokenizer.ggml.tokens": (_ARRAY, (_STR, tokens)),
        "tokenizer.ggml.scores": (_ARRAY, (_F32, [_BPE_SCORE] * len(tokens))),
        "tokenizer.ggml.token_type": (_ARRAY, (_I32, [int(t) for t in types])),
        "tokenizer.ggml.merges": (_ARRAY, (_STR, [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])),
        "tokenizer.ggml.bos_token_id": (_U32, config.bos_token_id),
        "tokenizer.ggml.eos_token_id": (_U32, config.eos_token_id[0]),
    }
    if model.get("unk_token") in index:
        meta["tokenizer.ggml.unknown_token_id"] = (_U32, index[model["unk_token"]])
    meta["tokenizer.ggml.padding_token_id"] = (_U32, config.pad_token_id)
    if "<mask>" in index:
        meta["tokenizer.ggml.mask_token_id"] = (_U32, index["<mask>"])
    meta["tokenizer.ggml.add_bos_token"] = (_BOOL, True)
    meta["tokenizer.ggml.add_space_prefix"] = (_BOOL, False)
    return meta


def generation_metadata(aux: AuxFiles) -> dict[str, Value]:
    """The chat template and the sampling settings of generation_config.json as `tokenizer.chat_template`
    and `general.sampling.*`, for the file being written."""
    meta: dict[str, Value] = {}
    if aux.chat_template:
        meta["tokenizer.chat_template"] = (_STR, aux.chat_template)
    for field, (key, kind) in _SAMPLING_KEYS.items():
        if aux.generation_config.get(field) is not None:
            meta[key] = (kind, aux.generation_config[field])
    return meta


def generation_config_from_gguf(f: GGUFFile, config: Gemma4Config) -> dict:
    """generation_config.json's fields from the special ids and `general.sampling.*` (whose presence
    means sampling is on, as llama.cpp applies them)."""
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_id), "pad_token_id": config.pad_token_id}
    for field, (key, kind) in _SAMPLING_KEYS.items():
        value = f.get(key)
        if value is not None:
            out[field] = _f32(value) if kind == _F32 else int(value)
            out["do_sample"] = True
    return out
