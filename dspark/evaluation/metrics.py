"""Draft-quality metrics over round logs (paper Section 4: τ, Table 1; acceptance, Fig. 2; confidence, Section 4.3.3).

Pure functions of round records, one line of ``rounds.jsonl`` each (``round_tau`` says what its keys
mean); τ counts the bonus token (paper Section 4.1):

- ``round_tau``, ``tau_pooled``   τ of one round (m + 1, or m after an accepted EOS); its mean over all rounds
- ``tau_per_request``            τ averaged within each request, then over requests
- ``conditional_acceptance``     P(k accepted | 1..k−1 accepted, k verified), paper Fig. 2
- ``prefix_survival``            P(m ≥ k);  ``verify_rate``: mean ℓ/γ;  ``acceptance_rate``: Σm / Σℓ
- ``confidence_quality``         ECE (20 bins) / ROC-AUC / Brier of a_k = Π_{i≤k} c_i against 1[first k accepted]
- ``summarize_rounds``           all of the above for one benchmark or domain
- ``macro_average(_array)``      the Math / Code / Chat / Avg columns of Table 1 (the array form over a
                                 trailing benchmark axis; leading axes: resamples or deletions)

Their 95 % intervals over requests: ``dspark.evaluation.intervals``; benchmarks and domains: ``dspark.data.benchmarks``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dspark.data.benchmarks import BENCHMARKS, DOMAINS, domain_of
# Views of the benchmark table, re-exported for the modules that read them from here.
from dspark.data.benchmarks import DISPLAY_NAMES as DISPLAY_NAMES, TABLE1_ORDER as TABLE1_ORDER
from dspark.scheduling.calibration import apply_temperatures
from dspark.scheduling.calibration_metrics import confidence_metrics

ECE_BINS = 20

# The macro columns of Table 1, in the order ``macro_average_array`` returns them, and their headers.
MACRO_KEYS: tuple[str, ...] = (*DOMAINS, "avg")
MACRO_COLUMNS: dict[str, str] = {key: key.capitalize() for key in MACRO_KEYS}


# ---------------------------------------------------------------------------
# Per-round quantities. Inputs are 1-D sequences over rounds.
# ---------------------------------------------------------------------------


def _counts(accepted: Any, proposed: Any, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(m, ℓ) as int64 [N], checked: 0 ≤ m ≤ ℓ ≤ γ."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1 (the drafter's block size), got {gamma!r}")
    m = np.asarray(accepted, dtype=np.int64).ravel()
    ell = np.asarray(proposed, dtype=np.int64).ravel()
    if m.shape != ell.shape:
        raise ValueError(f"accepted has {m.size} rounds but proposed has {ell.size}")
    if m.size and (m.min() < 0 or np.any(m > ell) or ell.max() > gamma):
        bad = int(np.flatnonzero((m < 0) | (m > ell) | (ell > gamma))[0])
        raise ValueError(
            f"round {bad} has accepted={int(m[bad])}, proposed={int(ell[bad])}; every round needs "
            f"0 <= accepted <= proposed <= gamma={gamma} (accepted counts draft tokens only, not the bonus)"
        )
    return m, ell


def round_tau(row: Mapping[str, Any]) -> int:
    """τ of one round record: m + 1, or m when it accepted an EOS (no token follows it).

    A round record is a mapping with the keys of one line of ``rounds.jsonl`` (written by
    ``dspark.evaluation.evaluate``)::

        {"benchmark": "gsm8k", "request": 3, "round": 0,
         "proposed": 7, "accepted": 4, "confidences": [0.9, ...] or None,
         "eos_accepted": false}

    ``proposed`` is ℓ, the number of draft tokens sent to verification (γ with the scheduler off);
    ``accepted`` is m ≤ ℓ, the accepted draft tokens (the bonus token excluded); ``confidences`` are
    c_1..c_γ (conditional, not cumulative), or None for a drafter without a confidence head.
    ``eos_accepted`` (absent = false) marks a round that accepted an EOS draft: it ended the sequence
    with no token after it, so its τ is m, and its ``proposed`` stops at the EOS (m = ℓ: nothing after
    it was verified or rejected), as DeepSpec's evaluator counts it."""
    return int(row["accepted"]) + (0 if row.get("eos_accepted") else 1)


