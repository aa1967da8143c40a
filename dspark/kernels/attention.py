"""A CPU attention kernel choice for the target's multi-token forwards (verification, prefill).

transformers' ``sdpa`` attention expands the key/value heads of a grouped-query model
(``repeat_kv``: a copy of the whole KV cache per layer) whenever it passes a mask, which it
does for every forward of more than one query token over a cache: the γ+1 tokens a
speculative round verifies. ``torch.nn.functional.scaled_dot_product_attention`` takes the
grouped heads directly (``enable_gqa=True``) with the same mask and returns the same
numbers, without the copies. ``sdpa_gqa`` is that, registered with transformers'
``AttentionInterface`` (and its mask builder is ``sdpa``'s), and falls back to transformers'
own ``sdpa`` function wherever the shortcut does not apply: on accelerators (where the masked
GQA kernels differ by backend), for one query token (transformers already packs the heads; but
see the split below), with dropout, a soft-cap or a position bias. `TargetModel.from_pretrained` uses it on CPU
in place of ``sdpa``: it shortens a few-token verification forward (``bench/decode_round.py``),
with identical outputs.

A verification forward of several rows (the batched decoder's R rows of 1 + ℓ tokens) packs
the g query heads that share a key/value head into one head of g·q query rows
([B, H, q, D] -> [B, H_kv, g·q, D], the mask repeated per head), so that the kernel reads each
key/value block once for all g heads instead of once per head. The result is the same
attention (each query row still sees only its own mask row). It pays when the packed rows are
few (g·q <= ``PACKED_ROWS``) and there are enough (row, key/value head) pairs to keep every
thread busy (B·H_kv >= 2 · threads); bench/studies.md has the measurements.

The rows of a batch hold different lengths, and one pass reads every row up to the longest row's
end: the columns past a shorter row's end are masked yet still read. Within ``row_extents`` (the
batched cache's forward: row r's queries see only its first extents[r] columns) the packed
attention of a full-attention layer may split at a column C (``_ragged_split``, a cost model in
columns read): every row over its first C columns in one call, each longer row over its own
columns past C in its own call (a view), and the two parts merged by their log-sum-exps
(``_ragged_attention``). It pays where one row is far longer than the rest, as in an evaluation's
first rows, the longest prompts. One-token forwards (the target-only steps of R rows) split by the
same rule; where they do not, transformers' own attention runs them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
        groups == 1 or query.device.type != "cpu" or dropout
        or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
        # sdpa's is_causal aligns the mask to the top left: only right when q and kv coincide
        or (attention_mask is None and causal and q_len != kv_len)
    )
    # one query per row: transformers packs the heads itself, and only a split (rows far apart) reads fewer columns
    if plain or (q_len == 1 and (attention_mask is None or _ragged_split(module, query, key) is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None and (q_len == 1 or _pack_heads(query, key, groups)):
        split = _ragged_split(module, query, key)
        if split is not None:
            return _ragged_attention(query, key, value, attention_mask, scaling, groups, split), None
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
    kv_heads = key.shape[1]
    packed_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed_query, key, value,
                                                           attn_mask=_packed_mask(mask, heads, kv_heads, groups),
                                                           scale=scaling)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous()


def _packed_mask(mask: Tensor, heads: int, kv_heads: int, groups: int, additive: bool = False) -> Tensor:
    """The mask [B, 1 or H, q, kv] of the packed layout, [B, 1 or H_kv, g·q, kv] (``additive``: as
    0 / −inf in the query's dtype, which the kernel that returns the log-sum-exp takes); made once per
    forward within ``row_extents`` (every layer gets the same mask)."""
    memo = getattr(_PLAN, "masks", None)
    key = (mask.data_ptr(), tuple(mask.shape), mask.dtype, groups, additive)
    if memo is not None and key in memo:
        return memo[key]
    batch, _, q_len, kv_len = mask.shape
    if mask.shape[1] == 1:
        packed = mask.unsqueeze(2).expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)
    else:
        packed = mask.expand(batch, heads, q_len, kv_len).reshape(batch, kv_heads, groups * q_len, kv_len)
    if additive and packed.dtype == torch.bool:
        packed = torch.zeros(packed.shape, dtype=_PLAN.dtype, device=packed.device).masked_fill_(~packed, float("-inf"))
    if memo is not None:
        memo[key] = packed
    return packed


# The split's cost model, fitted to timed calls on 2 CPU threads (bench/studies.md): a key/value
# column of a row costs about COLUMN_US[0] + COLUMN_US[1]·q µs (in the batch's call or a row's own),
# and a row whose keys run past the split one more kernel call and a merge, about
# EXTRA_CALL_US[0] + EXTRA_CALL_US[1]·q µs.
COLUMN_US = (0.070, 0.033)
EXTRA_CALL_US = (96.0, 8.0)


def split_cost_columns(q_len: int) -> float:
    """One more kernel call and its merge, in key/value columns of one row at q_len queries per row."""
    return (EXTRA_CALL_US[0] + EXTRA_CALL_US[1] * q_len) / (COLUMN_US[0] + COLUMN_US[1] * q_len)


def _ragged_split(module: torch.nn.Module, query: Tensor, key: Tensor) -> int | None:
    """The column C that splits a batched forward's attention into all rows' first C columns and the
    longer rows' own columns past C (``_ragged_attention``), or None when one pass over every row's
    columns costs less. Within ``row_extents`` only, on full-attention layers: row r reads columns
    0 .. extents[r] − 1, so a row of the split reads its first C columns whole."""
    extents = getattr(_PLAN, "extents", None)
    if extents is None or query.device.type != "cpu" or len(extents) != query.shape[0]:
        return None
    if max(extents) != key.shape[2] or getattr(module, "is_sliding", False) or getattr(module, "sliding_window", None):
        return None
    q_len, rows = query.shape[2], len(extents)
    memo = _PLAN.masks  # the same for every full-attention layer of the forward
    if ("split", q_len) in memo:
        return memo[("split", q_len)]
    best, split, extra = float(rows * max(extents)), None, split_cost_columns(q_len)
    for c in sorted(set(extents))[:-1]:
        # every row either ends by C or sees all of 0..C (its past holds C columns): no empty chunk
        if any(c < e < c + q_len for e in extents):
            continue
        cost = rows * c + sum(extra + (e - c) for e in extents if e > c)
        if cost < best:
            best, split = cost, c
    memo[("split", q_len)] = split
    return split


def _ragged_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float | None,
                      groups: int, split: int) -> Tensor:
    """``_packed_attention`` of rows of different lengths (``row_extents``) in two parts: every row
    over its first ``split`` columns in one call, and each row longer than that over its own columns
    past it (a view, no copy), the two merged by their log-sum-exps:
    o = (e^{l₁}·o₁ + e^{l₂}·o₂) / (e^{l₁} + e^{l₂}). The same attention, without reading the
    columns past each shorter row's end."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    packed_query = query.reshape(batch, kv_heads, groups * q_len, dim)
    packed_mask = _packed_mask(mask, heads, kv_heads, groups, additive=True)
    out, lse = flash(packed_query, key[:, :, :split], value[:, :, :split], attn_mask=packed_mask[..., :split],
                     scale=scaling)
    for r, end in enumerate(_PLAN.extents):
        if end <= split:
            continue
        rest, rest_lse = flash(packed_query[r : r + 1], key[r : r + 1, :, split:end], value[r : r + 1, :, split:end],
                               attn_mask=packed_mask[r : r + 1, :, :, split:end], scale=scaling)
        first_lse = lse[r : r + 1]
        top = torch.maximum(first_lse, rest_lse)
        a, b = (first_lse - top).exp_(), (rest_lse - top).exp_()
        total = a + b
        merged = out[r : r + 1].float() * (a / total).unsqueeze(-1) + rest.float() * (b / total).unsqueeze(-1)
        out[r : r + 1] = merged.to(out.dtype)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()


_PLAN = threading.local()


@contextmanager
def row_extents(extents: Sequence[int], dtype: torch.dtype = torch.float32) -> Iterator[None]:
    """Within the block (this thread), the multi-token forwards' queries of row r see only that row's
    first extents[r] key/value columns (a causal mask within them): the batched cache's layout
    (``dspark.decoding.batch_state.BatchKVCache``), which lets the attention read fewer columns
    (``_ragged_attention``). ``dtype``: the queries' (for the additive mask the split kernel takes)."""
    before = (getattr(_PLAN, "extents", None), getattr(_PLAN, "masks", None), getattr(_PLAN, "dtype", None))
    _PLAN.extents, _PLAN.masks, _PLAN.dtype = [int(e) for e in extents], {}, dtype
    try:
        yield
    finally:
        _PLAN.extents, _PLAN.masks, _PLAN.dtype = before


def register() -> str:
    """Register ``sdpa_gqa`` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
