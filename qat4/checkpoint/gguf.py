"""llama.cpp GGUF files of architecture `gemma4`: read into qat4's packed form, write an exact Q4_0 file.

Q4_0 holds exactly what qat4 keeps: a block of 32 weights along a row is one fp16 step `d` and 32
4-bit codes, value `(code - 8) * d`. Only the nibble order differs: in a block's 16 bytes, element
j (j < 16) is the low nibble of byte j and element j + 16 its high nibble, while qat4 (the
compressed-tensors order) keeps elements 2b and 2b + 1 in the low and high nibble of byte b. So
transcoding is a nibble shuffle plus a step-dtype change (fp16 in GGUF; bf16 steps convert exactly
while fp16 can hold them, and anything else is refused). GGUF lists shapes innermost first
(`ne = [in, out]`); blocks run along `in`, so they cover the same 32 weights as qat4's groups.

Tensor data stays memory-mapped and is transcoded in slices, so neither reading nor writing holds a
second copy of a large table. Byte views assume a little-endian host, as GGUF files themselves are.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType

from qat4.checkpoint.gguf_file import GGUFFile, TensorInfo, Value, encode_header
from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.checkpoint.packed_model import Tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import GROUP, PER_WORD, GridReport, PackedBlocks, PackedTensor, recover_grid, row_blocks, streamed
from qat4.checkpoint.source import AuxFiles
from qat4.config import FULL, SLIDING, Gemma4Config
from qat4.errors import Qat4Error

ARCH = "gemma4"
ROPE_FREQS = "rope_freqs.weight"
Q4_0_BLOCK_BYTES = 18  # fp16 step + 16 bytes of nibbles
_CHUNK_BLOCKS = 1 << 20  # blocks transcoded at once (32 Mi weights)
_ROPE_OFF = 1e30  # rope_freqs factor that keeps a frequency pair from rotating

_U32, _I32, _F32, _BOOL, _STR, _ARRAY = (
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
    GGUFValueType.BOOL, GGUFValueType.STRING, GGUFValueType.ARRAY,
)

# ---- names -------------------------------------------------------------------------------------

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


# ---- Q4_0 <-> qat4 packed ------------------------------------------------------------------------


def q4_0_to_packed(blocks: np.ndarray, rows: int, cols: int, consumed: Callable[[int], None] | None = None) -> PackedTensor:
    """Q4_0 bytes of a [rows, cols] matrix (rows x cols/32 blocks of 18 bytes) -> PackedTensor, exactly.

    `consumed(n)` is told after each slice that the first n bytes of `blocks` are no longer needed.
    """
    n = rows * cols // GROUP
    blocks = blocks.reshape(n, Q4_0_BLOCK_BYTES)
    words = np.empty((n, 16), np.uint8)
    steps = np.empty((n, 2), np.uint8)
    for s in range(0, n, _CHUNK_BLOCKS):
        part = blocks[s : s + _CHUNK_BLOCKS]
        steps[s : s + len(part)] = part[:, :2]
        qs = part[:, 2:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # element order 0..31
        words[s : s + len(part)] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        if consumed is not None:
            consumed((s + len(part)) * Q4_0_BLOCK_BYTES)
    packed = torch.from_numpy(words.view(np.int32).reshape(rows, cols // PER_WORD))
    scales = torch.from_numpy(steps.view(np.float16).reshape(rows, cols // GROUP))
    return PackedTensor(packed, scales)


def require_exact_steps(steps: torch.Tensor, dtype: torch.dtype, name: str, consequence: str, row0: int = 0) -> None:
    """Raise Qat4Error naming tensor, row and group of the first step ([rows, groups]) that `dtype`
    cannot hold exactly; `consequence` ends the message (why it matters, what to do). `row0`: the
    row of the whole matrix that steps' first row is, for the message."""
    chunk = max(1, _CHUNK_BLOCKS // steps.shape[1])
    for r in range(0, steps.shape[0], chunk):
        step32 = steps[r : r + chunk].to(torch.float32)
        bad = (step32.to(dtype).to(torch.float32) != step32).nonzero()
        if len(bad):
            row, group = r + int(bad[0, 0]), int(bad[0, 1])
            raise Qat4Error(
                f"tensor {name} has step {float(steps[row, group])!r} at row {row0 + row}, group {group}, "
                f"which {str(dtype).removeprefix('torch.')} cannot hold exactly; {consequence}"
            )


def packed_to_q4_0(tensor: PackedTensor, name: str, row0: int = 0) -> Iterator[np.ndarray]:
    """The Q4_0 bytes of a PackedTensor, row-major, in slices of whole blocks.

    Steps are stored as fp16; a step fp16 cannot hold exactly raises Qat4Error naming the tensor,
    row and group, since Q4_0 would then change the weights.
    """
    require_exact_steps(tensor.scales, torch.float16, name, "Q4_0 stores fp16 steps", row0)
    n = tensor.rows * tensor.cols // GROUP
    words = tensor.packed.contiguous().numpy().reshape(n, 4).view(np.uint8)  # [n, 16]
    steps = tensor.scales.reshape(n)
    for s in range(0, n, _CHUNK_BLOCKS):
        part = words[s : s + _CHUNK_BLOCKS]
        codes = np.empty((len(part), GROUP), np.uint8)
        codes[:, 0::2] = part & 0xF
        codes[:, 1::2] = part >> 4
        out = np.empty((len(part), Q4_0_BLOCK_BYTES), np.uint8)
        out[:, :2] = steps[s : s + len(part)].to(torch.float16).numpy().view(np.uint8).reshape(-1, 2)
        out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
        yield out.reshape(-1)


# ---- config <-> metadata -------------------------------------------------------------------------


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


def _n_rotated_pairs(config: Gemma4Config) -> int:
    """Frequency pairs that rotate on global layers (HF's proportional RoPE: factor x head_dim // 2)."""
    full, sliding = config.rope_parameters[FULL], config.rope_parameters[SLIDING]
    if sliding.get("rope_type", "default") != "default" or sliding.get("partial_rotary_factor", 1.0) != 1.0:
        raise Qat4Error("config field rope_parameters.sliding_attention is not a full default RoPE, which GGUF cannot express")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise Qat4Error(f"config field rope_parameters.full_attention.rope_type {full['rope_type']!r} cannot be expressed in GGUF")
    return int(full.get("partial_rotary_factor", 1.0) * config.global_head_dim // 2)


def _model_metadata(config: Gemma4Config) -> dict[str, Value]:
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


def _tokenizer_metadata(tokenizer_json: str, config: Gemma4Config) -> dict[str, Value]:
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


def _generation_metadata(aux: AuxFiles) -> dict[str, Value]:
    meta: dict[str, Value] = {}
    if aux.chat_template:
        meta["tokenizer.chat_template"] = (_STR, aux.chat_template)
    for field, (key, kind) in _SAMPLING_KEYS.items():
        if aux.generation_config.get(field) is not None:
            meta[key] = (kind, aux.generation_config[field])
    return meta


def _generation_config(f: GGUFFile, config: Gemma4Config) -> dict:
    """generation_config.json's fields from the special ids and `general.sampling.*` (whose presence
    means sampling is on, as llama.cpp applies them)."""
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_id), "pad_token_id": config.pad_token_id}
    for field, (key, kind) in _SAMPLING_KEYS.items():
        value = f.get(key)
        if value is not None:
            out[field] = _f32(value) if kind == _F32 else int(value)
            out["do_sample"] = True
    return out


