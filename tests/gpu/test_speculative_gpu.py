"""Speculative decoding on a CUDA GPU at E2B shapes: verification graphs replay what eager steps
compute, drafted greedy output agrees with plain greedy output alone and in a batch, and every
block comes back. The share of identical tokens is printed, for seeded sampling too: on the GPU a
step of 1 + k rows runs the multi-row int4 kernel where a plain step runs the one-row one, so the
two round differently (as a batch does), and a draw from a flat nucleus of a random model moves
with the last bit of its logits; on the CPU both are exact (tests/test_speculative.py).
Run with `pytest -m gpu tests/gpu`."""

import pytest
import torch
from engine_runs import run

from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Oracle:
    """Drafts each sequence's known continuation, every second step a wrong first token."""

    def __init__(self):
        self.futures, self.calls = {}, 0

    def propose(self, seq, k):
        self.calls += 1
        known = self.futures.get(tuple(seq.prompt), [])[len(seq.output) : len(seq.output) + k]
        return [(known[0] + 1) % E2B.vocab_size, *known[1:]] if known and self.calls % 2 else known


class Repeat:
    """Drafts the newest token k times (always a proposal, now and then right)."""

    def propose(self, seq, k):
        return [seq.tokens[-1]] * k


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(E2B, seed=0, device="cuda")


@pytest.fixture(scope="module")
def plain(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=2048, max_num_seqs=16)


@pytest.fixture(scope="module")
def spec(packed):
    engine = Engine.from_packed(packed, "cuda", max_ctx=2048, max_num_seqs=16, speculative="ngram", spec_tokens=4)
    return engine


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, E2B.vocab_size, (60 + 9 * i,), generator=g).tolist() for i in range(n)]


def same_share(a, b):
    """Share of sequences' tokens before the first difference."""
    total = sum(len(x) for x in a)
    agree = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        agree += n
    return agree / total


def test_drafted_greedy_output_agrees_with_plain_alone_and_in_a_batch(plain, spec):
    oracle = Oracle()
    spec.enable_speculation(oracle, adaptive=False)
    batch = prompts(8, seed=1)
    expected = [run(plain, [p], 48, temperature=0)[0] for p in batch]
    oracle.futures = {tuple(p): e for p, e in zip(batch, expected)}
    alone = [run(spec, [p], 48, temperature=0)[0] for p in batch]
    together = run(spec, batch, 48, temperature=0)
    seeded_plain = run(plain, batch, 32, temperature=1.0, top_p=0.9, seed=7)
    seeded_spec = run(spec, batch, 32, temperature=1.0, top_p=0.9, seed=7)
    s = spec.speculator
    print(f"\nspeculative vs plain greedy: alone {same_share(alone, expected):.3f}, in a batch of 8 "
          f"{same_share(together, expected):.3f}, sampled {same_share(seeded_spec, seeded_plain):.3f} of tokens "
          f"before the first difference; {s.accepted} of {s.drafted} drafts kept")
    assert s.accepted > 0 and s.accepted < s.drafted
    assert same_share(alone, expected) >= 0.9 and same_share(together, expected) >= 0.9
    assert all(u == 0 for u in spec.pool.usage().values()) and spec.pool.num_free_slots == spec.max_num_seqs


def test_verification_graphs_replay_what_eager_steps_compute(packed, spec):
    eager = Engine.from_packed(packed, "cuda", max_ctx=2048, max_num_seqs=16, speculative="ngram", spec_tokens=4,
                               cuda_graph=False)
    for engine in (spec, eager):
        engine.enable_speculation(Repeat(), adaptive=False)
    batch = prompts(4, seed=2)
    assert run(spec, batch, 24, temperature=0) == run(eager, batch, 24, temperature=0)
    assert all(key in spec.runner.graphs for key in [(b, q, 1, False, False) for b in spec.spec_sizes for q in range(2, 6)])
