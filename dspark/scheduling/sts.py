"""The temperature search of Sequential Temperature Scaling (paper Section 3.2.1) and its evidence guards.

``dspark.scheduling.calibration.fit_sts`` validates a round log and calls ``fit_temperatures`` here; this
module holds the numerics only (numpy, no file or report handling).

Plain STS (the paper's Section 3.2.1) picks, position by position, the grid temperature T_k whose
calibrated prefix survival a'_k = Π_{i<k} c'_i · σ(logit(c_k)/T_k) has the lowest ECE against
1[first k accepted]. An argmin always finds *some* T: where a position's labels carry no evidence
it fits noise. Two guards keep T_k = 1 there (both off gives the plain argmin):

- **minimum evidence** (``min_events``): T_k moves off 1 only if the rounds that verified k hold at
  least ``min_events`` accepted *and* ``min_events`` rejected prefixes. With one class only the
  ECE is minimised by pushing every prediction towards that class (T → the grid bound 0.05 when
  all are rejected and c_k < 1/2), which says nothing about the temperature.
- **held-out gain beyond noise** (``folds`` = K ≥ 2): the rounds are dealt into K seeded folds by
  group (by request in `dspark calibrate`, since the rounds of one request are correlated); each
  fold's rounds get the T fitted on the other K − 1 folds, and T_k moves off 1 only if the ECE of
  these out-of-fold predictions is below the ECE at T = 1 on the same rounds by more than noise:
  the 95 % interval of that gain, from a seeded bootstrap over the groups, must lie above 0. The
  in-sample argmin can only lower the fit ECE, so only held-out rounds say whether the gain
  generalises (a bootstrap of the in-sample gain would ignore that T was selected on the same
  rounds); and the held-out ECE difference is itself noisy (binned ECE has a positive bias of
  order sqrt(bins / n)), hence the interval. On synthetic rounds with calibrated confidences this
  guard rarely moves T off 1 on small sets and never on large ones, where a bare "held-out ECE
  below T = 1's" often does and "every fold's held-out ECE below" lacks power; for a miscalibrated
  head it lets T move more often as the rounds grow, always on large sets. Deterministic given
  ``seed``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["bin_index", "fit_temperatures", "fold_ids", "logit", "sigmoid"]

_CLIP = 1e-6


def logit(c: np.ndarray) -> np.ndarray:
    c = np.clip(c, _CLIP, 1.0 - _CLIP)
    return np.log(c) - np.log1p(-c)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf gives the right limit 0
        return 1.0 / (1.0 + np.exp(-x))


def bin_index(p: np.ndarray, n_bins: int) -> np.ndarray:
    # Bins [i/n, (i+1)/n); the value 1.0 joins the last bin.
    return np.minimum((p * n_bins).astype(np.int64), n_bins - 1)


def _ece_per_candidate(preds: np.ndarray, y: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of preds [G, n] against labels y [n] -> [G].

    Uses n_b·|p̄_b − ȳ_b| = |Σ_{i∈b} (p_i − y_i)|, so one weighted bincount
    over the [G, n_bins] flattened bins gives every candidate's ECE."""
    G, n = preds.shape
    idx = bin_index(preds, n_bins)  # [G, n]
    idx += (np.arange(G) * n_bins)[:, None]
    preds -= y[None, :]  # in place: preds is a scratch array owned by the caller
    per_bin = np.bincount(idx.ravel(), weights=preds.ravel(), minlength=G * n_bins)
    return np.abs(per_bin.reshape(G, n_bins)).sum(axis=1) / n


def _argmin_temperature(z: np.ndarray, prefix: np.ndarray, y: np.ndarray, grid: np.ndarray, n_bins: int) -> float:
    """The grid T minimising the ECE of prefix·σ(z/T) against y (n ≥ 1 rounds). ``grid`` is ordered
    by |log T| so that argmin's first-hit rule breaks ties towards T = 1."""
    n = z.size
    chunk = max(1, 4_000_000 // n)  # bound the [G, n] working set to a few million entries
    scores = np.concatenate([
        _ece_per_candidate(prefix[None, :] * sigmoid(z[None, :] / g[:, None]), y, n_bins)
        for g in (grid[i: i + chunk] for i in range(0, grid.size, chunk))
    ])
    return float(grid[int(np.argmin(scores))])


def _ece(pred: np.ndarray, y: np.ndarray, n_bins: int) -> float:
    return float(_ece_per_candidate(pred[None, :].copy(), y, n_bins)[0])


def fold_ids(groups: Any, folds: int, seed: int) -> np.ndarray:
    """Fold of each round, int64 [N]: the distinct groups in a seeded random order, dealt
    round-robin into min(folds, number of groups) folds, so a group never spans two folds."""
    g = np.asarray(groups).ravel()
    _, inverse = np.unique(g, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.size else 0
    order = np.random.default_rng(seed).permutation(n_groups)
    fold_of_group = np.empty(n_groups, dtype=np.int64)
    fold_of_group[order] = np.arange(n_groups) % max(1, min(folds, n_groups))
    return fold_of_group[inverse.ravel()]


def _out_of_fold(z: np.ndarray, prefix: np.ndarray, y: np.ndarray, fold: np.ndarray, grid: np.ndarray,
                 n_bins: int) -> np.ndarray:
    """Out-of-fold predictions [n]: prefix·σ(z/T_f) on fold f, T_f fitted on the rounds outside f."""
    pred = np.empty_like(z)
    for f in np.unique(fold):
        held = fold == f
        t = _argmin_temperature(z[~held], prefix[~held], y[~held], grid, n_bins)
        pred[held] = prefix[held] * sigmoid(z[held] / t)
    return pred


def _gain_interval(pred: np.ndarray, base: np.ndarray, y: np.ndarray, group: np.ndarray, n_bins: int,
                   resamples: int, level: float, seed: int) -> tuple[float, float]:
    """[lo, hi] of ECE(base) − ECE(pred) over a seeded bootstrap of the groups: per group the signed
    residual sums per bin (n_b·|p̄_b − ȳ_b| = |Σ_b (p − y)|), resampled with multinomial weights."""
    _, g = np.unique(group, return_inverse=True)
    g = g.ravel()
    n_groups = int(g.max()) + 1

    def sums(p: np.ndarray) -> np.ndarray:  # [groups, n_bins]
        out = np.zeros((n_groups, n_bins))
        np.add.at(out, (g, bin_index(p, n_bins)), p - y)
        return out

    count = np.bincount(g, minlength=n_groups).astype(np.float64)
    w = np.random.default_rng(seed).multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=resamples)
    n = w @ count  # rounds per resample, [B]
    gain = (np.abs(w @ sums(base)).sum(axis=1) - np.abs(w @ sums(pred)).sum(axis=1)) / n
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(gain, alpha)), float(np.quantile(gain, 1.0 - alpha))


