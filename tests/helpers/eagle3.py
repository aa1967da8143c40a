"""A tiny Eagle3 drafter over a tiny target."""

from __future__ import annotations

import torch
from dspark.modeling import DrafterConfig, Eagle3Drafter


def tiny_eagle3(target, preset: str = "eagle3_deepspec", seed: int = 0, **fields) -> Eagle3Drafter:
    cfg = DrafterConfig.from_target_config(
        target.model.config, target_layer_ids=list(target.target_layer_ids),
        mask_token_id=0, num_draft_layers=1, variant="eagle3", eagle3_preset=preset, block_size=4,
        markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False, **fields,
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():  # visible norms and larger weights, so that every path changes the numbers
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return drafter.attach_target(target)
