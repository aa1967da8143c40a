"""The DSpark training objective: CE + TV + confidence (paper Eq. 8-12, Section 3.3).

:func:`dspark_loss` is the general, memory-bounded path: any logits, asked for ``chunk_rows`` rows at
a time, each chunk recomputed in backward. It is the reference the fused LM-head path
(:func:`dspark.training.fused_loss.fused_dspark_loss`, what the trainer runs) is tested against, and
:func:`naive_dspark_loss` the unchunked textbook version (a baseline for benchmarks and tests). Both
paths reduce their per-position terms [N, γ] with :func:`reduce_terms` into a :class:`LossOutput`.
:class:`LossWeights` holds α of Eq. 12 and λ of the position weights w_k = exp(−(k−1)/λ)
(:func:`position_weights`). With a draft vocabulary (:mod:`dspark.modeling.vocab`) the target is
restricted to its ids as in EAGLE-3 (:func:`draft_vocab_targets`) and c* stays the acceptance
against the full target (:func:`full_vocab_tv`).

docs/training.md: the terms, the weighted mean over a global batch, the chunks and their memory,
and what a draft vocabulary drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dspark.modeling.vocab import DraftVocab

__all__ = [
    "LossWeights",
    "LossOutput",
    "position_weights",
    "dspark_loss",
    "naive_dspark_loss",
]

LogitsFn = Callable[[int, int], Tensor]


@dataclass
class LossWeights:
    """Mixing weights α of Eq. 12 (the paper's defaults) and the decay λ of the position weights.

    DFlash as DeepSpec trains it: ``LossWeights(ce=1.0, tv=0.0, conf=0.0)``.
    """

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    decay_gamma: float = 4.0

    def __post_init__(self) -> None:
        for name in ("ce", "tv", "conf"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LossWeights.{name} must be a finite number ≥ 0, got {value!r}")
        if not (isinstance(self.decay_gamma, (int, float)) and self.decay_gamma > 0):
            raise ValueError(
                f"LossWeights.decay_gamma must be > 0 (λ in w_k = exp(-(k-1)/λ)), got {self.decay_gamma!r}"
            )


@dataclass
class LossOutput:
    """Result of :func:`dspark_loss` (and of the fused path).

    ``loss`` carries the gradient. ``ce``, ``tv`` and ``conf`` are the detached
    weighted means of each term (before the α mixing). ``accept_sum[k]`` sums
    the expected acceptance 1 − ½‖p^d_k − p^t_k‖₁ (= c*_k) over valid rows and
    ``count[k]`` counts those rows; reduce both across ranks, then
    acc_k = accept_sum[k] / count[k]. ``prefix_sum`` sums Σ_k Π_{i≤k} c*_i·valid_i
    over the blocks and ``blocks`` counts the blocks with a valid slot: reduced
    across ranks, τ_prob = 1 + prefix_sum / blocks is DeepSpec's estimator
    (the mean over blocks of 1 + Σ_k cumprod(c*·mask)_k, its ``tau_probabilistic``).
    """

    loss: Tensor  # scalar, with grad
    ce: Tensor  # scalar, detached
    tv: Tensor  # scalar, detached
    conf: Tensor  # scalar, detached (0 without a confidence head)
    accept_sum: Tensor  # float32 [γ], detached
    count: Tensor  # int64 [γ]
    prefix_sum: Tensor  # float32 scalar, detached
    blocks: Tensor  # int64 scalar


def position_weights(
    block_size: int,
    decay_gamma: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Position weights w_k = exp(−(k−1)/λ), k = 1..γ, as a [γ] tensor (float32 by default).

    Paper Section 3.3 with λ = ``decay_gamma`` (the paper writes γ, the block size, for the decay too;
    λ is a separate setting here).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not decay_gamma > 0:
        raise ValueError(f"decay_gamma must be > 0, got {decay_gamma!r}")
    k_minus_1 = torch.arange(block_size, dtype=dtype, device=device)
    return torch.exp(-k_minus_1 / decay_gamma)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16/fp16 logits are upcast, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def check_loss_inputs(
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
    denominator: Tensor | None,
) -> None:
    """Shapes and dtypes shared by every loss path; the errors name the argument and its fix."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be [N, γ], got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids, got dtype {labels.dtype}")
    if valid.shape != labels.shape:
        raise ValueError(
            f"valid shape {tuple(valid.shape)} must equal labels shape {tuple(labels.shape)}"
        )
    if confidence_logits is None:
        if weights.conf != 0:
            raise ValueError(
                f"confidence_logits is None but weights.conf = {weights.conf}; "
                "pass the confidence head's logits or set weights.conf = 0 (DFlash)"
            )
    elif confidence_logits.shape != labels.shape:
        raise ValueError(
            f"confidence_logits shape {tuple(confidence_logits.shape)} must equal labels shape "
            f"{tuple(labels.shape)}"
        )
    if denominator is not None and denominator.numel() != 1:
        raise ValueError(f"denominator must be a scalar, got shape {tuple(denominator.shape)}")


