"""The engine's public API on the CPU: prompts, greedy and seeded sampling, stop ids and strings,
streaming and cancellation, the context check, device-side sampling, and `qat4 generate`.

The model is the tiny synthetic checkpoint written to disk in the ct-emb4 format, so loading,
the tokenizer (the real Gemma 4 vocabulary) and generation_config all come from the folder.
"""

import bisect
import itertools
import re

import pytest
import torch

from qat4.checkpoint.synth import write_synthetic
from qat4.cli import main
from qat4.config import TINY
from qat4.engine import Engine
from qat4.errors import Qat4Error
from qat4.model import dtype_round
from qat4.sampling import SamplingParams, sample

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("tiny") / "ckpt", TINY, "ct-emb4", seed=3)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.load(checkpoint, max_ctx=128)


@pytest.fixture(scope="module")
def greedy(engine):
    """Eight greedy tokens of PROMPT with no stop ids."""
    return engine.generate(PROMPT, max_new_tokens=8, temperature=0, stop_token_ids=[])


def test_load_reads_folder(engine):
    assert engine.tokenizer is not None
    assert engine.max_ctx == 128 and engine.dtype == torch.float32
    assert engine.model.output is engine.model.embed_tokens  # the emb4 lm_head copy is loaded once
    params = engine.sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 64, 0.95)  # generation_config.json
    assert engine.nbytes["kv_cache"] == engine.cache.nbytes > 0


def test_default_context_is_the_models(checkpoint):
    assert Engine.load(checkpoint).max_ctx == TINY.max_position_embeddings  # min(131072, 4096)


def test_text_prompt_has_one_bos(engine):
    bos = TINY.bos_token_id
    ids = engine.encode(PROMPT)
    assert ids[0] == bos and ids.count(bos) == 1
    assert engine.encode("<bos>" + PROMPT) == ids
    assert engine.encode([5, 6, 7]) == [5, 6, 7]  # ids pass through untouched
    with pytest.raises(Qat4Error, match="outside the vocabulary"):
        engine.encode([TINY.vocab_size])


def test_generate_text_and_ids(engine, greedy):
    assert len(greedy.tokens) == 8 and greedy.finish_reason == "length"
    assert greedy.prompt_tokens == len(engine.encode(PROMPT))
    assert greedy.text == engine.tokenizer.decode(greedy.tokens)
    assert greedy.decode_steps == 7 and greedy.prefill_ms > 0 and greedy.decode_ms > 0 and greedy.decode_tok_s > 0
    by_ids = engine.generate(engine.encode(PROMPT), max_new_tokens=8, temperature=0, stop_token_ids=[])
    assert by_ids.tokens == greedy.tokens


def test_greedy_is_argmax_of_logits(engine, greedy):
    prompt = engine.encode(PROMPT)
    logits = engine.logits(prompt + greedy.tokens[:3])
    assert logits.shape == (len(prompt) + 3, TINY.vocab_size) and logits.dtype == torch.float32
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == greedy.tokens[:4]
    assert float(logits.abs().max()) <= 30.0  # softcap


def test_stop_token_ids(engine, greedy):
    stop = greedy.tokens[3]
    first = greedy.tokens.index(stop)
    got = engine.generate(PROMPT, max_new_tokens=8, temperature=0, stop_token_ids=[stop])
    assert got.tokens == greedy.tokens[:first] and got.finish_reason == "stop"


def test_stop_strings(engine, greedy):
    k = next(i for i in range(2, 8) if engine.tokenizer.decode(greedy.tokens[i : i + 1]).strip())
    stop = engine.tokenizer.decode(greedy.tokens[k : k + 1]).strip()
    got = engine.generate(PROMPT, max_new_tokens=8, temperature=0, stop_token_ids=[], stop=[stop])
    assert got.finish_reason == "stop"
    assert got.text == greedy.text[: greedy.text.find(stop)]
    assert got.tokens == greedy.tokens[: len(got.tokens)] and len(got.tokens) <= k + 1


