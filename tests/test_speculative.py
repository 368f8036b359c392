"""Speculative decoding on the CPU (fp32 reference ops) changes how fast tokens come, never which:
every generation, greedy or seeded sampling, alone or in a batch that others join and wait for,
gets exactly the tokens plain decoding gives, whatever the drafter proposes (prompt lookup, random
ids, or the right answer), with stop tokens and max_new_tokens honoured inside a run of kept drafts
and every KV block back in the pool at the end. Beside that: the verification rule samples the
target distribution (a statistical check of the sampler with a point-mass draft), prompt lookup
proposes what a brute-force scan finds, and the adaptive draft length follows the step costs.

The model is `SMALL`, the tiny preset with a 1,024-token vocabulary (these tests read token ids,
not text). Its sliding window is 8 positions and the pool's blocks hold 4, so the long
generations here slide past several windows while drafts are refused and written over.
"""

import math

import pytest
import torch

from checkpoint_fixtures import SMALL
from qat4.checkpoint.synth import synthetic_model
from qat4.engine import Engine
from qat4.engine.kv_cache import sliding_blocks_per_seq, spec_lookahead
from qat4.engine.sampler import SamplingParams, sample
from qat4.ops.draws import uniforms
from qat4.engine.sequence import Sequence, State
from qat4.engine.speculation import (
    PROBE_BACKOFF, PROBE_EVERY, PROBE_TOKENS, SPEC_MAX_BATCH, PromptLookup, Speculator, accepted_count,
)
from qat4.errors import Qat4Error

K = 4  # drafts per step on the speculative engines
OPTIONS = {"max_ctx": 128, "prefill_chunk": 8, "block_size": 4}


def repeating_prompt(n: int, seed: int) -> list[int]:
    """<bos>, n random ids, the same n again, then their first half: prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(3, SMALL.vocab_size, (n,), generator=g).tolist()
    return [SMALL.bos_token_id, *body, *body, *body[: n // 2]]


GREEDY = [(repeating_prompt(n, seed), new) for n, seed, new in [(5, 1, 16), (7, 2, 14), (4, 3, 16), (9, 4, 12)]]
SAMPLINGS = [
    {"temperature": 1.0, "top_k": 0, "seed": 5},  # the whole vocabulary
    {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 6},
    {"temperature": 0.7, "top_k": 0, "top_p": 0.8, "seed": 7},
]
SAMPLED_PROMPT = repeating_prompt(6, 8)


# ---- drafters ----------------------------------------------------------------------------------


class Oracle:
    """Proposes the continuation plain decoding produced (``answers``: prompt -> tokens), and
    records every call as (tokens read back so far, k, proposal)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]):
        self.answers, self.calls = answers, []

    def propose(self, seq, k):
        done = len(seq.output)
        proposal = self.answers[tuple(seq.prompt)][done : done + k]
        self.calls.append((done, k, proposal))
        return proposal


class RandomDrafter:
    """Seeded random proposals: ids drawn from ``choices`` (a list), or from the whole vocabulary."""

    def __init__(self, seed: int, choices: list[int] | None = None):
        self.g, self.choices = torch.Generator().manual_seed(seed), choices

    def propose(self, seq, k):
        if self.choices is None:
            return torch.randint(0, SMALL.vocab_size, (k,), generator=self.g).tolist()
        picks = torch.randint(0, len(self.choices), (k,), generator=self.g).tolist()
        return [self.choices[i] for i in picks]


# ---- engines and references --------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(SMALL, seed=0)


def spec_engine(packed, drafter=None, **options) -> Engine:
    engine = Engine.from_packed(packed, "cpu", speculative="ngram", spec_tokens=options.pop("spec_tokens", K),
                                spec_adaptive=False, **{**OPTIONS, **options})
    if drafter is not None:
        engine.enable_speculation(drafter, adaptive=False)
    return engine


@pytest.fixture(scope="module")
def plain_engine(packed):
    return Engine.from_packed(packed, "cpu", **OPTIONS)


@pytest.fixture(scope="module")
def ngram(packed):
    return spec_engine(packed)


@pytest.fixture(scope="module")
def custom(packed):
    """A speculative engine whose drafter each test plugs in with enable_speculation."""
    return spec_engine(packed)


@pytest.fixture(scope="module")
def reference(plain_engine):
    """Plain decoding's tokens of a request, computed once: reference(prompt, new, **sampling)."""
    memo = {}

    def run(prompt, new, **sampling):
        key = (tuple(prompt), new, tuple(sorted(sampling.items())))
        if key not in memo:
            memo[key] = plain_engine.generate(prompt, new, stop_token_ids=[], **sampling).tokens
        return memo[key]

    return run


def use(engine: Engine, drafter) -> Engine:
    engine.enable_speculation(drafter, adaptive=False)
    return engine


def assert_pool_empty(engine: Engine):
    assert not engine.has_work
    assert all(share == 0.0 for share in engine.pool.usage().values()), engine.pool.usage()
    assert engine.pool.num_free_slots == engine.max_num_seqs


# ---- exactness, one request at a time ----------------------------------------------------------


