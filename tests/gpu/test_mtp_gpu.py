"""Gemma 4's MTP drafter on a CUDA GPU at E2B shapes (synthetic target and drafter): its bf16 draft
step against transformers' ``Gemma4AssistantForCausalLM`` in fp32 on the same K/V and hidden state
(the KL divergence over transformers' candidate ids is printed), its captured graphs against eager
drafts, and greedy decoding with its drafts against plain decoding, alone and in a batch. Run with
`pytest -m gpu tests/gpu`."""

import pytest
import torch
from engine_runs import run
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from qat4.checkpoint.assistant import write_synthetic_assistant
from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine
from qat4.engine.sampler import SamplingParams
from qat4.engine.sequence import Sequence
from qat4.ops.attention import PagedSeqs, pool_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return write_synthetic_assistant(tmp_path_factory.mktemp("mtp") / "e2b", E2B, seed=1)


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(E2B, seed=0, device="cuda")


@pytest.fixture(scope="module")
def spec(packed, drafter_dir):
    return Engine.from_packed(packed, "cuda", max_ctx=2048, max_num_seqs=16, speculative=f"mtp:{drafter_dir}",
                              spec_tokens=4)


@pytest.fixture(scope="module")
def plain(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=2048, max_num_seqs=16)


def prompts(n, seed, length=60):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, E2B.vocab_size, (length + 9 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("n", [100, 700])  # inside the sliding window, and past it (513 keys read)
def test_the_bf16_draft_step_agrees_with_transformers_fp32_on_the_same_inputs(spec, drafter_dir, n):
    hf = Gemma4AssistantForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).cuda().eval()
    hf.config.get_text_config()._attn_implementation = "eager"
    engine, drafter = spec, spec.assistant
    ids = prompts(1, n, n - 1)[0]
    seq = Sequence(ids, SamplingParams(temperature=0), 0, 1, frozenset())
    seq.slot = engine.pool.open_slot()
    try:
        engine.pool.grow(seq.slot, n, 0)
        engine.pool.flush()
        with torch.no_grad():
            hidden, _, _ = engine.runner.forward_chunks([(seq, n)])
            token = engine.model.argmax(hidden[-1:])
            kv = {}
            for kind, layer in E2B.first_shared_types().items():
                rows = pool_rows(engine.pool.tables[kind], engine.pool.block_size, torch.full((n,), seq.slot, device="cuda"),
                                 torch.arange(n, device="cuda"))
                kv[kind] = (engine.pool.k[layer][rows].float()[None, None], engine.pool.v[layer][rows].float()[None, None])
            e = engine.model.embed_input(token).float()
            want = hf(inputs_embeds=torch.cat([e, hidden[-1:].float()], -1)[None], position_ids=torch.tensor([[n]], device="cuda"),
                      attention_mask=torch.ones(1, n + 1, dtype=torch.long, device="cuda"), shared_kv_states=kv, use_cache=False)
            seqs = PagedSeqs(torch.tensor([n - 1], device="cuda"), torch.arange(2, device="cuda"),
                             torch.tensor([seq.slot], device="cuda"), 1, engine.max_ctx)
            y = drafter.step(token, hidden[-1:], torch.tensor([n], device="cuda"), engine.pool, seqs)
            ours_ids, _ = drafter.candidates(y)
        ref = want.logits[0, 0]
        hf_ids = torch.nonzero(ref > ref.min()).flatten()
        ours = (drafter.output[hf_ids].float() @ y[0].float())  # qat4's state scored on transformers' candidates
        kl = float(torch.nn.functional.kl_div(torch.log_softmax(ours, -1), torch.log_softmax(ref[hf_ids], -1),
                                              log_target=True, reduction="sum"))
        overlap = len(set(ours_ids[0].tolist()) & set(hf_ids.tolist())) / len(hf_ids)
        projected = torch.nn.functional.linear(y, drafter.post_projection)[0].float()
        rel = float((projected - want.last_hidden_state[0, 0]).norm() / want.last_hidden_state[0, 0].norm())
        print(f"\nMTP draft step at position {n}: KL {kl:.2e} over transformers' {len(hf_ids)} candidates, "
              f"{overlap:.3f} of them also qat4's, projected state rel. error {rel:.2e}, same draft "
              f"{int(drafter.next_token(y)) == int(ref.argmax())}")
        assert kl < 1e-2 and overlap >= 0.9 and rel < 3e-2
    finally:
        engine.pool.close_slot(seq.slot)


def test_captured_draft_graphs_draft_what_eager_drafting_does(spec):
    drafter = spec.speculator.drafter
    seqs = []
    try:
        for ids in prompts(4, seed=4):  # four prompts read (a captured size), each with its newest token and hidden state
            seq = Sequence(ids, SamplingParams(temperature=0), 0, 8, frozenset())
            seq.slot = spec.pool.open_slot()
            seqs.append(seq)
            spec.pool.grow(seq.slot, len(ids), 0)
            spec.pool.flush()
            with torch.no_grad():
                hidden, _, _ = spec.runner.forward_chunks([(seq, len(ids) - 1)])
            spec.runner.last_hidden[seq.slot] = hidden[-1]
            seq.num_computed = len(ids) - 1
        graphed = drafter.propose_all(seqs, 4)
        drafter.runner.use_graph = False
        try:
            eager = drafter.propose_all(seqs, 4)
        finally:
            drafter.runner.use_graph = True
    finally:
        for seq in seqs:
            spec.pool.close_slot(seq.slot)
    assert graphed == eager and all(len(d) == 4 for d in graphed)
    assert all((b, k) in drafter.graphs for b in spec.spec_sizes for k in range(1, 5))
    print("\nMTP drafts, µs per k = 1..4 drafts, 1 sequence: " + ", ".join(f"{drafter.cost(1, k) * 1e6:.0f}" for k in range(1, 5))
          + "; 16 sequences: " + ", ".join(f"{drafter.cost(16, k) * 1e6:.0f}" for k in range(1, 5)))


def test_greedy_output_with_mtp_drafts_agrees_with_plain_alone_and_in_a_batch(plain, spec):
    spec.speculator.adaptive = False  # draft every step: random weights would turn it off
    try:
        batch = prompts(8, seed=1)
        expected = [run(plain, [p], 48, temperature=0)[0] for p in batch]
        alone = [run(spec, [p], 48, temperature=0)[0] for p in batch]
        together = run(spec, batch, 48, temperature=0)
    finally:
        spec.speculator.adaptive = True
    share = lambda a: sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))  # noqa: E731
                          for s, t in zip(a, expected)) / sum(len(s) for s in expected)
    s = spec.speculator
    print(f"\nMTP speculative vs plain greedy: alone {share(alone):.3f}, in a batch of 8 {share(together):.3f} of tokens "
          f"before the first difference; {s.accepted} of {s.drafted} drafts kept")
    assert s.drafted > 0 and share(alone) >= 0.9 and share(together) >= 0.9
    assert all(u == 0 for u in spec.pool.usage().values()) and spec.pool.num_free_slots == spec.max_num_seqs
