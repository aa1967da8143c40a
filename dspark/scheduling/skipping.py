"""Draft skipping: a policy beyond the paper that decides, per request and step, whether to draft at all.

A request that drafts and verifies ℓ = 0 tokens still paid for its draft; when drafts are poor the
fastest step is a plain target step (``target_step``: one token, no draft). ``DraftSkipper`` makes that
call with ``block_pays``, a cost model on the SPS table Algorithm 1 uses and the measured drafting time:
a block pays iff its expected extra tokens, priced at a plain step's cost per token, exceed the draft
plus the extra verification time. A request that skips backs off (1, 2, 4, ... up to ``max_backoff``
steps) and then drafts once more. Lossless: the decision for step t reads only rounds and draft times
before t. The cost model and the state machine: docs/scheduling.md, "Draft skipping".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from dspark.scheduling.algorithm1 import SPSTable, schedule_prefix

__all__ = ["DraftSkipper", "block_pays", "expected_survival", "target_step"]

DRAFT_TIME_WINDOW = 32  # measured draft times kept for the median t_d


def expected_survival(rows: Sequence[np.ndarray]) -> np.ndarray:
    """ā_j, the mean over ``rows`` (each a_1..a_γ of one round, float [γ]) of the prefix survival."""
    return np.mean(np.stack([np.asarray(r, dtype=np.float64) for r in rows]), axis=0)


def _conditionals(a: np.ndarray) -> np.ndarray:
    """c_j = ā_j / ā_{j−1} (ā_0 = 1; 0 after a zero), so that Π_{i≤j} c_i = ā_j: Algorithm 1's input."""
    prev = np.concatenate([[1.0], a[:-1]])
    c = np.divide(a, prev, out=np.zeros_like(a), where=prev > 0)
    return np.clip(c, 0.0, 1.0)


def block_pays(a: np.ndarray, sps: SPSTable, live: int, draft_s: float) -> tuple[bool, int, float, float]:
    """Whether one request's next block pays for its draft: (pays, ℓ, gain_s, cost_s); the cost model of
    docs/scheduling.md, "Draft skipping".

    a: ā_1..ā_γ, float [γ] (non-increasing, in [0, 1]); sps: the target's SPS table;
    live: R, the requests of the step (>= 1); draft_s: t_d, seconds of one draft."""
    a = np.asarray(a, dtype=np.float64).ravel()
    if live < 1:
        raise ValueError(f"live must be >= 1 (the requests of the step), got {live}")
    if not math.isfinite(draft_s) or draft_s < 0:
        raise ValueError(f"draft_s must be a finite number of seconds >= 0, got {draft_s!r}")
    others = live - 1
    ell = int(schedule_prefix(_conditionals(a)[None], lambda b: sps(np.asarray(b) + others))[0])
    step = 1.0 / _speed(sps, live)
    gain = float(a[:ell].sum()) * step / live
    cost = draft_s + 1.0 / _speed(sps, live + ell) - step
    return gain > cost, ell, gain, cost


def _speed(sps: SPSTable, batch: int) -> float:
    speed = float(sps(batch))
    if not speed > 0:
        raise ValueError(f"the SPS table stops at max_batch_tokens = {sps.max_batch_tokens} < B = {batch}; "
                         "profile larger batches (dspark profile-sps --batch-tokens ...)")
    return speed


