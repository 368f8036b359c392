"""The engine: one sequence at a time over an engine-owned KV cache.

A prompt is read in chunks of ``prefill_chunk`` tokens (by default the largest of 4096 .. 256 whose
estimated working memory fits beside the model and cache; 256 on the CPU); each new token then
runs one decode step (embedding -> layers -> output layer -> greedy argmax or sampling) over static
device buffers.
On CUDA that step is captured once as a CUDA graph per sampling shape and replayed per token; the
host enqueues step n+1 before it reads token n back, so the GPU never waits for Python. Decode GEMV
tilings saved for this GPU by :meth:`Engine.tune_decode` (``qat4 bench --tune``) are pinned at load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qat4.cache import KVCache
from qat4.checkpoint.packed_model import PackedModel
from qat4.checkpoint.packing import PackedTensor
from qat4.decode_tuning import load_tilings, save_tilings, tune_decode_tilings
from qat4.errors import Qat4Error
from qat4.model import Gemma4
from qat4.ops.w4_linear import forget_matvec_tilings, matvec_tilings, pin_matvec_tilings
from qat4.sampling import SamplingParams, sample

DEFAULT_STOP_IDS = (1, 106, 50)  # <eos>, <turn|>, <|tool_response>
GREEDY = "greedy"  # decode-graph key of argmax decoding; sampling graphs are keyed by top_k
MAX_CTX_DEFAULT = 131_072
MIB = 1 << 20
AUTO_PREFILL_CHUNKS = (4096, 2048, 1024, 512, 256)  # prefill_chunk=None picks the largest that fits (CUDA)
PREFILL_BYTES_PER_TOKEN = 256 << 10  # working memory of one prompt token in a chunk, with headroom
TUNING_RESERVE = 256 * MIB  # Triton's autotuner allocates a 256 MiB cache-flush buffer while it tunes


@dataclass
class Generation:
    """One finished generation. ``tokens`` excludes a stop token; after a stop string it ends
    with the token that completed it, and ``text`` is cut before the stop string."""

    tokens: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    prefill_ms: float  # prompt read and first token picked, until it is on the host
    decode_ms: float  # first token to last token
    decode_steps: int  # tokens produced by decode steps (every token after the first)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_ms * 1e3 if self.decode_ms > 0 else 0.0


@dataclass
class _Timing:
    started: float = 0.0
    first: float = 0.0
    last: float = 0.0
    steps: int = 0


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU; bf16 on CUDA parts with a bf16 datapath (sm_80+), fp16 before."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


class DecodeStep:
    """One decode step over static buffers, replayed from a CUDA graph or run eagerly.

    Inputs: ``token`` [1] (the id to feed) and ``pos`` [1] (its position), both int64 on the
    device, plus ``uniform`` / ``temperature`` / ``top_p`` [1] fp32 for sampling. The step
    writes the next id back into ``token`` and advances ``pos``, so replays chain without the host.
    """

    def __init__(self, model: Gemma4, cache: KVCache, use_graph: bool):
        dev = model.device
        self.model, self.cache, self.use_graph = model, cache, use_graph
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.uniform = torch.zeros(1, dtype=torch.float32, device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(1, dtype=torch.float32, device=dev)
        self.graphs: dict[object, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def pick(self, h: torch.Tensor, key: object) -> torch.Tensor:
        """Final-normed h [1, D] -> next id [1] int64: argmax for GREEDY, else sample with top_k = key."""
        if key == GREEDY:
            return self.model.argmax(h)
        return sample(self.model.logits(h)[0], self.uniform, self.temperature, self.top_p, key)

    def _step(self, key: object) -> None:
        h = self.model.decode(self.token, self.pos, self.cache)
        self.token.copy_(self.pick(h, key))
        self.pos.add_(1)

    def prepare(self, key: object) -> None:
        """Capture the graph for ``key`` if needed. Scribbles on the cache: call before a sequence."""
        if not self.use_graph or key in self.graphs:
            return
        self.token.zero_()
        self.pos.zero_()
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):  # first launches compile and tune kernels outside the capture
            for _ in range(2):
                self._step(key)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step(key)
        self._pool = graph.pool()
        self.graphs[key] = graph

    def run(self, key: object) -> None:
        if self.use_graph:
            self.graphs[key].replay()
        else:
            self._step(key)


class _HostReader:
    """Device token ids to host ints without stalling the stream: copies go to pinned slots and
    are read once their event completes. On the CPU a read is immediate."""

    def __init__(self, device: torch.device, slots: int = 2):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(slots, dtype=torch.int64, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() for _ in range(slots)] if self.cuda else []
        self.next = 0

    def submit(self, value: torch.Tensor) -> int:
        slot = self.next
        self.next = (slot + 1) % self.host.shape[0]
        self.host[slot : slot + 1].copy_(value, non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> int:
        if self.cuda:
            self.events[slot].synchronize()
        return int(self.host[slot])


class Engine:
    """Gemma 4 text generation from packed 4-bit weights on one device."""

    def __init__(self, model: Gemma4, cache: KVCache, *, prefill_chunk: int, cuda_graph: bool,
                 tokenizer=None, generation_config: dict | None = None):
        self.model, self.cache, self.config = model, cache, model.config
        self.device, self.dtype = model.device, model.dtype
        self.max_ctx, self.prefill_chunk = cache.max_ctx, prefill_chunk
        self.tokenizer = tokenizer
        self.generation_config = dict(generation_config or {})
        self.step = DecodeStep(model, cache, use_graph=cuda_graph and self.device.type == "cuda")
        self._reader = _HostReader(self.device)
        self.pinned_tilings = (0, 0)  # (decode GEMV shapes pinned from saved tilings, shapes in the step); CUDA only

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def load(cls, path_or_id: str, device: str | torch.device = "cpu", *, dtype: torch.dtype | None = None,
             max_ctx: int | None = None, prefill_chunk: int | None = None, memory_cap_mib: float | None = None,
             cuda_graph: bool = True) -> "Engine":
        """Read a checkpoint (folder, file or model id) and build an engine on ``device``.

        dtype: compute dtype (default: :func:`default_dtype`). max_ctx: context in tokens
        (default 131072), at most the model's max_position_embeddings. prefill_chunk: tokens per
        prefill step; None picks the largest of AUTO_PREFILL_CHUNKS whose estimated working memory
        fits beside the model and the KV cache (256 on the CPU). memory_cap_mib: on CUDA, cap this
        process's GPU memory before anything is allocated; raises Qat4Error at load when the
        model, the KV cache and the prefill workspace do not fit. cuda_graph: replay decode as a CUDA graph (CUDA only).
        """
        from qat4.checkpoint.loader import load_packed

        return cls.from_packed(load_packed(path_or_id), device, dtype=dtype, max_ctx=max_ctx,
                               prefill_chunk=prefill_chunk, memory_cap_mib=memory_cap_mib, cuda_graph=cuda_graph)

    @classmethod
    def from_packed(cls, packed: PackedModel, device: str | torch.device = "cpu", *, dtype: torch.dtype | None = None,
                    max_ctx: int | None = None, prefill_chunk: int | None = None, memory_cap_mib: float | None = None,
                    cuda_graph: bool = True, tokenizer=None) -> "Engine":
        """Build an engine from a PackedModel in memory; same options as :meth:`load`.

        The tokenizer comes from ``packed.source`` when it has one, unless ``tokenizer`` is given.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = dtype or default_dtype(device)
        cfg = packed.config
        max_ctx = min(cfg.max_position_embeddings, MAX_CTX_DEFAULT if max_ctx is None else int(max_ctx))
        if max_ctx < 1:
            raise Qat4Error(f"max_ctx is {max_ctx}; it must be at least 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise Qat4Error(f"prefill_chunk is {prefill_chunk}; it must be at least 1")
        cap = None
        if memory_cap_mib is not None:
            cap = _cap_memory(device, memory_cap_mib)
            _check_fits(packed, max_ctx, dtype, device, cap)
        if prefill_chunk is None:
            prefill_chunk = _auto_prefill_chunk(packed, max_ctx, dtype, device, cap)
        if tokenizer is None and packed.source is not None:
            tokenizer = _find_tokenizer(packed.source)
        try:
            model = Gemma4(packed, device, dtype, max_ctx)
            cache = KVCache(cfg, max_ctx, device, dtype)
            engine = cls(model, cache, prefill_chunk=prefill_chunk, cuda_graph=cuda_graph, tokenizer=tokenizer,
                         generation_config=packed.generation_config)
            if device.type == "cuda":
                saved = load_tilings(device, dtype)
                pin_matvec_tilings(saved)
                engine._reserve_workspace()
                launched = matvec_tilings()  # the decode step's GEMV shapes, captured just now
                engine.pinned_tilings = (sum(key in saved for key in launched), len(launched))
        except torch.cuda.OutOfMemoryError:
            raise Qat4Error(
                f"the model, a KV cache of {max_ctx} tokens and the prefill workspace for chunks of {prefill_chunk} "
                f"tokens do not fit in GPU memory{_cap_text(memory_cap_mib)}; lower max_ctx or prefill_chunk"
            ) from None
        return engine

    @torch.no_grad()
    def _reserve_workspace(self) -> None:
        """Run one prefill chunk at the deepest position and capture the greedy decode graph, so the
        caching allocator holds their peak working memory from load on; then forget the sequence.
        Afterwards :func:`matvec_tilings` lists the decode step's GEMV shapes (and no prefill ones)."""
        chunk = min(self.prefill_chunk, self.max_ctx)
        ids = torch.zeros(chunk, dtype=torch.int64, device=self.device)
        self.model.argmax(self.model.prefill(ids, self.max_ctx - chunk, self.cache)[-1:])
        forget_matvec_tilings()
        self.step.prepare(GREEDY)
        torch.cuda.synchronize(self.device)
        self.cache.reset()

    @torch.no_grad()
    def tune_decode(self, replays: int = 50) -> tuple[float, float, Path]:
        """Choose every decode GEMV's tiling by the greedy step's graph-replay time
        (:mod:`qat4.decode_tuning`), pin them and save them for this GPU, where later loads pick
        them up. Returns (µs per step before, after, the file). CUDA graphs only; forgets the sequence."""
        if not self.step.use_graph:
            raise Qat4Error("decode tuning times CUDA-graph replays; it needs a CUDA device with cuda_graph on")
        tilings, before, after = tune_decode_tilings(self.step, GREEDY, replays)
        self.step.graphs.clear()  # sampling graphs hold the tilings from before
        self.step.prepare(GREEDY)
        self.cache.reset()
        return before, after, save_tilings(tilings, self.device, self.dtype)

    @property
    def nbytes(self) -> dict[str, int]:
        """Device memory by part: weights and tables, KV cache."""
        return {"model": self.model.nbytes, "kv_cache": self.cache.nbytes}

    # ---- prompts and parameters --------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: text is encoded with exactly one leading <bos>; ids pass through."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Qat4Error("this model has no tokenizer; pass the prompt as token ids")
            bos = self.config.bos_token_id
            ids = list(self.tokenizer.encode(prompt))
            while ids and ids[0] == bos:
                ids.pop(0)
            ids = [bos, *ids]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise Qat4Error("the prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise Qat4Error(f"prompt token id {bad} is outside the vocabulary of {self.config.vocab_size}")
        return ids

    def sampling_params(self, temperature: float | None = None, top_k: int | None = None,
                        top_p: float | None = None) -> SamplingParams:
        """Fill unset options from the checkpoint's generation_config (then 1.0 / none / 1.0)."""
        gen = self.generation_config
        if temperature is None:
            temperature = 0.0 if gen.get("do_sample") is False else float(gen.get("temperature", 1.0))
        return SamplingParams(
            temperature=float(temperature),
            top_k=gen.get("top_k") if top_k is None else int(top_k),
            top_p=float(gen.get("top_p", 1.0) if top_p is None else top_p),
        )

    def _check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise Qat4Error(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
        if prompt_tokens + max_new_tokens > self.max_ctx:
            raise Qat4Error(
                f"the prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} is "
                f"{prompt_tokens + max_new_tokens} tokens, more than the context of {self.max_ctx} (max_ctx)"
            )

    # ---- forward -----------------------------------------------------------------------------

    def _prefill(self, ids: list[int], every_position: bool = False) -> torch.Tensor:
        """Read ids from position 0 in chunks of prefill_chunk -> final-normed hidden states:
        [len, D] with ``every_position``, else the last one [1, D]."""
        self.cache.reset()
        tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)
        kept = []
        for start in range(0, len(ids), self.prefill_chunk):
            h = self.model.prefill(tokens[start : start + self.prefill_chunk], start, self.cache)
            if every_position:
                kept.append(h)
        return torch.cat(kept) if every_position else h[-1:]

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Softcapped logits [len, V] fp32 of a fresh sequence, every position (one full prefill)."""
        ids = self.encode(list(token_ids))
        if len(ids) > self.max_ctx:
            raise Qat4Error(f"{len(ids)} tokens are more than the context of {self.max_ctx} (max_ctx)")
        return self.model.logits(self._prefill(ids, every_position=True))

    # ---- generation --------------------------------------------------------------------------

    def stream(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_token_ids: list[int] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Generated token ids, one at a time; a stop token is yielded and ends the stream.

        ``should_stop`` is called between tokens; returning True ends the stream (cancellation).
        Raises Qat4Error up front when the prompt plus max_new_tokens exceed max_ctx.
        """
        ids = self.encode(prompt)
        params = self.sampling_params(temperature, top_k, top_p)
        self._check_request(len(ids), max_new_tokens)
        return self._generate(ids, max_new_tokens, params, seed, stop_token_ids, should_stop, _Timing())

    @torch.no_grad()
    def _generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None,
                  stop_token_ids: list[int] | None, should_stop: Callable[[], bool] | None,
                  timing: _Timing) -> Iterator[int]:
        """The decode loop behind :meth:`stream` and :meth:`generate` (request already checked)."""
        stops = frozenset(DEFAULT_STOP_IDS if stop_token_ids is None else stop_token_ids)
        key = GREEDY if params.greedy else params.effective_top_k(self.config.vocab_size)
        step = self.step
        step.prepare(key)
        generator = None
        if not params.greedy:
            generator = torch.Generator(self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            step.temperature.fill_(params.temperature)
            step.top_p.fill_(params.top_p)

        def draw() -> None:
            if generator is not None:
                step.uniform.uniform_(0.0, 1.0, generator=generator)

        timing.started = time.perf_counter()
        draw()
        step.token.copy_(step.pick(self._prefill(ids), key))
        step.pos.fill_(len(ids))
        pending = self._reader.submit(step.token)
        for produced in range(1, max_new_tokens + 1):
            following = None
            if produced < max_new_tokens:  # enqueue the next step before reading this token back
                draw()
                step.run(key)
                following = self._reader.submit(step.token)
            token = self._reader.read(pending)
            timing.last = time.perf_counter()
            if produced == 1:
                timing.first = timing.last
            timing.steps = produced - 1
            yield token
            if token in stops or (should_stop is not None and should_stop()):
                return
            pending = following

    def generate(self, prompt: str | list[int], max_new_tokens: int = 256, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: list[str] | None = None, stop_token_ids: list[int] | None = None) -> Generation:
        """Generate up to ``max_new_tokens`` tokens; greedy when temperature is 0.

        Unset sampling options come from the checkpoint's generation_config. ``stop`` strings end
        the generation once the decoded text contains one (needs a tokenizer).
        """
        ids = self.encode(prompt)
        params = self.sampling_params(temperature, top_k, top_p)
        self._check_request(len(ids), max_new_tokens)
        stop = [s for s in (stop or []) if s]
        if stop and self.tokenizer is None:
            raise Qat4Error("stop strings need a tokenizer; this model has none")
        stop_ids = frozenset(DEFAULT_STOP_IDS if stop_token_ids is None else stop_token_ids)
        timing = _Timing()
        tokens: list[int] = []
        reason = "length"
        tail = max((len(s) for s in stop), default=0) + 8  # tokens enough to hold any stop string
        for token in self._generate(ids, max_new_tokens, params, seed, list(stop_ids), None, timing):
            if token in stop_ids:
                reason = "stop"
                break
            tokens.append(token)
            if stop and any(s in self.tokenizer.decode(tokens[-tail:]) for s in stop):
                reason = "stop"
                break
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        return Generation(
            tokens=tokens,
            text=text if cut < 0 else text[:cut],
            finish_reason=reason,
            prompt_tokens=len(ids),
            prefill_ms=(timing.first - timing.started) * 1e3,
            decode_ms=(timing.last - timing.first) * 1e3,
            decode_steps=timing.steps,
        )


# ---- memory ----------------------------------------------------------------------------------


def _cap_text(memory_cap_mib: float | None) -> str:
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


def _estimate_model_nbytes(packed: PackedModel, max_ctx: int, dtype: torch.dtype) -> int:
    """Device bytes of Gemma4(packed, ..., dtype, max_ctx) without allocating (RoPE tables at full width)."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    tensors = list(packed.tensors.values()) + ([packed.lm_head] if packed.lm_head is not None else [])
    for t in tensors:
        total += t.packed.numel() * 4 + t.scales.numel() * item if isinstance(t, PackedTensor) else t.numel() * item
    cfg = packed.config
    total += sum(max_ctx * cfg.layer_head_dim(cfg.layer_types.index(kind)) * item for kind in set(cfg.layer_types))
    return total


def _model_and_cache_nbytes(packed: PackedModel, max_ctx: int, dtype: torch.dtype) -> tuple[int, int]:
    """Estimated device bytes of the model and of a KV cache of max_ctx tokens."""
    return _estimate_model_nbytes(packed, max_ctx, dtype), KVCache.estimate_nbytes(packed.config, max_ctx, dtype)


def _free_nbytes(device: torch.device, cap: int | None) -> int:
    """Bytes this process may still allocate on a CUDA device: what the cap leaves, or without a
    cap what the GPU has free."""
    return cap - torch.cuda.memory_allocated(device) if cap is not None else torch.cuda.mem_get_info(device)[0]


def _auto_prefill_chunk(packed: PackedModel, max_ctx: int, dtype: torch.dtype, device: torch.device,
                        cap: int | None) -> int:
    """The largest of AUTO_PREFILL_CHUNKS (at most max_ctx) whose estimated working memory, plus the
    autotuner's reserve, fits in what the model and KV cache leave of the cap or of the GPU's free
    memory; else the smallest. 256 on the CPU."""
    smallest = min(AUTO_PREFILL_CHUNKS[-1], max_ctx)
    if device.type != "cuda":
        return smallest
    left = _free_nbytes(device, cap) - sum(_model_and_cache_nbytes(packed, max_ctx, dtype))
    fits = [c for c in AUTO_PREFILL_CHUNKS if c <= max_ctx and c * PREFILL_BYTES_PER_TOKEN + TUNING_RESERVE <= left]
    return fits[0] if fits else smallest


def _check_fits(packed: PackedModel, max_ctx: int, dtype: torch.dtype, device: torch.device, cap: int) -> None:
    """Raise Qat4Error before allocating when the weights and the KV cache alone exceed the cap."""
    model, cache = _model_and_cache_nbytes(packed, max_ctx, dtype)
    free = _free_nbytes(device, cap)
    if model + cache > free:
        raise Qat4Error(
            f"the model ({model / MIB:,.0f} MiB) and a KV cache of {max_ctx} tokens ({cache / MIB:,.0f} MiB) "
            f"need {(model + cache) / MIB:,.0f} MiB but memory_cap_mib leaves {free / MIB:,.0f} MiB; lower max_ctx"
        )


def _find_tokenizer(source: Path):
    """The tokenizer stored with a checkpoint (folder or .gguf file), or None when it has none."""
    from qat4.tokenizer import Tokenizer, load_tokenizer

    source = Path(source)
    try:
        return Tokenizer.from_gguf(source) if source.is_file() else load_tokenizer(source)
    except Qat4Error:
        return None
