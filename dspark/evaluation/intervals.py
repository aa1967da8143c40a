"""95 % intervals over requests of the evaluation report's numbers (``dspark.evaluation.report.build_report``).

Every interval treats the requests of each benchmark as the sample (stratified by benchmark) and
works on the scale where the number lives (``dspark.bootstrap``): the stratified jackknife on the
log scale for τ, τ per request and the speedups; Wilson's interval on effective counts for the
proportions (conditional acceptance, acceptance rate, verified share of the drafts); the
stratified percentile bootstrap on the logit scale for ECE. :func:`request_aggregates` sums the
rounds and timings of each request of each benchmark (:class:`BenchmarkAggregates`), and
:func:`add_intervals` adds ``x_ci`` next to each metric ``x`` of a report that it covers.

docs/intervals.md (the report's intervals): what each number gets and why; docs/evaluation.md:
how to read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.bootstrap import DEFAULT_LEVEL, check_settings, jackknife_ci, proportion_ci, resample_counts, stratified_ci
from dspark.data.benchmarks import domain_of
from dspark.scheduling.calibration import apply_temperatures
from dspark.scheduling.calibration_metrics import ece_from_sums, ece_sums
from dspark.evaluation.metrics import ECE_BINS, MACRO_KEYS, macro_average_array, round_tau

__all__ = ["BenchmarkAggregates", "add_intervals", "request_aggregates"]


@dataclass
class BenchmarkAggregates:
    """Per-request aggregates of one benchmark, each array [n_requests, ...] in one request order."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    num_requests: int = 0


# Each statistic maps sums over requests, stacked over benchmarks [..., G, d...], to the
# number pooled over those benchmarks' rounds.
def _ratio(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)
    return s[..., 0] / s[..., 1]


def _conditional(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-3)  # [..., γ, 2]
    return s[..., 0] / s[..., 1]


def _ece(s: np.ndarray) -> np.ndarray:
    return ece_from_sums(s.sum(axis=-3))


def _speedup(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


# The interval of each kind of number (docs/intervals.md): a jackknife scale, or "proportion".
PROPORTION = "proportion"
TAU_SUPPORT = (1.0, float("inf"))  # every round emits at least one token
_STATISTICS: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], str]] = {
    # report key -> (aggregate name, statistic, interval)
    "tau": ("tau", _ratio, "log"),
    "tau_per_request": ("tau_per_request", _ratio, "log"),
    "acceptance_rate": ("acceptance", _ratio, PROPORTION),
    "verify_rate": ("verify", _ratio, PROPORTION),
    "conditional_acceptance": ("conditional", _conditional, PROPORTION),
    "speedup": ("speed", _speedup, "log"),
    "decode_speedup": ("decode_speed", _speedup, "log"),
}


def request_aggregates(
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    gamma: int,
    temperatures: Any = None,
    n_bins: int = ECE_BINS,
) -> dict[str, BenchmarkAggregates]:
    """Per benchmark, the per-request sums every covered metric is a ratio (or ECE) of.

    tau [Σ τ, rounds]; tau_per_request [mean τ, 1] (0, 0 without rounds);
    acceptance [Σ m, Σ ℓ]; verify [Σ ℓ / γ, rounds]; conditional [γ, 2]
    (passed, reached); ece / ece_calibrated [γ, n_bins + 1] (``ece_sums``, if
    any round has confidences); speed [tokens, wall_s, baseline tokens,
    baseline wall_s] and decode_speed (the same after the prefill), when every
    record has them, as ``dspark.evaluation.report`` computes the speedups."""
    names = list(dict.fromkeys([r["benchmark"] for r in records] + [r["benchmark"] for r in rounds]))
    out = {}
    for name in names:
        mine = [r for r in records if r["benchmark"] == name]
        its_rounds = [r for r in rounds if r["benchmark"] == name]
        keys = list(dict.fromkeys([r["request"] for r in mine] + [r["request"] for r in its_rounds]))
        index = {k: i for i, k in enumerate(keys)}
        arrays = _round_sums(its_rounds, [index[r["request"]] for r in its_rounds], len(keys), gamma)
        arrays.update(_ece_aggregates(its_rounds, index, len(keys), temperatures, n_bins))
        arrays.update(_speed_aggregates(mine, index, len(keys)))
        out[name] = BenchmarkAggregates(arrays, len(keys))
    return out


