"""Confidence quality metrics and Sequential Temperature Scaling (STS).

Where each piece of the paper lives:

- ``ece``, ``roc_auc``, ``brier``   the metrics of paper Section 4.3.3 (20 equal-width ECE
                                    bins, rank-based ROC-AUC, Brier score).
- ``log_loss``                      mean log-loss, a proper scoring rule reported
                                    next to the (improper) binned ECE.
- ``prefix_labels``                 label 1[first k accepted] and its validity
                                    mask from accepted / verified lengths.
- ``confidence_metrics``            per-position quality of a_k = Π_{i≤k} c_i.
- ``apply_temperatures``, ``fit_sts``, ``fit_sts_explained``, ``save_sts_json``,
  ``load_sts_json``                 STS (paper Section 3.2.1; the
                                    search and its evidence guards in
                                    ``dspark.scheduling.sts``) and its SGLang JSON
                                    (``temperatures``, ``ece_before``, ``ece_after``).
- ``ece_sums``, ``ece_from_sums``  ECE per position as a function of per-request
                                    sums, for bootstrap intervals over requests.
- ``calibrate_rounds``, ``save_sts_report``
                                    the `dspark calibrate` recipe: STS fitted
                                    on part of a rounds.jsonl log (split by
                                    request), measured on the rest, and its
                                    JSON. ``dspark.evaluation.report.write_sts_report``
                                    writes it with its reliability diagrams
                                    (``dspark.evaluation.plots``).

Shapes: N rounds, γ draft positions. ``conf`` [N, γ] holds the per-position
conditional confidences c_k (not cumulative); ``accepted`` [N] the accepted
draft tokens m of each round (bonus token excluded); ``proposed`` [N] the
number ℓ of draft tokens that were verified (γ when the scheduler is off).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from dspark.bootstrap import DEFAULT_LEVEL, DEFAULT_RESAMPLES, stratified_ci
from dspark.io.jsonsafe import to_jsonable
from dspark.scheduling.sts import bin_index, fit_temperatures, log_loss_values, logit, sigmoid

__all__ = [
    "ece",
    "roc_auc",
    "brier",
    "log_loss",
    "reliability_bins",
    "prefix_labels",
    "cumulative_confidence",
    "confidence_metrics",
    "ece_from_sums",
    "ece_sums",
    "apply_temperatures",
    "default_temperature_grid",
    "fit_sts",
    "fit_sts_explained",
    "save_sts_json",
    "load_sts_json",
    "conditional_metrics",
    "split_rounds_by_request",
    "calibrate_rounds",
    "round_arrays",
    "save_sts_report",
]

PathLike = Union[str, os.PathLike]


# ----------------------------------------------------------------------------
# Metrics (paper Section 4.3.3, Figure 6)
# ----------------------------------------------------------------------------


def _pred_label(pred: Any, label: Any) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(pred, dtype=np.float64).ravel()
    y = np.asarray(label, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"pred has {p.size} entries but label has {y.size}")
    if p.size and not (np.isfinite(p).all() and p.min() >= 0.0 and p.max() <= 1.0):
        raise ValueError("pred must be probabilities in [0, 1]")
    if p.size and not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("label must be binary (0/1 or False/True)")
    return p, y


def reliability_bins(pred: Any, label: Any, n_bins: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-width bins on [0, 1]: (count, mean_pred, mean_label), each [n_bins];
    means are NaN for empty bins."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p, y = _pred_label(pred, label)
    idx = bin_index(p, n_bins)
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(idx, weights=p, minlength=n_bins) / count
        mean_label = np.bincount(idx, weights=y, minlength=n_bins) / count
    return count, mean_pred, mean_label


def ece(pred: Any, label: Any, n_bins: int = 20) -> float:
    """Expected calibration error: Σ_b (n_b/N)·|mean pred_b − mean label_b| over
    ``n_bins`` equal-width bins on [0, 1] (1.0 falls in the last bin). NaN when
    empty."""
    count, mean_pred, mean_label = reliability_bins(pred, label, n_bins)
    total = count.sum()
    if total == 0:
        return float("nan")
    nz = count > 0
    return float(np.sum(count[nz] * np.abs(mean_pred[nz] - mean_label[nz])) / total)


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x with ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    # Start index of each run of equal values in sorted order.
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def roc_auc(pred: Any, label: Any) -> float:
    """ROC-AUC via the Mann-Whitney U statistic with midranks for ties: the
    probability that a random positive scores above a random negative, ties
    counting one half. NaN when only one class is present."""
    p, y = _pred_label(pred, label)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _midranks(p)
    u = ranks[y == 1.0].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(pred: Any, label: Any) -> float:
    """Mean squared error between probabilities and binary labels. NaN when empty."""
    p, y = _pred_label(pred, label)
    if p.size == 0:
        return float("nan")
    return float(np.mean((p - y) ** 2))


def log_loss(pred: Any, label: Any) -> float:
    """Mean log-loss −[y·log p + (1 − y)·log(1 − p)] in nats. p is clipped to [1e-6, 1 − 1e-6]
    (the clip of ``apply_temperatures``), so a prediction of exactly 0 or 1 that misses costs
    log(1e6) ≈ 13.8 nats instead of infinity. NaN when empty."""
    p, y = _pred_label(pred, label)
    if p.size == 0:
        return float("nan")
    return float(np.mean(log_loss_values(p, y)))


# ----------------------------------------------------------------------------
# Labels and per-position metrics
# ----------------------------------------------------------------------------


def _rounds(accepted: Any, proposed: Any, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(accepted).ravel()
    ell = np.asarray(proposed).ravel()
    if m.shape != ell.shape:
        raise ValueError(f"accepted has {m.size} rounds but proposed has {ell.size}")
    if m.size and not (np.all(m == np.round(m)) and np.all(ell == np.round(ell))):
        raise ValueError("accepted and proposed must be integer counts")
    m = m.astype(np.int64)
    ell = ell.astype(np.int64)
    if m.size and (m.min() < 0 or np.any(m > ell) or ell.max() > gamma):
        raise ValueError(
            f"need 0 <= accepted <= proposed <= gamma={gamma} in every round; "
            "accepted counts draft tokens only (exclude the bonus token)"
        )
    return m, ell


def prefix_labels(accepted: Any, proposed: Any, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and validity for the prefix-survival prediction, both bool [N, γ].

    label[n, k-1] = 1[accepted_n ≥ k] (the first k draft tokens were accepted);
    valid[n, k-1] = (k ≤ proposed_n): positions that were not verified have no
    label.
    """
    m, ell = _rounds(accepted, proposed, gamma)
    k = np.arange(1, gamma + 1)
    label = m[:, None] >= k[None, :]
    valid = k[None, :] <= ell[:, None]
    return label, valid