# ---- reading -------------------------------------------------------------------------------------

_DENSE_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def _single_gguf(path: Path) -> Path:
    if not path.is_dir():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise Qat4Error(f"{path} holds {len(found)} .gguf files; name the one to read")
    return found[0]


class GGUFSource:
    """A llama.cpp gemma4 GGUF opened for reading (a CheckpointSource).

    Matrices stored as Q4_0 transcode exactly; matrices stored as F32/F16/BF16 are recovered onto
    the 4-bit grid (fp16 steps, as Q4_0 would hold them); any other type is refused when the file
    is opened, naming the tensor and its type. Norms and layer scalars come out in their stored
    dtype. Shapes are checked against the config when the file is opened.
    """

    format = "gguf"

    def __init__(self, path: str | Path):
        """`path`: a .gguf file, or a folder holding exactly one."""
        self.file = GGUFFile(_single_gguf(Path(path)))
        self.location = str(self.file.path)
        self.config = config_from_gguf(self.file)
        specs = expected_tensors(self.config)
        self._infos: dict[str, TensorInfo] = {}
        self._matrices: set[str] = set()
        for info in self.file.tensors.values():
            name = canonical_name(info.name)
            if name is None or is_unused_shared_kv(self.config, name):
                continue
            shape = (self.config.vocab_size, self.config.hidden_size) if name == LM_HEAD else specs[name].shape
            matrix = name == LM_HEAD or specs[name].packed
            if info.type not in _DENSE_TYPES and not (matrix and info.type == GGMLQuantizationType.Q4_0):
                raise Qat4Error(
                    f"tensor {info.name} in {self.location} is stored as {info.type.name}; qat4 reads matrices "
                    "from Q4_0 (exactly) or F32/F16/BF16 on the 4-bit grid, and other tensors from F32/F16/BF16"
                )
            if info.shape != tuple(shape):
                raise Qat4Error(f"tensor {info.name} in {self.location} has shape {list(info.shape)}; the config expects {list(shape)}")
            self._infos[name] = info
            if matrix:
                self._matrices.add(name)
        self._names = [n for n in [*specs, LM_HEAD] if n in self._infos]
        self._reports: dict[str, GridReport] = {}

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> Tensor:
        info = self._infos.get(name)
        if info is None:
            raise Qat4Error(f"{self.location} has no tensor for {name}")
        if name not in self._matrices:
            tensor = self._dense(info).clone()
        elif info.type == GGMLQuantizationType.Q4_0:
            tensor = q4_0_to_packed(self.file.data(info), *info.shape, lambda n: self.file.release(info, n))
        else:
            tensor, self._reports[name] = recover_grid(self._dense(info), info.name, torch.float16)
        self.file.release(info)
        return tensor

    def read_blocks(self, name: str) -> Tensor | PackedBlocks:
        """As :meth:`read`, but a Q4_0 matrix large enough to be ``streamed`` comes as PackedBlocks
        converting one block of rows at a time (pages released as they are read)."""
        info = self._infos.get(name)
        if info is None or name not in self._matrices or info.type != GGMLQuantizationType.Q4_0 or not streamed(info.shape):
            return self.read(name)
        rows, cols = info.shape
        row_bytes = cols // GROUP * Q4_0_BLOCK_BYTES

        def convert(start: int, stop: int) -> PackedTensor:
            block = q4_0_to_packed(self.file.data(info)[start * row_bytes : stop * row_bytes], stop - start, cols)
            self.file.release(info, stop * row_bytes)
            return block

        return PackedBlocks(rows, cols, convert)

    def _dense(self, info: TensorInfo) -> torch.Tensor:
        """The stored values, a view of the memory map."""
        return torch.from_numpy(self.file.data(info)).view(_DENSE_TYPES[info.type]).reshape(info.shape)

    def grid_reports(self) -> dict[str, GridReport]:
        return dict(self._reports)

    def aux(self) -> AuxFiles:
        from qat4.tokenizer import build_tokenizer_json

        return AuxFiles(
            tokenizer_json=build_tokenizer_json(self.file.path),
            chat_template=self.file.get("tokenizer.chat_template"),
            generation_config=_generation_config(self.file, self.config),
        )

    def iter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name in self._names:
            yield name, self.read(name)


