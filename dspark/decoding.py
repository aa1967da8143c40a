"""Rejection sampling and the speculative decoding loop (SPEC sections 1 and 5).

Shapes: B requests, ℓ verified draft positions, V vocabulary entries. A round
verifies draft tokens x_1..x_ℓ against the target and emits the accepted prefix
plus one more token (the correction at the first rejection, or the bonus).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from dspark.modeling import Drafter, Proposal
    from dspark.target import TargetModel

# ---------------------------------------------------------------------------
# Verification primitives (SPEC section 5). Pure functions of tensors: no model,
# no cache, no state. Every random draw goes through the `generator` argument.
# ---------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def logits_to_probs(logits: Tensor, temperature: float) -> Tensor:
    """Softmax of ``logits / temperature`` over the last dim, computed in fp32.

    Args:
        logits: [..., V], any floating dtype.
        temperature: T > 0. Temperature 0 is greedy decoding: use
            ``greedy_verify`` / argmax instead of probabilities.

    Returns:
        [..., V] float32 probabilities. Draft tokens must be sampled from
        exactly these probabilities and the same tensor handed to
        ``rejection_sample`` (SPEC section 9: a bf16 softmax breaks losslessness).
    """
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r}; "
            "for temperature 0 (greedy) take the argmax of the logits and verify with greedy_verify"
        )
    if value == 1.0:  # no scaled copy of a [.., V] tensor at the default temperature
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.softmax(logits.float() / value, dim=-1)


def rejection_sample(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    lengths: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Lossless speculative sampling of one verification round (SPEC section 5).

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
    dtype = torch.promote_types(torch.promote_types(draft_probs.dtype, target_probs.dtype), torch.float32)

    # Accept test at every position at once; the first rejection is found with a cumprod.
    u = torch.rand(batch, ell, generator=generator, device=device, dtype=torch.float64)  # [B, ℓ]
    p_d = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()  # [B, ℓ]
    p_t = target_probs[:, :ell].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()  # [B, ℓ]
    # u < min(1, p_t/p_d) without dividing: with p_d(x) = 0 the ratio is +inf
    # (accept) unless p_t(x) = 0 too, and 0/0 is rejected.
    in_range = torch.arange(ell, device=device) < lengths.unsqueeze(-1)  # [B, ℓ]
    accept = (u * p_d < p_t) & in_range
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    # The next token comes from row num_accepted in both cases: the residual of
    # that position after a rejection, the bonus row when all ℓ_b were accepted.
    rows = torch.arange(batch, device=device)
    target_row = target_probs[rows, num_accepted].to(dtype)  # [B, V]
    if ell > 0:
        draft_row = draft_probs[rows, num_accepted.clamp(max=ell - 1)].to(dtype)  # [B, V]
        residual = (target_row - draft_row).clamp(min=0)  # [B, V]
        use_residual = (num_accepted < lengths) & (residual.sum(dim=-1) > 0)  # [B]
        weights = torch.where(use_residual.unsqueeze(-1), residual, target_row)  # [B, V]
    else:
        weights = target_row
    next_token = sample_categorical(weights, generator)
    return num_accepted, next_token


def greedy_verify(
    draft_tokens: Tensor,
    target_logits_or_probs: Tensor,
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Temperature-0 verification (SPEC section 5): accept x_k iff it is the target argmax.

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


def sample_categorical(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of non-negative ``weights`` [B, V], with P(i) ∝ weights[i].

    Inverse CDF on one uniform per row; the CDF is accumulated in float64 so
    that tokens with tiny mass in a large vocabulary keep their probability.
    """
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=torch.float64)
    # First i with cdf_i > u·total. As u < 1, u·total < total in float64, so such an i exists
    # and cdf_i > cdf_{i-1}: a token without mass is never drawn. The clamp only guards
    # against an all-zero row (invalid input).
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # [B]
    return index.clamp(max=weights.shape[-1] - 1)


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"


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
    vocab = target.shape[2]
    if vocab == 0:
        raise ValueError(f"{target_name} has an empty vocabulary dim (shape {tuple(target.shape)}); expected V ≥ 1")
    if target.device != draft_tokens.device:
        raise ValueError(
            f"{target_name} is on {target.device} but draft_tokens is on {draft_tokens.device}; move both to one device"
        )
    if draft_probs is not None:
        if not isinstance(draft_probs, Tensor) or not draft_probs.is_floating_point():
            raise ValueError(f"draft_probs must be a floating tensor of shape [B, ℓ, V], got {_describe(draft_probs)}")
        if tuple(draft_probs.shape) != (batch, ell, vocab):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}; expected [B, ℓ, V] = [{batch}, {ell}, {vocab}] "
                f"to match draft_tokens {tuple(draft_tokens.shape)} and {target_name} {tuple(target.shape)}"
            )
        if draft_probs.device != draft_tokens.device:
            raise ValueError(
                f"draft_probs is on {draft_probs.device} but draft_tokens is on {draft_tokens.device}; "
                "move both to one device"
            )
    if draft_tokens.numel() > 0:
        low, high = int(draft_tokens.min()), int(draft_tokens.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"draft_tokens must lie in [0, V) = [0, {vocab}), got values in [{low}, {high}]; "
                f"check that {target_name} covers the drafter's vocabulary"
            )
    if lengths is not None:
        if not isinstance(lengths, Tensor) or lengths.dtype not in _INDEX_DTYPES or tuple(lengths.shape) != (batch,):
            raise ValueError(f"lengths must be an integer tensor of shape [B] = [{batch}], got {_describe(lengths)}")
        if lengths.device != draft_tokens.device:
            raise ValueError(
                f"lengths is on {lengths.device} but draft_tokens is on {draft_tokens.device}; move both to one device"
            )
        if batch > 0:
            low, high = int(lengths.min()), int(lengths.max())
            if low < 0 or high > ell:
                raise ValueError(
                    f"lengths must lie in [0, ℓ] = [0, {ell}], got values in [{low}, {high}]; "
                    "a row cannot verify more draft positions than draft_tokens holds"
                )
    return batch, ell, vocab


