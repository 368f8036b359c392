"""The one packed int4 layout, whether a step dtype holds a matrix's steps exactly, and exact recovery
of the trained 4-bit grid from 16-bit values.

Layout (compressed-tensors order): a matrix W [rows, cols] (cols a multiple of 32) is
- `packed` int32 [rows, cols // 8]: column c = 8j + i lives in word j, bits 4i..4i+3, as the biased
  code `level + 8` (0..15), level in -8..7;
- `scales` fp16 or bf16 [rows, cols // 32]: W[r, c] = scales[r, c // 32] * level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from qat4.errors import Qat4Error

GROUP = 32
PER_WORD = 8
_ROW_CHUNK_ELEMENTS = 1 << 20  # elements handled at once: 4 MB fp32 temporaries stay in cache (3x faster than 1 << 24)
STREAM_BYTES = 256 << 20  # a 4-bit matrix with more bytes of codes than this is repacked a row block at a time
_BLOCK_BYTES = 32 << 20  # bytes of codes per row block of such a matrix


@dataclass
class PackedTensor:
    """A matrix on the 4-bit grid: int32 words [rows, cols/8] and group steps [rows, cols/32]."""

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @property
    def cols(self) -> int:
        return self.packed.shape[1] * PER_WORD

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 4 + self.scales.numel() * self.scales.element_size()

    def levels(self) -> torch.Tensor:
        """int8 [rows, cols] in -8..7."""
        return unpack_levels(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] in `dtype`: scale x level, computed in fp32 (exact for on-grid values)."""
        return dequantize(self.packed, self.scales, dtype)

    def to(self, device=None, scale_dtype: torch.dtype | None = None) -> "PackedTensor":
        scales = self.scales if scale_dtype is None else self.scales.to(scale_dtype)
        return PackedTensor(self.packed.to(device), scales.to(device))

    def cat_rows(self, *others: "PackedTensor") -> "PackedTensor":
        """Stack along the output dimension (q/k/v or gate/up fusion): exact, no repacking."""
        parts = (self, *others)
        return PackedTensor(
            torch.cat([p.packed for p in parts]), torch.cat([p.scales.to(self.scales.dtype) for p in parts])
        )

    def interleave_rows(self, other: "PackedTensor") -> "PackedTensor":
        """Rows alternating self[0], other[0], self[1], ... (gate/up fusion whose GELU gate runs
        in the GEMV epilogue on adjacent rows): exact, no repacking. Both [N, K] alike."""
        if self.packed.shape != other.packed.shape:
            raise ValueError(f"interleaved rows need equal shapes, got {tuple(self.shape)} and {tuple(other.shape)}")
        return PackedTensor(
            torch.stack([self.packed, other.packed], 1).flatten(0, 1),
            torch.stack([self.scales, other.scales.to(self.scales.dtype)], 1).flatten(0, 1),
        )


