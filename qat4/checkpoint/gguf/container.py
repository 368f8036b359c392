"""The GGUF container (version 3, little-endian): parse a file's header, encode a new one.

A GGUF file is a header (magic, version, counts), metadata key/values, tensor infos (name, shape
innermost first, ggml type, offset relative to the data section), then the tensor data, each tensor
starting on an `general.alignment` boundary (32 by default).

The `gguf` package's GGUFReader turns every vocabulary string into its own array (about a minute
for Gemma 4's 262,144 tokens and 514,906 merges) and GGUFWriter packs arrays element by element
(about 13 s), so both directions are done here over a memory map and with bulk encoding; the
`gguf` package supplies the type codes and block sizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from qat4.errors import Qat4Error

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}

Value = tuple[GGUFValueType, Any]  # (type, value); an array is (ARRAY, (element type, values))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: shape in PyTorch order ([out, in] for a matrix) and its offset in the file."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return int(np.prod(self.shape, dtype=np.int64)) * size // block


@dataclass(frozen=True)
class _LazyArray:
    """A metadata array not decoded yet: element type, count and the offset of its first element."""

    type: GGUFValueType
    count: int
    offset: int


class GGUFFile:
    """A GGUF file's metadata and tensor directory, read from a memory map; arrays decode on first use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                # Copy-on-write: arrays over it are writable for torch, yet nothing is written back.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise Qat4Error(f"{self.path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise Qat4Error(f"{self.path} cannot be read as a GGUF file ({exc})") from None
        self._values: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise Qat4Error(f"{self.path} is not a readable GGUF file ({exc})") from None

    def _parse(self) -> None:
        if self._map[:4] != MAGIC:
            raise ValueError("no GGUF magic at the start")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise ValueError(f"version {version}, big-endian or unsupported")
        self._pos = 24
        for _ in range(n_kv):
            key = self._string()
            self._values[key] = self._value(GGUFValueType(self._scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            kind = GGMLQuantizationType(self._scalar("<I"))
            infos.append(TensorInfo(name, kind, tuple(reversed(ne)), self._scalar("<Q")))
        alignment = int(self._values.get("general.alignment", ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        for info in infos:
            placed = TensorInfo(info.name, info.type, info.shape, start + info.offset)
            if placed.offset + placed.nbytes > len(self._map):
                raise ValueError(f"tensor {info.name} runs past the end of the file")
            self.tensors[info.name] = placed

    def _scalar(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        self._pos += n
        return self._map[self._pos - n : self._pos].decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            value = np.frombuffer(self._map, _NUMPY[kind], 1, self._pos)[0].item()
            self._pos += np.dtype(_NUMPY[kind]).itemsize
            return value
        item = GGUFValueType(self._scalar("<I"))
        array = _LazyArray(item, self._scalar("<Q"), self._pos)
        if item == GGUFValueType.STRING:
            for _ in range(array.count):
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
        else:
            self._pos += array.count * np.dtype(_NUMPY[item]).itemsize
        return array

    def _decode(self, array: _LazyArray) -> list:
        if array.type != GGUFValueType.STRING:
            return np.frombuffer(self._map, _NUMPY[array.type], array.count, array.offset).tolist()
        out, pos, buf = [], array.offset, self._map
        for _ in range(array.count):
            (n,) = struct.unpack_from("<Q", buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        return out

    def keys(self) -> list[str]:
        return list(self._values)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (arrays as lists), or `default` when the key is absent."""
        value = self._values.get(key, default)
        if isinstance(value, _LazyArray):
            value = self._values[key] = self._decode(value)
        return value

    def require(self, key: str) -> Any:
        if key not in self._values:
            raise Qat4Error(f"{self.path} has no metadata key {key}")
        return self.get(key)

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, memory-mapped (uint8)."""
        return np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)

    def release(self, info: TensorInfo, nbytes: int | None = None) -> None:
        """Drop the pages of the tensor's first `nbytes` (all by default) from this process's memory
        once they have been copied out (they stay in the page cache); without this a streamed read
        would keep the whole file resident."""
        start = info.offset - info.offset % mmap.PAGESIZE
        end = info.offset + (info.nbytes if nbytes is None else nbytes)
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


# ---- encoding ------------------------------------------------------------------------------------


def _string_bytes(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value_bytes(kind: GGUFValueType, value: Any) -> bytes:
    head = struct.pack("<I", kind)
    if kind == GGUFValueType.STRING:
        return head + _string_bytes(value)
    if kind != GGUFValueType.ARRAY:
        return head + np.array(value, _NUMPY[kind]).tobytes()
    item, values = value
    head += struct.pack("<IQ", item, len(values))
    if item == GGUFValueType.STRING:
        return head + b"".join([_string_bytes(v) for v in values])
    return head + np.asarray(values, _NUMPY[item]).tobytes()


def encode_header(metadata: dict[str, Value], tensors: list[TensorInfo], alignment: int = ALIGNMENT) -> tuple[bytes, list[int]]:
    """The header bytes (padded to `alignment`) and each tensor's absolute offset in the file.

    Tensors are laid out in list order, each on an `alignment` boundary; their `offset` fields
    are ignored.
    """
    parts = [MAGIC, struct.pack("<IQQ", VERSION, len(tensors), len(metadata))]
    parts += [_string_bytes(key) + _value_bytes(*value) for key, value in metadata.items()]
    relative, pos = [], 0
    for t in tensors:
        relative.append(pos)
        ne = tuple(reversed(t.shape))
        parts.append(_string_bytes(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type, pos))
        pos += -(-t.nbytes // alignment) * alignment
    header = b"".join(parts)
    header += b"\0" * (-len(header) % alignment)
    return header, [len(header) + r for r in relative]
