"""What an engine allocates, estimated before anything is: the plan behind :meth:`Engine.load`.

Order of claims on the device memory (a cap's, or what the GPU has free): the model, and the MTP
drafter when one drafts; the KV pool's full-attention blocks (``kv_tokens``); the sliding-window
blocks of ``max_num_seqs`` sequences and the decode working memory of that many rows (and with
CUDA graphs the padded prompt steps' graphs); then the prompt chunk's working memory and the autotuner's
buffer, the largest of AUTO_PREFILL_CHUNKS that fits; the prompt cache's extra sliding blocks
(``prompt_cache_mib``: by default as much of DEFAULT_PROMPT_CACHE_MIB as is left); last, where
prompt products can take it and it fits in what is left, the model's 16-bit copies of its layer
matrices (:func:`qat4.model.dense_nbytes`, ``dense``, with cuBLAS's workspaces: by default where
they fit beside a margin of one scratch, ``dense_weights`` None), else the scratch of
:mod:`qat4.ops.w4.expanded` (``expand``); without either prompt products run the prefill GEMM.
``dense_weights=True`` claims the copies with the model instead, before everything else, and
fails the load where they do not fit.
``dense_weights=False`` never keeps them.
Without an explicit ``max_num_seqs``, as many sequences as fit with that working memory (up to the
default), else as many as fit without it; the model, the pool and the decode rows that do not fit
are an error, and so is an explicit prompt cache that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qat4.checkpoint.assistant import AssistantCheckpoint
from qat4.checkpoint.packed_model import PackedModel
from qat4.checkpoint.packing import PackedTensor
from qat4.config import SLIDING, Gemma4Config
from qat4.engine.config import MAX_CTX_DEFAULT, EngineConfig
from qat4.engine.graphs import chunk_graph_sizes, graph_sizes
from qat4.engine.kv_cache import block_nbytes, pool_blocks, pool_nbytes, spec_lookahead
from qat4.errors import Qat4Error
from qat4.model import CUBLAS_WORKSPACE_NBYTES, dense_nbytes, expansion_nbytes
from qat4.ops.w4.dispatch import expands_products

MIB = 1 << 20
AUTO_PREFILL_CHUNKS = (4096, 2048, 1024, 512, 256)  # prefill_chunk=None picks the largest that fits (CUDA)
PREFILL_BYTES_PER_TOKEN = 256 << 10  # working memory of one prompt token in a chunk, with headroom
DEFAULT_MAX_NUM_SEQS = {"cuda": 64, "cpu": 8}
DEFAULT_PROMPT_CACHE_MIB = 64


@dataclass(frozen=True)
class Plan:
    """The resolved options of one engine (every None of its EngineConfig filled in)."""

    dtype: torch.dtype
    max_ctx: int
    max_num_seqs: int
    prefill_chunk: int
    kv_tokens: int
    blocks: dict[str, int]
    cap: int | None  # bytes, when memory_cap_mib was given
    prompt_cache: bool = True
    window: int | None = None  # sliding positions the KV pool keeps per query (None: the model's window)
    expand: bool = False  # whether prompt products expand W into a scratch (qat4.ops.w4.expanded)
    dense: bool = False  # whether the model keeps a 16-bit copy of every layer matrix (dense_weights)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU; bf16 on CUDA parts with a bf16 datapath (sm_80+), fp16 before."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def cap_text(memory_cap_mib: float | None) -> str:
    return "" if memory_cap_mib is None else f" capped at {memory_cap_mib:g} MiB (memory_cap_mib)"


def _cap_memory(device: torch.device, cap_mib: float) -> int:
    """Limit this process's allocations on ``device`` to cap_mib; returns the cap in bytes."""
    if device.type != "cuda":
        raise Qat4Error("memory_cap_mib applies to CUDA devices only")
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(cap_mib * MIB)
    if not 0 < cap <= total:
        raise Qat4Error(f"memory_cap_mib is {cap_mib:g}; the GPU has {total / MIB:,.0f} MiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap


def model_nbytes(packed: PackedModel, max_ctx: int, dtype: torch.dtype) -> int:
    """Device bytes of Gemma4(packed, ..., dtype, max_ctx) without allocating."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    tensors = list(packed.tensors.values()) + ([packed.lm_head] if packed.lm_head is not None else [])
    for t in tensors:
        total += t.packed.numel() * 4 + t.scales.numel() * item if isinstance(t, PackedTensor) else t.numel() * item
    return total + rope_nbytes(packed.config, max_ctx, dtype)


def rope_nbytes(cfg: Gemma4Config, max_ctx: int, dtype: torch.dtype) -> int:
    """Bytes of the RoPE tables of ``cfg`` (:func:`qat4.model.rope_table`): a cos/sin table of
    2 * n_rot columns per layer type."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for kind in set(cfg.layer_types):
        rope = cfg.rope_parameters[kind]
        half = cfg.layer_head_dim(cfg.layer_types.index(kind)) // 2
        n_rot = int(float(rope.get("partial_rotary_factor", 1.0)) * half) if rope.get("rope_type") == "proportional" else half
        total += max_ctx * 2 * n_rot * item
    return total


GRAPH_NBYTES = 8 * MIB  # what one captured decode graph keeps beside the shared pool (attention partials)
# Working memory per logit of a row sampled over the whole vocabulary (qat4.engine.sampler.sample:
# the sort, its int64 ids, the integer CDF and their temporaries): on the H200 the 16-row sampled
# decode graph of E2B (262,144 logits a row) reserved 240 MiB, 15 MiB a row.
SAMPLED_BYTES_PER_LOGIT = 64


def decode_nbytes(packed: PackedModel, seqs: int, spec_tokens: int = 0) -> int:
    """Working memory of decode steps over up to ``seqs`` sequences, each with up to
    ``spec_tokens`` drafts while at most SPEC_MAX_BATCH decode: per row, the working memory of
    sampling it over the whole vocabulary (SAMPLED_BYTES_PER_LOGIT a logit) and headroom for its
    activations, and what the two graphs captured per batch size and rows per sequence (greedy and
    the default sampling) keep."""
    from qat4.engine.speculation import SPEC_MAX_BATCH

    spec_sizes = [b for b in graph_sizes(seqs) if b <= SPEC_MAX_BATCH] if spec_tokens else []
    rows = max([seqs] + [b * (1 + spec_tokens) for b in spec_sizes])
    graphs = len(graph_sizes(seqs)) + len(spec_sizes) * spec_tokens
    return rows * (packed.config.vocab_size * SAMPLED_BYTES_PER_LOGIT + (1 << 20)) + 2 * graphs * GRAPH_NBYTES


def chunk_graph_nbytes(prefill_chunk: int) -> int:
    """What the graphs of padded prompt steps keep from load on: the working memory of the largest
    size they run (:func:`qat4.engine.graphs.chunk_graph_sizes`) under ``prefill_chunk``."""
    return max(chunk_graph_sizes(prefill_chunk), default=0) * PREFILL_BYTES_PER_TOKEN


def tuning_reserve(device: torch.device) -> int:
    """What the autotuner allocates beside everything else while it tunes at load: its L2 flush
    buffer (:func:`qat4.ops.w4.tiling.flush_nbytes`)."""
    from qat4.ops.w4.tiling import flush_nbytes

    return flush_nbytes(device)


def _free_nbytes(device: torch.device, cap: int | None) -> int:
    """Bytes this process may still allocate on a CUDA device: what the cap leaves, or without a
    cap what the GPU has free."""
    return cap - torch.cuda.memory_allocated(device) if cap is not None else torch.cuda.mem_get_info(device)[0]


DRAFTER_GRAPHS_NBYTES = 16 << 20  # what the MTP drafter's captured graphs keep beside their activations


def drafter_nbytes(checkpoint: AssistantCheckpoint, target: Gemma4Config, dtype: torch.dtype, max_ctx: int) -> int:
    """Device bytes the MTP drafter takes beside ``target``: its weights in ``dtype``, its RoPE
    tables unless it shares the target's, and its working memory: for SPEC_MAX_BATCH sequences the
    output rows of its candidates, gathered, with their logits and headroom as much again; and the
    cuBLAS workspaces of the three streams its 16-bit products run on (the engine's, the graphs'
    warm-up and capture streams), which the expanded prompt products may share."""
    from qat4.engine.speculation import SPEC_MAX_BATCH

    cfg = checkpoint.config
    item = torch.empty((), dtype=dtype).element_size()
    rope = 0 if cfg.shares_rope(target) else rope_nbytes(cfg.text, max_ctx, dtype)
    candidates = cfg.centroid_top_k * cfg.tokens_per_centroid if cfg.use_ordered_embeddings else cfg.text.vocab_size
    working = 2 * SPEC_MAX_BATCH * candidates * (cfg.text.hidden_size + 1) * item
    return checkpoint.nbytes(dtype) + rope + working + DRAFTER_GRAPHS_NBYTES + 3 * CUBLAS_WORKSPACE_NBYTES


def plan(packed: PackedModel, device: torch.device, config: EngineConfig,
         drafter: AssistantCheckpoint | None = None) -> Plan:
    """Resolve ``config`` for ``packed`` on ``device`` (module docstring), beside an MTP
    ``drafter`` when given (its bytes, and the KV pool keeping the keys its sliding layers read
    behind a query, :attr:`qat4.checkpoint.assistant.AssistantConfig.keys_behind`); raises
    Qat4Error when it cannot fit."""
    cfg = packed.config
    dtype = config.dtype or default_dtype(device)
    max_ctx = min(cfg.max_position_embeddings, MAX_CTX_DEFAULT if config.max_ctx is None else int(config.max_ctx))
    kv_tokens = int(config.kv_tokens or max_ctx)
    cap = _cap_memory(device, config.memory_cap_mib) if config.memory_cap_mib is not None else None
    bs = config.block_size
    spec_tokens = config.spec_tokens if config.speculative else 0
    window = max(cfg.sliding_window, drafter.config.keys_behind + 1) if drafter is not None else None
    extra_nbytes = drafter_nbytes(drafter, cfg, dtype, max_ctx) if drafter is not None else 0
    # cuBLAS's workspaces of the streams the copies' products run on; drafter_nbytes counts them when one drafts
    dense_extra = dense_nbytes(cfg, dtype) + (0 if drafter is not None else (3 if config.cuda_graph else 1)
                                              * CUBLAS_WORKSPACE_NBYTES)
    if config.dense_weights:
        if not expands_products(dtype, device):
            raise Qat4Error(f"dense_weights needs 16-bit tensor-core products on a CUDA GPU (bf16 or fp16, without "
                            f"QAT4_PREFILL_FP32=1 or QAT4_OPS=reference); {device} in "
                            f"{str(dtype).removeprefix('torch.')} has none")
        extra_nbytes += dense_extra

    sliding_nbytes = block_nbytes(cfg, SLIDING, bs, dtype)
    cache_mib = DEFAULT_PROMPT_CACHE_MIB if config.prompt_cache_mib is None else config.prompt_cache_mib
    cache_blocks = int(cache_mib * MIB) // sliding_nbytes if sliding_nbytes else 0
    on = cache_mib > 0

    def kv(seqs: int, chunk: int, cache: int = 0) -> tuple[dict[str, int], int]:
        blocks = pool_blocks(cfg, kv_tokens=kv_tokens, max_seqs=seqs, prefill_chunk=chunk, max_ctx=max_ctx,
                             block_size=bs, cache_blocks=cache, lookahead=spec_lookahead(spec_tokens), window=window)
        return blocks, pool_nbytes(cfg, blocks, bs, seqs, max_ctx, dtype)

    if device.type != "cuda":
        seqs = int(config.max_num_seqs or DEFAULT_MAX_NUM_SEQS["cpu"])
        chunk = int(config.prefill_chunk or min(AUTO_PREFILL_CHUNKS[-1], max_ctx))
        return Plan(dtype, max_ctx, seqs, chunk, kv_tokens, kv(seqs, chunk, cache_blocks)[0], None, on, window)

    free = _free_nbytes(device, cap) - model_nbytes(packed, max_ctx, dtype) - extra_nbytes
    chunks = [config.prefill_chunk] if config.prefill_chunk else [c for c in AUTO_PREFILL_CHUNKS if c <= max_ctx]
    chunks = chunks or [max_ctx]
    smallest = min(chunks)
    reserve = tuning_reserve(device)

    def needed(seqs: int, chunk: int, working: bool) -> int:
        """Bytes of the pool and decode rows, with (``working``) the prompt chunk's working memory
        and the autotuner's buffer, which only a load that tunes needs at once."""
        extra = chunk * PREFILL_BYTES_PER_TOKEN + reserve if working else 0
        graphs = chunk_graph_nbytes(chunk) if config.cuda_graph else 0
        return kv(seqs, chunk)[1] + decode_nbytes(packed, seqs, spec_tokens) + graphs + extra

    if config.max_num_seqs:
        seqs = int(config.max_num_seqs)
    else:
        wanted = range(DEFAULT_MAX_NUM_SEQS["cuda"], 0, -1)
        seqs = next((s for s in wanted if needed(s, smallest, True) <= free), None)
        seqs = seqs or next((s for s in wanted if needed(s, smallest, False) <= free), 1)
    if needed(seqs, smallest, False) > free:
        raise Qat4Error(
            f"the model ({model_nbytes(packed, max_ctx, dtype) / MIB:,.0f} MiB) and a KV pool of {kv_tokens} tokens for "
            f"{seqs} sequences ({kv(seqs, smallest)[1] / MIB:,.0f} MiB) with their decode memory do not fit in GPU memory"
            f"{cap_text(config.memory_cap_mib)}{dense_text(bool(config.dense_weights), cfg, dtype)}; lower max_ctx, kv_tokens or max_num_seqs"
        )
    chunk = next(c for c in chunks if needed(seqs, c, True) <= free or c == smallest)
    room = free - needed(seqs, chunk, True)
    if config.prompt_cache_mib is None:  # the default: as much of it as fits
        cache_blocks = max(0, min(cache_blocks, room // sliding_nbytes if sliding_nbytes else 0))
    elif cache_blocks and cache_blocks * sliding_nbytes > room:
        raise Qat4Error(
            f"a prompt cache of {cache_mib:g} MiB (prompt_cache_mib) does not fit beside the model, the KV pool and "
            f"their working memory{cap_text(config.memory_cap_mib)}; {max(0, room) / MIB:,.0f} MiB are left"
        )
    expansion = expansion_nbytes(cfg, dtype, device, streams=3 if config.cuda_graph else 1)
    left = room - cache_blocks * sliding_nbytes
    dense = bool(config.dense_weights) or (config.dense_weights is None and expansion > 0
                                           and dense_extra + expansion <= left)
    expand = not dense and 0 < expansion <= left
    return Plan(dtype, max_ctx, seqs, chunk, kv_tokens, kv(seqs, chunk, cache_blocks)[0], cap, on, window, expand,
                dense)


def dense_text(dense: bool, model_config: Gemma4Config, dtype: torch.dtype) -> str:
    """What a load that does not fit holds beside the model when it keeps 16-bit weight copies
    (``dense``), "" without them."""
    if not dense:
        return ""
    return f" beside 16-bit copies of the weights ({dense_nbytes(model_config, dtype) / MIB:,.0f} MiB, dense_weights)"
