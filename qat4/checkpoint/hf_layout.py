"""Transformers-style checkpoint folders, shared by the compressed-tensors and bf16 QAT formats.

A folder holds `config.json`, safetensors files and the aux files (tokenizer, chat template,
generation config). Text tensors sit under a prefix (`model.language_model.` in Google's files
and the text-only repacks); every pattern is anchored on it, so vision and audio tower tensors,
which have their own `layers.N.self_attn` names, are never mistaken for text tensors. A matrix is
stored either dense (`<name>.weight`) or packed (`<name>.weight_packed`, `.weight_scale`,
`.weight_shape`), decided per tensor. `layers.N.layer_scalar` has no `.weight` suffix.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from qat4.checkpoint.packed_model import Tensor, TensorSpec, check_tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import (
    GROUP, PER_WORD, GridReport, PackedBlocks, PackedTensor, dequantize, recover_grid, row_blocks, streamed,
)
from qat4.checkpoint.safetensors_io import DEFAULT_SHARD_BYTES, Entry, SafetensorsReader, SafetensorsWriter, write_text_atomic
from qat4.checkpoint.source import AuxFiles
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

TEXT_PREFIXES = ("model.language_model.", "language_model.", "model.")
WRITE_PREFIX = "model.language_model."
LM_HEAD = "lm_head"
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape")
UNSUPPORTED_PARTS = ("weight_zero_point", "weight_g_idx")
RECOVERED_SCALE_DTYPE = torch.float16  # fp16 steps reproduce more bf16 values exactly than bf16 steps
TRANSFORMERS_VERSION = "5.17.0"
TOWER_IGNORE = "re:^model\\.(vision_tower|audio_tower|embed_vision|embed_audio)\\."

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
EXTRA_AUX_FILES = ("tokenizer_config.json", "special_tokens_map.json")


# ---- config.json and aux files ----------------------------------------------------------------


def read_json(path: Path) -> dict:
    """A JSON object from a file; a Qat4Error naming the file when it is missing or malformed."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise Qat4Error(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Qat4Error(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise Qat4Error(f"{path} does not hold a JSON object")
    return value


def write_json(path: Path, value: dict) -> None:
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_aux(folder: Path) -> AuxFiles:
    """Tokenizer, chat template (the .jinja file, else tokenizer_config's), generation config."""
    aux = AuxFiles()
    if (folder / TOKENIZER_FILE).is_file():
        aux.tokenizer_json = (folder / TOKENIZER_FILE).read_text()
    if (folder / GENERATION_CONFIG_FILE).is_file():
        aux.generation_config = read_json(folder / GENERATION_CONFIG_FILE)
    for name in EXTRA_AUX_FILES:
        if (folder / name).is_file():
            aux.extra[name] = (folder / name).read_bytes()
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        aux.chat_template = (folder / CHAT_TEMPLATE_FILE).read_text()
    elif "tokenizer_config.json" in aux.extra:
        template = read_json(folder / "tokenizer_config.json").get("chat_template")
        aux.chat_template = template if isinstance(template, str) else None
    return aux


def write_aux(folder: Path, aux: AuxFiles) -> None:
    if aux.tokenizer_json is not None:
        (folder / TOKENIZER_FILE).write_text(aux.tokenizer_json)
    if aux.chat_template is not None:
        (folder / CHAT_TEMPLATE_FILE).write_text(aux.chat_template)
    if aux.generation_config:
        write_json(folder / GENERATION_CONFIG_FILE, aux.generation_config)
    for name, data in aux.extra.items():
        (folder / name).write_bytes(data)


def text_config_dict(config: Gemma4Config, tie: bool) -> dict:
    """The text config as Google spells it, with the given tie flag."""
    return {**config.to_hf_text_dict(), "tie_word_embeddings": tie}


def causal_lm_config(config: Gemma4Config, tie: bool) -> dict:
    """config.json of a text-only repack: the text config at the top level."""
    return {
        **text_config_dict(config, tie),
        "architectures": ["Gemma4ForCausalLM"],
        "dtype": "bfloat16",
        "transformers_version": TRANSFORMERS_VERSION,
    }


def conditional_generation_config(config: Gemma4Config, tie: bool) -> dict:
    """config.json in Google's multimodal layout: the text config nested in `text_config`."""
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config_dict(config, tie),
        "tie_word_embeddings": tie,
        "dtype": "bfloat16",
        "transformers_version": TRANSFORMERS_VERSION,
    }