def test_seeded_sampling_is_reproducible(engine):
    def run(seed, **options):
        return engine.generate(PROMPT, max_new_tokens=4, seed=seed, stop_token_ids=[], **options).tokens

    first = run(1, temperature=1.0, top_k=64)
    assert run(1, temperature=1.0, top_k=64) == first
    assert run(2, temperature=1.0, top_k=64) != first
    assert run(5, temperature=0.7, top_k=0, top_p=0.9) == run(5, temperature=0.7, top_k=0, top_p=0.9)


def test_context_overflow_is_refused_up_front(engine):
    prompt = list(range(10, 20))
    with pytest.raises(Qat4Error, match=r"10 tokens.*max_new_tokens 119.*128"):
        engine.generate(prompt, max_new_tokens=119)
    with pytest.raises(Qat4Error, match="119"):
        engine.stream(prompt, max_new_tokens=119)  # raised when called, before any token
    with pytest.raises(Qat4Error, match="at least 1"):
        engine.generate(prompt, max_new_tokens=0)


def test_stream_yields_ids_and_cancels(engine, greedy):
    assert list(engine.stream(PROMPT, max_new_tokens=4, temperature=0, stop_token_ids=[])) == greedy.tokens[:4]
    stop = greedy.tokens[2]
    streamed = list(engine.stream(PROMPT, max_new_tokens=8, temperature=0, stop_token_ids=[stop]))
    assert streamed == greedy.tokens[: greedy.tokens.index(stop) + 1]  # the stop id is yielded, then the end
    calls = []
    cancelled = list(engine.stream(PROMPT, max_new_tokens=8, temperature=0, stop_token_ids=[],
                                   should_stop=lambda: calls.append(1) or len(calls) >= 2))
    assert cancelled == greedy.tokens[:2]


def test_bad_sampling_options(engine):
    for kwargs, field in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")):
        with pytest.raises(Qat4Error, match=field):
            engine.generate(PROMPT, max_new_tokens=2, **kwargs)


def test_embedding_scale_rounding():
    assert dtype_round(1536**0.5, torch.bfloat16) == 39.25
    assert dtype_round(1536**0.5, torch.float16) == 39.1875
    assert dtype_round(256**0.5, torch.bfloat16) == 16.0


# ---- sampling on the device ------------------------------------------------------------------


def _sample(logits, u, temperature=1.0, top_p=1.0, top_k=None):
    f = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    return int(sample(torch.tensor(logits, dtype=torch.float32), f(u), f(temperature), f(top_p), top_k))


def test_sample_inverts_the_cdf():
    logits = [0.0, 2.0**0.5, 1.0]  # probabilities ~ 1 : e^1.41 : e
    probs = torch.softmax(torch.tensor(logits), 0).tolist()  # token 1, then 2, then 0
    assert _sample(logits, 0.0) == 1
    assert _sample(logits, probs[1] - 1e-4) == 1
    assert _sample(logits, probs[1] + 1e-4) == 2
    assert _sample(logits, 0.9999) == 0


def test_sample_top_k_and_top_p():
    logits = [0.0, 3.0, 2.9, 1.0]
    assert _sample(logits, 0.9999, top_k=1) == 1
    assert _sample(logits, 0.9999, top_k=2) == 2
    assert _sample(logits, 0.9999, top_p=0.01) == 1  # the most likely token always stays
    assert _sample(logits, 0.9999, top_p=0.6) == 2  # tokens 1 and 2 hold ~0.9
    assert _sample(logits, 0.9999, temperature=0.01) == 1