def _taus(accepted: Any, eos_accepted: Any) -> np.ndarray:
    """τ per round, float64 [N]: m + 1, minus 1 where an accepted EOS ended the round."""
    m = np.asarray(accepted, dtype=np.float64).ravel()
    if eos_accepted is None:
        return m + 1.0
    eos = np.asarray(eos_accepted, dtype=bool).ravel()
    if eos.shape != m.shape:
        raise ValueError(f"accepted has {m.size} rounds but eos_accepted has {eos.size}")
    return m + 1.0 - eos


def tau_pooled(accepted: Any, eos_accepted: Any = None) -> float:
    """Mean τ over all rounds (NaN without rounds): τ = m + 1, or m in a round
    whose ``eos_accepted`` is true (default: no such round)."""
    tau = _taus(accepted, eos_accepted)
    return float(tau.mean()) if tau.size else math.nan


def tau_per_request(accepted: Any, request_ids: Any, eos_accepted: Any = None) -> float:
    """Mean over requests of each request's mean τ (NaN without rounds); τ as in ``tau_pooled``.

    Requests without a round (ended at the prefill token) have no τ and do
    not count."""
    m = _taus(accepted, eos_accepted)
    ids = list(request_ids)
    if len(ids) != m.size:
        raise ValueError(f"accepted has {m.size} rounds but request_ids has {len(ids)}")
    if not ids:
        return math.nan
    sums: dict[Any, float] = {}
    counts: dict[Any, int] = {}
    for rid, value in zip(ids, m):
        sums[rid] = sums.get(rid, 0.0) + value
        counts[rid] = counts.get(rid, 0) + 1
    return float(np.mean([sums[r] / counts[r] for r in sums]))


