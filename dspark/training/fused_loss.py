"""The DSpark loss (Eq. 8-12) fused with the LM head: gradients computed in the forward pass.

:func:`fused_dspark_loss` takes the small factors of drafter-shaped logits (:class:`LogitFactors`:
draft softcap(h W_lmᵀ) + latent W2ᵀ, the frozen LM head plus the sequential head's rank-r bias, and
target softcap(h_t W_lmᵀ)) instead of the logits callables of :func:`dspark.training.loss.dspark_loss`,
which stays the general path (any logits) and the reference this one is tested against. The
gradients of CE (Eq. 9) and TV (Eq. 10) w.r.t. the draft logits have closed forms, so one forward
pass per chunk yields the terms and the gradients w.r.t. the chunk's small inputs (hidden, latent,
W2), and no logits are recomputed. Here: the inputs and their checks, the autograd op
:class:`_FusedCeTv` and the reduction; the pass is dspark.training.fused_pass.

docs/training.md (the fused LM-head pass): the closed forms, the cost per position and why the
result is dspark_loss's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dspark.training.fused_pass import _FixedInputs, _fused_ce_tv, _fused_compute_dtype, _Want
from dspark.training.loss import (
    LossOutput,
    LossWeights,
    check_loss_inputs,
    reduce_terms,
    weights_and_denominator,
)
from dspark.modeling.vocab import DraftVocab

__all__ = ["LogitFactors", "fused_dspark_loss"]


# ------------------------------------------------------------------ the inputs
@dataclass
class LogitFactors:
    """The small tensors the fused loss forms both logits from, chunk by chunk, instead of
    taking the logits: draft z = softcap(h W_lmᵀ) + latent W2ᵀ (Eq. 5-6 for the bias) and
    target softcap(h_t W_tᵀ), W_t = W_lm without a draft vocabulary.

    With a draft vocabulary of k ids (``vocab``) the draft side is k-sized (``lm_head_weight``
    [k, d], ``w2`` [k, r]) and p^t comes from the full [V, d] ``target_lm_head_weight``
    (restriction and dropped positions as in docs/training.md).
    """

    hidden: Tensor  # [N, γ, d] draft hidden states h_1..h_γ (with grad), any float dtype
    lm_head_weight: Tensor  # [V, d] ([k, d]) the frozen shared LM head; its matmuls run in its dtype
    target_hidden: Tensor  # [N, γ, d] the target's final hidden states at positions i+k−1 (constants)
    latent: Tensor | None = None  # [N, γ, r] the sequential head's rank-r latents; None: DFlash
    w2: Tensor | None = None  # [V, r] ([k, r]) the sequential head's W2, given iff ``latent`` is
    softcap: float | None = None  # c of the final-logit soft-cap c·tanh(x/c) (Gemma), or None
    vocab: DraftVocab | None = None  # a draft vocabulary, or None
    target_lm_head_weight: Tensor | None = None  # [V, d] the full head p^t comes from, iff ``vocab``
    # [N, γ] integer ids, equal where the target hidden states are equal (overlapping blocks read
    # the same target positions): p^t is then computed once per distinct id in a chunk.
    target_rows: Tensor | None = None


# ---------------------------------------------------------------- the autograd op
class _FusedCeTv(torch.autograd.Function):
    """α_ce·L_ce + α_tv·L_tv with its gradient computed in forward; backward only scales it.

    Differentiable inputs (hidden, latent, w2); everything else rides in one
    :class:`_FixedInputs`. Outputs (objective, ce_terms [N, γ], tv_terms [N, γ], the TV c*
    reads [N, γ]); the terms are non-differentiable (metrics and c*). Double backward is
    refused: the stored gradients are constants, so a graph through them would be silently wrong.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, latent: Tensor | None, w2: Tensor | None,
                fixed: _FixedInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # Inside forward grad mode is off and needs_input_grad ignores it: hence fixed.grad_enabled.
        want = _Want(*(bool(fixed.grad_enabled and flag) for flag in ctx.needs_input_grad[:3]))
        # The precision is explicit inside (vocabulary matmuls in the LM head's dtype, softmaxes
        # and accumulators in the compute dtype): an enclosing autocast must not re-type them.
        with torch.autocast(hidden.device.type, enabled=False):
            terms = _fused_ce_tv(hidden, latent, w2, fixed, want)
            objective = (terms.ce * fixed.ce_coef).sum() + (terms.tv * fixed.tv_coef).sum()
        ctx.save_for_backward(terms.grad_hidden, terms.grad_latent, terms.grad_w2)
        ctx.input_dtypes = tuple(None if t is None else t.dtype for t in (hidden, latent, w2))
        ctx.mark_non_differentiable(terms.ce, terms.tv, terms.tv_c_star)
        return objective, terms.ce, terms.tv, terms.tv_c_star

    @staticmethod
    def backward(ctx: Any, grad_objective: Tensor, *_grad_terms: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(
                "fused_dspark_loss cannot be differentiated twice (create_graph=True): its gradient "
                "is precomputed in forward; use dspark_loss for higher-order gradients"
            )
        grads = [
            None if g is None else (grad_objective * g).to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.input_dtypes)
        ]
        return (*grads, None)  # None: the fixed inputs


