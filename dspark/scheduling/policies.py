"""Verification-length policies of the serving loop (``dspark.scheduling.simulator``), made from spec strings.

``make_policy(spec, sps)`` reads a spec "name[:arg]": a name of ``dspark.registry.POLICIES`` (the
built-ins are the factories below, listed with their arguments by ``POLICY_HELP``; docs/evaluation.md,
"Verification policies"), or ``module:function``, a user's function ``(request_ids, confidences [R, γ])
-> lengths [R]`` or ``Policy`` loaded by ``dspark.registry.load_object``. A callable or a ``Policy``
is taken as it is. ``per_request_policy`` turns a one-request hook ``(confidences, round) -> ℓ`` (the
``choose_length`` of ``dspark.decoding.loop.speculative_generate``) into a policy.

Every built-in decides whether x_{r,k} is verified without looking at x_{r,k} itself, so decoding
stays lossless (paper Section 3.2.2 and Appendix A); a user's policy must keep to the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from dspark.registry import POLICIES, load_object, policy_help
from dspark.scheduling.algorithm1 import SPSTable, first_below_lengths, schedule_prefix, threshold_lengths
from dspark.scheduling.async_scheduler import AsyncPrefixScheduler
from dspark.scheduling.skipping import DraftSkipper

__all__ = [
    "LengthFn", "Policy", "PolicySpec", "POLICY_HELP", "algorithm1_policy", "algorithm1_skip_policy", "async_policy",
    "first_below_policy", "make_policy", "per_request_policy", "policy_name", "skip_policy", "static1_policy",
    "static_policy", "threshold_policy",
]

# (request ids of the R live requests, confidences [R, γ]) -> lengths int [R] in 0..γ
LengthFn = Callable[[Sequence[Hashable], np.ndarray], Any]
# (request ids of the R live requests) -> bool [R]: which of them draft at this step
PlanFn = Callable[[Sequence[Hashable]], np.ndarray]

# The registered policies with their arguments (``dspark.registry.policy_help``), for messages and the CLI.
POLICY_HELP = policy_help()


@dataclass
class Policy:
    """A verification-length policy: ``policy(request_ids, confidences)`` -> lengths int64 [R].

    name: the spec it was made from (for tables and logs); a callable's ``__name__``.
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

    A named policy is made by its factory in ``dspark.registry.POLICIES``:
    ``factory(arg, sps, spec) -> Policy``, where the spec "name:arg" passes arg ("" without ':'),
    ``sps`` is the run's ``SPSTable`` or None (a factory that needs one raises ValueError), and
    ``spec`` is the whole spec, stripped, which the Policy takes as its name. Register one with
    ``POLICIES.register("mine", factory, help="...")``; ``--policy mine:3`` then calls
    ``factory("3", sps, "mine:3")``, once per run.
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


def policy_name(policy: PolicySpec) -> str:
    """The name a policy goes by in tables and logs: a spec (stripped), a Policy's ``name``, a
    callable's ``__name__`` (a ``functools.partial``'s function's; a callable object's class)."""
    if isinstance(policy, str):
        return policy.strip()
    if isinstance(policy, Policy):
        return policy.name
    name = getattr(policy, "__name__", None) or getattr(getattr(policy, "func", None), "__name__", None)
    return name if isinstance(name, str) else type(policy).__name__


