"""Log-probabilities of tokens: on the device for a step's rows, and as the host reads them back.

A sequence that asks for logprobs gets, for each token it takes, the token's log-probability and
the TOP_LOGPROBS most likely tokens at its position, under the model's own distribution: the
log-softmax of the softcapped logits, before temperature, top-k, top-p and any grammar mask (what
vLLM reports by default). A step with such a row scores every row (:func:`score`) into buffers that
go to the host with the step's tokens; :func:`read_scores` turns a row of them into a
:class:`TokenLogprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_LOGPROBS = 20  # the most likely tokens a scored row keeps: the most any request may ask for


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the most likely tokens at its position, ``top`` as (id,
    logprob) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def top_width(vocab_size: int) -> int:
    """The most likely tokens a scored row keeps over a vocabulary of ``vocab_size``."""
    return min(TOP_LOGPROBS, vocab_size)


def score_buffers(rows: int, k: int, device: torch.device, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for :func:`score`'s output of ``rows`` rows and k top tokens: logprobs [rows, 1 + k]
    fp32 and ids [rows, k] int64 on ``device`` (``pinned``: in pinned host memory)."""
    return (torch.zeros(rows, 1 + k, dtype=torch.float32, device=device, pin_memory=pinned),
            torch.zeros(rows, k, dtype=torch.int64, device=device, pin_memory=pinned))


def score(logits: torch.Tensor, tokens: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Log-probabilities under logits [R, V] fp32 into ``out`` = (logprobs [R, 1 + K] fp32: each
    row's token of ``tokens`` [R], then its K most likely tokens, most likely first; their ids
    [R, K] int64), on the device."""
    logprobs, ids = out
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    top, top_ids = torch.topk(logits, ids.shape[1], dim=-1)
    logprobs[:, :1].copy_(logits.gather(1, tokens[:, None]) - lse)
    logprobs[:, 1:].copy_(top - lse)
    ids.copy_(top_ids)


def read_scores(token: int, logprobs: list[float], ids: list[int], k: int) -> TokenLogprobs:
    """A row of :func:`score`'s output read back (``logprobs`` [1 + K], ``ids`` [K]) as the
    TokenLogprobs of ``token`` with its k most likely tokens."""
    return TokenLogprobs(token, logprobs[0], tuple(zip(ids[:k], logprobs[1 : k + 1])))
