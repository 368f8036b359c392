"""Open any supported checkpoint and load it as one PackedModel.

Formats (qat4.checkpoint.source.FORMATS): a `.gguf` file, or a folder holding one, is GGUF; a
folder with config.json and safetensors is compressed-tensors (`ct`, or `ct-emb4` when the token
table is packed) when config.json has a quantization_config, else Google's dense bf16 QAT layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qat4.checkpoint.compressed_tensors import CompressedTensorsSource
from qat4.checkpoint.hf_layout import LM_HEAD, read_json
from qat4.checkpoint.hub import resolve
from qat4.checkpoint.packed_model import PackedModel, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import PackedTensor
from qat4.checkpoint.qat_bf16 import QatBf16Source
from qat4.checkpoint.source import CheckpointSource
from qat4.errors import Qat4Error

Progress = Callable[[int, int, str], None]  # (tensors done, tensors in all, name just read)


def _family(path: Path) -> str:
    """`gguf`, `ct` or `qat-bf16`, from the file names and config.json alone."""
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        raise Qat4Error(f"{path} is not a checkpoint: expected a .gguf file or a folder with config.json and .safetensors files")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "ct" if "quantization_config" in read_json(path / "config.json") else "qat-bf16"
    if any(path.glob("*.gguf")):
        return "gguf"
    raise Qat4Error(f"{path} holds neither a .gguf file nor config.json with .safetensors files")


def open_checkpoint(path_or_id: str | Path) -> CheckpointSource:
    """A reader for a local checkpoint path or a Hub model id."""
    path = resolve(path_or_id)
    family = _family(path)
    if family == "gguf":
        from qat4.checkpoint.gguf.reader import GGUFSource

        return GGUFSource(path)
    return CompressedTensorsSource(path) if family == "ct" else QatBf16Source(path)


def detect_format(path: str | Path) -> str:
    """One of FORMATS for a local checkpoint (reads only headers and config.json)."""
    path = Path(path)
    family = _family(path)
    return CompressedTensorsSource(path).format if family == "ct" else family


def read_packed(source: CheckpointSource, progress: Progress | None = None) -> PackedModel:
    """Every text tensor of an open checkpoint as one validated PackedModel."""
    config = source.config
    expected = expected_tensors(config)
    names = [name for name in source.names() if not is_unused_shared_kv(config, name)]
    unexpected = [name for name in names if name not in expected and name != LM_HEAD]
    if unexpected:
        raise Qat4Error(f"{source.location} holds tensor {unexpected[0]}, which the Gemma 4 text model of its config does not have")
    missing = [name for name in expected if name not in names]
    if missing:
        raise Qat4Error(f"{source.location} has no tensor {missing[0]}")
    tensors = {}
    for done, name in enumerate(names, 1):
        tensors[name] = source.read(name)
        if progress is not None:
            progress(done, len(names), name)
    lm_head = tensors.pop(LM_HEAD, None)
    model = PackedModel(config, tensors, source=Path(source.location), generation_config=source.aux().generation_config)
    model.validate(source.location)
    if lm_head is not None:
        if not isinstance(lm_head, PackedTensor):
            raise Qat4Error(f"tensor {LM_HEAD} in {source.location} should be a 4-bit matrix")
        model.set_output_layer(lm_head)
    return model


def load_packed(path_or_id: str | Path, progress: Progress | None = None) -> PackedModel:
    """Load a checkpoint (local path or Hub model id) of any supported format as a PackedModel."""
    return read_packed(open_checkpoint(path_or_id), progress)
