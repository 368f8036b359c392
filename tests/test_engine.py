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
from qat4.config import E2B, TINY
from qat4.engine import Engine
from qat4.engine.engine import CheckedIds
from qat4.errors import Qat4Error
from qat4.engine.sampler import SamplingParams, keep_shape, sample
from qat4.model import dtype_round

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
    assert engine.nbytes["kv_cache"] == engine.pool.nbytes > 0


def test_the_block_tables_share_one_tensor_at_aligned_starts_and_take_their_entries_in_one_flush():
    from qat4.config import FULL, SLIDING
    from qat4.engine.kv_cache import TABLE_ALIGN, KVPool, pool_nbytes

    blocks = {FULL: 16, SLIDING: 16}
    pool = KVPool(TINY, blocks, block_size=4, max_seqs=3, max_ctx=30, device=torch.device("cpu"), dtype=torch.float32)
    assert pool.nbytes == pool_nbytes(TINY, blocks, 4, 3, 30, torch.float32)
    starts = [t.storage_offset() for t in pool.tables.values()]
    assert starts[0] == 0 and all(start % TABLE_ALIGN == 0 for start in starts) and starts[1] >= 4 * 8
    a, b = pool.open_slot(), pool.open_slot()
    pool.grow(a, 12, 0)
    pool.grow(b, 30, 0)  # to the table's last entry
    pool.flush()
    for kind in blocks:
        for slot, n in ((a, 3), (b, 8)):
            assert pool.tables[kind][slot, :n].tolist() == pool._held[slot][kind] and all(pool._held[slot][kind])
        assert pool.tables[kind][[2, 3]].count_nonzero() == 0  # the free slot and the scratch row


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


def test_checked_ids_are_taken_without_a_second_check(engine):
    """encode's lists carry the vocabulary they were checked against: encoding one again (what
    add_request does with the server's) copies it without a pass over its ids, and one checked
    against a larger vocabulary is checked again."""
    ids = engine.encode("<bos><bos>" + PROMPT)
    assert isinstance(ids, CheckedIds) and ids.vocab_size == TINY.vocab_size and ids.count(TINY.bos_token_id) == 1
    again = engine.encode(ids)
    assert again == ids and again is not ids  # a new list: a sequence's tokens never alias its caller's
    with pytest.raises(Qat4Error, match=f"token id {TINY.vocab_size} is outside"):
        engine.encode(CheckedIds([5, TINY.vocab_size], TINY.vocab_size + 1))
    # what encode made is trusted as it is: an id out of range put in by hand passes (encode makes none)
    assert engine.encode(CheckedIds([TINY.vocab_size], TINY.vocab_size)) == [TINY.vocab_size]
    with pytest.raises(Qat4Error, match="outside the vocabulary"):  # a copy made another way is checked
        engine.encode(CheckedIds([TINY.vocab_size]))
    with pytest.raises(Qat4Error, match="empty"):
        engine.encode(CheckedIds([], TINY.vocab_size))


def test_text_is_checked_only_when_its_tokenizer_outgrows_the_model(engine, monkeypatch):
    """A tokenizer's ids lie below its id limit (its largest id + 1): within the model's vocabulary,
    a text prompt's ids need no pass over them; a tokenizer whose ids reach past it (a larger
    vocabulary, or one with gaps) has them checked."""
    tokenizer = engine.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda text: [TINY.bos_token_id, 5, TINY.vocab_size - 1])
    assert engine.encode(PROMPT) == [TINY.bos_token_id, 5, TINY.vocab_size - 1]
    monkeypatch.setattr(tokenizer, "encode", lambda text: [TINY.bos_token_id, 5, TINY.vocab_size])
    monkeypatch.setattr(tokenizer, "id_limit", TINY.vocab_size + 1)
    with pytest.raises(Qat4Error, match=f"token id {TINY.vocab_size} is outside"):
        engine.encode(PROMPT)