def _round_sums(rounds: Sequence[Mapping[str, Any]], group: list[int], n: int, gamma: int) -> dict[str, np.ndarray]:
    g = np.asarray(group, dtype=np.int64)
    m = np.asarray([int(r["accepted"]) for r in rounds], dtype=np.int64)
    ell = np.asarray([int(r["proposed"]) for r in rounds], dtype=np.int64)
    tau = np.asarray([round_tau(r) for r in rounds], dtype=np.float64)

    def per_request(values: np.ndarray) -> np.ndarray:
        return np.bincount(g, weights=values, minlength=n) if g.size else np.zeros(n)

    count = per_request(np.ones(g.size))
    tau_sum = per_request(tau)
    has = count > 0
    mean_tau = np.divide(tau_sum, count, out=np.zeros(n), where=has)
    conditional = np.zeros((n, gamma, 2))
    k = np.arange(1, gamma + 1)
    passed = (m[:, None] >= k).astype(np.float64)  # [N, γ]; the oracle is conditional_acceptance_counts
    reached = ((m[:, None] >= k - 1) & (ell[:, None] >= k)).astype(np.float64)
    np.add.at(conditional, (g, slice(None), 0), passed)
    np.add.at(conditional, (g, slice(None), 1), reached)
    return {
        "tau": np.stack([tau_sum, count], axis=1),
        "tau_per_request": np.stack([mean_tau, has.astype(np.float64)], axis=1),
        "acceptance": np.stack([per_request(m.astype(np.float64)), per_request(ell.astype(np.float64))], axis=1),
        "verify": np.stack([per_request(ell / gamma), count], axis=1),
        "conditional": conditional,
    }


def _ece_aggregates(
    rounds: Sequence[Mapping[str, Any]], index: Mapping[Any, int], n: int, temperatures: Any, n_bins: int
) -> dict[str, np.ndarray]:
    """``ece_sums`` per request of the rounds with confidences (raw, and after STS if given)."""
    with_conf = [r for r in rounds if r.get("confidences") is not None]
    if not with_conf:
        return {}
    conf = np.asarray([r["confidences"] for r in with_conf], dtype=np.float64)  # [N, γ]
    m = [int(r["accepted"]) for r in with_conf]
    ell = [int(r["proposed"]) for r in with_conf]
    group = [index[r["request"]] for r in with_conf]
    out = {"ece": ece_sums(conf, m, ell, group, n, n_bins)}
    if temperatures is not None:
        out["ece_calibrated"] = ece_sums(apply_temperatures(conf, temperatures), m, ell, group, n, n_bins)
    return out


def _speed_aggregates(records: Sequence[Mapping[str, Any]], index: Mapping[Any, int], n: int) -> dict[str, np.ndarray]:
    """speed and decode_speed per request (see ``request_aggregates``), when the records allow."""
    if not records or not all("baseline_wall_s" in r for r in records):
        return {}
    speed = np.zeros((n, 4))
    for r in records:
        speed[index[r["request"]]] += [int(r["tokens"]), float(r["wall_s"]), int(r["baseline_tokens"]),
                                       float(r["baseline_wall_s"])]
    out = {"speed": speed}
    if all("prefill" in r.get("timings", {}) and "prefill" in r.get("baseline_timings", {}) for r in records):
        decode = np.zeros((n, 4))
        for r in records:
            decode[index[r["request"]]] += [max(0, int(r["tokens"]) - 1),
                                            float(r["wall_s"]) - float(r["timings"]["prefill"]),
                                            max(0, int(r["baseline_tokens"]) - 1),
                                            float(r["baseline_wall_s"]) - float(r["baseline_timings"]["prefill"])]
        out["decode_speed"] = decode
    return out


def _pair(lo: Any, hi: Any) -> Any:
    """[lo, hi], or one [lo, hi] per element; NaN bounds (no interval) stay NaN."""
    if np.ndim(lo) == 0:
        return [float(lo), float(hi)]
    return [[float(a), float(b)] for a, b in zip(lo, hi)]