def test_greedy_prompt_lookup_gives_the_plain_tokens_with_drafts_kept_and_refused(ngram, reference):
    drafted = accepted = 0
    for prompt, new in GREEDY:
        out = ngram.generate(prompt, new, temperature=0, stop_token_ids=[])
        assert out.tokens == reference(prompt, new, temperature=0)
        assert out.finish_reason == "length"
        drafted, accepted = drafted + out.drafted, accepted + out.accepted
    assert 0 < accepted < drafted  # both the kept and the refused path ran
    assert_pool_empty(ngram)


@pytest.mark.parametrize("kind", ["random ids", "random ids among the likely ones", "the plain answer"])
def test_greedy_speculation_gives_the_plain_tokens_whatever_the_drafter_proposes(custom, reference, kind):
    answers = {tuple(p): reference(p, new, temperature=0) for p, new in GREEDY}
    likely = sorted({t for tokens in answers.values() for t in tokens})
    drafter = {"random ids": RandomDrafter(1), "random ids among the likely ones": RandomDrafter(2, likely),
               "the plain answer": Oracle(answers)}[kind]
    use(custom, drafter)
    drafted = accepted = 0
    for prompt, new in GREEDY:
        out = custom.generate(prompt, new, temperature=0, stop_token_ids=[])
        assert out.tokens == answers[tuple(prompt)]
        drafted, accepted = drafted + out.drafted, accepted + out.accepted
    assert drafted > 0
    if kind == "the plain answer":
        assert accepted == drafted  # every draft is the target's own choice
    if kind == "random ids among the likely ones":
        assert 0 < accepted < drafted
    assert_pool_empty(custom)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["all-tokens", "top-k-top-p", "cool-top-p"])
def test_seeded_sampling_with_speculation_gives_the_plain_tokens(ngram, custom, reference, sampling):
    """The verifier draws at each position with the counter-based uniform of that position, so a
    kept draft is the token plain decoding draws there and the output is equal token for token."""
    new = 16
    expected = reference(SAMPLED_PROMPT, new, **sampling)
    assert ngram.generate(SAMPLED_PROMPT, new, stop_token_ids=[], **sampling).tokens == expected
    oracle = Oracle({tuple(SAMPLED_PROMPT): expected})
    out = use(custom, oracle).generate(SAMPLED_PROMPT, new, stop_token_ids=[], **sampling)
    assert out.tokens == expected
    assert out.drafted > 0 and out.accepted == out.drafted
    out = use(custom, RandomDrafter(3, sorted(set(expected)))).generate(SAMPLED_PROMPT, new, stop_token_ids=[],
                                                                        **sampling)
    assert out.tokens == expected and out.drafted > 0
    assert_pool_empty(custom)
    assert_pool_empty(ngram)


# ---- exactness in a batch ----------------------------------------------------------------------

# (prompt, max new tokens, sampling); greedy and sampled, of different lengths
BATCH = [
    (repeating_prompt(5, 11), 12, {"temperature": 0}),
    (repeating_prompt(8, 12), 9, {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 31}),
    (repeating_prompt(3, 13), 14, {"temperature": 0}),
    (repeating_prompt(6, 14), 7, {"temperature": 0.9, "top_k": 0, "top_p": 0.9, "seed": 32}),
    (repeating_prompt(4, 15), 10, {"temperature": 0}),
]


def run_batch(engine: Engine, requests, arrivals: dict[int, list[int]]) -> tuple[list[Sequence], int]:
    """Add requests before the steps ``arrivals`` names, step until done; the sequences and the
    most that ran at once."""
    seqs, step, most = {}, 0, 0
    while step <= max(arrivals) or engine.has_work:
        for i in arrivals.get(step, []):
            prompt, new, sampling = requests[i]
            seqs[i] = engine.add_request(prompt, new, stop_token_ids=[], **sampling)
        engine.step()
        most = max(most, len(engine.scheduler.running))
        step += 1
    return [seqs[i] for i in range(len(requests))], most


def test_every_sequence_of_a_speculating_batch_gets_its_plain_tokens_while_others_join(ngram, reference):
    seqs, most = run_batch(ngram, BATCH, {0: [0, 1], 2: [2], 4: [3], 7: [4]})
    for seq, (prompt, new, sampling) in zip(seqs, BATCH):
        assert seq.output == reference(prompt, new, **sampling), seq.id
        assert seq.finish_reason == "length"
    assert most >= 3
    assert sum(s.drafted for s in seqs) > 0 and sum(s.accepted for s in seqs) > 0
    assert_pool_empty(ngram)


def test_requests_that_wait_for_a_slot_still_get_their_plain_tokens(packed, reference):
    engine = spec_engine(packed, max_num_seqs=2, spec_tokens=3)
    requests = BATCH[:4]
    seqs, most = run_batch(engine, requests, {0: [0, 1, 2], 3: [3]})
    assert most == 2
    for seq, (prompt, new, sampling) in zip(seqs, requests):
        assert seq.output == reference(prompt, new, **sampling), seq.id
    assert sum(s.accepted for s in seqs) > 0
    assert_pool_empty(engine)


GROWING = [(repeating_prompt(3, 51), 14, {"temperature": 0}),
           (repeating_prompt(3, 52), 14, {"temperature": 1.0, "top_k": 64, "seed": 21}),
           (repeating_prompt(3, 53), 14, {"temperature": 0.9, "top_k": 0, "top_p": 0.9, "seed": 22})]


