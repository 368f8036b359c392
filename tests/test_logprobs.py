"""Logprobs on the tiny synthetic model on the CPU: every token's logprob and top tokens are those
of the log-softmax of `Engine.logits` at its position (the model's own distribution, whatever the
sampling or grammar), a prompt's own tokens are scored the same way, and asking for logprobs
changes no token of any sequence in the batch."""

from __future__ import annotations

import pytest
import torch
from server_harness import TINY_MAX_CTX, tiny_tokenizer

from qat4.checkpoint.synth import synthetic_model
from qat4.config import PRESETS
from qat4.engine import Engine
from qat4.engine.logprobs import TOP_LOGPROBS
from qat4.errors import Qat4Error

PROMPT = "The capital of France is"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine():
    """The tiny engine (the weights of server_harness.tiny_engine) in an instance of its own,
    reading prompts in chunks of 16 so that they chunk beside decoding sequences."""
    return Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=TINY_MAX_CTX, prefill_chunk=16,
                              tokenizer=tiny_tokenizer())


def model_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The log-softmax [len, V] of the logits of ``ids`` read alone."""
    return torch.log_softmax(engine.logits(ids), dim=-1)


def check_scored(rows: torch.Tensor, tokens: list[int], entries, k: int) -> None:
    """entries[i] (TokenLogprobs) scores tokens[i] under rows[i] (log-probabilities [V]): its
    logprob, and the k most likely tokens, most likely first."""
    assert [e.token for e in entries] == tokens
    for row, token, entry in zip(rows, tokens, entries):
        assert abs(entry.logprob - float(row[token])) < TOLERANCE
        values, ids = row.topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(lp - float(v)) < TOLERANCE for (_, lp), v in zip(entry.top, values))


SAMPLINGS = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 7},
    "constrained": {"temperature": 0, "json_schema": {"type": "object"}},
}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_each_token_is_scored_under_the_models_own_distribution(engine, sampling):
    """Whatever picks the token (argmax, a seeded draw at a temperature, a grammar's mask), its
    logprob is the model's raw log-softmax; a greedy token is the most likely one."""
    options = dict(SAMPLINGS[sampling])
    schema = options.pop("json_schema", None)
    constraint = None if schema is None else engine.json_constraint(schema)
    ids = engine.encode(PROMPT)
    stops = None if constraint else []  # a grammar ends at a stop token
    seq = engine.add_request(ids, 6, stop_token_ids=stops, constraint=constraint, logprobs=3, **options)
    engine.drain()
    rows = model_logprobs(engine, ids + seq.output)[len(ids) - 1 : -1]
    check_scored(rows, seq.output, seq.token_logprobs, 3)
    if sampling == "greedy":
        assert all(e.top[0][0] == e.token for e in seq.token_logprobs)
    if sampling == "constrained":  # the mask picked tokens the model does not favour, scored unmasked
        assert any(e.top[0][0] != e.token for e in seq.token_logprobs)


def test_prompt_tokens_are_scored_by_the_positions_before_them(engine):
    ids = engine.encode(PROMPT * 3)
    scored = engine.prompt_logprobs(ids, TOP_LOGPROBS)
    assert len(scored) == len(ids) and scored[0] is None
    check_scored(model_logprobs(engine, ids)[:-1], ids[1:], scored[1:], TOP_LOGPROBS)
    assert [e.top for e in engine.prompt_logprobs(ids, 0)[1:]] == [()] * (len(ids) - 1)


def test_logprobs_out_of_range_are_refused(engine):
    with pytest.raises(Qat4Error, match="logprobs is 21"):
        engine.add_request(PROMPT, 2, logprobs=TOP_LOGPROBS + 1)
    with pytest.raises(Qat4Error, match="k is -1"):
        engine.prompt_logprobs([2, 3], -1)


# (prompt, sampling, logprobs) of the requests batched; the prompts are longer than a chunk and
# arrive while the others decode
BATCH = [
    ("Paris is the capital of", {"temperature": 0}, 2),
    ("Once upon a time, in a land far away, there lived a", {"temperature": 0}, None),
    ("1, 2, 3,", {"temperature": 1.0, "top_k": 64, "seed": 5}, 0),
    ("The weather today is sunny and warm, and the children are", {"temperature": 0.7, "seed": 6}, None),
    ("def fibonacci(n):", {"temperature": 0}, TOP_LOGPROBS),
]


def test_a_batch_with_and_without_logprobs_gets_what_each_gets_alone(engine):
    alone = []
    for prompt, sampling, logprobs in BATCH:
        seq = engine.add_request(prompt, 8, stop_token_ids=[], logprobs=logprobs, **sampling)
        engine.drain()
        alone.append(seq)
    seqs, steps = [], 0
    while len(seqs) < len(BATCH) or engine.has_work:
        if steps % 2 == 0 and len(seqs) < len(BATCH):  # one joins every other step
            prompt, sampling, logprobs = BATCH[len(seqs)]
            seqs.append(engine.add_request(prompt, 8, stop_token_ids=[], logprobs=logprobs, **sampling))
        engine.step()
        steps += 1
    for seq, was in zip(seqs, alone):
        assert seq.output == was.output
        assert len(seq.token_logprobs) == (0 if seq.logprobs is None else len(seq.output))
        for got, want in zip(seq.token_logprobs, was.token_logprobs):
            assert got.token == want.token and [t for t, _ in got.top] == [t for t, _ in want.top]
            assert abs(got.logprob - want.logprob) < TOLERANCE
