"""Many sequences at once on a CUDA GPU at E2B shapes: graph replay equals eager at every captured
batch size, each row's logits agree with the same sequence alone within bf16 rounding (the KL is
printed), a seeded request repeats its tokens beside any neighbours, and a flood of requests with
disconnects through the server leaves no sequence and no memory behind; rows constrained by a
grammar pick from graphs what they pick eagerly.
Run with `pytest -m gpu tests/gpu`."""

import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from engine_runs import record_logits, run

from qat4.chat.grammars import grammars_for
from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine
from qat4.engine.graphs import chunk_graph_sizes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server_harness import LiveServer, tiny_tokenizer, wait_until  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def packed():
    return synthetic_model(E2B, seed=0, device="cuda")


@pytest.fixture(scope="module")
def engine(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=4096, tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def eager(packed):
    return Engine.from_packed(packed, "cuda", max_ctx=4096, cuda_graph=False)


def prompts(n, length=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, E2B.vocab_size, (length + 7 * i % 50,), generator=g).tolist() for i in range(n)]


def test_graph_replay_equals_eager_at_every_captured_batch_size(engine, eager):
    assert engine.runner.sizes[-1] == engine.max_num_seqs
    for b in engine.runner.sizes:
        batch = prompts(b, seed=b)
        assert run(engine, batch, 12, temperature=0) == run(eager, batch, 12, temperature=0), b


def test_rows_agree_with_the_same_sequence_alone(eager):
    """Eight sequences decoded together (8-row kernels) against each alone (one-row kernels),
    teacher-forced by greedy decoding from the same prompts: KL and top-1 agreement printed."""
    seen = record_logits(eager)
    batch = prompts(8, seed=3)
    together = [eager.add_request(p, 24, temperature=0, stop_token_ids=[]) for p in batch]
    while eager.has_work:
        eager.step()
    alone = []
    for p in batch:
        alone.append(eager.add_request(p, 24, temperature=0, stop_token_ids=[]))
        while eager.has_work:
            eager.step()
    del eager.runner.pick
    kls, same, compared = [], 0, 0
    for a, b in zip(together, alone):
        for (sid, pos), row in seen.items():
            # the logits at pos read the tokens up to pos: output[pos - len(prompt)] is the one at pos
            fed = pos - len(a.prompt) + 1
            if sid != a.id or (b.id, pos) not in seen or a.output[:fed] != b.output[:fed]:
                continue
            la, lb = torch.log_softmax(row, -1), torch.log_softmax(seen[(b.id, pos)], -1)
            kls.append(float((lb.exp() * (lb - la)).sum()))
            same += int(row.argmax() == seen[(b.id, pos)].argmax())
            compared += 1
    kl = sum(kls) / len(kls)
    print(f"\nbatched vs alone over {compared} positions: mean KL {kl:.2e}, top-1 agreement {same / compared:.4f}")
    assert compared >= 8 and kl < 1e-3 and same / compared >= 0.9


def test_padded_prompt_chunks_agree_with_the_prompt_read_unpadded(engine, eager):
    """A one-sequence prompt chunk runs padded to the next of 16 .. prefill_chunk tokens (replayed
    from a graph, or eagerly without graphs): its last row's logits against the same prompt read
    unpadded (Engine.logits), KL and top-1 agreement printed."""
    sizes = chunk_graph_sizes(engine.prefill_chunk)
    assert set(engine.runner.chunk_graphs) >= {(t, s, 1, False, False) for t in sizes for s in (1, engine.runner.chunk_seqs(t))}
    seen = record_logits(eager)
    kls, same = [], 0
    lengths = (3, 16, 17, 100, 300, 512, 600, 2000)
    try:
        for n in lengths:
            p = prompts(1, length=n - 1, seed=n)[0]
            seq = eager.add_request(p, 1, temperature=0, stop_token_ids=[])
            while eager.has_work:
                eager.step()
            got = torch.log_softmax(seen[(seq.id, n - 1)], -1)
            ref = torch.log_softmax(eager.logits(p)[-1].float().cpu(), -1)
            kls.append(float((ref.exp() * (ref - got)).sum()))
            same += int(got.argmax() == ref.argmax())
    finally:
        del eager.runner.pick
    print(f"\npadded vs unpadded prompt chunks of {lengths} tokens: KL {max(kls):.2e} at most, top-1 {same}/{len(lengths)}")
    assert max(kls) < 1e-3 and same >= len(lengths) - 1


