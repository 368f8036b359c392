"""Many sequences at once on the CPU (fp32 reference ops): every sequence in a batch gets exactly the
tokens and logits it gets alone, whoever joins or leaves, with prompts read in chunks between decode
steps, through preemption, and with the KV pool empty again at the end.

The model is `SMALL`, the tiny preset with a 1,024-token vocabulary (these tests read token ids,
not text). Its window is 8 positions and the pool's blocks hold 4, so the sequences here slide
past several windows and give back sliding blocks as they go.
"""

import pytest
import torch

from checkpoint_fixtures import SMALL
from qat4.checkpoint.synth import synthetic_model
from qat4.engine import Engine
from qat4.engine.kv_cache import BlockAllocator, KVPool, PoolExhausted, pool_blocks
from qat4.engine.model_runner import ModelRunner
from qat4.engine.scheduler import Scheduler
from qat4.engine.sequence import Sequence, State
from qat4.engine.sampler import SamplingParams, mask_logits
from qat4.errors import Qat4Error
from qat4.ops.attention import pool_rows

CHUNK = 8


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [SMALL.bos_token_id] + torch.randint(3, SMALL.vocab_size, (n - 1,), generator=g).tolist()


# (prompt length, max new tokens, sampling) per request; the prompts cross the window and the chunk
REQUESTS = [
    (5, 6, {"temperature": 0}),
    (21, 12, {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "seed": 11}),
    (13, 9, {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 12}),
    (30, 10, {"temperature": 0}),
    (9, 14, {"temperature": 1.2, "top_k": 5, "seed": 13}),
]


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(SMALL, seed=0)


def make_engine(packed, **options) -> Engine:
    options = {"max_ctx": 128, "prefill_chunk": CHUNK, "block_size": 4, **options}
    return Engine.from_packed(packed, "cpu", **options)


def padded_engine(packed, **options) -> Engine:
    """An engine whose prompt steps are padded as on CUDA (to 16 or 24 tokens, for one sequence or
    up to eight), run eagerly."""
    engine = make_engine(packed, prefill_chunk=24, **options)
    engine.runner = ModelRunner(engine.model, engine.pool, max_num_seqs=engine.max_num_seqs, use_graph=False,
                                max_chunk=24, pad_chunks=True)
    return engine


def record_logits(engine: Engine) -> dict:
    """Wrap the runner's token pick so every sampled row's logits are kept, by (sequence, position)."""
    seen = {}

    def recording(h, slots, positions, keep, masked=False, scores=None):
        assert scores is None  # no request here asks for logprobs
        owners = {s.slot: s for s in engine.scheduler.running}
        logits = engine.model.logits(h)
        if masked:
            mask_logits(logits, engine.runner.allowed[slots])
        for row, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
            if slot in owners:  # not a padded prompt step's pick on the scratch row
                seen[(owners[slot].id, pos)] = logits[row]
        return logits.argmax(-1) if keep == 1 else engine.runner.sample(logits, slots, positions, keep)

    engine.runner.pick = recording
    return seen


def run_alone(engine: Engine, requests) -> list[tuple[list[int], dict]]:
    results = []
    for i, (n, new, sampling) in enumerate(requests):
        seen = record_logits(engine)
        seq = engine.add_request(prompt(n, i), new, stop_token_ids=[], **sampling)
        while engine.has_work:
            engine.step()
        results.append((seq.output, {pos: row for (sid, pos), row in seen.items() if sid == seq.id}))
    return results


