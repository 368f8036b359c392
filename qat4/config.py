"""Gemma 4 text configuration: read from config.json or GGUF metadata, per-layer facts derived.

Saved configs come in three spellings: Google's (`text_config` nested,
`global_head_dim` present), the text-only repacks (same keys at the top level) and transformers'
own `save_pretrained` diff (keys equal to the class defaults omitted, `per_layer_config` instead of
`global_head_dim`). All three parse to one `Gemma4Config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from qat4.errors import Qat4Error

SLIDING = "sliding_attention"
FULL = "full_attention"

# transformers 5.17 Gemma4TextConfig class defaults: what a diff-saved config.json leaves out.
# They are *not* E2B's values; they only fill keys a file omitted.
_HF_CLASS_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "hidden_activation": "gelu_pytorch_tanh",
}
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Gemma4Config:
    """The Gemma 4 text decoder's shape and constants; per-layer facts are methods."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_parameters: dict = field(default_factory=lambda: json.loads(json.dumps(_DEFAULT_ROPE)))
    max_position_embeddings: int = 131_072
    hidden_size_per_layer_input: int = 256
    vocab_size_per_layer_input: int = 262_144
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_id: tuple[int, ...] = (1, 106, 50)
    pad_token_id: int = 0

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise Qat4Error(
                f"config field layer_types has {len(self.layer_types)} entries "
                f"but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise Qat4Error(f"config field layer_types holds unknown layer type {bad[0]!r}")
        if self.num_key_value_heads != 1:
            raise Qat4Error(
                f"config field num_key_value_heads is {self.num_key_value_heads}; "
                "qat4 runs Gemma 4 E2B-style models with a single KV head"
            )
        if self.num_kv_shared_layers >= self.num_hidden_layers:
            raise Qat4Error("config field num_kv_shared_layers must be below num_hidden_layers")
        for t in set(self.layer_types):
            if t not in self.first_shared_types():
                raise Qat4Error(f"no layer below the KV-shared ones has type {t}, so shared layers of that type have no cache to read")

    # ---- per-layer facts -------------------------------------------------------------------

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_kv_shared_layer

    def first_shared_types(self) -> dict[str, int]:
        """Layer type -> the last KV-owning layer of that type (the one shared layers read)."""
        sources: dict[str, int] = {}
        for i in range(self.first_kv_shared_layer):
            sources[self.layer_types[i]] = i
        return sources

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V cache `layer` attends over (itself when it owns one)."""
        if self.owns_kv(layer):
            return layer
        return self.first_shared_types()[self.layer_types[layer]]

    def mlp_width(self, layer: int) -> int:
        doubled = self.use_double_wide_mlp and not self.owns_kv(layer)
        return self.intermediate_size * (2 if doubled else 1)

    def rope(self, layer: int) -> dict:
        return self.rope_parameters[self.layer_types[layer]]

    @property
    def per_layer_width(self) -> int:
        """Columns of the per-layer embedding table: num_hidden_layers x hidden_size_per_layer_input."""
        return self.num_hidden_layers * self.hidden_size_per_layer_input

    # ---- parsing -----------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "Gemma4Config":
        """Parse a transformers-style config dict (top-level or nested `text_config`)."""
        cfg = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
        get = lambda key: cfg.get(key, _HF_CLASS_DEFAULTS.get(key))  # noqa: E731
        try:
            n_layers = int(get("num_hidden_layers"))
            layer_types = cfg.get("layer_types") or [
                SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)
            ]
            layer_types = list(layer_types)
            layer_types[-1] = FULL
            global_head_dim = cfg.get("global_head_dim")
            if global_head_dim is None:
                overrides = cfg.get("per_layer_config") or {}
                dims = {int(v["head_dim"]) for v in overrides.values() if isinstance(v, dict) and "head_dim" in v}
                global_head_dim = dims.pop() if len(dims) == 1 else _HF_CLASS_DEFAULTS["global_head_dim"]
            rope = cfg.get("rope_parameters") or _DEFAULT_ROPE
            eos = get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else (int(eos),)
            tie = raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
            return cls(
                vocab_size=int(get("vocab_size")),
                hidden_size=int(get("hidden_size")),
                intermediate_size=int(get("intermediate_size")),
                num_hidden_layers=n_layers,
                num_attention_heads=int(get("num_attention_heads")),
                num_key_value_heads=int(get("num_key_value_heads")),
                head_dim=int(get("head_dim")),
                global_head_dim=int(global_head_dim),
                layer_types=tuple(layer_types),
                sliding_window=int(get("sliding_window")),
                rope_parameters={k: dict(v) for k, v in rope.items()},
                max_position_embeddings=int(get("max_position_embeddings")),
                hidden_size_per_layer_input=int(get("hidden_size_per_layer_input")),
                vocab_size_per_layer_input=int(get("vocab_size_per_layer_input")),
                num_kv_shared_layers=int(get("num_kv_shared_layers")),
                use_double_wide_mlp=bool(get("use_double_wide_mlp")),
                rms_norm_eps=float(get("rms_norm_eps")),
                final_logit_softcapping=get("final_logit_softcapping"),
                tie_word_embeddings=bool(tie),
                bos_token_id=int(get("bos_token_id")),
                eos_token_id=eos,
                pad_token_id=int(get("pad_token_id")),
            )
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise Qat4Error(f"{source} is not a readable Gemma 4 text config ({exc})") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "Gemma4Config":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise Qat4Error(f"{path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise Qat4Error(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_hf_dict(raw, source=str(path))

    def to_hf_text_dict(self) -> dict:
        """The text config as Google's files spell it (explicit keys, `global_head_dim`)."""
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["eos_token_id"] = list(self.eos_token_id)
        out.update(
            model_type="gemma4_text",
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=False,
            attention_dropout=0.0,
            attention_k_eq_v=False,
            enable_moe_block=False,
            num_global_key_value_heads=None,
            use_bidirectional_attention=None,
        )
        return out

    def replace(self, **changes) -> "Gemma4Config":
        return dataclasses.replace(self, **changes)


def _pattern(n_layers: int, period: int) -> tuple[str, ...]:
    return tuple(FULL if i % period == period - 1 else SLIDING for i in range(n_layers))


E2B = Gemma4Config(
    vocab_size=262_144,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    global_head_dim=512,
    layer_types=_pattern(35, 5),
    sliding_window=512,
    num_kv_shared_layers=20,
    use_double_wide_mlp=True,
)

# Small enough for CPU tests, yet every structural feature of E2B: sliding and full layers, a small
# window (the ring wraps within a short test), KV sharing by type, double-wide MLP on shared layers,
# per-layer inputs, proportional partial RoPE and the final softcap; the real vocabulary.
TINY = E2B.replace(
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=10,
    head_dim=32,
    global_head_dim=64,
    layer_types=_pattern(10, 5),
    sliding_window=8,
    num_kv_shared_layers=4,
    hidden_size_per_layer_input=32,
    max_position_embeddings=4096,
)

PRESETS = {"tiny": TINY, "e2b": E2B}
SYNTHETIC = "synthetic:"  # --model synthetic:PRESET: random on-grid weights of a preset


def synthetic_config(model: str) -> Gemma4Config:
    """The preset config of a `synthetic:PRESET` --model; an unknown preset is a Qat4Error."""
    preset = model[len(SYNTHETIC):]
    if preset not in PRESETS:
        raise Qat4Error(f"--model {model}: unknown synthetic preset; use one of {', '.join(SYNTHETIC + p for p in PRESETS)}")
    return PRESETS[preset]
