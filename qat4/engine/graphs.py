"""The CUDA graphs of the engine's steps: which sizes it captures, and how a capture runs.

A decode step replays the graph of its batch size padded up to the next of :func:`graph_sizes`; a
prompt step the graph of its token count padded up to the next of :func:`chunk_graph_sizes`
(:mod:`qat4.engine.model_runner`). :func:`capture_graph` captures one, its eager warm-ups on the
single side stream of :func:`warm_up_stream`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

CHUNK_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)  # padded sizes of prompt steps


def chunk_graph_sizes(prefill_chunk: int) -> list[int]:
    """The token counts prompt steps are padded to under ``prefill_chunk``: the sizes of
    CHUNK_GRAPH_TOKENS below it, and prefill_chunk itself unless it is past the largest (then
    steps longer than that run unpadded)."""
    sizes = [t for t in CHUNK_GRAPH_TOKENS if t < prefill_chunk]
    return sizes + [prefill_chunk] if prefill_chunk <= CHUNK_GRAPH_TOKENS[-1] else sizes


def graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured decode graph: 1, 2, 4, 8, then every 16, and max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def uses_graphs(cuda_graph: bool, device: torch.device) -> bool:
    """Whether decode steps replay CUDA graphs: asked for (EngineConfig.cuda_graph) and on a CUDA device."""
    return cuda_graph and device.type == "cuda"


@functools.lru_cache(maxsize=None)
def warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream on which :func:`capture_graph` runs its eager warm-ups on ``device``.
    cuBLAS keeps a 32 MiB workspace per stream it has run on, for good: a new stream per capture
    kept one more workspace for every graph whose products reach cuBLAS (576 MiB over E2B's
    prompt-step graphs, which broke the 3,732 MiB plan)."""
    return torch.cuda.Stream(device)


def capture_graph(run: Callable[[], None], device: torch.device, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run`` (in memory pool ``pool``, when given): two eager runs on the
    device's warm-up stream first, which compile and tune its kernels, then the capture (on
    torch's one capture stream)."""
    side = warm_up_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph
