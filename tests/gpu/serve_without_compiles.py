"""Load an E2B engine, then serve a mixed workload and print, as JSON, every kernel Triton
compiled (or loaded) after the load: prompts of many lengths arriving while others decode, greedy
and default sampling, prompt chunks beside decode rows. Run by test_batching_gpu.py in a fresh
process, so kernels compiled by earlier tests cannot hide one the load failed to prepare."""

import json

import torch
from triton import knobs

from qat4.checkpoint.synth import synthetic_model
from qat4.config import E2B
from qat4.engine import Engine

engine = Engine.from_packed(synthetic_model(E2B, seed=0, device="cuda"), "cuda", max_ctx=4096)
compiled = []


def record(**info):
    compiled.append(info["repr"].split("(")[0])
    return False  # compile it as usual


knobs.runtime.jit_cache_hook = record
lengths = [5, 37, 130, 700, 1500, 3, 17, 64, 513, 2049, 9, 260, 1024, 33, 90, 1]
g = torch.Generator().manual_seed(0)
for wave in (lengths[:4], lengths[4:9], lengths[9:]):
    for i, n in enumerate(wave):
        sampling = {"temperature": 0} if i % 2 else {}
        engine.add_request(torch.randint(3, E2B.vocab_size, (n,), generator=g).tolist(), 24, stop_token_ids=[], **sampling)
    for _ in range(6):
        engine.step()
engine.drain()
torch.cuda.synchronize()
print(json.dumps(compiled))
