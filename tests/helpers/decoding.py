"""Builders shared by the decoding tests: a random drafter, the exact joint law of a round, a chi-square p-value."""

from __future__ import annotations

import itertools
import math

import torch
from dspark.modeling import Drafter, DrafterConfig
from dspark.sampling import logits_to_probs


# --------------------------------------------------------------------------- drafters
def random_drafter(target, *, gamma: int = 4, seed: int = 0, layers: int = 1, **fields) -> Drafter:
    """A drafter of the target's family with every parameter randomised (far from the target);
    ``fields`` set any other DrafterConfig field (e.g. draft_vocab_size)."""
    config = DrafterConfig.from_target_config(
        target.model.config,
        target_layer_ids=list(target.target_layer_ids),
        mask_token_id=target.vocab_size - 1,
        num_draft_layers=layers,
        block_size=gamma,
        markov_rank=8,
        **fields,
    )
    drafter = Drafter(config).attach_target(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.dim() == 2 and "markov_w1" not in name:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise)
    return drafter


def exact_joint(target, prompt: list[int], n: int, temperature: float) -> torch.Tensor:
    """P(x_0..x_{n-1} | prompt) of target-only sampling at T, by enumeration: [V]*n (float64)."""
    V = target.vocab_size
    joint = torch.ones(1, 1, dtype=torch.float64)
    for k in range(n):
        prefixes = torch.tensor(list(itertools.product(range(V), repeat=k)), dtype=torch.long).reshape(V**k, k)
        ids = torch.cat([torch.tensor(prompt).expand(V**k, -1), prefixes], dim=1)  # every continuation so far
        p = logits_to_probs(target(ids).logits[:, -1], temperature).double()  # [V^k, V]
        joint = joint.reshape(-1, 1) * p  # rows in the order of `prefixes`, i.e. row-major
    return joint.reshape([V] * n)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; cells expecting < 5 are pooled into one."""
    counts, probs = counts.reshape(-1).double(), probs.reshape(-1)
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
