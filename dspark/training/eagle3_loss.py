"""The Eagle3 training-time-test (TTT) loss (Li et al., the Eagle3 baseline of paper Section 4.1) and
the module the trainer runs for an Eagle3 drafter.

Step s at position i predicts x_{i+s+2} against the target's distribution there (soft labels), and
L = Σ_s decay^s · Σ CE_s / D. :func:`eagle3_loss` computes it with the gradient w.r.t. the draft
logits taken in closed form in the forward pass (:class:`_TTTLoss`); :func:`checkpointed_eagle3_loss`
is the same loss through autograd with activation checkpointing (the general path, and the
benchmarks' baseline). :func:`supervision_mask` says which (step, position) is trained under each
convention (ours, or DeepSpec's with ``parity``), and :class:`Eagle3LossModule` wraps the drafter and
its loss with the metric sums the trainer reduces, on the scale of DSpark's c* (paper Eq. 8).

docs/training.md (the Eagle3 TTT loss): the two conventions and their denominators D, a draft
vocabulary, the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dspark.kernels.lm_head import vocab_logits
from dspark.training.loss import full_vocab_tv


def supervision_mask(loss_mask: Tensor, steps: int, *, parity: bool = False, lengths: Tensor | None = None) -> Tensor:
    """Bool [T, B, S]: whether step s at position i is trained.

    Default: loss_mask[i+s+2] (the predicted token's own mask; False past the end). parity:
    pm0[i+s], pm0 = loss_mask with position lengths[b]−1 cleared (lengths default S), as DeepSpec."""
    B, S = loss_mask.shape
    m = loss_mask > 0
    if parity:
        last = (torch.full((B,), S, device=m.device) if lengths is None else lengths.to(m.device)) - 1
        m = m.clone()
        m[torch.arange(B, device=m.device), last.clamp_min(0)] = False
        shift = 0
    else:
        shift = 2
    out = torch.zeros(steps, B, S, dtype=torch.bool, device=m.device)
    for s in range(steps):
        k = s + shift
        if k < S:
            out[s, :, : S - k] = m[:, k:]
    return out


@dataclass
class Eagle3LossOutput:
    loss: Tensor  # Σ_s decay^s Σ CE (the numerator; divide by `denominator`)
    denominator: Tensor  # D of the convention
    ce_sum: Tensor  # [T] Σ CE per step
    count: Tensor  # [T] supervised entries per step (the acceptance metrics' denominator)
    accept_sum: Tensor  # [T] Σ c*: the expected acceptance against the full target per step
    correct: Tensor  # [T] entries whose draft argmax (a target id) equals the full target's argmax
    prefix_sum: Tensor  # Σ over chains of Σ_s Π_{s' ≤ s} c*_{s'} · mask_{s'}
    chains: Tensor  # chains (positions) supervised at step 0
    kept: Tensor  # [T] supervised entries in the loss (count less those a draft vocabulary drops)


def teacher_logits(final_hidden: Tensor, lm_head: Tensor, softcap: float | None) -> Tensor:
    """The target's logits from its final (normed) hidden states: [..., d] -> [..., V]."""
    logits = vocab_logits(final_hidden.to(lm_head.dtype), lm_head)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def full_acceptance(p_draft: Tensor, p_full: Tensor, p_in: Tensor | None, vocab: Any) -> Tensor:
    """c* = clamp(1 − ½ Σ_v |p_d(v) − p_t(v)|, 0, 1) over all V ids (paper Eq. 8), per row, as DSpark's
    (`dspark.training.loss.full_vocab_tv`): p_draft [n, k or V] is zero outside a draft vocabulary,
    p_full [n, V] the target softmax, p_in [n, k] its restriction renormalised (with a vocabulary)."""
    if vocab is None:
        tv = (p_draft - p_full).abs().sum(-1)
    else:
        mass_in = p_full.index_select(-1, vocab.draft_ids.to(p_full.device)).sum(-1)
        tv = full_vocab_tv(p_draft, p_in, mass_in)
    return (1.0 - 0.5 * tv).clamp(0.0, 1.0)


def _draft_argmax(logp: Tensor, vocab: Any) -> Tensor:
    """The draft's argmax as target ids."""
    arg = logp.argmax(-1)
    return arg if vocab is None else vocab.to_target_ids(arg)


def _softcapped(u: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """(c·tanh(u/c), tanh(u/c)) with a soft-cap, else (u, None)."""
    if not softcap:
        return u, None
    t = torch.tanh(u / softcap)
    return t * softcap, t


def _ttt_terms(normed: tuple[Tensor, ...], final_hidden: Tensor, sup: Tensor, head: Tensor, full_head: Tensor,
               vocab: Any, softcap: float | None, decay: float, chunk_rows: int, want_grad: bool
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor | None]]:
    """Per-entry CE, accept (c*), correct and keep maps [T, B, S] of the TTT loss, and (``want_grad``)
    ∂(Σ_s decay^s Σ CE_s)/∂normed_s [B, S, d] for every step.

    The teacher p_t at position j serves step s at position i = j − s − 1 for every s, so it is
    computed once per position (the V-sized product and softmax), ``chunk_rows`` positions at a
    time, and every step's rows that read it are handled against it: the draft logits z =
    softcap(norm(h) W_kᵀ), log p = log_softmax(z), CE = −⟨p_t, log p⟩, and the closed-form
    gradient ∂CE/∂z = p − p_t (p_t sums to 1 over the draft ids), so nothing is recomputed in
    backward. Entries whose teacher argmax lies outside a draft vocabulary are dropped from CE and
    its gradient (keep); accept and correct are against the full target for every entry."""
    T, B, S = sup.shape
    device = final_hidden.device
    dt = torch.promote_types(head.dtype, torch.float32)  # at least fp32 (fp64 for an fp64 head)
    maps = [torch.zeros(T, B, S, dtype=dt, device=device) for _ in range(4)]  # ce, accept, correct, keep
    grads = [torch.zeros(h.shape, dtype=dt, device=device) if want_grad else None for h in normed]
    # need[b, j]: position j is the teacher of some supervised entry (b, j − s − 1) at some step s
    need = torch.zeros(B, S, dtype=torch.bool, device=device)
    for s in range(T):
        if s + 1 < S:
            need[:, s + 1:] |= sup[s, :, : S - s - 1]
    tb, tj = need.nonzero(as_tuple=True)
    for c0 in range(0, tb.numel(), chunk_rows):
        b, j = tb[c0 : c0 + chunk_rows], tj[c0 : c0 + chunk_rows]
        p_full = torch.softmax(teacher_logits(final_hidden[b, j], full_head, softcap).to(dt), -1)
        p_t, keep = p_full, torch.ones(p_full.shape[0], dtype=torch.bool, device=device)
        if vocab is not None:
            p_t, keep = vocab.restrict(p_full)
        t_arg = p_full.argmax(-1)
        for s in range(T):
            i = j - s - 1
            on = i >= 0
            on[on.clone()] = sup[s, b[on], i[on]]
            if not bool(on.any()):
                continue
            rb, ri, pt, kp, pf = b[on], i[on], p_t[on], keep[on].to(dt), p_full[on]
            u = vocab_logits(normed[s][rb, ri].to(head.dtype), head).to(dt)
            z, tanh_u = _softcapped(u, softcap)
            logp = torch.log_softmax(z, -1)
            p = logp.exp()
            maps[0][s, rb, ri] = -(pt * logp).sum(-1) * kp
            maps[1][s, rb, ri] = full_acceptance(p, pf, pt, vocab)
            maps[2][s, rb, ri] = (_draft_argmax(logp, vocab) == t_arg[on]).to(dt)
            maps[3][s, rb, ri] = kp
            if want_grad:
                g = p.sub_(pt).mul_(kp[:, None] * decay**s)  # ∂(decay^s CE)/∂z
                if tanh_u is not None:
                    g.mul_(1 - tanh_u.square())
                grads[s][rb, ri] = (g.to(head.dtype) @ head).to(dt)
    return (*maps, grads)


class _TTTLoss(torch.autograd.Function):
    """Σ_s decay^s Σ CE_s with its gradient w.r.t. each step's normed hidden states computed in
    forward (:func:`_ttt_terms`); backward only scales it. Outputs (loss, ce, accept, correct,
    keep), the maps non-differentiable."""

    @staticmethod
    def forward(ctx, final_hidden, sup, head, full_head, vocab, softcap, decay, chunk_rows, want_grad, *normed):
        with torch.autocast(final_hidden.device.type, enabled=False):  # the precision is explicit inside
            ce, acc, cor, keep, grads = _ttt_terms(normed, final_hidden, sup, head, full_head, vocab, softcap,
                                                   decay, chunk_rows, want_grad)
            weights = decay ** torch.arange(sup.shape[0], device=ce.device, dtype=ce.dtype)
            loss = (ce.sum((1, 2)) * weights).sum()
        ctx.save_for_backward(*[g for g in grads if g is not None])
        ctx.dtypes = [h.dtype for h in normed]
        ctx.mark_non_differentiable(ce, acc, cor, keep)
        return loss, ce, acc, cor, keep

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if torch.is_grad_enabled():
            raise RuntimeError("the Eagle3 TTT loss cannot be differentiated twice: its gradient is precomputed")
        grads = ctx.saved_tensors
        out = [(grad_loss * g).to(dtype) for g, dtype in zip(grads, ctx.dtypes)] if grads else [None] * len(ctx.dtypes)
        return (None,) * 9 + tuple(out)


def eagle3_loss(
    drafter: Any,
    step_hidden: list[Tensor],
    final_hidden: Tensor,
    loss_mask: Tensor,
    *,
    parity: bool = False,
    lengths: Tensor | None = None,
    chunk_rows: int = 1024,
) -> Eagle3LossOutput:
    """The TTT loss of one micro-batch. step_hidden: T × [B, S, d] pre-norm draft outputs
    (`Eagle3Drafter.forward`); final_hidden [B, S, d] the target's; loss_mask [B, S].

    Only supervised entries reach the LM head; each teacher position's distribution is computed
    once for all T steps, ``chunk_rows`` positions at a time, and the gradient w.r.t. the draft
    logits is taken in closed form in the forward pass (:func:`_ttt_terms`): per supervised
    position one V-sized teacher product and 2T k-sized ones (autograd with activation
    checkpointing needs 2T V-sized and 3T k-sized ones)."""
    T = len(step_hidden)
    B, S = loss_mask.shape
    sup = supervision_mask(loss_mask, T, parity=parity, lengths=lengths)  # [T, B, S]
    decay = drafter.config.step_loss_decay
    normed = [drafter.norm(h) for h in step_hidden]  # the final norm stays in autograd (its weight trains)
    want_grad = torch.is_grad_enabled() and any(h.requires_grad for h in normed)
    loss, ce, acc, cor, keep = _TTTLoss.apply(
        final_hidden.detach(), sup, drafter.head_weight().detach(), drafter.target_lm_head_weight().detach(),
        drafter.vocab, drafter.config.final_logit_softcapping, float(decay), int(chunk_rows), want_grad, *normed)
    ce_sum, accept_sum, correct, kept = (m.sum((1, 2)) for m in (ce, acc, cor, keep))
    loss, denominator = _normalised(loss, kept, decay, B, S, parity)
    chain_ok = sup[0]
    survive = torch.cumprod(acc * sup.float(), dim=0)  # [T, B, S]: Π_{s' ≤ s} accept·mask
    prefix_sum = (survive.sum(0) * chain_ok).sum()
    count = sup.sum((1, 2)).to(ce_sum.dtype)
    return Eagle3LossOutput(loss, denominator, ce_sum, count, accept_sum, correct, prefix_sum,
                            chain_ok.sum().float(), kept)


def _normalised(loss: Tensor, kept: Tensor, decay: float, B: int, S: int, parity: bool) -> tuple[Tensor, Tensor]:
    """(numerator, D) of one micro-batch (docs/training.md): default Σ_s decay^s Σ CE over
    D = Σ_s decay^s n_s; parity (DeepSpec) Σ_s decay^s Σ CE / S over D = B, the per-sequence means'
    sum over the micro-batch's sequences."""
    if parity:
        return loss / S, torch.tensor(float(B), device=loss.device)
    weights = decay ** torch.arange(kept.numel(), device=kept.device, dtype=torch.float32)
    return loss, (weights * kept).sum()


def _chunk_terms(drafter: Any, h: Tensor, t_hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row (CE, c*, correct, keep) of draft hidden rows h [n, d] against teacher rows [n, d]."""
    vocab = drafter.vocab
    with torch.no_grad():
        w = drafter.target_lm_head_weight()  # the full [V, d] head: p_t is the target's whole distribution
        p_full = torch.softmax(teacher_logits(t_hidden, w, drafter.config.final_logit_softcapping).float(), -1)
        p_t, keep = p_full, torch.ones(p_full.shape[0], dtype=torch.bool, device=p_full.device)
        if vocab is not None:
            p_t, keep = vocab.restrict(p_full)
    logp = F.log_softmax(drafter.compute_logits(h).float(), dim=-1)
    ce = -(p_t * logp).sum(-1) * keep
    with torch.no_grad():
        accept = full_acceptance(logp.exp(), p_full, p_t, vocab)
        correct = _draft_argmax(logp, vocab) == p_full.argmax(-1)
    return ce, accept, correct.float(), keep


def checkpointed_eagle3_loss(
    drafter: Any,
    step_hidden: list[Tensor],
    final_hidden: Tensor,
    loss_mask: Tensor,
    *,
    parity: bool = False,
    lengths: Tensor | None = None,
    chunk_rows: int = 1024,
) -> Eagle3LossOutput:
    """:func:`eagle3_loss` through autograd: per step, the supervised rows' draft and teacher logits,
    ``chunk_rows`` at a time, each chunk recomputed in the backward pass (activation checkpointing).
    The general path and the baseline `bench/train_step.py --sections eagle3` measures against:
    every teacher distribution is computed once per step that reads it, twice with the recomputation."""
    T = len(step_hidden)
    B, S = loss_mask.shape
    device = final_hidden.device
    sup = supervision_mask(loss_mask, T, parity=parity, lengths=lengths)  # [T, B, S]
    decay = drafter.config.step_loss_decay
    loss = torch.zeros((), device=device)
    ce_sum, kept, accept_sum, correct = (torch.zeros(T, device=device) for _ in range(4))
    accept_map = torch.zeros(T, B, S, device=device)
    for s, h in enumerate(step_hidden):
        b, i = sup[s].nonzero(as_tuple=True)
        if b.numel() == 0:
            continue
        rows_h, rows_t = h[b, i], final_hidden[b, i + s + 1]  # [N, d]
        ce_parts, acc_parts = [], []
        for r0 in range(0, rows_h.shape[0], chunk_rows):
            chunk = (rows_h[r0 : r0 + chunk_rows], rows_t[r0 : r0 + chunk_rows])
            if torch.is_grad_enabled() and rows_h.requires_grad:
                ce, acc, cor, keep = checkpoint(_chunk_terms, drafter, *chunk, use_reentrant=False)
            else:
                ce, acc, cor, keep = _chunk_terms(drafter, *chunk)
            ce_parts.append(ce)
            acc_parts.append(acc)
            correct[s] += cor.sum()
            kept[s] += keep.sum()
        ce, acc = torch.cat(ce_parts), torch.cat(acc_parts)
        ce_sum[s] = ce.detach().sum()
        accept_sum[s] = acc.sum()
        accept_map[s, b, i] = acc
        loss = loss + decay**s * ce.sum()
    loss, denominator = _normalised(loss, kept, decay, B, S, parity)
    chain_ok = sup[0]
    survive = torch.cumprod(accept_map * sup.float(), dim=0)  # [T, B, S]: Π_{s' ≤ s} accept·mask
    prefix_sum = (survive.sum(0) * chain_ok).sum()
    count = sup.sum((1, 2)).float()
    return Eagle3LossOutput(loss, denominator, ce_sum, count, accept_sum, correct, prefix_sum,
                            chain_ok.sum().float(), kept)


class Eagle3LossModule(nn.Module):
    """The Eagle3 drafter and its TTT loss as one module (what DDP wraps), with the metric sums the
    trainer reduces: ce/tv/conf are sums over `weight` = D (tv: the decay-weighted mean of 1 − c*
    over supervised entries, times D), `accept_sum`/`count` per step, `prefix_sum`/`blocks`
    DeepSpec's τ_prob over chains."""

    def __init__(self, drafter: nn.Module, target: Any, *, parity: bool = False, chunk_rows: int = 1024) -> None:
        super().__init__()
        self.drafter = drafter
        self.parity = parity
        self.chunk_rows = chunk_rows
        self._target = [target]  # not a submodule: frozen, never synced or saved

    def forward(self, batch: dict[str, Tensor], anchors: Tensor | None = None, keep: Tensor | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
        """Returns (Σ_s decay^s Σ CE over this micro-batch, detached metric sums); anchors are unused."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        if "features" in batch:
            features, final_hidden = batch["features"], batch["final_hidden"]
        else:
            out = self._target[0](input_ids, return_logits=False)
            features, final_hidden = out.features, out.last_hidden
        lengths = _lengths(batch)
        hidden = self.drafter(features, input_ids)
        out = eagle3_loss(self.drafter, hidden, final_hidden, loss_mask, parity=self.parity, lengths=lengths,
                          chunk_rows=self.chunk_rows)
        decay = self.drafter.config.step_loss_decay
        w = decay ** torch.arange(len(hidden), device=input_ids.device, dtype=torch.float32)
        tv_mean = (w * (out.count - out.accept_sum)).sum() / (w * out.count).sum().clamp_min(1e-12)
        metrics = {
            "ce": out.loss.detach(),
            "tv": tv_mean * out.denominator,
            "conf": torch.zeros((), device=input_ids.device),
            "weight": out.denominator,
            "accept_sum": out.accept_sum,
            "count": out.count,
            "prefix_sum": out.prefix_sum,
            "blocks": out.chains,
            "anchors": out.chains,
            "tokens": (loss_mask > 0).sum().float(),
        }
        return out.loss, metrics


def _lengths(batch: dict[str, Tensor]) -> Tensor:
    """Real (unpadded) length per row: attention_mask's sum when the batch has one, else one past
    the last loss-masked position (padding is right padding with loss_mask 0)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(-1)
    m = batch["loss_mask"] > 0
    S = m.shape[1]
    last = torch.where(m, torch.arange(S, device=m.device), -1).max(-1).values
    return torch.where(last >= 0, last + 1, torch.full_like(last, S))