# ---- names -------------------------------------------------------------------------------------


def find_text_prefix(keys: Iterable[str], location: Path) -> str:
    """The prefix of the text tensors, probed by where `embed_tokens` is stored."""
    keys = set(keys)
    for prefix in TEXT_PREFIXES:
        if any(prefix + "embed_tokens." + part in keys for part in ("weight", "weight_packed")):
            return prefix
    raise Qat4Error(f"{location} has no embed_tokens tensor under any of the prefixes {', '.join(TEXT_PREFIXES)}")


def split_key(key: str) -> tuple[str, str]:
    """Stored key without prefix -> (canonical name, part): `weight`, `weight_packed`, ..."""
    base, _, last = key.rpartition(".")
    if base and last.startswith("weight"):
        return base, last
    return key, "weight"  # layer_scalar: the tensor is the name itself


def stored_key(base: str, part: str) -> str:
    """The key of one part of a stored tensor (`layer_scalar` is stored without a suffix)."""
    if part == "weight" and base.endswith("layer_scalar"):
        return base
    return f"{base}.{part}"


def tensor_specs(config: Gemma4Config) -> dict[str, TensorSpec]:
    """Expected tensors plus an optional untied output layer."""
    specs = expected_tensors(config)
    specs[LM_HEAD] = specs["embed_tokens"]
    return specs


# ---- reading -----------------------------------------------------------------------------------


