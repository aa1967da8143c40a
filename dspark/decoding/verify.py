"""Verification of a draft block against the target (speculative sampling, paper Section 2.1).

Pure functions of tensors: no model, no cache, no state. Every random draw goes
through the ``generator`` argument. Shapes: B requests, ℓ verified draft
positions, V vocabulary entries. A round verifies draft tokens x_1..x_ℓ and
emits the accepted prefix plus one more token (the correction at the first
rejection, or the bonus).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dspark.sampling import logits_to_probs, sample_categorical

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def verify_draft(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_logits: Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """The verification rule of the decoding loops: ``greedy_verify`` on the logits at T = 0,
    else ``rejection_sample`` against the target's probabilities at T (``logits_to_probs``).

    draft_tokens [B, ℓ], draft_probs [B, ℓ, V] (unused at T = 0), target_logits [B, ℓ+1, V].
    Returns (num_accepted, next_token), two [B] int64 tensors.
    """
    if temperature == 0:
        return greedy_verify(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, temperature)  # [B, ℓ+1, V]
    return rejection_sample(draft_tokens, draft_probs, target_probs, generator=generator)


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Lossless speculative sampling of one verification round (paper Section 2.1).

    For k = 1..ℓ_b, x_k is accepted iff u_k < min(1, p_t(x_k) / p_d(x_k)) with
    u_k ~ U(0, 1). At the first rejection the next token is drawn from
    norm(max(0, p_t − p_d)) of that position (from p_t if that residual has no
    mass); if all ℓ_b are accepted it is the bonus, drawn from target row ℓ_b.
    The emitted tokens x_1..x_m, next_token are then distributed exactly as
    the target's own autoregressive samples.

    Args:
        draft_tokens: [B, ℓ] integer draft tokens x_1..x_ℓ (ℓ may be 0).
        draft_probs: [B, ℓ, V] the exact probabilities the draft tokens were
            sampled from (fp32, at the sampling temperature).
        target_probs: [B, ℓ+1, V] target probabilities at the sampling
            temperature; row k is the distribution of draft position k+1, row
            ℓ the bonus distribution after all ℓ drafts.
        lengths: optional [B] integer verification lengths ℓ_b ≤ ℓ. Draft
            positions ≥ ℓ_b are ignored and the bonus comes from row ℓ_b.
            Default: ℓ for every row.
        generator: source of every random draw (B·ℓ acceptance uniforms, then
            B uniforms for the next token), for reproducible rounds.

    Returns:
        (num_accepted, next_token): two [B] int64 tensors; τ = num_accepted + 1.
    """
    batch, ell, _ = _check_verify_inputs(draft_tokens, target_probs, "target_probs", lengths, draft_probs)
    device = draft_tokens.device
    tokens = draft_tokens.long()
    lengths = _lengths_or_full(lengths, batch, ell, device)

    # Accept test at every position at once; the first rejection is found with a cumprod.
    u = torch.rand(batch, ell, generator=generator, device=device, dtype=torch.float64)  # [B, ℓ]
    p_d = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()  # [B, ℓ]
    p_t = target_probs[:, :ell].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()  # [B, ℓ]
    # u < min(1, p_t/p_d) without dividing: with p_d(x) = 0 the ratio is +inf
    # (accept) unless p_t(x) = 0 too, and 0/0 is rejected.
    in_range = torch.arange(ell, device=device) < lengths.unsqueeze(-1)  # [B, ℓ]
    accept = (u * p_d < p_t) & in_range
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    weights = _next_token_weights(draft_probs, target_probs, num_accepted, lengths)
    next_token = sample_categorical(weights, generator)
    return num_accepted, next_token


def _next_token_weights(draft_probs: Tensor, target_probs: Tensor, num_accepted: Tensor, lengths: Tensor) -> Tensor:
    """[B, V] unnormalised distribution of the token after the m = num_accepted accepted drafts.

    It comes from row m in both cases: the residual max(0, p_t − p_d) of that
    position after a rejection (p_t if the residual has no mass), the bonus
    row p_t when all ℓ_b were accepted.
    """
    batch, ell = draft_probs.shape[:2]
    dtype = torch.promote_types(torch.promote_types(draft_probs.dtype, target_probs.dtype), torch.float32)
    rows = torch.arange(batch, device=num_accepted.device)
    target_row = target_probs[rows, num_accepted].to(dtype)  # [B, V]
    if ell == 0:
        return target_row
    draft_row = draft_probs[rows, num_accepted.clamp(max=ell - 1)].to(dtype)  # [B, V]
    residual = (target_row - draft_row).clamp(min=0)  # [B, V]
    use_residual = (num_accepted < lengths) & (residual.sum(dim=-1) > 0)  # [B]
    return torch.where(use_residual.unsqueeze(-1), residual, target_row)  # [B, V]


