"""Google's bf16 QAT checkpoint (`-qat-q4_0-unquantized`): reader and writer.

Every linear and both vocabulary tables are stored dense bf16, yet each group of 32 values along a
row is exactly `step x level` up to bf16 rounding. The reader recovers levels and
steps with `recover_grid` (one GridReport per matrix, for `grid_reports()`); a group off the grid
is a Qat4Error naming the tensor and group. The layout is multimodal: `text_config` nested,
`model.language_model.*` names, tower tensors beside them (skipped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from qat4.checkpoint.hf_layout import SafetensorsFolderSource, conditional_generation_config, text_plan, write_folder
from qat4.checkpoint.packed_model import Tensor
from qat4.checkpoint.safetensors_io import DEFAULT_SHARD_BYTES
from qat4.checkpoint.source import AuxFiles
from qat4.config import Gemma4Config
from qat4.errors import Qat4Error


class QatBf16Source(SafetensorsFolderSource):
    """A dense bf16 checkpoint whose matrices lie on the 4-bit grid."""

    format = "qat-bf16"

    def __init__(self, folder: str | Path):
        super().__init__(folder)
        packed = next((name for name in self.names() if self.is_packed(name)), None)
        if packed is not None:
            raise Qat4Error(f"{self.folder} holds packed tensor {packed} but its config.json has no quantization_config")


def write_qat_bf16(
    out_dir: str | Path,
    config: Gemma4Config,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    aux: AuxFiles,
    *,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Write every matrix as dense bf16 (level x step) in Google's multimodal layout, tied.

    `tensors`: canonical text tensors (PackedModel form), streamed in any order. Values are
    exact when every step x level fits bf16 (steps with at most 4 significant bits always do).
    """
    plan = text_plan(config, lambda name: None)
    config_json = conditional_generation_config(config, tie=True)
    write_folder(out_dir, config, config_json, plan, tensors, aux, overwrite=overwrite, shard_bytes=shard_bytes)
