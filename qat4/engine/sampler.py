"""Token sampling on the device with per-row parameters: temperature, top-k, top-p, and a seed.

Every row of a batch carries its own parameters in device tensors, so one captured graph serves any
mix of requests: a row with temperature 0 takes the argmax, the others keep their top_k largest
logits (0: all), softmax at their temperature, keep the smallest prefix reaching top_p and invert
the cumulative distribution at a uniform number. A grammar-constrained row first has its
disallowed tokens set to -inf (:func:`mask_logits`, from a bitmask per row). Only the most tokens any row keeps is a shape
(``keep``: a power of two, or the whole vocabulary), so graphs are captured per ``keep``.

The uniform number of a row is a hash of (seed, position of the token drawn) (:mod:`qat4.ops.draws`):
a request with a seed draws the same numbers whoever shares its batch, eagerly or replayed, on any
device. The cumulative sums run over integer weights (probabilities in units of 2^-40): a GPU
prefix scan adds floats in an order that can change from run to run, and over a nucleus of
100,000+ nearly equal probabilities that moves the draw to a neighbouring token; integer sums are
the same in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qat4.errors import Qat4Error

_ONE = float(1 << 40)  # probability 1 as an integer weight (exact: a power of two)
MIN_KEEP = 64  # the smallest top-k shape a graph is captured for


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

    def effective_top_k(self, vocab_size: int) -> int:
        """top_k as kept tokens: 1 when greedy, the vocabulary size when it keeps every token."""
        if self.greedy:
            return 1
        return self.top_k if self.top_k and self.top_k < vocab_size else vocab_size


def keep_shape(top_ks: list[int], vocab_size: int) -> int:
    """The ``keep`` shape serving rows with these effective top_k: 1 when every row is greedy,
    else the next power of two (at least MIN_KEEP), or the vocabulary when that is no smaller."""
    most = max(top_ks, default=1)
    if most <= 1:
        return 1
    keep = max(MIN_KEEP, 1 << (most - 1).bit_length())
    return keep if keep < vocab_size else vocab_size


# ----------------------------------------------------------------------------------------------
# Sampling


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           uniform: torch.Tensor, keep: int) -> torch.Tensor:
    """Draw one token per row of logits [R, V] fp32 -> [R] int64, all on the device.

    temperature [R] fp32 (0: greedy, the first maximum), top_k [R] int64 (kept tokens, <= keep;
    the vocabulary for all), top_p [R] fp32 in (0, 1], uniform [R] float64 in [0, 1). ``keep`` is
    the static number of candidates (>= every row's top_k).
    """
    greedy = torch.argmax(logits, dim=-1)
    if keep >= logits.shape[-1]:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    else:
        values, ids = torch.topk(logits, keep, dim=-1)
    # in place where a [R, keep] temporary would otherwise be made: over the whole vocabulary
    # every 4 or 8 bytes per logit count, on a 4 GB card once per sampled row
    width = values.shape[-1]
    ranks = torch.arange(width, device=logits.device)
    values.masked_fill_(ranks >= top_k[:, None], float("-inf"))
    hot = temperature > 0
    values.div_(torch.where(hot, temperature, 1.0)[:, None])
    weights = torch.softmax(values, dim=-1).mul_(_ONE).long()  # the first >= 2^40 / V > 0
    del values
    before = weights.cumsum(-1).sub_(weights)
    # before < top_p * total (in float64), for an integer before: before < ceil(top_p * total)
    threshold = torch.ceil(top_p.double()[:, None] * weights.sum(-1, keepdim=True).double()).long()
    weights.mul_(before < threshold)  # the first stays
    del before
    cdf = weights.cumsum_(-1)
    target = (uniform * cdf[:, -1].double()).long()[:, None]  # < cdf[:, -1]: lands on a kept token
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=width - 1)
    return torch.where(hot, ids.gather(1, choice)[:, 0], greedy)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set, in place, the logits [R, V] of tokens not allowed by bitmasks [R, W] int32 (bit j of
    word i allows token 32 i + j; W * 32 >= V) to -inf, on the device; returns logits."""
    bits = (allowed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=allowed.device)) & 1
    return logits.masked_fill_(bits.view(allowed.shape[0], -1)[:, : logits.shape[-1]] == 0, float("-inf"))