class DraftSkipper:
    """Per-request draft/skip decisions (docs/scheduling.md, "Draft skipping"), then Algorithm 1 over the drafted rows.

    sps: the SPS table. draft_time_s: a fixed t_d in seconds, or None to use the
    median of the last ``DRAFT_TIME_WINDOW`` measured drafts (``observe_draft_time``;
    until the first measurement every request drafts). window: rounds in ā.
    max_backoff: the longest run of skipped steps before a re-probe.

    Per step: ``plan(ids)`` -> bool [R] (who drafts), the loop drafts those,
    ``observe_draft_time`` with each measured draft, ``choose(ids, confidences)``
    -> lengths (rows of skipped requests are zeros and get ℓ = 0)."""

    def __init__(self, sps: SPSTable, *, draft_time_s: float | None = None, window: int = 4,
                 max_backoff: int = 16) -> None:
        if draft_time_s is not None and (not math.isfinite(draft_time_s) or draft_time_s < 0):
            raise ValueError(f"draft_time_s must be None (measured) or seconds >= 0, got {draft_time_s!r}")
        if window < 1 or max_backoff < 1:
            raise ValueError(f"window and max_backoff must be >= 1, got {window} and {max_backoff}")
        self.sps, self.fixed_draft_s, self.window, self.max_backoff = sps, draft_time_s, window, max_backoff
        self._times: deque[float] = deque(maxlen=DRAFT_TIME_WINDOW)
        self._history: dict[Hashable, deque[np.ndarray]] = {}
        self._wait: dict[Hashable, int] = {}  # skipped steps left before the re-probe
        self._backoff: dict[Hashable, int] = {}  # the next back-off length
        self._probe: set[Hashable] = set()  # requests whose next non-skipped step drafts unconditionally
        self._planned: dict[Hashable, bool] = {}  # this step's decisions

    @property
    def draft_s(self) -> float | None:
        """t_d used by the cost model: fixed, else the median measured draft time (None before any)."""
        if self.fixed_draft_s is not None:
            return self.fixed_draft_s
        return float(np.median(self._times)) if self._times else None

    def observe_draft_time(self, seconds: float) -> None:
        """One measured draft (seconds); used from the next ``plan`` on."""
        self._times.append(float(seconds))

    def plan(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """bool [R]: which of the live requests draft at this step (from past rounds only)."""
        ids = list(request_ids)
        self._forget(set(ids))
        self._planned = {rid: self._decide(rid, len(ids)) for rid in ids}
        return np.array([self._planned[rid] for rid in ids], dtype=bool)

    def _decide(self, rid: Hashable, live: int) -> bool:
        if self._wait.get(rid, 0) > 0:
            self._wait[rid] -= 1
            return False
        history, draft_s = self._history.get(rid), self.draft_s
        if not history or draft_s is None or rid in self._probe:
            self._probe.discard(rid)
            return True
        if block_pays(expected_survival(history), self.sps, live, draft_s)[0]:
            self._backoff[rid] = 1
            return True
        backoff = self._backoff.get(rid, 1)
        self._wait[rid] = backoff - 1  # this step is the first skipped one
        self._backoff[rid] = min(2 * backoff, self.max_backoff)
        self._probe.add(rid)
        return False

    def choose(self, request_ids: Sequence[Hashable], confidences: Any) -> np.ndarray:
        """Algorithm 1 (early stop) over all rows, lengths int64 [R]; records the drafted rows' a_j."""
        c = np.asarray(confidences, dtype=np.float64)  # [R, γ]; skipped rows are zeros
        lengths = schedule_prefix(c, self.sps, early_stop=True)
        a = np.cumprod(c, axis=1)
        for row, rid in enumerate(request_ids):
            if self._planned.get(rid, True):
                self._history.setdefault(rid, deque(maxlen=self.window)).append(a[row].copy())
        return lengths

    def _forget(self, live: set[Hashable]) -> None:
        """Drop the state of requests that left (ids are never reused by the serving loop)."""
        for table in (self._history, self._wait, self._backoff):
            for rid in [r for r in table if r not in live]:
                del table[rid]
        self._probe &= live


def target_step(request: Any) -> Any:
    """A plain target step of a ``dspark.decoding.loop.SpeculativeRequest``: no draft, verify ℓ = 0.

    One target forward on the anchor, the next token drawn from the target's own
    distribution (rejection sampling with no draft), the drafter context extended
    as after any round. Returns the round's RoundRecord (proposed 0, no confidences)."""
    from dspark.modeling import Proposal

    device = torch.device(getattr(request.target, "device", "cpu"))
    vocab = int(request.target.vocab_size)
    empty = torch.empty(1, 0, vocab, dtype=torch.float32, device=device)  # [1, 0, V]: no draft position
    request.proposal = Proposal(torch.empty(1, 0, dtype=torch.long, device=device), empty, empty, None)
    return request.verify(0)
