"""Every figure of the library, as PNG files (matplotlib is imported inside ``_new_figure`` only).

- ``plot_acceptance``, ``plot_reliability``: an evaluation report's conditional acceptance per
  position (paper Fig. 2) and the reliability of a_k.
- ``acceptance_comparison_figure``, ``plot_acceptance_comparison``: several drafters' conditional
  acceptance, one line each (Fig. 2 of the comparison).
- ``reliability_diagram``, ``reliability_grid``: reliability diagrams of predictions, and of
  a_k = Π_{i≤k} c_i before / after STS per position.
- ``plot_sps``: a profiled SPS(B) table (paper Section 5.2); ``plot_figure8``, ``plot_frontier``:
  the serving simulator (paper Fig. 8 and 7); ``plot_learning_curves``: held-out τ of training runs
  against wall-clock minutes.

docs/evaluation.md (figures): which command writes each file, and how a figure is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from dspark.scheduling.calibration import apply_temperatures
from dspark.scheduling.calibration_metrics import cumulative_confidence, ece, prefix_labels, reliability_bins
from dspark.evaluation.curves import curve, read_log
from dspark.data.benchmarks import DISPLAY_NAMES, DOMAINS, domain_of
from dspark.evaluation.metrics import MACRO_COLUMNS

if TYPE_CHECKING:
    from dspark.scheduling.simulator import SimResult
    from dspark.scheduling.sps_profile import SPSProfile

__all__ = [
    "acceptance_comparison_figure",
    "plot_acceptance",
    "plot_acceptance_comparison",
    "plot_figure8",
    "plot_frontier",
    "plot_learning_curves",
    "plot_reliability",
    "plot_sps",
    "reliability_diagram",
    "reliability_grid",
]

PathLike = Union[str, os.PathLike]


def _new_figure(figsize: tuple[float, float], dpi: float | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig: Any, path: PathLike) -> None:
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)


# ---------------------------------------------------------------------------
# An evaluation report
# ---------------------------------------------------------------------------


def plot_acceptance(report: Mapping[str, Any], path: PathLike) -> None:
    """Conditional acceptance per position, one line per domain and one for all rounds (paper Fig. 2)."""
    gamma = int(report["gamma"])
    k = np.arange(1, gamma + 1)
    fig = _new_figure((5.0, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    curves = [(MACRO_COLUMNS[d], e) for d, e in report["domains"].items()]
    if not curves:  # benchmarks outside the three domains only
        curves = [(DISPLAY_NAMES.get(n, n), e) for n, e in report["benchmarks"].items()]
    for name, entry in curves:
        ys = np.array([np.nan if y is None else y for y in entry["conditional_acceptance"]], dtype=float)
        ax.plot(k, ys, marker="o", label=name)
    ys = np.array([np.nan if y is None else y for y in report["all"]["conditional_acceptance"]], dtype=float)
    ax.plot(k, ys, ls="--", color="gray", label="all")
    ax.set_xticks(k)
    ax.set_xlim(0.7, gamma + 0.3)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(k accepted | 1..k−1 accepted)")
    ax.set_title(f"Conditional acceptance: {report['label']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save_png(fig, path)


def acceptance_comparison_figure(reports: Mapping[str, Mapping[str, Any]]):
    """The figure of several drafters' conditional acceptance P(k accepted | 1..k−1 accepted), over
    all rounds of each report (``report["all"]``), one line per drafter labelled by its name (paper
    Fig. 2: DFlash's decays with k, Eagle3's stays flat), with a vertical bar per position for its
    95 % interval over requests where the report has one (``conditional_acceptance_ci``). Reports of
    different γ share the axes."""
    fig = _new_figure((5.6, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    gamma = 1
    for i, (label, report) in enumerate(reports.items()):
        ys = np.array([np.nan if y is None else y for y in report["all"]["conditional_acceptance"]], dtype=float)
        k = np.arange(1, len(ys) + 1)
        gamma = max(gamma, len(ys))
        (line,) = ax.plot(k, ys, marker="o", label=label)
        lo, hi = _position_intervals(report["all"].get("conditional_acceptance_ci"), len(ys))
        shown = np.isfinite(ys) & np.isfinite(lo) & np.isfinite(hi)
        if shown.any():  # each drafter's bars a little apart, so that overlapping intervals stay readable
            shift = (i - (len(reports) - 1) / 2) * 0.08
            ax.vlines(k[shown] + shift, lo[shown], hi[shown], color=line.get_color(), lw=2.0, alpha=0.6)
    ax.set_xticks(np.arange(1, gamma + 1))
    ax.set_xlim(0.7, gamma + 0.3)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(k accepted | 1..k−1 accepted)")
    ax.set_title("Conditional acceptance per position", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _position_intervals(cis: Any, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-position [lo, hi] of a report's ``conditional_acceptance_ci`` as two arrays of length
    γ (NaN where a position has none, or the report no intervals)."""
    lo, hi = np.full(gamma, np.nan), np.full(gamma, np.nan)
    for j, ci in enumerate((cis or [])[:gamma]):
        if isinstance(ci, (list, tuple)) and len(ci) == 2 and None not in ci:
            lo[j], hi[j] = float(ci[0]), float(ci[1])
    return lo, hi


