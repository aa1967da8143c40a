"""The answer generator's sampler: temperature, top-k, then top-p, drawn on the k survivors only.

``transformers``' sampling path (``do_sample=True`` with ``top_k`` and ``top_p``) applies the
temperature, masks all but the top k logits, then sorts the whole vocabulary for top-p and draws
from a softmax over the whole vocabulary: on a CPU with V = 49,152 and 32 rows that is a sizeable
share of a small target's decoding step, spent on tokens top-k has already excluded. The
distribution it draws from depends on the k survivors alone, so ``TopKTopPSampler`` computes the
same distribution on them (``topk_topp_probs``), draws the token there, and hands ``generate`` a
score row whose only finite entry is that token, which greedy selection (``do_sample=False``)
then takes. The result is a draw from the distribution of ``transformers``' warpers
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``; tested against them);
the one difference: where several logits tie at the k-th value, ``TopKLogitsWarper`` keeps them
all and this keeps k.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessor

__all__ = ["TopKTopPSampler", "topk_topp_probs"]


def topk_topp_probs(scores: Tensor, temperature: float, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """(probabilities [B, k'], their token ids [B, k']) of the temperature / top-k / top-p distribution
    of ``scores`` [B, V], k' = min(top_k, V), in increasing logit order.

    Top-p as ``TopPLogitsWarper`` applies it after top-k: sorted increasingly, a token is removed when
    the probability of it and every smaller one (softmax over the survivors) is at most 1 − top_p;
    the largest is always kept."""
    k = min(int(top_k), scores.shape[-1])
    values, ids = torch.topk(scores.float() / float(temperature), k, dim=-1)  # [B, k], decreasing
    values, ids = values.flip(-1), ids.flip(-1)  # increasing, as TopPLogitsWarper sorts
    if top_p < 1.0:
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1.0 - float(top_p)
        remove[..., -1] = False
        values = values.masked_fill(remove, float("-inf"))
    return values.softmax(dim=-1), ids


class TopKTopPSampler(LogitsProcessor):
    """A ``LogitsProcessor`` for ``generate(do_sample=False)`` that samples instead (module docstring):
    each row's next token is drawn from ``topk_topp_probs`` with the global generator (``generate``'s
    own sampling uses it too), and the returned scores [B, V] are −inf except 0 at that token."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature!r} (0 is greedy: no sampler)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, float(top_p)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        probs, ids = topk_topp_probs(scores, self.temperature, self.top_k, self.top_p)
        chosen = ids.gather(-1, torch.multinomial(probs, num_samples=1))  # [B, 1]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, chosen, 0.0)
