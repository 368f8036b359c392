"""Token sampling on the device: temperature, top-k, top-p, driven by one uniform number per token.

The random number is drawn outside (from a seeded ``torch.Generator``) into a device tensor, so
the sampling itself is a pure function of tensors: it can sit inside a captured CUDA graph and
gives the same token eagerly and replayed. ``temperature`` and ``top_p`` are device tensors too
(changing them needs no recapture); ``top_k`` is a shape, so a graph is captured per value.

The cumulative sums run over integer weights (probabilities in units of 2^-40): a GPU prefix scan
adds floats in an order that can change from run to run, and over a nucleus of 100,000+ nearly
equal probabilities that moves the draw to a neighbouring token; integer sums are the same in any
order, so a seed gives the same tokens every time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qat4.errors import Qat4Error


_ONE = float(1 << 40)  # probability 1 as an integer weight (exact: a power of two)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. temperature 0 is greedy; top_k None (or 0) keeps every token."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise Qat4Error(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise Qat4Error(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise Qat4Error(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def effective_top_k(self, vocab_size: int) -> int | None:
        """top_k as a static shape: None when it keeps the whole vocabulary."""
        return self.top_k if self.top_k and self.top_k < vocab_size else None


def sample(logits: torch.Tensor, uniform: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: int | None) -> torch.Tensor:
    """Draw one token id from logits [V] fp32 -> [1] int64, all on the device.

    uniform [1] in [0, 1); temperature [1] > 0; top_p [1] in (0, 1]. Keeps the top_k largest
    logits (all when None), softmaxes them at the temperature, keeps the smallest prefix whose
    probability reaches top_p, and inverts the cumulative distribution of what is left at
    ``uniform``.
    """
    if top_k is None:
        values, ids = torch.sort(logits, descending=True)
    else:
        values, ids = torch.topk(logits, top_k)
    weights = (torch.softmax(values / temperature, dim=-1) * _ONE).long()  # the first >= 2^40 / V > 0
    before = weights.cumsum(-1) - weights
    weights = weights * (before.double() < top_p.double() * weights.sum(-1, keepdim=True))  # the first stays
    cdf = weights.cumsum(-1)
    target = (uniform.double() * cdf[-1:]).long()  # < cdf[-1]: lands on a kept token
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=ids.shape[0] - 1)
    return ids[choice]
