"""A CPU attention kernel choice for the target's multi-token forwards (verification, prefill).

transformers' ``sdpa`` attention expands the key/value heads of a grouped-query model
(``repeat_kv``: a copy of the whole KV cache per layer) whenever it passes a mask, which it
does for every forward of more than one query token over a cache: the γ+1 tokens a
speculative round verifies. ``torch.nn.functional.scaled_dot_product_attention`` takes the
grouped heads directly (``enable_gqa=True``) with the same mask and returns the same
numbers, without the copies. ``sdpa_gqa`` is that, registered with transformers'
``AttentionInterface`` (and its mask builder is ``sdpa``'s), and falls back to transformers'
own ``sdpa`` function wherever the shortcut does not apply: on accelerators (where the masked
GQA kernels differ by backend), for one query token (transformers already packs the heads),
with dropout, a soft-cap or a position bias. `TargetModel.from_pretrained` uses it on CPU
in place of ``sdpa``: it shortens a few-token verification forward (``bench/decode_round.py``),
with identical outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "sdpa_gqa"


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, H_kv, kv, D]
    -> ([B, q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = (
        groups == 1 or q_len == 1 or query.device.type != "cpu" or dropout
        or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
        # sdpa's is_causal aligns the mask to the top left: only right when q and kv coincide
        or (attention_mask is None and causal and q_len != kv_len)
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling,
        is_causal=bool(attention_mask is None and causal), enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``sdpa_gqa`` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
