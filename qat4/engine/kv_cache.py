"""The KV pool: K/V pages of every KV-owning layer, shared by all running sequences.

Only layers below ``config.first_kv_shared_layer`` own K/V (E2B: 12 sliding layers of width 256
and 3 full-attention layers of width 512); KV-shared layers read their source layer's pages
(``config.kv_source``). Each layer type has one pool of blocks of ``block_size`` positions and
one allocator; a layer's K and V are [num_blocks * block_size, D] in the compute dtype, and a
sequence's position ``p`` sits at row ``table[slot, p // block_size] * block_size + p %
block_size`` of every layer of that type (``qat4.ops.attention``).

- Full-attention layers keep a block for every ``block_size`` positions a sequence holds, so one
  131,072-token conversation and many short ones share the same memory.
- Sliding layers are paged the same way, but a block whose positions have all left the window of
  every query still to come is given back at once: a decoding sequence holds at most
  ``ceil(W / block_size) + 1`` blocks whatever its length. (A ring of W slots per sequence
  holds as much; pages also let a prompt chunk of any length write its keys before it attends,
  as a decode step does, since the window of the chunk's first query reaches W - 1 positions
  behind the chunk, and let one kernel read both layer types.)

Block 0 of each pool is scratch and never handed out; table row ``max_seqs`` (the scratch row) is
all zeros, so the padding rows of a captured batch write and read block 0 and never a live
sequence's KV. Tables live on the device; the host keeps each slot's blocks and sends the new
entries once per step (:meth:`KVPool.flush`).
"""

from __future__ import annotations

import math

import torch

from qat4.config import FULL, SLIDING, Gemma4Config



