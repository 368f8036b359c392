"""Gemma 4's MTP drafter on the CPU (fp32 reference ops) against transformers 5.17's own
``Gemma4AssistantForCausalLM``, and in the engine.

One tiny synthetic target (sliding window 8) and a synthetic drafter written in the published
layout (``qat4 synth --assistant``): transformers loads the same folder, and is given the K/V and
hidden state qat4's target computed (the drafter's parity is then its own, not the target's). The
drafter reads every key before its position on its full layer and the window + 1 before it on its
sliding ones, so prompts below, at and past the window are checked. In the engine the drafter
changes how fast tokens come, never which; at every step its drafts are those it makes from a fresh
prefill of the sequence, while an oracle's drafts are verified instead, kept and refused at known
places (so it starts from the row of the last kept draft).
"""

import json

import pytest
import torch
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from qat4.assistant import Gemma4Assistant
from qat4.checkpoint.assistant import (ORDERING, AssistantCheckpoint, load_assistant, synthetic_assistant_config,
                                       synthetic_assistant_tensors, write_synthetic_assistant)
from qat4.checkpoint.safetensors_io import Entry, SafetensorsWriter
from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B, TINY
from qat4.engine import Engine
from qat4.engine.mtp import MTPDrafter
from qat4.engine.sampler import SamplingParams
from qat4.engine.sequence import Sequence
from qat4.engine.speculation import PROBE_EVERY
from qat4.errors import Qat4Error
from qat4.ops.attention import PagedSeqs, pool_rows

# The tiny preset with an 8,192-token vocabulary (64 centroids, 32 of them scored): these tests read
# token ids, not text, and on the CPU the real vocabulary's output layer is most of a step.
TARGET = TINY.replace(vocab_size=8192, vocab_size_per_layer_input=8192)
OPTIONS = {"max_ctx": 128, "prefill_chunk": 8, "block_size": 4}
DRAFTS = 4


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(TARGET, seed=0)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return write_synthetic_assistant(tmp_path_factory.mktemp("mtp") / "drafter", TARGET, seed=3)


@pytest.fixture(scope="module")
def hf_drafter(drafter_dir):
    model = Gemma4AssistantForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    model.config.get_text_config()._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def target(packed):
    return Engine.from_packed(packed, "cpu", max_ctx=128)


@pytest.fixture(scope="module")
def spec(packed, drafter_dir):
    return Engine.from_packed(packed, "cpu", speculative=f"mtp:{drafter_dir}", spec_tokens=3, spec_adaptive=False,
                              **OPTIONS)


@pytest.fixture(scope="module")
def plain(packed):
    return Engine.from_packed(packed, "cpu", **OPTIONS)


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [TARGET.bos_token_id] + torch.randint(3, TARGET.vocab_size, (n - 1,), generator=g).tolist()


def prefill(engine: Engine, ids: list[int]) -> tuple[Sequence, torch.Tensor]:
    """ids read into a fresh slot of ``engine``'s pool (kept open) -> (the sequence, final-normed hidden [T, D])."""
    seq = Sequence(ids, SamplingParams(temperature=0), 0, 1, frozenset())
    seq.slot = engine.pool.open_slot()
    engine.pool.grow(seq.slot, len(ids), 0)
    engine.pool.flush()
    hidden, _, _ = engine.runner.forward_chunks([(seq, len(ids))])
    return seq, hidden


