"""One pass of the fused DSpark loss over the supervised positions, chunk by chunk
(dspark.training.fused_loss holds its inputs and the autograd op; docs/training.md the closed forms
it uses, its cost per position and the draft-vocabulary case).

Reading order: :func:`_fused_ce_tv` (the pass) -> :func:`_chunk_terms` (CE and TV of a chunk)
and :func:`_chunk_grads` (their gradients, through :func:`_logits_grad`) -> :class:`_Head` (the
LM head and the sequential head's bias latent·W2ᵀ on a chunk). The [m, V] work is done in place in
the buffers of :class:`_Buffers`, which every chunk of a call reuses: no [m, V] tensor outlives the
call, and on a CPU the buffers stay for the next one (:func:`release_workspace` frees them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from dspark.training.loss import compute_dtype, full_vocab_tv
from dspark.modeling.vocab import DraftVocab


def _fused_compute_dtype(hidden: Tensor, lm_head_weight: Tensor, w2: Tensor | None) -> torch.dtype:
    """At least fp32, and fp64 if any input is (the logits' dtype of dspark_loss, upcast)."""
    dtype = torch.promote_types(hidden.dtype, lm_head_weight.dtype)
    return compute_dtype(dtype if w2 is None else torch.promote_types(dtype, w2.dtype))


# ------------------------------------------------------------- one chunk of positions
def _softmax_(z: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(z) written over z [m, V], as exp(z − max) / Σ exp(z − max); returns (max, Σ)
    [m, 1] so that log p_y = z_y − max − log Σ. In place: no [m, V] tensor is allocated (a
    fresh one costs page faults of the order of its exp pass on a CPU). Deterministic per
    row: equal logits rows give bitwise-equal probabilities (the sign(0) = 0 ties of Eq. 10)."""
    top = z.amax(dim=-1, keepdim=True)
    total = z.sub_(top).exp_().sum(dim=-1, keepdim=True)
    z.div_(total)
    return top, total


@dataclass
class _Head:
    """The shared LM head as the fused loss applies it to a chunk of m positions."""

    weight: Tensor  # [V, d] ([k, d] with a draft vocabulary); its matmuls run in its dtype
    w2: Tensor | None  # [V, r] ([k, r]) in the compute dtype; the rank-r products are cheap in fp32
    softcap: float | None
    dtype: torch.dtype  # compute dtype of everything vocabulary-sized
    vocab: DraftVocab | None = None
    target_weight: Tensor | None = None  # [V, d], the full head p^t comes from (None: ``weight``)

    def project(self, x: Tensor, pos: Tensor, weight: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """x[pos] Wᵀ: rows ``pos`` [m] of x [N·γ, d] -> [m, V] in the compute dtype, written
        into ``out`` (a reused [m, V] buffer of the compute dtype) when given."""
        w = self.weight if weight is None else weight
        if out is None:
            return (x[pos].to(w.dtype) @ w.T).to(self.dtype)
        if w.dtype != self.dtype:  # a bf16 head: the product in its dtype, upcast into the buffer
            return out.copy_(x[pos].to(w.dtype) @ w.T)
        return torch.mm(x[pos].to(w.dtype), w.T, out=out)

    def draft_probs(self, h: Tensor, pos: Tensor, lat: Tensor | None, y: Tensor, bufs: "_Buffers") -> tuple[Tensor, Tensor, Tensor | None]:
        """(p^d [m, V], CE = −log p^d_y [m], tanh(h[pos] W_lmᵀ / c) or None without softcap)
        for z = softcap(h[pos] W_lmᵀ) + lat W2ᵀ; tanh is kept for the backward: softcap' = 1 − tanh²."""
        m = pos.shape[0]
        if self.softcap is not None:
            tanh_u = self.project(h, pos, out=bufs.tanh[:m]).div_(self.softcap).tanh_()
            z = torch.mul(tanh_u, self.softcap, out=bufs.draft[:m])
        else:
            tanh_u, z = None, self.project(h, pos, out=bufs.draft[:m])
        if lat is not None:
            z.addmm_(lat, self.w2.T)  # + B_k
        z_y = z.gather(1, y)
        top, total = _softmax_(z)
        return z, (total.log() + top - z_y).squeeze(1), tanh_u

    def target_logits(self, t: Tensor, pos: Tensor, out: Tensor | None = None) -> Tensor:
        """softcap(t[pos] Wᵀ) [m, V] over the full vocabulary."""
        logits = self.project(t, pos, self.target_weight, out)
        if self.softcap is not None:  # in place: softcap(x) = c·tanh(x/c)
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def minus_target_probs(self, p: Tensor, t: Tensor, pos: Tensor, out: Tensor) -> Tensor:
        """p^d − p^t [m, V] from p = p^d [m, V] and the target hidden states t[pos] [m, d], in ``out``."""
        # p^t through the same _softmax_ as p^d, so that equal logits give bitwise-equal
        # probabilities and sign(p − p^t) = 0 exactly there.
        p_t = self.target_logits(t, pos, out)
        _softmax_(p_t)
        return torch.sub(p, p_t, out=p_t)

    def minus_distinct_target_probs(self, p: Tensor, t: Tensor, rows: Tensor, expand: Tensor, bufs: "_Buffers") -> Tensor:
        """p^d − p^t [m, V] like :meth:`minus_target_probs`, with p^t computed once per distinct target
        position: rows [u] of t to project, expand [m] the distinct row of each of the m positions."""
        p_t = self.target_logits(t, rows, bufs.distinct[: rows.shape[0]])
        _softmax_(p_t)
        diff = torch.index_select(p_t, 0, expand, out=bufs.target[: expand.shape[0]])
        return torch.sub(p, diff, out=diff)

    def minus_restricted_target(self, p: Tensor, t: Tensor, pos: Tensor,
                                expand: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Draft vocabulary: (p^d − p^t_D [m, k], target mass inside [m], argmax inside Bool [m]),
        p^t_D the target restricted to the k ids and renormalised (EAGLE-3). With ``expand`` [m],
        ``pos`` are the distinct target rows and row i of the result reads distinct row expand[i]."""
        logp, argmax_in, log_mass_in = self.vocab.restrict_logits(self.target_logits(t, pos))
        if expand is not None:
            logp, argmax_in, log_mass_in = logp[expand], argmax_in[expand], log_mass_in[expand]
        return logp.exp_().neg_().add_(p), log_mass_in.exp(), argmax_in


@dataclass
class _Buffers:
    """[rows, V] buffers reused by every chunk of one pass (rows = the largest chunk)."""

    draft: Tensor  # z, then p^d
    target: Tensor  # target logits, then p^t, then p^d − p^t, then the logits gradient
    tanh: Tensor | None  # tanh(u/c), softcap only
    distinct: Tensor | None = None  # p^t of a chunk's distinct target positions (``target_rows``)
    l1: Tensor | None = None  # [≤ _L1_ROWS, V] scratch for the row L1 norms (TV)

    @staticmethod
    def make(rows: int, cols: int, dtype: torch.dtype, device: torch.device, target: bool, tanh: bool,
             distinct: bool = False) -> "_Buffers":
        """Uninitialised buffers (every element is written before it is read); ``target``
        False with a draft vocabulary, whose target side is V-sized, not k-sized. On a CPU they
        are this thread's workspace (:func:`release_workspace`), kept from one call to the next."""
        def empty(name: str, n: int = rows) -> Tensor:
            if torch.device(device).type == "cpu":
                return _cpu_workspace(name, n, cols, dtype)
            return torch.empty(n, cols, dtype=dtype, device=device)  # CUDA's caching allocator reuses

        return _Buffers(empty("draft"), empty("target") if target else None, empty("tanh") if tanh else None,
                        empty("distinct") if target and distinct else None, empty("l1", min(rows, _L1_ROWS)))

    def row_l1(self, x: Tensor) -> Tensor:
        """Σ_v |x_v| per row of x [m, V] -> [m], |x| written a few rows at a time into ``l1``
        (x.abs().sum() would allocate an [m, V] tensor)."""
        out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        step = self.l1.shape[0]
        for start in range(0, x.shape[0], step):
            rows = x[start : start + step]
            torch.sum(torch.abs(rows, out=self.l1[: rows.shape[0]]), dim=1, out=out[start : start + rows.shape[0]])
        return out


# Rows of |p − p^t| per pass of :meth:`_Buffers.row_l1`: a small [32, V] scratch.
_L1_ROWS = 32

# The CPU buffers of the last call, per thread. A fresh [m, V] buffer is fresh pages from the OS:
# writing it the first time costs page faults of the order of a matmul over it (bench/README.md),
# and PyTorch keeps no CPU cache of freed memory.
_WORKSPACE = threading.local()


def _cpu_workspace(name: str, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """A [rows, cols] view of this thread's buffer ``name``, grown (never shrunk) on demand."""
    store: dict[str, Tensor] = _WORKSPACE.__dict__.setdefault("buffers", {})
    buf = store.get(name)
    if buf is None or buf.dtype != dtype or buf.shape[1] != cols or buf.shape[0] < rows:
        store[name] = buf = torch.empty(rows, cols, dtype=dtype)
    return buf[:rows]


def release_workspace() -> int:
    """Free this thread's CPU workspace of :func:`fused_dspark_loss` (2-5 [chunk_rows·γ, V] buffers,
    kept between calls); returns the bytes released. The next call allocates it again."""
    store: dict[str, Tensor] = _WORKSPACE.__dict__.pop("buffers", {})
    return sum(b.numel() * b.element_size() for b in store.values())


def _logits_grad(p: Tensor, diff: Tensor, y: Tensor, a: Tensor, b: Tensor | None) -> Tensor:
    """∂objective/∂z [m, V] = p ⊙ (a + b (s − ⟨p, s⟩)) − a·onehot(y) (Eq. 9-10 closed forms).

    p = p^d [m, V], diff = p^d − p^t [m, V], y [m, 1] the labels, a and b the CE
    and TV coefficients [m, 1] (b None: no TV gradient). Written in place over
    ``diff`` (or ``p`` when b is None): the caller must not read them again.
    """
    if b is not None:
        # s = sign(p − p^t) in place (sign(0) = 0 is the subgradient torch.abs uses), then
        # q = p ⊙ s: ⟨p, s⟩ is a plain row sum of q (a cheaper pass than a row-wise dot product),
        # and g = b·q + (a − b⟨p, s⟩)·p.
        q = diff.sign_().mul_(p)
        c = a - b * q.sum(dim=1, keepdim=True)  # [m, 1]
        g = q.mul_(b).addcmul_(p, c)  # p ⊙ (a + b (s − ⟨p, s⟩))
    else:
        g = p.mul_(a)
    g.scatter_add_(1, y, -a)  # − a·onehot(y)
    return g


@dataclass
class _FixedInputs:
    """What the autograd op reads but does not differentiate: the frozen heads, the target side,
    the supervision, the per-position coefficients and the chunking."""

    lm_head_weight: Tensor  # [V, d] ([k, d]), frozen
    target_hidden: Tensor  # [N, γ, d], detached
    labels: Tensor  # Long [N, γ], 0 where unsupervised
    valid: Tensor  # Bool [N, γ]
    ce_coef: Tensor  # [γ]: ∂objective/∂CE_k at a supervised position
    tv_coef: Tensor  # [γ]: ∂objective/∂TV_k
    tv_active: bool  # α_TV ≠ 0 (a Python flag: no device sync, no graph break under torch.compile)
    softcap: float | None
    chunk_rows: int
    grad_enabled: bool  # grad mode of the caller (forward itself runs with grad off)
    vocab: DraftVocab | None
    target_weight: Tensor | None  # [V, d] detached, with ``vocab``; None: ``lm_head_weight``
    target_rows: Tensor | None  # Long [N, γ]


class _Want(NamedTuple):
    """Which differentiable inputs of the op need a gradient."""

    hidden: bool
    latent: bool
    w2: bool


# ------------------------------------------------------------------- one pass
@dataclass
class _Pass:
    """The inputs flattened over the N·γ positions (row-major) and what the pass writes there."""

    hidden: Tensor  # [N·γ, d]
    target_hidden: Tensor  # [N·γ, d]
    latent: Tensor | None  # [N·γ, r]
    labels: Tensor  # [N·γ]
    target_rows: Tensor | None  # [N·γ] int64: equal ids have equal target hidden states
    ce_coef: Tensor  # [γ]
    tv_coef: Tensor | None  # [γ]; None: no TV gradient to compute
    any_grad: bool
    ce: Tensor  # [N·γ], compute dtype
    tv: Tensor  # [N·γ]
    grad_h: Tensor | None  # [N·γ, d], only if wanted
    grad_lat: Tensor | None  # [N·γ, r]
    grad_w2_t: Tensor | None  # [r, V]: W2's gradient transposed (accumulated as latᵀ g, the faster product order)
    tv_full: Tensor | None  # [N·γ], TV against the full target (draft vocabulary only)
    bufs: _Buffers | None = None

    @staticmethod
    def open(hidden: Tensor, latent: Tensor | None, w2: Tensor | None, fixed: _FixedInputs, want: _Want,
             dtype: torch.dtype) -> "_Pass":
        """The flattened inputs and zeroed outputs in ``dtype``; gradient outputs only where ``want`` asks."""
        rows, block_size, dim = hidden.shape
        n = rows * block_size
        flat_lat = None if latent is None else latent.reshape(n, latent.shape[2])

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=hidden.device)

        any_grad = any(want)
        return _Pass(
            hidden=hidden.reshape(n, dim),
            target_hidden=fixed.target_hidden.reshape(n, dim),
            latent=flat_lat,
            labels=fixed.labels.reshape(-1),
            target_rows=None if fixed.target_rows is None else fixed.target_rows.reshape(-1),
            ce_coef=fixed.ce_coef,
            ce=zeros(n),
            tv=zeros(n),
            grad_h=zeros(n, dim) if want.hidden else None,
            grad_lat=zeros(*flat_lat.shape) if want.latent else None,
            grad_w2_t=zeros(w2.shape[1], w2.shape[0]) if want.w2 else None,
            tv_full=None if fixed.vocab is None else zeros(n),
            any_grad=any_grad,
            tv_coef=fixed.tv_coef if any_grad and fixed.tv_active else None,
        )

    def result(self, hidden_shape: torch.Size, latent_shape: torch.Size | None) -> "_PassResult":
        """The outputs reshaped to the inputs' [N, γ, ...] shapes."""
        shape = hidden_shape[:2]
        return _PassResult(
            ce=self.ce.reshape(shape),
            tv=self.tv.reshape(shape),
            tv_c_star=(self.tv if self.tv_full is None else self.tv_full).reshape(shape),
            grad_hidden=None if self.grad_h is None else self.grad_h.reshape(hidden_shape),
            grad_latent=None if self.grad_lat is None else self.grad_lat.reshape(latent_shape),
            grad_w2=None if self.grad_w2_t is None else self.grad_w2_t.T,
        )


@dataclass
class _PassResult:
    """Per-position terms and the gradients of Σ (ce_coef_k·CE + tv_coef_k·TV), in the compute dtype."""

    ce: Tensor  # [N, γ]
    tv: Tensor  # [N, γ]
    tv_c_star: Tensor  # [N, γ], the TV c* is read from (against the full target with a draft vocabulary)
    grad_hidden: Tensor | None  # [N, γ, d]
    grad_latent: Tensor | None  # [N, γ, r]
    grad_w2: Tensor | None  # [V, r] ([k, r])


@dataclass
class _Chunk:
    """What the gradient of a chunk of m positions reuses from its terms."""

    p: Tensor  # p^d [m, V or k], in ``bufs.draft``
    diff: Tensor  # p^d − p^t [m, V or k]
    y: Tensor  # [m, 1] labels (draft ids with a draft vocabulary)
    lat: Tensor | None  # [m, r] latents in the compute dtype
    tanh_u: Tensor | None  # [m, V or k] tanh(u/c), softcap only
    keep: Tensor | None  # Bool [m], draft vocabulary only: CE kept (label and target argmax inside it)
    keep_tv: Tensor | None  # Bool [m], draft vocabulary only: TV kept (target argmax inside)


# Below this share of distinct target positions in a chunk, p^t is computed once per distinct
# position and gathered; above it the gather costs more than the rows it saves.
_DISTINCT_SHARE = 0.9


def _distinct_target_rows(run: _Pass, pos: Tensor) -> tuple[Tensor, Tensor | None]:
    """(rows of the target hidden states to project, [m] index of each position's row in them or
    None): one row per distinct ``run.target_rows`` id among ``pos`` (the smallest), when that
    saves enough; else (pos, None)."""
    if run.target_rows is None:
        return pos, None
    distinct, expand = torch.unique(run.target_rows[pos], return_inverse=True)
    if distinct.numel() > _DISTINCT_SHARE * pos.numel():
        return pos, None
    first = torch.full_like(distinct, run.target_rows.numel()).scatter_reduce_(0, expand, pos, reduce="amin")
    return first, expand


def _chunk_labels(run: _Pass, head: _Head, pos: Tensor) -> tuple[Tensor, Tensor | None]:
    """(labels y [m, 1] as rows of the draft head, Bool [m] label inside the draft vocabulary or
    None without one); a label outside reads row 0 and its position is dropped."""
    y = run.labels[pos][:, None]  # [m, 1], target ids
    if head.vocab is None:
        return y, None
    y = head.vocab.to_draft_ids(y)  # −1 outside the vocabulary
    return y.clamp_min(0), y.squeeze(1) >= 0


def _minus_target(run: _Pass, head: _Head, pos: Tensor, p: Tensor,
                  label_in: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(p^d − p^t [m, V or k], Bool [m] CE kept, Bool [m] TV kept, Bool [m] TV against the full
    target; the three None without a draft vocabulary), p^t computed once per distinct target
    position. With a draft vocabulary p^t is restricted to it, except at a kept position whose
    label lies outside (CE undefined there), whose row is p^d − p^t over the k ids of the full
    target; the TV against the full target (c*, Eq. 8) is written into ``run.tv_full``."""
    t_rows, expand = _distinct_target_rows(run, pos)
    if head.vocab is None and expand is None:
        return head.minus_target_probs(p, run.target_hidden, pos, run.bufs.target[: pos.shape[0]]), None, None, None
    if head.vocab is None:
        return head.minus_distinct_target_probs(p, run.target_hidden, t_rows, expand, run.bufs), None, None, None
    diff, mass_in, argmax_in = head.minus_restricted_target(p, run.target_hidden, t_rows, expand)  # [m, k]
    p_t_in = p - diff
    run.tv_full[pos] = full_vocab_tv(p, p_t_in, mass_in)
    full = argmax_in & ~label_in
    if bool(full.any()):
        diff[full] = p[full] - p_t_in[full] * mass_in[full, None]
    return diff, label_in & argmax_in, argmax_in, full


def _chunk_terms(run: _Pass, head: _Head, pos: Tensor) -> _Chunk:
    """CE (Eq. 9) and TV (Eq. 10) at the supervised positions ``pos`` [m], written into
    ``run.ce`` and ``run.tv`` (0 at a dropped position); [m, V] work happens in ``run.bufs``."""
    y, label_in = _chunk_labels(run, head, pos)
    lat = None if run.latent is None else run.latent[pos].to(head.dtype)  # [m, r]
    p, ce, tanh_u = head.draft_probs(run.hidden, pos, lat, y, run.bufs)  # p^d [m, V or k]
    diff, keep, keep_tv, full = _minus_target(run, head, pos, p, label_in)
    tv = run.bufs.row_l1(diff)
    if full is not None:
        tv = torch.where(full, run.tv_full[pos], tv)  # Σ over the k ids + the target's mass outside
    run.ce[pos] = ce if keep is None else torch.where(keep, ce, 0.0)
    run.tv[pos] = tv if keep_tv is None else torch.where(keep_tv, tv, 0.0)
    return _Chunk(p, diff, y, lat, tanh_u, keep, keep_tv)


def _chunk_grads(run: _Pass, head: _Head, pos: Tensor, chunk: _Chunk) -> None:
    """Gradients of Σ (ce_coef_k·CE + tv_coef_k·TV) over the chunk w.r.t. its hidden states,
    latents and W2, through the logits gradient of :func:`_logits_grad` (which overwrites
    ``chunk.p`` or ``chunk.diff``)."""
    block_size = run.ce_coef.shape[0]
    a = run.ce_coef[pos % block_size][:, None].to(head.dtype)  # [m, 1]
    b = None if run.tv_coef is None else run.tv_coef[pos % block_size][:, None].to(head.dtype)  # [m, 1]
    if chunk.keep is not None:  # a dropped term has no gradient
        a = a * chunk.keep[:, None]
        b = None if b is None else b * chunk.keep_tv[:, None]
    g = _logits_grad(chunk.p, chunk.diff, chunk.y, a, b)  # ∂objective/∂z, [m, V]
    if run.grad_lat is not None:
        run.grad_lat[pos] = g @ head.w2  # [m, r]
    if run.grad_w2_t is not None:
        run.grad_w2_t.addmm_(chunk.lat.T, g)  # [r, V]
    if run.grad_h is not None:
        if chunk.tanh_u is not None:
            g.mul_(chunk.tanh_u.square_().neg_().add_(1))  # ∂z/∂u = 1 − tanh²(u/c)
        run.grad_h[pos] = (g.to(head.weight.dtype) @ head.weight).to(head.dtype)  # [m, d]


def _fused_chunk(run: _Pass, head: _Head, pos: Tensor) -> None:
    """The terms at ``pos`` and, if the pass wants any gradient, theirs; nothing [m, V] outlives it."""
    chunk = _chunk_terms(run, head, pos)
    if run.any_grad:
        _chunk_grads(run, head, pos, chunk)


def _fused_ce_tv(hidden: Tensor, latent: Tensor | None, w2: Tensor | None, fixed: _FixedInputs,
                 want: _Want) -> _PassResult:
    """Per-position CE and TV terms [N, γ], the TV c* is read from [N, γ] and, for the inputs
    flagged in ``want``, the gradients of Σ (ce_coef_k·CE + tv_coef_k·TV), in the compute dtype.

    Only supervised positions are read (``chunk_rows·γ`` of them per chunk), so
    whatever sits in unsupervised slots cannot leak into values or gradients.
    """
    dtype = _fused_compute_dtype(hidden, fixed.lm_head_weight, w2)
    head = _Head(fixed.lm_head_weight, None if w2 is None else w2.to(dtype), fixed.softcap, dtype, fixed.vocab,
                 fixed.target_weight)
    run = _Pass.open(hidden, latent, w2, fixed, want, dtype)
    positions = fixed.valid.reshape(-1).nonzero().squeeze(1)  # supervised positions, row-major
    step = fixed.chunk_rows * hidden.shape[1]
    run.bufs = _Buffers.make(min(step, positions.numel()), fixed.lm_head_weight.shape[0], dtype, hidden.device,
                             target=fixed.vocab is None, tanh=fixed.softcap is not None,
                             distinct=fixed.target_rows is not None)
    for start in range(0, positions.numel(), step):
        _fused_chunk(run, head, positions[start : start + step])
    return run.result(hidden.shape, None if latent is None else latent.shape)