def test_generate_text_and_ids(engine, greedy):
    assert len(greedy.tokens) == 8 and greedy.finish_reason == "length"
    assert greedy.prompt_tokens == len(engine.encode(PROMPT))
    assert greedy.text == engine.tokenizer.decode(greedy.tokens)
    assert greedy.decode_steps == 7 and greedy.prefill_ms > 0 and greedy.decode_ms > 0 and greedy.decode_tok_s > 0
    assert engine.generate(PROMPT, max_new_tokens=2, temperature=0, stop_token_ids=[]).decode_tok_s is None
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
    logits = torch.tensor([logits], dtype=torch.float32)
    v = logits.shape[-1]
    f = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    k = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).effective_top_k(v)
    keep = keep_shape([k], v) if k > 1 else v
    return int(sample(logits, f(temperature), torch.tensor([k]), f(top_p), torch.tensor([u], dtype=torch.float64), keep))


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
    assert SamplingParams(top_k=0).effective_top_k(100) == 100
    assert SamplingParams(top_k=100).effective_top_k(100) == 100
    assert SamplingParams(top_k=64).effective_top_k(100) == 64
    assert SamplingParams(temperature=0, top_k=64).effective_top_k(100) == 1
    assert keep_shape([1, 1], 1000) == 1 and keep_shape([1, 64], 1000) == 64 and keep_shape([65], 1000) == 128
    assert keep_shape([3], 1000) == 64 and keep_shape([600], 1000) == 1000