def pool_kv(engine: Engine, slot: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """transformers' ``shared_kv_states`` [1, 1, n, d] of the slot's first n positions, from qat4's pool."""
    out = {}
    for kind, layer in TARGET.first_shared_types().items():
        rows = pool_rows(engine.pool.tables[kind], engine.pool.block_size, torch.full((n,), slot), torch.arange(n))
        out[kind] = (engine.pool.k[layer][rows][None, None], engine.pool.v[layer][rows][None, None])
    return out


def hf_draft_step(hf_drafter, target: Engine, token: int, hidden: torch.Tensor, position: int, kv):
    with torch.no_grad():
        e = target.model.embed_input(torch.tensor([token]))
        return hf_drafter(inputs_embeds=torch.cat([e, hidden.view(1, -1)], -1).view(1, 1, -1),
                          attention_mask=torch.ones(1, position + 1, dtype=torch.long),
                          position_ids=torch.tensor([[position]]), shared_kv_states=kv, use_cache=False)


# ---- the checkpoint ----------------------------------------------------------------------------


def test_a_synthetic_drafter_loads_in_transformers_with_the_same_tensors(drafter_dir, hf_drafter):
    checkpoint = load_assistant(drafter_dir)
    assert checkpoint.config == synthetic_assistant_config(TARGET)
    state = hf_drafter.state_dict()
    for name, t in checkpoint.tensors.items():
        assert torch.equal(state[name].to(t.dtype), t), name
    assert hf_drafter.config.text_config.num_kv_shared_layers == 4


def test_the_synthetic_e2b_drafter_has_the_published_shape():
    config = synthetic_assistant_config(E2B)
    t = config.text
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads) == (256, 2048, 4, 4)
    assert (t.layer_head_dim(0), t.layer_head_dim(3), t.sliding_window, config.backbone_hidden_size) == (256, 512, 512, 1536)
    assert (config.num_centroids, config.centroid_top_k, config.use_ordered_embeddings) == (2048, 32, True)


def test_transformers_reads_the_config_qat4_writes_and_qat4_reads_it_back(drafter_dir):
    raw = json.loads((drafter_dir / "config.json").read_text())
    hf = Gemma4AssistantConfig(**raw)
    assert hf.text_config.layer_types == list(synthetic_assistant_config(TARGET).text.layer_types)
    assert load_assistant(drafter_dir).config.to_hf_dict() == raw


def _rewrite(folder, tensors: dict, config: dict | None = None):
    folder.mkdir()
    with SafetensorsWriter(folder, [Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]) as w:
        for n, t in tensors.items():
            w.write(n, t)
    (folder / "config.json").write_text(json.dumps(config or synthetic_assistant_config(TARGET).to_hf_dict()))
    return folder


@pytest.mark.parametrize("change, message", [
    (lambda t, c: t.pop("pre_projection.weight"), "has no tensor pre_projection.weight"),
    (lambda t, c: t.__setitem__("model.norm.weight", torch.ones(7)), r"tensor model.norm.weight in .* is \[7\]; its config asks for \[32\]"),
    (lambda t, c: t.__setitem__(ORDERING, torch.zeros_like(t[ORDERING])), f"is not an ordering of the {TARGET.vocab_size} token ids"),
    (lambda t, c: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2)), "tensor model.layers.9.mlp.up_proj.weight in .* is not part of"),
    (lambda t, c: c.update(model_type="gemma4_text"), "is not an MTP drafter's config"),
    (lambda t, c: c["text_config"].update(num_kv_shared_layers=2), "num_kv_shared_layers must equal num_hidden_layers"),
    (lambda t, c: c.update(num_centroids=3), "num_centroids is 3; it must divide the vocabulary"),
    (lambda t, c: t[ORDERING].masked_fill_(t[ORDERING] == 0, -1), f"is not an ordering of the {TARGET.vocab_size} token ids"),
    (lambda t, c: c["text_config"].update(enable_moe_block=True), "has neither enable_moe_block nor use_double_wide_mlp"),
    (lambda t, c: c["text_config"].pop("num_hidden_layers"), "text_config.num_hidden_layers is None; it must be a positive"),
    (lambda t, c: c.update(text_config=[1]), "needs a text_config object"),
])
def test_a_broken_drafter_checkpoint_is_one_clear_sentence(tmp_path, change, message):
    tensors = synthetic_assistant_tensors(synthetic_assistant_config(TARGET))
    config = synthetic_assistant_config(TARGET).to_hf_dict()
    change(tensors, config)
    with pytest.raises(Qat4Error, match=message):
        load_assistant(_rewrite(tmp_path / "bad", tensors, config))


