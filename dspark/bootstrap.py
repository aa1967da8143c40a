"""Seeded bootstrap confidence intervals over requests (percentile method).

The unit of resampling is the request, never the round: rounds of one request
share its prompt and its context, so they are not independent, and a round
bootstrap would give intervals that are too narrow.

Every number the reports compare is a function of sums over requests of
per-request aggregates (τ pooled = Σ τ / Σ rounds, conditional acceptance =
Σ passed / Σ reached, ECE = Σ_b |Σ residual_b| / Σ count, a speedup = a ratio
of four sums). So a resample is a count vector w [n] (how often each request
was drawn, Σ w = n) and the statistic is evaluated on w · aggregates: one
matrix product for all resamples.

- ``resample_counts``          [R, n] draw counts of R seeded resamples of n requests
- ``counts_from_indices``      the same from an explicit [R, k] index matrix
- ``percentile_interval``      (lo, hi) of resampled statistics
- ``bootstrap_ci``             (estimate, lo, hi) of a statistic of request sums
- ``bootstrap_ci_from_indices`` the same on a given resample set (tests, hand checks)
- ``stratified_ci``            requests resampled within each group (benchmark),
                               for macro averages over benchmarks
- ``intervals_overlap``        whether two [lo, hi] intervals share a point

Percentile interval (Efron & Tibshirani 1993, ch. 13): lo and hi are the
(1 − level)/2 and (1 + level)/2 quantiles of the resampled statistic, with
numpy's default linear interpolation; resamples where the statistic is
undefined (NaN, e.g. a ratio whose denominator was not drawn) are left out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95

Statistic = Callable[[np.ndarray], Any]

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "Interval",
    "bootstrap_ci",
    "bootstrap_ci_from_indices",
    "check_settings",
    "counts_from_indices",
    "intervals_overlap",
    "percentile_interval",
    "resample_counts",
    "stratified_ci",
]


class Interval(NamedTuple):
    """A point estimate and its interval; floats, or arrays of one shape for a vector statistic."""

    estimate: Any
    lo: Any
    hi: Any


def check_settings(resamples: int, level: float) -> None:
    """ValueError naming the setting unless resamples is an int >= 1 and 0 < level < 1."""
    if isinstance(resamples, bool) or not isinstance(resamples, (int, np.integer)) or resamples < 1:
        raise ValueError(f"bootstrap resamples must be an int >= 1 (eval.bootstrap_resamples), got {resamples!r}")
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"bootstrap level must be in (0, 1), e.g. 0.95, got {level!r}")


def resample_counts(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Draw counts of ``resamples`` bootstrap resamples of n units, int64 [R, n]:
    row r holds how many times each unit was drawn (n draws with replacement)."""
    check_settings(resamples, DEFAULT_LEVEL)
    if n == 0:
        return np.zeros((resamples, 0), dtype=np.int64)
    indices = rng.integers(0, n, size=(resamples, n))
    return counts_from_indices(indices, n)


