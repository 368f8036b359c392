"""Speculative decoding: drafts proposed on the host, verified in the batch, and how many to draft.

**Verification.** A decoding sequence feeds its newest token and k draft tokens in one step
(:meth:`qat4.engine.model_runner.ModelRunner.run_decode`), and the step picks a token at each of
the k + 1 positions exactly as a plain step picks one: the argmax of a greedy row, or for a sampled
row the seeded draw of :mod:`qat4.engine.sampler`, keyed by the position. The engine keeps the
drafts for as long as each equals the token the target picked before it, then the target's token
after the last kept draft (:func:`accepted_count`). Every token kept is the one plain decoding
produces with the same seed, so the output is the same, token for token, whatever the drafter
proposes. For a sampled row this is rejection sampling with a point-mass draft: a draft d is kept
with probability p(d) = min(1, p(d) / q(d)) for q = 1 at d, and when it is not, the token is a draw
from p given that it is not d, which is the normalised residual (p - q)+. KV written at positions
past the kept drafts is overwritten by the next step before any query can see it; the KV pool holds
every block a step's first query still needs (:meth:`qat4.engine.kv_cache.KVPool.grow`).

**How many.** Each sequence keeps a decayed count of kept and refused drafts, starting from
:data:`qat4.engine.sequence.DRAFT_PRIOR` (a = 2/3: a few refusals at the start of a reply do not
end its speculation before it has been measured); under a geometric model a sequence whose draft
tokens are kept with probability a gains 1 + a + ... + a^k tokens from a step with k drafts. Drafting needs the newest tokens on the host, so a speculating step waits for
the step before it (plain decoding launches step n + 1 before reading step n). :class:`Speculator`
picks the k of each step, 0 to ``max_tokens``, that gives the most tokens per second of step, from
the step costs measured at load for every batch size and k (:func:`measure_step_costs`) and what a
speculating step is measured to take beyond its graph while serving (the host's drafting,
scheduling and reading, which plain decoding hides behind the device). A step with k = 0 is plain
decoding, so speculation only runs where the measurements say it pays; a sequence that has not speculated for
PROBE_EVERY steps drafts PROBE_TOKENS once, so its counts follow what it does now (a pasted
document may start being quoted) at a cost of one short verification in PROBE_EVERY steps. Each
verification in a row that keeps nothing doubles that wait, up to PROBE_EVERY << PROBE_BACKOFF
steps: where drafts are never right, probing costs about 1 % of plain decoding at 64 steps
apart and a tenth of that at 1,024.

**Drafters.** :class:`PromptLookup` copies what followed an earlier occurrence of the sequence's
last few tokens, in the prompt or in its own output. :class:`qat4.engine.mtp.MTPDrafter` runs
Gemma 4's MTP drafter for all decoding sequences at once and says what its drafts cost, which
the choice of k adds to the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from qat4.engine.sequence import Sequence
from qat4.errors import Qat4Error

SPEC_MAX_BATCH = 16  # decoding sequences up to which steps may speculate (graphs are captured for them)
DECAY = 0.9  # weight of the counts so far at each verification
PROBE_EVERY = 64  # a sequence that has not speculated for this many steps drafts PROBE_TOKENS once
PROBE_TOKENS = 2
PROBE_BACKOFF = 4  # doublings of PROBE_EVERY, one per fruitless verification in a row


class Drafter(Protocol):
    """Proposes up to k tokens to follow a sequence's known tokens (``seq.tokens``), at no device cost."""

    def propose(self, seq: Sequence, k: int) -> list[int]: ...


class BatchDrafter(Protocol):
    """Proposes k tokens for each of a step's decoding sequences at once, and says what that costs:
    seconds for a padded batch of b sequences and k drafts each (:class:`qat4.engine.mtp.MTPDrafter`)."""

    def propose_all(self, seqs: list[Sequence], k: int) -> list[list[int]]: ...

    def cost(self, b: int, k: int) -> float: ...