class SafetensorsFolderSource:
    """A transformers-style folder read tensor by tensor, under canonical text names.

    Packed matrices come out as stored (validated); dense matrices are recovered onto the 4-bit
    grid (a GridReport kept for each); norms and scalars come out dense in their stored dtype.
    """

    format: str  # set by each format's subclass

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.location = str(self.folder)
        self.raw_config = read_json(self.folder / "config.json")
        self.config = Gemma4Config.from_hf_dict(self.raw_config, source=str(self.folder / "config.json"))
        self.files = SafetensorsReader(self.folder)
        self.prefix = find_text_prefix(self.files.keys(), self.folder)
        self._parts = self._index_parts()
        self._specs = tensor_specs(self.config)
        self._reports: dict[str, GridReport] = {}

    def _index_parts(self) -> dict[str, dict[str, str]]:
        parts: dict[str, dict[str, str]] = {}
        for key in self.files.keys():
            if key.startswith(self.prefix):
                name, part = split_key(key[len(self.prefix):])
            elif key.startswith(LM_HEAD + "."):
                name, part = LM_HEAD, split_key(key)[1]
            else:
                continue  # vision / audio towers and anything else outside the text model
            parts.setdefault(name, {})[part] = key
        for name, found in parts.items():
            self._check_parts(name, found)
        return parts

    def _check_parts(self, name: str, found: dict[str, str]) -> None:
        key = next(iter(found.values()))
        file = self.files.file_of(key)
        odd = [p for p in found if p in UNSUPPORTED_PARTS or p not in (*PACKED_PARTS, "weight")]
        if odd:
            raise Qat4Error(f"tensor {found[odd[0]]} in {file} is not supported: qat4 reads symmetric 4-bit weights without activation order")
        if "weight" in found and len(found) > 1:
            raise Qat4Error(f"tensor {name} in {file} is stored both dense and packed")
        missing = [p for p in PACKED_PARTS if p not in found]
        if "weight" not in found and missing:
            raise Qat4Error(f"packed tensor {key.rsplit('.', 1)[0]} in {file} lacks its {missing[0]}")

    def names(self) -> list[str]:
        return list(self._parts)

    def is_packed(self, name: str) -> bool:
        return "weight_packed" in self._parts[name]

    def read(self, name: str) -> Tensor:
        found, spec = self._found(name)
        if "weight_packed" in found:
            packed_key, scale_key, _, _ = self._packed_parts(found, spec)
            return PackedTensor(self.files.get(packed_key), self.files.get(scale_key))
        key = found["weight"]
        self._check_dense_shape(key, spec)
        if spec is not None and spec.packed:
            packed, report = recover_grid(self.files.rows(key), f"{key} in {self.files.file_of(key)}", RECOVERED_SCALE_DTYPE)
            report.name = key
            self._reports[name] = report
            return packed
        return self.files.get(key)

    def read_blocks(self, name: str) -> Tensor | PackedBlocks:
        """As :meth:`read`, but a 4-bit matrix large enough to be ``streamed`` comes as PackedBlocks
        that read (and, from 16-bit values, recover) one block of rows at a time."""
        found, spec = self._found(name)
        if spec is None or not spec.packed or not streamed(spec.shape):
            return self.read(name)
        if "weight_packed" in found:
            packed_key, scale_key, rows, cols = self._packed_parts(found, spec)
            words, steps = self.files.rows(packed_key), self.files.rows(scale_key)
            return PackedBlocks(rows, cols, lambda start, stop: PackedTensor(words[start:stop], steps[start:stop]))
        key = found["weight"]
        self._check_dense_shape(key, spec)
        values, where = self.files.rows(key), f"{key} in {self.files.file_of(key)}"

        def recover(start: int, stop: int) -> PackedTensor:
            if start == 0:  # a new pass over the matrix
                self._reports[name] = GridReport(key)
            packed, report = recover_grid(values[start:stop], where, RECOVERED_SCALE_DTYPE, row0=start)
            self._reports[name].add(report)
            return packed

        return PackedBlocks(*spec.shape, recover)

    def _found(self, name: str) -> tuple[dict[str, str], TensorSpec | None]:
        found = self._parts.get(name)
        if found is None:
            raise Qat4Error(f"{self.location} has no tensor {name}")
        return found, self._specs.get(name)

    def _check_dense_shape(self, key: str, spec: TensorSpec | None) -> None:
        shape = self.files.shape(key)
        if spec is not None and tuple(shape) != spec.shape:
            raise Qat4Error(f"tensor {key} in {self.files.file_of(key)} has shape {shape}; the config expects {list(spec.shape)}")

    def _packed_parts(self, found: dict[str, str], spec: TensorSpec | None) -> tuple[str, str, int, int]:
        """(words key, steps key, rows, cols) of a packed tensor, its shape record and parts checked."""
        packed_key, scale_key, shape_key = (found[p] for p in PACKED_PARTS)
        shape = self.files.get(shape_key)
        if shape.dtype not in (torch.int32, torch.int64) or tuple(shape.shape) != (2,):
            raise Qat4Error(f"tensor {shape_key} in {self.files.file_of(shape_key)} should hold two integers [rows, cols]")
        rows, cols = (int(v) for v in shape.tolist())
        if spec is not None and (rows, cols) != spec.shape:
            raise Qat4Error(
                f"tensor {shape_key} in {self.files.file_of(shape_key)} says [{rows}, {cols}]; the config expects {list(spec.shape)}"
            )
        if cols % GROUP:
            raise Qat4Error(f"tensor {shape_key} in {self.files.file_of(shape_key)} has {cols} columns, not a multiple of {GROUP}")
        self._expect(packed_key, ("I32",), [rows, cols // PER_WORD])
        self._expect(scale_key, ("BF16", "F16"), [rows, cols // GROUP])
        return packed_key, scale_key, rows, cols

    def _expect(self, key: str, dtypes: tuple[str, ...], shape: list[int]) -> None:
        dtype, got = self.files.dtype(key), self.files.shape(key)
        if dtype not in dtypes or got != shape:
            raise Qat4Error(
                f"tensor {key} in {self.files.file_of(key)} is {dtype} {got}; expected {' or '.join(dtypes)} {shape}"
            )

    def grid_reports(self) -> dict[str, GridReport]:
        return dict(self._reports)

    def aux(self) -> AuxFiles:
        return read_aux(self.folder)

    def iter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for name in self.names():
            yield name, self.read(name)


# ---- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """How one canonical tensor is stored: under `key` (no part suffix), packed with steps in
    `scale_dtype`, or dense bf16 when `scale_dtype` is None."""

    key: str
    spec: TensorSpec
    scale_dtype: torch.dtype | None = None

    def entries(self) -> list[Entry]:
        if self.scale_dtype is None:
            return [Entry(self._key("weight"), torch.bfloat16, self.spec.shape)]
        rows, cols = self.spec.shape
        return [
            Entry(self._key("weight_packed"), torch.int32, (rows, cols // PER_WORD)),
            Entry(self._key("weight_scale"), self.scale_dtype, (rows, cols // GROUP)),
            Entry(self._key("weight_shape"), torch.int64, (2,)),
        ]

    def _key(self, part: str) -> str:
        return stored_key(self.key, part)

    def encode(self, tensor: Tensor | PackedBlocks) -> Iterator[tuple[str, torch.Tensor | Iterator[torch.Tensor]]]:
        """(stored key, data) pairs for the writer, consumed in order; matrices come in row blocks
        (whole or PackedBlocks alike): dense 16-bit values, or the words, whose steps (1/4 the
        size) are gathered while the words stream and written next."""
        if not isinstance(tensor, (PackedTensor, PackedBlocks)):
            yield self._key("weight"), tensor.to(torch.bfloat16)
        elif self.scale_dtype is None:
            yield self._key("weight"), dense_chunks(tensor, torch.bfloat16)
        else:
            steps = torch.empty(tensor.rows, tensor.cols // GROUP, dtype=self.scale_dtype)

            def words() -> Iterator[torch.Tensor]:
                row = 0
                for block in row_blocks(tensor):
                    steps[row : row + block.rows] = block.scales
                    row += block.rows
                    yield block.packed

            yield self._key("weight_packed"), words()
            yield self._key("weight_scale"), steps
            yield self._key("weight_shape"), torch.tensor(tensor.shape, dtype=torch.int64)


def dense_chunks(tensor: PackedTensor | PackedBlocks, dtype: torch.dtype, chunk_elements: int = 1 << 22) -> Iterator[torch.Tensor]:
    """The dequantised matrix, a block of rows at a time (exact for on-grid 16-bit values)."""
    step = max(1, chunk_elements // tensor.cols)
    for block in row_blocks(tensor):
        for start in range(0, block.rows, step):
            yield dequantize(block.packed[start : start + step], block.scales[start : start + step], dtype)


@contextmanager
def staged_folder(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling folder that replaces `out_dir` only when the block completes."""
    if out_dir.exists() and not overwrite:
        raise Qat4Error(f"{out_dir} already exists; pass --force to replace it")
    stage = out_dir.with_name(f".{out_dir.name}.partial")
    try:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        yield stage
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old")
            if old.exists():
                _remove(old)
            out_dir.rename(old)
            stage.rename(out_dir)
            _remove(old)
        else:
            stage.rename(out_dir)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise Qat4Error(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def write_folder(
    out_dir: str | Path,
    config: Gemma4Config,
    config_json: dict,
    plan: Mapping[str, list[Stored]],
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    aux: AuxFiles,
    *,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write config.json, aux files and safetensors laid out by `plan` (canonical name -> how it
    is stored; one name may be stored twice, e.g. emb4's lm_head copy), streaming `tensors`."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    entries = [entry for stores in plan.values() for store in stores for entry in store.entries()]
    with staged_folder(Path(out_dir), overwrite) as stage:
        write_json(stage / "config.json", config_json)
        write_aux(stage, aux)
        with SafetensorsWriter(stage, entries, shard_bytes) as writer:
            given = set()
            for name, tensor in items:
                stores = plan.get(name)
                if stores is None:
                    if is_unused_shared_kv(config, name):
                        continue
                    if name == LM_HEAD:
                        raise Qat4Error("tensor lm_head cannot be written: this layout's output layer is embed_tokens (emb4 stores its copy)")
                    raise Qat4Error(f"tensor {name} is not part of the Gemma 4 text model its config describes, so it cannot be written")
                check_tensor(name, tensor, stores[0].spec)
                for store in stores:
                    for key, data in store.encode(tensor):
                        writer.write(key, data)
                given.add(name)
            missing = [name for name in plan if name not in given]
            if missing:
                raise Qat4Error(f"tensor {missing[0]} was not given, so {out_dir} cannot be written")


def text_plan(config: Gemma4Config, packed_scale: Callable[[str], torch.dtype | None]) -> dict[str, list[Stored]]:
    """Every text tensor under WRITE_PREFIX; matrices packed with `packed_scale(name)` steps, or
    dense bf16 where it returns None; norms and scalars dense bf16."""
    return {
        name: [Stored(WRITE_PREFIX + name, spec, packed_scale(name) if spec.packed else None)]
        for name, spec in expected_tensors(config).items()
    }
