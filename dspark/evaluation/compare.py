"""Comparing drafters (`dspark compare`): the paper's Table 1 with intervals, the macro-average
gain of each drafter over each other, and their conditional-acceptance curves in one figure (Fig. 2).

- ``compare_reports``   Table 1 as markdown, one row per drafter (τ per benchmark, Math / Code /
                        Chat / Avg macro averages, "τ [lo, hi]" with the 95 % intervals), the
                        speedups, which pairs' intervals overlap, and the gains below.
- ``paired_markdown``   for reports of the same requests (the folders `dspark eval` wrote), each
                        pair's speedup and τ ratios with paired intervals (``dspark.evaluation.paired``).
- ``macro_gains``       gain of a over b = Avg_a / Avg_b − 1, Avg the macro-average τ (the mean
                        over the benchmarks, Table 1's Avg column): the paper's "+16 % over
                        DFlash" is this number for DSpark over DFlash.
- ``write_comparison``  the markdown and ``<stem>-acceptance.png`` next to it (linked from it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from dspark.bootstrap import intervals_overlap
from dspark.evaluation.markdown import fmt_ci, markdown_table
from dspark.data.benchmarks import DISPLAY_NAMES, TABLE1_ORDER
from dspark.evaluation.metrics import MACRO_COLUMNS, macro_average
from dspark.evaluation.paired import paired_ratio, verdict

PathLike = Union[str, os.PathLike]


def load_report(path: PathLike) -> dict[str, Any]:
    """A report from ``report.json`` or from the folder that holds it."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def compare_reports(reports: Mapping[str, Mapping[str, Any] | PathLike],
                    folders: Mapping[str, PathLike] | None = None) -> str:
    """Table 1 as markdown: one row per drafter (label -> report, report.json or its folder).

    Columns: the nine benchmarks in the paper's order (plus any other
    benchmark a report holds), then Math / Code / Chat / Avg (macro averages
    of τ), each "τ [lo, hi]" with its 95 % interval when the report has one.
    A benchmark a report lacks shows "–". Then, for two drafters or more, the macro-average gain
    of each over each other (`gains_markdown`); when reports hold speedups,
    their macro averages; and for two drafters or more, one row per pair saying
    for each compared number whether the two intervals overlap, then the paired
    ratios of the pairs that share requests (``paired_markdown``; ``folders``:
    label -> the report's folder, default the reports given as paths)."""
    loaded = {label: r if isinstance(r, Mapping) else load_report(r) for label, r in reports.items()}
    if folders is None:
        folders = {label: r for label, r in reports.items() if not isinstance(r, Mapping)}
    columns = _table1_columns(loaded.values())
    cells = {label: _compared_numbers(report) for label, report in loaded.items()}
    text = _numbers_table(cells, columns)
    gains = gains_markdown(loaded) if len(loaded) > 1 else ""
    if gains:
        text += "\n\n" + gains
    speed_columns = [c for c in _SPEED_COLUMNS if any(c in numbers for numbers in cells.values())]
    if speed_columns:
        text += "\n\nSpeedup vs target-only decoding (macro average over benchmarks):\n\n"
        text += _numbers_table(cells, speed_columns)
    if len(loaded) > 1:
        text += "\n\n" + _overlap_table(cells, columns + speed_columns)
    paired = paired_markdown(folders)
    if paired:
        text += "\n\n" + paired
    return text


_SPEED_COLUMNS = ("speedup Avg", "decode speedup Avg")


def _table1_columns(reports: Any) -> list[str]:
    """Table 1's τ columns: the nine benchmarks in the paper's order, any other benchmark, the macro averages."""
    extra = [n for r in reports for n in r["benchmarks"] if n not in TABLE1_ORDER]
    return [DISPLAY_NAMES.get(n, n) for n in [*TABLE1_ORDER, *dict.fromkeys(extra)]] + list(MACRO_COLUMNS.values())