def test_scored_steps_replayed_from_graphs_give_the_eager_logprobs(engine, eager):
    """Eight greedy sequences with logprobs, batched: the graph-replayed engine's logprob rows (the
    scored graph variants, prompt picks included) against the eager engine's on the same prompts,
    while their tokens agree; the largest difference is printed."""
    batch = prompts(8, seed=5)

    def scored(eng):
        seqs = [eng.add_request(p, 16, temperature=0, stop_token_ids=[], logprobs=5) for p in batch]
        while eng.has_work:
            eng.step()
        return seqs

    worst, compared = 0.0, 0
    for a, b in zip(scored(engine), scored(eager)):
        assert len(a.token_logprobs) == len(a.output) == 16
        for x, y, t_a, t_b in zip(a.token_logprobs, b.token_logprobs, a.output, b.output):
            if t_a != t_b:
                break
            assert x.token == t_a and x.top[0][0] == t_a  # greedy: the most likely token
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)))
            compared += 1
    print(f"\nscored graph replay vs eager over {compared} tokens: largest logprob difference {worst:.2e}")
    assert compared >= 64 and worst < 0.05


def test_constrained_rows_replayed_from_graphs_give_the_eager_tokens_and_parse(engine, eager):
    """Rows constrained by a JSON schema beside free rows, greedy and seeded: their forward and
    their deferred masked pick replayed as two graphs give the tokens the eager engine picks, and
    every constrained reply is JSON that matches the schema."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    grammars = grammars_for(engine.tokenizer, engine.stop_token_ids)

    def replies(eng):
        seqs = [eng.add_request(p, 24, temperature=0 if i % 2 else 1.0, seed=i,
                                constraint=grammars.json(schema) if i % 3 else None)
                for i, p in enumerate(prompts(12, seed=11))]
        eng.drain()
        return seqs

    from_graphs, from_eager = replies(engine), replies(eager)
    assert [s.output for s in from_graphs] == [s.output for s in from_eager]
    for i, seq in enumerate(from_graphs):
        if i % 3:
            assert seq.finish_reason == "stop", seq.output
            jsonschema.validate(json.loads(engine.tokenizer.decode(seq.output[:-1])), schema)


def test_a_seed_repeats_its_tokens_beside_any_neighbours(engine):
    """The same padded batch size with other neighbours gives the seeded request the same tokens;
    across batch sizes (other kernels, bf16 rounding) the agreement is printed."""
    mine = prompts(1, seed=9)[0]
    seeded = dict(temperature=1.0, top_k=64, top_p=0.95, seed=1234)

    def with_neighbours(n, seed):
        seqs = [engine.add_request(mine, 32, stop_token_ids=[], **seeded)]
        seqs += [engine.add_request(p, 32, stop_token_ids=[], temperature=0.9, seed=seed + i)
                 for i, p in enumerate(prompts(n, seed=seed))]
        while engine.has_work:
            engine.step()
        return seqs[0].output

    first = with_neighbours(7, 100)
    assert with_neighbours(7, 200) == first
    for n in (0, 15, 40):
        other = with_neighbours(n, 300 + n)
        same = sum(a == b for a, b in zip(first, other))
        print(f"\nseeded request beside {n} neighbours: {same} of 32 tokens as beside 7")


def test_a_flood_through_the_server_leaks_no_sequence_and_no_memory(engine):
    """500 requests from 64 clients, every tenth leaving after its first chunk: the rest complete,
    no 5xx, the pool is empty after and the allocated memory is what it was."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    from qat4.server.app import create_app

    with LiveServer(create_app(engine, model_name="e2b", max_queue=512)) as server:
        loop_state = server.app.state.engine_loop

        async def one(client, i):
            body = {"prompt": prompts(1, length=60 + i % 200, seed=i)[0], "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return f"status {resp.status_code}"
                chunks = 0
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        return f"done {chunks}"
                    if line.startswith("data: "):
                        chunks += 1
                        if i % 10 == 0:
                            return "left"
                return "cut"

        async def flood():
            async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=64)) as client:
                queue, results = list(range(500)), {}

                async def worker():
                    while queue:
                        i = queue.pop()
                        results[i] = await one(client, i)

                await asyncio.gather(*(worker() for _ in range(64)))
                return results

        results = asyncio.run(flood())
        assert wait_until(lambda: not engine.has_work and not loop_state._jobs, timeout=120)
        metrics = httpx.get(server.url + "/metrics").text
    assert sum(r == "left" for r in results.values()) == 50
    assert all(r == "done 33" for i, r in results.items() if i % 10), sorted(set(results.values()))
    assert 'status="5' not in metrics
    assert all(a.num_used == 0 for a in engine.pool.allocators.values()) and engine.pool.num_free_slots == engine.max_num_seqs
    torch.cuda.synchronize()
    print(f"\nallocated before {before / 2**20:,.1f} MiB, after {torch.cuda.memory_allocated() / 2**20:,.1f} MiB")
    assert torch.cuda.memory_allocated() <= before + (8 << 20)


