"""The DSpark training objective: CE + TV + confidence (paper Eq. 8-12, SPEC 4 "Loss").

For N supervised blocks (rows) of γ positions, with position weights
w_k = exp(−(k−1)/λ) and the supervision mask ``valid``:

- L_ce   = −Σ w_k log p^d_k(x*_k)                                  (Eq. 9)
- L_tv   =  Σ w_k Σ_v |p^d_k(v) − p^t_k(v)|   (no ½, as DeepSpec)    (Eq. 10)
- c*_k   = clamp(1 − ½ Σ_v |p^d_k(v) − p^t_k(v)|, 0, 1), detached    (Eq. 8)
- L_conf = −Σ w_k [c*_k log c_k + (1−c*_k) log(1−c_k)], c_k = σ(z_k) (Eq. 11)
- L      = α_ce L_ce + α_tv L_tv + α_conf L_conf                      (Eq. 12)

Each term is a weighted mean: Σ w_k·valid·term / Σ w_k·valid, where the
denominator may be supplied for the global batch (all ranks, all micro-batches).

Memory. One full-vocabulary fp32 tensor for 512 anchors × 7 × 151,936 is
2.2 GB, so :func:`dspark_loss` never materialises one for all rows. It asks
callables for the logits of ``chunk_rows`` rows at a time and wraps each chunk
in activation checkpointing: after the forward only the per-position terms
[n, γ] survive, and backward recomputes the chunk's logits (the draft ones and
the target ones; one extra LM-head matmul each per chunk). Within a chunk the
draft distribution is computed once (log-softmax; p^d = exp of it), the target
one once under ``no_grad``, and c* is read off the same TV tensor, detached.
:func:`naive_dspark_loss` is the unchunked textbook version, kept only as a
baseline for benchmarks and as a cross-check in tests.

Fused path. When the draft logits are softcap(h W_lmᵀ) + latent W2ᵀ (the
drafter's frozen LM head plus the sequential head's rank-r bias) and the target
logits softcap(h_t W_lmᵀ), :func:`fused_dspark_loss` takes those small inputs
instead of callables. It computes each chunk's loss terms and, from the closed
forms ∂CE/∂z = p − onehot(y) and ∂Σ|p − p^t|/∂z = p ⊙ (s − ⟨p, s⟩) with
s = sign(p − p^t), the gradients w.r.t. hidden, latent and W2 in the same
forward pass; no logits are recomputed and no vocabulary-sized tensor outlives
its chunk. :func:`dspark_loss` stays the general path (any logits) and the
reference the fused one is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "LossWeights",
    "LossOutput",
    "position_weights",
    "dspark_loss",
    "fused_dspark_loss",
    "naive_dspark_loss",
]

LogitsFn = Callable[[int, int], Tensor]


@dataclass
class LossWeights:
    """Mixing weights α of Eq. 12 and the decay λ of the position weights (SPEC 4 defaults).

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
    """Result of :func:`dspark_loss`.

    ``loss`` carries the gradient. ``ce``, ``tv`` and ``conf`` are the detached
    weighted means of each term (before the α mixing). ``accept_sum[k]`` sums
    the expected acceptance 1 − ½‖p^d_k − p^t_k‖₁ (= c*_k) over valid rows and
    ``count[k]`` counts those rows; reduce both across ranks, then
    acc_k = accept_sum[k] / count[k] and τ_prob = 1 + Σ_k Π_{i≤k} acc_i.
    """

    loss: Tensor  # scalar, with grad
    ce: Tensor  # scalar, detached
    tv: Tensor  # scalar, detached
    conf: Tensor  # scalar, detached (0 without a confidence head)
    accept_sum: Tensor  # float32 [γ], detached
    count: Tensor  # int64 [γ]


def position_weights(
    block_size: int,
    decay_gamma: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Position weights w_k = exp(−(k−1)/λ), k = 1..γ, as a [γ] tensor (float32 by default).

    Paper Section 3.3 with λ = ``decay_gamma`` (the paper writes γ; SPEC 4 (conv)).
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not decay_gamma > 0:
        raise ValueError(f"decay_gamma must be > 0, got {decay_gamma!r}")
    k_minus_1 = torch.arange(block_size, dtype=dtype, device=device)
    return torch.exp(-k_minus_1 / decay_gamma)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16/fp16 logits are upcast, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
    denominator: Tensor | None,
) -> None:
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