def counts_from_indices(indices: Any, n: int) -> np.ndarray:
    """Draw counts int64 [R, n] of an index matrix [R, k] (row r: the units drawn in resample r)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 2:
        raise ValueError(f"resample indices must be a matrix [resamples, draws], got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"resample indices must lie in [0, {n}), got {int(idx.min())}..{int(idx.max())}")
    rows = np.repeat(np.arange(idx.shape[0]), idx.shape[1])
    counts = np.zeros((idx.shape[0], n), dtype=np.int64)
    np.add.at(counts, (rows, idx.ravel()), 1)
    return counts


def percentile_interval(samples: Any, level: float = DEFAULT_LEVEL) -> tuple[Any, Any]:
    """(lo, hi): the (1 − level)/2 and (1 + level)/2 quantiles of ``samples`` [R, ...] over
    axis 0, NaN resamples left out; NaN where no resample is finite."""
    s = np.asarray(samples, dtype=np.float64)
    tail = 50.0 * (1.0 - float(level))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN, as documented
        lo, hi = np.nanpercentile(s, [tail, 100.0 - tail], axis=0)
    return _scalar(lo), _scalar(hi)


def _scalar(x: np.ndarray) -> Any:
    return float(x) if np.ndim(x) == 0 else x


def _evaluate(statistic: Statistic, sums: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN slice is NaN on purpose
        return np.asarray(statistic(sums), dtype=np.float64)


def _aggregates(aggregates: Any) -> np.ndarray:
    a = np.asarray(aggregates, dtype=np.float64)
    if a.ndim < 1:
        raise ValueError("aggregates must have one row per request, shape [n, ...]")
    return a


def _interval_from_counts(aggregates: np.ndarray, statistic: Statistic, counts: np.ndarray, level: float) -> Interval:
    check_settings(int(counts.shape[0]), level)
    if counts.shape[1] != aggregates.shape[0]:
        raise ValueError(f"resample counts cover {counts.shape[1]} requests but there are {aggregates.shape[0]}")
    estimate = _evaluate(statistic, aggregates.sum(axis=0))
    resampled = _evaluate(statistic, np.tensordot(np.asarray(counts, dtype=np.float64), aggregates, axes=1))  # [R, ...]
    lo, hi = percentile_interval(resampled, level)
    return Interval(_scalar(estimate), lo, hi)


def bootstrap_ci(
    aggregates: Any,
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """(estimate, lo, hi) of ``statistic`` over requests.

    aggregates: [n, ...], one row per request (e.g. [Σ τ, rounds] of its rounds);
    statistic: maps sums over requests [..., d...] to the number(s) reported
    (leading axes are resamples), e.g. ``lambda s: s[..., 0] / s[..., 1]``.
    The estimate is the statistic of the plain sums; lo / hi the percentile
    interval of ``resamples`` resamples of the n requests drawn with
    ``np.random.default_rng(seed)``."""
    a = _aggregates(aggregates)
    counts = resample_counts(a.shape[0], resamples, np.random.default_rng(seed))
    return _interval_from_counts(a, statistic, counts, level)


def bootstrap_ci_from_indices(
    aggregates: Any, statistic: Statistic, indices: Any, level: float = DEFAULT_LEVEL
) -> Interval:
    """``bootstrap_ci`` on an explicit resample set: indices [R, k], row r the requests drawn."""
    a = _aggregates(aggregates)
    return _interval_from_counts(a, statistic, counts_from_indices(indices, a.shape[0]), level)


def stratified_ci(
    groups: Sequence[Any],
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
    counts: Sequence[np.ndarray] | None = None,
) -> Interval:
    """(estimate, lo, hi) of a statistic of per-group sums, requests resampled within each group.

    groups: G aggregate arrays [n_g, d...] (one per benchmark, same trailing
    shape); statistic: maps stacked group sums [..., G, d...] to the reported
    number(s), e.g. the mean over benchmarks of each one's τ (a macro
    average). Each group keeps its size in every resample, as the benchmarks
    of an evaluation do. ``counts`` (G draw-count matrices [R, n_g]) replaces
    the seeded draw, so that several statistics share one resample set; the
    default draws group after group from ``np.random.default_rng(seed)``."""
    arrays = [_aggregates(g) for g in groups]
    if not arrays:
        raise ValueError("stratified_ci needs at least one group")
    if len({a.shape[1:] for a in arrays}) != 1:
        raise ValueError(f"groups have different aggregate shapes {[a.shape[1:] for a in arrays]}")
    if counts is None:
        rng = np.random.default_rng(seed)
        counts = [resample_counts(a.shape[0], resamples, rng) for a in arrays]
    if len(counts) != len(arrays) or len({c.shape[0] for c in counts}) != 1:
        raise ValueError("counts must hold one [resamples, n_g] matrix per group, all with the same resamples")
    check_settings(int(counts[0].shape[0]), level)
    for c, a in zip(counts, arrays):
        if c.shape[1] != a.shape[0]:
            raise ValueError(f"resample counts cover {c.shape[1]} requests but a group has {a.shape[0]}")
    estimate = _evaluate(statistic, np.stack([a.sum(axis=0) for a in arrays], axis=0))
    sums = np.stack([np.tensordot(np.asarray(c, dtype=np.float64), a, axes=1) for c, a in zip(counts, arrays)], axis=1)
    lo, hi = percentile_interval(_evaluate(statistic, sums), level)  # sums: [R, G, d...]
    return Interval(_scalar(estimate), lo, hi)


def intervals_overlap(a: Any, b: Any) -> bool | None:
    """Whether the closed intervals a = [lo, hi] and b = [lo, hi] share a point; None
    when either is missing or not finite (e.g. a report written without intervals)."""
    for pair in (a, b):
        if pair is None or len(pair) != 2 or any(v is None or not np.isfinite(float(v)) for v in pair):
            return None
    return float(a[0]) <= float(b[1]) and float(b[0]) <= float(a[1])