def _lengths_or_full(lengths: Tensor | None, batch: int, ell: int, device: torch.device) -> Tensor:
    if lengths is None:
        return torch.full((batch,), ell, dtype=torch.long, device=device)
    return lengths.long()


# ---------------------------------------------------------------------------
# The speculative decoding loop (SPEC section 1) and its target-only baseline.
# One request (batch 1), a KV-cached target and an incrementally kept drafter
# context; SpeculativeRequest holds that state and steps it one round at a time
# (dspark.serving steps many of them in lockstep under a scheduler). Both loops
# draw every token through the helpers above, so a wall-clock comparison
# between them measures speculation and nothing else.
# ---------------------------------------------------------------------------

# (confidences c_1..c_γ or None, round index) -> verification length ℓ in 0..γ
ChooseLength = Callable[[list[float] | None, int], int]


@dataclass
class RoundRecord:
    """One draft/verify round.

    proposed: ℓ, the number of draft tokens sent to verification (0..γ).
    accepted: m, how many of them the target accepted (0..ℓ); τ of the round is m + 1.
        An accepted EOS ends the accepted prefix (later drafts are not counted);
        truncation at max_new_tokens does not change m.
    confidences: c_1..c_γ of all γ drafted positions (not cumulative), None
        without a confidence head.
    """

    proposed: int
    accepted: int
    confidences: list[float] | None


