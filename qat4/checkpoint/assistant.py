"""Gemma 4's MTP drafter ("assistant") checkpoints: read, check, and write synthetic ones.

The published drafter (`google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant`, transformers'
``Gemma4AssistantForCausalLM``, ``model_type`` ``gemma4_assistant``) is a folder of config.json and
dense safetensors: a small Gemma 4 decoder whose layers have queries only (they attend over the
target's K/V, :mod:`qat4.assistant`), the projections in from the target (``pre_projection``
[d, 2 x backbone]) and back out (``post_projection`` [backbone, d]), and an output head over
``num_centroids`` clusters of ``vocab / num_centroids`` token ids (``masked_embedding``). Its
weights stay dense (about 150 MiB in bf16 for E2B's, 128 MiB of them the output table).

config.json nests the decoder's own config under ``text_config`` beside the drafter's keys
(``backbone_hidden_size``, ``use_ordered_embeddings``, ``num_centroids``,
``centroid_intermediate_top_k``). Synthetic drafters (:func:`write_synthetic_assistant`, ``qat4
synth --assistant``) have the published shape scaled to their target, random dense weights and a
random token ordering, and load in transformers as they load in qat4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from qat4.checkpoint.hf_layout import read_json
from qat4.checkpoint.hub import resolve
from qat4.checkpoint.safetensors_io import Entry, SafetensorsReader, SafetensorsWriter, write_text_atomic
from qat4.config import FULL, SLIDING, Gemma4Config
from qat4.errors import Qat4Error

MODEL_TYPE = "gemma4_assistant"
ARCHITECTURE = "Gemma4AssistantForCausalLM"
ORDERING = "masked_embedding.token_ordering"
UNUSED_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")  # never read


@dataclass(frozen=True)
class AssistantConfig:
    """The drafter's decoder (``text``: every layer reads the target's K/V, so its KV-sharing
    count is not kept) and how it meets its target and its vocabulary."""

    text: Gemma4Config
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool  # the centroid head; else the full output table
    num_centroids: int
    centroid_top_k: int  # clusters scored per draft token

    def __post_init__(self):
        t = self.text
        if t.hidden_size_per_layer_input or t.use_double_wide_mlp:
            raise Qat4Error("an MTP drafter's config must have hidden_size_per_layer_input 0 and use_double_wide_mlp false")
        if self.backbone_hidden_size < 1:
            raise Qat4Error(f"config field backbone_hidden_size is {self.backbone_hidden_size}; it must be positive")
        if self.use_ordered_embeddings:
            if self.num_centroids < 1 or t.vocab_size % self.num_centroids:
                raise Qat4Error(f"config field num_centroids is {self.num_centroids}; it must divide the vocabulary of {t.vocab_size}")
            if not 1 <= self.centroid_top_k <= self.num_centroids:
                raise Qat4Error(f"config field centroid_intermediate_top_k is {self.centroid_top_k}; "
                                f"it must be 1 to num_centroids ({self.num_centroids})")

    def shares_rope(self, target: Gemma4Config) -> bool:
        """Whether every layer type of the drafter rotates as ``target``'s does (its cos/sin tables
        can be the target's)."""
        return all(self.text.rope_parameters[kind] == target.rope_parameters.get(kind)
                   and self.text.layer_head_dim(i) == target.layer_head_dim(target.layer_types.index(kind))
                   for i, kind in enumerate(self.text.layer_types) if kind in target.layer_types)

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids

    @property
    def keys_behind(self) -> int:
        """Positions before a draft position its sliding layers read: transformers' window of
        |distance| <= W on its flipped key axis admits W + 1."""
        return self.text.sliding_window + 1

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "AssistantConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise Qat4Error(f"{source} is not an MTP drafter's config: its model_type is {raw.get('model_type')!r}, "
                            f"not {MODEL_TYPE!r}")
        if not isinstance(raw.get("text_config"), dict):
            raise Qat4Error(f"{source}: an MTP drafter's config needs a text_config object (the drafter's decoder)")
        text = dict(raw["text_config"])
        layers = text.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise Qat4Error(f"{source}: config field text_config.num_hidden_layers is {layers!r}; it must be a positive integer")
        shared = text.get("num_kv_shared_layers") or layers
        if shared != layers:
            raise Qat4Error(f"{source}: an MTP drafter's layers all read the target's K/V, so num_kv_shared_layers "
                            f"must equal num_hidden_layers ({layers}), not {shared!r}")
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text.get(key, 0):
                raise Qat4Error(f"{source}: config field text_config.{key} is {text[key]!r}; an MTP drafter has none (0)")
        if text.get("enable_moe_block") or text.get("use_double_wide_mlp"):
            raise Qat4Error(f"{source}: an MTP drafter has neither enable_moe_block nor use_double_wide_mlp")
        text.update(num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                    final_logit_softcapping=None, tie_word_embeddings=raw.get("tie_word_embeddings", True))
        try:
            return cls(
                text=Gemma4Config.from_hf_dict(text, source),
                backbone_hidden_size=int(raw.get("backbone_hidden_size", 1536)),
                use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
                num_centroids=int(raw.get("num_centroids", 2048)),
                centroid_top_k=int(raw.get("centroid_intermediate_top_k", 32)),
            )
        except (TypeError, ValueError) as exc:
            raise Qat4Error(f"{source} is not a readable MTP drafter config ({exc})") from None
        except Qat4Error as exc:
            raise Qat4Error(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict:
        """config.json as Google's drafter spells it (transformers reads it back)."""
        text = self.text.to_hf_text_dict()
        text.update(num_kv_shared_layers=self.text.num_hidden_layers, vocab_size_per_layer_input=0,
                    final_logit_softcapping=None, enable_moe_block=False)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "backbone_hidden_size": self.backbone_hidden_size,
            "use_ordered_embeddings": self.use_ordered_embeddings,
            "num_centroids": self.num_centroids,
            "centroid_intermediate_top_k": self.centroid_top_k,
            "tie_word_embeddings": self.text.tie_word_embeddings,
            "dtype": "bfloat16",
            "text_config": text,
        }

    def check_target(self, target: Gemma4Config, source: str) -> None:
        """Raise Qat4Error unless this drafter fits ``target``: its hidden size and vocabulary, and
        for each of its layer types a KV-owning target layer of that type and head width."""
        if self.backbone_hidden_size != target.hidden_size:
            raise Qat4Error(f"the drafter {source} was made for a model of hidden size {self.backbone_hidden_size}; "
                            f"this one has {target.hidden_size}")
        if self.text.vocab_size != target.vocab_size:
            raise Qat4Error(f"the drafter {source} has a vocabulary of {self.text.vocab_size}; the model has {target.vocab_size}")
        sources = target.first_shared_types()
        for i, kind in enumerate(self.text.layer_types):
            if kind not in sources:
                raise Qat4Error(f"drafter layer {i} of {source} reads {kind} K/V, which the model has none of")
            if self.text.layer_head_dim(i) != target.layer_head_dim(sources[kind]):
                raise Qat4Error(f"drafter layer {i} of {source} has heads of {self.text.layer_head_dim(i)}; "
                                f"the model's {kind} K/V (layer {sources[kind]}) are {target.layer_head_dim(sources[kind])} wide")


