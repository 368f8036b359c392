"""Writing an exact Q4_0 gemma4 GGUF that llama.cpp can load: write_gguf."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType

from qat4.checkpoint.gguf.container import TensorInfo, encode_header
from qat4.checkpoint.gguf.metadata import generation_metadata, model_metadata, n_rotated_pairs, tokenizer_metadata
from qat4.checkpoint.gguf.names import ROPE_FREQS, gguf_name
from qat4.checkpoint.gguf.q4_0 import packed_to_q4_0
from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.checkpoint.packed_model import Tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import PackedBlocks, PackedTensor, row_blocks
from qat4.checkpoint.source import AuxFiles
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

_ROPE_OFF = 1e30  # rope_freqs factor that keeps a frequency pair from rotating


@dataclass(frozen=True)
class _Planned:
    """One tensor of the file being written: canonical name, its GGUF entry, and whether it is Q4_0."""

    name: str
    info: TensorInfo

    @property
    def packed(self) -> bool:
        return self.info.type == GGMLQuantizationType.Q4_0


def _plan(config: Gemma4Config, names: Iterable[str]) -> dict[str, _Planned]:
    specs = expected_tensors(config)
    plan = {}
    for name in names:
        if name == LM_HEAD:
            shape, packed = (config.vocab_size, config.hidden_size), True
        elif name in specs:
            shape, packed = specs[name].shape, specs[name].packed
        else:
            raise Qat4Error(f"tensor {name} is not part of the Gemma 4 text model its config describes, so it has no place in a GGUF")
        kind = GGMLQuantizationType.Q4_0 if packed else GGMLQuantizationType.F32
        plan[name] = _Planned(name, TensorInfo(gguf_name(name), kind, tuple(shape)))
    return plan


def _tensor_bytes(item: _Planned, tensor: Tensor | PackedBlocks) -> Iterator[np.ndarray]:
    """The bytes of one planned tensor: Q4_0 blocks for a matrix, F32 for a dense tensor."""
    if item.packed != isinstance(tensor, (PackedTensor, PackedBlocks)):
        raise Qat4Error(f"tensor {item.name} should be {'a 4-bit matrix' if item.packed else 'a dense tensor'}")
    shape = tuple(tensor.shape)
    if shape != item.info.shape:
        raise Qat4Error(f"tensor {item.name} has shape {list(shape)}; the config expects {list(item.info.shape)}")
    if item.packed:
        row = 0
        for block in row_blocks(tensor):
            yield from packed_to_q4_0(block, item.name, row)
            row += block.rows
    else:
        yield tensor.detach().to(torch.float32).contiguous().numpy().reshape(-1).view(np.uint8)


def _write_at(out, offset: int, chunks: Iterable[np.ndarray], info: TensorInfo) -> None:
    """Write the chunks of one tensor at its offset and check they fill its declared size."""
    out.seek(offset)
    size = 0
    for chunk in chunks:
        out.write(memoryview(chunk))
        size += chunk.nbytes
    if size != info.nbytes:
        raise Qat4Error(f"tensor {info.name} produced {size} bytes where its GGUF entry declares {info.nbytes}")


def write_gguf(
    out_path: str | Path,
    config: Gemma4Config,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    aux: AuxFiles,
    progress: Callable[[str, int], None] | None = None,
) -> Path:
    """Write an exact Q4_0 gemma4 GGUF that llama.cpp can load.

    `tensors`: canonical text tensors. A mapping is written in its key order (`lm_head` included
    when present, as `output.weight`; values may be produced lazily, each fetched once); pairs may
    come in any order and must be the text tensors of `config`. k/v of KV-shared layers are
    skipped. Every matrix becomes Q4_0 with its trained step as fp16, norms and layer scalars F32,
    plus the generated `rope_freqs.weight`; metadata, tokenizer (from `aux.tokenizer_json`) and
    chat template follow llama.cpp's gemma4 converter. The header with every tensor info goes
    first, then each tensor's bytes at its offset, one tensor at a time;
    `progress(name, tensor bytes written so far)` follows each. The file is written under a
    temporary name beside `out_path` and renamed when complete.
    """
    out_path = Path(out_path)
    if not aux.tokenizer_json:
        raise Qat4Error(f"cannot write {out_path}: a GGUF carries its tokenizer and the source has no tokenizer.json")
    if isinstance(tensors, Mapping):
        names, items = [n for n in tensors if not is_unused_shared_kv(config, n)], tensors.items()
    else:
        names, items = list(expected_tensors(config)), tensors
    plan = _plan(config, names)
    freqs = np.full(config.global_head_dim // 2, _ROPE_OFF, np.float32)
    freqs[: n_rotated_pairs(config)] = 1.0
    rope_info = TensorInfo(ROPE_FREQS, GGMLQuantizationType.F32, freqs.shape)
    metadata = {**model_metadata(config), **tokenizer_metadata(aux.tokenizer_json, config), **generation_metadata(aux)}
    infos = [rope_info] + [p.info for p in plan.values()]
    header, offsets = encode_header(metadata, infos)
    offset_of = dict(zip(plan, offsets[1:]))

    partial = out_path.with_name(f".{out_path.name}.partial")
    try:
        with open(partial, "wb") as out:
            out.write(header)
            out.truncate(offsets[-1] + infos[-1].nbytes)
            _write_at(out, offsets[0], [freqs.view(np.uint8)], rope_info)
            written, done_bytes = set(), 0
            for name, tensor in items:
                if is_unused_shared_kv(config, name):
                    continue
                if name in written:
                    raise Qat4Error(f"tensor {name} was given twice for {out_path}")
                item = plan.get(name)
                if item is None:
                    raise Qat4Error(f"tensor {name} is not one of the text tensors planned for {out_path}")
                _write_at(out, offset_of[name], _tensor_bytes(item, tensor), item.info)
                written.add(name)
                done_bytes += item.info.nbytes
                if progress is not None:
                    progress(name, done_bytes)
            missing = [n for n in plan if n not in written]
            if missing:
                raise Qat4Error(f"no data was given for tensor {missing[0]} of {out_path}")
        os.replace(partial, out_path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise Qat4Error(f"cannot write {out_path}: {exc.strerror or exc}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return out_path