def _as_conf(conf: Any) -> np.ndarray:
    if hasattr(conf, "detach"):  # torch tensor, without importing torch here
        conf = conf.detach().cpu().double().numpy()
    c = np.asarray(conf, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"conf must have shape [N, gamma], got shape {c.shape}")
    if c.size and not (np.isfinite(c).all() and c.min() >= 0.0 and c.max() <= 1.0):
        raise ValueError("conf must hold per-position probabilities in [0, 1]")
    return c


def cumulative_confidence(conf: Any) -> np.ndarray:
    """a_k = Π_{i≤k} c_i, [N, γ]."""
    return np.cumprod(_as_conf(conf), axis=1)


def confidence_metrics(
    conf: Any, accepted: Any, proposed: Any, n_bins: int = 20
) -> list[dict[str, float]]:
    """Per-position quality of the prefix-survival prediction (paper Section 4.3.3).

    For each position k = 1..γ, over the rounds with k ≤ proposed: prediction
    a_k = Π_{i≤k} c_i, label 1[first k accepted]. Returns one dict per
    position with keys position (1-based), count, ece, auroc, brier,
    log_loss, mean_pred, mean_label (NaN where undefined).
    """
    c = _as_conf(conf)
    gamma = c.shape[1]
    a = np.cumprod(c, axis=1)
    label, valid = prefix_labels(accepted, proposed, gamma)
    if label.shape[0] != c.shape[0]:
        raise ValueError(f"conf has {c.shape[0]} rounds but accepted has {label.shape[0]}")
    out = []
    for k in range(gamma):
        p = a[valid[:, k], k]
        y = label[valid[:, k], k]
        out.append(_position_metrics(k + 1, p, y, n_bins))
    return out