def conditional_acceptance_counts(accepted: Any, proposed: Any, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(numerator, denominator) of the conditional acceptance, each int64 [γ].

    denominator[k-1]: rounds with m ≥ k−1 (positions 1..k−1 accepted) and
    ℓ ≥ k (position k was verified); numerator[k-1]: those with m ≥ k. Kept
    as counts so that benchmarks and ranks pool exactly."""
    m, ell = _counts(accepted, proposed, gamma)
    k = np.arange(1, gamma + 1)
    reached = (m[:, None] >= k[None, :] - 1) & (ell[:, None] >= k[None, :])  # [N, γ]
    passed = m[:, None] >= k[None, :]  # [N, γ], implies reached
    return passed.sum(axis=0), reached.sum(axis=0)


def conditional_acceptance(accepted: Any, proposed: Any, gamma: int) -> list[float]:
    """P(position k accepted | positions 1..k−1 accepted and k verified), k = 1..γ (paper Fig. 2).

    NaN at positions no round reached."""
    num, den = conditional_acceptance_counts(accepted, proposed, gamma)
    return [float(n / d) if d else math.nan for n, d in zip(num, den)]


def prefix_survival(accepted: Any, gamma: int) -> list[float]:
    """Fraction of rounds with m ≥ k, k = 1..γ (NaN without rounds).

    Over all rounds, verified or not: a round that verified ℓ < k drafts did
    not accept k of them."""
    m = np.asarray(accepted, dtype=np.int64).ravel()
    if not m.size:
        return [math.nan] * gamma
    return [float(np.mean(m >= k)) for k in range(1, gamma + 1)]


def verify_rate(proposed: Any, gamma: int) -> float:
    """Mean verified length over γ: mean(ℓ) / γ (1.0 with the scheduler off)."""
    ell = np.asarray(proposed, dtype=np.float64).ravel()
    return float(ell.mean() / gamma) if ell.size else math.nan


def acceptance_rate(accepted: Any, proposed: Any) -> float:
    """Accepted over verified draft tokens, Σm / Σℓ (NaN when nothing was verified)."""
    total = float(np.sum(np.asarray(proposed, dtype=np.float64)))
    return float(np.sum(np.asarray(accepted, dtype=np.float64)) / total) if total else math.nan


def confidence_quality(
    confidences: Sequence[Sequence[float] | None],
    accepted: Any,
    proposed: Any,
    temperatures: Any = None,
    n_bins: int = ECE_BINS,
) -> list[dict[str, float]] | None:
    """Per-position quality of a_k = Π_{i≤k} c_i against 1[first k accepted] (paper Section 4.3.3).

    Rounds without confidences are left out; None if no round has them.
    ``temperatures`` (γ STS temperatures, paper Section 3.2.1) are applied to c first.
    Returns ``dspark.scheduling.calibration.confidence_metrics``: one dict per position
    with position, count, ece, auroc, brier, mean_pred, mean_label."""
    keep = [i for i, c in enumerate(confidences) if c is not None]
    if not keep:
        return None
    conf = np.asarray([confidences[i] for i in keep], dtype=np.float64)  # [N, γ]
    if temperatures is not None:
        conf = apply_temperatures(conf, temperatures)
    m = np.asarray(accepted).ravel()[keep]
    ell = np.asarray(proposed).ravel()[keep]
    return confidence_metrics(conf, m, ell, n_bins=n_bins)


# ---------------------------------------------------------------------------
# Summaries over round records
# ---------------------------------------------------------------------------


def summarize_rounds(
    rounds: Iterable[Mapping[str, Any]],
    gamma: int,
    temperatures: Any = None,
) -> dict[str, Any]:
    """Every metric above of a set of round records (one benchmark, a domain, or all).

    Requests are told apart by (benchmark, request). Keys: num_rounds,
    num_requests, tau, tau_per_request, conditional_acceptance (γ floats),
    conditional_acceptance_num / _den (γ counts), prefix_survival (γ),
    verify_rate, acceptance_rate, confidence (per-position dicts or None), and
    confidence_calibrated when ``temperatures`` is given.
    """
    rounds = list(rounds)
    accepted = [int(r["accepted"]) for r in rounds]
    proposed = [int(r["proposed"]) for r in rounds]
    requests = [(r.get("benchmark"), r["request"]) for r in rounds]
    confidences = [r.get("confidences") for r in rounds]
    eos = [bool(r.get("eos_accepted", False)) for r in rounds]
    num, den = conditional_acceptance_counts(accepted, proposed, gamma)
    summary: dict[str, Any] = {
        "num_rounds": len(rounds),
        "num_requests": len(set(requests)),
        "tau": tau_pooled(accepted, eos),
        "tau_per_request": tau_per_request(accepted, requests, eos),
        "conditional_acceptance": [float(n / d) if d else math.nan for n, d in zip(num, den)],
        "conditional_acceptance_num": [int(n) for n in num],
        "conditional_acceptance_den": [int(d) for d in den],
        "prefix_survival": prefix_survival(accepted, gamma),
        "verify_rate": verify_rate(proposed, gamma),
        "acceptance_rate": acceptance_rate(accepted, proposed),
        "confidence": confidence_quality(confidences, accepted, proposed),
    }
    if temperatures is not None:
        summary["confidence_calibrated"] = confidence_quality(confidences, accepted, proposed, temperatures)
    return summary


def macro_average(values: Mapping[str, float]) -> dict[str, float]:
    """Table 1's domain columns from per-benchmark values.

    math / code / chat: the mean over that domain's benchmarks present in
    ``values``; avg: the mean over all present benchmarks of the table (equal to the
    mean of the three domain means when all nine are there). NaN where no
    benchmark is present; NaN values are skipped; other names are ignored."""
    def mean(names: Iterable[str]) -> float:
        xs = [float(values[n]) for n in names if n in values and not math.isnan(float(values[n]))]
        return float(np.mean(xs)) if xs else math.nan

    extra = [n for n in values if n not in BENCHMARKS and domain_of(n) is not None]
    out = {domain: mean([*names, *(n for n in extra if domain_of(n) == domain)]) for domain, names in DOMAINS.items()}
    out["avg"] = mean([*BENCHMARKS, *extra])
    return out


def macro_average_array(values: Any, names: Sequence[str]) -> np.ndarray:
    """``macro_average`` of many rows at once: values [..., G] over the benchmarks ``names``
    -> [..., 4], the columns of ``MACRO_KEYS``. NaN values are skipped; a column
    with no finite member is NaN; names without a domain are ignored."""
    v = np.asarray(values, dtype=np.float64)
    if v.shape[-1] != len(names):
        raise ValueError(f"values have {v.shape[-1]} benchmarks but names has {len(names)}")
    domains = [domain_of(n) for n in names]
    out = []
    for key in MACRO_KEYS:
        cols = [i for i, d in enumerate(domains) if d is not None and (key == "avg" or d == key)]
        picked = v[..., cols]
        finite = np.isfinite(picked)
        total = np.where(finite, picked, 0.0).sum(axis=-1)
        count = finite.sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            out.append(np.where(count > 0, total / np.maximum(count, 1), np.nan))
    return np.stack(out, axis=-1)