def greedy_verify(
    draft_tokens: Tensor,
    target_logits_or_probs: Tensor,
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Temperature-0 verification (paper Section 2.1 at T = 0): accept x_k iff it is the target argmax.

    Args:
        draft_tokens: [B, ℓ] integer draft tokens (ℓ may be 0).
        target_logits_or_probs: [B, ℓ+1, V] target logits or probabilities
            (only the argmax is used; ties go to the lowest token id).
        lengths: optional [B] integer verification lengths ℓ_b ≤ ℓ, as in
            ``rejection_sample``.

    Returns:
        (num_accepted, next_token): [B] int64; next_token is the target argmax
        at the first mismatch, or of row ℓ_b when all ℓ_b drafts match.
    """
    batch, ell, _ = _check_verify_inputs(draft_tokens, target_logits_or_probs, "target_logits_or_probs", lengths)
    device = draft_tokens.device
    lengths = _lengths_or_full(lengths, batch, ell, device)
    target_argmax = target_logits_or_probs.argmax(dim=-1)  # [B, ℓ+1]
    in_range = torch.arange(ell, device=device) < lengths.unsqueeze(-1)  # [B, ℓ]
    match = (draft_tokens.long() == target_argmax[:, :ell]) & in_range
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    next_token = target_argmax.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return num_accepted, next_token


def _lengths_or_full(lengths: Tensor | None, batch: int, ell: int, device: torch.device) -> Tensor:
    if lengths is None:
        return torch.full((batch,), ell, dtype=torch.long, device=device)
    return lengths.long()


# ---------------------------------------------------------------------------
# Input checks shared by the verifiers, in the order they run.
# ---------------------------------------------------------------------------


def _check_verify_inputs(
    draft_tokens: Tensor,
    target: Tensor,
    target_name: str,
    lengths: Tensor | None,
    draft_probs: Tensor | None = None,
) -> tuple[int, int, int]:
    """Validate the shapes shared by the verifiers; return (B, ℓ, V)."""
    if not isinstance(draft_tokens, Tensor) or draft_tokens.dim() != 2 or draft_tokens.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"draft_tokens must be an integer tensor of shape [B, ℓ], got {_describe(draft_tokens)}; "
            "for a single request add the batch dim with draft_tokens.unsqueeze(0)"
        )
    batch, ell = draft_tokens.shape
    vocab = _check_target(target, target_name, draft_tokens)
    if draft_probs is not None:
        _check_draft_probs(draft_probs, draft_tokens, target, target_name)
    _check_range("draft_tokens", draft_tokens, f"[0, V) = [0, {vocab})", vocab - 1,
                 f"check that {target_name} covers the drafter's vocabulary")
    if lengths is not None:
        if not isinstance(lengths, Tensor) or lengths.dtype not in _INDEX_DTYPES or tuple(lengths.shape) != (batch,):
            raise ValueError(f"lengths must be an integer tensor of shape [B] = [{batch}], got {_describe(lengths)}")
        _check_device("lengths", lengths, draft_tokens)
        _check_range("lengths", lengths, f"[0, ℓ] = [0, {ell}]", ell,
                     "a row cannot verify more draft positions than draft_tokens holds")
    return batch, ell, vocab


def _check_target(target: Tensor, target_name: str, draft_tokens: Tensor) -> int:
    """target [B, ℓ+1, V] against draft_tokens [B, ℓ]; returns V."""
    batch, ell = draft_tokens.shape
    if not isinstance(target, Tensor) or target.dim() != 3 or not target.is_floating_point():
        raise ValueError(
            f"{target_name} must be a floating tensor of shape [B, ℓ+1, V] = [{batch}, {ell + 1}, V], "
            f"got {_describe(target)}"
        )
    if target.shape[0] != batch or target.shape[1] != ell + 1:
        raise ValueError(
            f"{target_name} has shape {tuple(target.shape)} but draft_tokens has shape {tuple(draft_tokens.shape)}; "
            f"expected [B, ℓ+1, V] = [{batch}, {ell + 1}, V]: one row per draft position plus the bonus row"
        )
    if target.shape[2] == 0:
        raise ValueError(f"{target_name} has an empty vocabulary dim (shape {tuple(target.shape)}); expected V ≥ 1")
    _check_device(target_name, target, draft_tokens)
    return target.shape[2]


def _check_draft_probs(draft_probs: Tensor, draft_tokens: Tensor, target: Tensor, target_name: str) -> None:
    """draft_probs [B, ℓ, V] against draft_tokens [B, ℓ] and target [B, ℓ+1, V]."""
    if not isinstance(draft_probs, Tensor) or not draft_probs.is_floating_point():
        raise ValueError(f"draft_probs must be a floating tensor of shape [B, ℓ, V], got {_describe(draft_probs)}")
    (batch, ell), vocab = draft_tokens.shape, target.shape[2]
    if tuple(draft_probs.shape) != (batch, ell, vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}; expected [B, ℓ, V] = [{batch}, {ell}, {vocab}] "
            f"to match draft_tokens {tuple(draft_tokens.shape)} and {target_name} {tuple(target.shape)}"
        )
    _check_device("draft_probs", draft_probs, draft_tokens)


def _check_device(name: str, x: Tensor, draft_tokens: Tensor) -> None:
    if x.device != draft_tokens.device:
        raise ValueError(
            f"{name} is on {x.device} but draft_tokens is on {draft_tokens.device}; move both to one device"
        )


def _check_range(name: str, values: Tensor, interval: str, high_max: int, fix: str) -> None:
    """Integer ``values`` must lie in 0..high_max (``interval`` is how the message writes it)."""
    if values.numel() == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high > high_max:
        raise ValueError(f"{name} must lie in {interval}, got values in [{low}, {high}]; {fix}")


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"
