"""Building an engine from a PackedModel (:meth:`Engine.from_packed <qat4.engine.Engine.from_packed>`).

:func:`build_engine` settles the device, finds the checkpoint's tokenizer, reads and checks the MTP
drafter's checkpoint before anything goes to the device, and plans the memory
(:mod:`qat4.engine.memory`); a build that runs out of GPU memory (the plan's estimate of the
working memory fell short) is tried again without the 16-bit weight copies the plan chose by
itself (``dense_weights`` None), then, without an explicit max_num_seqs, with half as many sequences.
Each build puts the model and the KV pool on the device, makes the engine, and on CUDA pins the
decode GEMV tilings saved for this GPU (:mod:`qat4.engine.tuning`) in the model's
:attr:`~qat4.model.Gemma4.tilings` before the warm-up
(:mod:`qat4.engine.warmup`); then it turns speculative decoding on with the drafter asked for.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from qat4.checkpoint.packed_model import PackedModel
from qat4.engine.config import EngineConfig
from qat4.engine.kv_cache import KVPool
from qat4.engine.memory import MIB, Plan, cap_text, dense_text, model_nbytes, plan
from qat4.engine.speculation import PromptLookup
from qat4.engine.tuning import tilings_for
from qat4.engine.warmup import reserve_workspace
from qat4.errors import Qat4Error
from qat4.model import Gemma4

if TYPE_CHECKING:
    from qat4.engine.engine import Engine


def build_engine(engine_class: type[Engine], packed: PackedModel, device: str | torch.device, config: EngineConfig,
                 tokenizer) -> Engine:
    """An ``engine_class`` over ``packed`` on ``device`` with ``config``; the tokenizer comes from
    ``packed.source`` when it has one, unless ``tokenizer`` is given."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tokenizer is None and packed.source is not None:
        from qat4.tokenizer import find_tokenizer

        tokenizer = find_tokenizer(packed.source)
    assistant = None
    if config.mtp_source is not None:  # read and checked before anything goes to the device
        from qat4.checkpoint.assistant import load_assistant

        assistant = load_assistant(config.mtp_source)
        assistant.config.check_target(packed.config, config.mtp_source)
    attempt = config
    while True:
        resolved = plan(packed, device, attempt, assistant)
        try:
            return _build(engine_class, packed, device, resolved, config, tokenizer, assistant)
        except torch.cuda.OutOfMemoryError:
            if resolved.dense and attempt.dense_weights is None:  # copies kept from the margin: given up first
                retry = EngineConfig.of(attempt, dense_weights=False)
            elif config.max_num_seqs is not None or resolved.max_num_seqs == 1:
                raise Qat4Error(
                    f"the model ({model_nbytes(packed, resolved.max_ctx, resolved.dtype) / MIB:,.0f} MiB), a KV pool of "
                    f"{resolved.kv_tokens} tokens for {resolved.max_num_seqs} sequences and the prefill workspace for "
                    f"chunks of {resolved.prefill_chunk} tokens do not fit in GPU memory"
                    f"{cap_text(config.memory_cap_mib)}{dense_text(resolved.dense, packed.config, resolved.dtype)}; "
                    f"lower max_ctx, max_num_seqs or prefill_chunk"
                ) from None
            else:  # half as many sequences
                retry = EngineConfig.of(attempt, max_num_seqs=resolved.max_num_seqs // 2)
        # the failed attempt's tensors are garbage once the exception is gone
        gc.collect()
        torch.cuda.empty_cache()
        attempt = retry


def _build(engine_class: type[Engine], packed: PackedModel, device: torch.device, resolved: Plan,
           config: EngineConfig, tokenizer, assistant=None) -> Engine:
    model = Gemma4(packed, device, resolved.dtype, resolved.max_ctx, expand=resolved.expand, dense=resolved.dense)
    pool = KVPool(packed.config, resolved.blocks, block_size=config.block_size,
                  max_seqs=resolved.max_num_seqs, max_ctx=resolved.max_ctx, device=device, dtype=resolved.dtype,
                  prompt_cache=resolved.prompt_cache, window=resolved.window)
    engine = engine_class(model, pool, resolved, cuda_graph=config.cuda_graph, tokenizer=tokenizer,
                          generation_config=packed.generation_config,
                          spec_tokens=config.spec_tokens if config.speculative else 0,
                          keep_hidden=assistant is not None)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the load's transient blocks: under a cap, reserved bytes count, not live ones
        saved, sources = tilings_for(device, resolved.dtype)
        model.tilings.pin(saved)
        reserve_workspace(engine)
        launched = model.tilings.launched()  # the decode steps' GEMV shapes, captured just now
        engine.pinned_tilings = (sum(key in saved for key in launched), len(launched), sources)
    if assistant is not None:
        from qat4.assistant import Gemma4Assistant
        from qat4.engine.mtp import MTPDrafter

        engine.assistant = Gemma4Assistant(assistant, model, resolved.max_ctx)
        drafter = MTPDrafter(engine.assistant, engine.runner, engine.spec_sizes, engine.spec_tokens)
        drafter.prepare()
        engine.enable_speculation(drafter, config.spec_adaptive)
    elif config.speculative:
        engine.enable_speculation(PromptLookup(), config.spec_adaptive)
    return engine
