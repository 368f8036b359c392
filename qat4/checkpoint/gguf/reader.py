"""Reading a llama.cpp gemma4 GGUF into qat4's packed form: GGUFSource, a CheckpointSource."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from gguf import GGMLQuantizationType

from qat4.checkpoint.gguf.container import GGUFFile, TensorInfo
from qat4.checkpoint.gguf.metadata import config_from_gguf, generation_config_from_gguf
from qat4.checkpoint.gguf.names import canonical_name
from qat4.checkpoint.gguf.q4_0 import Q4_0_BLOCK_BYTES, q4_0_to_packed
from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.checkpoint.packed_model import Tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import GROUP, GridReport, PackedBlocks, PackedTensor, recover_grid, streamed
from qat4.checkpoint.source import AuxFiles
from qat4.errors import Qat4Error

_DENSE_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def _single_gguf(path: Path) -> Path:
    if not path.is_dir():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise Qat4Error(f"{path} holds {len(found)} .gguf files; name the one to read")
    return found[0]


class GGUFSource:
    """A llama.cpp gemma4 GGUF opened for reading (a CheckpointSource).

    Matrices stored as Q4_0 transcode exactly; matrices stored as F32/F16/BF16 are recovered onto
    the 4-bit grid (fp16 steps, as Q4_0 would hold them); any other type is refused when the file
    is opened, naming the tensor and its type. Norms and layer scalars come out in their stored
    dtype. Shapes are checked against the config when the file is opened.
    """

    format = "gguf"

    def __init__(self, path: str | Path):
        """`path`: a .gguf file, or a folder holding exactly one."""
        self.file = GGUFFile(_single_gguf(Path(path)))
        self.location = str(self.file.path)
        self.config = config_from_gguf(self.file)
        specs = expected_tensors(self.config)
        self._infos: dict[str, TensorInfo] = {}
        self._matrices: set[str] = set()
        for info in self.file.tensors.values():
            name = canonical_name(info.name)
            if name is None or is_unused_shared_kv(self.config, name):
                continue
            shape = (self.config.vocab_size, self.config.hidden_size) if name == LM_HEAD else specs[name].shape
            matrix = name == LM_HEAD or specs[name].packed
            if info.type not in _DENSE_TYPES and not (matrix and info.type == GGMLQuantizationType.Q4_0):
                raise Qat4Error(
                    f"tensor {info.name} in {self.location} is stored as {info.type.name}; qat4 reads matrices "
                    "from Q4_0 (exactly) or F32/F16/BF16 on the 4-bit grid, and other tensors from F32/F16/BF16"
                )
            if info.shape != tuple(shape):
                raise Qat4Error(f"tensor {info.name} in {self.location} has shape {list(info.shape)}; the config expects {list(shape)}")
            self._infos[name] = info
            if matrix:
                self._matrices.add(name)
        self._names = [n for n in [*specs, LM_HEAD] if n in self._infos]
        self._reports: dict[str, GridReport] = {}

    def names(self) -> list[str]:
        return list(self._names)

    def read(self, name: str) -> Tensor:
        info = self._infos.get(name)
        if info is None:
            raise Qat4Error(f"{self.location} has no tensor for {name}")
        if name not in self._matrices:
            tensor = self._dense(info).clone()
        elif info.type == GGMLQuantizationType.Q4_0:
            tensor = q4_0_to_packed(self.file.data(info), *info.shape, lambda n: self.file.release(info, n))
        else:
            tensor, self._reports[name] = recover_grid(self._dense(info), info.name, torch.float16)
        self.file.release(info)
        return tensor

    def read_blocks(self, name: str) -> Tensor | PackedBlocks:
        """As :meth:`read`, but a Q4_0 matrix large enough to be ``streamed`` comes as PackedBlocks
        converting one block of rows at a time (pages released as they are read)."""
        info = self._infos.get(name)
        if info is None or name not in self._matrices or info.type != GGMLQuantizationType.Q4_0 or not streamed(info.shape):
            return self.read(name)
        rows, cols = info.shape
        row_bytes = cols // GROUP * Q4_0_BLOCK_BYTES

        def convert(start: int, stop: int) -> PackedTensor:
            block = q4_0_to_packed(self.file.data(info)[start * row_bytes : stop * row_bytes], stop - start, cols)
            self.file.release(info, stop * row_bytes)
            return block

        return PackedBlocks(rows, cols, convert)

    def _dense(self, info: TensorInfo) -> torch.Tensor:
        """The stored values, a view of the memory map."""
        return torch.from_numpy(self.file.data(info)).view(_DENSE_TYPES[info.type]).reshape(info.shape)

    def grid_reports(self) -> dict[str, GridReport]:
        return dict(self._reports)

    def aux(self) -> AuxFiles:
        from qat4.tokenizer import build_tokenizer_json

        return AuxFiles(
            tokenizer_json=build_tokenizer_json(self.file.path),
            chat_template=self.file.get("tokenizer.chat_template"),
            generation_config=generation_config_from_gguf(self.file, self.config),
        )

    def iter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name in self._names:
            yield name, self.read(name)
