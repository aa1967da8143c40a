"""Verification-length policies of the serving loop (``dspark.scheduling.simulator``), made from spec strings.

``make_policy(spec, sps)`` (a spec string, or any callable
``(request_ids, confidences [R, γ]) -> lengths [R]``):

- ``algorithm1``        Algorithm 1 with the early-stopping break
                        (``algorithm1.schedule_prefix``), lossless;
- ``algorithm1+skip[:M]`` beyond the paper, off unless named: Algorithm 1, and
                        before each step a per-request decision whether to draft
                        at all (``dspark.scheduling.skipping``): a request whose recent
                        calibrated confidences say a block will not pay for its
                        measured draft time takes a plain target step instead, and
                        re-probes after a back-off of at most M steps (default 16);
- ``async``             the production variant of Section 5.2
                        (``algorithm1.AsyncPrefixScheduler``): capacity K from
                        the confidences of two steps before by an
                        unconstrained search, top-K admission by the current
                        a_{r,j}; K is known before the draft, so a step with
                        K = 0 drafts nothing (a plain target step for every
                        request); ``async:K0`` sets the capacity used while no
                        request has a two-step-old draft (K0 >= 1; default one
                        token per live request);
- ``static1``           ℓ = 1 for every request (MTP-1-like);
- ``static``            ℓ = γ (verify every draft); ``static:<ℓ>`` any fixed ℓ;
- ``threshold:<a>``     ℓ_r = #{j : a_{r,j} ≥ a}, on the cumulative a (``algorithm1.threshold_lengths``);
- ``first-below:<t>``   DeepSpec's rule: stop before the first c_{r,j} < t
                        (``algorithm1.first_below_lengths``; DeepSpec uses raw c: no STS).

``per_request_policy`` turns a one-request hook ``(confidences, round) -> ℓ`` (the
``choose_length`` of ``dspark.decoding.loop.speculative_generate``) into a policy.

Every one of them decides whether x_{r,k} is verified without looking at
x_{r,k} itself, so decoding stays lossless (paper Section 3.2.2 and Appendix A).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from dspark.scheduling.algorithm1 import (
    AsyncPrefixScheduler,
    SPSTable,
    first_below_lengths,
    schedule_prefix,
    threshold_lengths,
)
from dspark.scheduling.skipping import DraftSkipper

__all__ = ["LengthFn", "Policy", "PolicySpec", "POLICY_HELP", "make_policy", "per_request_policy", "skip_policy"]

# (request ids of the R live requests, confidences [R, γ]) -> lengths int [R] in 0..γ
LengthFn = Callable[[Sequence[Hashable], np.ndarray], Any]
# (request ids of the R live requests) -> bool [R]: which of them draft at this step
PlanFn = Callable[[Sequence[Hashable]], np.ndarray]

POLICY_HELP = ("algorithm1, algorithm1+skip[:M] (also skips drafting when a block will not pay), async[:K0], "
               "static1, static[:ℓ], threshold:<a> (cumulative a_j), first-below:<t> (per c_j)")


@dataclass
class Policy:
    """A verification-length policy: ``policy(request_ids, confidences)`` -> lengths int64 [R].

    name: the spec it was made from (for tables and logs).
    needs_confidences: whether it reads the confidences (the drafter must
        have a confidence head); static policies read only their shape.
    choose: the function; ``confidences`` is float64 [R, γ] (calibrated when
        STS temperatures are given, NaN when the drafter has none, zeros for a
        request that did not draft at this step).
    plan: None (every live request drafts at every step) or, before the step's
        drafts exist, (request_ids) -> bool [R], which requests draft; the others
        take a plain target step (ℓ = 0, no draft time).
    on_draft_time: None, or called with the measured seconds of each draft (after ``plan``).
    on_start: None, or called when a run starts: request ids restart with every run, so a
        policy that keeps per-request history forgets it here.
    """

    name: str
    needs_confidences: bool
    choose: LengthFn
    plan: PlanFn | None = None
    on_draft_time: Callable[[float], None] | None = None
    on_start: Callable[[], None] | None = None

    def __call__(self, request_ids: Sequence[Hashable], confidences: np.ndarray) -> np.ndarray:
        return self.choose(request_ids, confidences)


# What ``make_policy`` takes: a spec string, a Policy, or a bare LengthFn
PolicySpec = Union[str, Policy, LengthFn]


def per_request_policy(choose_length: Callable[[list[float] | None, int], int], name: str | None = None) -> Policy:
    """A Policy that asks ``choose_length(confidences c_1..c_γ or None, round index) -> ℓ`` for
    each live request on its own, as ``speculative_generate(choose_length=...)`` does.

    The confidences are those the serving loop hands to every policy (STS-calibrated when
    temperatures are given; None when the drafter has no confidence head). The round index
    counts the rounds the policy scheduled for that request in the current run (its rounds,
    as every request drafts at every step under this policy)."""
    rounds: dict[Hashable, int] = {}

    def choose(request_ids: Sequence[Hashable], confidences: np.ndarray) -> np.ndarray:
        lengths = []
        for request_id, row in zip(request_ids, confidences):
            c = None if np.isnan(row).any() else row.tolist()
            lengths.append(choose_length(c, rounds.get(request_id, 0)))
            rounds[request_id] = rounds.get(request_id, 0) + 1
        return np.asarray(lengths)  # the serving loop checks them (integers in 0..γ)

    return Policy(name or getattr(choose_length, "__name__", type(choose_length).__name__), False, choose,
                  on_start=rounds.clear)


def skip_policy(sps: SPSTable, *, draft_time_s: float | None = None, max_backoff: int = 16,
                window: int = 4, name: str = "algorithm1+skip") -> Policy:
    """``algorithm1+skip``: a ``DraftSkipper`` decides who drafts, Algorithm 1 picks ℓ.

    draft_time_s: a fixed drafting time (seconds) for the cost model; None = measured."""
    skipper = DraftSkipper(sps, draft_time_s=draft_time_s, window=window, max_backoff=max_backoff)
    return Policy(name, True, skipper.choose, plan=skipper.plan, on_draft_time=skipper.observe_draft_time)


def make_policy(spec: PolicySpec, sps: SPSTable | None = None) -> Policy:
    """A fresh Policy from a spec string (see the module docstring) or a callable.

    Stateful policies (``async``, ``algorithm1+skip``) keep per-request history, so make
    one per run. ``sps`` is required by ``algorithm1``, ``algorithm1+skip`` and ``async``."""
    if isinstance(spec, Policy):
        return spec
    if callable(spec):
        return Policy(getattr(spec, "__name__", type(spec).__name__), True, spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy must be a non-empty string ({POLICY_HELP}) or a callable, got {spec!r}")
    name = spec.strip()
    kind, _, arg = name.partition(":")
    kind = kind.lower()

    def needs_sps() -> SPSTable:
        if sps is None:
            raise ValueError(f"policy {name!r} needs an SPS table (--sps FILE from `dspark profile-sps`)")
        return sps

    if kind == "algorithm1" and not arg:
        table = needs_sps()
        return Policy(name, True, lambda ids, c: schedule_prefix(c, table, early_stop=True))
    if kind == "algorithm1+skip":
        backoff = _parse_number(arg, name, int) if arg else 16
        if backoff < 1:
            raise ValueError(f"policy {name!r}: the longest back-off M must be >= 1 step")
        return skip_policy(needs_sps(), max_backoff=backoff, name=name)
    if kind == "async":
        default = _parse_number(arg, name, int) if arg else None
        if default is not None and default < 1:
            raise ValueError(f"policy {name!r}: the default capacity K0 must be >= 1 (with K0 = 0 a step without "
                             "drafts leaves no confidences to size the next ones, and no request drafts again)")
        scheduler = AsyncPrefixScheduler(needs_sps(), default_capacity=default)

        def plan(ids: Sequence[Hashable]) -> np.ndarray:  # K is known before the draft: K = 0 draws none
            return np.full(len(ids), scheduler.plan(ids), dtype=bool)

        return Policy(name, True, lambda ids, c: scheduler.step(ids, c), plan=plan, on_start=scheduler.reset)
    if kind == "static1" and not arg:
        return Policy(name, False, lambda ids, c: np.full(c.shape[0], min(1, c.shape[1]), dtype=np.int64))
    if kind == "static":
        return _static(name, arg)
    if kind in ("threshold", "first-below") and arg:
        threshold = _parse_number(arg, name, float)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"policy {name!r}: the threshold must be in [0, 1]")
        cut = threshold_lengths if kind == "threshold" else first_below_lengths
        return Policy(name, True, lambda ids, c: cut(c, threshold))
    raise ValueError(f"unknown policy {spec!r}; choose from {POLICY_HELP}")


def _static(name: str, arg: str) -> Policy:
    """``static`` (ℓ = γ) or ``static:<ℓ>``."""
    if not arg:
        return Policy(name, False, lambda ids, c: np.full(c.shape[0], c.shape[1], dtype=np.int64))
    ell = _parse_number(arg, name, int)
    if ell < 0:
        raise ValueError(f"policy {name!r}: ℓ must be >= 0")

    def static(ids: Sequence[Hashable], c: np.ndarray) -> np.ndarray:
        if ell > c.shape[1]:
            raise ValueError(f"policy {name!r} asks for ℓ = {ell} but the drafter's block size γ is {c.shape[1]}")
        return np.full(c.shape[0], ell, dtype=np.int64)

    return Policy(name, False, static)


def _parse_number(text: str, name: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"policy {name!r}: cannot read {text!r} as {kind.__name__}") from None
