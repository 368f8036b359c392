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
  ``ceil(W / block_size) + 1`` blocks whatever its length, or with speculative decoding those of
  its window and of :func:`spec_lookahead` positions past its newest token. (With the MTP
  drafter, which reads W + 1 positions behind its query, the pool's window is W + 2.) (A ring of W
  slots per sequence holds as much; pages also let a prompt chunk of any length write its keys
  before it attends, as a decode step does, since the window of the chunk's first query reaches
  W - 1 positions behind the chunk, and let one kernel read both layer types.)

Blocks are reference-counted: with the prompt cache on (:mod:`qat4.engine.prefix`), a block whose
tokens are known is named by their hash when its sequence lets go of it, stays cached until the pool
needs the room, and is shared read-only by every later sequence with the same prefix
(:meth:`KVPool.attach_prefix`); a sequence never writes into a block it did not allocate, since it
only writes positions after its restart point, which starts a block.

Block 0 of each pool is scratch and never handed out; table row ``max_seqs`` (the scratch row) is
all zeros, so the padding rows of a captured batch write and read block 0 and never a live
sequence's KV. Tables live on the device; the host keeps each slot's blocks and sends the new
entries at each step's launch (:meth:`KVPool.flush`), and again once a speculating step is
launched, for the blocks held ahead for the next (:meth:`qat4.engine.scheduler.Scheduler.reserve`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from itertools import count, repeat

import torch

from qat4.config import FULL, SLIDING, Gemma4Config
from qat4.engine.prefix import RecentChains
from qat4.engine.uploads import Uploader

TABLE_ALIGN = 64  # entries (256 bytes) between the starts of the block tables in their shared tensor


class PoolExhausted(Exception):
    """The pool has fewer free blocks (or slots) than asked for."""


class BlockAllocator:
    """The blocks of one pool: free, held (reference-counted by the sequences whose tables name
    them) and cached (held by none, kept for the prompt cache until the pool needs them, oldest
    first). Block 0 is scratch and never allocated.

    A cached block is one whose positions all hold the K/V of known tokens: :meth:`register`
    names it by the hash of the tokens from position 0 to its end (:mod:`qat4.engine.prefix`),
    :meth:`lookup_run` finds a chain of them again, :meth:`acquire` takes another reference. When
    its last holder lets go (:meth:`release`) a named block is cached instead of freed;
    :meth:`allocate` hands out free blocks first and takes the oldest cached ones only when none
    are left.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3, ...
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # held by none, oldest first

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones and cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks held by no sequence and kept for the prompt cache."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PoolExhausted(f"{n} blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds is cached when named, else freed."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def register(self, blocks: list[int], keys: list[bytes]) -> None:
        """Name each held block by its key, the hash of the tokens up to its end (block 0: none to
        name; a first name sticks; a second block with the same tokens stays unnamed and is freed
        when let go)."""
        block_of, hash_of = self._block_of, self._hash_of
        for block, key in zip(blocks, keys):
            if block and key not in block_of and block not in hash_of:
                block_of[key], hash_of[block] = block, key

    def held_once(self, block: int) -> bool:
        """Whether exactly one sequence holds the block (letting go makes it available)."""
        return self._refs[block] == 1

    def lookup_run(self, keys: list[bytes]) -> list[int]:
        """The blocks ``keys`` name, from the first key up to the first that names none."""
        blocks = list(map(self._block_of.get, keys))
        if None in blocks:
            del blocks[blocks.index(None):]
        return blocks

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference to each of these named blocks (out of the cache where nobody held it)."""
        for block in blocks:
            if not self._refs[block]:
                del self._cached[block]
            self._refs[block] += 1


def sliding_blocks_per_seq(window: int, block_size: int, max_ctx: int) -> int:
    """Blocks a decoding sequence holds on a sliding layer: its last ``window`` positions, on any
    alignment."""
    return min(math.ceil(window / block_size) + 1, math.ceil(max_ctx / block_size))


def spec_lookahead(spec_tokens: int) -> int:
    """Positions past its newest token a sequence drafting up to ``spec_tokens`` a step may hold
    KV for: the drafts of the step in flight, the token after them, and the next step's drafts,
    which :meth:`qat4.engine.scheduler.Scheduler.reserve` holds ahead."""
    return 2 * spec_tokens + 1 if spec_tokens else 0


def pool_blocks(config: Gemma4Config, *, kv_tokens: int, max_seqs: int, prefill_chunk: int, max_ctx: int,
                block_size: int, cache_blocks: int = 0, lookahead: int = 0, window: int | None = None) -> dict[str, int]:
    """Blocks per layer type (scratch included) of a pool holding ``kv_tokens`` full-attention
    positions, and on sliding layers the ``window`` (default the model's) of ``max_seqs`` decoding
    sequences (each with ``lookahead`` positions past its newest token, :func:`spec_lookahead`)
    plus one step's prompt chunk and ``cache_blocks`` for the prompt cache's restart windows."""
    kinds = {config.layer_types[i] for i in range(config.first_kv_shared_layer)}
    blocks = {}
    if FULL in kinds:
        blocks[FULL] = math.ceil(kv_tokens / block_size) + 1
    if SLIDING in kinds:
        per_seq = sliding_blocks_per_seq((window or config.sliding_window) + lookahead, block_size, max_ctx)
        blocks[SLIDING] = max_seqs * per_seq + math.ceil(prefill_chunk / block_size) + 1 + cache_blocks
    return blocks


def block_nbytes(config: Gemma4Config, kind: str, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of layer type ``kind``: its K and V over every layer of that type that
    owns K/V (0 without any)."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * config.layer_head_dim(i) * item
               for i in range(config.first_kv_shared_layer) if config.layer_types[i] == kind)


def table_stride(max_seqs: int, max_ctx: int, block_size: int) -> int:
    """Entries from one kind's block table [max_seqs + 1, ceil(max_ctx / block_size)] to the next
    in the pool's shared table tensor: the table, rounded up to TABLE_ALIGN."""
    entries = (max_seqs + 1) * math.ceil(max_ctx / block_size)
    return -(-entries // TABLE_ALIGN) * TABLE_ALIGN


def pool_nbytes(config: Gemma4Config, blocks: dict[str, int], block_size: int, max_seqs: int, max_ctx: int,
                dtype: torch.dtype) -> int:
    """Device bytes of a :class:`KVPool` with these blocks, without allocating."""
    kv = sum(n * block_nbytes(config, kind, block_size, dtype) for kind, n in blocks.items())
    return kv + len(blocks) * table_stride(max_seqs, max_ctx, block_size) * 4


class KVPool:
    """K/V pages of every KV-owning layer, the block allocators, and the block tables."""

    def __init__(self, config: Gemma4Config, blocks: dict[str, int], *, block_size: int, max_seqs: int, max_ctx: int,
                 device: torch.device, dtype: torch.dtype, prompt_cache: bool = True, window: int | None = None):
        self.config, self.block_size, self.max_seqs, self.max_ctx = config, block_size, max_seqs, max_ctx
        self.prompt_cache = prompt_cache
        # sliding positions kept for a query, itself included: the model's window, or more for a
        # drafter that reads further back (qat4.assistant)
        self.window = window or config.sliding_window
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
        # every kind's table [max_seqs + 1, width] in one flat tensor, so a step's new entries go in
        # with one copy; each starts TABLE_ALIGN entries apart (kernels keep their aligned variants)
        entries, stride = (max_seqs + 1) * width, table_stride(max_seqs, max_ctx, block_size)
        self._table_store = torch.zeros(len(blocks) * stride, dtype=torch.int32, device=device)
        self._table_offset = {kind: i * stride for i, kind in enumerate(blocks)}
        self.tables = {kind: self._table_store[o : o + entries].view(max_seqs + 1, width)
                       for kind, o in self._table_offset.items()}
        self._table_width = width
        self._held: list[dict[str, list[int]]] = [{kind: [] for kind in blocks} for _ in range(max_seqs)]
        self._live_from = [0] * max_seqs  # first sliding block index still held, per slot
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._updates: dict[str, list[tuple[int, int, int]]] = {kind: [] for kind in blocks}
        self.blocks = dict(blocks)
        self.uploads = Uploader(device)  # every host-to-device copy of the engine's steps
        self.recent = RecentChains(block_size) if prompt_cache else None  # names a chat's next turn reuses

    # ---- facts ---------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
        return kv + self._table_store.numel() * self._table_store.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Positions the full-attention pool holds over all sequences (the sliding pool when the
        model has no full-attention layer)."""
        kind = FULL if FULL in self.blocks else SLIDING
        return (self.blocks[kind] - 1) * self.block_size

    def cached_blocks(self) -> dict[str, int]:
        """Blocks per layer type kept by the prompt cache and held by no sequence."""
        return {kind: a.num_cached for kind, a in self.allocators.items()}

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

    def close_slot(self, slot: int, hashes: list[bytes] | None = None) -> None:
        """Give back a slot's blocks and the slot; with the prompt cache on, the blocks named by
        ``hashes`` (:meth:`Sequence.computed_block_hashes`) stay cached. The table row keeps stale
        entries, which nothing reads before the row's next owner writes over them."""
        for kind, held in self._held[slot].items():
            self._name(kind, held, 0, len(held), hashes)
            self.allocators[kind].release([b for b in held if b])
            held.clear()
            self._updates[kind] = [u for u in self._updates[kind] if u[0] != slot]  # never sent: nothing to undo
        self._live_from[slot] = 0
        self._free_slots.append(slot)

    def _name(self, kind: str, held: list[int], start: int, stop: int, hashes: list[bytes] | None) -> None:
        if self.prompt_cache and hashes:
            self.allocators[kind].register(held[start:stop], hashes[start:stop])

    def attach_prefix(self, slot: int, hashes: list[bytes], limit: int) -> int:
        """Give an empty slot the cached blocks of the longest prefix named by ``hashes`` that
        restarts before ``limit`` tokens (at least one token is left to read, for its logits):
        every full-attention block before the restart point and the sliding blocks its window
        sees (:mod:`qat4.engine.prefix`). Returns the tokens reused, a multiple of block_size."""
        if not self.prompt_cache:
            return 0
        bs = self.block_size
        restart = min(len(hashes), (limit - 1) // bs)
        if FULL in self.allocators:
            full = self.allocators[FULL].lookup_run(hashes[:restart])
            restart = len(full)
        if SLIDING in self.allocators:
            sliding = self.allocators[SLIDING]
            while restart:  # back off until the restart point's window is cached whole
                first = self._first_kept(restart * bs)
                if len(sliding.lookup_run(hashes[first:restart])) == restart - first:
                    break
                restart -= 1
        for kind, alloc in self.allocators.items():
            start = self._first_kept(restart * bs) if kind == SLIDING else 0
            # every one is named: the runs above reach restart
            blocks = full[:restart] if kind == FULL else alloc.lookup_run(hashes[start:restart])
            alloc.acquire(blocks)
            held = self._held[slot][kind]
            held.extend([0] * start)
            held.extend(blocks)
            self._updates[kind].extend(zip(repeat(slot), count(start), blocks))
            if kind == SLIDING:
                self._live_from[slot] = start
        return restart * bs

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

    def holds(self, slot: int, end: int, first_query: int) -> bool:
        """Whether growing the slot to ``end`` for queries from ``first_query`` on would change
        nothing: it holds the blocks already and has no sliding block to give back. A decoding
        sequence crosses a block boundary once every block_size steps, so most steps end here."""
        n = -(-end // self.block_size)
        held = self._held[slot]
        if any(len(blocks) < n for blocks in held.values()):
            return False
        return SLIDING not in held or self._first_kept(first_query) <= self._live_from[slot]

    def can_grow(self, slot: int, end: int, first_query: int) -> bool:
        return all(self.allocators[kind].num_free + self.freeable(slot, kind, first_query) >= n
                   for kind, n in self.blocks_to_grow(slot, end, first_query).items())

    def freeable(self, slot: int, kind: str, first_query: int) -> int:
        """Blocks of the slot that growing for queries from ``first_query`` on gives back: sliding
        blocks out of their window that no other sequence holds."""
        if kind != SLIDING:
            return 0
        held, alloc = self._held[slot][kind], self.allocators[kind]
        return sum(1 for b in held[self._live_from[slot] : self._first_kept(first_query)] if b and alloc.held_once(b))

    def grow(self, slot: int, end: int, first_query: int, hashes: Callable[[], list[bytes]] | None = None) -> None:
        """Hold positions up to ``end`` for queries from ``first_query`` on: give back the sliding
        blocks out of their reach (cached under ``hashes()`` when the prompt cache is on), then
        allocate what is missing (raises PoolExhausted, holding what it had)."""
        if SLIDING in self._held[slot]:
            self._trim(slot, first_query, hashes)
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

    def _trim(self, slot: int, first_query: int, hashes: Callable[[], list[bytes]] | None) -> None:
        held = self._held[slot][SLIDING]
        stop = min(self._first_kept(first_query), len(held))
        if stop <= self._live_from[slot]:
            return
        self._name(SLIDING, held, self._live_from[slot], stop, hashes() if hashes and self.prompt_cache else None)
        self.allocators[SLIDING].release([b for b in held[self._live_from[slot] : stop] if b])
        for i in range(self._live_from[slot], stop):
            held[i] = 0
        self._live_from[slot] = stop

    def flush(self) -> None:
        """Write the table entries of the blocks allocated since the last flush to the device,
        without waiting for it (from pinned memory, which is not reused before the copy ran): every
        kind's entries in one upload and one indexed copy, few calls for the host, which may have
        the GPU waiting. An entry written twice keeps its last block."""
        last = {}
        for kind, updates in self._updates.items():
            offset = self._table_offset[kind]
            for slot, i, block in updates:
                assert i < self._table_width, f"block {i} of slot {slot} is past the table's {self._table_width}"
                last[offset + slot * self._table_width + i] = block
            updates.clear()
        if last:
            index, blocks = self.uploads.new([list(last), list(last.values())])
            self._table_store.index_copy_(0, index, blocks.to(torch.int32))