# ---- writing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    """One tensor of the file being written: canonical name, its GGUF entry, and whether it is Q4_0."""

    name: str
    info: TensorInfo

    @property
    def packed(self) -> bool:
        return self.info.type == GGMLQuantizationType.Q4_0


def _plan(config: Gemma4Config, names: Iterable[str]) -> dict[str, _Planned]:
    specs = expected_tensors(config)
    plan = {}
    for name in names:
        if name == LM_HEAD:
            shape, packed = (config.vocab_size, config.hidden_size), True
        elif name in specs:
            shape, packed = specs[name].shape, specs[name].packed
        else:
            raise Qat4Error(f"tensor {name} is not part of the Gemma 4 text model its config describes, so it has no place in a GGUF")
        kind = GGMLQuantizationType.Q4_0 if packed else GGMLQuantizationType.F32
        plan[name] = _Planned(name, TensorInfo(gguf_name(name), kind, tuple(shape)))
    return plan


def _tensor_bytes(item: _Planned, tensor: Tensor | PackedBlocks) -> Iterator[np.ndarray]:
    """The bytes of one planned tensor: Q4_0 blocks for a matrix, F32 for a dense tensor."""
    if item.packed != isinstance(tensor, (PackedTensor, PackedBlocks)):
        raise Qat4Error(f"tensor {item.name} should be {'a 4-bit matrix' if item.packed else 'a dense tensor'}")
    shape = tuple(tensor.shape)
    if shape != item.info.shape:
        raise Qat4Error(f"tensor {item.name} has shape {list(shape)}; the config expects {list(item.info.shape)}")
    if item.packed:
        row = 0
        for block in row_blocks(tensor):
            yield from packed_to_q4_0(block, item.name, row)
            row += block.rows
    else:
        yield tensor.detach().to(torch.float32).contiguous().numpy().reshape(-1).view(np.uint8)