@dataclass
class PackedBlocks:
    """A 4-bit matrix [rows, cols] too large to hold while it is converted, read as consecutive
    blocks of rows: `read_rows(start, stop)` returns rows start..stop-1 as a PackedTensor, and each
    pass of :func:`row_blocks` reads the matrix again from row 0."""

    rows: int
    cols: int
    read_rows: Callable[[int, int], PackedTensor]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def row_blocks(t: PackedTensor | PackedBlocks) -> Iterator[PackedTensor]:
    """A 4-bit matrix, whole or PackedBlocks, as consecutive row blocks of about _BLOCK_BYTES of
    codes; both forms of one shape split at the same rows."""
    step = max(1, 2 * _BLOCK_BYTES // t.cols)
    for start in range(0, t.rows, step):
        stop = min(t.rows, start + step)
        yield t.read_rows(start, stop) if isinstance(t, PackedBlocks) else PackedTensor(t.packed[start:stop], t.scales[start:stop])


def streamed(shape: tuple[int, int]) -> bool:
    """Whether a repack reads a 4-bit matrix of this shape as PackedBlocks rather than whole."""
    rows, cols = shape
    return rows * cols // 2 > STREAM_BYTES


def pack_levels(levels: torch.Tensor) -> torch.Tensor:
    """int levels [rows, cols] in -8..7 -> int32 words [rows, cols / 8].

    Codes pair up into bytes (even column in the low nibble), and each four bytes are one word read
    in the machine's (little-endian) byte order: column 8j + i lands in bits 4i..4i+3 of word j.
    """
    rows, cols = levels.shape
    codes = (levels + 8).to(torch.uint8).reshape(rows, cols // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int32)


def unpack_levels(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [rows, cols / 8] -> int8 levels [rows, cols] in -8..7."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (codes - 8).to(torch.int8).reshape(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed words [rows, cols/8] and steps [rows, cols/32] -> dense [rows, cols] in `dtype`."""
    rows = packed.shape[0]
    levels = unpack_levels(packed).to(torch.float32).reshape(rows, -1, GROUP)
    return (levels * scales.to(torch.float32).unsqueeze(-1)).reshape(rows, -1).to(dtype)


def require_exact_steps(steps: torch.Tensor, dtype: torch.dtype, name: str, consequence: str, row0: int = 0) -> None:
    """Raise Qat4Error naming tensor, row and group of the first step ([rows, groups]) that `dtype`
    cannot hold exactly; `consequence` ends the message (why it matters, what to do). `row0`: the
    row of the whole matrix that steps' first row is, for the message."""
    chunk = max(1, _ROW_CHUNK_ELEMENTS // steps.shape[1])
    for r in range(0, steps.shape[0], chunk):
        step32 = steps[r : r + chunk].to(torch.float32)
        bad = (step32.to(dtype).to(torch.float32) != step32).nonzero()
        if len(bad):
            row, group = r + int(bad[0, 0]), int(bad[0, 1])
            raise Qat4Error(
                f"tensor {name} has step {float(steps[row, group])!r} at row {row0 + row}, group {group}, "
                f"which {str(dtype).removeprefix('torch.')} cannot hold exactly; {consequence}"
            )


@dataclass
class GridReport:
    """How well a 16-bit tensor's values are reproduced by the recovered levels and steps."""

    name: str
    elements: int = 0
    groups: int = 0
    exact: int = 0  # values whose reconstruction is bit-identical to the source
    worst_ulp_steps: float = 0.0  # worst |reconstructed - source| in units of the group step

    def add(self, other: "GridReport") -> None:
        self.elements += other.elements
        self.groups += other.groups
        self.exact += other.exact
        self.worst_ulp_steps = max(self.worst_ulp_steps, other.worst_ulp_steps)

    @property
    def exact_share(self) -> float:
        return self.exact / self.elements if self.elements else 1.0


def recover_grid(
    weight: torch.Tensor, name: str, scale_dtype: torch.dtype = torch.float16, row0: int = 0
) -> tuple[PackedTensor, GridReport]:
    """Recover the trained (level, step) of every group of 32 along each row of a 16-bit matrix.

    weight: [rows, cols] bf16/fp16/fp32 whose groups are `step x level` up to 16-bit rounding: a
    tensor, or anything with `.shape`, `.dim()` and row slicing (a reader's :class:`RowSlices`),
    which is then read a row chunk at a time. The result is allocated once and filled in place.
    `row0`: the row of the whole matrix that weight's first row is, for messages.
    Per group: for m = 1..8 try step = amax / m and keep the first that reproduces every value
    within 2^-7 amax with levels in -8..7 (amax / 8 alone is wrong whenever the peak is not at
    level -8); refine the step by least squares, round it to `scale_dtype` and take, of the
    `scale_dtype` values next to it, the one that reproduces the most values bit-identically when
    `scale_dtype` is finer than the source's dtype (:func:`_most_exact_step`); recompute the levels.
    Raises Qat4Error naming the tensor and the first off-grid group. Works in row chunks.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise Qat4Error(f"tensor {name} has shape {tuple(weight.shape)}; a 4-bit matrix needs 2 dims and columns a multiple of {GROUP}")
    rows, cols = weight.shape
    chunk = max(1, _ROW_CHUNK_ELEMENTS // cols)
    packed = torch.empty(rows, cols // PER_WORD, dtype=torch.int32)
    scales = torch.empty(rows, cols // GROUP, dtype=scale_dtype)
    report = GridReport(name)
    for start in range(0, rows, chunk):
        block = weight[start : start + chunk]
        levels, steps, part = _recover_block(block, name, row0 + start, scale_dtype)
        packed[start : start + chunk] = pack_levels(levels)
        scales[start : start + chunk] = steps
        report.add(part)
    return PackedTensor(packed, scales), report


_PROBE = 4  # values per group tested against all eight trial steps before the full check


def _fits(w: torch.Tensor, trial: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Whether step `trial` [..., k, 1] reproduces every value of w [..., k, n] within tol on
    levels -8..7 -> bool [..., k, 1].

    Every trial step is at least amax / 8 (or 0 for an all-zero group), so |w / trial| <= 8 and
    no level falls below -8: only level 8 needs excluding. Both bounds are taken as excesses whose
    maximum over the group must not be positive (x - y <= 0 exactly when x <= y), which is several
    times faster than comparing and then reducing bools over a short last dimension.
    """
    q = torch.round(w / torch.where(trial == 0, 1.0, trial))
    excess = torch.maximum((w - q * trial).abs_().sub_(tol), q.sub_(7))
    return excess.amax(dim=-1, keepdim=True) <= 0


def _first_fitting_step(w: torch.Tensor, amax: torch.Tensor, tol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of w [R, G, 32]: the step amax / m for the first m in 1..8 that reproduces all
    32 values, and whether one does (an all-zero group fits at step 0) -> ([R, G, 1], bool [R, G, 1]).

    The first _PROBE values of each group are tested against all eight steps at once; only the
    first step passing that probe gets the full check, and the rare group it fails (a probe that
    happened to sit on a coarser grid) tries the later steps in full. A step that fails the probe
    fails the full check, so the result equals trying m = 1..8 in full, at about a third of the work.
    """
    m = torch.arange(1, 9, dtype=torch.float32)
    trials = amax / m  # [R, G, 8]
    probe_ok = _fits(w[..., None, :_PROBE], trials[..., None], tol[..., None])[..., 0]  # [R, G, 8]
    first = torch.where(probe_ok.any(-1), probe_ok.int().argmax(-1), 0)[..., None]  # [R, G, 1]
    step = torch.gather(trials, -1, first)
    found = (amax == 0) | (probe_ok.any(-1, keepdim=True) & _fits(w, step, tol))
    step = torch.where(amax == 0, 0.0, step)
    retry = (~found).reshape(-1).nonzero()[:, 0]
    if retry.numel():
        flat_w, flat_amax, flat_tol = w.reshape(-1, 1, GROUP)[retry], amax.reshape(-1, 1, 1)[retry], tol.reshape(-1, 1, 1)[retry]
        flat_first = first.reshape(-1)[retry]
        got_step, got = torch.zeros_like(flat_amax), torch.zeros_like(flat_amax, dtype=torch.bool)
        for k in range(1, 9):
            ok = _fits(flat_w, flat_amax / k, flat_tol) & ~got & (k > flat_first + 1).reshape(-1, 1, 1)
            got_step = torch.where(ok, flat_amax / k, got_step)
            got |= ok
        step.reshape(-1)[retry] = got_step.reshape(-1)
        found.reshape(-1)[retry] = got.reshape(-1)
    return step, found


_NEIGHBOURS = 8  # stored-dtype steps tried on either side of the least-squares one (6 reached every value of a bf16 source)


def _levels_and_values(w: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels round(w / step) of groups w [..., 32] (fp32) and the values levels x step they stand
    for, with steps [..., 1] fp32 (a step of 0 gives level 0)."""
    levels = torch.round(w / torch.where(step == 0, 1.0, step))
    return levels, levels * step


def _most_exact_step(w: torch.Tensor, source: torch.Tensor, stored: torch.Tensor,
                     exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of w [N, 32] (fp32 of ``source`` [N, 32], a 16-bit tensor) whose least-squares
    step ``stored`` [N, 1] reproduces only ``exact`` [N, 1] < 32 of its values bit-identically:
    the value of stored's dtype within _NEIGHBOURS steps of it that reproduces the most (the
    least-squares one on a tie), nearest first, a group leaving once it is whole. Returns the
    steps [N, 1] and the indices of the groups whose step changed.

    A source stores each trained value rounded to 16 bits, so the least-squares step lies near the
    trained one but not always on it: a bf16 source whose trained steps are exact fp16 values kept
    96.3 % of its values through an fp16 step, and 100 % through the step chosen here."""
    best, exact = stored.clone(), exact.clone()
    bits = stored.view(torch.int16)
    todo = ((exact < GROUP) & (stored > 0)).reshape(-1).nonzero()[:, 0]
    changed = torch.zeros(len(stored), dtype=torch.bool)
    for k in (d for n in range(1, _NEIGHBOURS + 1) for d in (n, -n)):
        if not todo.numel():
            break
        trial = (bits[todo] + k).view(stored.dtype)
        levels, values = _levels_and_values(w[todo], trial.to(torch.float32))
        count = (values.to(source.dtype) == source[todo]).sum(-1, keepdim=True)
        in_range = ((levels >= -8) & (levels <= 7)).all(-1, keepdim=True)
        better = in_range & torch.isfinite(trial) & (trial > 0) & (count > exact[todo])
        best[todo] = torch.where(better, trial, best[todo])
        exact[todo] = torch.where(better, count, exact[todo])
        changed[todo] |= better.reshape(-1)
        todo = todo[exact[todo].reshape(-1) < GROUP]
    return best, changed.nonzero()[:, 0]


def _recover_block(block: torch.Tensor, name: str, row0: int, scale_dtype: torch.dtype):
    rows, cols = block.shape
    w = block.to(torch.float32).reshape(rows, cols // GROUP, GROUP)
    amax = w.abs().amax(dim=-1, keepdim=True)
    tol = amax * 2.0**-7
    step, found = _first_fitting_step(w, amax, tol)
    if not bool(found.all()):
        flat = int((~found).reshape(-1).nonzero()[0])
        row, group = divmod(flat, cols // GROUP)
        raise Qat4Error(
            f"tensor {name} is off the 4-bit grid at row {row0 + row}, group {group} "
            f"(columns {group * GROUP}..{group * GROUP + GROUP - 1}): no step reproduces its 32 values"
        )
    safe = torch.where(step == 0, 1.0, step)
    q = torch.round(w / safe)
    denom = (q * q).sum(-1, keepdim=True)
    refined = torch.where(denom > 0, (q * w).sum(-1, keepdim=True) / torch.where(denom > 0, denom, 1.0), 0.0)
    # A step stores as 0 only for an all-zero group or one so small (under 2^-24) that its values
    # round to level 0 over a step of 1 too.
    groups, source = w.reshape(-1, GROUP), block.reshape(-1, GROUP)
    stored = refined.to(scale_dtype).reshape(-1, 1)
    levels, recon = _levels_and_values(groups, stored.to(torch.float32))
    exact = (recon.to(block.dtype) == source).sum(-1, keepdim=True)
    if torch.finfo(scale_dtype).eps < torch.finfo(block.dtype).eps:
        # a step finer than the source's values: the trained one is among its neighbours
        stored, changed = _most_exact_step(groups, source, stored, exact)
        levels[changed], recon[changed] = _levels_and_values(groups[changed], stored[changed].to(torch.float32))
    lowest, highest = torch.aminmax(levels)
    if lowest < -8 or highest > 7:
        flat = int(((levels < -8) | (levels > 7)).any(-1).nonzero()[0])
        row, group = divmod(flat, cols // GROUP)
        raise Qat4Error(f"tensor {name} row {row0 + row}, group {group} needs a level outside -8..7 once its step is stored as {scale_dtype}")
    exact = (recon.to(block.dtype) == source).sum()
    stored_f = stored.to(torch.float32)
    worst = recon.sub_(groups).abs_().div_(torch.where(stored_f == 0, 1.0, stored_f)).max()
    report = GridReport(name, elements=rows * cols, groups=rows * cols // GROUP, exact=int(exact), worst_ulp_steps=float(worst))
    return levels.to(torch.int8).reshape(rows, cols), stored.reshape(rows, cols // GROUP), report
