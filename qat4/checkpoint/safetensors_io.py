"""Safetensors files and sharded folders: a streaming writer and a memory-mapped reader.

The writer lays out every header up front from (name, dtype, shape) entries, so tensor bytes can
follow one tensor (or one row chunk) at a time, in any order, without a model ever being held in
memory. Each file is written under a temporary name and renamed when complete. Above a size
threshold the tensors are split, in entry order, into `model-0000K-of-0000N.safetensors` files
plus `model.safetensors.index.json`, as transformers' `save_pretrained` does.

The reader opens one file or a folder (with or without an index) through `safetensors.safe_open`,
whose tensors are views of a memory map: nothing is read until it is touched, and integer tensors
(packed int4 words) come back as raw integers, never through a float conversion.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors import SafetensorError, safe_open

from qat4.errors import Qat4Error

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")

DTYPE_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}

TensorData = torch.Tensor | Iterable[torch.Tensor]  # a whole tensor, or its row chunks in order


@dataclass(frozen=True)
class Entry:
    """One tensor of a file being written: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


def shard_file_name(index: int, count: int) -> str:
    """`model-0000K-of-0000N.safetensors`, K counted from 1."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _split_shards(entries: Sequence[Entry], shard_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _header(entries: Sequence[Entry]) -> tuple[bytes, dict[str, int]]:
    """The length-prefixed JSON header (padded to 8 bytes) and each tensor's absolute offset."""
    table: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    starts = {}
    for e in entries:
        table[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        starts[e.name] = offset
        offset += e.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {name: base + start for name, start in starts.items()}


class _PartialFile:
    """One output file under a temporary name: header written, data slots filled by seek."""

    def __init__(self, path: Path, entries: Sequence[Entry]):
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        header, self.offsets = _header(entries)
        self.handle = open(self.partial, "wb")
        self.handle.write(header)
        self.handle.truncate(len(header) + sum(e.nbytes for e in entries))

    def write_at(self, offset: int, chunk: torch.Tensor) -> None:
        self.handle.seek(offset)
        self.handle.write(chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    def finish(self) -> None:
        self.handle.close()
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        self.handle.close()
        self.partial.unlink(missing_ok=True)


class SafetensorsWriter:
    """Write a set of tensors declared up front into `folder` as one file or index-linked shards.

    Use as a context manager: `write(name, data)` for every entry (whole tensor or an iterable of
    row chunks), in any order; leaving the block normally renames the files into place and writes
    the index; leaving it by an exception deletes the partial files.
    """

    def __init__(self, folder: str | Path, entries: Sequence[Entry], shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = Path(folder)
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise ValueError("duplicate tensor names in a safetensors layout")
        shards = _split_shards(entries, shard_bytes)
        names = [SINGLE_FILE] if len(shards) == 1 else [shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
        self.weight_map = {e.name: file for file, shard in zip(names, shards) for e in shard}
        self.files: dict[str, _PartialFile] = {}
        try:
            for file, shard in zip(names, shards):
                self.files[file] = _PartialFile(self.folder / file, shard)
        except OSError as exc:
            self._discard()
            raise Qat4Error(f"cannot write {self.folder}: {exc.strerror or exc}") from None
        self.written: set[str] = set()

    def write(self, name: str, data: TensorData) -> None:
        """Store the bytes of tensor `name`: one tensor, or row chunks that stack to its shape."""
        entry = self.entries.get(name)
        if entry is None:
            raise Qat4Error(f"tensor {name} is not declared in the layout of {self.folder}")
        if name in self.written:
            raise Qat4Error(f"tensor {name} was given twice for {self.folder}")
        file = self.files[self.weight_map[name]]
        offset = file.offsets[name]
        rows = 0
        for chunk in [data] if isinstance(data, torch.Tensor) else data:
            if chunk.dtype != entry.dtype or tuple(chunk.shape[1:]) != entry.shape[1:] or chunk.dim() != len(entry.shape):
                raise Qat4Error(
                    f"tensor {name} for {file.path} is {chunk.dtype} {list(chunk.shape)}; "
                    f"its layout says {entry.dtype} {list(entry.shape)}"
                )
            file.write_at(offset, chunk)
            offset += chunk.numel() * chunk.element_size()
            rows += chunk.shape[0] if chunk.dim() else 1
        if rows != (entry.shape[0] if entry.shape else 1):
            raise Qat4Error(f"tensor {name} for {file.path} got {rows} rows; its layout says {list(entry.shape)}")
        self.written.add(name)

    def close(self) -> None:
        """Check every declared tensor was written, then move the files into place."""
        missing = [name for name in self.entries if name not in self.written]
        if missing:
            raise Qat4Error(f"no data was given for tensor {missing[0]} of {self.folder / self.weight_map[missing[0]]}")
        for file in self.files.values():
            file.finish()
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(e.nbytes for e in self.entries.values())},
                "weight_map": dict(sorted(self.weight_map.items())),
            }
            write_text_atomic(self.folder / INDEX_FILE, json.dumps(index, indent=2) + "\n")

    def _discard(self) -> None:
        for file in self.files.values():
            file.discard()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self._discard()
                raise
        else:
            self._discard()


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, then rename it into place."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


class SafetensorsReader:
    """The tensors of one .safetensors file, or of a folder of them, memory-mapped.

    A folder with `model.safetensors.index.json` is read through its weight map; without one,
    every `*.safetensors` file in it is read. Errors name the file and the tensor.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.location = path
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._file_of: dict[str, Path] = {}
        self._weight_map: dict[str, str] = {}
        if path.is_file():
            files = [path]
        elif (path / INDEX_FILE).is_file():
            files = self._indexed_files(path)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise Qat4Error(f"{path} holds no .safetensors file")
        for file in files:
            handle = self._open(file)
            for key in handle.keys():
                if key in self._file_of:
                    raise Qat4Error(f"tensor {key} appears in both {self._file_of[key]} and {file}")
                self._file_of[key] = file
        if self._weight_map:
            self._check_index(path)

    def _indexed_files(self, folder: Path) -> list[Path]:
        index_path = folder / INDEX_FILE
        try:
            self._weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise Qat4Error(f"{index_path} is not a readable safetensors index ({exc})") from None
        files = sorted({folder / name for name in self._weight_map.values()})
        for file in files:
            if not file.is_file():
                raise Qat4Error(f"{file} is listed in {index_path} but does not exist")
        return files

    def _check_index(self, folder: Path) -> None:
        for key, name in self._weight_map.items():
            if self._file_of.get(key) != folder / name:
                raise Qat4Error(f"{folder / INDEX_FILE} places tensor {key} in {name}, which does not hold it")

    def _open(self, file: Path):
        try:
            handle = safe_open(str(file), framework="pt")
        except SafetensorError as exc:
            raise Qat4Error(f"{file} is not a readable safetensors file, perhaps truncated ({exc})") from None
        except OSError as exc:
            raise Qat4Error(f"cannot read {file}: {exc.strerror or exc}") from None
        self._handles[file] = handle
        return handle

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def file_of(self, key: str) -> Path:
        return self._file_of[key]

    def dtype(self, key: str) -> str:
        """The stored dtype code (`I32`, `BF16`, ...), from the header alone."""
        return self._handles[self._file_of[key]].get_slice(key).get_dtype()

    def shape(self, key: str) -> list[int]:
        """The stored shape, from the header alone."""
        return list(self._handles[self._file_of[key]].get_slice(key).get_shape())

    def rows(self, key: str) -> "RowSlices":
        """Tensor `key` read on demand a block of rows at a time, by plain file reads: neither a
        whole-tensor copy nor memory-mapped pages that stay resident."""
        file = self._file_of[key]
        if file not in self._headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        base, header = self._headers[file]
        info = header[key]
        dtype = next(t for t, code in DTYPE_CODES.items() if code == info["dtype"])
        return RowSlices(file, base + info["data_offsets"][0], dtype, info["shape"], f"tensor {key} in {file}")

    def get(self, key: str) -> torch.Tensor:
        """The tensor in its stored dtype, backed by the memory map until touched."""
        file = self._file_of[key]
        try:
            return self._handles[file].get_tensor(key)
        except SafetensorError as exc:
            raise Qat4Error(f"tensor {key} in {file} cannot be read ({exc})") from None


class RowSlices:
    """A stored tensor as `.shape`, `.dim()` and `[a:b]` row reads from its file: only the rows
    asked for are read, so a multi-gigabyte table passes through memory a block at a time."""

    def __init__(self, file: Path, offset: int, dtype: torch.dtype, shape: list[int], where: str):
        self._file, self._offset, self.dtype, self._where = file, offset, dtype, where
        self.shape = torch.Size(shape)

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        row_bytes = prod(self.shape[1:]) * self.dtype.itemsize
        want = max(0, stop - start) * row_bytes
        with open(self._file, "rb") as f:
            data = os.pread(f.fileno(), want, self._offset + start * row_bytes)
        if len(data) != want:
            raise Qat4Error(f"{self._where} is cut short: the file ends inside rows {start}..{stop - 1}")
        if not want:
            return torch.empty(0, *self.shape[1:], dtype=self.dtype)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(-1, *self.shape[1:])