def test_a_drafter_made_for_another_model_is_refused_before_anything_loads(packed, tmp_path):
    other = write_synthetic_assistant(tmp_path / "e2b", E2B.replace(vocab_size=TARGET.vocab_size, hidden_size=256), seed=1)
    with pytest.raises(Qat4Error, match="was made for a model of hidden size 256; this one has 128"):
        Engine.from_packed(packed, "cpu", speculative=f"mtp:{other}", **OPTIONS)
    with pytest.raises(Qat4Error, match="there is no folder or file|does not exist"):
        Engine.from_packed(packed, "cpu", speculative=f"mtp:{tmp_path / 'missing'}", **OPTIONS)


# ---- one draft step against transformers ----------------------------------------------------------


@pytest.mark.parametrize("n", [5, 9, 10, 20])  # below the window, W + 1 keys, one past, far past
def test_a_draft_step_matches_transformers_on_the_same_kv_and_hidden_state(drafter_dir, hf_drafter, target, n):
    ids = random_ids(n, n)
    seq, hidden = prefill(target, ids)
    try:
        drafter = Gemma4Assistant(load_assistant(drafter_dir), target.model, 128)
        token = int(target.model.argmax(hidden[-1:]))
        kv = pool_kv(target, seq.slot, n)
        want = hf_draft_step(hf_drafter, target, token, hidden[-1], n, kv)
        seqs = PagedSeqs(torch.tensor([n - 1]), torch.arange(2), torch.tensor([seq.slot]), 1, 128)
        with torch.no_grad():
            y = drafter.step(torch.tensor([token]), hidden[-1:], torch.tensor([n]), target.pool, seqs)
            ids_scored, logits = drafter.candidates(y)
            projected = torch.nn.functional.linear(y, drafter.post_projection)
        ref = want.logits[0, 0]
        floor = ref.min()
        assert set(ids_scored[0].tolist()) == set(torch.nonzero(ref > floor).flatten().tolist())
        assert torch.allclose(logits[0], ref[ids_scored[0]], rtol=0, atol=1e-4 * float(ref.abs().max()))
        assert torch.allclose(projected[0], want.last_hidden_state[0, 0], rtol=0, atol=1e-4)
        assert int(drafter.next_token(y)) == int(ref.argmax())
    finally:
        target.pool.close_slot(seq.slot)


def test_k_drafts_chain_like_transformers_candidate_generator(drafter_dir, hf_drafter, target):
    n = 14
    seq, hidden = prefill(target, random_ids(n, 7))
    try:
        drafter = Gemma4Assistant(load_assistant(drafter_dir), target.model, 128)
        token = int(target.model.argmax(hidden[-1:]))
        kv, h, want = pool_kv(target, seq.slot, n), hidden[-1], []
        for _ in range(DRAFTS):  # transformers: the same position every step, the drafter's hidden fed back
            out = hf_draft_step(hf_drafter, target, token, h, n, kv)
            token, h = int(out.logits[0, 0].argmax()), out.last_hidden_state[0, 0]
            want.append(token)
        with torch.no_grad():
            got = drafter.draft(torch.tensor([int(target.model.argmax(hidden[-1:]))]), hidden[-1:], torch.tensor([n]),
                                target.pool, torch.tensor([seq.slot]), DRAFTS, 128)
        assert got[0].tolist() == want
    finally:
        target.pool.close_slot(seq.slot)


