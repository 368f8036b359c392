"""The server over the real engine with many clients at once (CPU, tiny model): each request gets
the answer it gets alone, and a flood of requests with disconnects leaves nothing behind."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest
from server_harness import LiveServer, tiny_tokenizer, wait_until

from qat4.checkpoint.synth import synthetic_model
from qat4.config import PRESETS
from qat4.engine import Engine
from qat4.server.app import create_app


@pytest.fixture(scope="module")
def engine():
    """64 slots and a pool of 512 positions, which holds about 16 of a flood's short sequences at
    once: the flood's requests still wait for pool room, while enough of them run together that
    its 500 requests take half the steps they took in a pool of max_ctx (six at a time on average)."""
    return Engine.from_packed(synthetic_model(PRESETS["tiny"]), "cpu", max_ctx=256, max_num_seqs=64, prefill_chunk=256,
                              kv_tokens=512, tokenizer=tiny_tokenizer())


def completion(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def test_concurrent_requests_get_the_answers_they_get_alone(engine):
    prompts = [f"Request number {i} says" + " more" * (i % 5) for i in range(12)]
    with LiveServer(create_app(engine, model_name="tiny")) as server:
        alone = [httpx.post(server.url + "/v1/completions", json=completion(p, 5), timeout=60).json() for p in prompts]

        async def together():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=completion(p, 5)) for p in prompts))

        batched = [r.json() for r in asyncio.run(together())]
        seeded = {**completion(prompts[0], 6), "temperature": 1.0, "seed": 7}
        first = httpx.post(server.url + "/v1/completions", json=seeded, timeout=60).json()

        async def beside_others():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                others = [client.post("/v1/completions", json=completion(p, 8)) for p in prompts[1:6]]
                return (await asyncio.gather(client.post("/v1/completions", json=seeded), *others))[0]

        again = asyncio.run(beside_others()).json()
    assert [r["choices"][0]["text"] for r in batched] == [r["choices"][0]["text"] for r in alone]
    assert all(r["usage"]["completion_tokens"] == 5 for r in batched)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]  # a seed repeats whoever runs beside it


def test_a_flood_with_disconnects_completes_the_rest_and_leaks_nothing(engine):
    """500 requests from 64 clients; every tenth client leaves after its first streamed chunk."""
    n_requests, clients, new = 500, 64, 3
    with LiveServer(create_app(engine, model_name="tiny", max_queue=512)) as server:
        loop_state = server.app.state.engine_loop

        async def one(client: httpx.AsyncClient, i: int) -> str:
            body = completion(f"Flood {i}:" + " x" * (i % 7), new, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return f"status {resp.status_code}"
                chunks = 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return f"done {chunks}"
                    if '"error"' in line:
                        return "error " + line
                    chunks += 1
                    if i % 10 == 0:
                        return "left"
                return "cut"

        async def flood():
            limits = httpx.Limits(max_connections=clients)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
                queue = list(range(n_requests))
                results: dict[int, str] = {}

                async def worker():
                    while queue:
                        i = queue.pop()
                        results[i] = await one(client, i)

                await asyncio.gather(*(worker() for _ in range(clients)))
                return results

        results = asyncio.run(flood())
        assert wait_until(lambda: not engine.has_work and not loop_state._jobs, timeout=60)
        metrics = httpx.get(server.url + "/metrics").text
    left = [i for i, r in results.items() if r == "left"]
    assert len(left) == n_requests // 10
    bad = {i: r for i, r in results.items() if r != "left" and not r.startswith("done")}
    assert not bad, list(bad.items())[:3]
    # every finished stream: its text chunks plus the final one with finish_reason
    assert all(results[i] == f"done {new + 1}" for i in results if i % 10)
    assert 'status="500"' not in metrics
    pool = engine.pool
    assert pool.num_free_slots == engine.max_num_seqs and all(a.num_used == 0 for a in pool.allocators.values())
    gc.collect()
    assert not engine.scheduler.running and not engine.scheduler.waiting
