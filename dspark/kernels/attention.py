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

A verification forward of several rows (the batched decoder's R rows of 1 + ℓ tokens) packs
the g query heads that share a key/value head into one head of g·q query rows
([B, H, q, D] -> [B, H_kv, g·q, D], the mask repeated per head), so that the kernel reads each
key/value block once for all g heads instead of once per head. The result is the same
attention (each query row still sees only its own mask row). It pays when the packed rows are
few (g·q <= ``PACKED_ROWS``) and there are enough (row, key/value head) pairs to keep every
thread busy (B·H_kv >= 2 · threads); bench/studies.md has the measurements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "sdpa_gqa"
PACKED_ROWS = 32  # at most this many query rows g·q per key/value head in the packed layout


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
    if attention_mask is not None and _pack_heads(query, key, groups):
        return _packed_attention(query, key, value, attention_mask, scaling, groups), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling,
        is_causal=bool(attention_mask is None and causal), enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def _pack_heads(query: Tensor, key: Tensor, groups: int) -> bool:
    """Whether the packed layout pays for this forward (module docstring)."""
    batch, kv_heads = query.shape[0], key.shape[1]
    return groups * query.shape[2] <= PACKED_ROWS and batch * kv_heads >= 2 * torch.get_num_threads()


def _packed_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float | None,
                      groups: int) -> Tensor:
    """Masked attention with the g query heads of each key/value head packed as g·q query rows.

    query [B, H, q, D], key/value [B, H_kv, kv, D], mask [B, 1 or H, q, kv] (bool or additive)
    -> [B, q, H, D]. Query head h = j·g + i belongs to key/value head j (transformers' repeat_kv
    order), so [B, H, q, D] viewed as [B, H_kv, g·q, D] lists head j's g query heads one after the
    other, and its mask rows are the head's own mask rows in the same order."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    packed_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    if mask.shape[1] == 1:
        packed_mask = mask.unsqueeze(2).expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)
    else:
        packed_mask = mask.expand(batch, heads, q_len, kv_len).reshape(batch, kv_heads, groups * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(packed_query, key, value, attn_mask=packed_mask,
                                                           scale=scaling)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()


def register() -> str:
    """Register ``sdpa_gqa`` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
