"""The interface every checkpoint reader implements, and the aux files every writer carries.

A CheckpointSource reads one checkpoint lazily (memory-mapped): tensors come out one at a time,
already in qat4's packed form and under the canonical text names of qat4.checkpoint.packed_model,
so a whole model is never held twice and a repack streams with bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

from qat4.checkpoint import FORMATS  # noqa: F401  (re-exported: the format names every reader reports)
from qat4.checkpoint.packed_model import Tensor
from qat4.checkpoint.packing import GridReport, PackedBlocks
from qat4.config import Gemma4Config

@dataclass
class AuxFiles:
    """What travels with the weights: tokenizer, chat template, generation settings.

    `tokenizer_json` is the HF tokenizers JSON text (built from GGUF metadata when the source is
    a GGUF); `chat_template` the jinja text; `generation_config` the generation_config.json dict;
    `extra` other small files copied verbatim (name -> bytes), e.g. tokenizer_config.json.
    """

    tokenizer_json: str | None = None
    chat_template: str | None = None
    generation_config: dict = field(default_factory=dict)
    extra: dict[str, bytes] = field(default_factory=dict)


class CheckpointSource(Protocol):
    """A checkpoint opened for reading."""

    config: Gemma4Config
    format: str  # one of FORMATS
    location: str  # the path shown in messages

    def names(self) -> list[str]:
        """Canonical names of the text tensors it holds (lm_head included when present)."""

    def read(self, name: str) -> Tensor:
        """One tensor in packed form: 4-bit matrices as PackedTensor (16-bit tables recovered
        onto the grid, raising Qat4Error naming the tensor and group when off-grid), the rest
        as dense torch tensors in their stored dtype."""

    def read_blocks(self, name: str) -> Tensor | PackedBlocks:
        """As read, except that a 4-bit matrix large enough to be `packing.streamed` may come as
        PackedBlocks, read a block of rows at a time (how a repack keeps its memory bounded)."""

    def grid_reports(self) -> dict[str, GridReport]:
        """For tensors recovered from 16-bit values so far: how many values reproduce exactly."""

    def aux(self) -> AuxFiles:
        ...

    def iter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        ...