def _chunk_terms(
    draft_logits_fn: LogitsFn,
    target_logits_fn: LogitsFn,
    labels: Tensor,
    start: int,
    end: int,
    track_tv: bool,
) -> tuple[Tensor, Tensor]:
    """Per-position CE and TV terms of rows [start, end): two [n, γ] tensors.

    ``labels`` is the chunk's slice, with invalid entries already made safe.
    TV is ``Σ_v |p^d − p^t|`` (no ½); it keeps a graph only if ``track_tv``.
    """
    rows, block_size = labels.shape
    draft = draft_logits_fn(start, end)  # [n, γ, V]
    _check_logits("draft_logits_fn", draft, rows, block_size)
    logp_d = torch.log_softmax(draft.to(_compute_dtype(draft.dtype)), dim=-1)  # [n, γ, V]
    del draft
    ce = -logp_d.gather(-1, labels[:, :, None]).squeeze(-1)  # [n, γ]
    with torch.no_grad():
        target = target_logits_fn(start, end)  # [n, γ, V]
        _check_logits("target_logits_fn", target, rows, block_size)
        if target.shape[-1] != logp_d.shape[-1]:
            raise ValueError(
                f"target_logits_fn vocabulary {target.shape[-1]} differs from draft_logits_fn "
                f"vocabulary {logp_d.shape[-1]}"
            )
        p_t = torch.softmax(target.to(logp_d.dtype), dim=-1)  # [n, γ, V]
        del target
    with torch.set_grad_enabled(track_tv and torch.is_grad_enabled()):
        tv = (logp_d.exp() - p_t).abs().sum(dim=-1)  # [n, γ]
    return ce, tv


