"""The DSpark loss of a batch in one call (paper Section 3.3, Eq. 8-12): :func:`block_loss`.

It wires what a training step wires: the drafter over every anchor's block
(``drafter(features, input_ids, anchors, keep)`` -> h_1..h_γ [B, A, γ, d]), the labels, supervision
mask and teacher-forced previous tokens of each block (``dspark.data.anchors.block_labels``), the
target's final hidden states at positions i+k−1 (``target_positions``) for p^t_k, the confidence
logits (Eq. 7) and the loss, fused with the LM head (dspark.training.fused_loss) or chunked over
rows (dspark.training.loss.dspark_loss, ``fused=False``). The trainer's micro-step
(dspark.training.step.DraftLossModule) runs the same :func:`block_terms` with the global-batch
denominator. :func:`logit_factors` is the one place that reads the drafter's sequential head
for the fused loss.
"""

from __future__ import annotations

import logging

from typing import Any

import torch
from torch import Tensor

from dspark.data.anchors import block_labels, target_positions
from dspark.training.fused_loss import LogitFactors, fused_dspark_loss
from dspark.training.loss import LossOutput, LossWeights, dspark_loss

__all__ = ["block_loss", "block_terms", "logit_factors"]

log = logging.getLogger(__name__)


def block_loss(
    drafter: Any,
    target_out: Any,
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor | None = None,
    *,
    weights: LossWeights | None = None,
    chunk_rows: int = 64,
    fused: bool = True,
    denominator: Tensor | None = None,
) -> LossOutput:
    """The DSpark loss (Eq. 12) of a batch: the drafter over every anchor's block, scored against
    the target.

    Args:
        drafter: a DSpark or DFlash ``dspark.Drafter`` attached to the target.
        target_out: the target's forward on ``input_ids`` (``target(input_ids, return_logits=False)``:
            its ``features`` [B, S, m·d] and ``last_hidden`` [B, S, d]), or the pair
            (features, final_hidden) from a feature cache.
        input_ids: Long [B, S]; loss_mask [B, S], 1 on supervised (assistant) tokens.
        anchors: Long [B, A] block starts, keep Bool [B, A] (None: all kept), as
            ``dspark.sample_anchors(loss_mask, A)`` draws them.
        weights: the α of Eq. 12 and the position decay (default ``LossWeights()``).
        chunk_rows, fused: blocks per chunk of vocabulary-sized work; the fused LM-head path or
            the chunked generic one (same values).
        denominator: None for the weighted mean over this batch's supervised positions;
            ``torch.ones(())`` for raw weighted sums (divide by a global D yourself, as the trainer does).

    Returns:
        ``LossOutput``: ``loss`` (with grad) and its detached parts ``ce``, ``tv``, ``conf``,
        ``accept_sum`` / ``count`` (per-position acceptance), ``prefix_sum`` / ``blocks`` (τ_prob).
    """
    features, final_hidden = _target_states(target_out)
    check_block_inputs(drafter, features, final_hidden, input_ids, loss_mask, anchors, keep)
    if keep is None:
        keep = torch.ones_like(anchors, dtype=torch.bool)
    out, _ = block_terms(drafter, features, final_hidden, input_ids, loss_mask, anchors, keep,
                         weights or LossWeights(), chunk_rows, fused, denominator)
    return out


def block_terms(
    drafter: Any, features: Tensor, final_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor,
    keep: Tensor, weights: LossWeights, chunk_rows: int, fused: bool, denominator: Tensor | None,
) -> tuple[LossOutput, Tensor]:
    """(the loss of the blocks, their supervision mask valid Bool [B, A, γ]), unchecked: the shapes
    of :func:`block_loss`'s arguments, ``keep`` given."""
    gamma = drafter.config.block_size
    B, S = input_ids.shape
    labels, valid, prev = block_labels(input_ids, loss_mask, anchors, keep, gamma)  # [B, A, γ] each
    hidden = drafter(features, input_ids, anchors, keep)  # [B, A, γ, d]
    tpos = target_positions(anchors, gamma, S)  # [B, A, γ]
    t_hidden = final_hidden.gather(1, tpos.reshape(B, -1, 1).expand(-1, -1, final_hidden.shape[-1]))
    t_hidden = t_hidden.reshape(-1, gamma, final_hidden.shape[-1])  # [N, γ, d]
    h_flat = hidden.reshape(-1, gamma, hidden.shape[-1])  # [N, γ, d]
    prev_flat = prev.reshape(-1, gamma)
    conf = drafter.confidence_logits(h_flat, prev_flat)
    t_rows = (torch.arange(B, device=tpos.device)[:, None, None] * S + tpos).reshape(-1, gamma)  # [N, γ]
    labels, valid_flat = labels.reshape(-1, gamma), valid.reshape(-1, gamma)
    factors = logit_factors(drafter, h_flat, prev_flat, t_hidden, t_rows) if fused else None
    if factors is not None:
        out = fused_dspark_loss(factors, labels, valid_flat, conf, weights, chunk_rows=chunk_rows,
                                denominator=denominator)
        return out, valid

    def draft_logits_fn(r0: int, r1: int) -> Tensor:
        return drafter.draft_logits(h_flat[r0:r1], prev_flat[r0:r1])

    def target_logits_fn(r0: int, r1: int) -> Tensor:
        return drafter.compute_logits(t_hidden[r0:r1], full=True)

    # A draft vocabulary: k-sized draft side, p^t restricted (dspark.training.loss).
    out = dspark_loss(draft_logits_fn, target_logits_fn, labels, valid_flat, conf, weights, chunk_rows=chunk_rows,
                      denominator=denominator, vocab=drafter.vocab)
    return out, valid


