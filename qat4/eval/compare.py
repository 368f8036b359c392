"""Two runs of one task paired question by question: both right, only A, only B, neither, the
difference of B's accuracy from A's with a 95 % paired-bootstrap interval, and McNemar's exact test."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from qat4.errors import Qat4Error
from qat4.eval.records import Record

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """The paired figures of runs A and B over the questions both answered."""

    questions: int
    both_right: int
    a_only: int
    b_only: int
    neither: int
    accuracy_a: float
    accuracy_b: float
    difference: float  # accuracy B - accuracy A
    interval: tuple[float, float]  # 95 % paired bootstrap of the difference
    mcnemar_p: float  # exact two-sided p of the discordant pairs
    only_in_a: int  # questions A has that B lacks (left out of the pairing)
    only_in_b: int

    def to_json(self) -> dict:
        return asdict(self)


def pair(a: Sequence[Record], b: Sequence[Record]) -> Comparison:
    """Pair the records of A and B by question id; Qat4Error when they share none."""
    right_a, right_b = {r.id: r.correct for r in a}, {r.id: r.correct for r in b}
    shared = [i for i in right_a if i in right_b]
    if not shared:
        raise Qat4Error("the two runs have no question in common; are they runs of the same task?")
    both = sum(right_a[i] and right_b[i] for i in shared)
    a_only = sum(right_a[i] and not right_b[i] for i in shared)
    b_only = sum(right_b[i] and not right_a[i] for i in shared)
    n = len(shared)
    return Comparison(questions=n, both_right=both, a_only=a_only, b_only=b_only, neither=n - both - a_only - b_only,
                      accuracy_a=(both + a_only) / n, accuracy_b=(both + b_only) / n, difference=(b_only - a_only) / n,
                      interval=bootstrap_interval(n, a_only, b_only), mcnemar_p=mcnemar_exact(a_only, b_only),
                      only_in_a=len(right_a) - n, only_in_b=len(right_b) - n)


def bootstrap_interval(n: int, a_only: int, b_only: int, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The 95 % percentile interval of B - A over `resamples` resamplings of the n pairs with
    replacement (a pair counts -1 when only A is right, +1 when only B is, 0 otherwise), drawn as
    counts of the three kinds, with a fixed seed so a run's interval is reproducible."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [a_only / n, b_only / n, (n - a_only - b_only) / n], size=resamples)
    differences = (counts[:, 1] - counts[:, 0]) / n
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(differences, [tail, 100 - tail])
    return float(low), float(high)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """The two-sided exact McNemar p-value: the chance of a split of the discordant pairs at least
    this uneven when each goes either way with probability 1/2."""
    m = a_only + b_only
    if m == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail)


def format_table(comparison: Comparison, name_a: str, name_b: str) -> str:
    """The paired table: accuracies, the difference with its interval, and the counts each way."""
    c = comparison
    low, high = c.interval
    rows = [f"{'':<12}{name_a:>14}{name_b:>14}   difference (95% interval)",
            f"{'accuracy':<12}{c.accuracy_a:>14.4f}{c.accuracy_b:>14.4f}   {c.difference:+.3f} ({low:+.3f} to {high:+.3f})",
            f"{c.questions} questions: {c.both_right} both right, {c.a_only} only {name_a}, {c.b_only} only {name_b}, "
            f"{c.neither} neither; McNemar exact p = {c.mcnemar_p:.3g}"]
    if c.only_in_a or c.only_in_b:
        rows.append(f"left out: {c.only_in_a} questions only {name_a} has, {c.only_in_b} only {name_b} has")
    return "\n".join(rows)
