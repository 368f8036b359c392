"""Compare two checkpoints of any formats tensor by tensor: do they hold the same 4-bit codes?

For every pair of tensors the comparison counts elements, elements whose dequantised values
(`step x level`, in fp32) differ, int4 codes that disagree, and the worst difference in units of
the group step (the larger of the two steps of that group). Tensors a source recovered from 16-bit
values also carry that source's GridReport: the share of values the recovered levels and steps
reproduce bit-identically. Counts are kept per group of tensors (each vocabulary table, attention,
MLP, per-layer projections, norms and scalars) and in total.

The output layer is compared as `lm_head`: a checkpoint without one (tied) contributes its
`embed_tokens`, so an `-emb4` file with its untied copy compares cleanly against a tied one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from qat4.checkpoint.hf_layout import LM_HEAD
from qat4.checkpoint.packed_model import Tensor, expected_tensors, is_unused_shared_kv
from qat4.checkpoint.packing import GROUP, GridReport, PackedBlocks, PackedTensor, row_blocks, unpack_levels
from qat4.checkpoint.source import CheckpointSource

SINGLE_TENSOR_GROUPS = ("embed_tokens", "embed_tokens_per_layer", LM_HEAD, "per_layer_model_projection")
GROUPS = (*SINGLE_TENSOR_GROUPS, "attention", "mlp", "per-layer projections", "norms and scalars")
_CHUNK_ELEMENTS = 1 << 22

Progress = Callable[[int, int, str], None]  # (tensors compared, tensors in all, name)


def group_of(name: str) -> str:
    """The report group of a canonical tensor name."""
    if name in SINGLE_TENSOR_GROUPS:
        return name
    tail = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if tail.startswith("self_attn.") and tail.endswith("_proj"):
        return "attention"
    if tail.startswith("mlp."):
        return "mlp"
    if tail in ("per_layer_input_gate", "per_layer_projection"):
        return "per-layer projections"
    return "norms and scalars"


@dataclass
class Tally:
    """Counts over a set of compared tensors."""

    tensors: int = 0
    elements: int = 0
    elements_differing: int = 0
    int4_codes: int = 0
    int4_codes_disagreeing: int = 0
    worst_diff_steps: float = 0.0
    recovered_a: GridReport | None = None  # values of A's 16-bit tensors reproduced exactly
    recovered_b: GridReport | None = None

    def add(self, other: "Tally") -> None:
        self.tensors += other.tensors
        self.elements += other.elements
        self.elements_differing += other.elements_differing
        self.int4_codes += other.int4_codes
        self.int4_codes_disagreeing += other.int4_codes_disagreeing
        self.worst_diff_steps = max(self.worst_diff_steps, other.worst_diff_steps)
        self.recovered_a = _merge(self.recovered_a, other.recovered_a)
        self.recovered_b = _merge(self.recovered_b, other.recovered_b)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("recovered")}
        for side in ("a", "b"):
            report = getattr(self, f"recovered_{side}")
            out[f"exact_share_{side}"] = None if report is None else report.exact_share
        return out


def _merge(total: GridReport | None, part: GridReport | None) -> GridReport | None:
    if part is None:
        return total
    merged = GridReport(part.name) if total is None else total
    merged.add(part)
    return merged


def compare_tensors(a: Tensor | PackedBlocks, b: Tensor | PackedBlocks) -> Tally:
    """Compare two tensors of the same shape; 4-bit matrices (whole or in blocks) in row chunks,
    never a dense copy."""
    tally = Tally(tensors=1)
    if _is_matrix(a) and _is_matrix(b):
        step = max(1, _CHUNK_ELEMENTS // a.cols)
        for ba, bb in zip(row_blocks(a), row_blocks(b)):
            for r in range(0, ba.rows, step):
                _compare_packed_rows(ba.packed[r : r + step], ba.scales[r : r + step], bb.packed[r : r + step],
                                     bb.scales[r : r + step], tally)
    else:
        va, vb = _dense(a), _dense(b)
        tally.elements = va.numel()
        tally.elements_differing = int((va != vb).sum())
    return tally


def _is_matrix(t: Tensor | PackedBlocks) -> bool:
    return isinstance(t, (PackedTensor, PackedBlocks))


def _dense(t: Tensor) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, PackedTensor) else t.to(torch.float32)


def _compare_packed_rows(pa: torch.Tensor, sa: torch.Tensor, pb: torch.Tensor, sb: torch.Tensor, tally: Tally) -> None:
    n = pa.numel() * 8
    tally.elements += n
    tally.int4_codes += n
    sa, sb = sa.to(torch.float32).unsqueeze(-1), sb.to(torch.float32).unsqueeze(-1)
    if torch.equal(pa, pb) and torch.equal(sa, sb):
        return  # same words and steps: nothing differs
    la, lb = unpack_levels(pa), unpack_levels(pb)
    rows = la.shape[0]
    tally.int4_codes_disagreeing += int((la != lb).sum())
    va = la.to(torch.float32).reshape(rows, -1, GROUP) * sa
    vb = lb.to(torch.float32).reshape(rows, -1, GROUP) * sb
    diff = (va - vb).abs()
    tally.elements_differing += int((diff != 0).sum())
    step = torch.maximum(sa.abs(), sb.abs())
    worst = (diff / torch.where(step == 0, 1.0, step)).max()
    tally.worst_diff_steps = max(tally.worst_diff_steps, float(worst))


@dataclass
class Comparison:
    """The result of comparing checkpoint A with checkpoint B."""

    a: str
    b: str
    format_a: str
    format_b: str
    groups: dict[str, Tally] = field(default_factory=dict)
    total: Tally = field(default_factory=Tally)
    problems: list[str] = field(default_factory=list)  # missing tensors, shape or kind mismatches
    notes: list[str] = field(default_factory=list)  # config fields that differ

    @property
    def identical_codes(self) -> bool:
        return not self.problems and self.total.int4_codes_disagreeing == 0

    def to_json(self) -> dict:
        return {
            "a": {"path": self.a, "format": self.format_a},
            "b": {"path": self.b, "format": self.format_b},
            "groups": {name: t.to_json() for name, t in self.groups.items()},
            "total": self.total.to_json(),
            "problems": list(self.problems),
            "notes": list(self.notes),
            "identical_codes": self.identical_codes,
        }


def _pairs(a: CheckpointSource, b: CheckpointSource) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(report name, name in A, name in B) in canonical order, and the tensors only one side has."""
    names_a = {n for n in a.names() if not is_unused_shared_kv(a.config, n)}
    names_b = {n for n in b.names() if not is_unused_shared_kv(b.config, n)}
    order = [*expected_tensors(a.config), *expected_tensors(b.config), LM_HEAD, *sorted(names_a | names_b)]
    pairs, problems = [], []
    for name in dict.fromkeys(order):
        if name == LM_HEAD:
            if LM_HEAD in names_a or LM_HEAD in names_b:
                pairs.append((name, name if name in names_a else "embed_tokens", name if name in names_b else "embed_tokens"))
        elif name in names_a and name in names_b:
            pairs.append((name, name, name))
        elif name in names_a or name in names_b:
            problems.append(f"tensor {name} is only in {'A' if name in names_a else 'B'}")
    return pairs, problems