def _write_at(out, offset: int, chunks: Iterable[np.ndarray], info: TensorInfo) -> None:
    """Write the chunks of one tensor at its offset and check they fill its declared size."""
    out.seek(offset)
    size = 0
    for chunk in chunks:
        out.write(memoryview(chunk))
        size += chunk.nbytes
    if size != info.nbytes:
        raise Qat4Error(f"tensor {info.name} produced {size} bytes where its GGUF entry declares {info.nbytes}")


def write_gguf(
    out_path: str | Path,
    config: Gemma4Config,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    aux: AuxFiles,
    progress: Callable[[str, int], None] | None = None,
) -> Path:
    """Write an exact Q4_0 gemma4 GGUF that llama.cpp can load.

    `tensors`: canonical text tensors. A mapping is written in its key order (`lm_head` included
    when present, as `output.weight`; values may be produced lazily, each fetched once); pairs may
    come in any order and must be the text tensors of `config`. k/v of KV-shared layers are
    skipped. Every matrix becomes Q4_0 with its trained step as fp16, norms and layer scalars F32,
    plus the generated `rope_freqs.weight`; metadata, tokenizer (from `aux.tokenizer_json`) and
    chat template follow llama.cpp's gemma4 converter. The header with every tensor info goes
    first, then each tensor's bytes at its offset, one tensor at a time;
    `progress(name, tensor bytes written so far)` follows each. The file is written under a
    temporary name beside `out_path` and renamed when complete.
    """
    out_path = Path(out_path)
    if not aux.tokenizer_json:
        raise Qat4Error(f"cannot write {out_path}: a GGUF carries its tokenizer and the source has no tokenizer.json")
    if isinstance(tensors, Mapping):
        names, items = [n for n in tensors if not is_unused_shared_kv(config, n)], tensors.items()
    else:
        names, items = list(expected_tensors(config)), tensors
    plan = _plan(config, names)
    freqs = np.full(config.global_head_dim // 2, _ROPE_OFF, np.float32)
    freqs[: _n_rotated_pairs(config)] = 1.0
    rope_info = TensorInfo(ROPE_FREQS, GGMLQuantizationType.F32, freqs.shape)
    metadata = {**_model_metadata(config), **_tokenizer_metadata(aux.tokenizer_json, config), **_generation_metadata(aux)}
    infos = [rope_info] + [p.info for p in plan.values()]
    header, offsets = encode_header(metadata, infos)
    offset_of = dict(zip(plan, offsets[1:]))

    partial = out_path.with_name(f".{out_path.name}.partial")
    try:
        with open(partial, "wb") as out:
            out.write(header)
            out.truncate(offsets[-1] + infos[-1].nbytes)
            _write_at(out, offsets[0], [freqs.view(np.uint8)], rope_info)
            written, done_bytes = set(), 0
            for name, tensor in items:
                if is_unused_shared_kv(config, name):
                    continue
                if name in written:
                    raise Qat4Error(f"tensor {name} was given twice for {out_path}")
                item = plan.get(name)
                if item is None:
                    raise Qat4Error(f"tensor {name} is not one of the text tensors planned for {out_path}")
                _write_at(out, offset_of[name], _tensor_bytes(item, tensor), item.info)
                written.add(name)
                done_bytes += item.info.nbytes
                if progress is not None:
                    progress(name, done_bytes)
            missing = [n for n in plan if n not in written]
            if missing:
                raise Qat4Error(f"no data was given for tensor {missing[0]} of {out_path}")
        os.replace(partial, out_path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise Qat4Error(f"cannot write {out_path}: {exc.strerror or exc}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out_path
