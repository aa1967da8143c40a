"""The speculative decoding loop (paper Section 2.1, Figure 1) and its target-only baseline.

One request (batch 1), a KV-cached target and an incrementally kept drafter context.
``SpeculativeRequest`` holds that state and steps it one round at a time: draft, verify, accept,
update the caches (``dspark.scheduling.simulator`` steps many of them in lockstep under a
scheduler); ``speculative_generate`` loops it to the end. Both loops draw every token through
``dspark.sampling`` (the speculative one verifies through ``dspark.decoding.verify``), so a
wall-clock comparison between them measures speculation and nothing else. Arguments are checked
before any forward (``dspark.decoding.checks``). Phase timings come from a ``PhaseClock``.

Both loops run under ``torch.inference_mode`` (not just ``no_grad``): no version counters or
view tracking on the ~1,500 small ops of a forward. The caches and drafter contexts they make
are inference tensors, only ever updated by these loops.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from dspark.decoding.checks import (
    check_drafter,
    check_generate_args,
    check_prompt_ids,
    checked_length,
    checked_sts_temperatures,
    checked_verify_length,
)
from dspark.decoding.verify import verify_draft
from dspark.sampling import sample_token
from dspark.scheduling.calibration import apply_temperatures

if TYPE_CHECKING:
    from dspark.decoding.prefill_store import PrefillStore
    from dspark.modeling import Drafter, Proposal
    from dspark.target import TargetModel

# (confidences c_1..c_γ, None without a confidence head; round index) -> verification length ℓ in 0..γ
ChooseLength = Callable[[list[float] | None, int], int]


@dataclass
class RoundRecord:
    """One draft/verify round.

    proposed: ℓ, the number of draft tokens sent to verification (0..γ);
        cut to m when an accepted EOS ended the round (the drafts after it
        were never looked at, so they are neither accepted nor rejected).
    accepted: m, how many of them the target accepted (0..ℓ), an accepted
        EOS included; truncation at max_new_tokens does not change m.
    confidences: c_1..c_γ of all γ drafted positions (not cumulative), None
        without a confidence head.
    eos_accepted: an EOS among the accepted drafts ended the sequence, so no
        token follows it: τ of the round is m, not m + 1. DeepSpec's
        evaluator counts such a round the same way (acceptance length and
        proposal length both cut at the EOS).
    """

    proposed: int
    accepted: int
    confidences: list[float] | None
    eos_accepted: bool = False

    @property
    def tau(self) -> int:
        """Tokens the round emitted before any max_new_tokens cut: m + 1, or m after an accepted EOS."""
        return self.accepted + (0 if self.eos_accepted else 1)


@dataclass
class DecodeResult:
    """What one generation returns.

    prompt_len: number of prompt tokens.
    tokens: the generated ids (at most max_new_tokens, an EOS included when it ended the sequence).
    rounds: one record per draft/verify round (empty for target-only decoding).
    finished_by_eos: True if the sequence ended on an EOS id.
    timings: seconds per phase (empty when nothing was timed). Speculative:
        prefill, draft (drafter.propose), verify (the target forward), accept
        (target probabilities and rejection sampling), bookkeeping (cache
        crop, context extend). Target-only: prefill, decode (target
        forwards), sample. Both: total (wall clock of the whole call).
    """

    prompt_len: int
    tokens: list[int]
    rounds: list[RoundRecord]
    finished_by_eos: bool
    timings: dict[str, float] = field(default_factory=dict)


@torch.inference_mode()
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
    sts_temperatures: Sequence[float] | str | os.PathLike | None = None,
    prefills: PrefillStore | None = None,
) -> DecodeResult:
    """Speculative decoding of one request (paper Section 2.1, Figure 1), lossless at every temperature.

    A loop over one ``SpeculativeRequest``: draft, pick ℓ, verify, until done.
    See ``SpeculativeRequest`` for the cache/context invariant of every round.
    The result carries the phase timings of the whole call. Before any forward
    the prompt is checked (a 1-D sequence of ids in [0, V)) and so is the
    drafter against the target (``dspark.modeling.checkpoint.check_against_target``:
    hidden size, vocabulary, layer count, the captured feature layers).

    Args:
        target: the frozen target (its forward, new_cache and crop_cache are used).
        drafter: the drafter (new_context, extend_context and propose are used; a
            test double with the same protocol works too).
        prompt_ids: the rendered prompt: one 1-D sequence of token ids in [0, V) (a list,
            tuple, 1-D integer tensor or array), at least one token.
        max_new_tokens: the most tokens to generate (the last round is truncated).
        temperature: T > 0 samples from softmax(logits / T) with rejection
            sampling; T = 0 is greedy (verified with greedy_verify).
        eos_token_ids: ids that end the sequence (the EOS is kept in `tokens`).
        choose_length: optional hook (confidences, round index) -> ℓ in 0..γ, the number of
            drafts to verify; default γ every round. The confidences are c_1..c_γ of the
            round's drafts (per position, not cumulative), STS-calibrated when
            ``sts_temperatures`` is given, and None for a drafter without a confidence head.
        generator: source of every random draw (draft sampling and verification).
        sts_temperatures: Sequential Temperature Scaling (paper Section 3.2.1): T_1..T_γ, or
            the path of the STS JSON ``dspark calibrate`` writes. The hook then sees
            c'_k = σ(logit(c_k) / T_k) (``dspark.scheduling.calibration.apply_temperatures``);
            the round records keep the raw c_k, which STS is fitted on.
        prefills: prompt prefills to take and keep (``dspark.decoding.prefill_store``; ``_prefill``).
    """
    temps = checked_sts_temperatures(sts_temperatures, drafter)
    request = SpeculativeRequest(
        target, drafter, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
        eos_token_ids=eos_token_ids, generator=generator, clock=PhaseClock(target.device), prefills=prefills,
    )
    while not request.done:
        request.draft()
        gamma = request.gamma
        ell = gamma
        if choose_length is not None:
            confidences = _calibrated(request.confidences, temps)
            ell = checked_length(choose_length(confidences, len(request.rounds)), gamma)
        request.verify(ell)
    return request.result()


def _calibrated(confidences: list[float] | None, temps: np.ndarray | None) -> list[float] | None:
    """c'_k = σ(logit(c_k) / T_k) of one round (paper Section 3.2.1); as given without temperatures or confidences."""
    if temps is None or confidences is None:
        return confidences
    if temps.size != len(confidences):
        raise ValueError(f"sts_temperatures has {temps.size} values but the drafter's block size γ is "
                         f"{len(confidences)}: give one temperature per draft position")
    return apply_temperatures(np.asarray([confidences], dtype=np.float64), temps)[0].tolist()