def test_rows_sample_with_their_own_parameters():
    """One batch, four rows: greedy, top-k, top-p and plain temperature each get what they would
    alone, whatever the other rows ask for."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=g) * 3
    temperature = torch.tensor([0.0, 0.7, 1.3, 1.0])
    top_k = torch.tensor([1, 8, 500, 500])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0])
    u = torch.tensor([0.3, 0.9, 0.6, 0.99], dtype=torch.float64)
    batch = sample(logits, temperature, top_k, top_p, u, 500)
    for r in range(4):
        alone = sample(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1], u[r : r + 1], 500)
        assert int(batch[r]) == int(alone[0])
    assert int(batch[0]) == int(logits[0].argmax())
    assert int(batch[1]) in logits[1].topk(8).indices.tolist()


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


def test_plan_takes_the_largest_chunk_and_the_most_sequences_that_fit(monkeypatch):
    """4096-token chunks and 64 sequences with room to spare; fewer sequences, then smaller chunks
    as memory tightens; without room for the working memory, as many sequences as fit at all; a
    clear error when the pool and decode rows do not fit; 256 on the CPU."""
    from qat4.checkpoint.synth import synthetic_model
    from qat4.engine import memory
    from qat4.engine.config import EngineConfig

    packed = synthetic_model(TINY, seed=0)
    mib = memory.MIB
    monkeypatch.setattr(memory, "model_nbytes", lambda *a: 100 * mib)
    monkeypatch.setattr(memory, "pool_nbytes", lambda cfg, blocks, bs, seqs, ctx, dtype: 10 * mib + seqs * mib)
    monkeypatch.setattr(memory, "decode_nbytes", lambda packed, seqs, spec_tokens=0: 0)
    monkeypatch.setattr(memory, "chunk_graph_nbytes", lambda prefill_chunk: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    reserve, per_token = 120 * mib, memory.PREFILL_BYTES_PER_TOKEN
    monkeypatch.setattr(memory, "tuning_reserve", lambda device: reserve)
    monkeypatch.setattr(memory, "expansion_nbytes", lambda cfg, dtype, device, streams=1: 75 * mib)
    base = 110 * mib + reserve
    for free, seqs, chunk in ((10**11, 64, 4096), (base + 64 * mib + 1024 * per_token, 64, 1024),
                              (base + 64 * mib + 300 * per_token, 64, 256), (base + 20 * mib + 256 * per_token, 20, 256)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 2 * free))
        got = memory.plan(packed, cuda, EngineConfig(max_ctx=8192))
        assert (got.max_num_seqs, got.prefill_chunk) == (seqs, chunk)
        # the 16-bit copies, else the expansion scratch, take only what is left over
        assert (got.dense, got.expand) == ((True, False) if free == 10**11 else (False, False))
        packed_only = memory.plan(packed, cuda, EngineConfig(max_ctx=8192, dense_weights=False))
        assert (packed_only.dense, packed_only.expand) == (False, free == 10**11)
    asked = memory.plan(packed, cuda, EngineConfig(max_ctx=8192, max_num_seqs=30))  # fits without the working memory
    assert (asked.max_num_seqs, asked.prefill_chunk) == (30, 256)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (115 * mib, 230 * mib))
    assert memory.plan(packed, cuda, EngineConfig(max_ctx=8192)).max_num_seqs == 5  # as many as fit at all
    with pytest.raises(Qat4Error, match="max_num_seqs"):
        memory.plan(packed, cuda, EngineConfig(max_ctx=8192, max_num_seqs=6))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (110 * mib, 220 * mib))
    with pytest.raises(Qat4Error, match="do not fit"):
        memory.plan(packed, cuda, EngineConfig(max_ctx=8192))
    assert memory.plan(packed, torch.device("cpu"), EngineConfig(max_ctx=1000)).prefill_chunk == 256
    assert memory.plan(packed, torch.device("cpu"), EngineConfig(max_ctx=100)).prefill_chunk == 100



def test_plan_claims_dense_weights_with_the_model(monkeypatch):
    """dense_weights=True claims the copies and cuBLAS's workspaces beside the model, before the pool
    and the working memory, and keeps no expansion scratch with them; a load they do not fit
    beside, or a device without 16-bit tensor-core products (the CPU), stops with a sentence
    naming dense_weights. By default (None) the copies are kept only where they fit in what is
    left over with a scratch's margin, else the scratch; False keeps the scratch; the CPU has neither."""
    from qat4.checkpoint.synth import synthetic_model
    from qat4.engine import memory
    from qat4.engine.config import EngineConfig

    packed = synthetic_model(TINY, seed=0)
    mib = memory.MIB
    monkeypatch.setattr(memory, "model_nbytes", lambda *a: 100 * mib)
    monkeypatch.setattr(memory, "pool_nbytes", lambda cfg, blocks, bs, seqs, ctx, dtype: 10 * mib)
    monkeypatch.setattr(memory, "decode_nbytes", lambda packed, seqs, spec_tokens=0: 0)
    monkeypatch.setattr(memory, "chunk_graph_nbytes", lambda prefill_chunk: 0)
    monkeypatch.setattr(memory, "tuning_reserve", lambda device: 0)
    monkeypatch.setattr(memory, "expansion_nbytes", lambda cfg, dtype, device, streams=1: 75 * mib)
    monkeypatch.setattr(memory, "expands_products", lambda dtype, device: True)
    monkeypatch.setattr(memory, "dense_nbytes", lambda cfg, dtype: 500 * mib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    config = EngineConfig(max_ctx=256, max_num_seqs=4, prefill_chunk=256, prompt_cache_mib=0, dense_weights=False)
    dense = EngineConfig.of(config, dense_weights=True)
    auto = EngineConfig.of(config, dense_weights=None)
    needed = 110 * mib + 256 * memory.PREFILL_BYTES_PER_TOKEN  # model, pool, working memory
    workspaces = 3 * memory.CUBLAS_WORKSPACE_NBYTES  # the engine's stream, warm-up and capture
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**11, 2 * 10**11))
    plain, kept = memory.plan(packed, cuda, config), memory.plan(packed, cuda, dense)
    assert (plain.dense, plain.expand) == (False, True) and (kept.dense, kept.expand) == (True, False)
    assert memory.plan(packed, cuda, auto).dense
    room = needed + 500 * mib + workspaces + 75 * mib  # the copies with a scratch's margin
    for free, dense_kept in ((room, True), (room - 1, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 10**11))
        chosen = memory.plan(packed, cuda, auto)
        assert (chosen.dense, chosen.expand) == (dense_kept, not dense_kept), free
    # sizes the plan picks itself: the copies come after the sequences, the chunk and the prompt cache
    from qat4.config import SLIDING

    defaults = EngineConfig(max_ctx=256)
    sliding = memory.block_nbytes(packed.config, SLIDING, defaults.block_size, torch.bfloat16)
    cache = memory.DEFAULT_PROMPT_CACHE_MIB * mib // sliding * sliding  # whole blocks of the prompt cache
    room = needed + cache + 500 * mib + workspaces + 75 * mib
    plans = []
    for free in (room, room - 1):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 10**11))
        plans.append(memory.plan(packed, cuda, defaults))
    assert [(p.dense, p.expand) for p in plans] == [(True, False), (False, True)]
    assert plans[0].max_num_seqs == plans[1].max_num_seqs == memory.DEFAULT_MAX_NUM_SEQS["cuda"]
    assert plans[0].prefill_chunk == plans[1].prefill_chunk == 256 and plans[0].blocks == plans[1].blocks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (needed + 500 * mib + workspaces, 10**11))
    assert memory.plan(packed, cuda, dense).dense
    short = 110 * mib + 500 * mib + workspaces - 1  # the model and the pool fit, but not beside the copies
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (short, 10**11))
    assert memory.plan(packed, cuda, config).max_num_seqs == 4
    with pytest.raises(Qat4Error, match=r"do not fit in GPU memory beside 16-bit copies .*500 MiB, dense_weights"):
        memory.plan(packed, cuda, dense)
    monkeypatch.undo()
    with pytest.raises(Qat4Error, match="dense_weights needs 16-bit tensor-core products"):
        memory.plan(packed, torch.device("cpu"), EngineConfig(max_ctx=64, dense_weights=True))
    assert not memory.plan(packed, torch.device("cpu"), EngineConfig(max_ctx=64)).dense