def _weights_and_denominator(
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


def _reduce(
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
    w, denominator = _weights_and_denominator(valid, weights, denominator, ce_terms.dtype)

    def weighted_mean(term: Tensor) -> Tensor:
        # where (not a product with valid) so that inf/NaN in unsupervised slots cannot leak.
        return (torch.where(valid, term, torch.zeros_like(term)) * w).sum() / denominator

    ce = weighted_mean(ce_terms)
    tv = weighted_mean(tv_terms)
    loss = weights.ce * ce + weights.tv * tv if ce_tv_loss is None else ce_tv_loss
    if confidence_logits is None:
        conf = torch.zeros((), dtype=ce.dtype, device=device)
    else:
        z = confidence_logits.to(_compute_dtype(confidence_logits.dtype))
        bce = F.binary_cross_entropy_with_logits(z, c_star.to(z.dtype), reduction="none")  # [N, γ]
        conf = weighted_mean(bce)
        loss = loss + weights.conf * conf
    accept_sum = torch.where(valid, c_star, torch.zeros_like(c_star)).sum(dim=0).float()  # [γ]
    count = valid.sum(dim=0)  # [γ]
    return LossOutput(
        loss=loss,
        ce=ce.detach(),
        tv=tv.detach(),
        conf=conf.detach(),
        accept_sum=accept_sum.detach(),
        count=count,
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

    Returns:
        :class:`LossOutput`. Gradients equal those of the unchunked formula.
    """
    _check_inputs(labels, valid, confidence_logits, weights, denominator)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    num_rows = labels.shape[0]
    valid = valid.bool()
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    track_tv = weights.tv != 0
    use_checkpoint = torch.is_grad_enabled()

    # An empty batch still runs one empty chunk, so that the loss stays attached to the graph.
    bounds = [(s, min(s + chunk_rows, num_rows)) for s in range(0, num_rows, chunk_rows)] or [(0, 0)]
    ce_chunks, tv_chunks = [], []
    for start, end in bounds:
        args = (draft_logits_fn, target_logits_fn, safe_labels[start:end], start, end, track_tv)
        if use_checkpoint:
            ce, tv = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            ce, tv = _chunk_terms(*args)
        ce_chunks.append(ce)
        tv_chunks.append(tv)
    ce_terms = torch.cat(ce_chunks)  # [N, γ]
    tv_terms = torch.cat(tv_chunks)  # [N, γ]
    c_star = (1.0 - 0.5 * tv_terms.detach()).clamp(0.0, 1.0)  # [N, γ], Eq. 8
    return _reduce(ce_terms, tv_terms, c_star, confidence_logits, valid, weights, denominator)


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
    _check_inputs(labels, valid, confidence_logits, weights, None)
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
    dtype = _compute_dtype(draft_logits.dtype)
    draft = draft_logits.to(dtype)
    log_p_d = torch.log_softmax(draft, dim=-1)
    p_d = torch.softmax(draft, dim=-1)
    p_t = torch.softmax(target_logits.to(dtype), dim=-1).detach()
    ce_terms = -log_p_d.gather(-1, safe_labels[:, :, None]).squeeze(-1)
    tv_terms = (p_d - p_t).abs().sum(dim=-1)
    c_star_graph = (1.0 - 0.5 * (torch.softmax(draft, dim=-1) - p_t).abs().sum(dim=-1)).clamp(0.0, 1.0)
    return _reduce(
        ce_terms, tv_terms, c_star_graph.detach(), confidence_logits, valid, weights, None
    )


# --------------------------------------------------------------------------- fused path
#
# When the logits have the structure of the DSpark drafter,
#     z = softcap(h W_lmᵀ) + latent W2ᵀ        (draft; W_lm frozen, latent W2ᵀ = B_k of Eq. 5-6)
#     t = softcap(h_t W_lmᵀ)                    (target)
# the gradient of the per-position terms w.r.t. z has a closed form (p = softmax(z),
# p^t = softmax(t), s = sign(p − p^t) with sign(0) = 0, torch.abs's subgradient):
#     ∂CE/∂z          = p − onehot(y)                                   (Eq. 9)
#     ∂Σ_v|p_v − p^t_v|/∂z_u = Σ_v s_v p_v (δ_vu − p_u) = p_u (s_u − ⟨p, s⟩)   (Eq. 10)
# so one forward pass per chunk yields the terms AND the gradients w.r.t. the
# chunk's small inputs; every [n, γ, V] tensor dies inside its chunk.


def _fused_compute_dtype(hidden: Tensor, lm_head_weight: Tensor, w2: Tensor | None) -> torch.dtype:
    """At least fp32, and fp64 if any input is (the logits' dtype of dspark_loss, upcast)."""
    dtype = torch.promote_types(hidden.dtype, lm_head_weight.dtype)
    return _compute_dtype(dtype if w2 is None else torch.promote_types(dtype, w2.dtype))


def _fused_ce_tv(
    hidden: Tensor,
    latent: Tensor | None,
    w2: Tensor | None,
    lm_head_weight: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    valid: Tensor,
    ce_coef: Tensor,
    tv_coef: Tensor,
    softcap: float | None,
    chunk_rows: int,
    want: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-position CE and TV terms [N, γ] and, for the inputs flagged in ``want``
    (hidden, latent, w2), the gradients of Σ (ce_coef_k·CE + tv_coef_k·TV), in the compute dtype.

    Only supervised positions are read (``chunk_rows·γ`` of them per chunk), so
    whatever sits in unsupervised slots cannot leak into values or gradients.
    """
    rows, block_size, dim = hidden.shape
    dtype = _fused_compute_dtype(hidden, lm_head_weight, w2)
    device = hidden.device
    head = lm_head_weight  # the LM-head matmuls run in its dtype, as in Drafter.compute_logits
    w2_c = None if w2 is None else w2.to(dtype)  # [V, r]; the rank-r products are cheap in fp32

    flat_h = hidden.reshape(rows * block_size, dim)
    flat_t = target_hidden.reshape(rows * block_size, dim)
    flat_lat = None if latent is None else latent.reshape(rows * block_size, latent.shape[2])
    flat_labels = labels.reshape(-1)
    positions = valid.reshape(-1).nonzero().squeeze(1)  # supervised positions, row-major

    ce_terms = torch.zeros(rows * block_size, dtype=dtype, device=device)
    tv_terms = torch.zeros(rows * block_size, dtype=dtype, device=device)
    grad_h = torch.zeros(rows * block_size, dim, dtype=dtype, device=device) if want[0] else None
    grad_lat = torch.zeros(flat_lat.shape, dtype=dtype, device=device) if want[1] else None
    grad_w2 = torch.zeros(w2.shape, dtype=dtype, device=device) if want[2] else None
    any_grad = any(want)
    tv_grad = any_grad and bool((tv_coef != 0).any())

    def capped(logits: Tensor) -> Tensor:  # in place: softcap(x) = c·tanh(x/c)
        return logits.div_(softcap).tanh_().mul_(softcap) if softcap is not None else logits

    step = chunk_rows * block_size
    for start in range(0, positions.numel(), step):
        pos = positions[start : start + step]  # [m]
        m = pos.numel()
        y = flat_labels[pos][:, None]  # [m, 1]
        lat = None if flat_lat is None else flat_lat[pos].to(dtype)  # [m, r]

        u = (flat_h[pos].to(head.dtype) @ head.T).to(dtype)  # [m, V]
        if softcap is not None:
            tanh_u = u.div_(softcap).tanh_()  # kept: softcap' = 1 − tanh²
            z = tanh_u * softcap
        else:
            tanh_u, z = None, u
        if lat is not None:
            z.addmm_(lat, w2_c.T)  # + B_k
        p = torch.log_softmax(z, dim=-1)  # [m, V], log p^d for now
        del z, u
        ce_terms[pos] = -p.gather(1, y).squeeze(1)
        p.exp_()  # p^d
        # p^t through the same log_softmax → exp as p^d, so that equal logits give
        # bitwise-equal probabilities and sign(p − p^t) = 0 exactly there.
        diff = capped((flat_t[pos].to(head.dtype) @ head.T).to(dtype))  # [m, V]
        diff = torch.log_softmax(diff, dim=-1).exp_().neg_().add_(p)  # p^d − p^t
        tv_terms[pos] = torch.linalg.vector_norm(diff, ord=1, dim=-1)
        if not any_grad:
            continue

        a = ce_coef[pos % block_size][:, None].to(dtype)  # [m, 1]
        if tv_grad:
            b = tv_coef[pos % block_size][:, None].to(dtype)  # [m, 1]
            diff.sign_()  # s, in place; sign(0) = 0 is the subgradient torch.abs uses
            p_dot_s = torch.bmm(p[:, None, :], diff[:, :, None]).reshape(m, 1)  # ⟨p, s⟩
            g = diff.sub_(p_dot_s).mul_(b).add_(a).mul_(p)  # p ⊙ (a + b (s − ⟨p, s⟩))
        else:
            g = p.mul_(a)
        del p, diff
        g.scatter_add_(1, y, -a)  # − a·onehot(y); g = ∂objective/∂z, [m, V]
        if want[1]:
            grad_lat[pos] = g @ w2_c  # [m, r]
        if want[2]:
            grad_w2.addmm_(g.T, lat)  # [V, r]
        if want[0]:
            if tanh_u is not None:
                g.mul_(tanh_u.square_().neg_().add_(1))  # ∂z/∂u = 1 − tanh²(u/c)
            grad_h[pos] = (g.to(head.dtype) @ head).to(dtype)  # [m, d]
        del g, tanh_u

    shape = (rows, block_size)
    return (
        ce_terms.reshape(shape),
        tv_terms.reshape(shape),
        None if grad_h is None else grad_h.reshape(hidden.shape),
        None if grad_lat is None else grad_lat.reshape(latent.shape),
        grad_w2,
    )


class _FusedCeTv(torch.autograd.Function):
    """α_ce·L_ce + α_tv·L_tv with its gradient computed in forward; backward only scales it.

    Outputs (objective, ce_terms [N, γ], tv_terms [N, γ]); the terms are
    non-differentiable (metrics and c*). Double backward is refused: the stored
    gradients are constants, so a graph through them would be silently wrong.
    """

    @staticmethod
    def forward(ctx, hidden, latent, w2, lm_head_weight, target_hidden, labels, valid,
                ce_coef, tv_coef, softcap, chunk_rows, grad_enabled):
        # Inside forward grad mode is off and needs_input_grad ignores it: hence grad_enabled.
        want = tuple(bool(grad_enabled and flag) for flag in ctx.needs_input_grad[:3])
        # The precision is explicit inside (vocabulary matmuls in the LM head's dtype, softmaxes
        # and accumulators in the compute dtype): an enclosing autocast must not re-type them.
        with torch.autocast(hidden.device.type, enabled=False):
            ce_terms, tv_terms, grad_h, grad_lat, grad_w2 = _fused_ce_tv(
                hidden, latent, w2, lm_head_weight, target_hidden, labels, valid,
                ce_coef, tv_coef, softcap, chunk_rows, want,
            )
            objective = (ce_terms * ce_coef).sum() + (tv_terms * tv_coef).sum()
        ctx.save_for_backward(grad_h, grad_lat, grad_w2)
        ctx.input_dtypes = tuple(None if t is None else t.dtype for t in (hidden, latent, w2))
        ctx.mark_non_differentiable(ce_terms, tv_terms)
        return objective, ce_terms, tv_terms

    @staticmethod
    def backward(ctx, grad_objective, _grad_ce_terms, _grad_tv_terms):
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(
                "fused_dspark_loss cannot be differentiated twice (create_graph=True): its gradient "
                "is precomputed in forward; use dspark_loss for higher-order gradients"
            )
        grads = [
            None if g is None else (grad_objective * g).to(dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.input_dtypes)
        ]
        return (*grads, None, None, None, None, None, None, None, None, None)


def _check_fused_inputs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    latent: Tensor | None,
    w2: Tensor | None,
    softcap: float | None,
    chunk_rows: int,
) -> None:
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
            "(SPEC 4) and computes no gradient for it; pass lm_head_weight.detach() or use dspark_loss"
        )
    if target_hidden.shape != hidden.shape:
        raise ValueError(
            f"target_hidden shape {tuple(target_hidden.shape)} must equal hidden shape {tuple(hidden.shape)}"
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
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be None or a number > 0 (Gemma: 30.0), got {softcap!r}")
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")


def fused_dspark_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    valid: Tensor,
    confidence_logits: Tensor | None,
    weights: LossWeights,
    *,
    latent: Tensor | None = None,
    w2: Tensor | None = None,
    softcap: float | None = None,
    chunk_rows: int = 64,
    denominator: Tensor | None = None,
) -> LossOutput:
    """The DSpark loss (Eq. 8-12) fused with the LM head, for drafter-shaped logits.

    Same result as :func:`dspark_loss` with ``draft_logits_fn`` returning
    softcap(h W_lmᵀ) + latent W2ᵀ and ``target_logits_fn`` softcap(h_t W_lmᵀ),
    but each chunk's gradient w.r.t. (hidden, latent, w2) is computed in the
    forward pass from the closed forms above and kept (sizes [N, γ, d],
    [N, γ, r], [V, r]); backward multiplies them by the incoming scalar. Per
    supervised position that is 4 vocabulary-sized matmuls (draft logits,
    target logits, grad → h, grad → W2/latent) and one pass of softmax/TV
    work, instead of recomputing both logits in backward.

    Args:
        hidden: [N, γ, d] draft hidden states h_1..h_γ (with grad), any float dtype.
        lm_head_weight: [V, d] the frozen shared LM head (must not require grad).
            Its matmuls run in its dtype; everything vocabulary-sized after
            them in ≥ fp32.
        target_hidden: [N, γ, d] the target's final hidden states at positions
            i+k−1 (treated as constants).
        labels, valid, confidence_logits, weights, denominator: as in :func:`dspark_loss`.
        latent: [N, γ, r] the sequential head's rank-r latents (Eq. 5-6), or None (DFlash).
        w2: [V, r] the sequential head's W2, given iff ``latent`` is.
        softcap: c of the final-logit soft-cap c·tanh(x/c) (Gemma), or None.
        chunk_rows: supervised positions are processed ``chunk_rows·γ`` at a
            time; peak memory grows with chunk_rows·γ·V (3 fp32 [chunk_rows·γ, V]
            buffers, 4 with softcap).

    Returns:
        :class:`LossOutput`; ``loss`` has gradients for hidden, latent, w2 and
        confidence_logits, in their dtypes. Double backward is not supported.
    """
    _check_inputs(labels, valid, confidence_logits, weights, denominator)
    _check_fused_inputs(hidden, lm_head_weight, target_hidden, labels, latent, w2, softcap, chunk_rows)
    valid = valid.to(device=hidden.device, dtype=torch.bool)
    safe_labels = torch.where(valid, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    dtype = _fused_compute_dtype(hidden, lm_head_weight, w2)
    w, den = _weights_and_denominator(valid, weights, denominator, dtype)
    ce_coef = weights.ce * w / den  # [γ]: ∂objective/∂CE_k at a supervised position
    tv_coef = weights.tv * w / den  # [γ]
    objective, ce_terms, tv_terms = _FusedCeTv.apply(
        hidden, latent, w2, lm_head_weight, target_hidden.detach(), safe_labels, valid,
        ce_coef, tv_coef, None if softcap is None else float(softcap), chunk_rows,
        torch.is_grad_enabled(),
    )
    c_star = (1.0 - 0.5 * tv_terms).clamp(0.0, 1.0)  # [N, γ], Eq. 8 (detached: no graph)
    return _reduce(
        ce_terms, tv_terms, c_star, confidence_logits, valid, weights, denominator, ce_tv_loss=objective
    )