def _compared_numbers(report: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Column name -> (value, [lo, hi] or None) of every number ``compare_reports`` compares."""
    out = {}
    taus = {}
    for name, b in report["benchmarks"].items():
        if b.get("tau") is not None:
            taus[name] = b["tau"]
            out[DISPLAY_NAMES.get(name, name)] = (b["tau"], b.get("tau_ci"))
    macro = report.get("macro") or {}
    tau_ci = macro.get("tau_ci") or {}
    for key, value in macro_average({n: t for n, t in taus.items()}).items():
        out[MACRO_COLUMNS[key]] = (value, tau_ci.get(key))
    for key, column in zip(("speedup", "decode_speedup"), _SPEED_COLUMNS):
        value = (macro.get(key) or {}).get("avg")
        if value is not None and math.isfinite(value):
            out[column] = (value, (macro.get(f"{key}_ci") or {}).get("avg"))
    return out


def _numbers_table(cells: Mapping[str, Mapping[str, tuple[Any, Any]]], columns: Sequence[str]) -> str:
    rows = [[label] + [fmt_ci(*numbers.get(c, (None, None))) for c in columns] for label, numbers in cells.items()]
    return markdown_table(["drafter", *columns], rows)


def _overlap_table(cells: Mapping[str, Mapping[str, tuple[Any, Any]]], columns: Sequence[str]) -> str:
    """One row per pair of drafters: "overlap" or "apart" per compared number ("–" without two
    intervals; columns with no pair of intervals are left out), and a sentence naming the pairs apart."""
    words = {True: "overlap", False: "apart", None: "–"}
    labels = list(cells)
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]]
    verdict = {(a, b, c): intervals_overlap(cells[a].get(c, (None, None))[1], cells[b].get(c, (None, None))[1])
               for a, b in pairs for c in columns}
    shown = [c for c in columns if any(verdict[a, b, c] is not None for a, b in pairs)]
    if not shown:
        return "No two drafters both carry intervals (reports written before them): overlap is not known."
    rows = [[f"{a} vs {b}"] + [words[verdict[a, b, c]] for c in shown] for a, b in pairs]
    apart = [f"{a} vs {b} on {c} ({fmt_ci(*cells[a][c])} vs {fmt_ci(*cells[b][c])})"
             for a, b in pairs for c in shown if verdict[a, b, c] is False]
    summary = ("Intervals apart: " + "; ".join(apart) + ".") if apart else "Every compared pair of intervals overlaps."
    return ("Do the 95 % intervals (over requests) overlap? \"apart\": the difference is larger than the "
            "request-to-request noise; \"overlap\": this check does not separate the two drafters (a conservative "
            "check: overlapping 95 % intervals can still hide a real difference).\n\n"
            + markdown_table(["pair", *shown], rows) + "\n\n" + summary)


def paired_markdown(folders: Mapping[str, PathLike]) -> str:
    """One line per pair of evaluation folders that share requests: the ratio of the first's pooled
    speedup (against its own target-only decodes) to the second's, and of their τ, each with the 95 %
    interval of a bootstrap that resamples the common requests jointly (``dspark.evaluation.paired``), and
    whether it excludes 1. '' when no pair shares requests (or the folders lack their request logs)."""
    labels = list(folders)
    lines = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            try:
                p = paired_ratio(folders[a], folders[b])
            except (OSError, ValueError, KeyError):  # no request logs, or no common requests: nothing to pair
                continue
            speed = "–" if p.speedup is None else f"{_fmt_interval(p.speedup)} ({verdict(p.speedup)})"
            tau = "–" if p.tau is None else f"{_fmt_interval(p.tau)} ({verdict(p.tau)})"
            lines.append(f"- {a} / {b}: speedup ratio {speed}, τ ratio {tau}; {p.common} common requests")
    if not lines:
        return ""
    return ("Paired ratios over the requests both reports decoded (pooled over benchmarks; each speedup against "
            "its own target-only decodes; 95 % interval over requests taken jointly: the jackknife leaves a request "
            "out of both, within each benchmark): an interval that excludes 1 separates the two even where their own "
            "intervals overlap.\n\n" + "\n".join(lines))


def _fmt_interval(interval: Any) -> str:
    return f"{interval.estimate:.3f} [{interval.lo:.3f}, {interval.hi:.3f}]"


# ------------------------------------------------------------------ gains and the figure
def macro_gains(reports: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """(a, b) -> Avg_a / Avg_b − 1 for every ordered pair of drafters with a macro-average τ."""
    avg = {label: _compared_numbers(r).get("Avg", (None, None))[0] for label, r in reports.items()}
    avg = {label: v for label, v in avg.items() if v is not None and math.isfinite(v) and v > 0}
    return {(a, b): avg[a] / avg[b] - 1.0 for a in avg for b in avg if a != b}


def fmt_gain(gain: float) -> str:
    """+16 % / −3 % (a relative change, rounded to a whole percent)."""
    pct = round(100 * gain)
    return f"{'+' if pct >= 0 else '−'}{abs(pct)} %"


def gains_markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    """A table of each drafter's macro-average τ gain over each other, and one sentence per drafter."""
    gains = macro_gains(reports)
    labels = [label for label in reports if any(label == a for a, _ in gains)]
    if len(labels) < 2:
        return ""
    rows = [[a] + ["–" if a == b else fmt_gain(gains[a, b]) for b in labels] for a in labels]
    lines = [", ".join(f"{fmt_gain(gains[a, b])} over {b}" for b in labels if b != a) for a in labels]
    return ("Macro-average τ gain (row over column: Avg_row / Avg_column − 1, Avg = Table 1's macro average over benchmarks):\n\n"
            + markdown_table(["drafter", *(f"over {b}" for b in labels)], rows) + "\n\n"
            + "\n".join(f"- {a}: {line}" for a, line in zip(labels, lines)))


def acceptance_path(out: PathLike) -> Path:
    """Where the figure of a comparison written to ``out`` goes: ``<stem>-acceptance.png`` beside it."""
    out = Path(out)
    return out.with_name(f"{out.stem}-acceptance.png")


def write_comparison(reports: Mapping[str, Mapping[str, Any] | PathLike], out: PathLike,
                     folders: Mapping[str, PathLike] | None = None) -> tuple[Path, Path]:
    """Write the comparison markdown to ``out`` and the conditional-acceptance figure next to it
    (linked from the markdown); returns (markdown path, figure path)."""
    from dspark.evaluation.plots import plot_acceptance_comparison

    if folders is None:
        folders = {label: r for label, r in reports.items() if not isinstance(r, Mapping)}
    loaded = {label: r if isinstance(r, Mapping) else load_report(r) for label, r in reports.items()}
    out = Path(out)
    figure = acceptance_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_acceptance_comparison(loaded, figure)
    text = compare_reports(loaded, folders)
    text += ("\n\nConditional acceptance per draft position, all rounds of every benchmark (paper Fig. 2):\n\n"
             f"![conditional acceptance]({figure.name})\n")
    out.write_text(text)
    return out, figure
