"""Repack a checkpoint of any format into compressed-tensors (`ct`, `ct-emb4`) or an exact Q4_0 GGUF.

The repack streams: tensors are read from the source one at a time in canonical order, handed to
the writer and dropped, and a matrix above `packing.STREAM_BYTES` of codes (the per-layer table)
passes as a block of rows at a time, so memory holds a few hundred megabytes, never the model. Codes
and steps pass through unchanged; a 16-bit source is recovered onto the grid and the first
off-grid group aborts the run, naming tensor and group. A step the output cannot store exactly
(Q4_0 and emb4 tables hold fp16, `ct` linears bf16 unless `scale_dtype` says otherwise) also
aborts, naming tensor, row and group.

Everything is written inside a temporary folder beside the output. Before it is moved into place,
the written checkpoint is opened again and checked: the same config and tensor names, every norm
and scalar, and the codes and steps of a sample of matrices equal to the source's. Any failure,
including an interrupt, removes the temporary folder, so a run leaves either a checkpoint that
loads back or nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

import torch

from qat4.checkpoint import REPACK_TARGETS as TARGETS
from qat4.checkpoint.compressed_tensors import TABLES, write_ct
from qat4.checkpoint.gguf.writer import write_gguf
from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.checkpoint.loader import open_checkpoint
from qat4.checkpoint.packed_model import Tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import GridReport, PackedBlocks, PackedTensor, require_exact_steps, row_blocks
from qat4.checkpoint.source import CheckpointSource
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error

SAMPLE_MATRICES = 6  # matrices re-read and compared after writing, besides every norm and scalar

Progress = Callable[[int, int, str, int], None]  # (tensors written, tensors in all, name, bytes on disk)


@dataclass
class RepackResult:
    """What a repack wrote: the output path, its tensor count (the text tensors it holds, an lm_head
    copy included, as `verify` counts them), size, and the source's grid fidelity."""

    out: Path
    format: str
    tensors: int
    bytes: int
    recovered: GridReport | None  # values of 16-bit source matrices the stored levels x steps reproduce exactly


def step_dtypes(to: str, scale_dtype: torch.dtype | None) -> Callable[[str], torch.dtype | None]:
    """name -> the dtype the output stores that matrix's steps in (None: stored dense, no steps).

    For ct/ct-emb4 this is write_ct's documented rule: `scale_dtype` for every packed matrix, or,
    when None, bf16 linears and fp16 emb4 tables; `ct` stores the tables dense bf16.
    """
    def step_dtype(name: str) -> torch.dtype | None:
        if to == "gguf":
            return torch.float16
        if name not in (*TABLES, LM_HEAD):
            return scale_dtype or torch.bfloat16
        return (scale_dtype or torch.float16) if to == "ct-emb4" else None

    return step_dtype


def default_scale_dtype(source: CheckpointSource) -> torch.dtype | None:
    """The ct step dtype that keeps the source's steps exactly: the published mix (None: bf16
    linears, fp16 tables) when the source's linears have bf16 steps, else fp16 throughout."""
    probe = next(n for n, spec in expected_tensors(source.config).items() if spec.packed and n.startswith("layers."))
    return None if source.read(probe).scales.dtype == torch.bfloat16 else torch.float16


def text_names(source: CheckpointSource) -> list[str]:
    """The source's text tensors in canonical order (lm_head last, when present); raises naming
    the first tensor missing or foreign to its config."""
    expected = expected_tensors(source.config)
    names = {n for n in source.names() if not is_unused_shared_kv(source.config, n)}
    missing = [n for n in expected if n not in names]
    if missing:
        raise Qat4Error(f"{source.location} has no tensor {missing[0]}")
    foreign = sorted(names - set(expected) - {LM_HEAD})
    if foreign:
        raise Qat4Error(f"{source.location} holds tensor {foreign[0]}, which the Gemma 4 text model of its config does not have")
    return [*expected, *([LM_HEAD] if LM_HEAD in names else [])]


def lm_head_differs(source: CheckpointSource) -> bool:
    """Whether the source's lm_head holds other codes or steps than its embed_tokens."""
    return fingerprint(source.read(LM_HEAD)) != fingerprint(source.read("embed_tokens"))