def _position_metrics(position: int, p: np.ndarray, y: np.ndarray, n_bins: int) -> dict[str, float]:
    """ECE / ROC-AUC / Brier / log-loss and the means of predictions p against labels y at one position."""
    return {
        "position": position,
        "count": int(p.size),
        "ece": ece(p, y, n_bins),
        "auroc": roc_auc(p, y),
        "brier": brier(p, y),
        "log_loss": log_loss(p, y),
        "mean_pred": float(p.mean()) if p.size else float("nan"),
        "mean_label": float(y.mean()) if y.size else float("nan"),
    }


def ece_sums(conf: Any, accepted: Any, proposed: Any, groups: Any, n_groups: int, n_bins: int = 20) -> np.ndarray:
    """Per group g (a request) and position k: the sums that ECE_k is a function of,
    float64 [G, γ, n_bins + 1]: in each bin b of a_k = Π_{i≤k} c_i the signed
    residual Σ (a_k − 1[first k accepted]) over the group's rounds that verified
    k, and in the last column their count. Because n_b·|p̄_b − ȳ_b| = |Σ_{i∈b}(p_i − y_i)|,
    ``ece_from_sums`` of the sum over any set of groups is the ECE of their rounds.
    groups: [N] ints in [0, n_groups), the group of each round."""
    c = _as_conf(conf)
    gamma = c.shape[1]
    a = np.cumprod(c, axis=1)  # [N, γ]
    label, valid = prefix_labels(accepted, proposed, gamma)
    g = np.asarray(groups, dtype=np.int64).ravel()
    if not (label.shape[0] == c.shape[0] == g.size):
        raise ValueError(f"conf has {c.shape[0]} rounds, accepted {label.shape[0]}, groups {g.size}")
    out = np.zeros((n_groups, gamma, n_bins + 1), dtype=np.float64)
    rows, k = np.nonzero(valid)
    np.add.at(out, (g[rows], k, bin_index(a[rows, k], n_bins)), a[rows, k] - label[rows, k])
    np.add.at(out, (g[rows], k, n_bins), 1.0)
    return out