def test_the_full_output_table_head_matches_transformers_without_ordered_embeddings(drafter_dir, target):
    checkpoint = load_assistant(drafter_dir)
    raw = checkpoint.config.to_hf_dict() | {"use_ordered_embeddings": False}
    from qat4.checkpoint.assistant import AssistantConfig

    unordered = AssistantCheckpoint(AssistantConfig.from_hf_dict(raw),
                                    {n: t for n, t in checkpoint.tensors.items() if not n.startswith("masked_embedding")},
                                    checkpoint.source)
    hf = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**raw)).eval()
    hf.config.get_text_config()._attn_implementation = "eager"
    hf.load_state_dict({n: t.float() for n, t in unordered.tensors.items()}, strict=False)
    hf.lm_head.weight = hf.model.embed_tokens.weight
    n = 11
    seq, hidden = prefill(target, random_ids(n, 2))
    try:
        drafter = Gemma4Assistant(unordered, target.model, 128)
        token = int(target.model.argmax(hidden[-1:]))
        want = hf_draft_step(hf, target, token, hidden[-1], n, pool_kv(target, seq.slot, n)).logits[0, 0]
        seqs = PagedSeqs(torch.tensor([n - 1]), torch.arange(2), torch.tensor([seq.slot]), 1, 128)
        with torch.no_grad():
            ids, logits = drafter.candidates(drafter.step(torch.tensor([token]), hidden[-1:], torch.tensor([n]),
                                                          target.pool, seqs))
        assert ids is None and torch.allclose(logits[0], want, rtol=0, atol=1e-4 * float(want.abs().max()))
    finally:
        target.pool.close_slot(seq.slot)


# ---- in the engine -------------------------------------------------------------------------------


def test_the_pool_keeps_the_keys_the_drafter_reads_behind_the_window(spec, plain):
    assert plain.pool.window == TARGET.sliding_window
    assert spec.pool.window == TARGET.sliding_window + 2  # W + 1 keys before the draft position, and the position
    assert isinstance(spec.speculator.drafter, MTPDrafter) and spec.runner.last_hidden is not None
    assert set(spec.speculator.drafter.costs) == {(b, k) for b in spec.spec_sizes for k in range(1, 4)}


@pytest.mark.parametrize("n, new", [(3, 20), (13, 24), (30, 16)])
def test_greedy_mtp_speculation_gives_the_plain_tokens(spec, plain, n, new):
    ids = random_ids(n, 40 + n)
    want = plain.generate(ids, new, temperature=0, stop_token_ids=[])
    got = spec.generate(ids, new, temperature=0, stop_token_ids=[])
    assert got.tokens == want.tokens and got.drafted > 0


def test_seeded_sampling_with_mtp_drafts_gives_the_plain_tokens(spec, plain):
    ids = random_ids(9, 3)
    options = {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 11, "stop_token_ids": []}
    assert spec.generate(ids, 20, **options).tokens == plain.generate(ids, 20, **options).tokens


def test_a_batch_drafting_with_mtp_gets_every_plain_answer_and_gives_the_pool_back(spec, plain):
    prompts = [random_ids(n, 70 + n) for n in (2, 6, 11, 17)]
    want = [plain.generate(p, 18, temperature=0, stop_token_ids=[]).tokens for p in prompts]
    seqs = [spec.add_request(p, 18, temperature=0, stop_token_ids=[]) for p in prompts]
    while spec.has_work:
        spec.step()
    assert [s.output[: len(w)] for s, w in zip(seqs, want)] == want
    assert all(s.drafted > 0 for s in seqs)
    assert all(spec.pool.held_blocks(slot) == {kind: 0 for kind in spec.pool.blocks} for slot in range(spec.pool.max_seqs))