class SpeculativeRequest:
    """One request's speculative decoding, stepped one round at a time (paper Figure 1).

    The pieces of ``speculative_generate`` with the verification length chosen
    from outside between ``draft`` and ``verify``, so that a serving loop
    (``dspark.scheduling.simulator``) can step many requests in lockstep and let a scheduler
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

    ``clock``: a ``PhaseClock`` that times the phases (prefill, draft, verify,
    accept, bookkeeping) into ``result().timings``; None times nothing. Other
    arguments as in ``speculative_generate``; construction checks them, and the
    drafter against the target, before the prefill; ``prefills``: a PrefillStore to take the prompt's
    prefill from and keep it in (``_prefill``).
    """

    @torch.inference_mode()
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
        clock: PhaseClock | None = None,
        prefills: PrefillStore | None = None,
    ) -> None:
        check_generate_args(max_new_tokens, temperature)
        prompt_ids = check_prompt_ids(prompt_ids, getattr(target, "vocab_size", None))
        check_drafter(drafter, target)
        self.target, self.drafter = target, drafter
        self.max_new_tokens, self.temperature, self.generator = max_new_tokens, temperature, generator
        self.eos = {int(t) for t in eos_token_ids}
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = []
        self.rounds: list[RoundRecord] = []
        self.proposal: Proposal | None = None  # the pending draft, between draft() and verify()
        self.clock = clock if clock is not None else _UNTIMED
        if max_new_tokens == 0:
            return
        self.cache, out = _prefill(target, prompt_ids, prefills, self.clock)
        with self.clock("prefill"):
            self.ctx = drafter.new_context(1, target.device, capacity=self.prompt_len + max_new_tokens)
            _extend_context(drafter, self.ctx, out.features, prompt_ids)  # context positions 0..P-1
            self.anchor = sample_token(out.logits[:, -1], temperature, generator)  # x_0, [1]
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

    @torch.inference_mode()
    def draft(self) -> Proposal:
        """Draft x_1..x_γ from the current anchor (paper Section 3.1: parallel, then sequential stage); kept until ``verify``."""
        if self.done:
            raise RuntimeError("draft() on a finished request; check request.done first")
        if self.proposal is not None:
            raise RuntimeError("draft() called twice without verify(); each round drafts once")
        with self.clock("draft"):
            self.proposal = self.drafter.propose(
                self.ctx, self.anchor, temperature=self.temperature, generator=self.generator
            )
        return self.proposal

    @torch.inference_mode()
    def verify(self, ell: int) -> RoundRecord:
        """Verify the first ``ell`` drafts in one target forward (paper Section 2.1).

        Appends the accepted prefix and the next token to ``tokens`` (truncated at
        max_new_tokens; an accepted EOS ends the prefix with no next token), and
        when the request goes on crops the cache to x_0..x_m, extends the drafter
        context with their features and makes the next token the anchor.
        Returns the round's record."""
        proposal, ell = self._pending(), checked_verify_length(ell, self.gamma)
        confidences = self.confidences
        self.proposal = None
        draft = proposal.tokens[:, :ell]  # [1, ℓ]

        with self.clock("verify"):  # positions P+n-1 .. P+n-1+ℓ; logits row k is p_t of x_{k+1}
            x = torch.cat([self.anchor[:, None], draft], dim=1)  # [1, 1+ℓ]
            out = self.target(x, past_key_values=self.cache, use_cache=True)

        with self.clock("accept"):
            num_accepted, next_token = verify_draft(
                draft, proposal.probs[:, :ell], out.logits, self.temperature, self.generator
            )
            m, *drafted, nxt = torch.cat([num_accepted, draft[0], next_token]).tolist()  # one host sync
            eos_at = _first_eos(drafted[:m], self.eos)
            if eos_at is None:
                emitted, record = drafted[:m] + [nxt], RoundRecord(ell, m, confidences)
            else:  # the sequence ends at the EOS: no next token, nothing after it was verified
                m = eos_at + 1
                emitted, record = drafted[:m], RoundRecord(m, m, confidences, eos_accepted=True)
            self.rounds.append(record)
            self.tokens += emitted[: self.max_new_tokens - len(self.tokens)]
        if self.done:
            return record

        with self.clock("bookkeeping"):  # keep x_0..x_m, drop the rejected drafts
            self.target.crop_cache(self.cache, self.prompt_len + len(self.tokens) - 1)
            _extend_context(self.drafter, self.ctx, out.features[:, : m + 1], x[:, : m + 1])
            self.anchor = next_token
        return record

    def result(self) -> DecodeResult:
        """The DecodeResult so far; timings["total"] is the wall clock since the clock was made."""
        finished = bool(self.tokens) and self.tokens[-1] in self.eos
        return DecodeResult(self.prompt_len, list(self.tokens), list(self.rounds), finished, self.clock.finish())

    def _pending(self) -> Proposal:
        if self.proposal is None:
            raise RuntimeError("no pending draft: call draft() before reading it or calling verify()")
        return self.proposal