def test_sample_draws_by_integer_weights_over_a_flat_vocabulary():
    """262,144 nearly equal probabilities (a nucleus where float prefix sums drift with their
    order): the draw is the token whose interval of the integer weights' prefix sums holds
    uniform * total, at uniforms next to the intervals' edges too."""
    logits = torch.randn(262_144, generator=torch.Generator().manual_seed(3)) * 0.05
    order = torch.sort(logits, descending=True).indices
    cdf = list(itertools.accumulate(int(w) for w in (torch.softmax(logits[order], 0) * float(1 << 40)).long()))
    for edge in (cdf[0], cdf[1], cdf[77_777], cdf[-2]):
        for u in torch.tensor([edge / cdf[-1]], dtype=torch.float64).float().nextafter(torch.tensor([[0.0], [1.0]])):
            expected = bisect.bisect_right(cdf, int(u.double() * cdf[-1]))
            assert _sample(logits.tolist(), float(u)) == int(order[expected])


def test_sampling_params():
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(top_k=0).effective_top_k(100) is None
    assert SamplingParams(top_k=100).effective_top_k(100) is None
    assert SamplingParams(top_k=64).effective_top_k(100) == 64


# ---- command line ----------------------------------------------------------------------------


def test_cli_generate(checkpoint, engine, capsys):
    expected = engine.generate(PROMPT, max_new_tokens=3, temperature=0).text
    assert main(["generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-new", "3",
                 "--temperature", "0", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    assert "prompt tokens" in err and "tok/s" in err
    assert re.search(r"^qat4 generate: reading tensor (\d+)/\1 \(", err, re.M)  # the load shows its progress
    assert main(["generate", "--model", str(checkpoint), "--prompt", PROMPT, "--chat", "--max-new", "2",
                 "--temperature", "0"]) == 0
    assert main(["generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-new", "5000"]) == 1
    assert "5000" in capsys.readouterr().err


def test_auto_prefill_chunk_is_the_largest_that_fits(monkeypatch):
    """4096 with room to spare; smaller chunks as memory tightens; 256 when even that is tight
    (a 4 GB card holding E2B and a 131,072-token cache); 256 on the CPU."""
    from qat4 import engine as engine_module
    from qat4.checkpoint.synth import synthetic_model

    packed = synthetic_model(TINY, seed=0)
    model_and_cache = 100 * engine_module.MIB
    monkeypatch.setattr(engine_module, "_estimate_model_nbytes", lambda *a: model_and_cache - 10 * engine_module.MIB)
    monkeypatch.setattr(engine_module.KVCache, "estimate_nbytes", staticmethod(lambda *a: 10 * engine_module.MIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    cuda = torch.device("cuda", 0)
    reserve, per_token = engine_module.TUNING_RESERVE, engine_module.PREFILL_BYTES_PER_TOKEN
    pick = engine_module._auto_prefill_chunk
    for free, expected in ((10**11, 4096), (model_and_cache + reserve + 1024 * per_token, 1024),
                           (model_and_cache + reserve + 300 * per_token, 256), (model_and_cache, 256)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 2 * free))
        assert pick(packed, 8192, torch.bfloat16, cuda, None) == expected
        assert pick(packed, 8192, torch.bfloat16, cuda, free) == expected  # a cap counts the same way
    assert pick(packed, 1000, torch.bfloat16, cuda, 10**11) == 512  # never past the context
    assert pick(packed, 8192, torch.float32, torch.device("cpu"), None) == 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_steps_keep_their_stored_dtype(dtype):
    """fp16 steps stay fp16 under bf16 compute (converting them would move every weight off its
    trained value); bf16 steps become fp16 only where compute is fp16."""
    from qat4.checkpoint.synth import synthetic_model

    packed = synthetic_model(TINY, seed=0)
    for name, t in packed.tensors.items():
        if name.endswith("q_proj") or name == "embed_tokens":
            t.scales = t.scales.to(torch.float16 if name == "embed_tokens" else torch.bfloat16)
    model = Engine.from_packed(packed, "cpu", dtype=dtype, max_ctx=64).model
    assert model.embed_tokens.scales.dtype == torch.float16
    assert model.layers[0].qkv.scales.dtype == (torch.float16 if dtype == torch.float16 else torch.bfloat16)
    assert torch.equal(model.embed_tokens.scales, packed["embed_tokens"].scales)
