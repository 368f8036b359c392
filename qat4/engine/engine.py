"""The engine: many sequences at once over one shared KV pool, one step at a time.

:meth:`Engine.add_request` queues a sequence. :meth:`Engine.step` asks the scheduler for the next
batch (:mod:`qat4.engine.scheduler`: every running sequence's next token, and prompt chunks under
a token budget), launches it on the device (:mod:`qat4.engine.model_runner`: decode rows replayed
from CUDA graphs, prompt chunks eagerly), then reads back the tokens of the step before and
returns them: the host enqueues step n + 1 before it waits for step n, so the GPU never waits for
Python. :meth:`Engine.generate` and :meth:`Engine.stream` are thin loops over that for one
request at a time (:mod:`qat4.engine.generation`); :meth:`Engine.logits` reads a prompt alone
beside the running sequences. A request may carry a grammar (``constraint``,
:mod:`qat4.engine.sequence`): its rows pick under a token mask that the engine fills on the host
(:meth:`qat4.engine.model_runner.ModelRunner.set_allowed`). The mask follows from the token the
step before is still sampling, so a step with a decoding row whose constraint is active is
launched with its pick deferred: its forward first, then the step before is read, the masks filled
and the pick enqueued, while the device runs the forward (a constraint waiting for its trigger
token leaves its row's pick as it is; a trigger read back makes the token picked after it without
the mask stale, see :mod:`qat4.engine.sequence`, unless that pick was deferred). A request may ask
for ``logprobs`` (:mod:`qat4.engine.logprobs`): the steps it is in score every row, and
:meth:`Engine.prompt_logprobs` scores a prompt's own tokens. :meth:`Engine.load` and
:meth:`Engine.from_packed` build an engine (:mod:`qat4.engine.build`): on CUDA the decode GEMV
tilings saved for this GPU by :meth:`Engine.tune_decode` (``qat4 bench --tune``) are pinned, then
the warm-up (:mod:`qat4.engine.warmup`) captures the steps' graphs and compiles their kernels.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qat4.checkpoint.packed_model import PackedModel, stop_token_ids
from qat4.engine.build import build_engine
from qat4.engine.config import EngineConfig
from qat4.engine.generation import Generation, generation_of, tokens_of
from qat4.engine.kv_cache import KVPool, PoolExhausted
from qat4.engine.logprobs import TOP_LOGPROBS, TokenLogprobs, read_scores, score, score_buffers
from qat4.engine.memory import Plan
from qat4.engine.model_runner import ModelRunner, PendingPick, StepTokens, bitmask_width
from qat4.engine.sampler import SamplingParams
from qat4.engine.scheduler import Scheduler
from qat4.engine.sequence import Sequence, TokenConstraint
from qat4.engine.speculation import SPEC_MAX_BATCH, Speculator, accepted_count, measure_step_costs
from qat4.engine.tuning import save_tilings, tune_decode_tilings
from qat4.engine.warmup import capture_graphs
from qat4.errors import Qat4Error
from qat4.model import Gemma4


class CheckedIds(list):
    """A prompt's token ids that :meth:`Engine.encode` found all below ``vocab_size``: a server
    encodes and checks a prompt off its event loop, and the engine thread's :meth:`Engine.add_request`
    then takes the ids without a second pass over them (some 0.7 ms for 8,000 ids on a slow host).
    Made by :meth:`Engine.encode` only; ``vocab_size`` None (a copy made any other way) marks ids
    not checked."""

    def __init__(self, ids=(), vocab_size: int | None = None):
        super().__init__(ids)
        self.vocab_size = vocab_size


class PoolBusy(Qat4Error):
    """The KV pool has no room for a prompt read alone (:meth:`Engine.logits`) beside the running
    sequences; it will have once they are done."""


@dataclass
class StepOutput:
    """A token one step produced for a sequence; ``finished`` when it ended the sequence
    (``seq.finish_reason`` says why)."""

    seq: Sequence
    token: int
    finished: bool
    logprobs: TokenLogprobs | None = None  # when the sequence asks for logprobs


class Engine:
    """Gemma 4 text generation from packed 4-bit weights on one device, many sequences at once."""

    def __init__(self, model: Gemma4, pool: KVPool, plan: Plan, *, cuda_graph: bool, tokenizer=None,
                 generation_config: dict | None = None, spec_tokens: int = 0, keep_hidden: bool = False):
        self.model, self.pool, self.plan, self.config = model, pool, plan, model.config
        self.device, self.dtype = model.device, model.dtype
        self.max_ctx, self.prefill_chunk, self.max_num_seqs = plan.max_ctx, plan.prefill_chunk, plan.max_num_seqs
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.id_limit  # noqa: B018 (read once here, at load: 0.2-0.5 s for Gemma's 262,144 tokens)
        self.generation_config = dict(generation_config or {})
        self.stop_token_ids = stop_token_ids(self.generation_config, self.config.eos_token_id)
        self.spec_tokens = spec_tokens  # drafts per step at most; 0: no speculative decoding
        spec_rows = min(plan.max_num_seqs, SPEC_MAX_BATCH) * (1 + spec_tokens) if spec_tokens else 0
        self.runner = ModelRunner(model, pool, max_num_seqs=plan.max_num_seqs, use_graph=cuda_graph, max_rows=spec_rows,
                                  keep_hidden=keep_hidden, max_chunk=plan.prefill_chunk)
        # the batch sizes a speculating step may have
        self.spec_sizes = [b for b in self.runner.batch_sizes if b <= SPEC_MAX_BATCH] if spec_tokens else []
        self.scheduler = Scheduler(pool, prefill_chunk=plan.prefill_chunk)
        self.speculator: Speculator | None = None  # set by enable_speculation
        self.assistant = None  # the MTP drafter's model, when the engine drafts with one
        self._in_flight = None
        self._verify_started = None  # (time of the read before, sequences, drafts) of a verifying step in flight
        # (decode GEMV shapes pinned from saved tilings, shapes in the steps, the files); CUDA only
        self.pinned_tilings: tuple[int, int, tuple[Path, ...]] = (0, 0, ())

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def load(cls, path_or_id: str, device: str | torch.device = "cpu", config: EngineConfig | None = None,
             **options) -> "Engine":
        """Read a checkpoint (folder, file or model id) and build an engine on ``device``.

        ``config`` and keyword ``options`` are :class:`qat4.engine.EngineConfig` fields (dtype,
        max_ctx, max_num_seqs, prefill_chunk, kv_tokens, block_size, prompt_cache_mib, memory_cap_mib,
        cuda_graph).
        """
        from qat4.checkpoint.loader import load_packed

        return cls.from_packed(load_packed(path_or_id), device, config, **options)

    @classmethod
    def from_packed(cls, packed: PackedModel, device: str | torch.device = "cpu", config: EngineConfig | None = None,
                    *, tokenizer=None, **options) -> "Engine":
        """Build an engine from a PackedModel in memory; same options as :meth:`load`.

        The tokenizer comes from ``packed.source`` when it has one, unless ``tokenizer`` is given.
        Without an explicit max_num_seqs, a load that runs out of GPU memory (the plan's estimate of
        the working memory fell short) is tried again with half as many sequences
        (:func:`qat4.engine.build.build_engine`).
        """
        return build_engine(cls, packed, device, EngineConfig.of(config, **options), tokenizer)

    def enable_speculation(self, drafter, adaptive: bool = True) -> None:
        """Speculative decoding with ``drafter`` (:mod:`qat4.engine.speculation`), up to the
        spec_tokens the engine was built for; the step costs it weighs are measured now."""
        if not self.spec_tokens:
            raise Qat4Error("this engine was built without spec_tokens; load it with a speculative drafter")
        self.drain()
        costs = measure_step_costs(self.runner, self.spec_sizes, range(1, self.spec_tokens + 2))
        self.speculator = Speculator(drafter, self.spec_tokens, costs, self.runner.padded, adaptive)

    @torch.no_grad()
    def tune_decode(self, replays: int = 50) -> tuple[float, float, Path]:
        """Choose every single-sequence decode GEMV's tiling by the greedy step's graph-replay time
        (:mod:`qat4.engine.tuning`), pin them and save them for this GPU, where later loads pick
        them up. Returns (µs per step before, after, the file). CUDA graphs only."""
        if not self.runner.use_graph:
            raise Qat4Error("decode tuning times CUDA-graph replays; it needs a CUDA device with cuda_graph on")
        self.drain()
        tilings, before, after = tune_decode_tilings(self.runner, (1, 1, 1, False, False), replays)
        self.runner.graphs.clear()  # every graph holds the tilings from before
        capture_graphs(self)
        return before, after, save_tilings(tilings, self.device, self.dtype)

    @property
    def nbytes(self) -> dict[str, int]:
        """Device memory by part: weights and tables, KV pool, the 16-bit weight copies when the model
        keeps them (``dense_weights``), and the MTP drafter's weights when it drafts."""
        parts = {"model": self.model.nbytes, "kv_cache": self.pool.nbytes}
        if self.model.dense:
            parts["dense"] = sum(w.numel() * w.element_size() for w in self.model.dense.values())
        if self.assistant is not None:
            parts["drafter"] = self.assistant.nbytes
        return parts

    # ---- prompts and parameters --------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> CheckedIds:
        """Token ids of a prompt: text is encoded with exactly one leading <bos>; ids pass through,
        checked against the vocabulary. Returns :class:`CheckedIds` (a new list), which a later
        :meth:`add_request` takes without checking its ids again."""
        vocab = self.config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Qat4Error("this model has no tokenizer; pass the prompt as token ids")
            bos = self.config.bos_token_id
            ids = self.tokenizer.encode(prompt)
            start = next((i for i, t in enumerate(ids) if t != bos), len(ids))
            ids = CheckedIds(ids if start == 1 else [bos, *ids[start:]], vocab)  # start 1: the text's own <bos>
            # a tokenizer's ids are ints from 0 below its id limit: within the model's vocabulary, or one pass in C
            if bos >= 0 and (self.tokenizer.id_limit <= vocab or max(ids) < vocab):
                return ids
        elif isinstance(prompt, CheckedIds) and prompt.vocab_size is not None and prompt.vocab_size <= vocab:
            if not prompt:
                raise Qat4Error("the prompt is empty")
            return CheckedIds(prompt, prompt.vocab_size)
        else:
            ids = CheckedIds(prompt, vocab)
            if set(map(type, ids)) != {int}:  # a set of types is built faster than a list of the same ints
                ids = CheckedIds([int(t) for t in ids], vocab)
        if not ids:
            raise Qat4Error("the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Qat4Error(f"prompt token id {bad} is outside the vocabulary of {vocab}")
        return ids

    def sampling_params(self, temperature: float | None = None, top_k: int | None = None,
                        top_p: float | None = None) -> SamplingParams:
        """Fill unset options from the checkpoint's generation_config (then 1.0 / none / 1.0)."""
        gen = self.generation_config
        if temperature is None:
            temperature = 0.0 if gen.get("do_sample") is False else float(gen.get("temperature", 1.0))
        return SamplingParams(
            temperature=float(temperature),
            top_k=gen.get("top_k") if top_k is None else int(top_k),
            top_p=float(gen.get("top_p", 1.0) if top_p is None else top_p),
        )

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise Qat4Error when a request of this size can never run on this engine."""
        if max_new_tokens < 1:
            raise Qat4Error(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
        if prompt_tokens + max_new_tokens > self.max_ctx:
            raise Qat4Error(
                f"the prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} is "
                f"{prompt_tokens + max_new_tokens} tokens, more than the context of {self.max_ctx} (max_ctx)"
            )
        self.scheduler.check_fits(prompt_tokens, max_new_tokens)

    # ---- many sequences ----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_token_ids: list[int] | None = None, constraint: TokenConstraint | None = None,
                    logprobs: int | None = None) -> Sequence:
        """Queue a generation; :meth:`step` runs it. ``constraint`` limits the tokens it may pick
        (a grammar, see :meth:`json_constraint`); ``logprobs`` (0 to TOP_LOGPROBS) keeps each
        token's logprob and that many most likely tokens (``Sequence.token_logprobs``). Raises
        Qat4Error at once for a request that can never run (bad prompt or options, more than the
        context or the pool holds)."""
        ids = self.encode(prompt)
        params = self.sampling_params(temperature, top_k, top_p)
        self.check_request(len(ids), max_new_tokens)
        if logprobs is not None and not 0 <= logprobs <= TOP_LOGPROBS:
            raise Qat4Error(f"logprobs is {logprobs}; it must be between 0 and {TOP_LOGPROBS}")
        stops = frozenset(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        seq = Sequence(ids, params, secrets.randbits(63) if seed is None else seed % (1 << 63), max_new_tokens, stops,
                       constraint=constraint, logprobs=logprobs)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """End a sequence now (a client that left); its KV is free for the next step."""
        self.scheduler.finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        """Whether a sequence waits or runs, or a launched step has not been read back."""
        return self.scheduler.has_work or self._in_flight is not None

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Launch the next batch, then read back the previous step's tokens and return them (a
        step with a masked decoding row enqueues its pick after that read, once its masks are
        filled); a speculating step (:mod:`qat4.engine.speculation`) reads the previous step back
        first, since its drafts follow the newest tokens.

        An exception from a step (a device error) leaves the sequences in an unknown state: abort
        them all (the server does) before stepping again."""
        if self.speculator is not None and self._speculates():
            return self._speculative_step()
        batch = self.scheduler.schedule()
        launched = self._launch(batch, defer_pick=any(s.masked for s in batch.decode)) if batch else None
        previous, self._in_flight = self._in_flight, None if isinstance(launched, PendingPick) else launched
        if self.speculator is not None:
            self.speculator.idle(batch.decode)
        outputs = self._collect(previous) if previous is not None else []
        self._in_flight = self._finish_pick(launched) if isinstance(launched, PendingPick) else launched
        return outputs

    def json_constraint(self, schema: dict) -> TokenConstraint:
        """A grammar that makes a reply one compact JSON value matching the JSON Schema ``schema``
        (``{"type": "object"}``: any object); for :meth:`add_request`. Raises Qat4Error for a
        schema it cannot enforce."""
        from qat4.chat.grammars import grammars_for

        if self.tokenizer is None or self.tokenizer.vocab_size != self.config.vocab_size:
            raise Qat4Error("constrained decoding needs the model's tokenizer, covering its whole vocabulary")
        try:
            return grammars_for(self.tokenizer, self.stop_token_ids).json(schema)
        except ValueError as exc:
            raise Qat4Error(f"json_schema cannot be enforced: {exc}") from None

    def _decoding(self) -> list[Sequence]:
        """Running sequences whose next step is a decode row."""
        return [s for s in self.scheduler.running if s.length - s.num_computed == 1 and s.wants_token]

    def _speculates(self) -> bool:
        """Whether the next step waits for the one in flight: it fed drafts (how far its sequences
        got is known only once read), or drafting pays for the sequences decoding now."""
        in_flight = self._in_flight is not None and self._in_flight.verifies
        return in_flight or self._draft_length(self._decoding()) > 0

    def _draft_length(self, decoding: list[Sequence]) -> int:
        """Drafts per sequence for the next step: none while a decoding sequence is constrained
        (a draft would be picked without the mask of the tokens before it) or wants logprobs (its
        scored steps keep to the graphs of one row per sequence, which are captured when first
        used, rather than scored verifying graphs for every draft length)."""
        if any(s.constraint is not None or s.logprobs is not None for s in decoding):
            return 0
        return self.speculator.draft_length(decoding)

    def _speculative_step(self) -> list[StepOutput]:
        outputs = self._collect(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        now = time.perf_counter()
        if self._verify_started is not None:  # the last step verified drafts: its whole period, read to read
            started, b, k = self._verify_started
            self.speculator.observe(b, k, now - started)
        decoding = self._decoding()
        self.speculator.propose(decoding, self._draft_length(decoding))
        batch = self.scheduler.schedule()
        self._in_flight = self._launch(batch) if batch else None
        k = len(batch.decode[0].drafts) if batch.decode else 0  # the scheduler drops drafts it has no room for
        # the next step feeds at most k + 1 more tokens and its own drafts
        self.scheduler.reserve(batch.decode, k + 1 + self.speculator.max_tokens)
        self._verify_started = (now, len(batch.decode), k) if k and not batch.prefill else None
        for seq in decoding:
            seq.drafts = []
        return outputs

    def drain(self) -> None:
        """Run until no sequence is left (tokens are dropped: for tools that reset the engine)."""
        while self.has_work:
            self.step()

    def _launch(self, batch, defer_pick: bool = False) -> StepTokens | PendingPick:
        """Enqueue a batch; with ``defer_pick`` its decode rows' pick waits for :meth:`_finish_pick`
        (their masks follow from tokens not yet read)."""
        admitted = [seq for seq, _ in batch.prefill if seq.new_slot]
        if admitted:
            self.runner.set_sampling([s.slot for s in admitted], [s.params for s in admitted], [s.seed for s in admitted])
            for seq in admitted:
                seq.new_slot = False
        sampled = [i for i, (seq, n) in enumerate(batch.prefill) if seq.num_computed + n == seq.length and seq.wants_token]
        picking = [*batch.decode, *(batch.prefill[i][0] for i in sampled)]
        masked = self._write_masks(picking[len(batch.decode) :] if defer_pick else picking)
        launched = self.runner.launch(batch.decode, self.runner.keep_for(batch.decode), batch.prefill, sampled,
                                      masked=masked, scored=any(s.logprobs is not None for s in picking),
                                      defer_pick=defer_pick)
        for seq in batch.decode:
            seq.num_computed += 1
            seq.pending += not defer_pick  # a deferred row's token is sampled once its pick is enqueued
        for seq, n in batch.prefill:
            seq.num_computed += n
        for i in sampled:
            batch.prefill[i][0].pending += 1
        return launched

    def _finish_pick(self, pending: PendingPick) -> StepTokens:
        """The masks of a deferred step's decode rows, now that their newest tokens are read,
        then its pick."""
        live = [s for s in pending.decode if not s.finished]
        for seq in live:
            seq.pending += 1
        self._write_masks(live, masked_pick=True)
        return self.runner.finish_pick(pending)

    def _write_masks(self, seqs: list[Sequence], masked_pick: bool = False) -> bool:
        """Whether any of ``seqs`` picks under a mask; if so (or if the pick is masked anyway,
        ``masked_pick``), the allowed tokens of each sequence with a constraint into its slot
        (every token while the constraint waits for its trigger). An unmasked pick reads no slot,
        so a step without a masked row writes nothing."""
        constrained = [s for s in seqs if s.constraint is not None]
        masked = any(s.constraint.active for s in constrained)
        if not constrained or not (masked or masked_pick):
            return masked
        bitmasks = torch.full((len(constrained), bitmask_width(self.config.vocab_size)), -1, dtype=torch.int32)
        for row, seq in enumerate(constrained):
            if seq.constraint.active:
                seq.constraint.fill(bitmasks, row)
        self.runner.set_allowed([s.slot for s in constrained], bitmasks)
        return masked

    def _collect(self, launched) -> list[StepOutput]:
        """The tokens of a launched step, sequence by sequence; a sequence that fed drafts keeps
        those the target agreed with and the target's token after them, and its KV counts only
        their positions (the next step writes over the rest)."""
        tokens = launched.read()
        scores = launched.logprobs(tokens)
        now = time.perf_counter()
        outputs = []
        for seq, drafts, picked, logprobs in zip(launched.seqs, launched.drafts, tokens, scores):
            if seq.finished or seq.drop_stale():  # aborted, ended by the token before, or picked unmasked
                continue
            kept = accepted_count(drafts, picked)
            seq.num_computed += kept
            seq.pending += kept
            taken = 0
            for j, token in enumerate(picked[: kept + 1]):
                scored = None if logprobs is None else logprobs[j]
                done = seq.accept(token, now, scored)
                outputs.append(StepOutput(seq, token, done, scored))
                taken += 1
                if done:
                    self.scheduler.finish(seq, seq.finish_reason)
                    break
            if drafts:  # drafts after a stop token were kept by the target but are not in the reply
                self.speculator.record(seq, len(drafts), min(kept, taken))
        return outputs

    # ---- one sequence ------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Softcapped logits [len, V] fp32 of a fresh sequence, every position (:meth:`_read_alone`)."""
        return self.model.logits(self._read_alone(token_ids))

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int], k: int) -> list[TokenLogprobs | None]:
        """For each token of a prompt after the first: its log-probability given the tokens before
        it and the k (0 to TOP_LOGPROBS) most likely tokens there, under the logits that
        :meth:`logits` gives, scored max_num_seqs positions at a time (a decode step's logits);
        None for the first token, which nothing predicts."""
        if not 0 <= k <= TOP_LOGPROBS:
            raise Qat4Error(f"k is {k}; it must be between 0 and {TOP_LOGPROBS}")
        ids = self.encode(token_ids)
        hidden = self._read_alone(ids)
        scored: list[TokenLogprobs | None] = [None]
        for start in range(0, len(ids) - 1, self.max_num_seqs):
            following = ids[start + 1 : start + 1 + self.max_num_seqs]
            scores = score_buffers(len(following), self.runner.top, self.device)
            score(self.model.logits(hidden[start : start + len(following)]),
                  torch.tensor(following, device=self.device), scores)
            values, top = (t.tolist() for t in scores)
            scored += [read_scores(token, v, i, k) for token, v, i in zip(following, values, top)]
        return scored

    def _read_alone(self, token_ids: list[int]) -> torch.Tensor:
        """Final-normed hidden states [len, D] of a fresh sequence, every position (one full
        prefill, in chunks of prefill_chunk), beside whatever else the engine runs; PoolBusy when
        the KV pool has no room for it beside the running sequences."""
        ids = self.encode(token_ids)
        if len(ids) > self.max_ctx:
            raise Qat4Error(f"{len(ids)} tokens are more than the context of {self.max_ctx} (max_ctx)")
        self.scheduler.check_fits(len(ids), 0)
        seq = Sequence(ids, SamplingParams(temperature=0), 0, 1, frozenset())
        hidden = []
        try:
            seq.slot = self.pool.open_slot()
            for start in range(0, len(ids), self.prefill_chunk):
                n = min(self.prefill_chunk, len(ids) - start)
                self.pool.grow(seq.slot, start + n, start)
                self.pool.flush()
                hidden.append(self.runner.forward_chunks([(seq, n)])[0])
                seq.num_computed += n
        except PoolExhausted:
            raise PoolBusy(f"the KV pool has no room for {len(ids)} more tokens beside the sequences running; "
                           "read the prompt when they are done") from None
        finally:
            if seq.slot is not None:
                self.pool.close_slot(seq.slot)
        return torch.cat(hidden)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_token_ids: list[int] | None = None,
               should_stop: Callable[[], bool] | None = None, json_schema: dict | None = None) -> Iterator[int]:
        """Generated token ids, one at a time; a stop token is yielded and ends the stream.
        ``json_schema``: the output is JSON matching it (:meth:`json_constraint`).

        ``should_stop`` is called between tokens; returning True ends the stream (cancellation).
        Raises Qat4Error up front when the request can never run.
        """
        constraint = None if json_schema is None else self.json_constraint(json_schema)
        seq = self.add_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, constraint)
        return tokens_of(self, seq, should_stop)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                 json_schema: dict | None = None) -> Generation:
        """Generate up to ``max_new_tokens`` tokens; greedy when temperature is 0.

        Unset sampling options come from the checkpoint's generation_config. ``stop`` strings end
        the generation once the decoded text contains one (needs a tokenizer). With ``json_schema``
        the text is compact JSON matching that JSON Schema (``{"type": "object"}``: any object),
        unless the token limit cuts it off first (finish_reason "length").
        """
        stop = [s for s in (stop or []) if s]
        if stop and self.tokenizer is None:
            raise Qat4Error("stop strings need a tokenizer; this model has none")
        constraint = None if json_schema is None else self.json_constraint(json_schema)
        seq = self.add_request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, constraint)
        return generation_of(self, seq, stop)
