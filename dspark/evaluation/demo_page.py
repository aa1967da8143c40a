"""The summary of a `scripts/demo.sh` run folder: one markdown page (README.md) and a short text.

`dspark summary RUN_DIR` reads what the demo's stages wrote (``dspark.evaluation.demo_runs``) and
says, top to bottom, the results table (the one the repository's README shows), what was trained,
the accepted length τ with its intervals, the calibration, the scheduling table, the simulation,
the time each stage took and where every file is (the sections: ``dspark.evaluation.demo_results``
and ``dspark.evaluation.demo_sections``; their statistical verdicts: ``dspark.evaluation.verdicts``).
Every input is optional: a stage that has not run (or a file without some key) is named as
missing, never an error.

Prompts: every reported number decodes the test part of each benchmark (``eval.split``), STS is
fitted on the dev part (``dspark.data.benchmarks``: the two never share a prompt); the page says
which split each stage decoded, from the reports' own config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.evaluation.demo_results import (results_caption, results_table, sched_rows, sched_section,
                                            simulate_section)
from dspark.evaluation.demo_runs import TAU_KEYS, drafter_order, eval_columns, link, load_run, metric
from dspark.evaluation.demo_sections import (acceptance_rows, acceptance_section, acceptance_table,
                                             calibration_section, drafters_trained, dspark_vs_dflash, files_section,
                                             llamacpp_section, tau_section, tau_table, timings_section,
                                             training_section)
from dspark.evaluation.markdown import fmt_ci, fmt_number
from dspark.evaluation.verdicts import PAIRED_BASELINE, fmt_ratio, paired_rows, paired_verdict
from dspark.io.atomic import atomic_write_text


def summary_markdown(run: Mapping[str, Any]) -> str:
    """The run's README.md: the sections above, with the plots linked relative to the run folder."""
    parts = [
        f"# dspark demo: {run['dir'].name}", "",
        f"SmolLM2-135M-Instruct as the target; {drafters_trained(run)} trained with the same budget, "
        "evaluated against target-only decoding, calibrated, and served under verification policies.",
        "", "## Results", "", results_table(run) or "No evaluation found.", "",
        results_caption(run), "",
        "τ: accepted tokens per round, macro average over the benchmarks, with its 95 % interval over requests "
        "[lo, hi]. R: requests decoded together (one drafter and one target forward per round for all of them). "
        "Speeds: tokens/s against target-only decoding of the same prompts at the same R; the last two columns "
        "serve R requests in the batched serving loop, on the SPS clock (its interval the SPS table's timing "
        "noise) and on the wall clock; the sections below give every number this table is made of.",
        "", "## 1. What was trained", "", training_section(run),
        "", f"Learning curves: {link(run, 'curves.png')}.",
        "", "## 2. Accepted length τ", "", tau_section(run),
        "", "### Conditional acceptance per draft position", "", acceptance_section(run),
        "", "## 3. Calibration of DSpark's confidences", "", calibration_section(run),
        "", "## 4. Scheduled verification", "", sched_section(run),
        "", "## 5. Serving simulation (Fig. 8 analogue)", "", simulate_section(run),
        *(["", "## 5b. llama.cpp beside dspark", "", llamacpp_section(run)] if run.get("llamacpp") else []),
        "", "## 6. Time per stage", "", timings_section(run),
        "", "## 7. Files", "", files_section(run), "",
    ]
    return "\n".join(parts)


