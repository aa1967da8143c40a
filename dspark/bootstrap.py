"""Intervals over requests: the stratified jackknife, the percentile bootstrap, and Wilson for proportions.

The unit of sampling is the request, never the round (rounds of one request share its prompt and
context); the requests of an evaluation are drawn per benchmark (G strata of n_g requests), so every
interval is stratified. A statistic maps group sums [..., G, d...] to the reported number.

- ``jackknife_ci``     smooth statistics (τ, speedups, paired ratios, macro averages)
- ``proportion_ci``    a pooled proportion Σ passed / Σ reached: Wilson on effective counts
- ``stratified_ci``    the stratified percentile bootstrap (ECE); ``bootstrap_ci`` for one group
- ``resample_counts``, ``counts_from_indices``, ``percentile_interval``: the bootstrap's parts
- ``design_df``, ``student_t_quantile``: Student's t at ν = Σ_g (n_g − 1), used by every interval

Each works on a scale (``SCALES``) from which no bound leaves the statistic's range. The
derivations, the small-sample correction and the coverage they were chosen by: docs/intervals.md.
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
# Whether intervals get the small-stratum correction (docs/intervals.md) when a call does not say.
SMALL_SAMPLE = True
# The scales an interval works on (docs/intervals.md): name -> (h, h⁻¹).
SCALES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "identity": (lambda x: x, lambda y: y),
    "log": (np.log, np.exp),
    "logit": (lambda x: np.log(x) - np.log1p(-x), lambda y: 1.0 / (1.0 + np.exp(-y))),
}
# Proportions (proportion_ci): no interval below these counts; the design effect's floor.
MIN_ROUNDS = 10
MIN_REQUESTS = 5
DEFF_FLOOR = 0.5

Statistic = Callable[[np.ndarray], Any]

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "DEFF_FLOOR",
    "Interval",
    "MIN_REQUESTS",
    "MIN_ROUNDS",
    "SCALES",
    "bootstrap_ci",
    "bootstrap_ci_from_indices",
    "check_settings",
    "counts_from_indices",
    "design_df",
    "intervals_overlap",
    "jackknife_ci",
    "percentile_interval",
    "proportion_ci",
    "resample_counts",
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
    """f_g = sqrt(n_g / (n_g − 1)) for groups of ``sizes`` n_g, [G] float64 (docs/intervals.md);
    0 for a group of one request, whose resamples never vary."""
    n = np.asarray(sizes, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n >= 2, np.sqrt(n / (n - 1)), 0.0)


def design_df(sizes: Sequence[int]) -> float:
    """ν = Σ_g (n_g − 1) over the groups of two or more requests: the degrees of freedom of a
    variance estimated within G strata of n_g requests; NaN when no group has two."""
    nu = float(sum(max(int(n) - 1, 0) for n in sizes))
    return nu if nu > 0 else math.nan


def _t_over_z(df: float, level: float) -> float:
    """t_ν / z at the (1 + level)/2 quantile (NaN for a NaN ν)."""
    if not np.isfinite(df):
        return math.nan
    p = (1.0 + float(level)) / 2
    return student_t_quantile(p, float(df)) / NormalDist().inv_cdf(p)


def _scale(name: str) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    if name not in SCALES:
        raise ValueError(f"scale must be one of {sorted(SCALES)}, got {name!r}")
    return SCALES[name]


def _on_scale(h: Callable[[np.ndarray], np.ndarray], x: Any) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return h(np.asarray(x, dtype=np.float64))


def _corrected(estimate: Any, lo: Any, hi: Any, width: Any, scale: str) -> tuple[Any, Any]:
    """[lo, hi] stretched about ``estimate`` by ``width`` on the ``scale`` (docs/intervals.md);
    NaN where the width or the estimate on that scale is not finite."""
    h, inverse = _scale(scale)
    e, a, b = _on_scale(h, estimate), _on_scale(h, lo), _on_scale(h, hi)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(np.isfinite(e), width, np.nan)
        new_lo = inverse(e - w * (e - a))
        new_hi = inverse(e + w * (b - e))
    return _scalar(new_lo), _scalar(new_hi)


def _group_variances(statistic: Statistic, observed: list[np.ndarray], resampled: list[np.ndarray],
                     h: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """v_g [G, ...]: the variance over resamples of h(statistic) when only group g is resampled
    (the others at their observed sums): each group's share of the interval's width."""
    base = np.stack(observed, axis=0)  # [G, d...]
    out = []
    for g, r in enumerate(resampled):
        sums = np.broadcast_to(base, (r.shape[0],) + base.shape).copy()  # [R, G, d...]
        sums[:, g] = r
        values = _on_scale(h, _evaluate(statistic, sums))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out.append(np.nanvar(np.where(np.isfinite(values), values, np.nan), axis=0))
    return np.stack(out, axis=0)


def _factor(sizes: Sequence[int], variances: Callable[[], np.ndarray] | None) -> Any:
    """f = sqrt(Σ_g f_g² v_g / Σ_g v_g) (docs/intervals.md): the common f_g when every group of two or
    more requests has the same size (``variances`` is then not called), else variance-weighted."""
    f = small_sample_factors(sizes)
    sized = {int(n) for n in sizes if n >= 2}
    if len(sized) <= 1 or variances is None:
        return float(f.max()) if f.size else math.nan
    v = np.nan_to_num(variances())  # [G, ...]
    f2 = (f**2).reshape((-1,) + (1,) * (v.ndim - 1))
    total = v.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.where(total > 0, (f2 * v).sum(axis=0) / total, float(np.mean(f[f > 0] ** 2))))


def _scalar(x: Any) -> Any:
    return float(x) if np.ndim(x) == 0 else np.asarray(x)


def _evaluate(statistic: Statistic, sums: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN slice is NaN on purpose
        return np.asarray(statistic(sums), dtype=np.float64)


def _aggregates(aggregates: Any) -> np.ndarray:
    a = np.asarray(aggregates, dtype=np.float64)
    if a.ndim < 1:
        raise ValueError("aggregates must have one row per request, shape [n, ...]")
    return a


def _groups(groups: Sequence[Any], caller: str) -> list[np.ndarray]:
    """The G group arrays as float64, checked: at least one, all of one trailing shape."""
    arrays = [_aggregates(g) for g in groups]
    if not arrays:
        raise ValueError(f"{caller} needs at least one group")
    if len({a.shape[1:] for a in arrays}) != 1:
        raise ValueError(f"groups have different aggregate shapes {[a.shape[1:] for a in arrays]}")
    return arrays


def _interval_from_counts(aggregates: np.ndarray, statistic: Statistic, counts: np.ndarray, level: float,
                          small_sample: bool | None = None, scale: str = "identity") -> Interval:
    check_settings(int(counts.shape[0]), level)
    _scale(scale)
    if counts.shape[1] != aggregates.shape[0]:
        raise ValueError(f"resample counts cover {counts.shape[1]} requests but there are {aggregates.shape[0]}")
    estimate = _evaluate(statistic, aggregates.sum(axis=0))
    sums = np.tensordot(np.asarray(counts, dtype=np.float64), aggregates, axes=1)  # [R, d...]
    lo, hi = percentile_interval(_evaluate(statistic, sums), level)
    if SMALL_SAMPLE if small_sample is None else small_sample:
        n = aggregates.shape[0]
        width = float(small_sample_factors([n])[0]) * _t_over_z(design_df([n]), level)
        lo, hi = _corrected(estimate, lo, hi, width, scale)
    return Interval(_scalar(estimate), lo, hi)


def bootstrap_ci(
    aggregates: Any,
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
    small_sample: bool | None = None,
    scale: str = "identity",
) -> Interval:
    """(estimate, lo, hi) of ``statistic`` over requests.

    aggregates: [n, ...], one row per request (e.g. [Σ τ, rounds] of its rounds);
    statistic: maps sums over requests [..., d...] to the number(s) reported
    (leading axes are resamples), e.g. ``lambda s: s[..., 0] / s[..., 1]``.
    The estimate is the statistic of the plain sums; lo / hi the percentile
    interval of ``resamples`` resamples of the n requests drawn with
    ``np.random.default_rng(seed)``, corrected for a small n on ``scale``
    (docs/intervals.md) unless ``small_sample`` is False; NaN bounds for fewer than two requests."""
    a = _aggregates(aggregates)
    counts = resample_counts(a.shape[0], resamples, np.random.default_rng(seed))
    return _interval_from_counts(a, statistic, counts, level, small_sample, scale)


def bootstrap_ci_from_indices(
    aggregates: Any, statistic: Statistic, indices: Any, level: float = DEFAULT_LEVEL,
    small_sample: bool | None = None, scale: str = "identity",
) -> Interval:
    """``bootstrap_ci`` on an explicit resample set: indices [R, k], row r the requests drawn."""
    a = _aggregates(aggregates)
    return _interval_from_counts(a, statistic, counts_from_indices(indices, a.shape[0]), level, small_sample, scale)


def stratified_ci(
    groups: Sequence[Any],
    statistic: Statistic,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    level: float = DEFAULT_LEVEL,
    counts: Sequence[np.ndarray] | None = None,
    small_sample: bool | None = None,
    scale: str = "identity",
) -> Interval:
    """(estimate, lo, hi) of a statistic of per-group sums, requests resampled within each group.

    groups: G aggregate arrays [n_g, d...] (one per benchmark, same trailing
    shape); statistic: maps stacked group sums [..., G, d...] to the reported
    number(s), e.g. the mean over benchmarks of each one's τ (a macro
    average). Each group keeps its size in every resample, as the benchmarks
    of an evaluation do. ``counts`` (G draw-count matrices [R, n_g]) replaces
    the seeded draw, so that several statistics share one resample set; the
    default draws group after group from ``np.random.default_rng(seed)``. The
    percentile interval is corrected for small groups on ``scale``
    (docs/intervals.md: "identity", "log" for positive ratios, "logit" for numbers in
    [0, 1]) unless ``small_sample`` is False; NaN bounds when no group has two requests."""
    arrays = _groups(groups, "stratified_ci")
    h, _ = _scale(scale)
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
    lo, hi = percentile_interval(_evaluate(statistic, np.stack(resampled, axis=1)), level)  # sums [R, G, d...]
    if SMALL_SAMPLE if small_sample is None else small_sample:
        sizes = [a.shape[0] for a in arrays]
        factor = _factor(sizes, lambda: _group_variances(statistic, observed, resampled, h))
        lo, hi = _corrected(estimate, lo, hi, factor * _t_over_z(design_df(sizes), level), scale)
    return Interval(_scalar(estimate), lo, hi)


def jackknife_ci(
    groups: Sequence[Any],
    statistic: Statistic,
    *,
    level: float = DEFAULT_LEVEL,
    scale: str = "identity",
    support: tuple[float, float] = (-math.inf, math.inf),
) -> Interval:
    """(estimate, lo, hi) of a smooth statistic of per-group sums: the stratified delete-one
    jackknife on ``scale`` with Student's t at the design degrees of freedom (docs/intervals.md),
    clipped to the statistic's ``support`` (e.g. (1, inf) for τ).

    groups: G aggregate arrays [n_g, d...] (one per benchmark); statistic: maps stacked group
    sums [..., G, d...] to the reported number(s), as for ``stratified_ci``. Deleting request i
    of group g replaces that group's sum by (S_g − a_i) · n_g / (n_g − 1), so every group keeps
    its weight. NaN bounds where no group has two requests, the estimate is off the scale's
    range (a ratio of 0 on "log"), or a deletion leaves the statistic undefined."""
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}")
    arrays = _groups(groups, "jackknife_ci")
    h, inverse = _scale(scale)
    observed = np.stack([a.sum(axis=0) for a in arrays], axis=0)  # [G, d...]
    estimate = _evaluate(statistic, observed)
    sizes = [a.shape[0] for a in arrays]
    variance: Any = 0.0
    for g, a in enumerate(arrays):
        n = a.shape[0]
        if n < 2:
            continue
        deleted = np.broadcast_to(observed, (n,) + observed.shape).copy()  # [n_g, G, d...]
        deleted[:, g] = (observed[g] - a) * (n / (n - 1))
        values = _on_scale(h, _evaluate(statistic, deleted))  # [n_g, ...]
        with np.errstate(invalid="ignore"):
            variance = variance + (n - 1) / n * ((values - values.mean(axis=0)) ** 2).sum(axis=0)
    nu = design_df(sizes)
    t = student_t_quantile((1.0 + float(level)) / 2, nu) if np.isfinite(nu) else math.nan
    e = _on_scale(h, estimate)
    with np.errstate(invalid="ignore", over="ignore"):
        half = t * np.sqrt(variance)
        ok = np.isfinite(e) & np.isfinite(half)
        lo = np.where(ok, np.clip(inverse(np.where(ok, e - half, 0.0)), *support), np.nan)
        hi = np.where(ok, np.clip(inverse(np.where(ok, e + half, 0.0)), *support), np.nan)
    return Interval(_scalar(estimate), _scalar(lo), _scalar(hi))


def proportion_ci(
    groups: Sequence[Any],
    *,
    level: float = DEFAULT_LEVEL,
    min_rounds: int = MIN_ROUNDS,
    min_requests: int = MIN_REQUESTS,
) -> Interval:
    """(θ̂, lo, hi) of the pooled proportion θ̂ = Σ passed / Σ reached over G groups of requests:
    Wilson's interval on effective counts (docs/intervals.md).

    groups: G arrays [n_g, ..., 2], per request (passed, reached) counts (``passed`` may be
    fractional, e.g. ℓ / γ per round); the middle axes (draft positions) are computed
    elementwise. lo / hi are NaN where fewer than ``min_rounds`` rounds were reached, fewer
    than ``min_requests`` requests reached any, or no group holds two requests."""
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}")
    arrays = _groups(groups, "proportion_ci")
    if arrays[0].shape[-1] != 2:
        raise ValueError(f"groups must be [n_g, ..., 2] arrays of (passed, reached), got "
                         f"{[a.shape for a in arrays]}")
    passed = sum(a[..., 0].sum(axis=0) for a in arrays)
    reached = sum(a[..., 1].sum(axis=0) for a in arrays)
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.asarray(passed / reached, dtype=np.float64)
        variance = np.zeros_like(theta)
        for a in arrays:
            n = a.shape[0]
            if n >= 2:
                residual = a[..., 0] - theta * a[..., 1]  # e_i [n_g, ...]
                variance = variance + n / (n - 1) * ((residual - residual.mean(axis=0)) ** 2).sum(axis=0)
        variance = variance / reached**2
        binomial = theta * (1 - theta) / reached
        deff = np.maximum(np.where(binomial > 0, variance / binomial, 1.0), DEFF_FLOOR)
        n_eff = reached / deff
        nu = design_df([a.shape[0] for a in arrays])
        t = student_t_quantile((1.0 + float(level)) / 2, nu) if np.isfinite(nu) else math.nan
        scale = 1 + t * t / n_eff
        center = (theta + t * t / (2 * n_eff)) / scale
        half = t * np.sqrt(theta * (1 - theta) / n_eff + t * t / (4 * n_eff * n_eff)) / scale
    requests = sum((a[..., 1] > 0).sum(axis=0) for a in arrays)
    enough = (reached >= min_rounds) & (requests >= min_requests) & np.isfinite(half)
    with np.errstate(invalid="ignore"):  # Wilson's interval holds θ̂; the clip only removes rounding
        lo = np.where(enough, np.clip(np.minimum(center - half, theta), 0.0, 1.0), np.nan)
        hi = np.where(enough, np.clip(np.maximum(center + half, theta), 0.0, 1.0), np.nan)
    return Interval(_scalar(theta), _scalar(lo), _scalar(hi))


def intervals_overlap(a: Any, b: Any) -> bool | None:
    """Whether the closed intervals a = [lo, hi] and b = [lo, hi] share a point; None
    when either is missing or not finite (e.g. a report written without intervals)."""
    for pair in (a, b):
        if pair is None or len(pair) != 2 or any(v is None or not np.isfinite(float(v)) for v in pair):
            return None
    return float(a[0]) <= float(b[1]) and float(b[0]) <= float(a[1])
