"""The Gemma 4 text decoder over a PackedModel, written once on top of qat4.ops.

Every op dispatches itself (CPU tensors: torch references; CUDA tensors: Triton kernels), so the
same code runs a tiny model on the CPU against transformers and E2B on a GPU. Weights stay packed
int4; at load time q/k/v (KV-owning layers) are merged by row concatenation and gate/up by
alternating rows, so the GELU gate runs in the projection's epilogue (group steps keep their stored
16-bit dtype), and RoPE cos/sin tables are built per layer type. Each residual step runs in the
epilogue of the projection that feeds it (one launch per projection in decode).

Shapes: T tokens, D hidden, H query heads, d head dim of the layer (one KV head), I MLP width,
L layers, P per-layer-input width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qat4.checkpoint.packed_model import PackedModel
from qat4.checkpoint.packing import PackedTensor
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error
from qat4.ops.attention import PagedSeqs, paged_attention
from qat4.ops.norms import rms_norm
from qat4.ops.qkv_prep import qk_norm_rope, qk_norm_rope_store, rope_cos_sin_cache, rope_inv_freq
from qat4.ops.w4.dispatch import expands_products, w4_argmax, w4_linear, w4_linear_gelu, w4_linear_residual, w4_logits
from qat4.ops.w4.embedding import w4_embedding
from qat4.ops.w4.expanded import expand_matrix, has_scratch, reserve_scratch
from qat4.ops.w4.reference import ResidualStep
from qat4.ops.w4.tiling import MatvecTilings

class Pages(Protocol):
    """The KV pages a forward reads and writes (:class:`qat4.engine.kv_cache.KVPool`): K and V
    [rows, d] of each KV-owning layer, a block table per layer type, the block size."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    tables: dict[str, torch.Tensor]
    block_size: int


@dataclass
class ForwardBatch:
    """Where a flat batch of tokens sits in the KV pool: the sequences' query layout for the
    attention (:class:`qat4.ops.attention.PagedSeqs`) and the block-table row [T] int64 of each
    token's sequence, through which its keys are written (at its position's pool row)."""

    seqs: PagedSeqs
    slots: torch.Tensor


def largest_product(config: Gemma4Config) -> int:
    """Weights of the largest matrix a forward multiplies by (the output layer aside): the merged
    gate/up of the widest MLP, the merged q/k/v, or the per-layer projection."""
    layers = range(config.num_hidden_layers)
    rows = [2 * config.mlp_width(i) for i in layers] + [config.per_layer_width]
    rows += [(config.num_attention_heads + 2) * config.layer_head_dim(i) for i in layers]
    return max(rows) * config.hidden_size


def dense_nbytes(config: Gemma4Config, dtype: torch.dtype) -> int:
    """Bytes of a 16-bit copy of every matrix the layers and the per-layer projection multiply by
    (``dense_weights``): 3.75 GB in bf16 on E2B; the embeddings and the output layer have none."""
    layers = range(config.num_hidden_layers)
    d = config.hidden_size
    weights = config.per_layer_width * d
    for i in layers:
        head_dim, heads = config.layer_head_dim(i), config.num_attention_heads
        weights += (heads + (2 if config.owns_kv(i) else 0)) * head_dim * d + d * heads * head_dim  # q/k/v, o_proj
        weights += 3 * config.mlp_width(i) * d + 2 * config.hidden_size_per_layer_input * d  # gate/up, down, per-layer
    return weights * torch.empty((), dtype=dtype).element_size()


CUBLAS_WORKSPACE_NBYTES = 32 << 20  # what cuBLAS keeps per thread and stream on Hopper (torch's default)


def expansion_nbytes(config: Gemma4Config, dtype: torch.dtype, device: torch.device, streams: int = 1) -> int:
    """Bytes the expanded prompt products (:mod:`qat4.ops.w4.expanded`) of this model take: their
    scratch, unless one that holds the largest matrix is reserved already, and the workspace
    cuBLAS keeps for each of the ``streams`` that run them (the engine's; with CUDA graphs also
    the warm-up and capture streams); 0 where they do not take that path."""
    if not expands_products(dtype, device):
        return 0
    numel = largest_product(config)
    scratch = 0 if has_scratch(device, dtype, numel) else numel * torch.empty((), dtype=dtype).element_size()
    return scratch + streams * CUBLAS_WORKSPACE_NBYTES


