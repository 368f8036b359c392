"""The prompt cache on the CPU (fp32 reference ops): a request whose prefix an earlier one read gets
exactly the tokens and logits of a cold read while reading only the rest, for histories several
sliding windows long, a history edited in the middle, a reply re-rendered differently, and beside
other running sequences; cached blocks give way to running sequences and nothing leaks.

The model is `SMALL`, the tiny preset with a 1,024-token vocabulary (these tests read token ids,
not text). Its window is 8 positions and the pool's blocks hold 4.
"""

import pytest
import torch

from checkpoint_fixtures import SMALL
from qat4.checkpoint.synth import synthetic_model
from qat4.engine import Engine
from qat4.engine.kv_cache import BlockAllocator
from qat4.engine.prefix import RecentChains, extend_block_hashes, shared_blocks


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SMALL.vocab_size, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(SMALL, seed=0)


def make_engine(packed, **options) -> Engine:
    return Engine.from_packed(packed, "cpu", **{"max_ctx": 256, "prefill_chunk": 8, "block_size": 4, **options})


def run(engine: Engine, requests: list[list[int]], new: int = 8, others: list[list[int]] = ()) -> list:
    """Greedy runs of ``requests`` (after ``others`` have started) -> per request (output tokens,
    logits of every sampled row, cached tokens)."""
    seen = {}

    def recording(h, slots, positions, keep, masked, scores):
        assert not masked and scores is None  # no request here is constrained or asks for logprobs
        owners = {s.slot: s for s in engine.scheduler.running}
        logits = engine.model.logits(h)
        for row, (slot, pos) in enumerate(zip(slots.tolist(), positions.tolist())):
            seen[(owners[slot].id, pos)] = logits[row].clone()
        return logits.argmax(-1)

    engine.runner.pick = recording
    background = [engine.add_request(p, 12, temperature=0, stop_token_ids=[]) for p in others]
    for _ in range(3 if others else 0):
        engine.step()
    seqs = [engine.add_request(p, new, temperature=0, stop_token_ids=[]) for p in requests]
    engine.drain()
    del engine.runner.pick
    assert all(s.finished for s in background)
    return [(s.output, [seen[k] for k in sorted(seen) if k[0] == s.id], s.cached_tokens) for s in seqs]


def same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_a_cached_conversation_gives_exactly_the_cold_results(packed):
    warm, cold = make_engine(packed), make_engine(packed, prompt_cache_mib=0)
    history = [SMALL.bos_token_id] + tokens(61, 1)  # several windows of 8
    (reply, _, first_hit), = run(warm, [history])
    assert first_hit == 0
    turn2 = history + reply + tokens(13, 2)
    (hot,) = run(warm, [turn2])
    (ref,) = run(cold, [turn2])
    assert same(hot, ref) and ref[2] == 0
    # everything but the reply's last token (its K/V was never written) and the block it ends in
    assert hot[2] == (len(history) + len(reply) - 1) // 4 * 4


@pytest.mark.parametrize("edit", ["middle", "reply"])
def test_a_history_that_diverges_reuses_up_to_the_block_before_the_difference(packed, edit):
    warm, cold = make_engine(packed), make_engine(packed, prompt_cache_mib=0)
    history = [SMALL.bos_token_id] + tokens(70, 3)
    (reply, _, _), = run(warm, [history])
    if edit == "middle":  # an earlier message edited at position 30
        turn2, diverges = history[:30] + tokens(40, 4) + reply, 30
    else:  # the reply re-rendered (thinking dropped): differs from its first token on
        turn2, diverges = history + tokens(9, 5) + tokens(6, 6), len(history)
    (hot,) = run(warm, [turn2])
    (ref,) = run(cold, [turn2])
    assert same(hot, ref)
    assert hot[2] == diverges // 4 * 4


def test_hits_beside_running_sequences_and_between_requests(packed):
    warm, cold = make_engine(packed), make_engine(packed, prompt_cache_mib=0)
    system = [SMALL.bos_token_id] + tokens(40, 7)
    first = run(warm, [system + tokens(5, 8)])
    others = [[SMALL.bos_token_id] + tokens(20 + 3 * i, 9 + i) for i in range(3)]
    asks = [system + tokens(6 + i, 20 + i) for i in range(3)]
    hot = run(warm, asks, others=others)
    ref = run(cold, asks, others=others)
    assert first[0][2] == 0
    assert all(same(h, r) for h, r in zip(hot, ref))
    assert all(h[2] == 40 for h in hot)  # the shared 41 tokens up to the block before the 41st
    assert sum(h[2] for h in hot) >= 120