def fingerprint(tensor: Tensor | PackedBlocks) -> tuple[str, str]:
    """Digests of a tensor's shape and content: (codes, steps as fp32) for a 4-bit matrix, (values as
    fp32, "") for a dense tensor. Equal digests mean equal codes and steps whatever the dtypes, and
    whether the matrix comes whole or in blocks."""
    codes, steps = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)

    def add(h, part: torch.Tensor) -> None:
        h.update(part.contiguous().reshape(-1).view(torch.uint8).numpy())

    add(codes, torch.tensor(tuple(tensor.shape), dtype=torch.int64))
    if not isinstance(tensor, (PackedTensor, PackedBlocks)):
        add(codes, tensor.to(torch.float32))
        return codes.hexdigest(), ""
    for block in row_blocks(tensor):
        add(codes, block.packed)
        add(steps, block.scales.to(torch.float32))
    return codes.hexdigest(), steps.hexdigest()


class _Streamed(Mapping):
    """The source's tensors under canonical names, each read when the writer asks for it: steps
    checked against the dtype the output stores them in, fingerprints kept for `sample`."""

    def __init__(self, source: CheckpointSource, names: list[str], sample: set[str],
                 step_dtype: Callable[[str], torch.dtype | None], consequence: str, on_read: Callable[[str], None]):
        self._source, self._names, self._sample = source, names, sample
        self._step_dtype, self._consequence, self._on_read = step_dtype, consequence, on_read
        self.fingerprints: dict[str, tuple[str, str]] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self._source.read_blocks(name)
        dtype = self._step_dtype(name)
        if isinstance(tensor, PackedBlocks) and dtype is not None:
            tensor = self._checked_blocks(tensor, name, dtype)
        elif isinstance(tensor, PackedTensor) and dtype is not None:
            require_exact_steps(tensor.scales, dtype, name, self._consequence)
        if name in self._sample:
            self.fingerprints[name] = fingerprint(tensor)
        self._on_read(name)
        return tensor

    def _checked_blocks(self, tensor: PackedBlocks, name: str, dtype: torch.dtype) -> PackedBlocks:
        """The same blocks, each one's steps checked against `dtype` as it is read."""

        def read_rows(start: int, stop: int) -> PackedTensor:
            block = tensor.read_rows(start, stop)
            require_exact_steps(block.scales, dtype, name, self._consequence, row0=start)
            return block

        return PackedBlocks(tensor.rows, tensor.cols, read_rows)


def _disk_bytes(folder: Path) -> int:
    """Bytes allocated on disk under `folder` (sparse, pre-sized files count what is written)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(folder) for f in files)


def _same_model(a: Gemma4Config, b: Gemma4Config) -> bool:
    """Configs equal in everything but the tie flag and stop ids, which formats spell differently."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name not in ("tie_word_embeddings", "eos_token_id"))


def sample_names(names: list[str], config: Gemma4Config, step_dtype: Callable[[str], torch.dtype | None]) -> set[str]:
    """What the read-back check compares: every dense tensor, embed_tokens and a spread of the other
    matrices; a matrix the output stores dense only when it is embed_tokens (re-recovering the
    per-layer table from 16-bit values would cost as much as the repack)."""
    specs = expected_tensors(config)
    matrices = [n for n in names if n == LM_HEAD or specs[n].packed]
    spread = [n for n in matrices if step_dtype(n) is not None]
    picks = {spread[round(i * (len(spread) - 1) / (SAMPLE_MATRICES - 1))] for i in range(SAMPLE_MATRICES)}
    return {n for n in names if n in picks or n == "embed_tokens" or n not in matrices}