def make_policy(spec: PolicySpec, sps: SPSTable | None = None) -> Policy:
    """A fresh Policy from a spec string "name[:arg]" or "module:function" (module docstring), a
    callable or a Policy (returned as it is).

    Stateful policies (``async``, ``algorithm1+skip``) keep per-request history, so make
    one per run. ``sps`` is required by ``algorithm1``, ``algorithm1+skip`` and ``async``."""
    if isinstance(spec, Policy):
        return spec
    if callable(spec):
        return Policy(policy_name(spec), True, spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy must be a non-empty string ({POLICY_HELP}) or a callable, got {spec!r}")
    name = spec.strip()
    kind, sep, arg = name.partition(":")
    kind = kind.strip()
    key = kind if kind in POLICIES else kind.lower()
    if key in POLICIES:
        policy = POLICIES.get(key)(arg.strip(), sps, name)
        if not isinstance(policy, Policy):
            raise ValueError(f"the factory of policy {key!r} returned {type(policy).__name__}; a factory "
                             "(arg, sps, spec) returns a dspark.scheduling.policies.Policy")
        return policy
    if not sep:
        raise ValueError(f"unknown policy {spec!r}; choose from {list(POLICIES.names())}, register one "
                         "(dspark.registry.POLICIES) or give module:function")
    try:
        loaded = load_object(name, "policy")
    except ValueError as exc:
        raise ValueError(f"unknown policy {spec!r}: {kind!r} is not a registered policy "
                         f"({list(POLICIES.names())}), and as module:function: {exc}") from None
    if not callable(loaded):
        raise ValueError(f"policy {spec!r} names a value of type {type(loaded).__name__}; module:function must "
                         "name a function (request_ids, confidences [R, γ]) -> lengths [R] or a Policy")
    return make_policy(loaded)


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

    return Policy(name or policy_name(choose_length), False, choose, on_start=rounds.clear)


def skip_policy(sps: SPSTable, *, draft_time_s: float | None = None, max_backoff: int = 16,
                window: int = 4, name: str = "algorithm1+skip") -> Policy:
    """``algorithm1+skip``: a ``DraftSkipper`` decides who drafts, Algorithm 1 picks ℓ.

    draft_time_s: a fixed drafting time (seconds) for the cost model; None = measured."""
    skipper = DraftSkipper(sps, draft_time_s=draft_time_s, window=window, max_backoff=max_backoff)
    return Policy(name, True, skipper.choose, plan=skipper.plan, on_draft_time=skipper.observe_draft_time)


# --------------------------------------------------------------------------- the built-in factories
# Each is registered in dspark.registry.POLICIES: (arg, sps, spec) -> Policy (``Policy``'s docstring).


def algorithm1_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``algorithm1``: Algorithm 1 with the early-stopping break (``algorithm1.schedule_prefix``), lossless."""
    _no_argument(arg, spec)
    table = _needs_sps(sps, spec)
    return Policy(spec, True, lambda ids, c: schedule_prefix(c, table, early_stop=True))


def algorithm1_skip_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``algorithm1+skip[:M]``, beyond the paper: Algorithm 1, and before each step a per-request
    decision whether to draft at all (``dspark.scheduling.skipping``): a request whose recent
    calibrated confidences say a block will not pay for its measured draft time takes a plain
    target step instead, and re-probes after a back-off of at most M steps (default 16)."""
    backoff = _parse_number(arg, spec, int) if arg else 16
    if backoff < 1:
        raise ValueError(f"policy {spec!r}: the longest back-off M must be >= 1 step")
    return skip_policy(_needs_sps(sps, spec), max_backoff=backoff, name=spec)


def async_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``async[:K0]``, the production variant of Section 5.2 (``async_scheduler.AsyncPrefixScheduler``):
    capacity K from the confidences of two steps before by an unconstrained search, top-K admission by
    the current a_{r,j}. K is known before the draft, so a step with K = 0 drafts nothing (a plain
    target step for every request). K0 is the capacity while no request has a two-step-old draft
    (K0 >= 1; default one token per live request)."""
    default = _parse_number(arg, spec, int) if arg else None
    if default is not None and default < 1:
        raise ValueError(f"policy {spec!r}: the default capacity K0 must be >= 1 (with K0 = 0 a step without "
                         "drafts leaves no confidences to size the next ones, and no request drafts again)")
    scheduler = AsyncPrefixScheduler(_needs_sps(sps, spec), default_capacity=default)

    def plan(ids: Sequence[Hashable]) -> np.ndarray:  # K is known before the draft: K = 0 draws none
        return np.full(len(ids), scheduler.plan(ids), dtype=bool)

    return Policy(spec, True, lambda ids, c: scheduler.step(ids, c), plan=plan, on_start=scheduler.reset)


def static1_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``static1``: ℓ = 1 for every request (MTP-1-like)."""
    _no_argument(arg, spec)
    return Policy(spec, False, lambda ids, c: np.full(c.shape[0], min(1, c.shape[1]), dtype=np.int64))


def static_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``static`` (ℓ = γ: verify every draft) or ``static:<ℓ>`` (any fixed ℓ)."""
    if not arg:
        return Policy(spec, False, lambda ids, c: np.full(c.shape[0], c.shape[1], dtype=np.int64))
    ell = _parse_number(arg, spec, int)
    if ell < 0:
        raise ValueError(f"policy {spec!r}: ℓ must be >= 0")

    def static(ids: Sequence[Hashable], c: np.ndarray) -> np.ndarray:
        if ell > c.shape[1]:
            raise ValueError(f"policy {spec!r} asks for ℓ = {ell} but the drafter's block size γ is {c.shape[1]}")
        return np.full(c.shape[0], ell, dtype=np.int64)

    return Policy(spec, False, static)


def threshold_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``threshold:<a>``: ℓ_r = #{j : a_{r,j} ≥ a}, on the cumulative a (``algorithm1.threshold_lengths``)."""
    threshold = _threshold(arg, spec)
    return Policy(spec, True, lambda ids, c: threshold_lengths(c, threshold))


def first_below_policy(arg: str, sps: SPSTable | None, spec: str) -> Policy:
    """``first-below:<t>``: DeepSpec's rule, stop before the first c_{r,j} < t
    (``algorithm1.first_below_lengths``; DeepSpec uses raw c: no STS)."""
    threshold = _threshold(arg, spec)
    return Policy(spec, True, lambda ids, c: first_below_lengths(c, threshold))


def _needs_sps(sps: SPSTable | None, spec: str) -> SPSTable:
    if sps is None:
        raise ValueError(f"policy {spec!r} needs an SPS table (--sps FILE from `dspark profile-sps`)")
    return sps


def _no_argument(arg: str, spec: str) -> None:
    if arg:
        raise ValueError(f"policy {spec!r}: {spec.partition(':')[0]!r} takes no argument")


def _threshold(arg: str, spec: str) -> float:
    if not arg:
        raise ValueError(f"policy {spec!r} needs a threshold in [0, 1]: {spec}:<value>")
    threshold = _parse_number(arg, spec, float)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"policy {spec!r}: the threshold must be in [0, 1]")
    return threshold


def _parse_number(text: str, name: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"policy {name!r}: cannot read {text!r} as {kind.__name__}") from None