def plot_acceptance_comparison(reports: Mapping[str, Mapping[str, Any]], path: PathLike) -> None:
    """:func:`acceptance_comparison_figure` written to ``path`` (PNG)."""
    _save_png(acceptance_comparison_figure(reports), path)


def plot_reliability(
    rounds: Sequence[Mapping[str, Any]], gamma: int, path: PathLike, temperatures: Any = None, n_bins: int = 20
) -> None:
    """Reliability diagrams of a_k = Π_{i≤k} c_i per position k.

    With STS temperatures: before/after curves over all rounds
    (``reliability_grid``). Without: one curve per domain."""
    with_conf = [r for r in rounds if r["confidences"] is not None]
    conf = np.asarray([r["confidences"] for r in with_conf], dtype=np.float64)  # [N, γ]
    accepted = np.asarray([r["accepted"] for r in with_conf])
    proposed = np.asarray([r["proposed"] for r in with_conf])
    if temperatures is not None:
        reliability_grid(conf, apply_temperatures(conf, temperatures), accepted, proposed, path, n_bins=n_bins,
                         title="Prefix survival calibration (before / after STS)")
        return
    label, valid = prefix_labels(accepted, proposed, gamma)
    a = np.cumprod(conf, axis=1)  # [N, γ]
    groups = {"all": np.ones(len(with_conf), dtype=bool)}
    for domain in DOMAINS:
        mask = np.array([domain_of(r["benchmark"]) == domain for r in with_conf], dtype=bool)
        if mask.any():
            groups[MACRO_COLUMNS[domain]] = mask
    cols = min(gamma, 4)
    rows = -(-gamma // cols)
    fig = _new_figure((3.2 * cols, 3.2 * rows))
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        for index, (name, mask) in enumerate(groups.items()):
            v = valid[:, k] & mask
            if not v.any():
                continue
            count, mean_pred, mean_label = reliability_bins(a[v, k], label[v, k], n_bins)
            nz = count > 0
            style = dict(color="gray", ls="--") if name == "all" else dict(color=f"C{index - 1}")
            ax.plot(mean_pred[nz], mean_label[nz], marker="o", ms=3,
                    label=f"{name} ECE={ece(a[v, k], label[v, k], n_bins):.3f}", **style)
        ax.plot([0, 1], [0, 1], ls=":", color="black", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1} (n={int(valid[:, k].sum())})", fontsize=9)
        ax.set_xlabel("predicted a_k")
        ax.set_ylabel("empirical acceptance")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    fig.suptitle("Prefix survival calibration")
    _save_png(fig, path)


# ---------------------------------------------------------------------------
# Reliability diagrams (calibration)
# ---------------------------------------------------------------------------


def _draw_reliability(ax, pred, label, n_bins: int, name: str, color: str) -> float:
    count, mean_pred, mean_label = reliability_bins(pred, label, n_bins)
    e = ece(pred, label, n_bins)
    nz = count > 0
    ax.plot(mean_pred[nz], mean_label[nz], marker="o", ms=3, color=color, label=f"{name} ECE={e:.3f}")
    return e


def _style_axes(ax, title: str) -> None:
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted a_k")
    ax.set_ylabel("empirical acceptance")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left")


def reliability_diagram(
    pred: Any,
    label: Any,
    path: PathLike,
    n_bins: int = 20,
    title: str = "Reliability diagram",
) -> float:
    """Write a PNG reliability diagram (mean label vs mean prediction per bin,
    bar heights = fraction of samples per bin) to ``path``; returns the ECE."""
    count, mean_pred, mean_label = reliability_bins(pred, label, n_bins)
    fig = _new_figure((4.5, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    total = max(count.sum(), 1.0)
    ax.bar(edges[:-1], count / total, width=1.0 / n_bins, align="edge", color="lightgray", label="fraction")
    e = _draw_reliability(ax, pred, label, n_bins, "model", "C0")
    _style_axes(ax, title)
    _save_png(fig, path)
    return e


def reliability_grid(
    conf_before: Any,
    conf_after: Any,
    accepted: Any,
    proposed: Any,
    path: PathLike,
    n_bins: int = 20,
    title: str = "Prefix survival calibration",
) -> None:
    """Write a PNG with one panel per position k: reliability curves of
    a_k = Π_{i≤k} c_i before and after calibration, on rounds that verified k."""
    ab, aa = cumulative_confidence(conf_before), cumulative_confidence(conf_after)  # [N, γ] each
    if ab.shape != aa.shape:
        raise ValueError(f"conf_before {ab.shape} and conf_after {aa.shape} differ in shape")
    gamma = ab.shape[1]
    label, valid = prefix_labels(accepted, proposed, gamma)
    cols = min(gamma, 4)
    rows = -(-gamma // cols)
    fig = _new_figure((3.2 * cols, 3.2 * rows))
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        v = valid[:, k]
        if v.any():
            _draw_reliability(ax, ab[v, k], label[v, k], n_bins, "before", "C3")
            _draw_reliability(ax, aa[v, k], label[v, k], n_bins, "after", "C0")
        _style_axes(ax, f"position {k + 1} (n={int(v.sum())})")
    fig.suptitle(title)
    _save_png(fig, path)


# ---------------------------------------------------------------------------
# SPS profile and serving simulation
# ---------------------------------------------------------------------------


def plot_sps(profile: SPSProfile, path: PathLike, title: str = "") -> None:
    """PNG: steps/s (left) and tokens/s = B · steps/s (right) against B (log scale): the
    medians with their 95 % intervals, and on the left the noise-aware table the scheduler uses."""
    fig = _new_figure((9.0, 3.6))
    xs = profile.batch_tokens
    sps = profile.steps_per_sec
    lo, hi = zip(*profile.steps_per_sec_interval)
    for index, scale in enumerate(((1,) * len(xs), xs)):
        ax = fig.add_subplot(1, 2, index + 1)
        ys = [k * s for k, s in zip(scale, sps)]
        err = [[k * (s - a) for k, s, a in zip(scale, sps, lo)], [k * (b - s) for k, s, b in zip(scale, sps, hi)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label="median, 95 % interval")
        if index == 0:
            ax.plot(xs, profile.table.sample_steps_per_sec, color="0.4", linestyle="--",
                    label="table (rises within the noise flattened)")
            ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch tokens B")
        ax.set_ylabel("steps / s  (SPS)" if index == 0 else "tokens / s")
        ax.grid(alpha=0.3)
    layout = "one sequence" if profile.tokens_per_request is None else f"{profile.tokens_per_request} tokens/request"
    fig.suptitle(title or f"Target verification speed ({profile.device}, {profile.dtype}, {profile.threads} threads, "
                 f"context {profile.context_len}, {layout}, {profile.repeats} interleaved sweeps)", fontsize=9)
    _save_png(fig, path)


def _by_policy(results: Sequence[SimResult]) -> dict[str, list[SimResult]]:
    groups: dict[str, list[SimResult]] = {}
    for r in results:
        groups.setdefault(r.policy, []).append(r)
    return {p: sorted(rs, key=lambda r: r.concurrency) for p, rs in groups.items()}


def plot_figure8(results: Sequence[SimResult], path: PathLike, title: str = "") -> None:
    """Paper Fig. 8 as a PNG: throughput Θ (top) and target tokens per request 1 + ℓ (bottom)
    against concurrency, one line per policy."""
    fig = _new_figure((6.0, 6.4))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2, sharex=None)
    for index, (policy, rs) in enumerate(_by_policy(results).items()):
        xs = [r.concurrency for r in rs]
        style = dict(marker="o", color=f"C{index}", label=policy)
        top.plot(xs, [r.throughput for r in rs], **style)
        bottom.plot(xs, [r.budget_tokens for r in rs], **style)
    ticks = sorted({r.concurrency for r in results})
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(alpha=0.3)
        ax.set_xlabel("concurrent requests R")
    top.set_ylabel("throughput Θ (tokens / simulated s)")
    bottom.set_ylabel("budget 1 + ℓ (tokens/request/step)")
    bottom.set_ylim(bottom=0)
    top.legend(fontsize=8)
    top.set_title(title or "Load-adaptive throughput and verification budget (cf. paper Fig. 8)", fontsize=9)
    _save_png(fig, path)


def plot_frontier(results: Sequence[SimResult], path: PathLike) -> None:
    """Paper Fig. 7 as a PNG: throughput against per-user speed, one line per policy (points = R)."""
    fig = _new_figure((5.5, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    for index, (policy, rs) in enumerate(_by_policy(results).items()):
        ax.plot([r.tokens_per_s_per_user for r in rs], [r.throughput for r in rs], marker="o",
                color=f"C{index}", label=policy)
        for r in rs:
            ax.annotate(f"R={r.concurrency}", (r.tokens_per_s_per_user, r.throughput), fontsize=6)
    ax.set_xlabel("tokens / simulated s / user")
    ax.set_ylabel("throughput Θ (tokens / simulated s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Throughput vs per-user speed (cf. paper Fig. 7)", fontsize=9)
    _save_png(fig, path)


# ---------------------------------------------------------------------------
# Training runs
# ---------------------------------------------------------------------------


def plot_learning_curves(runs: Mapping[str, PathLike], path: PathLike, key: str = "eval_tau_prob") -> None:
    """One line per run: `key` (default held-out τ_probabilistic) against wall-clock minutes.
    The format follows the extension of ``path`` (PNG, PDF, SVG, ...)."""
    fig = _new_figure((6.4, 4.2), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, run_dir) in enumerate(runs.items()):
        pts = curve(read_log(run_dir), key)
        if pts:  # the colour cycle has 10 colours: the next 10 runs dashed, then dotted
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label,
                    linestyle=("-", "--", ":")[min(i // 10, 2)])
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out τ (probabilistic)" if key == "eval_tau_prob" else key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2 if len(runs) > 6 else 1)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