def test_serving_compiles_no_kernel_after_the_load():
    """Every kernel an eager step launches is compiled at load (``qat4.engine.warmup.warm_kernels``): a compile
    mid-serving stalls every running sequence for seconds."""
    script = Path(__file__).with_name("serve_without_compiles.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled == [], compiled


def test_dense_weights_replay_their_eager_steps_and_give_the_packed_engines_tokens(packed):
    """An engine keeping 16-bit copies of the weights (dense_weights, what a load with memory to
    spare keeps by default), which its prompt steps of more than 128 tokens multiply: its graphs
    replay its eager steps bit for bit with 48 and 64 sequences reading their prompts together;
    one prompt of 300 tokens and then 64 sequences give the tokens of an engine without them
    exactly, since a copy is the matrix that engine expands (cuBLAS on the same 16-bit W) and the
    decode steps run the same packed kernels."""
    from qat4.model import dense_nbytes
    from qat4.ops.w4 import dispatch

    assert dispatch.DENSE_ROWS > dispatch.BATCH_ROWS
    options = dict(max_ctx=4096, kv_tokens=64 * 256)
    dense = Engine.from_packed(packed, "cuda", tokenizer=tiny_tokenizer(), **options)
    dense_eager = Engine.from_packed(packed, "cuda", cuda_graph=False, **options)
    plain = Engine.from_packed(packed, "cuda", dense_weights=False, **options)
    try:
        assert dense.nbytes["dense"] == dense_nbytes(E2B, torch.bfloat16) and not dense.plan.expand
        assert dense_eager.plan.dense
        assert plain.plan.expand and not plain.plan.dense  # its prompt products expand W: the same cuBLAS products
        for b in (48, 64):
            batch = prompts(b, seed=b)
            assert run(dense, batch, 12, temperature=0) == run(dense_eager, batch, 12, temperature=0), b
        one = prompts(1, length=300, seed=11)
        assert run(dense, one, 16, temperature=0) == run(plain, one, 16, temperature=0)
        batch = prompts(64, seed=12)
        assert run(dense, batch, 8, temperature=0) == run(plain, batch, 8, temperature=0)
    finally:
        del dense, dense_eager, plain
        gc.collect()
        torch.cuda.empty_cache()
