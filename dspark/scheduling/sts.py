"""The temperature search of Sequential Temperature Scaling (paper Section 3.2.1) and its evidence guards.

``dspark.scheduling.calibration.fit_sts`` validates a round log and calls ``fit_temperatures`` here; this
module holds the numerics only (numpy float64, no file or report handling).

Plain STS picks, position by position, the grid temperature T_k whose calibrated prefix survival
a'_k = Π_{i<k} c'_i · σ(logit(c_k)/T_k) has the lowest ECE against 1[first k accepted]. Two guards keep
T_k = 1 where a position's labels carry no evidence (both off gives the plain argmin): ``min_events``
accepted *and* rejected prefixes, and (``folds`` ≥ 2) cross-fitted held-out predictions that beat
T_k = 1 in ECE and in Brier score, each gain with a 95 % bootstrap interval above 0. Why both, how the
folds chain across positions, and the guarantee tests/scheduling/test_sts.py checks by
simulation: docs/scheduling.md, "STS and its guards". Deterministic given ``seed``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from dspark.scheduling.calibration_metrics import CLIP, bin_index, binned_residuals, ece_from_residuals, log_loss_values

__all__ = ["fit_temperatures", "fold_ids", "logit", "sigmoid"]


def logit(c: np.ndarray) -> np.ndarray:
    c = np.clip(c, CLIP, 1.0 - CLIP)
    return np.log(c) - np.log1p(-c)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf gives the right limit 0
        return 1.0 / (1.0 + np.exp(-x))


def _ece_per_candidate(preds: np.ndarray, y: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of preds [G, n] against labels y [n] -> [G] (``ece_from_residuals``; preds is
    a scratch array owned by the caller, overwritten)."""
    return ece_from_residuals(binned_residuals(preds, y, n_bins), preds.shape[1])


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


