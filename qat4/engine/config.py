"""How an engine is built: one options object instead of the same keyword list in every signature."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from qat4.errors import Qat4Error

MAX_CTX_DEFAULT = 131_072
BLOCK_SIZE_DEFAULT = 16
MAX_SPEC_TOKENS = 8
DRAFTERS = ("ngram", "mtp:PATH|ID")  # the speculative drafters: prompt lookup, Gemma 4's MTP assistant


MTP_PREFIX = "mtp:"


def check_drafter(spec: str, what: str) -> None:
    """Raise Qat4Error unless ``spec`` names a drafter: ``ngram``, or ``mtp:`` and a path or model id."""
    if spec != "ngram" and not (spec.startswith(MTP_PREFIX) and spec[len(MTP_PREFIX):].strip()):
        raise Qat4Error(f"{what} {spec!r} is not known; the choices are: {', '.join(DRAFTERS)}")


@dataclass(frozen=True)
class EngineConfig:
    """Options of :meth:`qat4.engine.Engine.load`; None means "work it out at load".

    dtype: compute dtype (fp32 on the CPU; bf16 on CUDA parts with a bf16 datapath, fp16 before).
    max_ctx: the longest sequence in tokens, prompt plus reply (default 131,072, at most the
    model's). max_num_seqs: sequences decoded together in one step (default 64 on CUDA, 8 on the
    CPU); fewer when the memory cap leaves no room for their sliding-window KV. prefill_chunk:
    prompt tokens read per step, over all the sequences reading a prompt (default on CUDA the
    largest of 4096 .. 256 whose working memory fits, 256 on the CPU); running sequences decode a
    token every step in between. kv_tokens: tokens the full-attention KV pool holds over all
    sequences (default max_ctx: one sequence of the whole context, or many shorter ones).
    block_size: tokens per KV block (a power of two). prompt_cache_mib: memory the sliding-window
    pool gets beyond what the running sequences need, so the prompt cache's restart windows
    survive beside them (:mod:`qat4.engine.prefix`; default 64 MiB, on CUDA as much of it as
    fits); 0 turns the prompt cache off. memory_cap_mib: on CUDA, cap this process's
    GPU memory before anything is allocated; the load fails with a clear message when the model
    and one sequence's KV do not fit. cuda_graph: replay decode steps as CUDA graphs (CUDA only).
    speculative: the drafter of speculative decoding (:mod:`qat4.engine.speculation`): "ngram"
    (prompt lookup) or "mtp:PATH" (Gemma 4's MTP drafter from a folder or Hub model id,
    :mod:`qat4.engine.mtp`); None: off. spec_tokens: the most draft tokens a sequence feeds per step (1 to
    8, default 4). spec_adaptive: pick each step's draft count from the measured step costs and
    acceptance (default); False drafts spec_tokens every step, for measurements. dense_weights:
    on CUDA with 16-bit tensor-core products, also keep a 16-bit copy of every layer matrix (3.75 GB
    in bf16 on E2B), which prompt steps (more than 128 rows) multiply with cuBLAS instead of
    expanding the packed words (:mod:`qat4.ops.w4.dispatch`). None (default): where the copies fit
    in the memory left over once everything else is planned; True: claimed with the model, before
    the KV pool, and the load fails with a clear message where they do not fit; False: never.
    """

    dtype: torch.dtype | None = None
    max_ctx: int | None = None
    max_num_seqs: int | None = None
    prefill_chunk: int | None = None
    kv_tokens: int | None = None
    block_size: int = BLOCK_SIZE_DEFAULT
    prompt_cache_mib: float | None = None
    memory_cap_mib: float | None = None
    cuda_graph: bool = True
    speculative: str | None = None
    spec_tokens: int = 4
    spec_adaptive: bool = True
    dense_weights: bool | None = None

    def __post_init__(self):
        for name in ("max_ctx", "max_num_seqs", "prefill_chunk", "kv_tokens"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                raise Qat4Error(f"{name} is {value}; it must be at least 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise Qat4Error(f"block_size is {self.block_size}; it must be a power of two")
        if self.prompt_cache_mib is not None and not self.prompt_cache_mib >= 0:
            raise Qat4Error(f"prompt_cache_mib is {self.prompt_cache_mib}; it must be 0 (off) or more")
        if self.speculative is not None:
            check_drafter(self.speculative, "speculative drafter")
        if not 1 <= self.spec_tokens <= MAX_SPEC_TOKENS:
            raise Qat4Error(f"spec_tokens is {self.spec_tokens}; it must be 1 to {MAX_SPEC_TOKENS}")
        if self.memory_cap_mib is not None and not self.memory_cap_mib > 0:
            raise Qat4Error(f"memory_cap_mib is {self.memory_cap_mib}; it must be positive")

    @property
    def mtp_source(self) -> str | None:
        """The MTP drafter's folder or model id, when ``speculative`` names one."""
        if self.speculative and self.speculative.startswith(MTP_PREFIX):
            return self.speculative[len(MTP_PREFIX):].strip()
        return None

    @classmethod
    def of(cls, config: "EngineConfig | None" = None, **options) -> "EngineConfig":
        """``config`` (or the defaults) with ``options`` set; an unknown option is a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise Qat4Error(f"unknown engine option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return replace(config or cls(), **options)