# ------------------------------------------------------------------- the checks
def _check_draft_factors(f: LogitFactors, labels: Tensor) -> None:
    """The draft side: the drafter's shapes, a frozen head, latent and W2 together, softcap."""
    hidden, lm_head_weight, latent, w2 = f.hidden, f.lm_head_weight, f.latent, f.w2
    if hidden.dim() != 3 or hidden.shape[:2] != labels.shape:
        raise ValueError(
            f"hidden must be [N, γ, d] with [N, γ] = {tuple(labels.shape)}, got {tuple(hidden.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight must be [V, d] with d = {hidden.shape[2]}, got {tuple(lm_head_weight.shape)}"
        )
    if lm_head_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "lm_head_weight requires grad, but the fused loss treats the shared LM head as frozen "
            "(paper Section 3.3) and computes no gradient for it; pass lm_head_weight.detach() or use dspark_loss"
        )
    if (latent is None) != (w2 is None):
        raise ValueError(
            "latent and w2 come together (the sequential head's bias latent·W2ᵀ); got "
            f"latent={'None' if latent is None else tuple(latent.shape)}, "
            f"w2={'None' if w2 is None else tuple(w2.shape)}"
        )
    if latent is not None:
        if latent.dim() != 3 or latent.shape[:2] != labels.shape:
            raise ValueError(
                f"latent must be [N, γ, r] with [N, γ] = {tuple(labels.shape)}, got {tuple(latent.shape)}"
            )
        if w2.shape != (lm_head_weight.shape[0], latent.shape[2]):
            raise ValueError(
                f"w2 must be [V, r] = [{lm_head_weight.shape[0]}, {latent.shape[2]}], got {tuple(w2.shape)}"
            )
    if f.softcap is not None and not (isinstance(f.softcap, (int, float)) and f.softcap > 0):
        raise ValueError(f"softcap must be None or a number > 0 (Gemma: 30.0), got {f.softcap!r}")


def _check_target_factors(f: LogitFactors, labels: Tensor) -> None:
    """The target side: its hidden states, the full head with a draft vocabulary, target_rows."""
    if f.target_hidden.shape != f.hidden.shape:
        raise ValueError(
            f"target_hidden shape {tuple(f.target_hidden.shape)} must equal hidden shape {tuple(f.hidden.shape)}"
        )
    vocab, target_weight, lm_head_weight = f.vocab, f.target_lm_head_weight, f.lm_head_weight
    if (vocab is None) != (target_weight is None):
        raise ValueError("vocab and target_lm_head_weight come together (a draft vocabulary needs the full "
                         "target LM head for p^t); pass both or neither")
    if vocab is not None and lm_head_weight.shape[0] != vocab.size:
        raise ValueError(f"lm_head_weight has {lm_head_weight.shape[0]} rows, the draft vocabulary {vocab.size}: "
                         "pass vocab.head_weight(target_lm_head_weight)")
    if vocab is not None and tuple(target_weight.shape) != (vocab.vocab_size, lm_head_weight.shape[1]):
        raise ValueError(f"target_lm_head_weight must be [V, d] = [{vocab.vocab_size}, {lm_head_weight.shape[1]}], "
                         f"got {tuple(target_weight.shape)}")
    rows = f.target_rows
    if rows is not None and (rows.shape != labels.shape or rows.dtype.is_floating_point or rows.dtype == torch.bool):
        raise ValueError(f"target_rows must be integer ids [N, γ] = {tuple(labels.shape)}, got "
                         f"{rows.dtype} {tuple(rows.shape)}")