def _cross_fit(z: np.ndarray, y: np.ndarray, fold_prefix: np.ndarray, fold: np.ndarray, grid: np.ndarray,
               n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cross-fitted predictions at one position from its n verified rounds.

    z, y: [n]; fold: [n] ids in [0, K); fold_prefix: [K, n], row f the prefix Π_{i<k} c'_i of every
    round under the temperatures T_1^(−f)..T_{k−1}^(−f) fitted without fold f. Returns (t_fold [K]:
    T_k^(−f), the argmin on the rounds outside f with their fold-f prefix, 1.0 where none is outside;
    pred [n]: prefix^(−f)·σ(z/T_k^(−f)) on each fold f's rounds; base [n]: prefix^(−f)·σ(z), the
    same rounds at T_k = 1)."""
    t_fold = np.ones(fold_prefix.shape[0], dtype=np.float64)
    pred, base = np.empty_like(z), np.empty_like(z)
    for f in range(fold_prefix.shape[0]):
        held = fold == f
        if (~held).any():
            t_fold[f] = _argmin_temperature(z[~held], fold_prefix[f, ~held], y[~held], grid, n_bins)
        pred[held] = fold_prefix[f, held] * sigmoid(z[held] / t_fold[f])
        base[held] = fold_prefix[f, held] * sigmoid(z[held])
    return t_fold, pred, base


def _gain_intervals(pred: np.ndarray, base: np.ndarray, y: np.ndarray, group: np.ndarray, n_bins: int,
                    resamples: int, level: float, seed: int) -> tuple[list[float], list[float]]:
    """[lo, hi] of ECE(base) − ECE(pred) and of Brier(base) − Brier(pred) over one seeded bootstrap
    of the groups (the same multinomial group weights for both): per group the signed residual sums
    per bin (n_b·|p̄_b − ȳ_b| = |Σ_b (p − y)|) and the summed squared errors. pred, base, y, group: [n]."""
    _, g = np.unique(group, return_inverse=True)
    g = g.ravel()
    n_groups = int(g.max()) + 1

    def sums(p: np.ndarray) -> np.ndarray:  # [groups, n_bins]
        out = np.zeros((n_groups, n_bins))
        np.add.at(out, (g, bin_index(p, n_bins)), p - y)
        return out

    count = np.bincount(g, minlength=n_groups).astype(np.float64)
    sq_gain = np.bincount(g, weights=(base - y) ** 2 - (pred - y) ** 2, minlength=n_groups)  # [groups]
    w = np.random.default_rng(seed).multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=resamples)
    n = w @ count  # rounds per resample, [B]
    ece_gain = (np.abs(w @ sums(base)).sum(axis=1) - np.abs(w @ sums(pred)).sum(axis=1)) / n
    brier_gain = (w @ sq_gain) / n
    alpha = (1.0 - level) / 2.0
    return ([float(np.quantile(ece_gain, alpha)), float(np.quantile(ece_gain, 1.0 - alpha))],
            [float(np.quantile(brier_gain, alpha)), float(np.quantile(brier_gain, 1.0 - alpha))])


def _brier(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((pred - y) ** 2))


def _scores(pred: np.ndarray, y: np.ndarray, n_bins: int) -> tuple[float, float, float]:
    """(ECE, Brier, log-loss) of predictions pred [n] against labels y [n]."""
    return _ece(pred, y, n_bins), _brier(pred, y), float(np.mean(log_loss_values(pred, y)))


_SCORE_KEYS = ("ece", "brier", "log_loss")


def _fit_position(z: np.ndarray, prefix: np.ndarray, y: np.ndarray, n_bins: int, grid: np.ndarray,
                  guard: dict[str, Any], cross: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
                  ) -> tuple[float, dict[str, Any]]:
    """T_k for one position from its n verified rounds, and the record of why.

    z, prefix, y: [n]; cross: ``_cross_fit``'s (t_fold, pred, base) at this position, None when there
    is no held-out check. Record keys: rounds, accepted, rejected, t_argmin (the plain STS choice);
    ece / brier / log_loss of prefix·σ(z/T) in-sample at T = 1 (``*_t1``) and at t_argmin
    (``*_argmin``); of the cross-fitted predictions (``*_held_out``) and of the same rounds at T_k = 1
    (``*_held_out_t1``) when ``cross`` is given (None otherwise); gain_ci and brier_gain_ci (intervals
    of ece_held_out_t1 − ece_held_out and brier_held_out_t1 − brier_held_out) when the check ran; and
    kept (None when T_k = t_argmin, else the reason T_k stayed 1). ``guard``: min_events, check
    (folds ≥ 2), group ([n] ids), resamples, level, seed."""
    n, n_acc = int(y.size), int(y.sum())
    info: dict[str, Any] = {"rounds": n, "accepted": n_acc, "rejected": n - n_acc, "t_argmin": 1.0}
    for suffix in ("t1", "argmin", "held_out", "held_out_t1"):
        info.update({f"{key}_{suffix}": None for key in _SCORE_KEYS})
    info.update(gain_ci=None, brier_gain_ci=None, kept=None)
    if n == 0:
        info["kept"] = "no round verified this position"
        return 1.0, info
    t_star = _argmin_temperature(z, prefix, y, grid, n_bins)
    for suffix, pred in (("t1", prefix * sigmoid(z)), ("argmin", prefix * sigmoid(z / t_star))):
        info.update(zip((f"{key}_{suffix}" for key in _SCORE_KEYS), _scores(pred, y, n_bins)))
    info["t_argmin"] = t_star
    if cross is not None:
        for suffix, pred in (("held_out", cross[1]), ("held_out_t1", cross[2])):
            info.update(zip((f"{key}_{suffix}" for key in _SCORE_KEYS), _scores(pred, y, n_bins)))
    if t_star == 1.0:
        return 1.0, info
    min_events = guard["min_events"]
    for count, what in ((n_acc, "accepted"), (n - n_acc, "rejected")):
        if count < min_events:
            info["kept"] = f"{count} {what} prefix{'' if count == 1 else 'es'} < min_events={min_events}"
            return 1.0, info
    if guard["check"]:
        if cross is None:
            info["kept"] = "one group (request) only: no held-out fold to check on"
            return 1.0, info
        (lo, hi), bci = _gain_intervals(cross[1], cross[2], y, guard["group"], n_bins, guard["resamples"],
                                        guard["level"], guard["seed"])
        info["gain_ci"] = [lo, hi]
        info["brier_gain_ci"] = bci
        if not lo > 0:
            info["kept"] = (f"held-out ECE gain over T = 1 is {info['ece_held_out_t1'] - info['ece_held_out']:.3g}, "
                            f"its {guard['level']:.0%} interval [{lo:.3g}, {hi:.3g}] reaches 0")
            return 1.0, info
        if not bci[0] > 0:
            info["kept"] = (f"held-out Brier gain over T = 1 is {info['brier_held_out_t1'] - info['brier_held_out']:.3g}, "
                            f"its {guard['level']:.0%} interval [{bci[0]:.3g}, {bci[1]:.3g}] reaches 0")
            return 1.0, info
    return t_star, info


def fit_temperatures(
    z: np.ndarray, label: np.ndarray, valid: np.ndarray, grid: np.ndarray, n_bins: int,
    min_events: int = 0, folds: int = 0, groups: Optional[Any] = None, seed: int = 0,
    resamples: int = 1000, level: float = 0.95,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Sequential Temperature Scaling with the guards of the module docstring (docs/scheduling.md).

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
    n_folds = 0 if fold is None else int(fold.max()) + 1 if fold.size else 0
    temps = np.ones(gamma, dtype=np.float64)
    prefix = np.ones(n, dtype=np.float64)  # Π_{i<k} c'_i
    fold_prefix = np.ones((n_folds, n), dtype=np.float64)  # row f: Π_{i<k} σ(z_i/T_i^(−f))
    records = []
    for k in range(gamma):
        rows = valid[:, k]
        zk, yk = z[rows, k], label[rows, k].astype(np.float64)
        cross = None
        if fold is not None and np.unique(fold[rows]).size >= 2:
            cross = _cross_fit(zk, yk, fold_prefix[:, rows], fold[rows], grid, n_bins)
        guard = {"min_events": min_events, "check": fold is not None, "group": group[rows],
                 "resamples": resamples, "level": level, "seed": seed}
        temps[k], info = _fit_position(zk, prefix[rows], yk, n_bins, grid, guard, cross)
        records.append({"position": k + 1, "temperature": float(temps[k]), **info})
        prefix = prefix * sigmoid(z[:, k] / temps[k])
        if cross is not None:
            if temps[k] != 1.0:  # a kept position has T_k^(−f) = 1 in every fold (docs/scheduling.md)
                fold_prefix[:, rows] *= sigmoid(zk[None, :] / cross[0][:, None])
            else:
                fold_prefix[:, rows] *= sigmoid(zk)[None, :]
    return temps, records
