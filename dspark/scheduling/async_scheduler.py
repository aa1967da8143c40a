"""The production variant of Algorithm 1 (paper Section 5.2): a capacity from stale confidences, top-K admission.

``capacity_from_stale`` gives K = Σℓ of the unconstrained search (``schedule_prefix(early_stop=False)``)
over confidences two steps old; ``admit_top_k`` admits the K best candidates by the current a_{r,j}
(Algorithm 1's order and tie rule, ``algorithm1.admission_order``); ``AsyncPrefixScheduler`` keeps the
per-request history that joins them, step by step. Shapes and conventions as in ``dspark.scheduling.algorithm1``.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from dspark.scheduling.algorithm1 import (
    SPSLike,
    _as_confidences,
    _int_value,
    _lengths_from_admitted,
    admission_order,
    prefix_survival,
    schedule_prefix,
)

__all__ = ["AsyncPrefixScheduler", "admit_top_k", "capacity_from_stale"]


def capacity_from_stale(stale_confidences: Any, sps: SPSLike) -> int:
    """Verification capacity K = Σℓ of the unconstrained global search
    (``schedule_prefix(..., early_stop=False)``) over confidences from two
    steps earlier, shape [R, γ] with one row per request of the current batch
    (rows of zeros for requests without a stale draft)."""
    return int(schedule_prefix(stale_confidences, sps, early_stop=False).sum())


def admit_top_k(confidences: Any, k: int) -> np.ndarray:
    """Lengths int64 [R] admitting the top-``k`` candidates by current a_{r,j}
    (a > 0 only, same tie rule as Algorithm 1; prefix-closed). Fewer than
    ``k`` tokens are admitted when fewer candidates have a > 0.

    For a fixed budget of k tokens this maximizes the expected number of
    accepted tokens Σ_r Σ_{j≤ℓ_r} a_{r,j} over all prefix-closed lengths.
    """
    k = _int_value(k, "k")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    a = prefix_survival(confidences)
    R, gamma = a.shape
    order = admission_order(a)
    return _lengths_from_admitted(order[:k], R, gamma)


class AsyncPrefixScheduler:
    """Asynchronous prefix scheduler (paper Section 5.2).

    At step t the capacity K_t comes from ``capacity_from_stale`` over the
    confidences recorded at step t−2 for the requests of the current batch
    (requests absent at t−2 contribute a row of zeros: they add their one
    base token to B and no candidates). The current step then admits the
    top-K_t candidates by the current a_{r,j} (``admit_top_k``).

    Why it is lossless: K_t is a function of step-(t−2) drafts, the batch's
    request ids and the SPS table, all fixed before the current draft tokens
    are sampled. Given K_t, the token x_{r,k} is verified iff (r, k) ranks
    among the top K_t; its rank depends on a_{r,1..k} (tokens before x_{r,k})
    and on other requests' candidates, never on a_{r,k+1}, which always ranks
    below (r, k). So the decision to verify x_{r,k} never sees x_{r,k}, which
    is all standard speculative sampling needs to reproduce the target's
    distribution. The unconstrained search (no early stop) is therefore safe
    here, and steps over the cliffs of step-shaped SPS curves.

    Fallback: when no request of the batch has a draft from two steps earlier
    (the first two steps, a batch of new requests, or two steps after a step
    without drafts), K = ``default_capacity``, which depends on no draft:
    an int, or None (the default) for one token per live request (K = R, what
    a static MTP-1 schedule verifies).

    Skipping the draft: K is known before the step's draft exists, so a step
    with K = 0 verifies nothing and need not draft at all. ``plan(request_ids)``
    says whether the step drafts (K > 0) and records a K = 0 step as one
    without drafts, whose requests then have no confidences two steps later
    (the fallback K probes again there, so a positive ``default_capacity``
    keeps the scheduler from never drafting again).

    Usage per decoding step: ``if sched.plan(ids): lengths = sched.step(ids, confidences)``
    (``step`` alone drafts at every step). ``capacity(request_ids)`` gives K for the
    upcoming step before its draft exists (what zero-overhead scheduling needs).
    """

    def __init__(self, sps: SPSLike, default_capacity: int | None = None) -> None:
        if default_capacity is not None:
            default_capacity = _int_value(default_capacity, "default_capacity")
            if default_capacity < 0:
                raise ValueError(f"default_capacity must be >= 0, got {default_capacity}")
        self.sps = sps
        self.default_capacity = default_capacity
        # confidences by request id at step t-1 and t-2 (index 0 = most recent)
        self._history: list[dict[Hashable, np.ndarray]] = [{}, {}]

    def capacity(self, request_ids: Sequence[Hashable]) -> int:
        """K for the next ``step`` call with this batch; uses only confidences
        recorded two ``step`` calls ago."""
        stale = self._history[1]
        rows = [stale.get(rid) for rid in request_ids]
        known = [row for row in rows if row is not None]
        if not known:
            return len(rows) if self.default_capacity is None else self.default_capacity
        gamma = known[0].shape[0]
        zeros = np.zeros(gamma, dtype=np.float64)
        stacked = np.stack([zeros if row is None else row for row in rows])  # [R, γ]
        return capacity_from_stale(stacked, self.sps)

    def step(self, request_ids: Sequence[Hashable], confidences: Any) -> np.ndarray:
        """Lengths int64 [R] for the current step and record its confidences.

        ``request_ids`` names the R rows of ``confidences`` [R, γ]."""
        c = _as_confidences(confidences)
        ids = list(request_ids)
        if len(ids) != c.shape[0]:
            raise ValueError(
                f"request_ids has {len(ids)} entries but confidences has {c.shape[0]} rows"
            )
        if len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique within a step")
        k = self.capacity(ids)  # decided before looking at the current draft
        lengths = admit_top_k(c, k)
        self._history = [{rid: c[i].copy() for i, rid in enumerate(ids)}, self._history[0]]
        return lengths

    def plan(self, request_ids: Sequence[Hashable]) -> bool:
        """Whether the upcoming step drafts: K > 0. A K = 0 step is recorded here as a step
        without drafts (call ``step`` only when this returns True)."""
        if self.capacity(list(request_ids)) > 0:
            return True
        self._history = [{}, self._history[0]]
        return False

    def reset(self) -> None:
        self._history = [{}, {}]