def test_dense_nbytes_counts_every_matrix_the_products_multiply_by():
    """The plan's figure for dense_weights is the 16-bit size of exactly the matrices the model
    keeps copies of: each layer's q/k/v, o_proj, gate/up, down and per-layer pair, and the
    per-layer projection (KV-sharing layers without k/v rows, double-wide MLPs)."""
    from qat4.checkpoint.synth import synthetic_model
    from qat4.model import Gemma4, dense_nbytes

    model = Gemma4(synthetic_model(TINY, seed=0), "cpu", torch.float32, 64)
    matrices = [model.ple_projection] + [getattr(layer, name) for layer in model.layers
                                         for name in ("qkv", "o_proj", "gate_up", "down", "ple_gate", "ple_proj")]
    assert dense_nbytes(TINY, torch.bfloat16) == 2 * sum(w.rows * w.cols for w in matrices)
    assert dense_nbytes(TINY, torch.float32) == 4 * sum(w.rows * w.cols for w in matrices)
    assert not model.dense  # not asked for, and no 16-bit products on the CPU
    assert dense_nbytes(E2B, torch.bfloat16) == 3_753_639_936  # 3.75 GB


def test_a_model_with_dense_weights_hands_each_product_its_own_copy(monkeypatch):
    """With ``dense``, Gemma4 keeps one copy per matrix its products multiply by (those dense_nbytes
    counts), and every product of a generation gets its own matrix's copy."""
    import qat4.model as model_module
    from qat4.checkpoint.synth import synthetic_model
    from qat4.ops.w4.embedding import w4_expand_rows_reference

    def expand(packed, scales, dtype):
        return w4_expand_rows_reference(packed, scales, torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=dtype))

    def matrices(model):
        return [model.ple_projection] + [getattr(layer, name) for layer in model.layers
                                         for name in ("qkv", "o_proj", "gate_up", "down", "ple_gate", "ple_proj")]

    monkeypatch.setattr(model_module, "expands_products", lambda dtype, device: True)
    monkeypatch.setattr(model_module, "expand_matrix", expand)
    engine = Engine.from_packed(synthetic_model(TINY, seed=0), "cpu", max_ctx=64)
    model = model_module.Gemma4(synthetic_model(TINY, seed=0), "cpu", torch.float32, 64, dense=True)
    assert set(model.dense) == {id(w) for w in matrices(model)}
    assert sum(c.numel() * 2 for c in model.dense.values()) == model_module.dense_nbytes(TINY, torch.bfloat16)
    engine.model.dense = {id(w): expand(w.packed, w.scales, torch.float32) for w in matrices(engine.model)}
    copies = {w.packed.data_ptr(): engine.model.dense[id(w)] for w in matrices(engine.model)}
    handed = []
    for name in ("w4_linear", "w4_linear_gelu", "w4_linear_residual"):
        def spy(x, packed, scales, *args, real=getattr(model_module, name), dense=None, **kw):
            handed.append(dense is copies.get(packed.data_ptr(), False))
            return real(x, packed, scales, *args, **kw)

        monkeypatch.setattr(model_module, name, spy)
    engine.generate([2, 5, 7, 9], max_new_tokens=2, temperature=0)
    assert len(handed) >= 7 * TINY.num_hidden_layers and all(handed)


