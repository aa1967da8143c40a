"""Confidence quality metrics (paper Section 4.3.3): binned ECE, ROC-AUC, Brier score and log-loss per draft position.

- ``ece_from_residuals``: the binned ECE from per-bin sums of signed residuals; ``ece``, ``ece_from_sums``
  and the temperature search of STS (``dspark.scheduling.sts``) all compute their ECE with it.
- ``ece``, ``roc_auc``, ``brier``, ``log_loss``, ``reliability_bins``: one set of predictions against
  binary labels (20 equal-width ECE bins, rank-based ROC-AUC).
- ``prefix_labels``, ``cumulative_confidence``, ``confidence_metrics``, ``conditional_metrics``: the
  quality of a_k = Π_{i≤k} c_i (and of c_k itself) at each position k.
- ``ece_sums``, ``ece_from_sums``: ECE per position as a function of per-request sums, for bootstrap
  intervals over requests.

Shapes: N rounds, γ draft positions. ``conf`` [N, γ] holds the per-position conditional confidences c_k
(not cumulative); ``accepted`` [N] the accepted draft tokens m of each round (bonus token excluded);
``proposed`` [N] the number ℓ of draft tokens that were verified (γ when the scheduler is off).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "CLIP",
    "bin_index",
    "binned_residuals",
    "brier",
    "conditional_metrics",
    "confidence_metrics",
    "cumulative_confidence",
    "ece",
    "ece_from_residuals",
    "ece_from_sums",
    "ece_sums",
    "log_loss",
    "log_loss_values",
    "prefix_labels",
    "reliability_bins",
    "roc_auc",
]

CLIP = 1e-6  # probabilities are clipped to [CLIP, 1 − CLIP] before a logit or a log


def bin_index(p: np.ndarray, n_bins: int) -> np.ndarray:
    # Bins [i/n, (i+1)/n); the value 1.0 joins the last bin.
    return np.minimum((p * n_bins).astype(np.int64), n_bins - 1)


def binned_residuals(pred: np.ndarray, label: np.ndarray, n_bins: int) -> np.ndarray:
    """Σ_{i∈b} (p_i − y_i) in each equal-width bin b of p, per row: pred float64 [G, n] (G sets of
    predictions of the same n labels), label [n] -> [G, n_bins]. ``pred`` is overwritten (scratch):
    one weighted bincount over the [G, n_bins] flattened bins serves every row."""
    G = pred.shape[0]
    idx = bin_index(pred, n_bins)  # [G, n]
    idx += (np.arange(G) * n_bins)[:, None]
    pred -= label[None, :]  # in place: pred is a scratch array owned by the caller
    per_bin = np.bincount(idx.ravel(), weights=pred.ravel(), minlength=G * n_bins)
    return per_bin.reshape(G, n_bins)


def ece_from_residuals(residuals: Any, count: Any) -> np.ndarray:
    """Binned expected calibration error Σ_b (n_b/N)·|mean pred_b − mean label_b| from the per-bin
    sums of signed residuals r_b = Σ_{i∈b} (p_i − y_i), [..., n_bins], and N, the number of
    predictions ([...] or a number): Σ_b |r_b| / N, since n_b·|p̄_b − ȳ_b| = |r_b|. NaN where N = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs(residuals).sum(axis=-1) / count


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
    ``n_bins`` equal-width bins on [0, 1] (1.0 falls in the last bin), ``ece_from_residuals``. NaN when
    empty."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p, y = _pred_label(pred, label)
    if p.size == 0:
        return float("nan")
    return float(ece_from_residuals(binned_residuals(p[None, :].copy(), y, n_bins), p.size)[0])


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


def log_loss_values(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-prediction log-loss −y·log p − (1 − y)·log(1 − p), p clipped to [1e-6, 1 − 1e-6] so that a
    confident miss costs at most log(1e6) ≈ 13.8 nats instead of infinity (the same clip as ``logit``)."""
    p = np.clip(pred, CLIP, 1.0 - CLIP)
    return -(y * np.log(p) + (1.0 - y) * np.log1p(-p))


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
    return ece_from_residuals(s[..., :-1], s[..., -1])


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