class CheckedDrafts:
    """Runs the engine's MTP drafter at every step and checks its drafts against the drafter run on
    a fresh prefill of each sequence's tokens in another engine (the hidden state before the newest
    token, every key before it); then proposes the plain continuation with every third draft wrong
    instead, so verifications keep some drafts and refuse others."""

    def __init__(self, mtp: MTPDrafter, drafter_dir, reference: Engine, answers: dict[tuple[int, ...], list[int]], k: int):
        self.mtp, self.reference, self.answers, self.k = mtp, reference, answers, k
        self.drafter = Gemma4Assistant(load_assistant(drafter_dir), reference.model, 128)
        self.checked, self.calls = 0, 0

    def expected(self, seq) -> list[int]:
        tokens = seq.tokens
        other, hidden = prefill(self.reference, tokens[:-1])
        try:
            with torch.no_grad():
                return self.drafter.draft(torch.tensor([tokens[-1]]), hidden[-1:], torch.tensor([len(tokens) - 1]),
                                          self.reference.pool, torch.tensor([other.slot]), self.k, 128)[0].tolist()
        finally:
            self.reference.pool.close_slot(other.slot)

    def propose_all(self, seqs, k):
        got = self.mtp.propose_all(seqs, self.k)
        assert got == [self.expected(s) for s in seqs], [len(s.output) for s in seqs]
        self.checked += len(seqs)
        out = []
        for seq in seqs:
            done = len(seq.output)
            drafts = []
            for t in self.answers[tuple(seq.prompt)][done : done + k]:
                self.calls += 1
                drafts.append(t if self.calls % 3 else t + 1)
            out.append(drafts)
        return out

    def cost(self, b, k):
        return self.mtp.cost(b, k)