def test_cached_blocks_give_way_to_running_sequences_and_nothing_leaks(packed):
    engine = make_engine(packed, max_num_seqs=4, kv_tokens=96, prompt_cache_mib=0.001)
    pool = engine.pool
    run(engine, [[SMALL.bos_token_id] + tokens(40, 30 + i) for i in range(2)])
    assert all(n > 0 for n in pool.cached_blocks().values())
    # four requests that need nearly the whole pool: the cache is evicted, none is preempted
    run(engine, [[SMALL.bos_token_id] + tokens(14, 40 + i) for i in range(4)], new=6)
    assert engine.scheduler.preempted_total == 0
    assert all(a.num_used == 0 for a in pool.allocators.values()) and pool.num_free_slots == 4
    assert all(a.num_free == a.num_blocks - 1 for a in pool.allocators.values())


def test_off_means_no_hits(packed):
    engine = make_engine(packed, prompt_cache_mib=0)
    p = [SMALL.bos_token_id] + tokens(30, 50)
    run(engine, [p])
    assert run(engine, [p + tokens(4, 51)])[0][2] == 0
    assert all(n == 0 for n in engine.pool.cached_blocks().values())


def test_the_allocator_caches_named_blocks_and_evicts_the_oldest_tails_first():
    a = BlockAllocator(8)
    blocks = a.allocate(3)
    names = extend_block_hashes([], list(range(12)), 4, 3)
    a.register(blocks, names)
    a.release(blocks)  # the tail is cached first, so evicted first
    assert a.num_cached == 3 and a.num_free == 7 and a.num_used == 0
    a.acquire(a.lookup_run(names[:1]))
    assert a.num_cached == 2 and a.num_used == 1
    got = a.allocate(5)  # 4 free, then the oldest cached: the last block of the chain
    assert blocks[2] in got and a.lookup_run(names) == blocks[:2]  # the chain ends where its tail went
    assert extend_block_hashes([], list(range(12)), 4, 3) == names
    assert extend_block_hashes([], [0, 1, 2, 4] + list(range(4, 12)), 4, 3)[0] != names[0]


def test_recent_chains_name_a_prompt_as_hashing_it_does(monkeypatch):
    """Names taken from a finished sequence's chain are the names hashing gives, whether the prompt
    extends that sequence, leaves it mid-block or mid-way, or is shorter; a prompt that starts
    otherwise hashes everything; the oldest chains go once more tokens than the bound are kept."""
    recent = RecentChains(4, max_tokens=40)
    done = tokens(30, 1)
    recent.remember(done, extend_block_hashes([], done, 4, 7))
    for prompt in (done + tokens(9, 2), done[:13] + [1] + done[14:], done[:10], tokens(20, 3), done[:28]):
        n = len(prompt) // 4
        assert recent.names(prompt, n) == extend_block_hashes([], prompt, 4, n)
    assert shared_blocks(done + [5], done[:17] + [5], 4, 4) == 4 and shared_blocks(done, done[:5] + [0], 4, 1) == 1
    later = tokens(20, 4)
    recent.remember(later, extend_block_hashes([], later, 4, 5))  # 48 tokens held: the first chain goes
    seen = []
    hashing = extend_block_hashes

    def counting(hashes, toks, bs, n):
        seen.append(n - len(hashes))
        return hashing(hashes, toks, bs, n)

    import qat4.engine.prefix as prefix

    monkeypatch.setattr(prefix, "extend_block_hashes", counting)
    recent.names(done + [7], 7)
    recent.names(later + [7] * 8, 7)
    assert seen == [7, 2]  # the first chain is gone; the second gives its 5 blocks


def test_a_chats_next_turn_hashes_only_its_new_blocks(packed, monkeypatch):
    """The engine names turn 2 of a conversation from turn 1's chain: only the blocks after what
    the two share are hashed, and the hit is the one hashing everything gives."""
    import qat4.engine.prefix as prefix

    engine = make_engine(packed)
    turn1 = [SMALL.bos_token_id] + tokens(37, 5)
    (out, _, _), = run(engine, [turn1])
    hashed = []
    hashing = prefix.extend_block_hashes
    monkeypatch.setattr(prefix, "extend_block_hashes",
                        lambda h, t, bs, n: hashed.append(n - len(h)) or hashing(h, t, bs, n))
    turn2 = turn1 + out + tokens(11, 6)
    (_, _, cached), = run(engine, [turn2])
    shared = len(turn1 + out) - 1  # the last token of turn 1 was picked, never fed
    assert hashed[0] == len(turn2) // 4 - shared // 4 and cached == shared // 4 * 4


