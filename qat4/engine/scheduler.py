"""Which sequences run in the next step, and with how many tokens each.

First come, first served. Every step, each running sequence that is decoding feeds its newest
token (a decode row; one whose token in flight is stale waits until it is read back, see
:mod:`qat4.engine.sequence`), and its drafts after it when it speculates and the pool has room for them
without preempting anyone; prompts are read in chunks of at most ``prefill_chunk`` tokens per step,
over all the sequences reading one, so a long prompt that arrives mid-stream delays the running
sequences by one chunk per step, never by its whole read. A prompt's chunks always start at
multiples of ``prefill_chunk``; a chunk that does not fit in what the step has left waits for the
next step.

A waiting sequence is admitted when one of the pool's ``max_seqs`` slots is free and the pool has
room for its whole prompt with a block to spare for every running sequence. When the pool runs out
while the running sequences grow, the most recently admitted one is preempted: it gives back its
KV and goes to the front of the queue, to be read again later, prompt and output together (a seed
keys each draw by its position, so the continuation is the one it would have produced). A prompt
chunk never preempts its own sequence: it waits, its KV kept, for a later step. A request that the
pool cannot hold even alone is refused when it is added (:meth:`Scheduler.check_fits`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

from qat4.engine.kv_cache import KVPool
from qat4.engine.sequence import Sequence, State
from qat4.errors import Qat4Error


@dataclass
class Batch:
    """One step's work: decoding sequences (their newest token and as many drafts each,
    graph-capturable) and prompt chunks (a sequence and how many of its tokens, from
    ``num_computed`` on)."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """The waiting queue and the running set over one KV pool."""

    def __init__(self, pool: KVPool, *, prefill_chunk: int):
        self.pool, self.prefill_chunk = pool, prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted_total = 0

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise Qat4Error when a request of this size could never run, even alone."""
        need = prompt_tokens + max_new_tokens
        if need > self.pool.capacity_tokens:
            raise Qat4Error(
                f"the prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} needs {need} tokens "
                f"of KV, more than the pool holds ({self.pool.capacity_tokens}, kv_tokens)"
            )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        """The next step's batch; allocates the KV blocks it writes (on the host side)."""
        batch = Batch()
        budget = self.prefill_chunk
        self._drop_drafts_without_room()
        for seq in list(self.running):
            if seq.state is not State.RUNNING:  # preempted by a sequence before it
                continue
            feed = seq.length - seq.num_computed
            if feed == 1:
                if seq.wants_token and not seq.stale and self._grow(seq, seq.length + len(seq.drafts),
                                                                      preempt_self=True):
                    batch.decode.append(seq)
            elif feed > 1:
                n = self._chunk(seq, budget)
                if n and self._grow(seq, seq.num_computed + n, preempt_self=False):
                    batch.prefill.append((seq, n))
                    budget -= n
        while self.waiting and budget and self.pool.num_free_slots:
            seq = self.waiting[0]
            if seq.pending:  # a preempted sequence whose last token is still on its way back
                break
            n = self._admit(seq, budget)
            if not n:
                break
            batch.prefill.append((seq, n))
            budget -= n
        return batch

    def reserve(self, seqs: list[Sequence], ahead: int) -> None:
        """Hold KV through ``ahead`` positions past each of ``seqs``' known tokens, and send the
        new blocks' table entries now. Called once a speculating step is launched, while the GPU
        runs it: the next step waits for this one's tokens, and finds its blocks in place instead
        of allocating and uploading them while the GPU idles. Nothing is held ahead while a
        running sequence is still reading its prompt (it was admitted on the free blocks for the
        rest of it), and a sequence takes only blocks that are neither cached nor one of the
        spares every running sequence's next step may need, so holding ahead never costs another
        sequence its place or the prompt cache a block."""
        pool, spare = self.pool, len(self.running)
        if any(s.length - s.num_computed > 1 for s in self.running):
            return
        for seq in seqs:
            # never past the last position it can feed (its last token is never fed)
            end = min(seq.num_known + ahead, len(seq.prompt) + seq.max_new_tokens - 1)
            first_query = seq.num_computed - 1  # the step in flight's first query
            need = pool.blocks_to_grow(seq.slot, end, first_query)
            if any(need.values()) and all(pool.allocators[kind].num_free - pool.allocators[kind].num_cached >= n + spare
                                          for kind, n in need.items()):
                pool.grow(seq.slot, end, first_query, partial(seq.computed_block_hashes, pool.block_size))
        pool.flush()

    def _drop_drafts_without_room(self) -> None:
        """Drafts only where the pool holds them beside everything else: when the free blocks do
        not cover every drafting sequence's positions through its drafts, none drafts this step
        (a draft never preempts a sequence, and a step's sequences draft alike or not at all)."""
        drafting = [s for s in self.running if s.drafts]
        if not drafting:
            return
        pool = self.pool
        for kind, alloc in pool.allocators.items():
            need = sum(pool.blocks_to_grow(s.slot, s.length + len(s.drafts), s.num_computed)[kind]
                       - pool.freeable(s.slot, kind, s.num_computed) for s in drafting)
            if need > alloc.num_free:
                for s in drafting:
                    s.drafts = []
                return

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's prompt to read now: the rest of its current chunk if the budget holds
        it, else none."""
        start = seq.num_computed
        n = min(self.prefill_chunk - start % self.prefill_chunk, seq.num_known - start)
        return n if n <= budget else 0

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit seq when the pool has room for its whole prompt beside a block for every running
        sequence's next step, its KV read from the prompt cache as far as it reaches; returns
        the tokens of its first chunk (0: not admitted)."""
        pool, bs, spare = self.pool, self.pool.block_size, len(self.running)
        slot = pool.open_slot()
        hit = pool.attach_prefix(slot, seq.block_hashes(bs, seq.num_known, pool.recent), seq.num_known)
        seq.num_computed = hit
        n = self._chunk(seq, budget)

        def room(end: int, first_query: int) -> bool:
            """Whether the slot can hold positions up to end beside a block for every running
            sequence (the cached blocks it took and will give back counted as available)."""
            return all(pool.allocators[kind].num_free + pool.freeable(slot, kind, first_query) >= need + spare
                       for kind, need in pool.blocks_to_grow(slot, end, first_query).items())

        if not n or not room(seq.num_known, seq.num_known - 1) or not room(hit + n, hit):
            pool.close_slot(slot)
            seq.num_computed = 0
            return 0
        self.waiting.popleft()
        pool.grow(slot, hit + n, hit)
        seq.state, seq.slot, seq.new_slot = State.RUNNING, slot, True
        if not seq.started:
            seq.started, seq.cached_tokens = time.perf_counter(), hit
        self.running.append(seq)
        return n

    def _grow(self, seq: Sequence, end: int, preempt_self: bool) -> bool:
        """Hold KV for seq's positions up to ``end``, preempting newer sequences while the pool is
        short. When only seq itself is left to preempt: a decoding sequence gives its KV back (and
        is read again later), a prompt chunk waits for the next step with its KV kept. False when
        seq does not run this step."""
        if self.pool.holds(seq.slot, end, seq.num_computed):
            return True
        while not self.pool.can_grow(seq.slot, end, seq.num_computed):
            victim = self.running[-1]
            if victim is seq and not preempt_self:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        self.pool.grow(seq.slot, end, seq.num_computed, lambda: seq.computed_block_hashes(self.pool.block_size))
        return True

    # ---- leaving -----------------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's KV; it waits at the front of the queue to be read again."""
        self.running.remove(seq)
        self.pool.close_slot(seq.slot, seq.computed_block_hashes(self.pool.block_size))
        seq.state, seq.slot, seq.num_computed = State.WAITING, None, 0
        seq.preemptions += 1
        self.preempted_total += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (a stop, its limit, or an abort) and give back its slot and KV at once: the
        device runs steps in order, so a step still in flight that writes its old blocks does so
        before any later owner's step."""
        if seq.finished:
            return
        if seq.state is State.RUNNING:
            self.running.remove(seq)
            names = seq.computed_block_hashes(self.pool.block_size)
            self.pool.close_slot(seq.slot, names)
            if self.pool.recent is not None:
                self.pool.recent.remember(seq.tokens, names)
        else:
            self.waiting.remove(seq)
        seq.state, seq.slot, seq.constraint = State.FINISHED, None, None  # the grammar state goes with it
        seq.finish_reason = seq.finish_reason or reason
