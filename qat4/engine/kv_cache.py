"""The engine-owned KV cache of the Gemma 4 text decoder.

Only layers below ``config.first_kv_shared_layer`` own K/V; KV-shared layers read their source
layer's buffers (``config.kv_source``). Every owning layer holds K and V as [S, D] in the compute
dtype (one KV head, D = that layer's head dim):

- full-attention layers: S = max_ctx, slot = position;
- sliding layers: a ring of S = sliding_window slots, slot = position % W, and ``slot_pos`` [S]
  holding the absolute position stored in each slot (-1 = empty).

Masks go by absolute position (``qat4.ops.attention``), so stale slots beyond the current length
of a full layer are never seen and ``reset`` only has to empty the rings. A decode step writes
(``qat4.ops.norms.qk_norm_rope_store``: slot pos, or pos % W on a ring, recorded in ``slot_pos``)
and reads through device tensors only (``pos`` [1] int64), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qat4.config import Gemma4Config

KV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(K [S, D], V [S, D], key positions [S] int64 or None when slot = position)."""


@dataclass
class LayerKV:
    """One KV-owning layer's buffers. ``slot_pos`` is None for a full layer (slot = position)."""

    k: torch.Tensor
    v: torch.Tensor
    slot_pos: torch.Tensor | None

    @property
    def ring(self) -> bool:
        return self.slot_pos is not None

    @property
    def nbytes(self) -> int:
        pos = 0 if self.slot_pos is None else self.slot_pos.numel() * self.slot_pos.element_size()
        return self.k.numel() * self.k.element_size() * 2 + pos


class KVCache:
    """K/V buffers of every KV-owning layer, allocated once for ``max_ctx`` positions."""

    def __init__(self, config: Gemma4Config, max_ctx: int, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.max_ctx = max_ctx
        self.window = config.sliding_window
        self.positions = torch.arange(max_ctx, dtype=torch.int64, device=device)
        self.layers: dict[int, LayerKV] = {}
        for i in range(config.first_kv_shared_layer):
            d = config.layer_head_dim(i)
            ring = config.is_sliding(i)
            slots = self.window if ring else max_ctx
            self.layers[i] = LayerKV(
                torch.zeros(slots, d, dtype=dtype, device=device),
                torch.zeros(slots, d, dtype=dtype, device=device),
                torch.full((slots,), -1, dtype=torch.int64, device=device) if ring else None,
            )

    @staticmethod
    def estimate_nbytes(config: Gemma4Config, max_ctx: int, dtype: torch.dtype) -> int:
        """Bytes ``KVCache(config, max_ctx, ...)`` allocates, without allocating."""
        item = torch.empty((), dtype=dtype).element_size()
        total = max_ctx * 8  # positions
        for i in range(config.first_kv_shared_layer):
            slots = config.sliding_window if config.is_sliding(i) else max_ctx
            total += 2 * slots * config.layer_head_dim(i) * item + (slots * 8 if config.is_sliding(i) else 0)
        return total

    @property
    def nbytes(self) -> int:
        return sum(kv.nbytes for kv in self.layers.values()) + self.positions.numel() * 8

    def reset(self) -> None:
        """Forget the sequence: empty every ring (full layers are masked by position)."""
        for kv in self.layers.values():
            if kv.ring:
                kv.slot_pos.fill_(-1)

    # ---- prefill -----------------------------------------------------------------------------

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> KV:
        """Store a chunk's keys and return what its queries attend over.

        k, v [C, D] for positions start .. start+C-1 of KV-owning ``layer``. Returns (K, V, k_pos):
        - full layer: the chunk is written at its slots, then the slots [0, start+C) are returned
          with positions 0 .. start+C-1;
        - sliding layer: [ring ; chunk] with their positions (ring slots hold the previous <= W
          positions, -1 where empty). That concatenation is a copy taken before the ring is
          touched; only then are the last min(C, W) chunk positions written into the ring. Writing
          first would overwrite keys that the chunk's early queries still need.
        """
        kv = self.layers[layer]
        end = start + k.shape[0]
        if not kv.ring:
            kv.k[start:end] = k
            kv.v[start:end] = v
            return kv.k[:end], kv.v[:end], self.positions[:end]
        positions = self.positions[start:end]
        seen = (torch.cat([kv.k, k]), torch.cat([kv.v, v]), torch.cat([kv.slot_pos, positions]))
        keep = min(k.shape[0], self.window)
        slots = positions[-keep:] % self.window
        kv.k.index_copy_(0, slots, k[-keep:])
        kv.v.index_copy_(0, slots, v[-keep:])
        kv.slot_pos.index_copy_(0, slots, positions[-keep:])
        return seen

    # ---- decode ------------------------------------------------------------------------------

    def view(self, layer: int) -> KV:
        """(K, V, slot_pos) of ``layer``'s KV source, for decode attention."""
        kv = self.layers[self.config.kv_source(layer)]
        return kv.k, kv.v, kv.slot_pos
