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

Small strata. An evaluation draws few requests per benchmark (2 to 8), and a
resample of n of n requests keeps only (n − 1)/n of a group sum's variance,
while the variance itself is estimated from only Σ (n_g − 1) degrees of
freedom; the plain percentile interval then covers far less than its level
(about 0.8 at 9 benchmarks × 2 requests). So every resampled group sum S*_g is
rescaled about the observed sum S_g (a rescaled bootstrap, Rao & Wu 1988),
which restores the variance,

    S*_g ← S_g + sqrt(n_g / (n_g − 1)) · (S*_g − S_g),

and the percentile interval is widened about the estimate θ̂ as a Student t
interval is wider than a normal one,

    lo ← θ̂ − w · (θ̂ − lo),  hi ← θ̂ + w · (hi − θ̂),  w = t_ν / z,

with t_ν and z the (1 + level)/2 quantiles of Student's t and of the normal.
The degrees of freedom are Satterthwaite's for the sum of the groups' variance
estimates (each group's share v_g measured by resampling it alone): at most
Σ_g (n_g − 1), fewer when a few benchmarks carry most of the variance. Chosen by measured coverage (tests/test_bootstrap.py simulates
ratio-of-sums statistics with known truth at 9 × 2, 9 × 4 and 9 × 8 requests:
plain resampling undercovers, the rescaled one does not). A group of one
request has no within-group variance to resample; with no group of two or
more (ν = 0) the interval is NaN: no interval rests on fewer than two
requests of a group. ``small_sample=False`` (or ``SMALL_SAMPLE = False`` for
every call that does not say) gives the plain bootstrap.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
# Whether intervals get the small-stratum correction (module docstring) when a call does not say.
SMALL_SAMPLE = True

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
    "satterthwaite_df",
    "small_sample_factors",
    "stratified_ci",
    "student_t_quantile",
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


def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` > 0 degrees of freedom (0.5 <= p < 1; df may be
    fractional, as a Satterthwaite df is).

    Closed forms for df = 1 and 2; otherwise Newton steps on the t CDF (its density integrated
    by Simpson's rule) from the Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5)."""
    if not 0.5 <= p < 1.0 or not df > 0:
        raise ValueError(f"student_t_quantile needs 0.5 <= p < 1 and df > 0, got p={p!r}, df={df!r}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    v = max(float(df), 1.0)
    x = z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(u: np.ndarray) -> np.ndarray:
        return np.exp(log_norm - (df + 1) / 2 * np.log1p(u * u / df))

    for _ in range(20):
        grid = np.linspace(0.0, x, 2001)  # Simpson's rule over [0, x], 2000 panels
        f = density(grid)
        area = (grid[1] - grid[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
        step = (0.5 + area - p) / float(density(np.array(x)))
        x -= step
        if abs(step) < 1e-10:
            break
    return float(x)


def small_sample_factors(sizes: Sequence[int]) -> np.ndarray:
    """f_g = sqrt(n_g / (n_g − 1)) for groups of ``sizes`` n_g, [G] float64 (module docstring);
    0 for a group of one request, whose resamples never vary."""
    n = np.asarray(sizes, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n >= 2, np.sqrt(n / (n - 1)), 0.0)


def satterthwaite_df(variances: Any, sizes: Sequence[int]) -> np.ndarray:
    """ν = (Σ_g v_g)² / Σ_g v_g² / (n_g − 1): the degrees of freedom of a sum of G independent
    variance estimates v_g [G, ...] from groups of n_g requests (Satterthwaite 1946). Groups of
    one request carry no estimate; where every v_g is 0 the plain Σ (n_g − 1) is returned, and
    NaN where no group has two requests."""
    v = np.asarray(variances, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64).reshape((-1,) + (1,) * (v.ndim - 1))
    usable = n >= 2
    plain = float(np.sum(np.maximum(n - 1, 0)))
    if plain == 0:
        return np.full(v.shape[1:], np.nan)
    v = np.where(usable, np.nan_to_num(v), 0.0)
    total = v.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = np.where(usable, v * v / np.maximum(n - 1, 1), 0.0).sum(axis=0)
        nu = np.where(spread > 0, total * total / spread, plain)
    return nu


def _width(df: Any, level: float) -> Any:
    """w = t_ν / z at the (1 + level)/2 quantile, elementwise over ν (NaN stays NaN)."""
    p = (1.0 + float(level)) / 2
    z = NormalDist().inv_cdf(p)
    nu = np.asarray(df, dtype=np.float64)
    cache: dict[float, float] = {}
    flat = [math.nan if not np.isfinite(x) else cache.setdefault(round(float(x), 6), student_t_quantile(p, float(x)) / z)
            for x in nu.ravel()]
    return np.asarray(flat, dtype=np.float64).reshape(nu.shape)


def _rescaled(resampled: np.ndarray, observed: np.ndarray, factor: float) -> np.ndarray:
    """S_g + f_g (S*_g − S_g) for resampled sums [R, d...] of a group with observed sums [d...]."""
    return observed + factor * (resampled - observed)


def _widened(estimate: Any, lo: Any, hi: Any, width: Any) -> tuple[Any, Any]:
    """The interval [lo, hi] stretched about ``estimate`` by ``width`` (NaN for a NaN width)."""
    est = np.asarray(estimate, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return _scalar(est - width * (est - lo)), _scalar(est + width * (np.asarray(hi) - est))


def _group_variances(statistic: Statistic, observed: list[np.ndarray], resampled: list[np.ndarray]) -> np.ndarray:
    """v_g [G, ...]: the variance over resamples of the statistic when only group g is resampled
    (the others at their observed sums), each group's share of the interval's width."""
    base = np.stack(observed, axis=0)  # [G, d...]
    out = []
    for g, r in enumerate(resampled):
        sums = np.broadcast_to(base, (r.shape[0],) + base.shape).copy()  # [R, G, d...]
        sums[:, g] = r
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out.append(np.nanvar(_evaluate(statistic, sums), axis=0))
    return np.stack(out, axis=0)


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


def _interval_from_counts(aggregates: np.ndarray, statistic: Statistic, counts: np.ndarray, level: float,
                          small_sample: bool | None = None) -> Interval:
    check_settings(int(counts.shape[0]), level)
    if counts.shape[1] != aggregates.shape[0]:
        raise ValueError(f"resample counts cover {counts.shape[1]} requests but there are {aggregates.shape[0]}")
    observed = aggregates.sum(axis=0)
    estimate = _evaluate(statistic, observed)
    sums = np.tensordot(np.asarray(counts, dtype=np.float64), aggregates, axes=1)  # [R, d...]
    small_sample = SMALL_SAMPLE if small_sample is None else small_sample
    width: Any = 1.0
    if small_sample:
        sums = _rescaled(sums, observed, float(small_sample_factors([aggregates.shape[0]])[0]))
        width = _width(aggregates.shape[0] - 1 if aggregates.shape[0] >= 2 else math.nan, level)
    resampled = _evaluate(statistic, sums)  # [R, ...]
    lo, hi = _widened(estimate, *percentile_interval(resampled, level), width)
    return Interval(_scalar(estimate), lo, hi)


def bootstrap_ci(
    aggregates: Any,
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
    small_sample: bool | None = None,
) -> Interval:
    """(estimate, lo, hi) of ``statistic`` over requests.

    aggregates: [n, ...], one row per request (e.g. [Σ τ, rounds] of its rounds);
    statistic: maps sums over requests [..., d...] to the number(s) reported
    (leading axes are resamples), e.g. ``lambda s: s[..., 0] / s[..., 1]``.
    The estimate is the statistic of the plain sums; lo / hi the percentile
    interval of ``resamples`` resamples of the n requests drawn with
    ``np.random.default_rng(seed)``, rescaled for a small n (module docstring)
    unless ``small_sample`` is False; NaN bounds for fewer than two requests."""
    a = _aggregates(aggregates)
    counts = resample_counts(a.shape[0], resamples, np.random.default_rng(seed))
    return _interval_from_counts(a, statistic, counts, level, small_sample)


def bootstrap_ci_from_indices(
    aggregates: Any, statistic: Statistic, indices: Any, level: float = DEFAULT_LEVEL, small_sample: bool | None = None
) -> Interval:
    """``bootstrap_ci`` on an explicit resample set: indices [R, k], row r the requests drawn."""
    a = _aggregates(aggregates)
    return _interval_from_counts(a, statistic, counts_from_indices(indices, a.shape[0]), level, small_sample)


def stratified_ci(
    groups: Sequence[Any],
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
    counts: Sequence[np.ndarray] | None = None,
    small_sample: bool | None = None,
) -> Interval:
    """(estimate, lo, hi) of a statistic of per-group sums, requests resampled within each group.

    groups: G aggregate arrays [n_g, d...] (one per benchmark, same trailing
    shape); statistic: maps stacked group sums [..., G, d...] to the reported
    number(s), e.g. the mean over benchmarks of each one's τ (a macro
    average). Each group keeps its size in every resample, as the benchmarks
    of an evaluation do. ``counts`` (G draw-count matrices [R, n_g]) replaces
    the seeded draw, so that several statistics share one resample set; the
    default draws group after group from ``np.random.default_rng(seed)``. Each
    group's resampled sums are rescaled for its size (module docstring) unless
    ``small_sample`` is False; NaN bounds when no group has two requests."""
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
    observed = [a.sum(axis=0) for a in arrays]
    estimate = _evaluate(statistic, np.stack(observed, axis=0))
    resampled = [np.tensordot(np.asarray(c, dtype=np.float64), a, axes=1) for c, a in zip(counts, arrays)]
    small_sample = SMALL_SAMPLE if small_sample is None else small_sample
    width: Any = 1.0
    if small_sample:
        sizes = [a.shape[0] for a in arrays]
        resampled = [_rescaled(r, s, f) for r, s, f in zip(resampled, observed, small_sample_factors(sizes))]
        width = _width(satterthwaite_df(_group_variances(statistic, observed, resampled), sizes), level)
    sums = np.stack(resampled, axis=1)  # [R, G, d...]
    lo, hi = _widened(estimate, *percentile_interval(_evaluate(statistic, sums), level), width)
    return Interval(_scalar(estimate), lo, hi)


def intervals_overlap(a: Any, b: Any) -> bool | None:
    """Whether the closed intervals a = [lo, hi] and b = [lo, hi] share a point; None
    when either is missing or not finite (e.g. a report written without intervals)."""
    for pair in (a, b):
        if pair is None or len(pair) != 2 or any(v is None or not np.isfinite(float(v)) for v in pair):
            return None
    return float(a[0]) <= float(b[1]) and float(b[0]) <= float(a[1])