def dtype_round(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as transformers casts its embedding scales (√1536 -> 39.25 in bf16)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


@dataclass
class Layer:
    """One decoder layer's weights (matrices packed, vectors in the compute dtype) and facts."""

    index: int
    kind: str  # config layer type: rope table and mask
    head_dim: int
    window: int | None  # sliding window in positions, None on full-attention layers
    owns_kv: bool
    qkv: PackedTensor  # [H*d (+ 2d when owns_kv), D]: q, then k and v rows
    o_proj: PackedTensor  # [D, H*d]
    gate_up: PackedTensor  # [2I, D]: rows alternate gate and up
    down: PackedTensor  # [D, I]
    ple_gate: PackedTensor  # per_layer_input_gate [P, D]
    ple_proj: PackedTensor  # per_layer_projection [D, P]
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    post_ple_norm: torch.Tensor
    q_norm: torch.Tensor  # [d]
    k_norm: torch.Tensor | None  # [d], KV-owning layers only
    scalar: torch.Tensor  # layer_scalar [1]


def rope_table(config: Gemma4Config, kind: str, max_positions: int, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """cos/sin table [max_positions, 2 n_rot] of the layers of type ``kind`` of ``config``."""
    params = config.rope_parameters[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or params.get("factor", 1.0) != 1.0:
        raise Qat4Error(
            f"config field rope_parameters.{kind} asks for RoPE scaling {rope_type!r}, which qat4 does not run"
        )
    head_dim = config.layer_head_dim(config.layer_types.index(kind))
    inv_freq = rope_inv_freq(
        head_dim, float(params["rope_theta"]), float(params.get("partial_rotary_factor", 1.0)),
        proportional=rope_type == "proportional",
    )
    return rope_cos_sin_cache(inv_freq.to(device), max_positions, dtype)


class Gemma4:
    """The text decoder on one device in one compute dtype.

    ``forward`` runs a flat batch of tokens of any number of sequences over a paged KV pool and
    returns the final-normed hidden states; ``logits`` / ``argmax`` apply the output layer and
    softcap. With ``expand`` (the memory plan's choice) it reserves the scratch in which prompt
    products expand their matrices (:mod:`qat4.ops.w4.expanded`); without it they run the GEMM.
    With ``dense`` (``dense_weights``) it also keeps a 16-bit copy of every matrix its products
    multiply by (:func:`dense_nbytes`), which products of DENSE_ROWS rows or more multiply with
    cuBLAS instead (:mod:`qat4.ops.w4.dispatch`).
    ``tilings`` holds the decode GEMV tilings it pins and those it launched
    (:class:`qat4.ops.w4.tiling.MatvecTilings`), its own: another model in the process has others.
    """

    def __init__(self, model: PackedModel, device: torch.device | str, dtype: torch.dtype, max_positions: int,
                 expand: bool = False, dense: bool = False):
        cfg = self.config = model.config
        self.device, self.dtype = torch.device(device), dtype
        self.eps = cfg.rms_norm_eps
        self.heads = cfg.num_attention_heads
        self.softcap = cfg.final_logit_softcapping
        self.tilings = MatvecTilings()
        self.embed_tokens = self._matrix(model["embed_tokens"])
        self.output = self.embed_tokens if model.lm_head is None else self._matrix(model.lm_head)
        self.ple_table = self._matrix(model["embed_tokens_per_layer"])
        self.ple_projection = self._matrix(model["per_layer_model_projection"])
        self.ple_norm = self._vector(model["per_layer_projection_norm"])
        self.norm = self._vector(model["norm"])
        self.embed_scale = dtype_round(cfg.hidden_size**0.5, dtype)
        self.ple_scale = dtype_round(cfg.hidden_size_per_layer_input**0.5, dtype)
        self.layers = [self._layer(model, i) for i in range(cfg.num_hidden_layers)]
        self.rope = {kind: rope_table(cfg, kind, max_positions, self.device, dtype) for kind in set(cfg.layer_types)}
        if expand and expands_products(dtype, self.device):
            reserve_scratch(self.device, dtype, largest_product(cfg))
        self.dense: dict[int, torch.Tensor] = {}  # id of a PackedTensor -> its 16-bit copy
        if dense and expands_products(dtype, self.device):
            for w in (self.ple_projection, *(getattr(layer, name) for layer in self.layers
                                             for name in ("qkv", "o_proj", "gate_up", "down", "ple_gate", "ple_proj"))):
                self.dense[id(w)] = expand_matrix(w.packed, w.scales, dtype)

    def _matrix(self, t: PackedTensor) -> PackedTensor:
        """A packed matrix on the device. fp16 group steps become bf16 under bf16 compute where
        bf16 holds every one of them exactly (8 significant bits: the synthetic checkpoints' steps
        have 4), so that the decode-batch kernel unpacks two weights per instruction
        (:func:`~qat4.ops.w4.batch.unpacks_pairs`); bf16 steps become fp16 under fp16 compute
        (GPUs without bf16). Other steps keep their stored dtype: the kernels read them as fp32,
        so fp16 steps stay exact under bf16 compute."""
        steps = t.scales
        if steps.dtype == torch.bfloat16 and self.dtype == torch.float16:
            steps = steps.to(torch.float16)
        elif steps.dtype == torch.float16 and self.dtype == torch.bfloat16:
            as_bf16 = steps.to(torch.bfloat16)
            if torch.equal(as_bf16.to(torch.float16), steps):
                steps = as_bf16
        return PackedTensor(t.packed.to(self.device), steps.to(self.device))

    def _vector(self, t: torch.Tensor) -> torch.Tensor:
        """A norm weight or layer scalar on the device in the compute dtype."""
        return t.to(self.device, self.dtype)

    def _layer(self, model: PackedModel, i: int) -> Layer:
        """Layer i's weights: q/k/v merged by row concatenation, gate/up by alternating rows."""
        cfg, p = self.config, f"layers.{i}."
        mat = lambda name: self._matrix(model[name])  # noqa: E731
        vec = lambda name: self._vector(model[name])  # noqa: E731
        attn = p + "self_attn."
        owns = cfg.owns_kv(i)
        qkv = model[attn + "q_proj"]
        if owns:
            qkv = qkv.cat_rows(model[attn + "k_proj"], model[attn + "v_proj"])
        return Layer(
            index=i,
            kind=cfg.layer_types[i],
            head_dim=cfg.layer_head_dim(i),
            window=cfg.sliding_window if cfg.is_sliding(i) else None,
            owns_kv=owns,
            qkv=self._matrix(qkv),
            o_proj=mat(attn + "o_proj"),
            gate_up=self._matrix(model[p + "mlp.gate_proj"].interleave_rows(model[p + "mlp.up_proj"])),
            down=mat(p + "mlp.down_proj"),
            ple_gate=mat(p + "per_layer_input_gate"),
            ple_proj=mat(p + "per_layer_projection"),
            input_norm=vec(p + "input_layernorm"),
            post_attention_norm=vec(p + "post_attention_layernorm"),
            pre_feedforward_norm=vec(p + "pre_feedforward_layernorm"),
            post_feedforward_norm=vec(p + "post_feedforward_layernorm"),
            post_ple_norm=vec(p + "post_per_layer_input_norm"),
            q_norm=vec(attn + "q_norm"),
            k_norm=vec(attn + "k_norm") if owns else None,
            scalar=vec(p + "layer_scalar"),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every weight and table this model holds on its device (shared tensors once)."""
        seen: dict[int, int] = {}

        def add(t):
            if isinstance(t, PackedTensor):
                add(t.packed)
                add(t.scales)
            elif isinstance(t, torch.Tensor):
                seen[t.data_ptr()] = t.numel() * t.element_size()

        for t in (self.embed_tokens, self.output, self.ple_table, self.ple_projection, self.ple_norm, self.norm,
                  *self.rope.values()):
            add(t)
        for layer in self.layers:
            for t in vars(layer).values():
                add(t)
        return sum(seen.values())

    # ---- products ----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w: PackedTensor) -> torch.Tensor:
        """x [T, in] @ w.T -> [T, out] straight from the packed words."""
        return w4_linear(x, w.packed, w.scales, tilings=self.tilings, dense=self.dense.get(id(w)))

    def linear_gelu(self, x: torch.Tensor, w: PackedTensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """gelu_tanh(x @ gate.T) * (x @ up.T) for w with alternating gate/up rows [2I, in] -> [T, I];
        or gelu_tanh(x @ w.T) * up for a given up [T, out]."""
        return w4_linear_gelu(x, w.packed, w.scales, up, tilings=self.tilings, dense=self.dense.get(id(w)))

    def linear_residual(self, x: torch.Tensor, w: PackedTensor,
                        step: ResidualStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, in] @ w.T fed into a residual step -> (h out [T, D], next input norm [T, D] or None)."""
        return w4_linear_residual(x, w.packed, w.scales, step, tilings=self.tilings, dense=self.dense.get(id(w)))

    # ---- forward -----------------------------------------------------------------------------

    def embed_input(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> the scaled input embedding h0 [T, D]."""
        return w4_embedding(ids, self.embed_tokens.packed, self.embed_tokens.scales, self.embed_scale, self.dtype)

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] int64 -> (h0 [T, D], per-layer inputs [T, L, P])."""
        cfg = self.config
        T, L, P = ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        h = self.embed_input(ids)
        token_part = w4_embedding(ids, self.ple_table.packed, self.ple_table.scales, self.ple_scale, self.dtype)
        context = self.linear(h, self.ple_projection) * cfg.hidden_size**-0.5
        context = rms_norm(context.view(T, L, P), self.ple_norm, self.eps)
        return h, (context + token_part.view(T, L, P)) * 2**-0.5

    def _attention(self, layer: Layer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                   positions: torch.Tensor, pages: Pages, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, d] (and k, v [T, 1, d] when the layer owns its KV) straight from the projection
        -> attention output [T, H, d]: head norms and RoPE, k and v stored at the tokens' pool rows,
        then attention over the KV source's pages."""
        rope = self.rope[layer.kind]
        if layer.owns_kv:
            q = qk_norm_rope_store(q, k, v, positions, rope, layer.q_norm, layer.k_norm, pages.k[layer.index],
                                   pages.v[layer.index], pages.tables[layer.kind], pages.block_size, batch.slots,
                                   self.eps)
        else:
            q, _, _ = qk_norm_rope(q, None, None, positions, rope, layer.q_norm, None, self.eps)
        source = self.config.kv_source(layer.index)
        return paged_attention(q, pages.k[source], pages.v[source], pages.tables[layer.kind], pages.block_size,
                               batch.seqs, window=layer.window)

    def _block(self, layer: Layer, h: torch.Tensor, x: torch.Tensor, ple: torch.Tensor, positions: torch.Tensor,
               pages: Pages, batch: ForwardBatch, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: h [T, D] and its input norm x -> (h out, RMSNorm_next_norm(h out))."""
        T, H, d, eps = h.shape[0], self.heads, layer.head_dim, self.eps
        qkv = self.linear(x, layer.qkv)
        q = qkv[:, : H * d].view(T, H, d)
        k = qkv[:, H * d : (H + 1) * d].view(T, 1, d) if layer.owns_kv else None
        v = qkv[:, (H + 1) * d :].view(T, 1, d) if layer.owns_kv else None
        o = self._attention(layer, q, k, v, positions, pages, batch)
        h, x = self.linear_residual(
            o.reshape(T, H * d), layer.o_proj,
            ResidualStep(h, layer.post_attention_norm, next_weight=layer.pre_feedforward_norm, eps=eps))
        h, _ = self.linear_residual(self.linear_gelu(x, layer.gate_up), layer.down,
                                    ResidualStep(h, layer.post_feedforward_norm, eps=eps))
        gated = self.linear_gelu(h, layer.ple_gate, ple[:, layer.index])
        return self.linear_residual(gated, layer.ple_proj,
                                    ResidualStep(h, layer.post_ple_norm, layer.scalar, next_norm, eps))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, pages: Pages, batch: ForwardBatch) -> torch.Tensor:
        """ids [T] at positions [T] (int64, on the device) -> final-normed hidden [T, D].

        The tokens of any number of sequences in one flat batch (``batch``): a decode step (one
        token per sequence), prompt chunks, or both. Every KV-owning layer writes the tokens' keys
        and values at their pool rows before any layer attends. Shapes and launches depend on T
        and the batch's host bounds only, so a decode batch is captured once and replayed at
        every position.
        """
        h, ple = self.embed(ids)
        x = rms_norm(h, self.layers[0].input_norm, self.eps)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            h, x = self._block(layer, h, x, ple, positions, pages, batch, next_norm)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed h [T, D] -> softcapped logits [T, V] fp32."""
        return w4_logits(h, self.output.packed, self.output.scales, self.softcap)

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed h [T, D] -> greedy token ids [T] int64 (the logits are never stored)."""
        return w4_argmax(h, self.output.packed, self.output.scales, self.softcap)