def check_written(path: Path, source: CheckpointSource, names: list[str], fingerprints: dict[str, tuple[str, str]]) -> int:
    """Open the written checkpoint and compare it with what was read from the source: model
    config, tensor names, and the fingerprints of the sampled tensors (an lm_head the output
    adds against embed_tokens). Steps of a matrix the output stores dense are re-recovered from
    16-bit values, so there only the codes must match. Raises Qat4Error at the first difference;
    returns how many text tensors the written checkpoint holds."""
    written = open_checkpoint(path)
    if not _same_model(written.config, source.config):
        raise Qat4Error(f"the written {path} reads back with another model config than {source.location}")
    got = [n for n in written.names() if not is_unused_shared_kv(written.config, n)]
    odd = sorted((set(got) - set(names) - {LM_HEAD}) | (set(names) - set(got)))  # emb4 may add an lm_head copy
    if odd:
        raise Qat4Error(f"the written {path} reads back with other tensors than {source.location}, {odd[0]} first")
    checks = dict(fingerprints)
    if LM_HEAD in got and LM_HEAD not in names:
        checks[LM_HEAD] = fingerprints["embed_tokens"]
    for name, (codes, steps) in checks.items():
        got_codes, got_steps = fingerprint(written.read_blocks(name))
        if got_codes != codes or (got_steps != steps and name not in written.grid_reports()):
            raise Qat4Error(f"tensor {name} of the written {path} does not read back equal to {source.location}")
    return len(got)


def _move_into_place(built: Path, out: Path, stage: Path) -> None:
    """Rename `built` to `out`; an existing `out` is first moved into `stage` (removed with it)."""
    replaced = stage / ".replaced"
    if out.exists() or out.is_symlink():
        os.rename(out, replaced)
    try:
        os.rename(built, out)
    except OSError:
        if replaced.exists():
            os.rename(replaced, out)
        raise


def repack(
    src: str | Path,
    out: str | Path,
    to: str,
    *,
    text_only: bool = False,
    scale_dtype: torch.dtype | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> RepackResult:
    """Repack `src` (any format; a path or Hub model id) into `out` as `to` (one of TARGETS).

    `scale_dtype`: the step dtype of a ct/ct-emb4 output; None keeps the source's steps exactly
    (the published mix when the source's linears have bf16 steps, fp16 otherwise). `text_only`: write the text-only config
    layout (Gemma4ForCausalLM at the top level, like the published `-text` repacks) even when the
    source has Google's multimodal layout; vision and audio towers are never carried.
    """
    out = Path(out)
    if to not in TARGETS:
        raise Qat4Error(f"--to {to} is not one of {', '.join(TARGETS)}")
    if to == "gguf" and out.suffix != ".gguf":
        raise Qat4Error(f"{out} does not end in .gguf; for --to gguf, OUT names the file to write")
    if to == "gguf" and scale_dtype not in (None, torch.float16):
        raise Qat4Error("--scale-dtype bf16 is not possible with --to gguf: Q4_0 stores fp16 steps")
    if out.exists() and not force:
        raise Qat4Error(f"{out} already exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise Qat4Error(f"cannot write {out}: folder {out.parent} does not exist")

    source = open_checkpoint(src)
    names = text_names(source)
    if LM_HEAD in names and not lm_head_differs(source):
        names.remove(LM_HEAD)
    if LM_HEAD in names and to != "gguf":
        raise Qat4Error(f"{source.location} has an lm_head that differs from embed_tokens; {to} ties them, so repack it --to gguf")
    if scale_dtype is None and to != "gguf":
        scale_dtype = default_scale_dtype(source)
    aux = source.aux()
    multimodal = "text_config" in getattr(source, "raw_config", {})

    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".repack", dir=out.parent))
    try:
        built = stage / out.name
        counter = itertools.count(1)

        def on_read(name: str) -> None:
            done = next(counter)
            if progress is not None:
                progress(done, len(names), name, _disk_bytes(stage))

        step_dtype = step_dtypes(to, scale_dtype)
        consequence = "Q4_0 stores fp16 steps" if to == "gguf" else "pass --scale-dtype fp16 to keep it"
        sample = sample_names(names, source.config, step_dtype)
        tensors = _Streamed(source, names, sample, step_dtype, consequence, on_read)
        if to == "gguf":
            write_gguf(built, source.config, tensors, aux)
        else:
            write_ct(built, source.config, tensors, aux, emb4=to == "ct-emb4", scale_dtype=scale_dtype,
                     text_only=text_only or not multimodal)
        size = _disk_bytes(stage)
        written = check_written(built, source, names, tensors.fingerprints)
        _move_into_place(built, out, stage)
    except OSError as exc:
        raise Qat4Error(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)

    recovered = None
    for report in source.grid_reports().values():
        recovered = recovered or GridReport("recovered")
        recovered.add(report)
    return RepackResult(out, to, written, size, recovered)
