"""Training anchors and their γ-token blocks (paper Section 3.3).

A training sequence yields several blocks. Each block starts at an anchor
position i (the token x_0 the drafter conditions on); block position
k = 1..γ predicts the token at i+k. These functions turn a batch of token ids
and loss masks into the tensors the drafter and the loss consume. They are
plain tensor functions so that the data path, not a model's ``forward``,
decides which anchors a step trains on.

Shapes: B sequences of length S, A anchors per sequence, γ = ``block_size``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["anchor_candidates", "sample_anchors", "block_labels", "target_positions"]


def _check_2d(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, S], got shape {tuple(t.shape)}")


def anchor_candidates(loss_mask: Tensor) -> Tensor:
    """Positions that may serve as anchors: ``loss_mask[i] and loss_mask[i+1]``.

    Args:
        loss_mask: [B, S], bool or 0/1, true on supervised (assistant) tokens.

    Returns:
        Bool [B, S]. The last position is never a candidate (nothing follows it).
    """
    _check_2d("loss_mask", loss_mask)
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return candidates


def sample_anchors(
    loss_mask: Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw up to ``num_anchors`` candidate positions per sequence, uniformly without replacement.

    Every candidate gets an independent uniform key and the ``num_anchors``
    largest keys win, which is a uniform draw without replacement; the result
    is then sorted by position.

    Args:
        loss_mask: [B, S], bool or 0/1.
        num_anchors: A ≥ 1, the static number of anchor slots per sequence.
        generator: optional generator on ``loss_mask``'s device, for reproducible draws.

    Returns:
        anchors: Long [B, A], ascending positions first, then padding (value 0).
        keep: Bool [B, A], false on padding; a row keeps min(#candidates, A) anchors.
    """
    if not isinstance(num_anchors, int) or num_anchors < 1:
        raise ValueError(f"num_anchors must be a positive int, got {num_anchors!r}")
    candidates = anchor_candidates(loss_mask)  # [B, S]
    batch, seq_len = candidates.shape
    keys = torch.rand(batch, seq_len, generator=generator, device=candidates.device)
    # Non-candidates get key -1, below every uniform key, so they lose to any candidate.
    keys = torch.where(candidates, keys, torch.full_like(keys, -1.0))
    k = min(num_anchors, seq_len)
    top_keys, top_pos = keys.topk(k, dim=1)  # [B, k]
    keep = top_keys >= 0
    # Padding sorts after every real position (seq_len > any index).
    order_key = torch.where(keep, top_pos, torch.full_like(top_pos, seq_len))
    order_key, _ = order_key.sort(dim=1)
    keep = order_key < seq_len
    anchors = torch.where(keep, order_key, torch.zeros_like(order_key))
    if k < num_anchors:  # static shape A even when S < A
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(batch, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(batch, pad)], dim=1)
    return anchors, keep


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Labels, supervision mask and teacher-forced previous tokens of every block.

    Block position k (1..γ) of anchor i predicts x*_k = input_ids[i+k]. It is
    valid iff i+k < S, loss_mask[i+k] and the anchor is kept; validity is then
    cut to a contiguous prefix (cumulative product), since a position after an
    unsupervised one can never be reached by prefix verification.

    Args:
        input_ids: Long [B, S].
        loss_mask: [B, S], bool or 0/1.
        anchors, keep: [B, A] from :func:`sample_anchors`.
        block_size: γ ≥ 1.

    Returns:
        labels: Long [B, A, γ], 0 where not valid (a safe index).
        valid: Bool [B, A, γ], prefix-closed along γ.
        prev_tokens: Long [B, A, γ], the previous token of each position under
            teacher forcing, [x_i, x*_1, …, x*_{γ−1}] (paper Eq. 5-7); 0 where not valid.
    """
    _check_2d("input_ids", input_ids)
    _check_2d("loss_mask", loss_mask)
    _check_2d("anchors", anchors)
    if loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if keep.shape != anchors.shape or anchors.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"anchors {tuple(anchors.shape)} and keep {tuple(keep.shape)} must both be [B, A] "
            f"with B = {input_ids.shape[0]} (from input_ids)"
        )
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    batch, seq_len = input_ids.shape
    num_anchors = anchors.shape[1]
    offsets = torch.arange(1, block_size + 1, device=anchors.device)  # [γ]
    pos = anchors.long()[:, :, None] + offsets  # [B, A, γ]
    inside = pos < seq_len
    flat_pos = pos.clamp(max=seq_len - 1).reshape(batch, num_anchors * block_size)  # [B, A·γ]
    in_mask = loss_mask.bool().gather(1, flat_pos).view(batch, num_anchors, block_size)
    valid = inside & in_mask & keep.bool()[:, :, None]
    valid = valid.long().cumprod(dim=-1).bool()  # contiguous prefix

    tokens = input_ids.gather(1, flat_pos).view(batch, num_anchors, block_size)
    labels = torch.where(valid, tokens, torch.zeros_like(tokens))
    anchor_tokens = input_ids.gather(1, anchors.long())  # [B, A]
    prev_tokens = torch.cat([anchor_tokens[:, :, None], labels[:, :, :-1]], dim=-1)  # [B, A, γ]
    prev_tokens = torch.where(valid, prev_tokens, torch.zeros_like(prev_tokens))
    return labels, valid, prev_tokens


def target_positions(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:
    """Sequence position whose target final hidden state gives p^t_k: i+k−1, k = 1..γ.

    Args:
        anchors: Long [B, A].
        block_size: γ.
        seq_len: S; positions are clamped into [0, S−1] (clamped ones are never valid).

    Returns:
        Long [B, A, γ].
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len!r}")
    offsets = torch.arange(block_size, device=anchors.device)  # [γ]
    return (anchors.long()[..., None] + offsets).clamp(0, seq_len - 1)
