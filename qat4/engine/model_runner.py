"""Runs the model over one step's batch and hands the sampled tokens back to the host a step late.

A step has two parts, both enqueued before the host waits for anything:

- **decode rows**, one token per sequence, or with speculative decoding ``q`` = 1 + k tokens per
  sequence (its newest token and k drafts, every one sampled): on CUDA a graph captured per padded
  batch size (1, 2, 4, 8, then every 16 up to ``max_num_seqs``), per ``q`` and per sampling shape
  (``keep``, see :mod:`qat4.engine.sampler`), replayed with the rows' ids, positions and slots
  copied into its static input buffer (a verifying step's graph copies them in itself, from
  pinned memory the host writes just before the replay, :meth:`ModelRunner.load_rows`); the
  padding rows point at the pool's scratch row. A row whose id is still on the device (the token
  sampled by the previous step) reads it from ``last_token[slot]``.
- **prompt chunks**: the tokens of one or more prompts as one flat batch. On CUDA a step's chunks
  run padded to the next of :func:`~qat4.engine.graphs.chunk_graph_sizes` (up to
  ``prefill_chunk`` tokens, so every step the scheduler makes), replayed from a graph of that size
  when graphs are on (so a graph and an eager engine compute the same). One graph per size serves
  one sequence, another up to min(size, max_num_seqs) sequences, the unused ones empty; the
  padding rows belong to no sequence (no query attends from them, every other op is row by row)
  and store their K/V on the scratch row; the picks of chunks that do not end their prompt, and
  of the empty sequences, land on the scratch row too. Without the padding a prompt step is some
  700 launches from Python (40 ms of host time on an H200's host, whatever the chunk's length),
  which is most of a short prompt's time to its first token and stalls every decoding sequence
  for as long.

Each sampled token is written to ``last_token[slot]`` on the device (the next step's input) and to
a pinned host buffer; :meth:`ModelRunner.launch` returns a :class:`StepTokens` that waits for that
copy only when read. Every host-to-device copy of a step goes through pinned memory without a
wait. The engine launches step n + 1 before it reads step n, so the GPU never idles while the host
schedules. Graphs are captured at load writing only to the scratch row, never into a live
sequence's KV.

Per-slot sampling parameters (temperature, top_k, top_p, seed) live on the device, set when a
sequence is admitted (:meth:`ModelRunner.set_sampling`), and so does each slot's allowed-token
bitmask (``allowed``, all ones until a grammar-constrained sequence's step writes its row,
:meth:`ModelRunner.set_allowed`). A step with a constrained row runs its *masked* variant (its own
graphs, keyed by ``masked``): logits for every row, the disallowed tokens of each row at -inf, then
the per-row sampler, where a greedy row takes the argmax of its masked logits. Steps without one
keep the fused argmax of greedy rows, so unconstrained decoding runs exactly as before.

A constrained row's mask follows from its newest token, which the step before is still sampling
when the next is launched. Such a step's decode rows are launched *pick deferred*
(``defer_pick``): their forward (a graph of sampling shape 0, which keeps the final hidden rows in
``_hidden``) is enqueued at once, and their masked pick (a graph of q = 0: no rows fed, the pick
of ``_hidden``) by :meth:`ModelRunner.finish_pick` once the host has read the step before and
written the masks. The device runs the forward while the host reads, accepts and fills. Likewise a
step with a row that asks for logprobs runs its *scored* variant (graphs keyed by ``scored`` too,
independent of ``masked``): logits for every row, and per row the picked token's log-probability
and the most likely tokens (:mod:`qat4.engine.logprobs`, of the logits before any mask) into
buffers copied to pinned host buffers beside the tokens. With ``keep_hidden`` (the MTP drafter,
:mod:`qat4.engine.mtp`) each step also keeps, per slot, the final-normed hidden state that picked
the sequence's newest token (``last_hidden``): a decode row's, a prompt's last row's, or in a
verifying step the row of the last draft the target agreed with.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from qat4.engine.graphs import capture_graph, chunk_graph_sizes, graph_sizes, uses_graphs
from qat4.engine.kv_cache import KVPool
from qat4.engine.logprobs import TokenLogprobs, read_scores, score, score_buffers, top_width
from qat4.engine.sampler import SamplingParams, keep_shape, mask_logits, sample
from qat4.engine.sequence import Sequence
from qat4.model import ForwardBatch, Gemma4
from qat4.ops.attention import PagedSeqs
from qat4.ops.draws import uniforms


def flat_chunks(chunks: list[tuple[Sequence, int]]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Prompt chunks (sequence, tokens from ``num_computed`` on) as one flat batch: the tokens' ids,
    positions and slots, the first token of each chunk then the total (cu_q), each chunk's slot."""
    ids, positions, slots, cu, rows = [], [], [], [0], []
    for seq, n in chunks:
        start = seq.num_computed
        ids += seq.tokens[start : start + n]
        positions += range(start, start + n)
        slots += [seq.slot] * n
        cu.append(cu[-1] + n)
        rows.append(seq.slot)
    return ids, positions, slots, cu, rows