def _check_logits(name: str, logits: Tensor, rows: int, block_size: int) -> None:
    if logits.dim() != 3 or logits.shape[0] != rows or logits.shape[1] != block_size:
        raise ValueError(
            f"{name} must return [n, γ, V] = [{rows}, {block_size}, V] for its row slice, "
            f"got shape {tuple(logits.shape)}"
        )


def draft_vocab_targets(
    target_logits: Tensor, labels: Tensor, vocab: DraftVocab, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EAGLE-3's restriction for the loss: target logits [.., V] and labels [..] (target ids) ->
    (p^t restricted to the vocabulary and renormalised [.., k], the target's mass inside it [..],
    argmax_in Bool [..] (target argmax inside: TV kept), label_in Bool [..], labels as draft ids
    [..], 0 outside)."""
    logp, argmax_in, log_mass_in = vocab.restrict_logits(target_logits.to(dtype))
    draft_labels = vocab.to_draft_ids(labels)
    return logp.exp(), log_mass_in.exp(), argmax_in, draft_labels >= 0, draft_labels.clamp_min(0)


def full_vocab_tv(p_d: Tensor, p_t_in: Tensor, mass_in: Tensor) -> Tensor:
    """Σ_v |p^d_v − p^t_v| over all V ids for a draft p^d [.., k] that is 0 outside the vocabulary and
    a target with restricted distribution p_t_in [.., k] and mass_in [..] inside: the TV that
    verification meets (its c* is the expected acceptance)."""
    return (p_d - p_t_in * mass_in.unsqueeze(-1)).abs().sum(-1) + (1 - mass_in)


def _chunk_terms(
    draft_logits_fn: LogitsFn,
    target_logits_fn: LogitsFn,
    labels: Tensor,
    start: int,
    end: int,
    track_tv: bool,
    vocab: DraftVocab | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-position CE and TV terms of rows [start, end) and the TV c* is read from: three [n, γ]
    tensors (the third the second, detached, without a draft vocabulary).

    ``labels`` is the chunk's slice, with invalid entries already made safe.
    TV is ``Σ_v |p^d − p^t|`` (no ½); it keeps a graph only if ``track_tv``. With ``vocab``
    the draft logits are [n, γ, k], the target ones [n, γ, V] (docs/training.md).
    """
    rows, block_size = labels.shape
    draft = draft_logits_fn(start, end)  # [n, γ, V or k]
    _check_logits("draft_logits_fn", draft, rows, block_size)
    logp_d = torch.log_softmax(draft.to(compute_dtype(draft.dtype)), dim=-1)  # [n, γ, V or k]
    del draft
    with torch.no_grad():
        target = target_logits_fn(start, end)  # [n, γ, V]
        _check_logits("target_logits_fn", target, rows, block_size)
        want = logp_d.shape[-1] if vocab is None else vocab.vocab_size
        if target.shape[-1] != want or (vocab is not None and logp_d.shape[-1] != vocab.size):
            raise ValueError(
                f"target_logits_fn vocabulary {target.shape[-1]} and draft_logits_fn vocabulary "
                f"{logp_d.shape[-1]} must be V and {'k of the draft vocabulary' if vocab else 'V'}"
            )
        if vocab is None:
            p_t = torch.softmax(target.to(logp_d.dtype), dim=-1)  # [n, γ, V]
        else:
            p_t, mass_in, argmax_in, label_in, labels = draft_vocab_targets(target, labels, vocab, logp_d.dtype)
        del target
    ce = -logp_d.gather(-1, labels[:, :, None]).squeeze(-1)  # [n, γ]
    with torch.set_grad_enabled(track_tv and torch.is_grad_enabled()):
        tv = (logp_d.exp() - p_t).abs().sum(dim=-1)  # [n, γ]
    if vocab is None:
        return ce, tv, tv.detach()
    with torch.set_grad_enabled(track_tv and torch.is_grad_enabled()):
        tv_full = full_vocab_tv(logp_d.exp(), p_t, mass_in)  # [n, γ], against the full target
    zero = torch.zeros((), dtype=ce.dtype, device=ce.device)
    tv = torch.where(label_in, tv, tv_full)  # a label outside: CE undefined, TV against the full target
    return torch.where(argmax_in & label_in, ce, zero), torch.where(argmax_in, tv, zero), tv_full.detach()


def weights_and_denominator(
    valid: Tensor, weights: LossWeights, denominator: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Position weights w [γ] and the weighted-mean denominator (a scalar, never 0), in ``dtype``."""
    device = valid.device
    w = position_weights(valid.shape[1], weights.decay_gamma, device=device, dtype=dtype)  # [γ]
    if denominator is None:
        denominator = (w * valid).sum()
    denominator = denominator.to(device=device, dtype=dtype).reshape(())
    # No supervised position anywhere: every sum is 0, keep the loss 0 instead of 0/0.
    denominator = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return w, denominator


def reduce_terms(
    ce_terms: Tensor,
    tv_terms: Tensor,
    c_star: Tensor,
    confidence_logits: Tensor | None,
    valid: Tensor,
    weights: LossWeights,
    denominator: Tensor | None,
    ce_tv_loss: Tensor | None = None,
) -> LossOutput:
    """Weighted means and metrics from per-position terms, all [N, γ].

    ``ce_tv_loss``, when given, is α_ce·L_ce + α_tv·L_tv already carrying its
    gradient (the fused path); by default it is formed from the two terms here.
    """
    device = ce_terms.device
    valid = valid.to(device=device, dtype=torch.bool)
    w, denominator = weights_and_denominator(valid, weights, denominator, ce_terms.dtype)

    def weighted_mean(term: Tensor) -> Tensor:
        # where (not a product with valid) so that inf/NaN in unsupervised slots cannot leak.
        return (torch.where(valid, term, torch.zeros_like(term)) * w).sum() / denominator

    ce = weighted_mean(ce_terms)
    tv = weighted_mean(tv_terms)
    loss = weights.ce * ce + weights.tv * tv if ce_tv_loss is None else ce_tv_loss
    if confidence_logits is None:
        conf = torch.zeros((), dtype=ce.dtype, device=device)
    else:
        z = confidence_logits.to(compute_dtype(confidence_logits.dtype))
        bce = F.binary_cross_entropy_with_logits(z, c_star.to(z.dtype), reduction="none")  # [N, γ]
        conf = weighted_mean(bce)
        loss = loss + weights.conf * conf
    masked = torch.where(valid, c_star, torch.zeros_like(c_star))  # [N, γ]
    accept_sum = masked.sum(dim=0).float()  # [γ]
    count = valid.sum(dim=0)  # [γ]
    # cumprod over the masked c*: a slot past the block's supervised prefix ends its product.
    prefix = masked.float().cumprod(dim=1)  # [N, γ]
    return LossOutput(
        loss=loss,
        ce=ce.detach(),
        tv=tv.detach(),
        conf=conf.detach(),
        accept_sum=accept_sum.detach(),
        count=count,
        prefix_sum=prefix.sum().detach(),
        blocks=valid.any(dim=1).sum(),
    )


def dspark_loss(
    draft_logits_fn: LogitsFn,
    target_logits_fn: LogitsFn,
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
    chunk_rows: int = 64,
    denominator: Tensor | None = None,
    vocab: DraftVocab | None = None,
) -> LossOutput:
    """Memory-bounded DSpark loss (Eq. 8-12), chunked over rows with recomputation.

    Args:
        draft_logits_fn: ``(row_start, row_end) -> [n, γ, V]`` draft logits U + B
            of those rows, with grad, any float dtype (computed in ≥ fp32 here).
            Called once per chunk in forward and again in backward, so it must
            be deterministic given the RNG state (dropout is replayed).
        target_logits_fn: ``(row_start, row_end) -> [n, γ, V]`` target logits
            (p^t_k comes from target position i+k−1). Called under ``no_grad``,
            also once more per chunk in backward.
        labels: Long [N, γ], x*_k; entries where ``valid`` is false are ignored.
        valid: Bool [N, γ], prefix-closed supervision mask.
        confidence_logits: [N, γ] pre-sigmoid confidence head outputs (with grad),
            or None without a confidence head (then ``weights.conf`` must be 0).
        weights: α of Eq. 12 and λ of the position weights.
        chunk_rows: rows per chunk; peak memory grows with chunk_rows·γ·V.
        denominator: Σ w_k·valid over the global batch; default: this call's.
        vocab: a draft vocabulary: ``draft_logits_fn`` returns [n, γ, k], ``target_logits_fn``
            still [n, γ, V]; restriction and dropped positions as in docs/training.md.

    Returns:
        :class:`LossOutput`. Gradients equal those of the unchunked formula.
    """
    check_loss_inputs(labels, valid, confidence_logits, weights, denominator)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    num_rows = labels.shape[0]
    valid = valid.bool()
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    track_tv = weights.tv != 0
    use_checkpoint = torch.is_grad_enabled()

    # An empty batch still runs one empty chunk, so that the loss stays attached to the graph.
    bounds = [(s, min(s + chunk_rows, num_rows)) for s in range(0, num_rows, chunk_rows)] or [(0, 0)]
    ce_chunks, tv_chunks, full_chunks = [], [], []
    for start, end in bounds:
        args = (draft_logits_fn, target_logits_fn, safe_labels[start:end], start, end, track_tv, vocab)
        if use_checkpoint:
            ce, tv, tv_full = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            ce, tv, tv_full = _chunk_terms(*args)
        ce_chunks.append(ce)
        tv_chunks.append(tv)
        full_chunks.append(tv_full)
    ce_terms = torch.cat(ce_chunks)  # [N, γ]
    tv_terms = torch.cat(tv_chunks)  # [N, γ]
    c_star = (1.0 - 0.5 * torch.cat(full_chunks).detach()).clamp(0.0, 1.0)  # [N, γ], Eq. 8
    return reduce_terms(ce_terms, tv_terms, c_star, confidence_logits, valid, weights, denominator)


def naive_dspark_loss(
    draft_logits: Tensor,
    target_logits: Tensor,
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
) -> LossOutput:
    """Baseline only: the textbook loss on full [N, γ, V] logits, for benchmarks.

    Same values and gradients as :func:`dspark_loss`, written the way it is
    often written elsewhere: separate softmax and log-softmax, c* computed from
    a second softmax with its own autograd graph (detached only where it is
    used), no chunking, no checkpointing. Its memory therefore grows with
    N·γ·V several times over; do not train with it.
    """
    check_loss_inputs(labels, valid, confidence_logits, weights, None)
    for name, logits in (("draft_logits", draft_logits), ("target_logits", target_logits)):
        if logits.dim() != 3 or logits.shape[:2] != labels.shape:
            raise ValueError(
                f"{name} must be [N, γ, V] with [N, γ] = {tuple(labels.shape)}, got {tuple(logits.shape)}"
            )
    if target_logits.shape != draft_logits.shape:
        raise ValueError(
            f"target_logits shape {tuple(target_logits.shape)} must equal draft_logits shape "
            f"{tuple(draft_logits.shape)}"
        )
    valid = valid.bool()
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    dtype = compute_dtype(draft_logits.dtype)
    draft = draft_logits.to(dtype)
    log_p_d = torch.log_softmax(draft, dim=-1)
    p_d = torch.softmax(draft, dim=-1)
    p_t = torch.softmax(target_logits.to(dtype), dim=-1).detach()
    ce_terms = -log_p_d.gather(-1, safe_labels[:, :, None]).squeeze(-1)
    tv_terms = (p_d - p_t).abs().sum(dim=-1)
    c_star_graph = (1.0 - 0.5 * (torch.softmax(draft, dim=-1) - p_t).abs().sum(dim=-1)).clamp(0.0, 1.0)
    return reduce_terms(
        ce_terms, tv_terms, c_star_graph.detach(), confidence_logits, valid, weights, None
    )