def test_preempted_speculating_sequences_are_read_again_and_continue_exactly(packed, reference):
    """A pool of 40 full-attention positions holds the three prompts but not their replies and
    drafts: the newest is preempted (its drafts with it), read again, and still gets its tokens."""
    answers = [reference(p, new, **s) for p, new, s in GROWING]
    likely = sorted({t for tokens in answers for t in tokens})
    engine = spec_engine(packed, RandomDrafter(7, likely), kv_tokens=40)
    seqs, _ = run_batch(engine, GROWING, {0: [0, 1, 2]})
    assert engine.scheduler.preempted_total > 0
    for seq, tokens in zip(seqs, answers):
        assert seq.output == tokens
    assert 0 < sum(s.accepted for s in seqs) < sum(s.drafted for s in seqs)
    assert_pool_empty(engine)


def test_a_batch_with_the_plain_answers_as_drafts_keeps_them_all_and_stays_exact(custom, reference):
    answers = {tuple(p): reference(p, new, **s) for p, new, s in BATCH}
    oracle = Oracle(answers)
    seqs, _ = run_batch(use(custom, oracle), BATCH, {0: [0, 1, 2], 3: [3, 4]})
    for seq, (prompt, _, _) in zip(seqs, BATCH):
        assert seq.output == answers[tuple(prompt)]
        assert seq.drafted > 0 and seq.accepted == seq.drafted
    assert_pool_empty(custom)


