"""One request as the engine sees it: its tokens, sampling, state, place in the KV pool and timing.

Token bookkeeping (the engine reads sampled tokens back one step late, so the GPU never waits):
``tokens`` are the ids the host knows (prompt, then read-back output); ``pending`` counts tokens
sampled on the device and not yet read; ``num_computed`` counts positions whose K/V have been
written (launched). A step feeds positions ``num_computed .. length - 1``: the host's ids, and for
the newest position an id still on the device. When the fed positions reach ``length`` the step
also samples the next token.

With speculative decoding (:mod:`qat4.engine.speculation`) a decoding step may also feed ``drafts``
after the newest token; the step's tokens are read back before the next one is scheduled, and
``num_computed`` then moves past the drafts the target agreed with only.

A sequence with a ``constraint`` (a grammar, :class:`TokenConstraint`) picks each token under the
mask its tokens so far allow: while the constraint is active, the engine enqueues the pick of a
step fed before the newest token is read only once that token is read and the mask filled
(:mod:`qat4.engine.engine`). A constraint that becomes active at a token read back (a tool call
opened in a free reply) makes the token already picked after it without the mask ``stale``: it is
dropped when read, the sequence is not fed until then, and its position is fed again under the mask.

A sequence that asks for ``logprobs`` keeps, for each output token, its log-probability and that
many most likely tokens (``token_logprobs``, :mod:`qat4.engine.logprobs`).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from qat4.engine.logprobs import TokenLogprobs
from qat4.engine.prefix import RecentChains, extend_block_hashes
from qat4.engine.sampler import SamplingParams

_ids = itertools.count()
DRAFT_PRIOR = (2.0, 1.0)  # pseudo-counts of kept and refused drafts: a new sequence is tried at 2 in 3


class TokenConstraint(Protocol):
    """Which tokens a sequence may pick next (:class:`qat4.chat.grammars.GrammarConstraint`)."""

    active: bool  # whether the next token is masked

    def fill(self, bitmasks: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmasks[row]`` (int32 words, bit j of word i: token 32 i + j)."""

    def accept(self, token: int) -> None:
        """Advance past a token the sequence took."""


class State(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: holds no KV
    RUNNING = "running"  # holds a slot and KV blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request: prompt ids, how to sample and when to stop, and what has happened so far."""

    prompt: list[int]
    params: SamplingParams
    seed: int  # keys the counter-based draws: the same seed gives the same tokens
    max_new_tokens: int
    stop_ids: frozenset[int]
    id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    state: State = State.WAITING
    slot: int | None = None
    num_computed: int = 0
    pending: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrived: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # admitted to the running set the first time
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    preemptions: int = 0
    new_slot: bool = False  # admitted since its sampling parameters were last set on the device
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache at admission
    drafts: list[int] = field(default_factory=list)  # proposed tokens fed after the newest in the next step
    drafted: int = 0  # draft tokens verified so far
    accepted: int = 0  # of those, the ones the target agreed with
    draft_stats: list[float] = field(default_factory=lambda: list(DRAFT_PRIOR))  # decayed kept, refused drafts
    idle_steps: int = 0  # decode steps since it last verified drafts
    fruitless: int = 0  # verifications in a row that kept no draft
    draft_state: object = field(default=None, repr=False)  # the drafter's per-sequence index
    constraint: TokenConstraint | None = field(default=None, repr=False)  # dropped when the sequence ends
    stale: int = 0  # tokens in flight that were picked before the constraint became active
    logprobs: int | None = None  # most likely tokens to keep with each token's logprob; None: no logprobs
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, with logprobs
    _hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_known(self) -> int:
        """Tokens the host knows: the prompt and the output read back."""
        return len(self.prompt) + len(self.output)

    @property
    def newest_known(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def length(self) -> int:
        """Positions the sequence has ids for, on the host or on the device."""
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def launched_outputs(self) -> int:
        """Tokens sampled so far, read back or not."""
        return len(self.output) + self.pending

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    @property
    def wants_token(self) -> bool:
        """Whether a step that reaches ``length`` should sample another token."""
        return self.launched_outputs < self.max_new_tokens

    @property
    def masked(self) -> bool:
        """Whether its next token is picked under a constraint's mask."""
        return self.constraint is not None and self.constraint.active

    def block_hashes(self, block_size: int, n_tokens: int, recent: RecentChains | None = None) -> list[bytes]:
        """Names (:mod:`qat4.engine.prefix`) of the blocks within the first ``n_tokens`` known
        tokens; the first names it makes are taken from ``recent`` as far as it has them."""
        n = min(n_tokens, self.num_known) // block_size
        if n > len(self._hashes):
            if recent is not None and not self._hashes:
                self._hashes = recent.names(self.tokens, n)
            else:
                extend_block_hashes(self._hashes, self.tokens, block_size, n)
        return self._hashes[:n]

    def computed_block_hashes(self, block_size: int) -> list[bytes]:
        """Names of the blocks whose K/V are all written, for known tokens."""
        return self.block_hashes(block_size, self.num_computed)

    def accept(self, token: int, now: float, logprobs: TokenLogprobs | None = None) -> bool:
        """Take a token read back from the device (and its logprobs, when the sequence asks for
        them); True when it ends the sequence (a stop id or the token limit), with
        ``finish_reason`` set."""
        self.pending -= 1
        if self.constraint is not None:
            was_masked = self.constraint.active
            self.constraint.accept(token)
            if self.constraint.active and not was_masked:  # the tokens launched after this one were not masked
                self.stale = self.pending
        self.output.append(token)
        if logprobs is not None:
            self.token_logprobs.append(logprobs)
        if len(self.output) == 1:
            self.first_token_at = now
        self.last_token_at = now
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def drop_stale(self) -> bool:
        """Whether the token read back now was picked before the constraint became active: it is
        dropped, and its position is fed again (under the mask) by the next step."""
        if not self.stale:
            return False
        self.stale -= 1
        self.pending -= 1
        if self.state is State.RUNNING:
            self.num_computed -= 1
        return True