# ------------------------------------------------------------------ the loss
def _fixed_inputs(f: LogitFactors, labels: Tensor, valid: Tensor, weights: LossWeights,
                  denominator: Tensor | None, chunk_rows: int) -> _FixedInputs:
    """The op's non-differentiable inputs: safe labels, the coefficients α·w_k/D of CE and TV
    (Eq. 12 over the weighted mean), detached target side, on the hidden states' device."""
    device = f.hidden.device
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    dtype = _fused_compute_dtype(f.hidden, f.lm_head_weight, f.w2)
    w, den = weights_and_denominator(valid, weights, denominator, dtype)
    return _FixedInputs(
        lm_head_weight=f.lm_head_weight,
        target_hidden=f.target_hidden.detach(),
        labels=safe_labels,
        valid=valid,
        ce_coef=weights.ce * w / den,  # [γ]
        tv_coef=weights.tv * w / den,  # [γ]
        tv_active=weights.tv != 0,  # w_k > 0 and den > 0: tv_coef ≠ 0 exactly when α_TV ≠ 0
        softcap=None if f.softcap is None else float(f.softcap),
        chunk_rows=chunk_rows,
        grad_enabled=torch.is_grad_enabled(),
        vocab=f.vocab,
        target_weight=None if f.target_lm_head_weight is None else f.target_lm_head_weight.detach(),
        target_rows=None if f.target_rows is None else f.target_rows.to(device=device, dtype=torch.long),
    )


def fused_dspark_loss(
    logits: LogitFactors,
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
    *,
    chunk_rows: int = 64,
    denominator: Tensor | None = None,
) -> LossOutput:
    """The DSpark loss (Eq. 8-12) fused with the LM head, for drafter-shaped logits.

    Same result as :func:`dspark.training.loss.dspark_loss` with ``draft_logits_fn`` returning
    softcap(h W_lmᵀ) + latent W2ᵀ and ``target_logits_fn`` softcap(h_t W_lmᵀ), but each
    chunk's gradient w.r.t. (hidden, latent, w2) is computed in the forward pass from the
    closed forms of Eq. 9-10 (docs/training.md) and kept; backward scales them, recomputing nothing.

    Args:
        logits: the factors of the draft and target logits (:class:`LogitFactors`).
        labels, valid, confidence_logits, weights, denominator: as in :func:`dspark.training.loss.dspark_loss`.
        chunk_rows: supervised positions are processed ``chunk_rows·γ`` at a
            time; peak memory grows with chunk_rows·γ·V (2 fp32 [chunk_rows·γ, V] buffers
            reused by every chunk, 3 with softcap, 4 with ``target_rows``, and a 32-row L1 scratch;
            + V-sized target logits with ``vocab``). On a CPU these buffers are kept for the next
            call (fresh pages cost page faults there);
            :func:`dspark.training.fused_pass.release_workspace` frees them.

    Returns:
        :class:`LossOutput`; ``loss`` has gradients for hidden, latent, w2 and
        confidence_logits, in their dtypes. Double backward is not supported.
    """
    check_loss_inputs(labels, valid, confidence_logits, weights, denominator)
    _check_draft_factors(logits, labels)
    _check_target_factors(logits, labels)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    valid = valid.to(device=logits.hidden.device, dtype=torch.bool)
    fixed = _fixed_inputs(logits, labels, valid, weights, denominator, chunk_rows)
    objective, ce_terms, tv_terms, tv_c_star = _FusedCeTv.apply(logits.hidden, logits.latent, logits.w2, fixed)
    c_star = (1.0 - 0.5 * tv_c_star).clamp(0.0, 1.0)  # [N, γ], Eq. 8 (detached: no graph)
    return reduce_terms(ce_terms, tv_terms, c_star, confidence_logits, valid, weights, denominator,
                        ce_tv_loss=objective)