class PromptLookup:
    """Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for n from ``max_n`` down to ``min_n``; none without a match.

    Each sequence keeps an index (``seq.draft_state``) from every n-gram to the position after its
    latest occurrence, extended by the tokens added since the last proposal, so a proposal costs
    the new tokens, not the whole context.
    """

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise Qat4Error(f"prompt lookup needs 1 <= min_n <= max_n, got min_n {min_n} and max_n {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        state = seq.draft_state if isinstance(seq.draft_state, _NgramIndex) else None
        if state is None:
            state = seq.draft_state = _NgramIndex(seq.prompt)
        tokens = state.tokens
        tokens += seq.output[len(tokens) - len(seq.prompt) :]
        end = len(tokens)
        # index every n-gram that ends before the last token, so the last n tokens never match themselves
        for e in range(max(state.upto, 1), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                state.after[tuple(tokens[e - n : e])] = e
        state.upto = max(state.upto, end)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            e = state.after.get(tuple(tokens[end - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []


class _NgramIndex:
    """A sequence's tokens so far (extended as it grows) and where each n-gram was last followed."""

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)
        self.after: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before this position are indexed


def accepted_count(drafts: list[int], tokens: list[int]) -> int:
    """How many leading drafts the target agreed with: drafts[i] is kept while it equals the token
    tokens[i] the target picked at the position before it."""
    j = 0
    while j < len(drafts) and drafts[j] == tokens[j]:
        j += 1
    return j


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step with k drafts yields when each draft is kept with probability a in turn."""
    return sum(a**i for i in range(k + 1))


class Speculator:
    """Drafts for each step's decoding sequences, as many as pay (module docstring).

    ``drafter``: a :class:`Drafter` or a :class:`BatchDrafter`. ``costs[(b, q)]``: seconds of a
    step over a padded batch of b sequences with q rows each. ``adaptive`` False drafts
    ``max_tokens`` every step (for measurements).
    """

    def __init__(self, drafter: Drafter | BatchDrafter, max_tokens: int, costs: dict[tuple[int, int], float],
                 padded: Callable[[int], int], adaptive: bool = True):
        self.max_tokens, self.costs, self.padded, self.adaptive = max_tokens, costs, padded, adaptive
        self.use(drafter)
        self.host_s = 0.0  # what a speculating step takes beyond its graph's replay (running mean)
        self.drafted = self.accepted = 0  # draft tokens verified and kept over the engine's life
        self.verified = self.refused = 0  # verifications, and those that refused a draft

    def use(self, drafter: Drafter | BatchDrafter) -> None:
        """Draft with ``drafter`` from now on."""
        self.drafter = drafter
        self.propose_all = getattr(drafter, "propose_all", None) or (lambda seqs, k: [drafter.propose(s, k) for s in seqs])
        self.draft_cost = getattr(drafter, "cost", None) or (lambda b, k: 0.0)

    def draft_length(self, seqs: list[Sequence]) -> int:
        """The k for a step over these decoding sequences: the most tokens per second of step."""
        if not seqs or len(seqs) > SPEC_MAX_BATCH:
            return 0
        room = min(s.max_new_tokens - s.launched_outputs - 1 for s in seqs)
        top = min(self.max_tokens, room)
        if top < 1:
            return 0
        if not self.adaptive:
            return top
        b = self.padded(len(seqs))
        if any(s.idle_steps >= PROBE_EVERY << min(s.fruitless, PROBE_BACKOFF) for s in seqs):
            return min(top, PROBE_TOKENS)
        rates = [_acceptance(s) for s in seqs]

        def tokens_per_s(k: int) -> float:
            cost = self.costs.get((b, k + 1))
            if cost is None:
                return 0.0
            return sum(expected_tokens(a, k) for a in rates) / (cost + self.draft_cost(b, k) + (self.host_s if k else 0.0))

        return max(range(top + 1), key=tokens_per_s)

    def propose(self, seqs: list[Sequence], k: int) -> int:
        """Set every sequence's ``drafts`` to k tokens (a drafter's short proposal is padded with
        its last token: any token verifies exactly). Returns k, or 0 when no sequence has a
        proposal, which leaves every sequence without drafts."""
        proposals = [p[:k] for p in self.propose_all(seqs, k)] if k else [[] for _ in seqs]
        if not any(proposals):
            if k:
                for s in seqs:
                    _record(s, 0, 0)
            else:
                self.idle(seqs)
            return 0
        for s, p in zip(seqs, proposals):
            s.drafts = p + [p[-1] if p else s.newest_known] * (k - len(p))
        return k

    def record(self, seq: Sequence, k: int, kept: int) -> None:
        """A verification of k drafts of which ``kept`` were kept."""
        seq.drafted += k
        seq.accepted += kept
        self.drafted += k
        self.accepted += kept
        self.verified += 1
        self.refused += kept < k
        _record(seq, k, kept)

    def idle(self, seqs: list[Sequence]) -> None:
        """A step in which these decoding sequences did not speculate."""
        for s in seqs:
            s.idle_steps += 1

    def observe(self, b: int, k: int, seconds: float) -> None:
        """A speculating step of k drafts over b sequences took ``seconds`` from the read of the
        step before to its own read: all but its graph's replay and the drafts' own cost is the
        price of waiting."""
        cost = self.costs.get((self.padded(b), k + 1), seconds) + self.draft_cost(self.padded(b), k)
        extra = min(max(0.0, seconds - cost), cost)  # a stall (a request arriving, a capture) counts as one step
        self.host_s = extra if not self.host_s else 0.9 * self.host_s + 0.1 * extra


def _acceptance(seq: Sequence) -> float:
    kept, refused = seq.draft_stats
    return kept / (kept + refused)


def _record(seq: Sequence, k: int, kept: int) -> None:
    """Counts after a verification: ``kept`` drafts kept in a row, then one refused unless all k
    were (a step that found no draft to verify counts as one refused)."""
    stats = seq.draft_stats
    stats[0] = DECAY * stats[0] + kept
    stats[1] = DECAY * stats[1] + (1 if kept < k or k == 0 else 0)
    seq.idle_steps = 0
    seq.fruitless = 0 if kept else seq.fruitless + 1


COST_DEPTH = 1024  # context the step costs are measured at (attention grows with it, a little)


@torch.no_grad()
def measure_step_costs(runner, sizes: list[int], qs: range, keep: int = 1) -> dict[tuple[int, int], float]:
    """Seconds per decode step for each padded batch size in ``sizes`` and q rows per sequence in
    ``qs``, every sequence on the pool's scratch row at COST_DEPTH: with CUDA graphs the replay time
    of each captured graph (greedy, keep 1); else the best of three eager steps over one sequence
    of q rows (never below the cost of fewer rows), and for b sequences the cost of b * q rows read
    off a line through the last two measured (eager rows run close to one after another)."""
    from qat4.engine.tuning import best_seconds, replay_us

    def place(b: int, q: int) -> None:
        depth = max(0, min(COST_DEPTH, runner.max_ctx - q))
        runner.load_rows([[0] * (b * q), list(range(depth, depth + q)) * b, [runner.pool.scratch_row] * (b * q)], q)

    if runner.use_graph:
        costs = {}
        for b in sizes:
            for q in qs:
                place(b, q)
                costs[(b, q)] = replay_us(runner.graphs[(b, q, keep, False, False)], 3) * 1e-6
        return costs
    by_rows, most = {}, 0.0
    for q in qs:
        place(1, q)
        most = max(most, best_seconds(lambda: runner.replay(1, q, keep), runner.device))  # more rows never cost less
        by_rows[q] = most
    top = max(qs)
    slope = by_rows[top] - by_rows[top - 1] if top - 1 in by_rows else by_rows[top]
    return {(b, q): by_rows.get(b * q, by_rows[top] + (b * q - top) * max(slope, 0.0)) for b in sizes for q in qs}