@dataclass
class DecodeResult:
    """What one generation returns.

    prompt_len: number of prompt tokens.
    tokens: the generated ids (at most max_new_tokens, an EOS included when it ended the sequence).
    rounds: one record per draft/verify round (empty for target-only decoding).
    finished_by_eos: True if the sequence ended on an EOS id.
    timings: seconds per phase. Speculative: prefill, draft (drafter.propose),
        verify (the target forward), accept (target probabilities and
        rejection sampling), bookkeeping (cache crop, context extend).
        Target-only: prefill, decode (target forwards), sample. Both: total
        (wall clock of the whole call).
    """

    prompt_len: int
    tokens: list[int]
    rounds: list[RoundRecord]
    finished_by_eos: bool
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def mean_tau(self) -> float:
        """Mean τ = accepted + 1 over the rounds (nan without rounds)."""
        if not self.rounds:
            return math.nan
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_ids: Iterable[int] = (),
    choose_length: ChooseLength | None = None,
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Speculative decoding of one request (SPEC section 1), lossless at every temperature.

    A loop over one ``SpeculativeRequest``: draft, pick ℓ, verify, until done.
    See ``SpeculativeRequest`` for the cache/context invariant of every round.

    Args:
        target: the frozen target (its forward, new_cache and crop_cache are used).
        drafter: the drafter (new_context, extend_context and propose are used; a
            test double with the same protocol works too).
        prompt_ids: the rendered prompt, at least one token.
        max_new_tokens: the most tokens to generate (the last round is truncated).
        temperature: T > 0 samples from softmax(logits / T) with rejection
            sampling; T = 0 is greedy (verified with greedy_verify).
        eos_token_ids: ids that end the sequence (the EOS is kept in `tokens`).
        choose_length: optional hook (confidences c_1..c_γ or None, round index) -> ℓ in 0..γ,
            the number of drafts to verify; default γ every round.
        generator: source of every random draw (draft sampling and verification).
    """
    request = SpeculativeRequest(
        target, drafter, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
        eos_token_ids=eos_token_ids, generator=generator,
    )
    while not request.done:
        request.draft()
        gamma = request.gamma
        ell = gamma if choose_length is None else _checked_length(
            choose_length(request.confidences, len(request.rounds)), gamma
        )
        request.verify(ell)
    return request.result()


class SpeculativeRequest:
    """One request's speculative decoding, stepped one round at a time (SPEC section 1).

    The pieces of ``speculative_generate`` with the verification length chosen
    from outside between ``draft`` and ``verify``, so that a serving loop
    (``dspark.serving``) can step many requests in lockstep and let a scheduler
    see all their confidences before any of them is verified. Every request
    keeps its own target KV cache, drafter context and random generator;
    verification runs per request (batch 1) with real rejection sampling.

    Construction runs the prefill and emits x_0. Then, until ``done``::

        proposal = request.draft()       # x_1..x_γ, their probabilities, c_1..c_γ
        record = request.verify(ell)     # verify x_1..x_ℓ, 0 ≤ ℓ ≤ γ
    and ``request.result()`` gives the DecodeResult.

    Invariant at the start of every round: the target cache and the drafter
    context both hold positions 0 .. P+n−2 (P prompt tokens, n tokens
    generated so far), and the anchor x_0, the last generated token, sits at
    position P+n−1. A round drafts x_1..x_γ from x_0, verifies x_0..x_ℓ in one
    target forward, keeps x_0..x_m in the cache and in the drafter context
    (with the features of that same forward) and makes the emitted next token
    the new anchor.

    Random draws, in order: x_0 at construction, then per round the drafts
    (``draft``) and the acceptance tests and next token (``verify``), all from
    ``generator``: the same generator state gives the same tokens whatever the
    other requests of a batch do.

    Arguments as in ``speculative_generate``.
    """

    @torch.no_grad()
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        eos_token_ids: Iterable[int] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        _check_generate_args(prompt_ids, max_new_tokens, temperature)
        self.target, self.drafter = target, drafter
        self.max_new_tokens, self.temperature, self.generator = max_new_tokens, temperature, generator
        self.eos = {int(t) for t in eos_token_ids}
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = []
        self.rounds: list[RoundRecord] = []
        self.proposal: Proposal | None = None  # the pending draft, between draft() and verify()
        self.clock = _PhaseClock(target.device)
        if max_new_tokens == 0:
            return
        with self.clock("prefill"):
            self.cache = target.new_cache()
            out = target(_ids(prompt_ids, target.device), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
            self.ctx = drafter.new_context(1, target.device, capacity=self.prompt_len + max_new_tokens)
            drafter.extend_context(self.ctx, out.features)  # context positions 0..P-1
            self.anchor = _next_token(out.logits[:, -1], temperature, generator)  # x_0, [1]
            self.tokens.append(int(self.anchor))

    @property
    def done(self) -> bool:
        """True once the last token is an EOS or max_new_tokens tokens exist."""
        return len(self.tokens) >= self.max_new_tokens or self.tokens[-1] in self.eos

    @property
    def gamma(self) -> int:
        """γ of the pending draft (call ``draft`` first)."""
        return self._pending().tokens.shape[1]

    @property
    def confidences(self) -> list[float] | None:
        """c_1..c_γ of the pending draft, None without a confidence head."""
        c = self._pending().confidences
        return None if c is None else c[0].tolist()

    @torch.no_grad()
    def draft(self) -> Proposal:
        """Draft x_1..x_γ from the current anchor (SPEC 1, steps 2-4); kept until ``verify``."""
        if self.done:
            raise RuntimeError("draft() on a finished request; check request.done first")
        if self.proposal is not None:
            raise RuntimeError("draft() called twice without verify(); each round drafts once")
        with self.clock("draft"):
            self.proposal = self.drafter.propose(
                self.ctx, self.anchor, temperature=self.temperature, generator=self.generator
            )
        return self.proposal

    @torch.no_grad()
    def verify(self, ell: int) -> RoundRecord:
        """Verify the first ``ell`` drafts in one target forward (SPEC 1 step 6, SPEC 5).

        Appends the accepted prefix and the next token to ``tokens`` (truncated at
        max_new_tokens and after an EOS), and when the request goes on crops the
        cache to x_0..x_m, extends the drafter context with their features and
        makes the next token the anchor. Returns the round's record."""
        proposal, gamma = self._pending(), self.gamma
        if isinstance(ell, bool) or not isinstance(ell, (int, np.integer)) or not 0 <= int(ell) <= gamma:
            raise ValueError(
                f"verification length ell={ell!r} must be an int in 0..γ = 0..{gamma} (γ is the drafter's block size)"
            )
        ell = int(ell)
        confidences = self.confidences
        self.proposal = None
        target, anchor = self.target, self.anchor
        draft = proposal.tokens[:, :ell]  # [1, ℓ]

        with self.clock("verify"):  # positions P+n-1 .. P+n-1+ℓ; logits row k is p_t of x_{k+1}
            out = target(torch.cat([anchor[:, None], draft], dim=1), past_key_values=self.cache, use_cache=True)

        with self.clock("accept"):
            if self.temperature == 0:
                num_accepted, next_token = greedy_verify(draft, out.logits)
            else:
                target_probs = logits_to_probs(out.logits, self.temperature)  # [1, ℓ+1, V]
                num_accepted, next_token = rejection_sample(
                    draft, proposal.probs[:, :ell], target_probs, generator=self.generator
                )
            m, *drafted, nxt = torch.cat([num_accepted, draft[0], next_token]).tolist()  # one host sync
            emitted = _through_first_eos(drafted[:m] + [nxt], self.eos)
            record = RoundRecord(proposed=ell, accepted=min(m, len(emitted)), confidences=confidences)
            self.rounds.append(record)
            self.tokens += emitted[: self.max_new_tokens - len(self.tokens)]
        if self.done:
            return record

        with self.clock("bookkeeping"):  # keep x_0..x_m, drop the rejected drafts
            target.crop_cache(self.cache, self.prompt_len + len(self.tokens) - 1)
            self.drafter.extend_context(self.ctx, out.features[:, : m + 1])
            self.anchor = next_token
        return record

    def result(self) -> DecodeResult:
        """The DecodeResult so far; timings["total"] is the wall clock since construction."""
        finished = bool(self.tokens) and self.tokens[-1] in self.eos
        return DecodeResult(self.prompt_len, list(self.tokens), list(self.rounds), finished, self.clock.finish())

    def _pending(self) -> Proposal:
        if self.proposal is None:
            raise RuntimeError("no pending draft: call draft() before reading it or calling verify()")
        return self.proposal