class _Intervals:
    """Intervals of the metrics of a set of benchmarks, on one shared set of draw counts."""

    def __init__(self, aggregates: Mapping[str, BenchmarkAggregates], resamples: int, seed: int) -> None:
        self.aggregates = aggregates
        rng = np.random.default_rng(seed)
        # float64 once: every statistic multiplies these counts with its aggregates.
        self.counts = {name: resample_counts(a.num_requests, resamples, rng).astype(np.float64)
                       for name, a in aggregates.items()}

    def ci(self, names: Sequence[str], aggregate: str, statistic: Callable[[np.ndarray], np.ndarray],
           method: str) -> Any:
        """[lo, hi] (or one per element) of ``statistic`` over ``names``; None where a benchmark lacks the
        aggregate. ``method``: a jackknife scale ("log", ...), ``PROPORTION``, or "bootstrap"
        (the shared draw counts, on the logit scale: ECE). τ's intervals are clipped at 1."""
        present = [n for n in names if n in self.aggregates]
        if not present or any(aggregate not in self.aggregates[n].arrays for n in present):
            return None
        groups = [self.aggregates[n].arrays[aggregate] for n in present]
        if method == PROPORTION:
            flat = [g if g.ndim == 3 else g[:, None, :] for g in groups]  # [n, positions, (passed, reached)]
            _, lo, hi = proportion_ci(flat)
            if groups[0].ndim == 2:
                lo, hi = np.asarray(lo)[0], np.asarray(hi)[0]
        elif method == "bootstrap":
            _, lo, hi = stratified_ci(groups, statistic, counts=[self.counts[n] for n in present], scale="logit")
        else:
            support = TAU_SUPPORT if aggregate.startswith("tau") else (-np.inf, np.inf)
            _, lo, hi = jackknife_ci(groups, statistic, scale=method, support=support)
        return _pair(lo, hi)

    def annotate(self, entry: dict[str, Any], names: Sequence[str]) -> None:
        """Add x_ci next to every covered metric x of ``entry`` (pooled over ``names``)."""
        for key, (aggregate, statistic, method) in _STATISTICS.items():
            if key in entry:
                ci = self.ci(names, aggregate, statistic, method)
                if ci is not None:
                    entry[f"{key}_ci"] = ci
        for key, aggregate in (("confidence", "ece"), ("confidence_calibrated", "ece_calibrated")):
            if entry.get(key):
                ci = self.ci(names, aggregate, _ece, "bootstrap")
                for position, pair in zip(entry[key], ci or []):
                    position["ece_ci"] = pair

    def macro(self, names: Sequence[str], aggregate: str, statistic: Callable[[np.ndarray], np.ndarray],
              scale: str) -> Any:
        """{math, code, chat, avg: [lo, hi]} of the macro average of the per-benchmark statistic
        (the jackknife on ``scale``).

        Each column is computed over the benchmarks it averages (a domain's, or all of them for
        avg), so that its degrees of freedom count the requests it rests on."""
        present = [n for n in names if aggregate in self.aggregates[n].arrays]
        if not present:
            return None
        out = {}
        for column, key in enumerate(MACRO_KEYS):
            members = [n for n in present if domain_of(n) is not None and (key == "avg" or domain_of(n) == key)]
            if not members:
                out[key] = [float("nan"), float("nan")]
                continue

            def macro_stat(s: np.ndarray, members: list[str] = members, column: int = column) -> np.ndarray:
                per_benchmark = statistic(s[..., None, :])  # [..., G]: each benchmark alone
                return macro_average_array(per_benchmark, members)[..., column]

            support = TAU_SUPPORT if aggregate.startswith("tau") else (-np.inf, np.inf)
            _, lo, hi = jackknife_ci([self.aggregates[n].arrays[aggregate] for n in members], macro_stat,
                                     scale=scale, support=support)
            out[key] = _pair(lo, hi)
        return out


def add_intervals(
    report: dict[str, Any],
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    *,
    resamples: int,
    seed: int,
    temperatures: Any = None,
    n_bins: int = ECE_BINS,
) -> dict[str, Any]:
    """Add the x_ci keys to a ``build_report`` dict in place, and
    ``report["bootstrap"] = {resamples, seed, level}``; returns the report.

    Next to each covered metric ``x`` it adds ``x_ci``: [lo, hi] (for a per-position list, one
    [lo, hi] per position; for the macro dicts, one per column). Covered: tau, tau_per_request,
    conditional_acceptance, acceptance_rate, verify_rate, speedup, decode_speedup (benchmarks,
    domains, all), each domain's tau_macro, the ECE of every confidence entry
    (``confidence[k]["ece_ci"]``, ``confidence_calibrated`` too) and the macro averages of tau,
    tau_per_request, speedup and decode_speedup."""
    check_settings(resamples, DEFAULT_LEVEL)
    aggregates = request_aggregates(records, rounds, int(report["gamma"]), temperatures, n_bins)
    intervals = _Intervals(aggregates, resamples, seed)
    for name, entry in report["benchmarks"].items():
        intervals.annotate(entry, [name])
    for entry in report["domains"].values():
        intervals.annotate(entry, entry["benchmarks"])
        ci = intervals.macro(entry["benchmarks"], "tau", _ratio, "log")
        if ci is not None:
            entry["tau_macro_ci"] = ci["avg"]
    intervals.annotate(report["all"], list(aggregates))
    names = list(report["benchmarks"])
    for key in [k for k in report["macro"] if k in _STATISTICS]:
        aggregate, statistic, method = _STATISTICS[key]
        ci = intervals.macro(names, aggregate, statistic, method)
        if ci is not None:
            report["macro"][f"{key}_ci"] = ci
    report["bootstrap"] = {"resamples": int(resamples), "seed": int(seed), "level": DEFAULT_LEVEL}
    return report