def _config_notes(a: CheckpointSource, b: CheckpointSource) -> list[str]:
    differ = [f.name for f in fields(a.config) if getattr(a.config, f.name) != getattr(b.config, f.name)]
    return [f"config field {name} differs: {getattr(a.config, name)!r} in A, {getattr(b.config, name)!r} in B" for name in differ]


def compare(a: CheckpointSource, b: CheckpointSource, progress: Progress | None = None) -> Comparison:
    """Compare every text tensor of A with its counterpart in B, one pair in memory at a time."""
    result = Comparison(a.location, b.location, a.format, b.format, notes=_config_notes(a, b))
    pairs, result.problems = _pairs(a, b)
    for done, (name, name_a, name_b) in enumerate(pairs, 1):
        ta, tb = a.read_blocks(name_a), b.read_blocks(name_b)
        shape_a = tuple(ta.shape)
        if shape_a != tuple(tb.shape):
            result.problems.append(f"tensor {name} has shape {list(shape_a)} in A and {list(tb.shape)} in B")
        elif _is_matrix(ta) != _is_matrix(tb):
            result.problems.append(f"tensor {name} is a 4-bit matrix in {'A' if _is_matrix(ta) else 'B'} only")
        else:
            tally = compare_tensors(ta, tb)
            # A tied side's embed_tokens stands in for lm_head; its report is counted under embed_tokens.
            tally.recovered_a = a.grid_reports().get(name) if name_a == name else None
            tally.recovered_b = b.grid_reports().get(name) if name_b == name else None
            result.groups.setdefault(group_of(name), Tally()).add(tally)
            result.total.add(tally)
        if progress is not None:
            progress(done, len(pairs), name)
    result.groups = {g: result.groups[g] for g in GROUPS if g in result.groups}
    return result


def format_comparison(result: Comparison) -> str:
    """A plain-text table: one row per group and the total, then problems and the verdict."""
    head = ("group", "tensors", "elements", "differing", "codes differing", "worst (steps)", "exact A", "exact B")
    rows = [head]
    for name, t in [*result.groups.items(), ("total", result.total)]:
        rows.append((
            name, f"{t.tensors:,}", f"{t.elements:,}", f"{t.elements_differing:,}",
            f"{t.int4_codes_disagreeing:,}" if t.int4_codes else "-",
            f"{t.worst_diff_steps:.4f}" if t.int4_codes else "-",
            _share(t.recovered_a), _share(t.recovered_b),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"A: {result.a} ({result.format_a})", f"B: {result.b} ({result.format_b})", ""]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines += [""] + result.notes + result.problems
    return "\n".join(lines + [_verdict(result)])


def _verdict(result: Comparison) -> str:
    """The last line: whether the codes agree, and that the configs differ when they do."""
    codes = "identical int4 codes" if result.identical_codes else "int4 codes differ"
    if not result.notes:
        return codes
    fields = "1 field" if len(result.notes) == 1 else f"{len(result.notes)} fields"
    return f"{codes}, but the configs differ ({fields}, above)"


def _share(report: GridReport | None) -> str:
    return "-" if report is None else f"{100 * report.exact_share:.2f} %"

