"""From logits to tokens: the temperature softmax, inverse-CDF sampling and the next-token rule.

Shared by the drafter (``dspark.modeling.drafter``), the verifiers
(``dspark.decoding.verify``), the decoding loops (``dspark.decoding.loop``) and, through
them, the serving simulator: every token of the library is drawn here, so a
wall-clock comparison between two loops measures the loops and nothing else.
Every random draw goes through the ``generator`` argument.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logits_to_probs(logits: Tensor, temperature: float) -> Tensor:
    """Softmax of ``logits / temperature`` over the last dim, computed in fp32.

    Args:
        logits: [..., V], any floating dtype.
        temperature: T > 0. Temperature 0 is greedy decoding: use
            ``greedy_verify`` / argmax instead of probabilities.

    Returns:
        [..., V] float32 probabilities. Draft tokens must be sampled from
        exactly these probabilities and the same tensor handed to
        ``rejection_sample`` (sampling from a bf16 softmax would break losslessness).
    """
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r}; "
            "for temperature 0 (greedy) take the argmax of the logits and verify with greedy_verify"
        )
    if value == 1.0:  # no scaled copy of a [.., V] tensor at the default temperature
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.softmax(logits.float() / value, dim=-1)


def sample_categorical(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of non-negative ``weights`` [B, V], with P(i) ∝ weights[i].

    Inverse CDF on one uniform per row; the CDF is accumulated in float64 so
    that tokens with tiny mass in a large vocabulary keep their probability.
    """
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=torch.float64)
    # First i with cdf_i > u·total. As u < 1, u·total < total in float64, so such an i exists
    # and cdf_i > cdf_{i-1}: a token without mass is never drawn. The clamp only guards
    # against an all-zero row (invalid input).
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [B]
    return index.clamp(max=weights.shape[-1] - 1)


def sample_token(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of logits [B, V]: the argmax at T = 0, else a draw from softmax(logits/T). -> [B]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_categorical(logits_to_probs(logits, temperature), generator)
