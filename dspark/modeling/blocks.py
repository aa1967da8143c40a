"""The inputs of the drafter's training forward over many blocks (Eq. 3): the shape checks that run
before any work, and the block attention mask."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def check_forward_inputs(config: Any, features: Tensor, input_ids: Tensor, anchors: Tensor,
                         keep: Tensor | None = None) -> None:
    """The training forward's shapes, checked before any work; a ValueError names the argument and
    the shape it needs (features [B, S, m·d] from the target layers `target_layer_ids`)."""
    m, d = len(config.target_layer_ids), config.hidden_size

    def shape(t: Any) -> str:
        return list(t.shape) if isinstance(t, Tensor) else type(t).__name__

    for name, t in (("features", features), ("input_ids", input_ids), ("anchors", anchors)):
        if not isinstance(t, Tensor):
            raise ValueError(f"Drafter.forward: {name} must be a tensor, got {type(t).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"Drafter.forward: input_ids must be integer token ids [B, S], got {input_ids.dtype} "
                         f"{shape(input_ids)}; a single sequence is input_ids[None]")
    B, S = input_ids.shape
    if features.dim() != 3 or tuple(features.shape) != (B, S, m * d):
        raise ValueError(
            f"Drafter.forward: features must be [B, S, m·d] = [{B}, {S}, {m * d}] (the target's hidden states "
            f"at the drafter's {m} layers {list(config.target_layer_ids)}, concatenated), got "
            f"{shape(features)}; capture them with a TargetModel built with those target_layer_ids"
        )
    if anchors.dim() != 2 or anchors.shape[0] != B or anchors.dtype.is_floating_point:
        raise ValueError(f"Drafter.forward: anchors must be integer positions [B, A] = [{B}, A], got "
                         f"{anchors.dtype} {shape(anchors)}; one sequence's anchors a [A] are a[None] "
                         "(dspark.sample_anchors returns them batched)")
    if keep is not None and (not isinstance(keep, Tensor) or tuple(keep.shape) != tuple(anchors.shape)):
        raise ValueError(f"Drafter.forward: keep must be a bool tensor shaped like anchors {shape(anchors)}, "
                         f"got {shape(keep)}")


def training_mask(anchors: Tensor, keep: Tensor, seq_len: int, block_len: int, impl: str = "sdpa") -> Any:
    """The block mask of Eq. 3 for A blocks per row: query slot of block a sees context j < anchors[a]
    and all slots of block a. Padding blocks (keep False) see only their own block (their
    outputs are never supervised; this avoids fully masked rows).

    Returns a bool [B, 1, A·L, S + A·L] (True = attend) or, for impl="flex", a BlockMask.
    """
    B, A = anchors.shape
    Q = A * block_len
    device = anchors.device
    eff_anchor = torch.where(keep, anchors, torch.zeros_like(anchors))
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            blk = q_idx // block_len
            in_ctx = (kv_idx < seq_len) & (kv_idx < eff_anchor[b, blk])
            same_blk = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_len == blk)
            return in_ctx | same_blk

        return create_block_mask(mask_mod, B=B, H=None, Q_LEN=Q, KV_LEN=seq_len + Q, device=device)
    q_blk = torch.arange(Q, device=device) // block_len  # [Q]
    ctx_vis = torch.arange(seq_len, device=device).view(1, 1, -1) < eff_anchor[:, q_blk].unsqueeze(-1)  # [B, Q, S]
    blk_vis = (q_blk.unsqueeze(1) == q_blk.unsqueeze(0)).expand(B, Q, Q)  # [B, Q, Q]
    return torch.cat([ctx_vis, blk_vis], dim=-1).unsqueeze(1)