def summary_short(run: Mapping[str, Any]) -> str:
    """A few lines for the terminal: training, macro τ, ECE, the scheduling rows, total time."""
    lines = []
    for name, t in sorted(run["training"].items(), key=lambda kv: drafter_order(kv[0])):
        lines.append(f"trained {name}: {fmt_number(t['steps'])} steps, {fmt_number(t['minutes'], 1)} min, "
                     f"held-out τ_prob {fmt_number(t['tau_prob_first'], 3)} -> {fmt_number(t['tau_prob_last'], 3)}")
    for temp, name in eval_columns(run):
        report = run["evals"][(temp, name)]
        lines.append(f"τ macro avg, {name} T={temp}: {fmt_ci(*metric(report.get('macro'), TAU_KEYS, 'avg'))}"
                     f" (speedup {fmt_ci(*metric(report.get('macro'), 'speedup', 'avg'))}x)")
    if run["evals"]:
        lines += ["", "accepted length τ ([lo, hi]: the 95 % interval over requests, where reported):", tau_table(run), ""]
    if acceptance_rows(run):
        lines += ["conditional acceptance per draft position ([lo, hi]: the 95 % interval; rounds reaching k):",
                  acceptance_table(run, last=4), *dspark_vs_dflash(run), ""]
    sts = run["sts"]
    if isinstance(sts, Mapping) and sts.get("ece_before"):
        pairs = [f"{fmt_number(b, 3)}->{fmt_number(a, 3)}" for b, a in zip(sts["ece_before"], sts.get("ece_after", []))]
        lines.append("ECE per position before->after STS: " + " ".join(pairs))
        if sts.get("brier_before"):
            pairs = [f"{fmt_number(b, 3)}->{fmt_number(a, 3)}" for b, a in zip(sts["brier_before"], sts.get("brier_after", []))]
            lines.append("Brier per position before->after STS: " + " ".join(pairs))
    for x in sched_rows(run):
        lines.append(f"{x['policy']:>12} R={x['R']}: τ {fmt_ci(x['tau'], x['tau_ci'])}, mean ℓ {fmt_number(x['mean_ell'])}, "
                     f"wall speedup {fmt_ci(x['speedup'], x['speedup_ci'])}, decode-only {fmt_ci(x['decode_speedup'], x['decode_speedup_ci'])}, "
                     f"batched wall Θ ratio {fmt_ci(x.get('wall_ratio'), x.get('wall_ratio_ci'))}, "
                     f"SPS-clock Θ ratio {fmt_ci(x['theta_ratio'], x['theta_ratio_ci'])}{'' if x['clocks'] == '–' else ' (' + x['clocks'] + ')'}"
                     f", draft/round {fmt_number(x['draft_steps'])} steps")
    if run["sched"]:
        lines.append("(R = 1: wall clock of dspark eval --policy; R > 1: the simulator's SPS clock)")
    elif run["simulate"]:
        lines.append("(every R: the batched serving loop of dspark simulate, on the SPS clock and on the wall clock)")
    for x in paired_rows(run):
        if x["paired"] is not None:
            speed = fmt_ratio(x["paired"].speedup)
            lines.append(f"{x['policy']:>12} / {PAIRED_BASELINE} (paired, R=1): speedup ratio {speed}, "
                         f"{paired_verdict(x['paired'].speedup, PAIRED_BASELINE)}; τ ratio {fmt_ratio(x['paired'].tau)}")
    for line in _llamacpp_short(run):
        lines.append(line)
    if run["timings"]:
        lines.append("minutes per stage: " + ", ".join(f"{k} {float(v) / 60:.1f}" for k, v in run["timings"].items())
                     + f"; total {sum(float(v) for v in run['timings'].values()) / 60:.1f}")
    lines.append(f"files in {run['dir']}: data/, <drafter>/drafter/, eval-T*/<drafter>/ (report.md, rounds.jsonl), "
                 f"sps.json, sts.json, {'sched/<policy>-R1/, ' if run['sched'] else ''}simulate/ (figure8.png); "
                 "README.md lists each")
    return "\n".join(lines)


def _llamacpp_short(run: Mapping[str, Any]) -> list[str]:
    """One line per drafter and temperature of the llama.cpp results (macro estimates only)."""
    results = run.get("llamacpp")
    if not isinstance(results, Mapping):
        return []

    def est(entry: Any, key: str, digits: int = 2) -> str:
        value = ((entry or {}).get(key) or {}).get("macro")
        return fmt_number(value[0], digits) if value else "–"

    lines = []
    for temp, entry in (results.get("temperatures") or {}).items():
        for name, d in entry.get("drafters", {}).items():
            lines.append(f"llama.cpp {name} T={temp}: τ {est(d, 'tau')} (dspark {est(d, 'dspark_tau')}), "
                         f"tok/s {est(entry.get('target'), 'tokens_per_s', 1)} -> {est(d, 'tokens_per_s', 1)} "
                         f"(x{est(d, 'speedup')})")
    return lines


def write_summary(run_dir: str | os.PathLike) -> tuple[Path, str]:
    """Write ``<run_dir>/README.md`` (and curves.png from the training logs when there are any);
    returns its path and the short text."""
    run = load_run(run_dir)
    if run["training"]:
        from dspark.evaluation.plots import plot_learning_curves

        try:
            plot_learning_curves({name: run["dir"] / name for name in run["training"]}, run["dir"] / "curves.png")
        except ValueError:  # a log line cut by a killed run: the page says the plot is missing
            pass
    path = run["dir"] / "README.md"
    atomic_write_text(path, summary_markdown(run))
    return path, summary_short(run)