def _fit_position(z: np.ndarray, prefix: np.ndarray, y: np.ndarray, n_bins: int, grid: np.ndarray,
                  guard: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """T_k for one position from its verified rounds, and the record of why: keys rounds, accepted,
    rejected, t_argmin (the plain STS choice), ece_t1 / ece_argmin (in-sample), ece_held_out (of the
    out-of-fold predictions) and gain_ci (interval of ECE at T = 1 minus ece_held_out), when checked,
    and kept (None when T_k = t_argmin, else the reason T_k stayed 1). ``guard``: min_events, and
    fold / group ([n] ids, fold None = no check), resamples, level, seed."""
    n, n_acc = int(y.size), int(y.sum())
    info: dict[str, Any] = {"rounds": n, "accepted": n_acc, "rejected": n - n_acc, "t_argmin": 1.0, "ece_t1": None,
                            "ece_argmin": None, "ece_held_out": None, "gain_ci": None, "kept": None}
    if n == 0:
        info["kept"] = "no round verified this position"
        return 1.0, info
    t_star = _argmin_temperature(z, prefix, y, grid, n_bins)
    base = prefix * sigmoid(z)
    info.update(t_argmin=t_star, ece_t1=_ece(base, y, n_bins), ece_argmin=_ece(prefix * sigmoid(z / t_star), y, n_bins))
    if t_star == 1.0:
        return 1.0, info
    min_events = guard["min_events"]
    for count, what in ((n_acc, "accepted"), (n - n_acc, "rejected")):
        if count < min_events:
            info["kept"] = f"{count} {what} prefix{'' if count == 1 else 'es'} < min_events={min_events}"
            return 1.0, info
    fold = guard["fold"]
    if fold is not None:
        if np.unique(fold).size < 2:
            info["kept"] = "one group (request) only: no held-out fold to check on"
            return 1.0, info
        held_out = _out_of_fold(z, prefix, y, fold, grid, n_bins)
        lo, hi = _gain_interval(held_out, base, y, guard["group"], n_bins, guard["resamples"], guard["level"],
                                guard["seed"])
        info.update(ece_held_out=_ece(held_out, y, n_bins), gain_ci=[lo, hi])
        if not lo > 0:
            info["kept"] = (f"held-out ECE gain over T = 1 is {info['ece_t1'] - info['ece_held_out']:.3g}, "
                            f"its {guard['level']:.0%} interval [{lo:.3g}, {hi:.3g}] reaches 0")
            return 1.0, info
    return t_star, info


def fit_temperatures(
    z: np.ndarray, label: np.ndarray, valid: np.ndarray, grid: np.ndarray, n_bins: int,
    min_events: int = 0, folds: int = 0, groups: Optional[Any] = None, seed: int = 0,
    resamples: int = 1000, level: float = 0.95,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Sequential Temperature Scaling with the guards of the module docstring.

    z: logit(c_k) [N, γ]; label: 1[first k accepted], valid: k verified, both bool [N, γ];
    grid: candidate temperatures (a kept position gets exactly 1.0 whether or not grid holds it);
    groups: [N] ids that folds and bootstrap resamples take whole (None = every round its own).
    For k = 1..γ in order, T_k is chosen on the rounds that verified k with T_1..T_{k−1} fixed.
    Returns (temperatures float64 [γ], one ``_fit_position`` record per position with its 1-based
    ``position`` and ``temperature``)."""
    n, gamma = z.shape
    grid = grid[np.argsort(np.abs(np.log(grid)), kind="stable")]
    group = np.arange(n) if groups is None else np.asarray(groups).ravel()
    fold = fold_ids(group, folds, seed) if folds >= 2 else None
    temps = np.ones(gamma, dtype=np.float64)
    prefix = np.ones(n, dtype=np.float64)  # Π_{i<k} c'_i
    records = []
    for k in range(gamma):
        rows = valid[:, k]
        guard = {"min_events": min_events, "fold": None if fold is None else fold[rows], "group": group[rows],
                 "resamples": resamples, "level": level, "seed": seed}
        temps[k], info = _fit_position(z[rows, k], prefix[rows], label[rows, k].astype(np.float64), n_bins, grid,
                                       guard)
        records.append({"position": k + 1, "temperature": float(temps[k]), **info})
        prefix = prefix * sigmoid(z[:, k] / temps[k])
    return temps, records