def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA through pinned memory
    (PyTorch's pinned allocator keeps the block until the copy has run), as is elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PoolExhausted(Exception):
    """The pool has fewer free blocks (or slots) than asked for."""


class BlockAllocator:
    """Free block ids of one pool; block 0 is scratch and never allocated."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{n} blocks asked for, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def sliding_blocks_per_seq(window: int, block_size: int, max_ctx: int) -> int:
    """Blocks a decoding sequence holds on a sliding layer: its last ``window`` positions, on any
    alignment."""
    return min(math.ceil(window / block_size) + 1, math.ceil(max_ctx / block_size))


def pool_blocks(config: Gemma4Config, *, kv_tokens: int, max_seqs: int, prefill_chunk: int, max_ctx: int,
                block_size: int) -> dict[str, int]:
    """Blocks per layer type (scratch included) of a pool holding ``kv_tokens`` full-attention
    positions, and on sliding layers the window of ``max_seqs`` decoding sequences plus one
    step's prompt chunk."""
    kinds = {config.layer_types[i] for i in range(config.first_kv_shared_layer)}
    blocks = {}
    if FULL in kinds:
        blocks[FULL] = math.ceil(kv_tokens / block_size) + 1
    if SLIDING in kinds:
        per_seq = sliding_blocks_per_seq(config.sliding_window, block_size, max_ctx)
        blocks[SLIDING] = max_seqs * per_seq + math.ceil(prefill_chunk / block_size) + 1
    return blocks


def pool_nbytes(config: Gemma4Config, blocks: dict[str, int], block_size: int, max_seqs: int, max_ctx: int,
                dtype: torch.dtype) -> int:
    """Device bytes of a :class:`KVPool` with these blocks, without allocating."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for i in range(config.first_kv_shared_layer):
        total += 2 * blocks[config.layer_types[i]] * block_size * config.layer_head_dim(i) * item
    return total + len(blocks) * (max_seqs + 1) * math.ceil(max_ctx / block_size) * 4


class KVPool:
    """K/V pages of every KV-owning layer, the block allocators, and the block tables."""

    def __init__(self, config: Gemma4Config, blocks: dict[str, int], *, block_size: int, max_seqs: int, max_ctx: int,
                 device: torch.device, dtype: torch.dtype):
        self.config, self.block_size, self.max_seqs, self.max_ctx = config, block_size, max_seqs, max_ctx
        self.window = config.sliding_window
        self.device = device
        self.scratch_row = max_seqs
        self.allocators = {kind: BlockAllocator(n) for kind, n in blocks.items()}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in range(config.first_kv_shared_layer):
            rows = blocks[config.layer_types[i]] * block_size
            d = config.layer_head_dim(i)
            self.k[i] = torch.zeros(rows, d, dtype=dtype, device=device)
            self.v[i] = torch.zeros(rows, d, dtype=dtype, device=device)
        width = math.ceil(max_ctx / block_size)
        self.tables = {kind: torch.zeros(max_seqs + 1, width, dtype=torch.int32, device=device) for kind in blocks}
        self._held: list[dict[str, list[int]]] = [{kind: [] for kind in blocks} for _ in range(max_seqs)]
        self._live_from = [0] * max_seqs  # first sliding block index still held, per slot
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._updates: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in blocks}
        self.blocks = dict(blocks)

    # ---- facts ---------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
        return kv + sum(t.numel() * t.element_size() for t in self.tables.values())

    @property
    def capacity_tokens(self) -> int:
        """Positions the full-attention pool holds over all sequences (the sliding pool when the
        model has no full-attention layer)."""
        kind = FULL if FULL in self.blocks else SLIDING
        return (self.blocks[kind] - 1) * self.block_size

    def usage(self) -> dict[str, float]:
        """Share of each pool's blocks in use (scratch left out)."""
        return {kind: a.num_used / max(1, a.num_blocks - 1) for kind, a in self.allocators.items()}

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def held_blocks(self, slot: int) -> dict[str, int]:
        """Blocks a slot holds per layer type (freed sliding blocks not counted)."""
        return {kind: sum(1 for b in held if b) for kind, held in self._held[slot].items()}

    # ---- slots ---------------------------------------------------------------------------------

    def open_slot(self) -> int:
        """A free table row for a new sequence."""
        if not self._free_slots:
            raise PoolExhausted("every sequence slot is taken")
        return self._free_slots.pop()

    def close_slot(self, slot: int) -> None:
        """Give back a slot's blocks and the slot. Its table row keeps stale entries, which
        nothing reads before the row's next owner writes over them."""
        for kind, held in self._held[slot].items():
            self.allocators[kind].free([b for b in held if b])
            held.clear()
        self._live_from[slot] = 0
        self._free_slots.append(slot)

    # ---- blocks --------------------------------------------------------------------------------

    def _first_kept(self, first_query: int) -> int:
        """Index of the first sliding block a query at ``first_query`` or later can still see."""
        return max(0, first_query - self.window + 1) // self.block_size

    def blocks_to_grow(self, slot: int, end: int, first_query: int) -> dict[str, int]:
        """New blocks per layer type for the slot to hold positions up to ``end`` (exclusive) once
        its sliding blocks before the window of ``first_query`` are given back."""
        need = {}
        n = math.ceil(end / self.block_size)
        for kind, held in self._held[slot].items():
            start = self._first_kept(first_query) if kind == SLIDING else 0
            need[kind] = max(0, n - max(len(held), start))
        return need

    def can_grow(self, slot: int, end: int, first_query: int) -> bool:
        return all(self.allocators[kind].num_free + self._freeable(slot, kind, first_query) >= n
                   for kind, n in self.blocks_to_grow(slot, end, first_query).items())

    def _freeable(self, slot: int, kind: str, first_query: int) -> int:
        if kind != SLIDING:
            return 0
        held = self._held[slot][kind]
        return sum(1 for b in held[self._live_from[slot] : self._first_kept(first_query)] if b)

    def grow(self, slot: int, end: int, first_query: int) -> None:
        """Hold positions up to ``end`` for queries from ``first_query`` on: give back the sliding
        blocks out of their reach, then allocate what is missing (raises PoolExhausted, holding
        what it had)."""
        if SLIDING in self._held[slot]:
            self._trim(slot, first_query)
        for kind, n in self.blocks_to_grow(slot, end, first_query).items():
            if not n:
                continue
            held = self._held[slot][kind]
            new = self.allocators[kind].allocate(n)
            start = max(len(held), self._first_kept(first_query) if kind == SLIDING else 0)
            held.extend([0] * (start - len(held)))
            for i, block in enumerate(new):
                held.append(block)
                self._updates[kind].append((slot, start + i, block))

    def _trim(self, slot: int, first_query: int) -> None:
        held = self._held[slot][SLIDING]
        stop = min(self._first_kept(first_query), len(held))
        if stop <= self._live_from[slot]:
            return
        self.allocators[SLIDING].free([b for b in held[self._live_from[slot] : stop] if b])
        for i in range(self._live_from[slot], stop):
            held[i] = 0
        self._live_from[slot] = stop

    def flush(self) -> None:
        """Write the table entries of the blocks allocated since the last flush to the device,
        without waiting for it (from pinned memory, which is not reused before the copy ran)."""
        for kind, updates in self._updates.items():
            if updates:
                index = to_device(torch.tensor(updates, dtype=torch.int64).T, self.device)
                self.tables[kind].index_put_((index[0], index[1]), index[2].to(torch.int32))
                updates.clear()

    # ---- rows ----------------------------------------------------------------------------------

    def store_rows(self, kind: str, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows [T] int64 of positions [T] of the sequences in table rows slots [T] (device
        tensors; graph-capturable)."""
        bs = self.block_size
        return self.tables[kind][slots, positions // bs].long() * bs + positions % bs