@torch.no_grad()
def target_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> DecodeResult:
    """Target-only autoregressive decoding with the same cache and sampling helpers.

    The baseline for wall-clock speedups and the reference distribution that
    speculative_generate must reproduce. Arguments as in speculative_generate.
    """
    _check_generate_args(prompt_ids, max_new_tokens, temperature)
    clock = _PhaseClock(target.device)
    eos = {int(t) for t in eos_token_ids}
    tokens: list[int] = []
    if max_new_tokens > 0:
        with clock("prefill"):
            cache = target.new_cache()
            out = target(_ids(prompt_ids, target.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        while True:
            with clock("sample"):
                token = _next_token(out.logits[:, -1], temperature, generator)  # [1]
                tokens.append(int(token))
            if tokens[-1] in eos or len(tokens) >= max_new_tokens:
                break
            with clock("decode"):
                out = target(token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finished = bool(tokens) and tokens[-1] in eos
    return DecodeResult(len(prompt_ids), tokens, [], finished, clock.finish())


def _next_token(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """One token per row of logits [B, V]: the argmax at T = 0, else a draw from softmax(logits/T). -> [B]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_categorical(logits_to_probs(logits, temperature), generator)


def _through_first_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """tokens up to and including the first EOS id (all of them without one)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _ids(prompt_ids: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, P]


def _checked_length(ell: Any, gamma: int) -> int:
    if isinstance(ell, bool) or not isinstance(ell, (int, Tensor)) or (isinstance(ell, Tensor) and ell.numel() != 1):
        raise ValueError(f"choose_length must return an int in 0..γ = 0..{gamma}, got {ell!r}")
    value = int(ell)
    if not 0 <= value <= gamma:
        raise ValueError(
            f"choose_length returned {value}; the verification length must be in 0..γ = 0..{gamma} "
            "(γ is the drafter's block size)"
        )
    return value


def _check_generate_args(prompt_ids: Sequence[int], max_new_tokens: int, temperature: float) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; the target needs at least one prompt token (e.g. a BOS id)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


class _PhaseClock:
    """Accumulates wall-clock seconds per phase. On CUDA each phase ends with a synchronize,
    so that the time of asynchronous kernels lands in the phase that launched them."""

    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.totals: dict[str, float] = {}
        cuda = torch.device(device).type == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start

    def finish(self) -> dict[str, float]:
        """The per-phase totals plus "total", the wall clock since the clock was made."""
        return {**self.totals, "total": time.perf_counter() - self.start}
