"""`qat4 bench speculative`: what speculative decoding costs and gains, at controlled acceptance.

Synthetic weights almost never agree with a real drafter, so the gain is measured with a replay
drafter instead: greedy decoding is run once without speculation to learn each sequence's
continuation, then again with drafts that are that continuation token by token with probability
``a`` each (else a token it is not), so a draft is kept with probability ``a`` while the earlier
ones were. Reported per batch size:

- the cost of a step verifying k drafts (1 + k rows per sequence), k = 0 .. spec_tokens, as the
  engine measured it at load and as a ratio to a plain step;
- decode tok/s for each acceptance and each k (drafting k every step), and with the engine's own
  choice of k (adaptive), beside plain decoding, with the acceptance the run actually saw, its
  verification steps and the engine's estimate of what waiting for each one costs.

On an engine built with the MTP drafter (``--speculative mtp:PATH``) the report also has what its
drafts cost per batch size and k, the replay drafter runs the MTP drafter every step and pays for
it (its drafts are replaced by the replayed ones), so the curve is what MTP decoding gives at each
acceptance, and one more run per batch size drafts with the MTP drafter itself (adaptive).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

import torch

from qat4.engine import Engine
from qat4.engine.sequence import Sequence


class ReplayDrafter:
    """Drafts from known continuations (``futures[seq.id]``): each draft token is the known one
    with probability ``a``, else a token it is not (seeded: the same runs draft the same).


    With ``paid_by`` (an MTP drafter) every proposal first runs that drafter and throws its
    drafts away, so a step costs what drafting with it costs."""

    def __init__(self, futures: dict[int, list[int]], a: float, vocab_size: int, seed: int = 0, paid_by=None):
        self.futures, self.a, self.vocab_size, self.paid_by = futures, a, vocab_size, paid_by
        self.rng = random.Random(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        known = self.futures.get(seq.id, [])[len(seq.output) : len(seq.output) + k]
        return [t if self.rng.random() < self.a else (t + 1) % self.vocab_size for t in known]

    def propose_all(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        if self.paid_by is not None:
            self.paid_by.propose_all(seqs, k)
        return [self.propose(s, k) for s in seqs]

    def cost(self, b: int, k: int) -> float:
        return self.paid_by.cost(b, k) if self.paid_by is not None else 0.0


@dataclass
class CurvePoint:
    batch: int
    acceptance: float | None  # the replay drafter's a; None for the MTP drafter's own drafts
    spec_tokens: int | None  # drafts per step; None: the engine's adaptive choice
    drafter: str  # "replay", or "mtp" for the MTP drafter's own drafts
    decode_tok_s: float
    speedup: float  # over plain decoding at the same batch size
    tokens_per_step: float  # tokens a sequence gained per verification (1 + kept drafts)
    seen_acceptance: float  # kept / (kept + refused) over the run's verifications
    verifications: int  # steps that verified drafts
    wait_us: float  # the engine's estimate, after the run, of what a speculating step adds to its graph


@dataclass
class SpecReport:
    model: str
    device: str
    new: int
    context: int
    step_us: dict[int, list[float]] = field(default_factory=dict)  # batch -> µs per step for k = 0 ..
    draft_us: dict[int, list[float]] = field(default_factory=dict)  # batch -> µs of the MTP drafts for k = 1 ..
    plain_tok_s: dict[int, float] = field(default_factory=dict)
    curve: list[CurvePoint] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def timed_decode(engine: Engine, prompts: list[list[int]], new: int,
                 futures: dict | None = None) -> tuple[float, list[Sequence]]:
    """Greedy decode of ``new`` tokens for every prompt at once; returns (tok/s of the steps after
    every sequence's first token, the sequences). ``futures`` gets each sequence's id mapped to
    the continuation it will be drafted from when given as {prompt index: tokens}."""
    seqs = [engine.add_request(p, new + 1, temperature=0, stop_token_ids=[]) for p in prompts]
    if futures is not None:
        engine.speculator.drafter.futures = {s.id: futures[i] for i, s in enumerate(seqs)}
    while any(not s.output for s in seqs):
        engine.step()
    start_tokens = sum(len(s.output) for s in seqs)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    return (sum(len(s.output) for s in seqs) - start_tokens) / seconds, seqs


def build_engine(packed, device: torch.device, max_batch: int, context: int, new: int, spec_tokens: int,
                 mtp: str | None = None) -> Engine:
    """An engine for these measurements: room for max_batch sequences of context + new tokens,
    speculating with prompt lookup (replaced by each run's drafter) or the MTP drafter at ``mtp``."""
    ctx = context + new + 16
    return Engine.from_packed(packed, device, max_ctx=ctx, max_num_seqs=max_batch, kv_tokens=max_batch * ctx,
                              speculative="ngram" if mtp is None else "mtp:" + mtp, spec_tokens=spec_tokens)


def plain_continuations(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, dict[int, list[int]]]:
    """Plain greedy decoding of the prompts with the speculator set aside, once to warm and once
    timed: (its tok/s, each prompt's continuation by index, what a replay drafter drafts from)."""
    speculator, engine.speculator = engine.speculator, None
    timed_decode(engine, prompts, new)  # warm
    plain, seqs = timed_decode(engine, prompts, new)
    engine.speculator = speculator
    return plain, {i: s.output for i, s in enumerate(seqs)}


def use_drafter(engine: Engine, drafter, k: int | None) -> None:
    """Draft from now on with ``drafter``: k drafts every step, or with k None the engine's
    adaptive choice up to its spec_tokens."""
    speculator = engine.speculator
    speculator.use(drafter)
    speculator.adaptive, speculator.max_tokens = k is None, k or engine.spec_tokens


def use_replay(engine: Engine, a: float, k: int | None, paid_by=None) -> None:
    """Draft from now on with a fresh :class:`ReplayDrafter` at acceptance ``a`` (k as for
    :func:`use_drafter`)."""
    use_drafter(engine, ReplayDrafter({}, a, engine.config.vocab_size, paid_by=paid_by), k)


def run(engine: Engine, model_name: str, batches: list[int], acceptances: list[float], ks: list[int],
        new: int, context: int, log=print) -> SpecReport:
    """Every measurement of the module docstring on one engine built with speculation."""
    speculator = engine.speculator
    mtp = speculator.drafter if hasattr(speculator.drafter, "propose_all") else None
    g = torch.Generator().manual_seed(0)
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "CPU"
    report = SpecReport(model_name, device, new, context)

    def measure(b: int, a: float | None, k: int | None, name: str, prompts, futures, plain: float) -> None:
        kept, steps, refused = speculator.accepted, speculator.verified, speculator.refused
        tok_s, _ = timed_decode(engine, prompts, new, futures)
        kept, steps = speculator.accepted - kept, speculator.verified - steps
        refused = speculator.refused - refused
        report.curve.append(CurvePoint(b, a, k, name, tok_s, tok_s / plain, 1 + kept / steps if steps else 1.0,
                                       kept / (kept + refused) if kept + refused else 0.0, steps, speculator.host_s * 1e6))
        at = "" if a is None else f", acceptance {a:.1f}"
        log(f"batch {b}, {name} drafts{at}, k {k or 'adaptive'}: {tok_s:,.0f} tok/s ({tok_s / plain:.2f}x)")

    for b in batches:
        padded = engine.runner.padded(b)
        report.step_us[b] = [speculator.costs[(padded, q)] * 1e6 for q in range(1, engine.spec_tokens + 2)]
        if mtp is not None:
            report.draft_us[b] = [mtp.cost(padded, k) * 1e6 for k in range(1, engine.spec_tokens + 1)]
        prompts = [torch.randint(3, engine.config.vocab_size, (context,), generator=g).tolist() for _ in range(b)]
        log(f"batch {b}: plain greedy decoding ({new} tokens)")
        plain, futures = plain_continuations(engine, prompts, new)
        report.plain_tok_s[b] = plain
        for a in acceptances:
            for k in [*ks, None]:
                use_replay(engine, a, k, paid_by=mtp)
                measure(b, a, k, "replay", prompts, futures, plain)
        if mtp is not None:
            use_drafter(engine, mtp, None)
            measure(b, None, None, "mtp", prompts, None, plain)
    use_drafter(engine, mtp if mtp is not None else speculator.drafter, None)
    return report


def format_table(report: SpecReport) -> str:
    lines = [f"model {report.model} on {report.device}: greedy, {report.new} new tokens after {report.context:,}-token "
             "prompts; drafts replayed from the plain run's continuation"]
    for b, costs in report.step_us.items():
        lines += ["", f"batch {b}: a step verifying k drafts per sequence, µs (x plain step)",
                  "  " + "  ".join(f"k={k}: {us:,.0f} ({us / costs[0]:.2f}x)" for k, us in enumerate(costs))]
        if b in report.draft_us:
            lines += ["  the MTP drafter's k drafts, µs (per draft token)",
                      "  " + "  ".join(f"k={k}: {us:,.0f} ({us / k:,.0f})" for k, us in enumerate(report.draft_us[b], 1))]
        lines += [f"  plain decoding {report.plain_tok_s[b]:,.0f} tok/s",
                  f"  {'drafts':>7} {'acceptance':>10} {'k':>8} {'tok/s':>9} {'speed-up':>9} {'tokens/step':>12} "
                  f"{'seen a':>7} {'verifications':>14} {'wait µs':>8}"]
        for p in (p for p in report.curve if p.batch == b):
            a = "—" if p.acceptance is None else f"{p.acceptance:.1f}"
            lines.append(f"  {p.drafter:>7} {a:>10} {p.spec_tokens or 'adaptive':>8} {p.decode_tok_s:>9,.0f} "
                         f"{p.speedup:>8.2f}x {p.tokens_per_step:>12.2f} {p.seen_acceptance:>7.2f} "
                         f"{p.verifications:>14} {p.wait_us:>8,.0f}")
    return "\n".join(lines)
