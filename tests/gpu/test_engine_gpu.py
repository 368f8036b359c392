"""The engine on a CUDA GPU (Triton kernels, 16-bit compute, CUDA-graph decode) at E2B shapes.

Synthetic E2B weights on the 4-bit grid are built directly on the GPU. transformers' own Gemma 4
in fp32 (on the GPU: 18.5 GB) is the reference; transformers in bf16 sets the yardstick: random
weights give nearly flat logits, so a 16-bit engine is held to KL(fp32 || engine) at most twice
HF-bf16's and top-1 agreement with fp32 no more than 2 points below HF-bf16's (engineering §4).
Run with `pytest -m gpu tests/gpu`.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine, SamplingParams
from qat4.engine.sequence import Sequence
from qat4.reference import cast, hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = 1100  # positions compared; more than two sliding windows of 512
DECODE_FROM = 300  # the decode check prefills this many tokens, then feeds the rest one at a time
KL_FACTOR, TOP1_SLACK = 2.0, 0.02


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(E2B, seed=0, device="cuda")


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return [E2B.bos_token_id] + torch.randint(3, E2B.vocab_size, (SEQ - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference(packed, ids):
    """HF logits of ids [SEQ, V] in fp32, and of the same model cast to bf16 (as fp32)."""
    hf = hf_model(packed, "cuda")
    tokens = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        fp32 = hf(tokens).logits[0]
        cast(hf, torch.bfloat16)
        bf16 = hf(tokens).logits[0].float()
    del hf
    torch.cuda.empty_cache()
    return fp32, bf16


@pytest.fixture(scope="module")
def engine(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=2048, prefill_chunk=256)


@pytest.fixture(scope="module")
def eager_engine(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=2048, prefill_chunk=256, cuda_graph=False)


def agreement(ref: torch.Tensor, got: torch.Tensor, rows: int = 128) -> tuple[float, float]:
    """(mean KL(softmax ref || softmax got), share of positions with the same top-1)."""
    kl, same = 0.0, 0
    for r0 in range(0, ref.shape[0], rows):
        lr = torch.log_softmax(ref[r0 : r0 + rows].float(), -1)
        lg = torch.log_softmax(got[r0 : r0 + rows].float(), -1)
        kl += float((lr.exp() * (lr - lg)).sum())
        same += int((lr.argmax(-1) == lg.argmax(-1)).sum())
    return kl / ref.shape[0], same / ref.shape[0]


def check_against_hf(name: str, got: torch.Tensor, fp32: torch.Tensor, bf16: torch.Tensor) -> None:
    kl, top1 = agreement(fp32, got)
    hf_kl, hf_top1 = agreement(fp32, bf16)
    print(f"\n{name}: KL vs fp32 {kl:.3e} (HF bf16 {hf_kl:.3e}), top-1 {top1:.4f} (HF bf16 {hf_top1:.4f})")
    assert kl <= KL_FACTOR * hf_kl
    assert top1 >= hf_top1 - TOP1_SLACK


def teacher_forced_logits(engine, ids, prompt, chunk=256):
    """Logits at positions prompt-1 .. len(ids)-1: the prompt read in chunks, then one token per
    forward (the decode kernels: one row of x), as a decode step runs them."""
    seq = Sequence(ids, SamplingParams(temperature=0), 0, 1, frozenset())
    seq.slot = engine.pool.open_slot()
    feeds = [min(chunk, prompt - s) for s in range(0, prompt, chunk)] + [1] * (len(ids) - prompt)
    hidden = []
    with torch.no_grad():
        for n in feeds:
            engine.pool.grow(seq.slot, seq.num_computed + n, seq.num_computed)
            engine.pool.flush()
            hidden.append(engine.runner.forward_chunks([(seq, n)])[0][-1:])
            seq.num_computed += n
        engine.pool.close_slot(seq.slot)
        return engine.model.logits(torch.cat(hidden[len(feeds) - (len(ids) - prompt) - 1 : -1]))


def test_engine_is_bf16_with_graphs(engine):
    assert engine.dtype == (torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16)
    assert engine.runner.use_graph and all((b, 1, 1, False, False) in engine.runner.graphs for b in engine.runner.sizes)  # at load


def test_prefill_logits_vs_hf(engine, ids, reference):
    fp32, bf16 = reference
    check_against_hf(f"prefill of {SEQ} tokens in chunks of 256", engine.logits(ids), fp32, bf16)


def test_decode_logits_vs_hf_past_the_window(engine, ids, reference):
    """Teacher-forced decode steps from position DECODE_FROM to SEQ-1: every sliding window moves on."""
    fp32, bf16 = reference
    got = teacher_forced_logits(engine, ids, DECODE_FROM)
    check_against_hf(f"decode steps at positions {DECODE_FROM}..{SEQ - 1}", got, fp32[DECODE_FROM - 1 : -1],
                     bf16[DECODE_FROM - 1 : -1])


@pytest.mark.parametrize("options", [
    {"temperature": 0},
    {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 1},
    {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 2},
])
def test_graph_replay_equals_eager(engine, eager_engine, ids, options):
    """A 600-token prompt, then 300 tokens: decode runs past position 512 in both."""
    prompt = ids[:600]
    graph = engine.generate(prompt, max_new_tokens=300, stop_token_ids=[], **options)
    eager = eager_engine.generate(prompt, max_new_tokens=300, stop_token_ids=[], **options)
    print(f"\n{options}: graph {graph.decode_tok_s:.0f} tok/s, eager {eager.decode_tok_s:.0f} tok/s")
    assert graph.tokens == eager.tokens
    assert len(graph.tokens) == 300


def test_greedy_graph_tokens_are_the_argmax_of_the_decode_logits(engine, ids):
    """64 greedy tokens from the graph (fused argmax) equal torch.argmax of the softcapped logits of
    the same decode steps run eagerly: the graph, the fused argmax and the pages agree exactly.
    Agreement with a prefill over the same tokens (GEMM instead of GEMV rounding) is printed."""
    prompt = ids[:520]
    tokens = engine.generate(prompt, max_new_tokens=64, temperature=0, stop_token_ids=[]).tokens
    decode_logits = teacher_forced_logits(engine, prompt + tokens, len(prompt))
    prefill_logits = engine.logits(prompt + tokens)[len(prompt) - 1 : -1]
    same = float((prefill_logits.argmax(-1).cpu() == torch.tensor(tokens)).float().mean())
    print(f"\ngreedy tokens equal to the prefill argmax at {same:.2%} of 64 positions")
    assert decode_logits.argmax(-1).cpu().tolist() == tokens


def test_memory_cap_131k_context():
    """In a fresh process: a cap too small is refused at load with a clear message; E2B with a
    131,072-token pool fits in 3,732 MiB, reads a 4,096-token prompt and decodes; with a 32,768-token
    context it serves 8 sequences of 4,096 tokens at once."""
    code = textwrap.dedent("""
        import json
        import torch
        from qat4.checkpoint.packed_model import PackedModel
        from qat4.checkpoint.synth import synthetic_model
        from qat4.config import E2B
        from qat4.engine import Engine
        from qat4.errors import Qat4Error

        made = synthetic_model(E2B, seed=0, device="cuda")
        packed = PackedModel(E2B, {n: t.to("cpu") for n, t in made.tensors.items()})
        del made
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            Engine.from_packed(packed, "cuda", memory_cap_mib=2500)
            print("REFUSED no")
        except Qat4Error as exc:
            print("REFUSED yes:", exc)
        engine = Engine.from_packed(packed, "cuda", memory_cap_mib=3732)
        g = torch.Generator().manual_seed(0)
        prompt = [2] + torch.randint(3, E2B.vocab_size, (4095,), generator=g).tolist()
        out = engine.generate(prompt, max_new_tokens=64, temperature=0, stop_token_ids=[])
        long_ctx, long_seqs = engine.max_ctx, engine.max_num_seqs
        del engine
        torch.cuda.empty_cache()
        engine = Engine.from_packed(packed, "cuda", memory_cap_mib=3732, max_ctx=32768)
        seqs = [engine.add_request([2] + torch.randint(3, E2B.vocab_size, (3999,), generator=g).tolist(), 97,
                                   temperature=0, stop_token_ids=[]) for _ in range(8)]
        most = 0
        while engine.has_work:
            engine.step()
            most = max(most, len(engine.scheduler.running))
        mib = 1 << 20
        print("STATS", json.dumps({"max_ctx": long_ctx, "new": len(out.tokens), "max_num_seqs": long_seqs,
                                   "together": most, "eight": [len(s.output) for s in seqs],
                                   "model_mib": engine.nbytes["model"] / mib, "kv_mib": engine.nbytes["kv_cache"] / mib,
                                   "peak_mib": torch.cuda.max_memory_allocated() / mib,
                                   "prefill_ms": out.prefill_ms, "decode_tok_s": out.decode_tok_s}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    print(run.stdout, run.stderr[-3000:])
    assert run.returncode == 0
    assert "REFUSED yes:" in run.stdout and "memory_cap_mib" in run.stdout
    stats = json.loads(run.stdout.split("STATS ", 1)[1])
    assert stats["max_ctx"] == 131072 and stats["new"] == 64
    assert stats["together"] == 8 and stats["eight"] == [97] * 8  # 8 streams of 4,096 tokens at once
    assert stats["peak_mib"] <= 3732


def test_decode_tuning_saves_tilings_that_the_next_load_pins(tmp_path, monkeypatch):
    """`tune_decode` on a tiny model: the step is never slower than with the autotuner's picks, the
    table is saved for this GPU, a fresh load pins it, and the engine still decodes."""
    from qat4.checkpoint.synth import write_synthetic
    from qat4.config import TINY
    from qat4.engine.tuning import load_tilings

    monkeypatch.setenv("QAT4_TILINGS", str(tmp_path / "tilings.json"))
    folder = write_synthetic(tmp_path / "ckpt", TINY, "ct-emb4", seed=1)
    engine = Engine.load(folder, "cuda", max_ctx=512)
    assert engine.pinned_tilings[0] == 0 < engine.pinned_tilings[1]  # nothing saved yet
    before, after, path = engine.tune_decode(replays=10)
    assert path == tmp_path / "tilings.json" and 0 < after <= before
    saved = load_tilings(engine.device, engine.dtype)
    assert saved and saved == {key: engine.model.tilings.launched()[key] for key in saved}
    again = Engine.load(folder, "cuda", max_ctx=512)  # its model's tilings start empty: only the file pins them
    now = again.model.tilings.launched()
    assert all(now[key] == tiling for key, tiling in saved.items())
    assert again.pinned_tilings[:2] == (len(saved), len(now)) and tmp_path / "tilings.json" in again.pinned_tilings[2]
    assert len(again.generate([2, 5, 6], max_new_tokens=8, temperature=0, stop_token_ids=[]).tokens) == 8