def test_the_drafter_drafts_from_the_last_kept_drafts_state_in_the_engine(packed, drafter_dir, plain, target):
    engine = Engine.from_packed(packed, "cpu", speculative=f"mtp:{drafter_dir}", spec_tokens=3, spec_adaptive=False,
                                **OPTIONS)
    prompts = [random_ids(5, 1), random_ids(12, 2)]  # the second is past the window from the start
    answers = {tuple(p): plain.generate(p, 20, temperature=0, stop_token_ids=[]).tokens for p in prompts}
    checker = CheckedDrafts(engine.speculator.drafter, drafter_dir, target, answers, 3)
    engine.speculator.use(checker)
    seqs = [engine.add_request(p, 20, temperature=0, stop_token_ids=[]) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [s.output for s in seqs] == [answers[tuple(p)] for p in prompts]
    assert checker.checked >= 8 and 0 < sum(s.accepted for s in seqs) < sum(s.drafted for s in seqs)


def test_mtp_drafts_are_weighed_at_their_cost_and_stop_when_never_kept(packed, drafter_dir):
    def generate(draft_s: float):
        """60 tokens where a step costs 1 s plus 0.05 s a row and each draft ``draft_s``: costs set,
        not measured, so the choice does not follow this machine's timing (a real step's 0.01 s
        leaves no host time beyond them)."""
        engine = Engine.from_packed(packed, "cpu", speculative=f"mtp:{drafter_dir}", spec_tokens=3, **OPTIONS)
        spec = engine.speculator
        spec.costs = {(b, q): 1.0 + 0.05 * (q - 1) for b, q in spec.costs}
        spec.drafter.costs = {(b, k): draft_s * k for b, k in spec.drafter.costs}
        return engine.generate(random_ids(6, 9), 60, temperature=0, stop_token_ids=[]), spec

    # cheap drafts are tried; random weights: they are refused, so after the first few steps it stops drafting
    out, spec = generate(0.1)
    assert 0 < out.drafted and out.accepted <= 1 and spec.verified < 30
    # drafts that cost more than a step never pay, even at the prior's 2 in 3 (and 60 steps are too few for a probe)
    assert 60 < PROBE_EVERY
    out, spec = generate(1.0)
    assert out.drafted == 0 and spec.verified == 0


def test_the_drafter_loads_by_its_model_id_from_the_hugging_face_cache(tmp_path, monkeypatch, drafter_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hf-home" / "hub" / "models--google--gemma-4-E2B-it-qat-q4_0-unquantized-assistant"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)  # as huggingface_hub stores a download
    write_synthetic_assistant(snapshot, TARGET, seed=3)
    by_id = load_assistant("google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant")
    local = load_assistant(drafter_dir)
    assert by_id.source == snapshot and all(torch.equal(by_id.tensors[n], t) for n, t in local.tensors.items())
    with pytest.raises(Qat4Error, match="no model google/other-assistant is in the local Hugging Face cache"):
        load_assistant("google/other-assistant")


def test_qat4_synth_assistant_and_generate_with_it_on_the_command_line(tmp_path, capsys):
    from qat4.cli import main

    assert main(["synth", "--preset", "tiny", "--assistant", "--out", str(tmp_path / "mtp")]) == 0
    assert "wrote an MTP drafter for the tiny model" in capsys.readouterr().out
    assert main(["synth", "--preset", "tiny", "--assistant", "--format", "ct", "--out", str(tmp_path / "x")]) == 1
    assert "--assistant writes the drafter's own layout; leave out --format" in capsys.readouterr().err
    assert main(["synth", "--preset", "tiny", "--format", "ct-emb4", "--out", str(tmp_path / "tiny")]) == 0
    capsys.readouterr()
    generate = ["generate", "--model", str(tmp_path / "tiny"), "--device", "cpu", "--prompt", "Hello", "--max-new", "6",
                "--temperature", "0"]
    assert main(generate) == 0
    plain_text = capsys.readouterr().out
    assert main([*generate, "--speculative", f"mtp:{tmp_path / 'mtp'}", "--spec-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == plain_text and "draft" in out.err
    assert main([*generate, "--speculative", f"mtp:{tmp_path / 'nothing'}"]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nothing'} does not exist" in err and "Traceback" not in err


def test_qat4_serve_says_it_drafts_with_the_mtp_drafter_and_what_it_holds(tmp_path, capsys, monkeypatch):
    import re

    from qat4.cli import main
    from qat4.commands import serve

    monkeypatch.setattr(serve._Server, "run", lambda self: None)  # everything up to listening
    drafter = write_synthetic_assistant(tmp_path / "mtp", TINY)
    assert main(["serve", "--model", "synthetic:tiny", "--device", "cpu", "--speculative", f"mtp:{drafter}"]) == 0
    err = capsys.readouterr().err
    assert re.search(rf"speculative decoding with mtp:{re.escape(str(drafter))} drafts, up to 4 a step at up to "
                     r"8 sequences \(the drafter: \d+ MiB\)", err), err


def test_mtp_drafting_stays_exact_through_preemption_and_prompt_cache_hits(packed, drafter_dir, plain, spec):
    """A pool of 48 full-attention positions holds three prompts but not their replies: sequences
    are preempted and read again while the drafter drafts every step from their hidden states, and
    each still gets its plain tokens; so does a prompt read partly from the prompt cache."""
    engine = Engine.from_packed(packed, "cpu", speculative=f"mtp:{drafter_dir}", spec_tokens=3, spec_adaptive=False,
                                **OPTIONS | {"kv_tokens": 48})
    prompts = [random_ids(9, 31), random_ids(11, 32), random_ids(13, 33)]
    want = [plain.generate(p, 16, temperature=0, stop_token_ids=[]).tokens for p in prompts]
    seqs = [engine.add_request(p, 16, temperature=0, stop_token_ids=[]) for p in prompts]
    while engine.has_work:
        engine.step()
    assert engine.scheduler.preempted_total > 0 and all(s.drafted > 0 for s in seqs)
    assert [s.output for s in seqs] == want
    first = spec.generate(prompts[1], 12, temperature=0, stop_token_ids=[])
    cached = prompts[1] + first.tokens[:8]  # a prefix the prompt cache holds
    again = spec.generate(cached, 6, temperature=0, stop_token_ids=[])
    assert again.cached_tokens > 0 and again.drafted > 0
    assert again.tokens == plain.generate(cached, 6, temperature=0, stop_token_ids=[]).tokens
