"""The load-time warm-up on CUDA: everything the first requests would otherwise wait for.

:func:`reserve_workspace` reads one prompt chunk at the deepest position, captures the decode and
prompt-step graphs (:func:`capture_graphs`) and compiles every kernel an eager prompt step can
launch (:func:`warm_kernels`), so the caching allocator holds the steps' peak working memory from
load on and no request waits for a graph capture or a Triton compile. :meth:`Engine.tune_decode
<qat4.engine.Engine.tune_decode>` captures the graphs again once it has pinned new tilings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qat4.engine.sampler import SamplingParams
from qat4.engine.sequence import Sequence

if TYPE_CHECKING:
    from qat4.engine.engine import Engine

# Token counts that reach every kernel choice of qat4.ops.w4.dispatch (the GEMV, the batch kernel's
# row blocks of 16, 32, 64 and 128, the prefill GEMM) and of the attention tiles (decode, prefill).
WARM_TOKENS = (1, 3, 17, 33, 65, 129)


@torch.no_grad()
def reserve_workspace(engine: Engine) -> None:
    """Read one prompt chunk at the deepest position, capture the decode graphs
    (:func:`capture_graphs`) and compile the eager steps' kernels (:func:`warm_kernels`), so
    the caching allocator holds their peak working memory from load on and no request waits
    for a compile. Afterwards the model's tilings
    (:meth:`~qat4.ops.w4.tiling.MatvecTilings.launched`) list the decode steps' GEMV shapes."""
    deep = min(engine.max_ctx, engine.pool.capacity_tokens)
    chunk = min(engine.prefill_chunk, deep)
    probe = Sequence([0] * deep, SamplingParams(temperature=0), 0, 1, frozenset())
    probe.slot, probe.num_computed = engine.pool.open_slot(), deep - chunk
    try:
        engine.pool.grow(probe.slot, deep, deep - chunk)
        engine.pool.flush()
        h, _, _ = engine.runner.forward_chunks([(probe, chunk)])
        engine.model.argmax(h[-1:])
        engine.model.tilings.forget()
        capture_graphs(engine)
        warm_kernels(engine, probe)
        torch.cuda.synchronize(engine.device)
    finally:
        engine.pool.close_slot(probe.slot)


def default_keeps(engine: Engine) -> list[int]:
    """Sampling shapes captured at load: greedy and the checkpoint's default sampling (what
    requests that set nothing ask for)."""
    return sorted({1, engine.runner.keep_for([Sequence([0], engine.sampling_params(), 0, 1, frozenset())])})


def capture_graphs(engine: Engine) -> None:
    """The decode graphs of every batch size for :func:`default_keeps`, with speculative
    decoding those of 1 + k rows per sequence for every k and batch size that may speculate,
    and the padded prompt steps' graphs of every size, for one sequence and for several,
    picking or not; other sampling shapes are captured when they first run."""
    for keep in default_keeps(engine):
        for b in engine.runner.sizes:
            engine.runner.capture(b, 1, keep)
        for b in engine.spec_sizes:
            for q in range(2, engine.spec_tokens + 2):
                engine.runner.capture(b, q, keep)
    for t in engine.runner.chunk_sizes:
        for s in sorted({1, engine.runner.chunk_seqs(t)}):
            for keep in (0, *default_keeps(engine)):
                engine.runner.capture_chunk(t, s, keep)


def warm_kernels(engine: Engine, probe: Sequence) -> None:
    """Launch every kernel variant an eager prompt step can need, on ``probe``'s blocks: a
    chunk of each row class of :mod:`qat4.ops.w4.dispatch` (WARM_TOKENS) at position 0 and at
    the deepest position (attention with and without key splits), then the output layer over
    each row class of sampled rows for every captured sampling shape. Triton compiles a kernel
    the first time a new constant or tiling reaches it, and a compile mid-serving stops every
    running sequence for seconds."""
    deep, keeps = probe.length, default_keeps(engine)
    for tokens in (t for t in WARM_TOKENS if t <= min(engine.prefill_chunk, deep)):
        for start in sorted({0, deep - tokens}):
            probe.num_computed = start
            h, positions, slots = engine.runner.forward_chunks([(probe, tokens)])
            for rows in (r for r in WARM_TOKENS if r <= min(tokens, engine.max_num_seqs)):
                for keep in keeps:
                    engine.runner.pick(h[:rows], slots[:rows], positions[:rows], keep)