# ---- the scheduler's admission with a hit, on the pool alone -------------------------------------


def pool_and_scheduler(window: int, block_size: int, chunk: int, max_seqs: int, cache_blocks: int = 0):
    import dataclasses

    from qat4.engine.kv_cache import KVPool, pool_blocks
    from qat4.engine.scheduler import Scheduler

    cfg = dataclasses.replace(SMALL, sliding_window=window)
    blocks = pool_blocks(cfg, kv_tokens=256, max_seqs=max_seqs, prefill_chunk=chunk, max_ctx=256,
                         block_size=block_size, cache_blocks=cache_blocks)
    pool = KVPool(cfg, blocks, block_size=block_size, max_seqs=max_seqs, max_ctx=256, device=torch.device("cpu"),
                  dtype=torch.float32)
    return pool, Scheduler(pool, prefill_chunk=chunk)


def seq(prompt, new=4):
    from qat4.engine.sampler import SamplingParams
    from qat4.engine.sequence import Sequence

    return Sequence(prompt, SamplingParams(temperature=0), 0, new, frozenset())


def read_all(scheduler, s) -> None:
    """Run s's prompt through the scheduler as the engine would (every token known), then finish it."""
    scheduler.add(s)
    while s.num_computed < s.num_known:
        for q, n in scheduler.schedule().prefill:
            q.num_computed += n
    scheduler.finish(s, "stop")


def test_a_failed_admission_leaves_no_table_entry_behind(monkeypatch):
    """A hit attached to a slot and given back (the admission failed) sends nothing for that slot: a
    later owner's entries are the only ones the table gets (duplicate entries in one index_put_
    are undefined on CUDA)."""
    sent = []
    pool, scheduler = pool_and_scheduler(window=8, block_size=4, chunk=8, max_seqs=2)
    send = pool.uploads.send
    monkeypatch.setattr(pool.uploads, "send", lambda rows, dst: sent.append(send(rows, dst).clone()) or dst)
    read_all(scheduler, seq([2] + tokens(23, 60)))
    pool.flush()
    slot = pool.open_slot()
    history = [2] + tokens(23, 60)
    assert pool.attach_prefix(slot, seq(history).block_hashes(4, 24), 24) == 20
    pool.close_slot(slot)
    again = pool.open_slot()
    assert again == slot
    pool.grow(again, 8, 0)
    fresh = pool._held[again]["full_attention"][:2]
    sent.clear()
    pool.flush()
    assert pool.tables["full_attention"][again, :2].tolist() == fresh
    for index in sent:
        pairs = list(zip(index[0].tolist(), index[1].tolist()))
        assert len(pairs) == len(set(pairs))


def test_a_hit_is_admitted_when_a_cold_read_would_be():
    """The cached window a hit takes goes back as its prompt moves on, so it counts as room: a
    one-slot pool without spare cache blocks admits turn 2 of a conversation at once."""
    pool, scheduler = pool_and_scheduler(window=8, block_size=1, chunk=4, max_seqs=1)
    first = seq([2] + tokens(29, 61))
    read_all(scheduler, first)
    second = seq(first.prompt + tokens(20, 62))
    scheduler.add(second)
    batch = scheduler.schedule()
    assert [q for q, _ in batch.prefill] == [second] and second.num_computed == len(first.prompt)


def test_a_first_chunk_that_does_not_fit_waits_instead_of_failing():
    """A prompt chunk wider than the window needs more sliding blocks than the whole prompt's last
    window: when another sequence holds them, the newcomer waits in the queue, holding nothing."""
    pool, scheduler = pool_and_scheduler(window=4, block_size=1, chunk=12, max_seqs=2)
    holder = seq(list(range(3, 15)), new=1)
    scheduler.add(holder)
    assert [n for _, n in scheduler.schedule().prefill] == [12]
    holder.num_computed, holder.pending = 12, 1  # its token is still on the device
    newcomer = seq(list(range(3, 39)))
    scheduler.add(newcomer)
    assert not scheduler.schedule().prefill
    assert newcomer in scheduler.waiting and newcomer.slot is None and pool.num_free_slots == 1