@torch.inference_mode()
def target_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
    prefills: PrefillStore | None = None,
) -> DecodeResult:
    """Target-only autoregressive decoding with the same cache and sampling helpers.

    The baseline for wall-clock speedups and the reference distribution that
    speculative_generate must reproduce. Arguments as in speculative_generate
    (checked before the prefill); the result carries the phase timings of the whole call.
    """
    check_generate_args(max_new_tokens, temperature)
    prompt_ids = check_prompt_ids(prompt_ids, getattr(target, "vocab_size", None), many="use target_batch_generate for many prompts")
    clock = PhaseClock(target.device)
    eos = {int(t) for t in eos_token_ids}
    tokens: list[int] = []
    if max_new_tokens > 0:
        cache, out = _prefill(target, prompt_ids, prefills, clock)
        while True:
            with clock("sample"):
                token = sample_token(out.logits[:, -1], temperature, generator)  # [1]
                tokens.append(int(token))
            if tokens[-1] in eos or len(tokens) >= max_new_tokens:
                break
            with clock("decode"):
                out = target(token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    finished = bool(tokens) and tokens[-1] in eos
    return DecodeResult(len(prompt_ids), tokens, [], finished, clock.finish())


def _prefill(target: TargetModel, prompt_ids: Sequence[int], prefills: PrefillStore | None = None,
             clock: Any = None) -> tuple[Any, Any]:
    """A new target KV cache holding the prompt, and the output of that forward (last-position logits,
    features), timed as the clock's "prefill".

    With a ``PrefillStore`` (``dspark.decoding.prefill_store``): a copy of the prompt's kept prefill
    instead of the forward, charged the seconds that forward took; a new prefill is offered to the
    store as a copy. The decode then extends and crops its own cache, never the kept one."""
    clock = clock if clock is not None else _UNTIMED
    kept = None if prefills is None else prefills.get(target, prompt_ids)
    if kept is not None:
        clock.charge("prefill", kept.seconds)
        return copy.deepcopy(kept.cache), kept.out
    start = time.perf_counter()
    with clock("prefill"):
        cache = target.new_cache()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)  # [1, P]
        out = target(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if prefills is not None:
        prefills.put(target, prompt_ids, copy.deepcopy(cache), out, time.perf_counter() - start)
    return cache, out


def _extend_context(drafter: Any, ctx: Any, features: Tensor, tokens: Sequence[int] | Tensor) -> None:
    """Append the features of new context positions; a drafter that pairs each feature row with the
    token after it (Eagle3: `reads_tokens`) also gets the tokens at those positions."""
    if getattr(drafter, "reads_tokens", False):
        ids = torch.as_tensor(tokens, dtype=torch.long, device=features.device).reshape(1, -1)
        drafter.extend_context(ctx, features, input_ids=ids)
    else:
        drafter.extend_context(ctx, features)


def _first_eos(tokens: list[int], eos: set[int]) -> int | None:
    """Index of the first EOS id in ``tokens``, None without one."""
    return next((i for i, token in enumerate(tokens) if token in eos), None)


class PhaseClock:
    """Accumulates wall-clock seconds per phase. On CUDA each phase ends with a synchronize,
    so that the time of asynchronous kernels lands in the phase that launched them."""

    def __init__(self, device: torch.device | str) -> None:
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

    def charge(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` that ran elsewhere (a kept prefill's forward) in ``phase`` and in the total."""
        self.totals[phase] = self.totals.get(phase, 0.0) + float(seconds)
        self.start -= float(seconds)

    def finish(self) -> dict[str, float]:
        """The per-phase totals plus "total", the wall clock since the clock was made (plus what was charged)."""
        return {**self.totals, "total": time.perf_counter() - self.start}


class _Untimed:
    """The clock of a request nobody times: every phase is a no-op, no timings."""

    def __call__(self, phase: str) -> AbstractContextManager[None]:
        return nullcontext()

    def charge(self, phase: str, seconds: float) -> None:
        pass

    def finish(self) -> dict[str, float]:
        return {}


_UNTIMED = _Untimed()
