"""The prompt cache on a CUDA GPU at E2B shapes: a request whose history the cache holds gets the
logits of the same tokens read cold, within bf16 rounding (KL and top-1 agreement printed), for a
history six sliding windows long, for one edited in the middle, and beside running sequences.
Run with `pytest -m gpu tests/gpu`."""

import pytest
import torch
from engine_runs import record_logits, run

from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HISTORY = 6 * E2B.sliding_window


@pytest.fixture(scope="module")
def eager():
    """Eager steps, so that every pick goes through the runner's (recorded) pick."""
    return Engine.from_packed(synthetic_model(E2B, seed=0, device="cuda"), "cuda", max_ctx=8192, max_num_seqs=8,
                              kv_tokens=16384, cuda_graph=False)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, E2B.vocab_size, (n,), generator=g).tolist()


def against_cold(engine: Engine, prompt: list[int], new: int, others: list[list[int]] = ()) -> tuple[int, float, float]:
    """Serve ``prompt`` for ``new`` greedy tokens (after ``others`` have started decoding); returns
    its cached prompt tokens, and the mean KL and top-1 agreement of its logits at every picking
    position against the same tokens read cold (:meth:`Engine.logits`, no prompt cache)."""
    seen = record_logits(engine)
    try:
        background = [engine.add_request(p, 48, temperature=0, stop_token_ids=[]) for p in others]
        for _ in range(4 if others else 0):
            engine.step()
        seq = engine.add_request(prompt, new, temperature=0, stop_token_ids=[])
        while not seq.finished:
            engine.step()
        assert all(not s.finished for s in background)  # still decoding: it ran beside them
        engine.drain()
    finally:
        del engine.runner.pick
    cold = torch.log_softmax(engine.logits(prompt + seq.output[:-1]).float().cpu(), -1)
    kls, same = [], 0
    for pos in range(len(prompt) - 1, len(prompt) + new - 1):
        warm = torch.log_softmax(seen[(seq.id, pos)], -1)
        kls.append(float((cold[pos].exp() * (cold[pos] - warm)).sum()))
        same += int(warm.argmax() == cold[pos].argmax())
    return seq.cached_tokens, sum(kls) / len(kls), same / new


def test_a_cached_history_gives_the_logits_of_a_cold_read(eager):
    history = [E2B.bos_token_id] + tokens(HISTORY - 1, 1)
    reply = run(eager, [history], 16, temperature=0)[0]  # the cache keeps the history and the reply
    edit = HISTORY // 2
    cases = {
        "the next turn": (history + reply + tokens(100, 2), []),
        f"the history edited at {edit}": (history[:edit] + [history[edit] % 1000 + 3] + history[edit + 1 :] + reply
                                          + tokens(100, 3), []),
        "the next turn beside 3 decoding sequences": (history + reply + tokens(60, 4),
                                                      [[E2B.bos_token_id] + tokens(200, 5 + i) for i in range(3)]),
    }
    results = {name: against_cold(eager, prompt, 8, others) for name, (prompt, others) in cases.items()}
    for name, (cached, kl, top1) in results.items():
        print(f"\n{name}: {cached} prompt tokens from the cache; against a cold read KL {kl:.2e}, top-1 {top1:.3f}")
    cached = [c for c, _, _ in results.values()]
    assert cached[0] >= HISTORY and 0 < cached[1] <= edit and cached[2] >= HISTORY
    assert all(kl < 1e-3 and top1 >= 0.75 for _, kl, top1 in results.values())