def expected_shapes(config: AssistantConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint holds (``lm_head.weight`` only when untied), by name."""
    t = config.text
    d, heads, width = t.hidden_size, t.num_attention_heads, t.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (t.vocab_size, d)}
    for i in range(t.num_hidden_layers):
        p, hd = f"model.layers.{i}.", t.layer_head_dim(i)
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (heads * hd, d),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "post_attention_layernorm.weight": (d,),
            p + "pre_feedforward_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (width, d),
            p + "mlp.up_proj.weight": (width, d),
            p + "mlp.down_proj.weight": (d, width),
            p + "post_feedforward_layernorm.weight": (d,),
            p + "layer_scalar": (1,),
        }
    shapes |= {
        "model.norm.weight": (d,),
        "pre_projection.weight": (d, 2 * config.backbone_hidden_size),
        "post_projection.weight": (config.backbone_hidden_size, d),
    }
    if not t.tie_word_embeddings:
        shapes["lm_head.weight"] = (t.vocab_size, d)
    if config.use_ordered_embeddings:
        shapes["masked_embedding.centroids.weight"] = (config.num_centroids, d)
        shapes[ORDERING] = (t.vocab_size,)
    return shapes


@dataclass
class AssistantCheckpoint:
    """A drafter read from disk: its config and every tensor in its stored dtype (host memory)."""

    config: AssistantConfig
    tensors: dict[str, torch.Tensor]
    source: Path

    def nbytes(self, dtype: torch.dtype) -> int:
        """Device bytes of its weights in compute dtype ``dtype`` (the token ordering as int64)."""
        item = torch.empty((), dtype=dtype).element_size()
        return sum(t.numel() * (8 if name == ORDERING else item) for name, t in self.tensors.items())


def load_assistant(path_or_id: str | Path) -> AssistantCheckpoint:
    """Read and check a drafter folder or Hub model id (``google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant``)."""
    folder = resolve(path_or_id)
    if not (folder / "config.json").is_file():
        raise Qat4Error(f"{folder} has no config.json; an MTP drafter is a folder of config.json and .safetensors files")
    config = AssistantConfig.from_hf_dict(read_json(folder / "config.json"), str(folder / "config.json"))
    reader = SafetensorsReader(folder)
    shapes = expected_shapes(config)
    present = set(reader.keys())
    tied_copy = config.text.tie_word_embeddings and "lm_head.weight" in present  # a materialised tied copy
    extra = sorted(n for n in present - set(shapes) if not n.endswith(UNUSED_KV) and not (tied_copy and n == "lm_head.weight"))
    if extra:
        raise Qat4Error(f"tensor {extra[0]} in {reader.file_of(extra[0])} is not part of an MTP drafter of this config")
    tensors = {}
    for name, shape in shapes.items():
        if name not in present:
            raise Qat4Error(f"the drafter {folder} has no tensor {name}")
        if tuple(reader.shape(name)) != shape:
            raise Qat4Error(f"tensor {name} in {reader.file_of(name)} is {reader.shape(name)}; its config asks for {list(shape)}")
        t = reader.get(name)
        if name == ORDERING:
            if t.dtype not in (torch.int32, torch.int64):
                raise Qat4Error(f"tensor {name} in {reader.file_of(name)} is {t.dtype}; token ids must be int32 or int64")
            if not torch.equal(t.long().sort().values, torch.arange(shape[0])):
                raise Qat4Error(f"tensor {name} in {reader.file_of(name)} is not an ordering of the {shape[0]} token ids")
        elif not t.is_floating_point():
            raise Qat4Error(f"tensor {name} in {reader.file_of(name)} is {t.dtype}; the drafter's weights are dense floats")
        tensors[name] = t
    return AssistantCheckpoint(config, tensors, folder)


# ---- synthetic drafters --------------------------------------------------------------------------

NORM_MEAN = (0.5, 1.5)
LAYER_SCALAR = (0.02, 0.8)


def synthetic_assistant_config(target: Gemma4Config) -> AssistantConfig:
    """The published E2B drafter's shape, scaled to ``target``: width target/6 (256 for E2B), four
    layers (three sliding, one full) of four query heads with the target's head widths, an MLP 8x
    its width, the target's window, RoPE and vocabulary, and 128 token ids per centroid, 32 scored."""
    d = max(32, target.hidden_size // 6 // 32 * 32)
    text = target.replace(
        hidden_size=d, intermediate_size=8 * d, num_hidden_layers=4, num_attention_heads=4,
        layer_types=(SLIDING, SLIDING, SLIDING, FULL), num_kv_shared_layers=0, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, use_double_wide_mlp=False, final_logit_softcapping=None, tie_word_embeddings=True,
    )
    centroids = max(1, target.vocab_size // 128)
    return AssistantConfig(text, target.hidden_size, True, centroids, min(32, centroids))


def synthetic_assistant_tensors(config: AssistantConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights (matrices N(0, 1/in), tables N(0, 1/d), norms around a random mean,
    layer scalars uniform 0.02-0.8) and a random token ordering, each from its own (seed, name) stream."""
    from qat4.checkpoint.synth import tensor_generator

    out = {}
    for name, shape in expected_shapes(config).items():
        g = tensor_generator(seed, "assistant/" + name)
        if name == ORDERING:
            out[name] = torch.randperm(shape[0], generator=g)
        elif name.endswith("layer_scalar"):
            out[name] = (torch.rand(shape, generator=g) * (LAYER_SCALAR[1] - LAYER_SCALAR[0]) + LAYER_SCALAR[0]).bfloat16()
        elif len(shape) == 1:
            mean = torch.rand(1, generator=g) * (NORM_MEAN[1] - NORM_MEAN[0]) + NORM_MEAN[0]
            out[name] = (mean * (torch.rand(shape, generator=g) * 1.5 + 0.5)).bfloat16()
        else:
            out[name] = (torch.randn(shape, generator=g) * shape[1] ** -0.5).bfloat16()
    return out


def write_synthetic_assistant(out: str | Path, target: Gemma4Config, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a synthetic drafter for ``target`` (config.json and model.safetensors) to folder ``out``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise Qat4Error(f"{out} already exists; pass --force to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Qat4Error(f"cannot create {out}: {exc.strerror or exc}") from None
    config = synthetic_assistant_config(target)
    tensors = synthetic_assistant_tensors(config, seed)
    with SafetensorsWriter(out, [Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
    write_text_atomic(out / "config.json", json.dumps(config.to_hf_dict(), indent=2) + "\n")
    return out
