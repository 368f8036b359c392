"""KL divergence, same-top-token rate and perplexity ratio of a model's next-token distributions
against a reference's, over chunks of text (WikiText-2: 16 chunks of 512 tokens by default).

As llama.cpp's `llama-perplexity --kl-divergence` does: each chunk is read from its start with BOS
in place of its first token, and the second half of its positions is scored; the divergence at a
position is KL(reference || model) over the tokens the reference gives a log-probability above -16;
the perplexity ratio is exp(mean NLL - mean reference NLL) of the chunk's own next tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from qat4.errors import Qat4Error
from qat4.eval.logits_file import LOG_PROB_RANGE, LogitsWriter, first_scored

Logits = Callable[[list[int]], torch.Tensor]  # a chunk's ids -> logits [n_ctx, V]
ReferenceLogProbs = Callable[[int, list[int]], torch.Tensor]  # (chunk index, ids) -> log-probs [positions, V]


@dataclass
class KldReport:
    """The figures over every scored position; the reference's are None without a reference."""

    chunks: int
    n_ctx: int
    positions: int
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    ppl_ratio: float | None = None
    mean_kld: float | None = None
    kld_stderr: float | None = None
    median_kld: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None  # fraction of positions whose most likely token is the reference's
    same_top_stderr: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def text_chunks(ids: Sequence[int], n_chunks: int, n_ctx: int) -> list[list[int]]:
    """The first `n_chunks` whole chunks of `n_ctx` ids (fewer when the text is shorter)."""
    available = len(ids) // n_ctx
    if available < 1:
        raise Qat4Error(f"the text is {len(ids)} tokens, shorter than one chunk of {n_ctx}")
    return [list(ids[i * n_ctx:(i + 1) * n_ctx]) for i in range(min(n_chunks, available))]


def with_bos(chunk: Sequence[int], bos_id: int) -> list[int]:
    """The ids a chunk is read as: BOS in place of its first token."""
    return [bos_id, *chunk[1:]]


def reference_of(logits: Logits) -> ReferenceLogProbs:
    """A model as a reference: its log-probabilities at the scored positions."""
    def log_probs(index: int, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(logits(ids)[first_scored(len(ids)):len(ids) - 1].float().cpu(), dim=-1)

    return log_probs


def run(logits: Logits, chunks: Sequence[list[int]], bos_id: int, reference: ReferenceLogProbs | None = None,
        reference_name: str | None = None, writer: LogitsWriter | None = None,
        on_chunk: Callable[[int, int], None] | None = None) -> KldReport:
    """Score `logits` on every chunk, against `reference` when given; `writer` also keeps the
    model's own distributions as a logits file. `on_chunk(done, total)` follows the chunks."""
    n_ctx = len(chunks[0])
    first = first_scored(n_ctx)
    nll, nll_ref, klds, same = [], [], [], []
    for index, chunk in enumerate(chunks):
        ids = with_bos(chunk, bos_id)
        own = logits(ids).float().cpu()
        if writer is not None:
            writer.add_chunk(own)
        log_probs = torch.log_softmax(own[first:n_ctx - 1], dim=-1)
        targets = torch.tensor(chunk[first + 1:n_ctx])
        nll.append(-log_probs.gather(1, targets[:, None])[:, 0].double())
        if reference is not None:
            ref = reference(index, ids)
            nll_ref.append(-ref.gather(1, targets[:, None])[:, 0].double())
            kept = ref > -LOG_PROB_RANGE
            klds.append(torch.where(kept, ref.exp() * (ref - log_probs), 0).sum(dim=-1).double())
            same.append((log_probs.argmax(dim=-1) == ref.argmax(dim=-1)).double())
        if on_chunk is not None:
            on_chunk(index + 1, len(chunks))
    nll_all = torch.cat(nll)
    report = KldReport(chunks=len(chunks), n_ctx=n_ctx, positions=len(nll_all), perplexity=math.exp(nll_all.mean()))
    if reference is None:
        return report
    nll_ref_all, kld_all, same_all = torch.cat(nll_ref), torch.cat(klds), torch.cat(same)
    n = len(kld_all)
    report.reference = reference_name
    report.reference_perplexity = math.exp(nll_ref_all.mean())
    report.ppl_ratio = math.exp(nll_all.mean() - nll_ref_all.mean())
    report.mean_kld = float(kld_all.mean())
    report.kld_stderr = float(kld_all.std() / math.sqrt(n)) if n > 1 else 0.0
    report.median_kld = float(kld_all.median())
    report.kld_p99 = float(torch.quantile(kld_all, 0.99))
    report.same_top = float(same_all.mean())
    report.same_top_stderr = math.sqrt(report.same_top * (1 - report.same_top) / (n - 1)) if n > 1 else 0.0
    return report


def format_report(report: KldReport) -> str:
    """The figures as llama-perplexity prints them."""
    rows = [f"{report.chunks} chunks of {report.n_ctx} tokens, {report.positions} scored positions",
            f"PPL: {report.perplexity:.4f}"]
    if report.mean_kld is not None:
        rows += [f"reference: {report.reference}, PPL {report.reference_perplexity:.4f}",
                 f"Mean PPL(Q)/PPL(base): {report.ppl_ratio:.6f}",
                 f"Mean KLD: {report.mean_kld:.6f} ± {report.kld_stderr:.6f}",
                 f"Median KLD: {report.median_kld:.6f}",
                 f"99.0% KLD: {report.kld_p99:.6f}",
                 f"Same top p: {100 * report.same_top:.3f} ± {100 * report.same_top_stderr:.3f} %"]
    return "\n".join(rows)
