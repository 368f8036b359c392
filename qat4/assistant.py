"""Gemma 4's MTP drafter ("assistant") on its target's device: draft tokens from the target's
newest token, its hidden state and its K/V.

One draft step for a sequence whose newest token ``t`` sits at position ``p`` (not yet run through
the target), given the target's final-normed hidden state ``h`` at ``p - 1`` (the one whose logits
picked ``t``), as transformers' ``Gemma4AssistantForCausalLM`` runs one step:

1. ``x = pre_projection(concat(E_target[t] * sqrt(D_target), h))`` (2 D_target -> d).
2. The drafter's layers: each a Gemma 4 decoder layer whose attention has queries only (head norm,
   RoPE at ``p``) and reads the target's K/V of the last KV-owning target layer of its type, every
   position before ``p`` (sliding layers: the ``W + 1`` before it, transformers' window on its
   flipped key axis); nothing is written to any cache. No per-layer inputs.
3. ``y = RMSNorm(x)``; the draft is the argmax of the output table ``E_d · y``, scored, with the
   ordered embeddings, only over the token ids of the ``centroid_top_k`` best of
   ``num_centroids`` centroids (every other id is below them all); no softcap.
4. The next step continues from (draft, ``post_projection(y)``) at the same position ``p``.

Where transformers' generation loop (``SinglePositionMultiTokenCandidateGenerator``) feeds it
otherwise, qat4 follows the definition above: after a prompt that loop passes the hidden state of
the prompt's first position rather than its last, and after a partly refused verification it
leaves the refused draft's K/V at position ``p`` among the keys; qat4 always passes the state
behind ``t`` and the keys before ``p`` (what the target verified).

Matrices are dense in the target's compute dtype; the norms, head norms with RoPE and attention are
qat4's ops (Triton on CUDA, torch on the CPU), so a draft of a batch of sequences is a fixed
sequence of launches a CUDA graph can capture.

Shapes: B sequences, D target hidden, d drafter hidden, H drafter query heads, hd head dim of a
layer, I MLP width, V vocabulary, N = centroid_top_k x V / num_centroids candidate ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qat4.checkpoint.assistant import ORDERING, AssistantCheckpoint
from qat4.model import Gemma4, Pages, rope_table
from qat4.ops.attention import PagedSeqs, paged_attention
from qat4.ops.norms import residual_rms_norm, rms_norm
from qat4.ops.qkv_prep import qk_norm_rope


@dataclass
class AssistantLayer:
    kind: str
    head_dim: int
    window: int | None  # sliding layers: the keys before the draft position it reads (the attention's
    # window, for a query placed at p - 1); None on full layers
    source: int  # the target layer whose K/V it reads
    q_proj: torch.Tensor  # [H*hd, d]
    q_norm: torch.Tensor  # [hd]
    o_proj: torch.Tensor  # [d, H*hd]
    gate_up: torch.Tensor  # [2I, d]: gate rows, then up rows
    down: torch.Tensor  # [d, I]
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    scalar: torch.Tensor  # [1]


class Gemma4Assistant:
    """The drafter's weights on ``target``'s device in its dtype, and its draft step."""

    def __init__(self, checkpoint: AssistantCheckpoint, target: Gemma4, max_positions: int):
        cfg = self.config = checkpoint.config
        cfg.check_target(target.config, str(checkpoint.source))
        text = cfg.text
        self.target, self.eps, self.heads = target, text.rms_norm_eps, text.num_attention_heads
        device, dtype = target.device, target.dtype
        w = lambda name: checkpoint.tensors[name].to(device, dtype)  # noqa: E731
        self.output = w("model.embed_tokens.weight" if text.tie_word_embeddings else "lm_head.weight")
        self.pre_projection = w("pre_projection.weight")
        self.post_projection = w("post_projection.weight")
        self.norm = w("model.norm.weight")
        sources = target.config.first_shared_types()
        self.layers = []
        for i, kind in enumerate(text.layer_types):
            p = f"model.layers.{i}."
            self.layers.append(AssistantLayer(
                kind=kind, head_dim=text.layer_head_dim(i),
                window=cfg.keys_behind if text.is_sliding(i) else None, source=sources[kind],
                q_proj=w(p + "self_attn.q_proj.weight"), q_norm=w(p + "self_attn.q_norm.weight"),
                o_proj=w(p + "self_attn.o_proj.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
                input_norm=w(p + "input_layernorm.weight"), post_attention_norm=w(p + "post_attention_layernorm.weight"),
                pre_feedforward_norm=w(p + "pre_feedforward_layernorm.weight"),
                post_feedforward_norm=w(p + "post_feedforward_layernorm.weight"), scalar=w(p + "layer_scalar"),
            ))
        if cfg.shares_rope(target.config):
            self.rope = {kind: target.rope[kind] for kind in set(text.layer_types)}
        else:
            self.rope = {kind: rope_table(text, kind, max_positions, device, dtype) for kind in set(text.layer_types)}
        self.centroids = self.clusters = None
        if cfg.use_ordered_embeddings:
            self.centroids = w("masked_embedding.centroids.weight")  # [C, d]
            self.clusters = checkpoint.tensors[ORDERING].to(device, torch.int64).view(cfg.num_centroids, -1)  # [C, V/C]

    @property
    def nbytes(self) -> int:
        """Bytes of its weights and tables on the device, the target's RoPE tables it reads not counted."""
        shared = {t.data_ptr() for t in self.target.rope.values()}
        seen = {}
        for t in (self.output, self.pre_projection, self.post_projection, self.norm, self.centroids, self.clusters,
                  *self.rope.values(), *(t for layer in self.layers for t in vars(layer).values())):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in shared:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    # ---- one draft step ----------------------------------------------------------------------

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, pages: Pages,
             seqs: PagedSeqs) -> torch.Tensor:
        """ids [B] (the tokens at ``positions`` [B]) and hidden [B, D] -> the drafter's final-normed
        state y [B, d]. ``seqs`` places each sequence's query in the pool at ``positions - 1``, so
        it sees every key before its position."""
        x = F.linear(torch.cat([self.target.embed_input(ids), hidden], dim=-1), self.pre_projection)
        a = rms_norm(x, self.layers[0].input_norm, self.eps)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            x, a = self._block(layer, x, a, positions, pages, seqs, next_norm)
        return a

    def _block(self, layer: AssistantLayer, x: torch.Tensor, a: torch.Tensor, positions: torch.Tensor, pages: Pages,
               seqs: PagedSeqs, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: x [B, d] and its input norm a -> (x out, RMSNorm_next_norm(x out))."""
        B, H, hd, eps = x.shape[0], self.heads, layer.head_dim, self.eps
        q = F.linear(a, layer.q_proj).view(B, H, hd)
        q, _, _ = qk_norm_rope(q, None, None, positions, self.rope[layer.kind], layer.q_norm, None, eps)
        o = paged_attention(q, pages.k[layer.source], pages.v[layer.source], pages.tables[layer.kind],
                            pages.block_size, seqs, window=layer.window)
        x, m = residual_rms_norm(x, F.linear(o.reshape(B, H * hd), layer.o_proj), layer.post_attention_norm, None,
                                 layer.pre_feedforward_norm, eps)
        gate, up = F.linear(m, layer.gate_up).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, layer.down)
        return residual_rms_norm(x, y, layer.post_feedforward_norm, layer.scalar, next_norm, eps)

    def candidates(self, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The ids the head scores and their logits for y [B, d]: (ids [B, N], logits [B, N]) with
        the ordered embeddings, else (None, logits [B, V] over every id)."""
        if self.clusters is None:
            return None, F.linear(y, self.output)
        top = F.linear(y, self.centroids).topk(self.config.centroid_top_k, dim=-1).indices  # [B, K]
        ids = self.clusters[top].flatten(1)  # [B, N]
        return ids, (self.output[ids] @ y.unsqueeze(-1)).squeeze(-1)

    def next_token(self, y: torch.Tensor) -> torch.Tensor:
        """The draft token [B] of y [B, d]: the best-scoring candidate id."""
        ids, logits = self.candidates(y)
        best = logits.argmax(dim=-1, keepdim=True)
        return best.squeeze(1) if ids is None else ids.gather(1, best).squeeze(1)

    def draft(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, pages: Pages,
              rows: torch.Tensor, k: int, max_keys: int) -> torch.Tensor:
        """k draft tokens [B, k] after each sequence's newest token ids [B] at positions [B], from
        the target's hidden [B, D] behind it and its K/V in table rows ``rows`` [B] of ``pages``."""
        cu_q = torch.arange(ids.shape[0] + 1, device=ids.device)
        seqs = PagedSeqs(positions - 1, cu_q, rows, 1, max_keys)
        drafts = []
        for i in range(k):
            y = self.step(ids, hidden, positions, pages, seqs)
            ids = self.next_token(y)
            drafts.append(ids)
            if i + 1 < k:
                hidden = F.linear(y, self.post_projection)
        return torch.stack(drafts, dim=1)