def check_same(alone, batched_seqs, seen, rounded=lambda seq: False):
    """Each sequence's tokens equal; its logits bit for bit, or to fp32 rounding for the sequences
    ``rounded`` names (whose rows went through other product shapes: read again after preemption,
    or in padded prompt steps)."""
    for (tokens, logits), seq in zip(alone, batched_seqs):
        assert seq.output == tokens
        mine = {pos: row for (sid, pos), row in seen.items() if sid == seq.id}
        assert mine.keys() == logits.keys()
        for pos in logits:
            if rounded(seq):
                torch.testing.assert_close(mine[pos], logits[pos], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(mine[pos], logits[pos]), pos


def assert_pool_empty(engine: Engine):
    pool = engine.pool
    assert pool.num_free_slots == engine.max_num_seqs
    assert all(a.num_used == 0 for a in pool.allocators.values())
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def alone(packed):
    return run_alone(make_engine(packed), REQUESTS)


def test_every_sequence_gets_what_it_gets_alone_while_others_join_and_leave(packed, alone):
    engine = make_engine(packed)
    seen = record_logits(engine)
    seqs, steps, decode_rows_with_chunk = [], 0, 0
    arrivals = {0: [0, 1], 2: [2], 5: [3], 9: [4]}  # step -> requests that arrive before it
    while steps < 10 or engine.has_work:
        for i in arrivals.get(steps, []):
            n, new, sampling = REQUESTS[i]
            seqs.append(engine.add_request(prompt(n, i), new, stop_token_ids=[], **sampling))
        batch_before = [s for s in engine.scheduler.running if s.num_computed == s.length - 1]
        engine.step()
        steps += 1
        decode_rows_with_chunk += bool(batch_before) and any(s.num_computed < len(s.prompt) for s in seqs)
    check_same(alone, seqs, seen)
    assert decode_rows_with_chunk > 0  # prompts were read between other sequences' decode steps
    assert_pool_empty(engine)


def test_padded_prompt_steps_give_every_sequence_what_it_gets_alone(packed, alone):
    """Prompt steps padded as on CUDA (to 16 or 24 tokens, for one sequence or up to eight): the
    chunks of several sequences in one step, the empty sequences and padding rows on the scratch
    row, the picks of unfinished prompts there too. Every sequence gets the tokens it gets alone
    and its logits to fp32 rounding (other row counts per product); the pool empties."""
    engine = padded_engine(packed)
    assert engine.runner.chunk_sizes == [16, 24]
    seen = record_logits(engine)
    seqs, steps = [], 0
    arrivals = {0: [0, 1, 2], 3: [3], 4: [4]}
    while steps < 5 or engine.has_work:
        for i in arrivals.get(steps, []):
            n, new, sampling = REQUESTS[i]
            seqs.append(engine.add_request(prompt(n, i), new, stop_token_ids=[], **sampling))
        engine.step()
        steps += 1
    shapes = {key[:2] for key in engine.runner.chunk_graphs}  # (padded tokens, sequences) of the steps run
    assert {t for t, _ in shapes} == {16, 24} and {s for _, s in shapes} == {1, 8}
    check_same(alone, seqs, seen, rounded=lambda seq: True)
    assert_pool_empty(engine)


def test_the_load_warm_up_runs_every_padded_prompt_step_and_leaves_the_pool_empty(packed, alone, monkeypatch):
    """The warm-up a CUDA load runs (qat4.engine.warmup), here without graphs, where each capture
    runs its step once: the chunk at the deepest position, a padded prompt step of every size for
    one sequence and for several, picking or not, and an eager step of every kernel class. The
    pool is empty afterwards, and requests still get what they get alone."""
    from qat4.engine import warmup

    engine = padded_engine(packed)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    warmup.reserve_workspace(engine)
    keeps = (0, *warmup.default_keeps(engine))
    assert set(engine.runner.chunk_graphs) == {(t, s, keep, False, False) for t in (16, 24) for s in (1, 8)
                                               for keep in keeps}
    assert_pool_empty(engine)
    seen = record_logits(engine)
    seqs = [engine.add_request(prompt(n, i), new, stop_token_ids=[], **sampling)
            for i, (n, new, sampling) in enumerate(REQUESTS)]
    while engine.has_work:
        engine.step()
    check_same(alone, seqs, seen, rounded=lambda seq: True)
    assert_pool_empty(engine)


def test_prompt_steps_longer_than_the_context_keep_their_rows_inside_it(packed):
    """A context of 12 tokens with prompt steps padded up to 48 (several short prompts at once):
    the load's padded prompt steps (qat4.engine.warmup.capture_graphs) and the padding rows of a
    step of three 6-token prompts (18 tokens padded to 32, read first: later their blocks come from
    the prompt cache) stay at positions inside the context, and the three prompts read in one step
    get the tokens each gets alone."""
    from qat4.engine import warmup

    engine = make_engine(packed, prefill_chunk=48, max_ctx=12, kv_tokens=48)
    engine.runner = ModelRunner(engine.model, engine.pool, max_num_seqs=engine.max_num_seqs, use_graph=False,
                                max_chunk=48, pad_chunks=True)
    warmup.capture_graphs(engine)
    assert {key[0] for key in engine.runner.chunk_graphs} == {16, 32, 48}
    prompts = [prompt(6, i) for i in range(3)]
    together = [engine.add_request(p, 4, temperature=0, stop_token_ids=[]) for p in prompts]
    engine.step()
    assert all(s.num_computed == 6 for s in together)  # the three prompts in one step
    while engine.has_work:
        engine.step()
    alone = []
    for p in prompts:
        alone.append(engine.add_request(p, 4, temperature=0, stop_token_ids=[]))
        while engine.has_work:
            engine.step()
    assert [s.output for s in together] == [s.output for s in alone]
    assert_pool_empty(engine)


GROWING = [(5, 14, {"temperature": 0}), (6, 14, {"temperature": 1.0, "top_k": 64, "seed": 21}),
           (7, 14, {"temperature": 0.9, "top_p": 0.9, "seed": 22})]


def test_preempted_sequences_read_again_and_continue_as_alone(packed):
    """A pool of 40 full-attention positions holds the three short prompts but not their replies:
    as they grow, the newest is preempted, read again later (prompt and output), and still
    produces the tokens it produces alone (the logits to fp32 rounding)."""
    alone = run_alone(make_engine(packed), GROWING)
    engine = make_engine(packed, kv_tokens=40)
    seen = record_logits(engine)
    seqs = [engine.add_request(prompt(n, i), new, stop_token_ids=[], **sampling)
            for i, (n, new, sampling) in enumerate(GROWING)]
    while engine.has_work:
        engine.step()
    assert engine.scheduler.preempted_total > 0
    check_same(alone, seqs, seen, rounded=lambda seq: seq.preemptions > 0)
    assert_pool_empty(engine)


def test_a_prompt_that_does_not_fit_beside_others_waits_without_preempting_itself(packed):
    """A long prompt whose chunks the pool cannot hold beside a decoding sequence is not admitted
    (or, admitted, waits with its KV kept) until the other one finishes; nothing is read twice."""
    engine = make_engine(packed, kv_tokens=48)
    first = engine.add_request(prompt(20, 1), 20, temperature=0, stop_token_ids=[])
    engine.step()
    engine.step()
    late = engine.add_request(prompt(40, 2), 4, temperature=0, stop_token_ids=[])
    while engine.has_work:
        engine.step()
    assert len(first.output) == 20 and len(late.output) == 4
    assert engine.scheduler.preempted_total == 0 and late.preemptions == 0
    assert_pool_empty(engine)


def test_a_request_larger_than_the_pool_is_refused_up_front(packed):
    engine = make_engine(packed, kv_tokens=40)
    with pytest.raises(Qat4Error, match="kv_tokens"):
        engine.add_request(prompt(30, 0), 20)
    assert not engine.has_work


def test_aborted_and_finished_sequences_give_everything_back(packed):
    engine = make_engine(packed)
    keep = engine.add_request(prompt(12, 1), 8, temperature=0, stop_token_ids=[])
    drop = engine.add_request(prompt(20, 2), 50, temperature=0, stop_token_ids=[])
    waiting = engine.add_request(prompt(20, 3), 50, temperature=0, stop_token_ids=[])
    while not drop.output:
        engine.step()
    assert drop.state is State.RUNNING and waiting.state is State.RUNNING
    engine.abort(drop)
    engine.abort(waiting)
    assert drop.finish_reason == waiting.finish_reason == "abort"
    while engine.has_work:
        engine.step()
    assert len(keep.output) == 8 and keep.finish_reason == "length"
    assert_pool_empty(engine)


def test_at_most_max_num_seqs_run_and_the_rest_wait(packed):
    engine = make_engine(packed, max_num_seqs=2)
    seqs = [engine.add_request(prompt(6, i), 4, temperature=0, stop_token_ids=[]) for i in range(5)]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == 2 and all(len(s.output) == 4 for s in seqs)
    assert_pool_empty(engine)


def test_a_stop_token_ends_a_sequence_one_step_late_on_the_device_only(packed, alone):
    """The step after a stop token is already launched when the token comes back: its row is
    dropped and the sequence ends with the stop token as its last output."""
    tokens = alone[0][0]
    engine = make_engine(packed)
    seq = engine.add_request(prompt(5, 0), 6, temperature=0, stop_token_ids=[tokens[2]])
    while engine.has_work:
        engine.step()
    assert seq.output == tokens[: tokens.index(tokens[2]) + 1] and seq.finish_reason == "stop"
    assert_pool_empty(engine)


# ---- the pool and the scheduler on their own ---------------------------------------------------


def test_allocator_hands_out_blocks_once_and_never_the_scratch_block():
    a = BlockAllocator(5)
    got = a.allocate(4)
    assert sorted(got) == [1, 2, 3, 4] and a.num_free == 0 and a.num_used == 4
    with pytest.raises(PoolExhausted):
        a.allocate(1)
    a.release(got[:2])
    assert a.num_free == 2 and sorted(a.allocate(2)) == sorted(got[:2])


def test_sliding_blocks_are_given_back_once_out_of_every_window():
    blocks = pool_blocks(SMALL, kv_tokens=64, max_seqs=2, prefill_chunk=40, max_ctx=64, block_size=4)
    pool = KVPool(SMALL, blocks, block_size=4, max_seqs=2, max_ctx=64, device=torch.device("cpu"),
                  dtype=torch.float32)
    slot = pool.open_slot()
    pool.grow(slot, 40, 0)  # a 40-token prompt read in one go: everything held
    assert pool.held_blocks(slot) == {"full_attention": 10, "sliding_attention": 10}
    pool.grow(slot, 41, 40)  # decoding at 40: the window (8) reaches back to position 33
    assert pool.held_blocks(slot) == {"full_attention": 11, "sliding_attention": 3}  # blocks 8, 9, 10
    pool.flush()
    table = pool.tables["sliding_attention"][slot]
    rows = pool_rows(pool.tables["sliding_attention"], pool.block_size, torch.tensor([slot, slot]),
                     torch.tensor([33, 40]))
    assert rows.tolist() == [int(table[8]) * 4 + 1, int(table[10]) * 4]
    pool.close_slot(slot)
    assert all(a.num_used == 0 for a in pool.allocators.values()) and pool.num_free_slots == 2


def test_a_pool_holds_a_slot_only_when_growing_it_would_change_nothing():
    """The scheduler skips growing a sequence that ``holds`` says is covered, so ``holds`` may be
    true only where grow allocates no block and gives no sliding block back; along a decode it
    is true on exactly those steps."""
    blocks = pool_blocks(SMALL, kv_tokens=64, max_seqs=2, prefill_chunk=40, max_ctx=64, block_size=4)
    pool = KVPool(SMALL, blocks, block_size=4, max_seqs=2, max_ctx=64, device=torch.device("cpu"),
                  dtype=torch.float32)
    slot = pool.open_slot()
    assert not pool.holds(slot, 1, 0)
    pool.grow(slot, 13, 0)  # a 13-token prompt
    changes = []
    for position in range(13, 60):  # decoding: the query at `position` writes it, the window trails
        before = (pool.held_blocks(slot), [a.num_used for a in pool.allocators.values()])
        covered = pool.holds(slot, position + 1, position)
        pool.grow(slot, position + 1, position)
        changed = (pool.held_blocks(slot), [a.num_used for a in pool.allocators.values()]) != before
        assert covered != changed, position
        changes.append(changed)
    assert 0 < sum(changes) < len(changes)  # new blocks at block boundaries only


def test_scheduler_reads_prompts_in_chunks_under_the_budget_and_decodes_the_rest():
    blocks = pool_blocks(SMALL, kv_tokens=256, max_seqs=4, prefill_chunk=8, max_ctx=128, block_size=4)
    pool = KVPool(SMALL, blocks, block_size=4, max_seqs=4, max_ctx=128, device=torch.device("cpu"),
                  dtype=torch.float32)
    sched = Scheduler(pool, prefill_chunk=8)
    long, short = (Sequence(prompt(n, n), SamplingParams(temperature=0), 0, 4, frozenset()) for n in (19, 5))
    sched.add(long)
    sched.add(short)
    first = sched.schedule()
    assert [(s, n) for s, n in first.prefill] == [(long, 8)] and not first.decode  # 5 more would pass 8
    long.num_computed += 8
    second = sched.schedule()
    assert second.prefill == [(long, 8)]
    long.num_computed += 8
    third = sched.schedule()
    assert third.prefill == [(long, 3), (short, 5)]  # chunks keep their boundaries: 16 + 3
    long.num_computed, long.pending, short.num_computed, short.pending = 19, 1, 5, 1
    fourth = sched.schedule()
    assert fourth.decode == [long, short] and not fourth.prefill