def bitmask_width(vocab_size: int) -> int:
    """32-bit words of an allowed-token bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class StepTokens:
    """The tokens a launched step samples for each of its sequences (decode rows, then prompt rows
    that finished their prompt), readable once the device has produced them: one per sequence, or
    1 + k for a decoding sequence that fed k drafts (``drafts``, as launched). A scored step also
    brings back each row's logprobs (``host_scores``: host buffers of logprobs [N, 1 + K] and ids [N, K])."""

    def __init__(self, seqs: list[Sequence], drafts: list[list[int]], host: torch.Tensor,
                 event: torch.cuda.Event | None, host_scores: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.seqs, self.drafts, self.host, self.event, self.host_scores = seqs, drafts, host, event, host_scores

    @property
    def verifies(self) -> bool:
        """Whether the step fed drafts (how many of its tokens count is known only once read)."""
        return any(self.drafts)

    @property
    def _rows(self) -> int:
        return sum(1 + len(d) for d in self.drafts)

    def _spans(self) -> list[tuple[int, int]]:
        """(first row, rows) of each sequence in the step's flat tokens."""
        spans, i = [], 0
        for d in self.drafts:
            spans.append((i, 1 + len(d)))
            i += 1 + len(d)
        return spans

    def read(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()
        flat = self.host[: self._rows].tolist()
        return [flat[i : i + n] for i, n in self._spans()]

    def logprobs(self, tokens: list[list[int]]) -> list[list[TokenLogprobs] | None]:
        """Once read, per sequence: the TokenLogprobs of its ``tokens`` (as :meth:`read` gave them)
        with as many top tokens as it asks for (``Sequence.logprobs``); None for a sequence that
        asks for none, and for every one of a step that was not scored."""
        if self.host_scores is None:
            return [None] * len(self.seqs)
        values, ids = (t[: self._rows].tolist() for t in self.host_scores)
        return [None if seq.logprobs is None else
                [read_scores(token, values[i + j], ids[i + j], seq.logprobs) for j, token in enumerate(picked)]
                for seq, (i, _), picked in zip(self.seqs, self._spans(), tokens)]


class ModelRunner:
    """The model, the KV pool and the per-slot device state of one engine."""

    def __init__(self, model: Gemma4, pool: KVPool, *, max_num_seqs: int, use_graph: bool, max_rows: int = 0,
                 keep_hidden: bool = False, max_chunk: int = 0, pad_chunks: bool | None = None):
        """``max_chunk``: the most prompt tokens a step reads (``prefill_chunk``); ``pad_chunks``:
        run prompt steps padded to :func:`chunk_graph_sizes` (default: on CUDA, where they can
        replay graphs)."""
        dev = model.device
        self.model, self.pool, self.device = model, pool, dev
        self.max_num_seqs, self.max_ctx = max_num_seqs, pool.max_ctx
        rows = max(max_num_seqs, max_rows)  # decode rows of one step: sequences times (1 + drafts)
        self.use_graph = uses_graphs(use_graph, dev)
        self.vocab_size = model.config.vocab_size
        slots = max_num_seqs + 1  # the last is the scratch row
        self.last_token = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_k = torch.ones(slots, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.allowed = torch.full((slots, bitmask_width(self.vocab_size)), -1, dtype=torch.int32, device=dev)
        hidden = model.config.hidden_size
        self.last_hidden = torch.zeros(slots, hidden, dtype=model.dtype, device=dev) if keep_hidden else None
        self.sizes = graph_sizes(max_num_seqs)
        self._meta = torch.zeros(3, rows, dtype=torch.int64, device=dev)  # ids (-1: on device), positions, slots
        # on CUDA a verifying step's rows, which its graph copies into _meta first (:meth:`load_rows`),
        # and an event after the last verifying step launched
        self._verify_rows = torch.zeros(3, rows, dtype=torch.int64, pin_memory=True) if dev.type == "cuda" else None
        self._verify_host = None if self._verify_rows is None else self._verify_rows.numpy()
        self._verify_done = torch.cuda.Event() if dev.type == "cuda" else None
        self._cu_q = torch.arange(max_num_seqs + 1, dtype=torch.int64, device=dev)
        self._decoded = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._hidden = torch.zeros(max_num_seqs, hidden, dtype=model.dtype, device=dev)  # rows awaiting a deferred pick
        self.top = top_width(self.vocab_size)  # most likely tokens of a scored row
        self._scores = score_buffers(rows, self.top, dev)  # decode rows' logprobs [rows, 1 + top], ids [rows, top]
        pinned = dev.type == "cuda"
        self._host = [torch.zeros(rows + max_num_seqs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_scores = [score_buffers(rows + max_num_seqs, self.top, torch.device("cpu"), pinned)
                             for _ in range(2)]
        self._turn = 0
        # (batch size, q, keep, masked, scored); q 0: the deferred pick, keep 0: the forward alone
        self.graphs: dict[tuple[int, int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None
        # padded prompt steps: ids, positions, slots [3, T]; for S sequences cu_q [S + 1], their
        # table rows [S], the rows that pick [S] and the slots they pick for [S]; the picked tokens
        pad = dev.type == "cuda" if pad_chunks is None else pad_chunks
        self.chunk_sizes = chunk_graph_sizes(max_chunk) if pad and max_chunk else []
        width = max(self.chunk_sizes, default=0)
        self._chunk_meta = torch.zeros(3, width, dtype=torch.int64, device=dev)
        self._chunk_seqs = torch.zeros(4 * self.chunk_seqs(width) + 1, dtype=torch.int64, device=dev)
        self._chunk_tokens = torch.zeros(self.chunk_seqs(width), dtype=torch.int64, device=dev)
        self._chunk_scores = score_buffers(self.chunk_seqs(width), self.top, dev)
        # (padded tokens, sequences, keep; 0: no pick, masked, scored) -> graph, or None once run
        # eagerly without graphs
        self.chunk_graphs: dict[tuple[int, int, int, bool, bool], torch.cuda.CUDAGraph | None] = {}

    # ---- per-slot state ------------------------------------------------------------------------

    def set_sampling(self, slots: list[int], params: list[SamplingParams], seeds: list[int]) -> None:
        """Newly admitted sequences' sampling parameters into their slots (temperature 0 marks a
        greedy row), their allowed-token rows back to all ones. Two pinned uploads without a wait,
        one for the integers and one for the floats: a Python number written into a device tensor
        is a blocking copy, which would stall the host until the step in flight had finished."""
        index, top_k, seed = self.pool.uploads.new([slots, [p.effective_top_k(self.vocab_size) for p in params], seeds])
        floats = torch.tensor([[0.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params]],
                              dtype=torch.float32, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        self.temperature.index_copy_(0, index, floats[0])
        self.top_p.index_copy_(0, index, floats[1])
        self.top_k.index_copy_(0, index, top_k)
        self.seed.index_copy_(0, index, seed)
        self.allowed.index_fill_(0, index, -1)

    def set_allowed(self, slots: list[int], bitmasks: torch.Tensor) -> None:
        """The allowed-token bitmasks [len(slots), W] int32 of constrained sequences into their
        slots (bit j of word i allows token 32 i + j), for the next pick enqueued: a step's, or a deferred
        one's (:meth:`finish_pick`)."""
        index = self.pool.uploads.new([slots])[0]
        if self.device.type == "cuda":  # int32 rows of a constrained step, through PyTorch's pinned allocator
            bitmasks = bitmasks.pin_memory().to(self.device, non_blocking=True)
        self.allowed.index_copy_(0, index, bitmasks)

    def keep_for(self, seqs: list[Sequence]) -> int:
        """The sampling shape (:func:`qat4.engine.sampler.keep_shape`) serving these sequences."""
        return keep_shape([s.params.effective_top_k(self.vocab_size) for s in seqs], self.vocab_size)

    # ---- the pieces of a step ------------------------------------------------------------------

    def _batch(self, slots: torch.Tensor, positions: torch.Tensor, cu_q: torch.Tensor, rows: torch.Tensor,
               max_q_len: int, max_keys: int) -> ForwardBatch:
        seqs = PagedSeqs(positions, cu_q, rows, max_q_len, max_keys)
        return ForwardBatch(seqs, slots)

    def pick(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, keep: int,
             masked: bool = False, scores: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Next token [R] of hidden rows h [R, D] whose tokens sit at ``positions`` [R] in the
        sequences of ``slots`` [R]: the fused argmax when every row is greedy (keep 1), none is
        ``masked`` and none is scored, else the logits (with each slot's disallowed tokens at -inf
        when masked) and per-row sampling with each slot's parameters. With ``scores`` (buffers
        of R rows, :func:`qat4.engine.logprobs.score_buffers`) each row's token is scored there
        under its unmasked logits."""
        if keep == 1 and not masked and scores is None:
            return self.model.argmax(h)
        logits = self.model.logits(h)
        unmasked = logits.clone() if masked and scores is not None else logits
        if masked:
            mask_logits(logits, self.allowed[slots])
        tokens = self.sample(logits, slots, positions, keep)
        if scores is not None:
            score(unmasked, tokens, scores)
        return tokens

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, keep: int) -> torch.Tensor:
        """Per-row sampling of logits [R, V] with the parameters of ``slots`` [R], drawing for the
        tokens after ``positions`` [R]. With keep 1 every row is greedy (:func:`keep_shape`): the
        argmax alone, without the draws and the sampler's launches (a masked or scored greedy pick)."""
        if keep == 1:
            return torch.argmax(logits, dim=-1)
        draws = uniforms(self.seed[slots], positions + 1)
        return sample(logits, self.temperature[slots], self.top_k[slots], self.top_p[slots], draws, keep)

    def _decode(self, b: int, q: int, keep: int, masked: bool, scored: bool) -> None:
        """The decode rows of ``_meta[:, :b * q]`` (with q > 1 on CUDA first copied in from
        ``_verify_rows``), q consecutive positions for each of b sequences: forward, pick a token
        at every row (:meth:`_pick_rows`); what a graph captures. With keep 0 the forward alone,
        its hidden rows into ``_hidden`` (q = 1); with q = 0 the pick alone, of the b rows in
        ``_hidden`` (a deferred pick)."""
        if q == 0:
            self._pick_rows(self._hidden[:b], b, 1, keep, masked, scored)
            return
        if self._rows_in_graph(q):
            self._meta.copy_(self._verify_rows, non_blocking=True)
        ids, positions, slots = self._meta[:, : b * q]
        ids = torch.where(ids >= 0, ids, self.last_token[slots])
        rows = slots if q == 1 else slots[::q].contiguous()
        batch = self._batch(slots, positions, self._cu_q[: b + 1] * q if q > 1 else self._cu_q[: b + 1], rows, q,
                            self.max_ctx)
        h = self.model.forward(ids, positions, self.pool, batch)
        if keep:
            self._pick_rows(h, b, q, keep, masked, scored)
        else:
            self._hidden[:b].copy_(h)

    def _pick_rows(self, h: torch.Tensor, b: int, q: int, keep: int, masked: bool, scored: bool) -> None:
        """Pick a token at each of the b * q hidden rows h of ``_meta``'s decode rows, the tokens
        into ``_decoded`` (``scored``: their scores into ``_scores``) and, with one row per
        sequence, into ``last_token``."""
        ids, positions, slots = self._meta[:, : b * q]
        tokens = self.pick(h, slots, positions, keep, masked,
                           tuple(t[: b * q] for t in self._scores) if scored else None)
        if q == 1:
            self.last_token.index_copy_(0, slots, tokens)
        if self.last_hidden is not None:
            self._keep_hidden(h, ids, tokens, slots, b, q)
        self._decoded[: b * q].copy_(tokens)

    def _keep_hidden(self, h: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, b: int,
                     q: int) -> None:
        """Into ``last_hidden[slot]``, of the b sequences of q rows each (h [b*q, D], their ids and
        picked tokens [b*q]): the row behind the newest token, the one after the drafts kept
        (:func:`qat4.engine.speculation.accepted_count`, here on the device)."""
        if q == 1:
            self.last_hidden.index_copy_(0, slots, h)
            return
        kept = (ids.view(b, q)[:, 1:] == tokens.view(b, q)[:, :-1]).cumprod(dim=1).sum(dim=1)
        rows = torch.arange(b, device=h.device) * q + kept
        self.last_hidden.index_copy_(0, slots[::q].contiguous(), h[rows])

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes decode steps run at: the captured graphs', or any without graphs."""
        return self.sizes if self.use_graph else list(range(1, self.max_num_seqs + 1))

    def padded(self, n: int) -> int:
        """The batch size whose graph serves n sequences (n itself without graphs)."""
        return next(b for b in self.sizes if b >= n) if self.use_graph else n

    def capture(self, b: int, q: int, keep: int, masked: bool = False, scored: bool = False) -> None:
        """Capture the decode graph of batch size b, q rows per sequence, sampling shape keep,
        masking or not and scoring or not (keep 0: the forward alone; q 0: the pick alone, see
        :meth:`_decode`), if not yet captured: two eager runs first (they compile and tune the
        kernels), every row on the scratch row."""
        if not self.use_graph or (b, q, keep, masked, scored) in self.graphs:
            return
        n = b * max(q, 1)
        self.load_rows([[0] * n, [0] * n, [self.pool.scratch_row] * n], q)
        graph = capture_graph(lambda: self._decode(b, q, keep, masked, scored), self.device, self._graph_pool)
        if q > 1:  # its warm-ups copy the scratch rows in before the host writes the step's own
            torch.cuda.synchronize(self.device)
        self._graph_pool = graph.pool()
        self.graphs[(b, q, keep, masked, scored)] = graph

    def _rows_in_graph(self, q: int) -> bool:
        """Whether a step of q rows per sequence copies its rows in itself: a verifying step on
        CUDA (:meth:`load_rows`)."""
        return q > 1 and self._verify_rows is not None

    def load_rows(self, rows: list[list[int]], q: int) -> None:
        """The decode rows of the next step of q rows per sequence: ids, positions and slots, each
        a list of its rows. A verifying step's (q > 1) go on CUDA into the pinned buffer its graph
        copies first: the host writes them just before the replay, without a copy of its own to
        enqueue, since the GPU idles until that step is launched (:mod:`qat4.engine.speculation`).
        The buffer is free again by then: a verifying step is launched only after the step
        before it was read (were it not, after a failed step, the wait for the last verifying
        step would stall rather than let the host overwrite its rows). Any other step's rows are
        sent to ``_meta`` (the host runs those a step ahead)."""
        if self._rows_in_graph(q):
            self._verify_done.synchronize()
            for r, row in enumerate(rows):
                self._verify_host[r, : len(row)] = row
        else:
            self.pool.uploads.send(rows, self._meta)

    def replay(self, b: int, q: int, keep: int, masked: bool = False, scored: bool = False) -> None:
        """Run the decode rows loaded last (:meth:`load_rows`; a captured graph, or eagerly
        without graphs)."""
        if self.use_graph:
            self.graphs[(b, q, keep, masked, scored)].replay()
        else:
            self._decode(b, q, keep, masked, scored)

    def run_decode(self, seqs: list[Sequence], keep: int, masked: bool = False, scored: bool = False,
                   defer_pick: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Enqueue the decode rows of ``seqs``: each one's newest position, then its drafts (every
        sequence has as many). Returns their tokens [n * (1 + drafts)], sequence by sequence, and
        with ``scored`` their scores (:func:`qat4.engine.logprobs.score_buffers`, as many rows).
        With ``defer_pick`` (no drafts) only the forward is enqueued, and the tokens are there once
        :meth:`finish_pick` has enqueued their masked pick."""
        n, b, k = len(seqs), self.padded(len(seqs)), len(seqs[0].drafts)
        q = k + 1
        # captures before the rows go in: a capture runs on the scratch row
        if defer_pick:
            self.capture(b, 1, 0)
            self.capture(b, 0, keep, True, scored)
        else:
            self.capture(b, q, keep, masked, scored)
        pad = (b - n) * q
        ids, positions, slots = [], [], []
        for s in seqs:
            ids += [-1 if s.pending else s.newest_known, *s.drafts]
            positions += range(s.length - 1, s.length + k)
            slots += [s.slot] * q
        self.load_rows([ids + [0] * pad, positions + [0] * pad, slots + [self.pool.scratch_row] * pad], q)
        self.replay(b, q, 0 if defer_pick else keep, masked and not defer_pick, scored and not defer_pick)
        if self._rows_in_graph(q):
            self._verify_done.record()
        return self._decoded[: n * q], tuple(t[: n * q] for t in self._scores) if scored else None

    def forward_chunks(self, chunks: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
        """Eager forward of prompt chunks (sequence, tokens from ``num_computed`` on), every id
        known on the host -> (hidden [T, D], positions [T], slots [T])."""
        ids, positions, slots, cu, rows = flat_chunks(chunks)
        flat = self.pool.uploads.new([ids, positions, slots])
        seq_meta = self.pool.uploads.new([cu + rows])[0]
        max_q = max(n for _, n in chunks)
        max_keys = max(seq.num_computed + n for seq, n in chunks)
        batch = self._batch(flat[2], flat[1], seq_meta[: len(cu)], seq_meta[len(cu) :], max_q, max_keys)
        return self.model.forward(flat[0], flat[1], self.pool, batch), flat[1], flat[2]

    def run_prefill(self, chunks: list[tuple[Sequence, int]], sampled: list[int], masked: bool = False,
                    scored: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Enqueue prompt chunks; the last row of the chunks listed in ``sampled`` (indices into
        chunks) picks its sequence's next token (``masked``: with the slots' allowed tokens).
        Returns those tokens [len(sampled)] and with ``scored`` their scores (None when no row picks)."""
        keep = self.keep_for([chunks[i][0] for i in sampled]) if sampled else 0
        scored = scored and bool(sampled)
        total = sum(n for _, n in chunks)
        padded = next((t for t in self.chunk_sizes if t >= total), None)
        if padded is not None:
            return self._replay_chunks(chunks, sampled, padded, keep, masked, scored)
        if not sampled:
            self.forward_chunks(chunks)
            return torch.zeros(0, dtype=torch.int64, device=self.device), None
        last = list(itertools.accumulate(n for _, n in chunks))  # each chunk's last row + 1
        ends = self.pool.uploads.new([[last[i] - 1 for i in sampled]])[0]
        h, positions, slots = self.forward_chunks(chunks)
        scores = score_buffers(len(sampled), self.top, self.device) if scored else None
        return self._pick_ends(h, positions, ends, slots[ends], keep, masked, scores), scores

    def _pick_ends(self, h: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor,
                   keep: int, masked: bool, scores: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The tokens the rows ``ends`` [S] of a prompt step pick for ``slots`` [S], into those
        slots' last_token (and last_hidden); with ``scores``, their scores there."""
        tokens = self.pick(h[ends], slots, positions[ends], keep, masked, scores)
        self.last_token.index_copy_(0, slots, tokens)
        if self.last_hidden is not None:
            self.last_hidden.index_copy_(0, slots, h[ends])
        return tokens

    def chunk_seqs(self, t: int) -> int:
        """Sequences a padded prompt step of t tokens holds at most: one per token, one per slot."""
        return min(t, self.max_num_seqs)

    def _chunk_fields(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``_chunk_seqs`` for a padded step of s sequences: cu_q [s + 1], table rows [s],
        rows that pick [s] and the slots they pick for [s]."""
        f = self._chunk_seqs
        return f[: s + 1], f[s + 1 : 2 * s + 1], f[2 * s + 1 : 3 * s + 1], f[3 * s + 1 : 4 * s + 1]

    def _chunk(self, t: int, s: int, keep: int, masked: bool, scored: bool) -> None:
        """The padded prompt step in ``_chunk_meta[:, :t]`` and ``_chunk_fields(s)``: forward, and
        with keep > 0 the s picks into ``_chunk_tokens`` (``scored``: their scores into
        ``_chunk_scores``; what a graph captures)."""
        ids, positions, slots = self._chunk_meta[:, :t]
        cu_q, rows, ends, picks = self._chunk_fields(s)
        h = self.model.forward(ids, positions, self.pool, self._batch(slots, positions, cu_q, rows, t, self.max_ctx))
        if keep:
            scores = tuple(b[:s] for b in self._chunk_scores) if scored else None
            self._chunk_tokens[:s].copy_(self._pick_ends(h, positions, ends, picks, keep, masked, scores))

    def capture_chunk(self, t: int, s: int, keep: int, masked: bool = False, scored: bool = False) -> None:
        """Capture the graph of a prompt step padded to t tokens for up to s sequences, picking
        with sampling shape keep (0: no pick), masked or not, scored or not, if not yet captured,
        every row on the scratch row; without graphs, run it once there (which compiles its kernels)."""
        if (t, s, keep, masked, scored) in self.chunk_graphs:
            return
        scratch = self.pool.scratch_row
        # one sequence of t tokens at positions inside the context: a step of several sequences may
        # hold more tokens than max_ctx (16 prompts of 32 tokens in a 176-token context), and so
        # may its padding rows (_replay_chunks)
        self._chunk_meta[:, :t] = torch.stack([torch.zeros(t, dtype=torch.int64), torch.arange(t) % self.max_ctx,
                                               torch.full((t,), scratch)]).to(self.device)
        self._chunk_seqs[: 4 * s + 1].copy_(torch.tensor([0] + [t] * s + [scratch] * s + [t - 1] * s + [scratch] * s))
        graph = None
        if self.use_graph:
            graph = capture_graph(lambda: self._chunk(t, s, keep, masked, scored), self.device, self._graph_pool)
            self._graph_pool = graph.pool()
        else:
            self._chunk(t, s, keep, masked, scored)
        self.chunk_graphs[(t, s, keep, masked, scored)] = graph

    def _replay_chunks(self, chunks: list[tuple[Sequence, int]], sampled: list[int], t: int, keep: int,
                       masked: bool, scored: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Prompt chunks (sequence, tokens from ``num_computed`` on) padded to t tokens, replayed
        from their graph (or run eagerly without graphs); the picks of ``sampled`` come first.
        Returns as :meth:`run_prefill`."""
        s = 1 if len(chunks) == 1 else self.chunk_seqs(t)
        self.capture_chunk(t, s, keep, masked, scored)
        scratch = self.pool.scratch_row
        ids, positions, slots, cu, rows = flat_chunks(chunks)
        pad, empty, unpicked = t - cu[-1], s - len(chunks), s - len(sampled)
        meta = [ids + [0] * pad, [*positions, *(p % self.max_ctx for p in range(pad))], slots + [scratch] * pad]
        fields = (cu + [cu[-1]] * empty + rows + [scratch] * empty + [cu[i + 1] - 1 for i in sampled]
                  + [t - 1] * unpicked + [chunks[i][0].slot for i in sampled] + [scratch] * unpicked)
        self.pool.uploads.send(meta, self._chunk_meta)
        self.pool.uploads.send([fields], self._chunk_seqs.view(1, -1))
        if self.use_graph:
            self.chunk_graphs[(t, s, keep, masked, scored)].replay()
        else:
            self._chunk(t, s, keep, masked, scored)
        if not keep:
            return torch.zeros(0, dtype=torch.int64, device=self.device), None
        n = len(sampled)
        return self._chunk_tokens[:n], tuple(b[:n] for b in self._chunk_scores) if scored else None

    def launch(self, decode: list[Sequence], decode_keep: int, chunks: list[tuple[Sequence, int]],
               sampled: list[int], masked: bool = False, scored: bool = False,
               defer_pick: bool = False) -> StepTokens | PendingPick:
        """Enqueue a whole step: decode rows, prompt chunks, the tokens' copy to the host;
        ``masked``: some row picks under its slot's allowed tokens (:meth:`set_allowed`);
        ``scored``: some row wants logprobs, and every row's scores go to the host too. With
        ``defer_pick`` the decode rows' pick waits for :meth:`finish_pick`, which returns the
        StepTokens."""
        self.pool.flush()
        parts, scores, seqs = [], [], []
        if decode:
            tokens, decode_scores = self.run_decode(decode, decode_keep, masked, scored, defer_pick)
            parts.append(tokens)
            scores.append(decode_scores)
            seqs += decode
        if chunks:
            tokens, chunk_scores = self.run_prefill(chunks, sampled, masked, scored)
            parts.append(tokens)
            scores.append(chunk_scores)
            seqs += [chunks[i][0] for i in sampled]
        drafts = [list(s.drafts) for s in decode] + [[] for _ in seqs[len(decode) :]]
        step = StepTokens(seqs, drafts, self._host[self._turn], None,
                          self._host_scores[self._turn] if scored else None)
        self._turn ^= 1
        if defer_pick and decode:
            return PendingPick(step, parts, scores, decode, decode_keep, scored)
        return self._send(step, parts, scores)

    def finish_pick(self, pending: PendingPick) -> StepTokens:
        """Enqueue the masked pick of a step launched with ``defer_pick`` (its slots' allowed
        tokens written since) and the tokens' copy to the host."""
        self.replay(self.padded(len(pending.decode)), 0, pending.keep, True, pending.scored)
        return self._send(pending.step, pending.parts, pending.scores)

    def _send(self, step: StepTokens, parts: list[torch.Tensor],
              scores: list[tuple[torch.Tensor, torch.Tensor] | None]) -> StepTokens:
        """Enqueue the copy of a step's tokens (``parts``, and their ``scores`` when the step is
        scored) to its host buffers, and the event its read waits for."""
        if step.seqs:
            tokens = _cat(parts)
            step.host[: tokens.shape[0]].copy_(tokens, non_blocking=step.host.is_pinned())
            if step.host_scores is not None:  # a part without scores has no rows
                for buffer, part in zip(step.host_scores, zip(*(s for s in scores if s is not None))):
                    buffer[: tokens.shape[0]].copy_(_cat(list(part)), non_blocking=buffer.is_pinned())
            if self.device.type == "cuda":
                step.event = torch.cuda.Event()
                step.event.record()
        return step


class PendingPick(NamedTuple):
    """A step launched with ``defer_pick``: its StepTokens, the device tensors of its parts and
    their scores (the decode rows' still to be picked), its decode rows' sequences, their
    sampling shape and whether the step is scored."""

    step: StepTokens
    parts: list[torch.Tensor]
    scores: list[tuple[torch.Tensor, torch.Tensor] | None]
    decode: list[Sequence]
    keep: int
    scored: bool


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after another along their first dimension (the one itself when alone)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