# ---- the verification rule samples the target distribution -------------------------------------


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) over the top_k largest, cut to the smallest prefix reaching top_p."""
    order = torch.argsort(logits, descending=True)
    p = torch.zeros_like(logits, dtype=torch.float64)
    kept = order[:top_k]
    p[kept] = torch.softmax(logits[kept].double() / temperature, -1)
    cut = torch.zeros_like(p)
    before = 0.0
    for i in kept.tolist():
        if before < top_p:
            cut[i] = p[i]
        before += float(p[i])
    return cut / cut.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, draft", [
    (0.8, 6, 1.0, 2),  # a middling draft
    (1.0, 6, 1.0, 3),  # the likeliest token as the draft
    (1.3, 3, 1.0, 5),  # a draft outside the top_k: never kept
    (1.0, 6, 0.7, 2),  # top_p cuts the tail
])
def test_keeping_a_draft_iff_it_equals_the_sampled_token_yields_the_target_distribution(temperature, top_k,
                                                                                        top_p, draft):
    """Rejection sampling with a point-mass draft q = 1 at d: d is kept with probability p(d), and
    when it is refused the token is distributed as p restricted to the other tokens. Over 20,000
    seeds of one batched call, the frequencies match within 4 standard errors."""
    n, position = 20_000, 37
    logits = torch.tensor([0.4, -0.3, 1.2, 2.0, 0.0, -1.5])
    target = target_distribution(logits, temperature, top_k, top_p)
    seeds = torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(top_k * 10 + draft))
    second_draft = 3

    def draw(at: int) -> list[int]:
        return sample(logits.expand(n, -1).contiguous(), torch.full((n,), temperature), torch.full((n,), top_k),
                      torch.full((n,), top_p), uniforms(seeds, torch.full((n,), at)), keep=6).tolist()

    picked = list(zip(draw(position), draw(position + 1)))  # the target's picks after the newest token and d
    kept = [accepted_count([draft, second_draft], [a, b]) for a, b in picked]
    first = [draft if k else a for k, (a, _) in zip(kept, picked)]  # the rule: d if kept, else the target's pick

    def close(count: int, total: int, p: float) -> bool:
        if p == 0.0:
            return count == 0
        return abs(count / total - p) <= 4 * math.sqrt(p * (1 - p) / total)

    for token in range(6):
        assert close(first.count(token), n, float(target[token])), (token, first.count(token) / n, target)
    assert close(sum(k > 0 for k in kept), n, float(target[draft]))
    refused = [t for k, t in zip(kept, first) if k == 0]
    residual = target.clone()
    residual[draft] = 0
    if residual.sum() > 0:
        residual /= residual.sum()
    for token in range(6):
        assert close(refused.count(token), len(refused), float(residual[token])), token
    # the draws of consecutive positions are independent: both drafts kept with p(d) p(d2)
    assert close(sum(k == 2 for k in kept), n, float(target[draft] * target[second_draft]))


# ---- accepted_count and prompt lookup ----------------------------------------------------------


def test_accepted_count_counts_the_leading_drafts_the_target_agreed_with():
    assert accepted_count([], [7]) == 0
    assert accepted_count([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_count([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_count([5, 6, 7], [5, 9, 7, 8]) == 1  # a later agreement after a refusal counts for nothing
    assert accepted_count([5, 6, 7], [5, 6, 1, 8]) == 2
    assert accepted_count([5, 5], [5, 5, 5]) == 2


def seq_of(tokens: list[int], output: list[int] | None = None) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams(temperature=0), 0, 64, frozenset())
    seq.output = list(output or [])
    return seq


def brute_force_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        for e in range(end - 1, n - 1, -1):  # latest first; e == end would be the suffix itself
            if tokens[e - n : e] == tokens[end - n :]:
                return tokens[e : e + k]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    lookup = PromptLookup()
    assert lookup.propose(seq_of([1, 2, 3, 9, 4, 1, 2, 3, 8, 5, 1, 2, 3]), 2) == [8, 5]  # the later of two
    assert lookup.propose(seq_of([1, 2, 3, 9, 4, 1, 2, 3, 8, 5, 1, 2, 3]), 8) == [8, 5, 1, 2, 3]  # cut at the end
    assert lookup.propose(seq_of([1, 2], [3, 9, 4, 1, 2, 3]), 3) == [9, 4, 1]  # prompt and output together


def test_prompt_lookup_tries_the_longest_ngram_first_from_four_down_to_two():
    tokens = [10, 11, 12, 13, 50, 51, 12, 13, 60, 61, 10, 11, 12, 13]
    assert PromptLookup().propose(seq_of(tokens), 2) == [50, 51]  # the 4-gram, not the later 2-gram
    tokens = [10, 11, 12, 13, 50, 30, 12, 13, 60, 40, 99, 11, 12, 13]
    assert PromptLookup().propose(seq_of(tokens), 1) == [50]  # the 3-gram (the 4-gram is new), not the 2-gram
    tokens = [3, 4, 70, 5, 3, 4]
    assert PromptLookup().propose(seq_of(tokens), 2) == [70, 5]  # a 2-gram
    five = [1, 2, 3, 4, 5, 80, 9, 2, 3, 4, 5, 81, 1, 2, 3, 4, 5]
    assert PromptLookup().propose(seq_of(five), 1) == [81]  # n stops at 4: the 5-gram match is not preferred


def test_prompt_lookup_proposes_nothing_without_a_match_and_never_matches_the_suffix_itself():
    lookup = PromptLookup()
    assert lookup.propose(seq_of([1, 2, 3, 4, 5]), 4) == []
    assert lookup.propose(seq_of([7, 1, 8, 2, 7]), 4) == []  # a single token is no match (n >= 2)
    assert lookup.propose(seq_of([5]), 4) == []
    assert lookup.propose(seq_of([6, 6]), 4) == []  # the only (6, 6) is the suffix
    assert lookup.propose(seq_of([7, 7, 7]), 4) == [7]  # the earlier, overlapping (7, 7)
    with pytest.raises(Qat4Error, match="min_n"):
        PromptLookup(max_n=2, min_n=3)


def test_prompt_lookup_stays_correct_as_tokens_are_appended_between_proposals():
    g = torch.Generator().manual_seed(4)
    lookup = PromptLookup()
    seq = seq_of(torch.randint(0, 4, (3,), generator=g).tolist())
    found = 0
    for _ in range(150):
        k = int(torch.randint(1, 6, (1,), generator=g))
        expected = brute_force_lookup(seq.tokens, k)
        assert lookup.propose(seq, k) == expected, (seq.tokens, k)
        found += bool(expected)
        alphabet = 4 if len(seq.output) % 40 < 30 else 50  # now and then a stretch without matches
        grow = int(torch.randint(1, 4, (1,), generator=g))
        seq.output += torch.randint(0, alphabet, (grow,), generator=g).tolist()
    assert found > 100  # a small alphabet repeats a lot
    other = seq_of([9, 8, 9, 8])  # a second sequence keeps its own index
    assert lookup.propose(other, 3) == [9, 8]


# ---- nothing leaks, long generations -----------------------------------------------------------


def test_an_aborted_speculating_sequence_gives_everything_back_and_the_other_is_unharmed(ngram, reference):
    prompt_a, new_a = GREEDY[0]
    prompt_b, new_b = GREEDY[1]
    keep = ngram.add_request(prompt_b, new_b, temperature=0, stop_token_ids=[])
    drop = ngram.add_request(prompt_a, 60, temperature=0, stop_token_ids=[])
    for _ in range(30):  # until drop has verified drafts and a step with drafts is in flight
        if drop.drafted and ngram._in_flight is not None and ngram._in_flight.verifies:
            break
        ngram.step()
    assert drop.drafted and ngram._in_flight.verifies and drop.state is State.RUNNING
    ngram.abort(drop)
    assert drop.finish_reason == "abort"
    ngram.drain()
    assert keep.output == reference(prompt_b, new_b, temperature=0)
    never_ran = ngram.add_request(prompt_a, 8, temperature=0, stop_token_ids=[])
    ngram.abort(never_ran)  # aborted while it waits
    assert never_ran.state is State.FINISHED and not never_ran.output
    assert_pool_empty(ngram)


def window_held(engine: Engine) -> int:
    """Check that every decoding sequence of the step in flight holds a sliding block for each
    position from the window of its first query (its newest token) through its last draft; the
    sequences checked."""
    launched, checked = engine._in_flight, 0
    for seq, drafts in zip(launched.seqs, launched.drafts) if launched is not None else []:
        if seq.finished or not seq.output:  # ended, or a prompt's last chunk
            continue
        first, last = seq.num_computed - 1, seq.num_computed - 1 + len(drafts)
        need = last // 4 - max(0, first - SMALL.sliding_window + 1) // 4 + 1
        assert engine.pool.held_blocks(seq.slot)["sliding_attention"] >= need, (seq.id, first, last)
        checked += 1
    return checked


LONG = [(repeating_prompt(6, 21), 44, {"temperature": 0}),
        (repeating_prompt(6, 22), 36, {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 41})]


@pytest.mark.parametrize("drafter", ["prompt lookup", "random ids among the likely ones"])
def test_long_generations_slide_past_the_window_with_speculation_and_stay_exact(packed, reference, drafter):
    """44 and 36 tokens after 16-token prompts, side by side: the window of 8 slides five times
    and more while refused drafts leave KV past the kept positions, and the sliding blocks each
    gives back go to the other, so a block given back too early would be written over."""
    expected = [reference(p, new, **s) for p, new, s in LONG]
    likely = sorted({t for tokens in expected for t in tokens})
    engine = spec_engine(packed, RandomDrafter(5, likely) if drafter != "prompt lookup" else None)
    seqs = [engine.add_request(p, new, stop_token_ids=[], **s) for p, new, s in LONG]
    most = checked = 0
    while engine.has_work:
        engine.step()
        checked += window_held(engine)
        for seq in seqs:
            if len(seq.output) >= 2 and seq.slot is not None:
                most = max(most, engine.pool.held_blocks(seq.slot)["sliding_attention"])
    assert checked > 20
    for seq, tokens in zip(seqs, expected):
        assert seq.output == tokens
    assert 0 < sum(s.accepted for s in seqs) < sum(s.drafted for s in seqs)
    assert engine.scheduler.preempted_total == 0
    # old blocks were given back
    assert 0 < most <= sliding_blocks_per_seq(SMALL.sliding_window + spec_lookahead(K), 4, 128)
    assert_pool_empty(engine)


# ---- stop tokens and the token limit inside a run of kept drafts -------------------------------


def stop_inside_a_run(tokens: list[int]) -> int:
    """An index i whose token first occurs there and that an all-kept run of K drafts (the steps
    after the first token feed output indices 1 + m(K + 1) ..) covers with a kept draft after it."""
    for i in range(2, len(tokens)):
        if tokens.index(tokens[i]) == i and (i - 1) % (K + 1) <= K - 2:
            return i
    raise AssertionError(f"no usable stop token in {tokens}")


@pytest.mark.parametrize("prompt, sampling", [
    (GREEDY[0][0], {"temperature": 0}),
    (SAMPLED_PROMPT, SAMPLINGS[1]),
], ids=["greedy", "sampled"])
def test_a_stop_token_among_kept_drafts_ends_the_generation_there(custom, ngram, plain_engine, reference, prompt,
                                                                   sampling):
    full = reference(prompt, 16, **sampling)
    i = stop_inside_a_run(full)
    stop = full[i]
    plain = plain_engine.generate(prompt, 16, stop_token_ids=[stop], **sampling)
    assert plain.tokens == full[:i] and plain.finish_reason == "stop"
    oracle = Oracle({tuple(prompt): full})
    out = use(custom, oracle).generate(prompt, 16, stop_token_ids=[stop], **sampling)
    assert (out.tokens, out.finish_reason) == (plain.tokens, "stop")
    assert 0 < out.accepted < out.drafted  # the drafts after the stop token are not in the reply, nor counted kept
    # a proposal covered index i with at least one more draft after it: kept, and dropped after the stop
    assert any(done <= i <= done + len(p) - 2 for done, _, p in oracle.calls), oracle.calls
    out = ngram.generate(prompt, 16, stop_token_ids=[stop], **sampling)
    assert (out.tokens, out.finish_reason) == (plain.tokens, "stop")
    seq = custom.add_request(prompt, 16, stop_token_ids=[stop], **sampling)
    custom.drain()
    assert seq.output == full[: i + 1] and seq.finish_reason == "stop"  # the stop token is the last output
    assert_pool_empty(custom)
    assert_pool_empty(ngram)


@pytest.mark.parametrize("new", [1, 2, 5, 6, 7])
def test_max_new_tokens_is_respected_exactly_with_speculation(custom, ngram, reference, new):
    prompt = GREEDY[2][0]
    full = reference(prompt, 16, temperature=0)
    oracle = Oracle({tuple(prompt): full})
    out = use(custom, oracle).generate(prompt, new, temperature=0, stop_token_ids=[])
    assert out.tokens == full[:new] and out.finish_reason == "length"
    assert all(k <= new - 1 - done for done, k, _ in oracle.calls), oracle.calls  # no draft past the limit
    if new >= 5:
        assert out.accepted == out.drafted > 0
    out = ngram.generate(prompt, new, temperature=0, stop_token_ids=[])
    assert out.tokens == full[:new] and out.finish_reason == "length"
    assert_pool_empty(custom)
    assert_pool_empty(ngram)


def test_cancelling_a_stream_ends_it_at_once_inside_a_run_of_kept_drafts(custom, plain_engine, reference):
    """should_stop returning True after the second token ends a plain stream there; a verifying
    step that brought five tokens at once must not hand out the three after it."""
    prompt = GREEDY[0][0]
    full = reference(prompt, 16, temperature=0)

    def cancelled_after(engine, n):
        calls = []

        def should_stop():
            calls.append(len(calls))
            return len(calls) >= n

        return list(engine.stream(prompt, 16, temperature=0, stop_token_ids=[], should_stop=should_stop)), len(calls)

    assert cancelled_after(plain_engine, 2) == (full[:2], 2)
    use(custom, Oracle({tuple(prompt): full}))
    assert cancelled_after(custom, 2) == (full[:2], 2)
    custom.drain()  # the step still in flight is read by the next one
    assert_pool_empty(custom)


# ---- the adaptive draft length -----------------------------------------------------------------


def decoding(n: int, *, kept: float, refused: float, max_new: int = 50, done: int = 3) -> list[Sequence]:
    seqs = []
    for _ in range(n):
        seq = seq_of([2, 5, 6, 7], [8] * done)
        seq.max_new_tokens, seq.draft_stats = max_new, [kept, refused]
        seqs.append(seq)
    return seqs


def costs(per_step: float, per_row: float, top_b: int = 32) -> dict[tuple[int, int], float]:
    return {(b, q): per_step + per_row * b * q for b in range(1, top_b + 1) for q in range(1, K + 2)}


def speculator(table, adaptive=True) -> Speculator:
    return Speculator(PromptLookup(), K, table, padded=lambda n: n, adaptive=adaptive)


def test_draft_length_drafts_when_extra_rows_are_nearly_free_and_drafts_are_kept():
    s = speculator(costs(1e-2, 1e-6))
    assert s.draft_length(decoding(1, kept=9.0, refused=1.0)) == K
    assert s.draft_length(decoding(4, kept=9.0, refused=1.0)) == K


def test_draft_length_is_zero_when_a_step_costs_as_much_as_its_rows():
    s = speculator(costs(0.0, 1e-2))
    assert s.draft_length(decoding(1, kept=9.0, refused=1.0)) == 0
    assert s.draft_length(decoding(3, kept=99.0, refused=1.0)) == 0


def test_draft_length_follows_the_acceptance_and_the_host_time_under_a_moderate_cost():
    table = {(b, q): 1.0 + 0.1 * (q - 1) for b in range(1, 5) for q in range(1, K + 2)}
    s = speculator(table)
    assert s.draft_length(decoding(1, kept=9.0, refused=1.0)) == K  # a = 0.9
    assert s.draft_length(decoding(1, kept=0.5, refused=9.5)) == 0  # a = 0.05: one draft gains 5% for 10%
    even = decoding(1, kept=5.0, refused=5.0)
    assert s.draft_length(even) == 2  # a = 0.5: 1.75 tokens for 1.2 beats 1.5 for 1.1 and 1.875 for 1.3
    s.observe(1, K, table[(1, K + 1)] + 1.0)  # a verifying step took 1 s beyond its graph: the host's share
    assert s.draft_length(even) == 0  # now no k pays for the wait
    assert s.draft_length(decoding(1, kept=9.0, refused=1.0)) == K  # good odds still do


def test_a_sequence_idle_for_long_probes_with_a_few_drafts_even_where_drafting_does_not_pay():
    s = speculator(costs(0.0, 1e-2))
    seq = decoding(1, kept=9.0, refused=1.0)[0]
    seq.idle_steps = PROBE_EVERY - 1
    assert s.draft_length([seq]) == 0
    seq.idle_steps = PROBE_EVERY
    assert s.draft_length([seq]) == min(K, PROBE_TOKENS)
    seq.max_new_tokens = seq.launched_outputs + 2  # room for one draft only
    assert s.draft_length([seq]) == 1


def test_each_fruitless_verification_in_a_row_doubles_the_wait_before_a_probe():
    s = speculator(costs(0.0, 1e-2))
    seq = decoding(1, kept=9.0, refused=1.0)[0]
    for fruitless in range(PROBE_BACKOFF + 2):
        wait = PROBE_EVERY << min(fruitless, PROBE_BACKOFF)
        seq.idle_steps = wait - 1
        assert s.draft_length([seq]) == 0
        seq.idle_steps = wait
        assert s.draft_length([seq]) == min(K, PROBE_TOKENS)
        s.record(seq, PROBE_TOKENS, 0)
        assert seq.fruitless == fruitless + 1 and seq.idle_steps == 0
    s.record(seq, PROBE_TOKENS, 1)  # a kept draft: probes come PROBE_EVERY steps apart again
    assert seq.fruitless == 0


def test_draft_length_is_zero_above_the_speculating_batch_size():
    s = speculator(costs(1e-2, 1e-6))
    assert s.draft_length(decoding(SPEC_MAX_BATCH, kept=9.0, refused=1.0)) == K
    assert s.draft_length(decoding(SPEC_MAX_BATCH + 1, kept=9.0, refused=1.0)) == 0
    assert speculator(costs(1e-2, 1e-6), adaptive=False).draft_length(decoding(SPEC_MAX_BATCH + 1, kept=1.0,
                                                                               refused=1.0)) == 0
    assert s.draft_length([]) == 0


@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_length_never_passes_any_sequences_remaining_room(adaptive):
    s = speculator(costs(1e-2, 1e-6), adaptive)
    for done, pending, room in [(3, 0, K), (10, 0, 1), (9, 1, 1), (8, 0, 3), (11, 0, 0), (10, 1, 0)]:
        seq = decoding(1, kept=9.0, refused=1.0, max_new=12, done=done)[0]
        seq.pending = pending
        assert s.draft_length([seq]) == min(K, room), (done, pending)
        roomy = decoding(2, kept=9.0, refused=1.0)
        assert s.draft_length(roomy + [seq]) == min(K, room)  # the tightest sequence decides


def test_draft_length_drafts_the_most_allowed_when_not_adaptive():
    s = speculator(costs(0.0, 1.0), adaptive=False)
    assert s.draft_length(decoding(2, kept=0.0, refused=10.0)) == K


@pytest.mark.parametrize("max_num_seqs", [8, 6])
def test_the_measured_step_costs_cover_every_batch_the_adaptive_speculator_weighs(packed, max_num_seqs):
    """draft_length looks up costs[(padded(n), k + 1)] for n decoding sequences; a missing entry
    scores every k as 0 tokens per second, so such a batch never speculates."""
    engine = Engine.from_packed(packed, "cpu", speculative="ngram", spec_tokens=2, max_num_seqs=max_num_seqs,
                                **OPTIONS)
    spec = engine.speculator
    assert spec.adaptive
    missing = [(engine.runner.padded(n), q) for n in range(1, min(max_num_seqs, SPEC_MAX_BATCH) + 1)
               for q in range(1, engine.spec_tokens + 2) if (engine.runner.padded(n), q) not in spec.costs]
    assert not missing, f"no step cost for (batch, rows per sequence) {missing}; measured {sorted(spec.costs)}"


def test_propose_pads_short_proposals_and_drafts_nothing_without_any():
    class Fixed:
        def __init__(self, by_prompt):
            self.by_prompt = by_prompt

        def propose(self, seq, k):
            return list(self.by_prompt[tuple(seq.prompt)])

    a, b, c = seq_of([1, 2]), seq_of([3, 4], [9]), seq_of([5, 6])
    s = Speculator(Fixed({(1, 2): [7, 8, 9, 10, 11], (3, 4): [], (5, 6): [4]}), K, {}, lambda n: n)
    assert s.propose([a, b, c], 3) == 3
    assert (a.drafts, b.drafts, c.drafts) == ([7, 8, 9], [9, 9, 9], [4, 4, 4])  # cut to k, padded
    d = seq_of([1, 2])
    quiet = Speculator(Fixed({(1, 2): []}), K, {}, lambda n: n)
    assert quiet.propose([d], 3) == 0 and d.drafts == []


# ---- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_tokens", [0, 9, -1])
def test_spec_tokens_outside_one_to_eight_is_a_clear_error(packed, spec_tokens):
    with pytest.raises(Qat4Error, match=rf"spec_tokens is {spec_tokens}; it must be 1 to 8"):
        Engine.from_packed(packed, "cpu", speculative="ngram", spec_tokens=spec_tokens, **OPTIONS)


def test_an_unknown_drafter_is_a_clear_error_naming_the_choices(packed):
    with pytest.raises(Qat4Error, match=r"'eagle' is not known; the choices are: ngram"):
        Engine.from_packed(packed, "cpu", speculative="eagle", **OPTIONS)


def test_enable_speculation_needs_an_engine_built_for_drafts(plain_engine):
    with pytest.raises(Qat4Error, match="without spec_tokens"):
        plain_engine.enable_speculation(PromptLookup())


def test_drafts_are_dropped_rather_than_preempting_when_the_pool_is_short(packed):
    """A step whose drafts need blocks the pool does not have free decodes plainly instead: no
    sequence is preempted to hold positions that may all be refused."""
    engine = spec_engine(packed)
    seq = engine.add_request(GREEDY[0][0], 12, temperature=0, stop_token_ids=[])
    engine.step()  # the prompt's step: a step that speculates holds blocks ahead for the next one
    taken = {kind: alloc.allocate(alloc.num_free) for kind, alloc in engine.pool.allocators.items()}
    seq.drafts = [1] * K
    ahead = engine.pool.blocks_to_grow(seq.slot, seq.length + K, seq.num_computed)
    assert any(ahead.values())  # the drafts would need a new block
    batch = engine.scheduler.schedule()
    assert seq.drafts == [] and engine.scheduler.preempted_total == 0
    assert batch.decode == [seq] or not batch  # a plain row, when its own position still fits
    for kind, blocks in taken.items():
        engine.pool.allocators[kind].release(blocks)


def test_a_speculating_step_finds_the_blocks_it_writes_held_by_the_step_before(packed, reference):
    """The step before a verification holds its blocks ahead (``Scheduler.reserve``, while the
    GPU runs), as far as the next step can write and no further: from the first speculating step
    on, no step allocates a block or uploads a table entry between reading the last step's tokens
    and launching."""
    engine = spec_engine(packed, RandomDrafter(3))  # k drafts every step
    prompt, new = repeating_prompt(6, 21), 40
    needs, uploads_at_launch, reach = [], [], []
    schedule, launch, upload = engine.scheduler.schedule, engine.runner.launch, engine.pool.uploads.new

    def watched_schedule():
        for s in engine.scheduler.running:
            if s.length - s.num_computed == 1:  # decoding: its newest token, then its drafts
                needs.append(sum(engine.pool.blocks_to_grow(s.slot, s.length + len(s.drafts), s.num_computed).values()))
        return schedule()

    def watched_launch(decode, keep, chunks, *args, **kwargs):
        calls = []
        engine.pool.uploads.new = lambda rows: calls.append(rows) or upload(rows)
        try:
            return launch(decode, keep, chunks, *args, **kwargs)
        finally:
            del engine.pool.uploads.new
            if decode and not chunks:
                uploads_at_launch.append(len(calls))

    engine.scheduler.schedule, engine.runner.launch = watched_schedule, watched_launch
    seq = engine.add_request(prompt, new, temperature=0, stop_token_ids=[])
    while engine.has_work:
        engine.step()
        launched = engine._in_flight
        if launched is not None and launched.verifies and not seq.finished:
            furthest = min(seq.num_known + len(launched.drafts[0]) + 1 + K, len(prompt) + new - 1)
            reach.append((engine.pool.held_blocks(seq.slot)["full_attention"], -(-furthest // 4)))
    assert seq.output == reference(prompt, new, temperature=0)
    assert len(needs) > 20 and len(reach) > 20
    assert not any(needs[1:]), needs  # only the first speculating step grows
    assert not any(uploads_at_launch[1:]), uploads_at_launch
    assert all(held == blocks for held, blocks in reach), reach
    assert_pool_empty(engine)


def test_holding_blocks_ahead_leaves_a_block_for_every_running_sequence_and_stops_at_the_last_position(packed,
                                                                                                      reference):
    engine = spec_engine(packed)
    seqs = [engine.add_request(p, new, temperature=0, stop_token_ids=[]) for p, new in GREEDY[:2]]
    while any(s.slot is None or s.length - s.num_computed != 1 for s in seqs):
        engine.step()
    seq, other = seqs
    far = 4 * K  # further than a step holds ahead
    assert any(engine.pool.blocks_to_grow(seq.slot, seq.length + far, seq.num_computed - 1).values())
    held = engine.pool.held_blocks(seq.slot)
    spare = len(engine.scheduler.running)
    taken = {kind: alloc.allocate(alloc.num_free - spare) for kind, alloc in engine.pool.allocators.items()}
    engine.scheduler.reserve([seq], far)
    assert engine.pool.held_blocks(seq.slot) == held  # only the running sequences' spares were free
    for kind, blocks in taken.items():
        engine.pool.allocators[kind].release(blocks)
    engine.scheduler.reserve([seq], far)
    assert engine.pool.held_blocks(seq.slot)["full_attention"] > held["full_attention"]
    engine.scheduler.reserve([seq], 1000)
    last = len(seq.prompt) + seq.max_new_tokens - 1  # positions it can ever feed
    assert engine.pool.held_blocks(seq.slot)["full_attention"] == -(-last // 4)
    engine.drain()
    assert [s.output for s in seqs] == [reference(p, new, temperature=0) for p, new in GREEDY[:2]]
    assert_pool_empty(engine)


def staggered_requests(seed: int) -> list[tuple[int, list[int], int]]:
    """Four greedy requests arriving 0-3 steps apart: (step, prompt, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    requests, step = [], 0
    for i in range(4):
        n = int(torch.randint(4, 14, (1,), generator=g))
        requests.append((step, repeating_prompt(n, 100 * seed + i), int(torch.randint(8, 30, (1,), generator=g))))
        step += int(torch.randint(0, 4, (1,), generator=g))
    return requests


@pytest.mark.parametrize("seed, kv_tokens", [(3, 64), (27, 80)])
def test_holding_blocks_ahead_never_costs_a_sequence_reading_its_prompt_its_place(packed, reference, seed,
                                                                                    kv_tokens):
    """Staggered arrivals on a pool that holds a few sequences: a drafting sequence holds blocks
    ahead only once no sequence is still reading its prompt, so it never preempts one that was
    admitted on the blocks for the rest of its prompt (these workloads did, when it could)."""
    def run(hold_ahead: bool) -> tuple[int, list[list[int]]]:
        engine = spec_engine(packed, kv_tokens=kv_tokens, max_num_seqs=4, prompt_cache_mib=0)
        if not hold_ahead:
            engine.scheduler.reserve = lambda seqs, ahead: None
        arrivals, seqs, step = staggered_requests(seed), [], 0
        while arrivals or engine.has_work:
            while arrivals and arrivals[0][0] <= step:
                _, prompt, new = arrivals.pop(0)
                seqs.append(engine.add_request(prompt, new, temperature=0, stop_token_ids=[]))
            engine.step()
            step += 1
        assert_pool_empty(engine)
        return engine.scheduler.preempted_total, [s.output for s in seqs]

    preempted, outputs = run(True)
    assert preempted <= run(False)[0]
    assert outputs == [reference(prompt, new, temperature=0) for _, prompt, new in staggered_requests(seed)]


class CountingEvent:
    """Stands in for a CUDA event on the CPU: counts its records and waits."""

    def __init__(self):
        self.records = self.waits = 0

    def record(self):
        self.records += 1

    def synchronize(self):
        self.waits += 1


def test_verifying_steps_take_their_rows_from_the_buffer_their_graph_copies_in(packed, reference):
    """The CUDA path of a verifying step, on CPU tensors: its rows go into the buffer that its
    forward copies into the step's inputs first (pinned memory on a GPU), after the wait for the
    last verifying step; every other step's rows go straight to the inputs."""
    engine = spec_engine(packed, RandomDrafter(4))
    runner = engine.runner
    runner._verify_rows = torch.full_like(runner._meta, -7)  # what a step reading stale rows would see
    runner._verify_host, runner._verify_done = runner._verify_rows.numpy(), CountingEvent()
    prompt, new = repeating_prompt(6, 23), 30
    out = engine.generate(prompt, new, temperature=0, stop_token_ids=[])
    assert out.tokens == reference(prompt, new, temperature=0)
    verifications = engine.speculator.verified
    assert verifications > 10
    assert runner._verify_done.records == runner._verify_done.waits == verifications
    assert_pool_empty(engine)
