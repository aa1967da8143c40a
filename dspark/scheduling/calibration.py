"""Sequential Temperature Scaling (STS, paper Section 3.2.1): fitting, applying, its JSON, and `dspark calibrate`.

- ``apply_temperatures``, ``fit_sts``, ``fit_sts_explained``: STS itself (the search and its evidence
  guards are ``dspark.scheduling.sts``); ``fit_sts`` warns where a temperature stayed 1 and why.
- ``save_sts_json``, ``load_sts_json``, ``as_temperatures``: the SGLang JSON (``temperatures``,
  ``ece_before``, ``ece_after``).
- ``calibrate_rounds``, ``save_sts_report``: the `dspark calibrate` recipe: STS fitted on part of a
  rounds.jsonl log (split by request, ``split_rounds_by_request``), measured on the rest, and its JSON.
  ``dspark.evaluation.report.write_sts_report`` writes it with its reliability diagrams.

The confidence metrics (ECE, ROC-AUC, Brier, log-loss, per position) are
``dspark.scheduling.calibration_metrics``; those the evaluation reads are importable from here too.
Shapes: ``conf`` [N, γ] conditional confidences c_k, ``accepted`` [N] accepted drafts m (bonus token
excluded), ``proposed`` [N] verified drafts ℓ.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from dspark.bootstrap import DEFAULT_LEVEL, DEFAULT_RESAMPLES, stratified_ci
from dspark.io.jsonsafe import to_jsonable
from dspark.scheduling.calibration_metrics import (
    _as_conf,
    conditional_metrics,
    confidence_metrics,
    ece_from_sums,
    ece_sums,
    prefix_labels,
)
from dspark.scheduling.sts import fit_temperatures, logit, sigmoid

__all__ = [
    "apply_temperatures",
    "as_temperatures",
    "default_temperature_grid",
    "fit_sts",
    "fit_sts_explained",
    "save_sts_json",
    "load_sts_json",
    "split_rounds_by_request",
    "calibrate_rounds",
    "round_arrays",
    "rounds_with_confidences",
    "save_sts_report",
]

PathLike = Union[str, os.PathLike]


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


def fit_sts(conf: Any, accepted: Any, proposed: Any, grid: Optional[Any] = None, n_bins: int = 20, *,
            explain: bool = False, **guards: Any) -> Union[np.ndarray, tuple[np.ndarray, list[Optional[str]]]]:
    """Sequential Temperature Scaling: temperatures T_1..T_γ, float64 [γ] (``fit_sts_explained``, to
    which ``guards`` passes min_events, folds, groups, seed and resamples).

    A guard keeps T_k = 1 where position k's fit rounds carry no evidence for another temperature: fewer
    than ``min_events`` accepted or rejected prefixes, a held-out gain whose interval reaches 0, one
    request only, or no round that verified k. A UserWarning then names each such position and why
    (e.g. "position 2: 0 accepted prefixes < min_events=10"). ``explain=True`` returns (temperatures,
    reasons) instead, and does not warn: reasons[k − 1] says why T_k stayed 1, None where T_k was
    fitted (the argmin, which may itself be 1). ``fit_sts_explained`` gives every position's record."""
    temps, records = fit_sts_explained(conf, accepted, proposed, grid, n_bins, **guards)
    reasons = [record["kept"] for record in records]
    if explain:
        return temps, reasons
    kept = [f"position {k}: {why}" for k, why in enumerate(reasons, 1) if why is not None]
    if kept:
        warnings.warn("fit_sts kept T = 1 where the fit rounds carry no evidence for another temperature: "
                      + "; ".join(kept) + " (fit_sts(..., explain=True) returns the reasons; min_events=0, "
                      "folds=0 is the plain argmin)", UserWarning, stacklevel=2)
    return temps


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


def rounds_with_confidences(rounds: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
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
    fit, test = split_rounds_by_request(rounds_with_confidences(rounds), fit_fraction, seed)
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