def logit_factors(drafter: Any, h_flat: Tensor, prev_flat: Tensor, t_hidden: Tensor,
                  t_rows: Tensor) -> LogitFactors | None:
    """The fused loss's factors of a drafter's N blocks: its hidden states h_flat [N, γ, d], the frozen
    LM head, the sequential head's ``fused_factors`` (latents and W2, bias = latent·W2ᵀ, Eq. 5-6; none
    for DFlash), the target's final hidden states t_hidden [N, γ, d] at rows t_rows [N, γ] (prev_flat
    [N, γ] the teacher-forced previous tokens). None when the head cannot feed the fused loss
    (``SequentialHead.fused_factors`` returns None): the caller takes the chunked loss instead."""
    vocab = drafter.vocab
    head = drafter.markov_head
    latent = w2 = None
    if head is not None:
        parts = head.fused_factors(prev_flat, h_flat)
        if parts is None:
            _say_fallback(type(head))
            return None
        latent, w2 = parts
    return LogitFactors(
        h_flat, drafter.shared_weights()["lm_head.weight"], t_hidden,
        latent=latent, w2=w2,
        softcap=drafter.config.final_logit_softcapping,
        vocab=vocab, target_lm_head_weight=None if vocab is None else drafter.target_lm_head_weight(),
        target_rows=t_rows,
    )


_FALLBACK_SAID: set[type] = set()


def _say_fallback(cls: type) -> None:
    """Log once per head class that its blocks take the chunked loss."""
    if cls not in _FALLBACK_SAID:
        _FALLBACK_SAID.add(cls)
        log.info("%s has no fused_factors (its bias is not latent @ W2ᵀ): the fused loss falls back to the "
                 "chunked loss (loss.fused=false), same value, more memory", cls.__qualname__)


def _target_states(target_out: Any) -> tuple[Tensor, Tensor]:
    """(features [B, S, m·d], final hidden states [B, S, d]) of a TargetOutput or a pair."""
    if hasattr(target_out, "features") and hasattr(target_out, "last_hidden"):
        return target_out.features, target_out.last_hidden
    if isinstance(target_out, (tuple, list)) and len(target_out) == 2:
        return target_out[0], target_out[1]
    raise TypeError(
        "target_out must be the target's output on input_ids (target(input_ids, return_logits=False), with "
        f".features and .last_hidden) or a pair (features, final_hidden); got {type(target_out).__name__}"
    )


def _shape(t: Any) -> tuple[int, ...] | str:
    return tuple(t.shape) if hasattr(t, "shape") else type(t).__name__


def check_block_inputs(drafter: Any, features: Tensor, final_hidden: Tensor, input_ids: Tensor, loss_mask: Tensor,
                       anchors: Tensor, keep: Tensor | None) -> None:
    """ValueError naming the argument of :func:`block_loss` whose shape is wrong, before any forward."""
    config = drafter.config
    if getattr(config, "variant", None) == "eagle3":
        raise ValueError("block_loss trains a DSpark or DFlash drafter; an Eagle3 drafter trains with its "
                         "training-time-test loss (dspark.training.eagle3_loss.Eagle3LossModule)")
    if getattr(input_ids, "dim", lambda: 0)() != 2:
        raise ValueError(f"input_ids must be 2-D [B, S] (one row per sequence; for one sequence pass "
                         f"input_ids[None]), got shape {_shape(input_ids)}")
    B, S = input_ids.shape
    if tuple(getattr(loss_mask, "shape", ())) != (B, S):
        raise ValueError(f"loss_mask must be [B, S] = {(B, S)} like input_ids (1 on supervised tokens), "
                         f"got shape {_shape(loss_mask)}")
    if getattr(anchors, "dim", lambda: 0)() != 2 or anchors.shape[0] != B:
        raise ValueError(
            f"anchors must be 2-D [B, A] with B = {B} (one row of block starts per sequence, as "
            f"dspark.sample_anchors(loss_mask, A) returns them), got shape {_shape(anchors)}"
            + ("; for one sequence pass anchors[None]" if getattr(anchors, "dim", lambda: 0)() == 1 else "")
        )
    if keep is not None and tuple(getattr(keep, "shape", ())) != tuple(anchors.shape):
        raise ValueError(f"keep must be Bool [B, A] = {tuple(anchors.shape)} like anchors (False: a padding "
                         f"anchor), got shape {_shape(keep)}")
    width = len(config.target_layer_ids) * config.hidden_size
    if tuple(getattr(features, "shape", ())) != (B, S, width):
        raise ValueError(
            f"features must be [B, S, m·d] = {(B, S, width)} (the target's hidden states at its "
            f"{len(config.target_layer_ids)} layers {list(config.target_layer_ids)}), got shape {_shape(features)}"
        )
    if tuple(getattr(final_hidden, "shape", ())) != (B, S, config.hidden_size):
        raise ValueError(f"final hidden states must be [B, S, d] = {(B, S, config.hidden_size)} (the target's "
                         f"last_hidden), got shape {_shape(final_hidden)}")