def test_a_build_out_of_memory_is_tried_again_with_half_as_many_sequences(monkeypatch):
    """The plan's estimate of the working memory can fall short: without an explicit max_num_seqs
    the build halves the sequences until it fits; with one, it says what did not fit."""
    from qat4.checkpoint.synth import synthetic_model
    from qat4.engine import build

    real, tried = build._build, []

    def short_of_memory(engine_class, packed, device, resolved, *args):
        tried.append(resolved.max_num_seqs)
        if resolved.max_num_seqs > 2:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return real(engine_class, packed, device, resolved, *args)

    monkeypatch.setattr(build, "_build", short_of_memory)
    packed = synthetic_model(TINY, seed=0)
    assert Engine.from_packed(packed, "cpu", max_ctx=64).max_num_seqs == 2 and tried == [8, 4, 2]
    with pytest.raises(Qat4Error, match="do not fit in GPU memory"):
        Engine.from_packed(packed, "cpu", max_ctx=64, max_num_seqs=4)

def test_a_build_out_of_memory_gives_up_the_weight_copies_it_chose_before_any_sequence(monkeypatch):
    """Copies the plan kept from the memory left over (dense_weights None) are the first thing an
    out-of-memory build gives up, with max_num_seqs explicit or not; copies asked for are not."""
    import dataclasses

    from qat4.checkpoint.synth import synthetic_model
    from qat4.engine import build

    real_plan, real_build, tried = build.plan, build._build, []
    # as on a GPU with memory to spare: the plan keeps the copies unless told not to
    monkeypatch.setattr(build, "plan", lambda packed, device, config, assistant=None: dataclasses.replace(
        real_plan(packed, device, dataclasses.replace(config, dense_weights=False), assistant),
        dense=config.dense_weights is not False))

    def short_of_memory(engine_class, packed, device, resolved, *args):
        tried.append((resolved.max_num_seqs, resolved.dense))
        if resolved.dense:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return real_build(engine_class, packed, device, resolved, *args)

    monkeypatch.setattr(build, "_build", short_of_memory)
    packed = synthetic_model(TINY, seed=0)
    assert Engine.from_packed(packed, "cpu", max_ctx=64).max_num_seqs == 8 and tried == [(8, True), (8, False)]
    tried.clear()
    assert Engine.from_packed(packed, "cpu", max_ctx=64, max_num_seqs=4).max_num_seqs == 4
    assert tried == [(4, True), (4, False)]
    with pytest.raises(Qat4Error, match=r"do not fit in GPU memory beside 16-bit copies .*dense_weights"):
        Engine.from_packed(packed, "cpu", max_ctx=64, max_num_seqs=4, dense_weights=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_steps_take_the_compute_dtype_where_it_holds_them_exactly(dtype):
    """fp16 steps become bf16 under bf16 compute where bf16 holds every one of them (the batch
    kernel then unpacks in pairs), and stay fp16 where one needs more than bf16's 8 significant
    bits (converting would move weights off their trained values); bf16 steps become fp16 where
    compute is fp16. No step changes its value."""
    from qat4.checkpoint.synth import synthetic_model

    packed = synthetic_model(TINY, seed=0)  # fp16 steps of 4 significant bits
    packed["layers.0.self_attn.q_proj"].scales = packed["layers.0.self_attn.q_proj"].scales.to(torch.bfloat16)
    packed["per_layer_model_projection"].scales[0, 0] = 1 + 2**-10  # fp16 holds it, bf16 does not
    model = Engine.from_packed(packed, "cpu", dtype=dtype, max_ctx=64).model
    assert model.embed_tokens.scales.dtype == dtype
    assert model.ple_projection.scales.dtype == torch.float16
    assert model.layers[0].qkv.scales.dtype == dtype
    for ours, theirs in ((model.embed_tokens, packed["embed_tokens"]),
                         (model.ple_projection, packed["per_layer_model_projection"])):
        assert torch.equal(ours.scales.float(), theirs.scales.float())