def ece_from_sums(sums: Any) -> np.ndarray:
    """ECE per position from ``ece_sums`` summed over groups: [..., γ, n_bins + 1] -> [..., γ]
    (NaN at a position with no round)."""
    s = np.asarray(sums, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs(s[..., :-1]).sum(axis=-1) / s[..., -1]


# ----------------------------------------------------------------------------
# Sequential Temperature Scaling (paper Section 3.2.1)
# ----------------------------------------------------------------------------


def apply_temperatures(conf: Any, temps: Any) -> np.ndarray:
    """c'_k = σ(logit(c_k)/T_k) per position, [N, γ].

    c is clipped to [1e-6, 1 − 1e-6] before the logit, so exact 0/1 map to
    finite logits (and values within 1e-6 of 0 or 1 collapse together)."""
    c = _as_conf(conf)
    t = _as_temperatures(temps, c.shape[1])
    return sigmoid(logit(c) / t[None, :])


def _as_temperatures(temps: Any, gamma: Optional[int] = None, name: str = "temperatures") -> np.ndarray:
    """`temps` as a float64 vector of γ finite, positive temperatures (errors say `name`)."""
    t = np.asarray(temps, dtype=np.float64).ravel()
    if gamma is not None and t.size != gamma:
        raise ValueError(f"{name} has {t.size} values but there are {gamma} positions (the drafter's γ)")
    if not (np.isfinite(t).all() and np.all(t > 0)):
        raise ValueError(f"{name} must be finite and > 0, got {t.tolist()}")
    return t


def as_temperatures(value: Any, gamma: Optional[int] = None, name: str = "temperatures") -> np.ndarray:
    """STS temperatures given as values or as the path of an STS JSON (``load_sts_json``)."""
    if isinstance(value, (str, os.PathLike)):
        return load_sts_json(value, gamma)
    return _as_temperatures(value, gamma, name)


def default_temperature_grid() -> np.ndarray:
    """301 geometrically spaced temperatures from 0.05 to 20, plus exactly 1.0."""
    return np.unique(np.append(np.geomspace(0.05, 20.0, 301), 1.0))


DEFAULT_MIN_EVENTS = 10  # accepted and rejected prefixes a position needs before T_k may leave 1
DEFAULT_FOLDS = 5  # request folds of the held-out check on T_k (dspark.scheduling.sts; 0 = no check)


def fit_sts(conf: Any, accepted: Any, proposed: Any, grid: Optional[Any] = None, n_bins: int = 20,
            **guards: Any) -> np.ndarray:
    """Sequential Temperature Scaling: temperatures T_1..T_γ, float64 [γ]; ``fit_sts_explained``
    (whose keywords min_events, folds, groups, seed ``guards`` passes on) without its records."""
    return fit_sts_explained(conf, accepted, proposed, grid, n_bins, **guards)[0]


def fit_sts_explained(
    conf: Any,
    accepted: Any,
    proposed: Any,
    grid: Optional[Any] = None,
    n_bins: int = 20,
    min_events: int = DEFAULT_MIN_EVENTS,
    folds: int = DEFAULT_FOLDS,
    groups: Optional[Any] = None,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Sequential Temperature Scaling: (temperatures float64 [γ], one record per position).

    For k = 1..γ in order, picks T_k from ``grid`` (default
    ``default_temperature_grid()``) minimizing the ECE of
    Π_{i<k} c'_i · σ(logit(c_k)/T_k) against 1[first k accepted] over the
    rounds that verified position k, with T_1..T_{k−1} already fixed. Among
    equal-ECE candidates the one closest to T = 1 (in log scale) wins. A
    position with no valid round keeps T = 1.

    Guards (``dspark.scheduling.sts``): T_k keeps 1 unless position k has ``min_events``
    accepted and ``min_events`` rejected prefixes, and (``folds`` = K ≥ 2) the cross-fitted
    held-out predictions (every temperature up to k fitted without each of K seeded folds dealt
    by ``groups``, [N] request ids, None = by round) beat T_k = 1 in both ECE and Brier score,
    each gain with a 95 % bootstrap interval (``resamples`` over the groups) above 0.
    ``min_events=0, folds=0`` is the plain ECE argmin of the paper. Each record:
    position, temperature, rounds, accepted, rejected, t_argmin; ece / brier / log_loss at
    T = 1 and at the argmin in-sample (``ece_t1``, ``brier_argmin``, …) and of the held-out
    predictions and of T_k = 1 on the same held-out prefixes (``ece_held_out``,
    ``log_loss_held_out_t1``, …; None without folds); gain_ci, brier_gain_ci; kept (None, or
    why T_k stayed 1).
    """
    c = _as_conf(conf)
    gamma = c.shape[1]
    label, valid = prefix_labels(accepted, proposed, gamma)
    if label.shape[0] != c.shape[0]:
        raise ValueError(f"conf has {c.shape[0]} rounds but accepted has {label.shape[0]}")
    if min_events < 0 or folds < 0 or folds == 1:
        raise ValueError(f"need min_events >= 0 and folds = 0 (no check) or >= 2, got {min_events}, {folds}")
    if groups is not None and np.asarray(groups).size != c.shape[0]:
        raise ValueError(f"groups has {np.asarray(groups).size} entries but there are {c.shape[0]} rounds")
    grid_t = default_temperature_grid() if grid is None else _as_temperatures(grid)
    return fit_temperatures(logit(c), label, valid, grid_t, n_bins, int(min_events), int(folds), groups, int(seed),
                            int(resamples), DEFAULT_LEVEL)


def _json_number(x: Any) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None



def save_sts_json(
    path: PathLike,
    temps: Any,
    ece_before: Sequence[float],
    ece_after: Sequence[float],
    per_position: Optional[Any] = None,
) -> None:
    """Write the STS result in the SGLang interop format.

    Fields: ``temperatures`` (γ floats), ``ece_before`` and ``ece_after`` (γ
    floats, per position), and, when given, ``per_position`` (e.g.
    ``{"before": confidence_metrics(...), "after": confidence_metrics(...)}``).
    Non-finite numbers are written as null.
    """
    t = _as_temperatures(temps)
    gamma = t.size
    for name, values in (("ece_before", ece_before), ("ece_after", ece_after)):
        if len(values) != gamma:
            raise ValueError(f"{name} has {len(values)} values but temperatures has {gamma}")
    data: dict[str, Any] = {
        "temperatures": [float(v) for v in t],
        "ece_before": [_json_number(v) for v in ece_before],
        "ece_after": [_json_number(v) for v in ece_after],
    }
    if per_position is not None:
        data["per_position"] = to_jsonable(per_position)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def save_sts_report(path: PathLike, report: Mapping[str, Any]) -> None:
    """Write a ``calibrate_rounds`` report as the STS JSON: its keys in order (the SGLang
    fields ``temperatures``, ``ece_before``, ``ece_after`` first, then evaluated_on, split,
    per_position). Non-finite numbers are written as null."""
    data = dict(report)
    _as_temperatures(data["temperatures"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(data), f, indent=2)
        f.write("\n")


def load_sts_json(path: PathLike, gamma: Optional[int] = None) -> np.ndarray:
    """Temperatures float64 [γ] from an STS JSON; checks they are finite, > 0
    and, when ``gamma`` is given, that there are γ of them."""
    with open(path, "r", encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from e
    if not isinstance(data, Mapping) or "temperatures" not in data:
        raise ValueError(f"{os.fspath(path)} has no 'temperatures' field")
    values = data["temperatures"]
    if not isinstance(values, list) or not values:
        raise ValueError(f"'temperatures' in {os.fspath(path)} must be a non-empty list")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"'temperatures' in {os.fspath(path)} must hold numbers, got {values}")
    return _as_temperatures(values, gamma)


# ----------------------------------------------------------------------------
# STS from a round log (the `dspark calibrate` recipe)
# ----------------------------------------------------------------------------

_REQUEST_KEYS = ("benchmark", "policy", "concurrency", "request")


def conditional_metrics(conf: Any, accepted: Any, proposed: Any, n_bins: int = 20) -> list[dict[str, float]]:
    """Per-position quality of the conditional confidence c_k itself (not the product).

    For k = 1..γ, over the rounds that verified k and accepted the first k−1:
    prediction c_k, label 1[k accepted]. Keys as in ``confidence_metrics``.
    A per-position temperature is strictly increasing in c_k, so STS leaves
    this AUROC unchanged at every k (the AUROC of a_k only at k = 1)."""
    c = _as_conf(conf)
    gamma = c.shape[1]
    m, ell = _rounds(accepted, proposed, gamma)
    if m.shape[0] != c.shape[0]:
        raise ValueError(f"conf has {c.shape[0]} rounds but accepted has {m.shape[0]}")
    out = []
    for k in range(1, gamma + 1):
        rows = (ell >= k) & (m >= k - 1)
        p, y = c[rows, k - 1], m[rows] >= k
        out.append(_position_metrics(k, p, y, n_bins))
    return out


def split_rounds_by_request(
    rounds: Sequence[Mapping[str, Any]], fit_fraction: float = 0.5, seed: int = 0
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """(fit, test) rounds, split by request so that no request has rounds on both sides.

    A request is identified by the keys benchmark / policy / concurrency / request
    present in its rows (plus ``source``, when rounds from several files are
    pooled). A seeded shuffle of the requests puts round(fit_fraction · n) of them
    (at least 1, and at most n − 1 when fit_fraction < 1) in the fit part."""
    if not 0.0 < float(fit_fraction) <= 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    keys: dict[tuple, int] = {}
    for index, row in enumerate(rounds):
        if "request" not in row:
            raise ValueError(f"round {index} has no 'request' field: {dict(row)!r:.160}; expected a rounds.jsonl row")
        keys.setdefault(tuple(row.get(k) for k in ("source", *_REQUEST_KEYS)), len(keys))
    n = len(keys)
    if n == 0:
        raise ValueError("no rounds to split")
    if fit_fraction < 1.0 and n < 2:
        raise ValueError(f"only one request in the log: cannot hold out a test part (fit_fraction={fit_fraction}); "
                         "pass fit_fraction=1 or log more requests")
    n_fit = min(max(1, round(float(fit_fraction) * n)), n if fit_fraction >= 1.0 else n - 1)
    order = np.random.default_rng(seed).permutation(n)
    fit_ids = set(order[:n_fit].tolist())
    fit, test = [], []
    for row in rounds:
        key = keys[tuple(row.get(k) for k in ("source", *_REQUEST_KEYS))]
        (fit if key in fit_ids else test).append(row)
    return fit, test


def round_arrays(rounds: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(conf float64 [N, γ], accepted int64 [N], proposed int64 [N]) of rounds.jsonl rows with confidences."""
    conf = np.asarray([r["confidences"] for r in rounds], dtype=np.float64)  # [N, γ]
    accepted = np.asarray([r["accepted"] for r in rounds], dtype=np.int64)
    proposed = np.asarray([r["proposed"] for r in rounds], dtype=np.int64)
    return conf, accepted, proposed


def _rounds_with_confidences(rounds: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows that carry confidences, all of one width (one drafter)."""
    with_conf = [r for r in rounds if r.get("confidences") is not None]
    if not with_conf:
        raise ValueError("no round has confidences: the log comes from a drafter without a confidence head")
    widths = {len(r["confidences"]) for r in with_conf}
    if len(widths) != 1:
        raise ValueError(
            f"rounds have confidences of different lengths {sorted(widths)}; calibrate one drafter at a time"
        )
    return with_conf


def _request_ids(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per row, the index of its request in order of first appearance (stable across processes,
    unlike hash(), so seeded folds and resamples repeat)."""
    ids: dict[tuple, int] = {}
    return [ids.setdefault(tuple(r.get(k) for k in ("source", *_REQUEST_KEYS)), len(ids)) for r in rows]


def calibrate_rounds(
    rounds: Sequence[Mapping[str, Any]],
    fit_fraction: float = 0.5,
    seed: int = 0,
    n_bins: int = 20,
    grid: Optional[Any] = None,
    resamples: int = DEFAULT_RESAMPLES,
    min_events: int = DEFAULT_MIN_EVENTS,
    folds: int = DEFAULT_FOLDS,
) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    """Fit STS on part of a round log and measure it on the held-out rest.

    ``rounds``: rows of rounds.jsonl (``dspark eval`` or ``dspark simulate``);
    rows without confidences are dropped. The requests are split with
    ``split_rounds_by_request``; ``fit_sts_explained`` runs on the fit part with
    ``min_events`` and ``folds`` (dealt by request, seeded with ``seed``, ``resamples``
    bootstrap resamples for the held-out gain): the
    report's ``kept`` says per position why T_k stayed 1 (None where it was
    fitted) and ``sts_fit`` holds those settings and the per-position records.

    Returns (report, evaluated rows). The report holds the SGLang fields ``temperatures``, ``ece_before``,
    ``ece_after`` (per position, ECE of a_k on the test part, on the fit part
    when fit_fraction = 1), ``evaluated_on`` ("test" or "fit"), ``split``
    (requests and rounds per part, fit_fraction, seed) and ``per_position``:
    for "test" and "fit", ``before`` / ``after`` (``confidence_metrics`` of
    a_k) and ``conditional_before`` / ``conditional_after``
    (``conditional_metrics`` of c_k). Every ECE of a_k carries ``ece_ci``, a 95 %
    bootstrap interval over the part's requests (``resamples`` resamples, seeded
    with ``seed``), and so do ``ece_before`` / ``ece_after`` (``ece_before_ci``,
    ``ece_after_ci``: one [lo, hi] per position); ``brier_before`` / ``brier_after`` and
    ``log_loss_before`` / ``log_loss_after`` give the proper scores of a_k per position on the same
    part (binned ECE alone is not a proper scoring rule: collapsing predictions into few bins can
    lower it without predicting better). ``sts_fit.positions`` holds the fit-part record of each
    position (``dspark.scheduling.sts``): ECE, Brier and log-loss at T = 1, at the argmin and of
    the cross-fitted held-out predictions. ``bootstrap`` records
    resamples, seed and level. The rows are those the headline metrics
    were measured on (the test part, or the fit part when fit_fraction = 1)."""
    fit, test = split_rounds_by_request(_rounds_with_confidences(rounds), fit_fraction, seed)
    conf, accepted, proposed = round_arrays(fit)
    temps, records = fit_sts_explained(conf, accepted, proposed, grid, n_bins, min_events, folds,
                                       _request_ids(fit), seed, resamples)

    per_position = {part: _part_metrics(rows, temps, n_bins, resamples, seed)
                     for part, rows in (("fit", fit), ("test", test)) if rows}
    evaluated_on = "test" if test else "fit"
    main = per_position[evaluated_on]

    def requests(rows: Sequence[Mapping[str, Any]]) -> int:
        return len(set(_request_ids(rows)))

    return {
        "temperatures": [float(t) for t in temps],
        "ece_before": [p["ece"] for p in main["before"]],
        "ece_after": [p["ece"] for p in main["after"]],
        "kept": [r["kept"] for r in records],
        "ece_before_ci": [p["ece_ci"] for p in main["before"]],
        "ece_after_ci": [p["ece_ci"] for p in main["after"]],
        "brier_before": [p["brier"] for p in main["before"]],
        "brier_after": [p["brier"] for p in main["after"]],
        "log_loss_before": [p["log_loss"] for p in main["before"]],
        "log_loss_after": [p["log_loss"] for p in main["after"]],
        "evaluated_on": evaluated_on,
        "split": {"fit_fraction": float(fit_fraction), "seed": int(seed), "fit_requests": requests(fit),
                  "test_requests": requests(test), "fit_rounds": len(fit), "test_rounds": len(test)},
        "per_position": per_position,
        "sts_fit": {"min_events": int(min_events), "folds": int(folds), "seed": int(seed), "positions": records},
        "bootstrap": {"resamples": int(resamples), "seed": int(seed), "level": DEFAULT_LEVEL},
    }, (test if test else fit)


def _part_metrics(
    rows: Sequence[Mapping[str, Any]], temps: np.ndarray, n_bins: int, resamples: int, seed: int
) -> dict[str, Any]:
    """before / after / conditional_before / conditional_after of one part (ECE, AUROC, Brier,
    log-loss per position, ``_position_metrics``); a_k's ECE with its ece_ci."""
    c, m, ell = round_arrays(rows)
    calibrated = apply_temperatures(c, temps)
    out = {
        "before": confidence_metrics(c, m, ell, n_bins),
        "after": confidence_metrics(calibrated, m, ell, n_bins),
        "conditional_before": conditional_metrics(c, m, ell, n_bins),
        "conditional_after": conditional_metrics(calibrated, m, ell, n_bins),
    }
    for name, values in (("before", c), ("after", calibrated)):
        for entry, ci in zip(out[name], _ece_intervals(rows, values, m, ell, n_bins, resamples, seed)):
            entry["ece_ci"] = ci
    return out


def _ece_intervals(
    rows: Sequence[Mapping[str, Any]], conf: np.ndarray, accepted: np.ndarray, proposed: np.ndarray, n_bins: int,
    resamples: int, seed: int,
) -> list[list[float]]:
    """[lo, hi] of the ECE of a_k per position, a bootstrap over the requests of ``rows``."""
    groups = _request_ids(rows)
    sums = ece_sums(conf, accepted, proposed, groups, max(groups) + 1, n_bins)  # [requests, γ, n_bins + 1]
    _, lo, hi = stratified_ci([sums], lambda s: ece_from_sums(s.sum(axis=-3)), resamples=resamples, seed=seed,
                              scale="logit")
    return [[float(a), float(b)] for a, b in zip(lo, hi)]
