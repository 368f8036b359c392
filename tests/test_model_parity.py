"""The engine's CPU path (torch reference ops, fp32) against transformers 5.17's own Gemma 4.

One tiny synthetic model (every structural feature of E2B, the real 262,144-token vocabulary,
weights exactly on the 4-bit grid) is given to both: packed to the engine, dequantised to
`Gemma4ForCausalLM` (eager attention, fp32). Its sliding window is 8 positions, so sequences of
40+ tokens slide past many windows (and give back their sliding blocks), and the KV-shared layers
read both layer types' pages.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from qat4.checkpoint.synth import synthetic_model
from qat4.config import TINY
from qat4.engine import Engine
from qat4.engine.sampler import SamplingParams
from qat4.engine.sequence import Sequence
from qat4.reference import cast, hf_config, hf_model, rel_max_error

SEQ = 48  # positions: six sliding windows
PREFILL_TOL = 1e-4  # max |engine - HF| / max |HF| over all logits
CHUNKS = (3, 8, 13, SEQ)  # below, at and above the window, and one shot
PROMPT_CHUNKS = (13, 7)  # the decode test's prompt: a chunk above the window, then one below
PROMPT = sum(PROMPT_CHUNKS)


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(TINY, seed=0)


@pytest.fixture(scope="module")
def hf(packed):
    return hf_model(packed)


@pytest.fixture(scope="module")
def engines(packed):
    """One fp32 CPU engine per prefill chunk size (they share nothing but the packed weights)."""
    return {c: Engine.from_packed(packed, "cpu", max_ctx=256, prefill_chunk=c) for c in CHUNKS}


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return [TINY.bos_token_id] + torch.randint(3, TINY.vocab_size, (SEQ - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_engine_is_fp32_on_cpu(engines):
    engine = engines[SEQ]
    assert engine.dtype == torch.float32 and engine.device.type == "cpu"
    assert engine.model.embed_scale == float(torch.tensor(TINY.hidden_size**0.5))  # fp32 sqrt, as HF in fp32


@pytest.fixture(scope="module")
def engine_logits(engines, ids):
    """Engine logits of ids, per prefill chunk size."""
    return {c: engines[c].logits(ids) for c in CHUNKS}


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_logits_match_hf(engine_logits, hf_logits, chunk):
    got = engine_logits[chunk]
    err = rel_max_error(got, hf_logits)
    print(f"prefill in chunks of {chunk}: rel. max error vs HF {err:.2e}")
    assert err < PREFILL_TOL
    assert torch.equal(got.argmax(-1), hf_logits.argmax(-1))


@pytest.mark.parametrize("chunk", CHUNKS[:-1])
def test_chunked_prefill_equals_one_shot(engine_logits, chunk):
    one_shot, got = engine_logits[SEQ], engine_logits[chunk]
    err = rel_max_error(got, one_shot)
    print(f"prefill in chunks of {chunk} vs one shot: rel. max error {err:.2e}")
    assert err < PREFILL_TOL  # fp32 rounding of different matmul shapes, amplified by the norms
    assert torch.equal(got.argmax(-1), one_shot.argmax(-1))


def test_decode_matches_hf_past_key_values(packed, hf, engines, ids):
    """Prefill PROMPT tokens (chunks above and below the window), then one token at a time to SEQ,
    on both sides: decode crosses the window boundary of every ring several times."""
    cache = DynamicCache(config=hf_config(packed))
    tokens = torch.tensor([ids])
    with torch.no_grad():
        ref = [hf(tokens[:, :PROMPT], past_key_values=cache, use_cache=True).logits[0, -1:]]
        for i in range(PROMPT, SEQ):
            ref.append(hf(tokens[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0])
    ref = torch.cat(ref)

    engine = engines[8]
    seq = Sequence(ids, SamplingParams(temperature=0), 0, 1, frozenset())
    seq.slot = engine.pool.open_slot()
    hidden = []
    with torch.no_grad():
        for n in (*PROMPT_CHUNKS, *[1] * (SEQ - PROMPT)):  # teacher-forced decode: one token per forward
            engine.pool.grow(seq.slot, seq.num_computed + n, seq.num_computed)
            engine.pool.flush()
            hidden.append(engine.runner.forward_chunks([(seq, n)])[0][-1:])
            seq.num_computed += n
        engine.pool.close_slot(seq.slot)
        got = engine.model.logits(torch.cat(hidden[len(PROMPT_CHUNKS) - 1 :]))
    err = rel_max_error(got, ref)
    print(f"decode from position {PROMPT} to {SEQ - 1}: rel. max error vs HF {err:.2e}")
    assert err < PREFILL_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_hf_generate(hf, engines, ids):
    prompt = ids[:12]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                          pad_token_id=TINY.pad_token_id)
    expected = out[0, len(prompt):].tolist()
    assert len(expected) == 64
    got = engines[3].generate(prompt, max_new_tokens=64, temperature=0, stop_token_ids=[])  # prompt in 4 chunks
    assert got.tokens == expected
    assert got.finish_reason == "length"


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(mean KL(softmax ref || softmax got), share of positions with the same top-1)."""
    lr, lg = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return float((lr.exp() * (lr - lg)).sum(-1).mean()), float((lr.argmax(-1) == lg.argmax(-1)).float().mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_engine_within_hf_yardstick(packed, hf, dtype):
    """A 16-bit engine against HF fp32, judged by HF's own run in that dtype (engineering §4).

    On this tiny model a handful of chaotic positions dominate the mean KL of both runs (their
    ratio moves between 0.7 and 1.8 from one random prompt to another), so the bound here is 3x
    HF's KL and 3 points of top-1; a wrong rounding point or scale costs far more. The E2B-shaped
    GPU test holds the engine to 2x and 2 points."""
    g = torch.Generator().manual_seed(2)
    ids = [TINY.bos_token_id] + torch.randint(3, TINY.vocab_size, (199,), generator=g).tolist()
    with torch.no_grad():
        fp32 = hf(torch.tensor([ids])).logits[0]
        low = cast(copy.deepcopy(hf), dtype)(torch.tensor([ids])).logits[0]
    engine = Engine.from_packed(packed, "cpu", dtype=dtype, max_ctx=256, prefill_chunk=64)
    kl, top1 = _agreement(fp32, engine.logits(ids))
    hf_kl, hf_top1 = _agreement(fp32, low)
    print(f"{dtype}: engine KL {kl:.2e} top-1 {top1:.3f}; transformers KL {hf_kl:.2e} top-1 {hf_top1:.3f}")
    assert kl <= 3 * hf_kl
    assert top1 >= hf_top1 - 0.03
