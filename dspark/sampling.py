"""From logits to tokens: the temperature softmax, inverse-CDF sampling and the next-token rule.

Shared by the drafter (``dspark.modeling.drafter``), the verifiers
(``dspark.decoding.verify``), the decoding loops (``dspark.decoding.loop``) and, through
them, the serving simulator: every token of the library is drawn here, so a
wall-clock comparison between two loops measures the loops and nothing else.
Every random draw goes through the ``generator`` argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

# One generator for every row, or one per row (``dspark.decoding.batched``: each request of a
# batch keeps its own stream, so its tokens are those it would draw decoding alone).
Generators = Union[torch.Generator, Sequence[torch.Generator], None]


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


def uniforms(rows: int, n: int, generator: Generators, device: torch.device | str,
             dtype: torch.dtype = torch.float64) -> Tensor:
    """[rows, n] U(0, 1) draws. With one generator (or None) one ``torch.rand(rows, n)``; with a
    sequence of ``rows`` generators, row r is ``torch.rand(1, n)`` of generator r, the draw that
    row would make decoding alone (batch 1)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, n, generator=generator, device=device, dtype=dtype)
    if len(generator) != rows:
        raise ValueError(f"got {len(generator)} generators for {rows} rows; pass one per row or a single generator")
    return torch.cat([torch.rand(1, n, generator=g, device=device, dtype=dtype) for g in generator])


def sample_categorical(weights: Tensor, generator: Generators = None) -> Tensor:
    """One index per row of non-negative ``weights`` [B, V], with P(i) ∝ weights[i].

    Inverse CDF on one uniform per row; the CDF is accumulated in float64 so
    that tokens with tiny mass in a large vocabulary keep their probability.
    ``generator``: one for all rows, or one per row (``uniforms``).
    """
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = uniforms(weights.shape[0], 1, generator, weights.device)
    # First i with cdf_i > u·total. As u < 1, u·total < total in float64, so such an i exists
    # and cdf_i > cdf_{i-1}: a token without mass is never drawn. The clamp only guards
    # against an all-zero row (invalid input).
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [B]
    return index.clamp(max=weights.shape[-1] - 1)


def sample_token(logits: Tensor, temperature: float, generator: Generators = None) -> Tensor:
    """One token per row of logits [B, V]: the argmax at T = 0, else a draw from softmax(logits/T). -> [B]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_categorical(logits_to_probs(logits, temperature), generator)
