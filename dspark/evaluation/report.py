"""What the recipes report: the numbers, their markdown, and the files they are written to.

- evaluation (``dspark.evaluation.evaluate``): ``build_report`` turns per-request and per-round records
  into the report dict, ``report_markdown`` into report.md (Table 1, per-benchmark details, conditional
  acceptance per position as in Fig. 2, confidence quality per position), and ``write_outputs`` writes
  rounds.jsonl (one line per draft/verify round: benchmark, request, round, proposed ℓ, accepted m,
  confidences c_1..c_γ or null, eos_accepted; the log STS and the scheduler are fitted on offline),
  requests.jsonl, report.json, report.md, acceptance.png and reliability.png (drafters with a confidence
  head). Table 1 of several drafters: ``compare_reports`` and ``load_report`` (``dspark.evaluation.compare``).
  A scheduled evaluation's speed and round costs: ``dspark.evaluation.scheduled_report``.
- serving simulation (``dspark.scheduling.simulator``): ``results_markdown``, ``write_results``.
- STS calibration (``dspark.scheduling.calibration.calibrate_rounds``): ``calibration_markdown``,
  ``write_sts_report``; SPS profiling (``dspark.scheduling.sps_profile``): ``write_profile``.

Figures come from ``dspark.evaluation.plots``; numbers and tables are formatted by ``dspark.evaluation.markdown``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from dspark.bootstrap import DEFAULT_RESAMPLES, MIN_REQUESTS, MIN_ROUNDS
from dspark.scheduling.calibration import apply_temperatures, round_arrays, save_sts_report
from dspark.evaluation.compare import _compared_numbers, _numbers_table, _table1_columns, compare_reports, load_report
from dspark.evaluation.intervals import add_intervals
from dspark.io.atomic import atomic_file, atomic_write_text
from dspark.io.jsonl import write_jsonl
from dspark.io.jsonsafe import to_jsonable
from dspark.evaluation.markdown import fmt_ci, fmt_number, markdown_table
from dspark.data.benchmarks import DISPLAY_NAMES, DOMAINS, domain_of
from dspark.evaluation.metrics import MACRO_COLUMNS, macro_average, summarize_rounds
from dspark.evaluation.plots import plot_acceptance, plot_figure8, plot_frontier, plot_reliability, plot_sps, reliability_grid
from dspark.evaluation.scheduled_report import scheduled_markdown, sum_phases

if TYPE_CHECKING:
    from dspark.scheduling.simulator import SimResult
    from dspark.scheduling.sps_profile import SPSProfile

__all__ = [
    "build_report",
    "calibration_markdown",
    "compare_reports",
    "load_report",
    "report_markdown",
    "results_markdown",
    "write_outputs",
    "write_profile",
    "write_results",
    "write_sts_report",
]

PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------------
# The evaluation report (pure)
# ---------------------------------------------------------------------------


def build_report(
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    *,
    gamma: int,
    label: str,
    config: Mapping[str, Any] | None = None,
    skipped: Sequence[str] = (),
    temperatures: Any = None,
    bootstrap_resamples: int | None = None,
    bootstrap_seed: int | None = None,
) -> dict[str, Any]:
    """The report dict from per-request records and per-round records.

    Keys: label, gamma, config, skipped, benchmarks (name -> metrics),
    domains (math/code/chat -> metrics pooled over the domain's rounds, plus
    its benchmarks and their macro τ), all (metrics pooled over every round),
    macro (Table 1's Math/Code/Chat/Avg of τ, τ per request and speedup),
    timings, bootstrap. Metric keys are those of ``dspark.evaluation.metrics.summarize_rounds``;
    benchmarks also carry tokens, wall times, throughputs and the speedup.
    The compared numbers carry a 95 % interval over requests ``x_ci`` (``dspark.evaluation.intervals``);
    the ECE's is a bootstrap with ``bootstrap_resamples`` resamples (default:
    config["run"]["eval"]["bootstrap_resamples"], else 1000) seeded with
    ``bootstrap_seed`` (default: config["seed"], the evaluation's eval.seed, else 0).
    """
    names = list(dict.fromkeys(r["benchmark"] for r in records))
    by_name: dict[str, list[Mapping[str, Any]]] = {n: [] for n in names}
    for r in rounds:
        by_name.setdefault(r["benchmark"], []).append(r)

    benchmarks: dict[str, Any] = {}
    for name in names:
        mine = [r for r in records if r["benchmark"] == name]
        entry = {"domain": domain_of(name), **summarize_rounds(by_name[name], gamma, temperatures)}
        entry["num_requests"] = len(mine)
        entry.update(_speed(mine))
        benchmarks[name] = entry

    everything = summarize_rounds(rounds, gamma, temperatures)
    everything["num_requests"] = len(records)
    everything.update(_speed(records))

    macro = {
        key: macro_average({n: b[key] for n, b in benchmarks.items() if b.get(key) is not None})
        for key in ("tau", "tau_per_request", "speedup", "decode_speedup")
    }
    report = {
        "label": label,
        "gamma": gamma,
        "config": dict(config or {}),
        "skipped": list(skipped),
        "benchmarks": benchmarks,
        "domains": _domains(benchmarks, by_name, gamma, temperatures),
        "all": everything,
        "macro": macro,
        "timings": _timings(records),
    }
    resamples, seed = _bootstrap_settings(config or {}, bootstrap_resamples, bootstrap_seed)
    return add_intervals(report, records, rounds, resamples=resamples, seed=seed, temperatures=temperatures)


def _bootstrap_settings(config: Mapping[str, Any], resamples: int | None, seed: int | None) -> tuple[int, int]:
    """(resamples, seed) of the intervals: the arguments, else eval.bootstrap_resamples and
    eval.seed as the evaluation recorded them in its config, else 1000 and 0."""
    if resamples is None:
        run = config.get("run") or {}
        resamples = (run.get("eval") or {}).get("bootstrap_resamples", DEFAULT_RESAMPLES)
    if seed is None:
        seed = config.get("seed")
    return int(resamples), int(seed or 0)


def _domains(
    benchmarks: Mapping[str, Any], by_name: Mapping[str, list[Mapping[str, Any]]], gamma: int, temperatures: Any
) -> dict[str, Any]:
    """Per domain present: the metrics pooled over its benchmarks' rounds, and their macro τ."""
    domains: dict[str, Any] = {}
    for domain, members in DOMAINS.items():
        present = [n for n in members if n in benchmarks]
        if not present:
            continue
        pooled = [r for n in present for r in by_name[n]]
        entry = {"benchmarks": present, **summarize_rounds(pooled, gamma, temperatures)}
        entry["num_requests"] = sum(benchmarks[n]["num_requests"] for n in present)
        entry["tau_macro"] = float(np.mean([benchmarks[n]["tau"] for n in present]))
        domains[domain] = entry
    return domains


def _timings(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Seconds spent decoding, in all and per phase, speculatively and (if run) by the baseline."""
    timings: dict[str, Any] = {
        "spec_s": float(sum(r["wall_s"] for r in records)),
        "spec_phases_s": sum_phases(r.get("timings", {}) for r in records),
    }
    if any("baseline_wall_s" in r for r in records):
        timings["baseline_s"] = float(sum(r.get("baseline_wall_s", 0.0) for r in records))
        timings["baseline_phases_s"] = sum_phases(r.get("baseline_timings", {}) for r in records)
    return timings


def _speed(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Tokens, wall time and throughput of the speculative and baseline decodes.

    speedup = (spec tokens / spec seconds) / (baseline tokens / baseline seconds):
    a throughput ratio, because the two decodes of a prompt sample different
    continuations and can stop at different lengths."""
    tokens = sum(int(r["tokens"]) for r in records)
    wall = sum(float(r["wall_s"]) for r in records)
    out: dict[str, Any] = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else math.nan,
    }
    if records and all("baseline_wall_s" in r for r in records):
        base_tokens = sum(int(r["baseline_tokens"]) for r in records)
        base_wall = sum(float(r["baseline_wall_s"]) for r in records)
        out["baseline_tokens"] = base_tokens
        out["baseline_wall_s"] = base_wall
        out["baseline_tokens_per_s"] = base_tokens / base_wall if base_wall > 0 else math.nan
        ratio = out["tokens_per_s"] / out["baseline_tokens_per_s"] if out["baseline_tokens_per_s"] else math.nan
        out["speedup"] = ratio
        out.update(_decode_speed(records))
    return out


def _decode_speed(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The same throughput ratio without the prefills: tokens after the first (which both
    decodes take from their prefill) per second of decoding. What the round/step cost of
    `bench/decode_round.py` predicts; the wall-clock speedup tends to it for long outputs.
    Empty when a record lacks its prefill time."""
    if not all("prefill" in r.get("timings", {}) and "prefill" in r.get("baseline_timings", {}) for r in records):
        return {}
    spec_tokens = sum(max(0, int(r["tokens"]) - 1) for r in records)
    spec_s = sum(float(r["wall_s"]) - float(r["timings"]["prefill"]) for r in records)
    base_tokens = sum(max(0, int(r["baseline_tokens"]) - 1) for r in records)
    base_s = sum(float(r["baseline_wall_s"]) - float(r["baseline_timings"]["prefill"]) for r in records)
    if min(spec_tokens, spec_s, base_tokens, base_s) <= 0:
        return {}
    return {"decode_speedup": (spec_tokens / spec_s) / (base_tokens / base_s)}


# ---------------------------------------------------------------------------
# The evaluation report as markdown
# ---------------------------------------------------------------------------


def report_markdown(report: Mapping[str, Any]) -> str:
    """``report.md``: Table 1 row, per-benchmark details, conditional acceptance, confidence quality."""
    lines = _settings_lines(report)
    lines += [
        "",
        "## Accepted length τ per round, bonus token included (Table 1)",
        "",
        _numbers_table({report["label"]: _compared_numbers(report)}, _table1_columns([report])),
        "",
        "## Per benchmark",
        "",
        _benchmark_table(report),
    ]
    lines += _position_tables(report)
    lines += ["", "## Confidence quality per position (all rounds)", ""]
    lines += _confidence_lines(report["all"])
    if report.get("scheduled"):
        lines += scheduled_markdown(report["scheduled"])
    return "\n".join(lines) + "\n"


def _settings_lines(report: Mapping[str, Any]) -> list[str]:
    """The title, the run's settings and the benchmarks skipped."""
    cfg = report.get("config", {})
    lines = [
        f"# Evaluation: {report['label']}",
        "",
        f"target `{cfg.get('target')}` ({cfg.get('dtype', 'dtype not recorded')}), γ = {int(report['gamma'])}, "
        f"T = {cfg.get('temperature')}, "
        f"max_new_tokens = {cfg.get('max_new_tokens')}, seed = {cfg.get('seed')}, "
        f"split = {cfg.get('split', 'all')}, "
        f"scheduler = {cfg.get('scheduler') or 'off (ℓ = γ)'}, ranks = {cfg.get('world_size', 1)}.",
    ]
    if report.get("skipped"):
        lines += ["", f"Skipped (file missing): {', '.join(report['skipped'])}."]
    boot = report.get("bootstrap")
    if boot:
        lines += ["", f"x [lo, hi]: the {100 * boot['level']:g} % interval over requests, stratified by benchmark "
                      "(τ and speedups: the jackknife on the log scale, Student's t at Σ (requests − 1) degrees of "
                      "freedom; rates and conditional acceptance: Wilson on effective counts, none below "
                      f"{MIN_ROUNDS} rounds or {MIN_REQUESTS} requests; ECE: a bootstrap, {boot['resamples']} "
                      f"resamples, seed {boot['seed']}; `dspark.bootstrap`)."]
    return lines


def _benchmark_table(report: Mapping[str, Any]) -> str:
    """One row per benchmark and one for all: counts, τ, rates, throughput (and the speedups)."""
    has_base = any("speedup" in b for b in report["benchmarks"].values())
    header = ["benchmark", "requests", "rounds", "tokens", "τ pooled", "τ per request",
              "verify rate", "accept rate", "tok/s"]
    if has_base:
        header += ["baseline tok/s", "speedup", "decode speedup"]
    rows = []
    for name, b in list(report["benchmarks"].items()) + [("all", report["all"])]:
        row = [DISPLAY_NAMES.get(name, name), fmt_number(b["num_requests"]), fmt_number(b["num_rounds"]),
               fmt_number(b["tokens"]), fmt_ci(b["tau"], b.get("tau_ci")),
               fmt_ci(b["tau_per_request"], b.get("tau_per_request_ci")), fmt_number(b["verify_rate"]),
               fmt_ci(b["acceptance_rate"], b.get("acceptance_rate_ci")), fmt_number(b["tokens_per_s"], 1)]
        if has_base:
            row += [fmt_number(b.get("baseline_tokens_per_s"), 1), fmt_ci(b.get("speedup"), b.get("speedup_ci")),
                    fmt_ci(b.get("decode_speedup"), b.get("decode_speedup_ci"))]
        rows.append(row)
    return markdown_table(header, rows)


def _position_tables(report: Mapping[str, Any]) -> list[str]:
    """Conditional acceptance (paper Fig. 2) and prefix survival per position, per benchmark and domain."""
    positions = [f"k={k}" for k in range(1, int(report["gamma"]) + 1)]
    groups = [*report["benchmarks"].items(), *report["domains"].items(), ("all", report["all"])]

    def table(key: str) -> str:
        return markdown_table(["", *positions], [[DISPLAY_NAMES.get(n, MACRO_COLUMNS[n] if n in DOMAINS else n)]
                                                 + [fmt_ci(x, ci, 3) for x, ci in zip(e[key], _cis(e, key))]
                                                 for n, e in groups])

    return ["", "## Conditional acceptance per position (paper Fig. 2)", "",
            "P(k accepted | 1..k−1 accepted, k verified); domains pool their rounds.", "",
            table("conditional_acceptance"),
            "", "## Prefix survival P(m ≥ k)", "",
            table("prefix_survival")]


def _cis(entry: Mapping[str, Any], key: str) -> list[Any]:
    """The per-position intervals of a list metric (Nones when the report has none)."""
    return entry.get(f"{key}_ci") or [None] * len(entry[key])


def _confidence_lines(pooled: Mapping[str, Any]) -> list[str]:
    """Confidence quality of a_k per position over all rounds (before and after STS, if fitted)."""
    conf = pooled.get("confidence")
    if conf is None:
        return ["The drafter reported no confidences (no confidence head)."]
    calibrated = pooled.get("confidence_calibrated")
    header = ["k", "rounds", "mean a_k", "accept rate", "ECE", "AUROC", "Brier"]
    if calibrated:
        header += ["ECE after STS", "Brier after STS"]
    rows = []
    for k, c in enumerate(conf):
        row = [str(c["position"]), fmt_number(c["count"]), fmt_number(c["mean_pred"], 3),
               fmt_number(c["mean_label"], 3), fmt_ci(c["ece"], c.get("ece_ci"), 4), fmt_number(c["auroc"], 3),
               fmt_number(c["brier"], 4)]
        if calibrated:
            row += [fmt_ci(calibrated[k]["ece"], calibrated[k].get("ece_ci"), 4), fmt_number(calibrated[k]["brier"], 4)]
        rows.append(row)
    return [
        "a_k = Π_{i≤k} c_i against 1[first k accepted], over rounds that verified k; ECE with 20 bins.",
        "",
        markdown_table(header, rows),
    ]


# ---------------------------------------------------------------------------
# The serving simulation and STS calibration as markdown
# ---------------------------------------------------------------------------


def results_markdown(results: Sequence[SimResult]) -> str:
    """One row per (policy, concurrency): Θ, Θ against target-only decoding at R (R · SPS(R)), τ, mean ℓ,
    1 + ℓ, per-user speed, mean B, the share of
    request-steps that skipped drafting, the measured drafting time per round (ms and in target
    steps, t_d · SPS(1)), counts; a note says how the clock charged drafting."""
    header = ["policy", "R", "Θ tok/s", "vs target-only", "τ", "mean ℓ", "1+ℓ", "tok/s/user", "mean B", "skipped",
              "draft ms/round", "draft cost (steps)", "steps", "tokens", "finished"]
    rows = [[r.policy, str(r.concurrency), fmt_number(r.throughput, 1),
             fmt_number(r.throughput / r.target_only_throughput), fmt_number(r.tau), fmt_number(r.mean_ell),
             fmt_number(r.budget_tokens), fmt_number(r.tokens_per_s_per_user, 1), fmt_number(r.mean_batch_tokens, 1),
             fmt_number(r.skip_rate), fmt_number(1e3 * r.draft_s_per_round, 1), fmt_number(r.draft_cost_steps),
             str(r.steps), str(r.tokens), f"{r.requests_finished}/{len(r.requests)}"] for r in results]
    clocks = sorted({r.draft_clock for r in results})
    note = (f"Drafting on the SPS clock: {', '.join(clocks)} (serve.draft_overhead). "
            "vs target-only = Θ / (R · SPS(R)). Draft cost = measured seconds of one draft · SPS(1), in target steps at B = 1; skipped = request-steps "
            "without a draft.")
    out = markdown_table(header, rows) + "\n\n" + note + "\n"
    batched = [r for r in results if getattr(r, "engine", "per-request") == "batched"]
    if batched:
        out += "\n" + wall_clock_markdown(batched)
    return out


def wall_clock_markdown(results: Sequence[SimResult]) -> str:
    """The batched engine's two clocks per (policy, R): throughput against target-only decoding at R on
    the SPS clock and on the wall clock, and the two ratios' relative difference with its interval
    (``dspark.evaluation.clocks.serving_clock_difference``)."""
    header = ["policy", "R", "requests", "SPS clock: vs target-only", "wall clock: vs target-only",
              "wall tok/s", "target-only wall tok/s", "SPS / wall ratio − 1", "clocks"]
    rows = []
    for r in results:
        c = r.clocks or {}
        diff = fmt_ci(c["difference"], (c["lo"], c["hi"])) if c else "(no profile)"
        sps_ci = r.table_ci
        sps = fmt_ci(r.throughput / r.target_only_throughput, sps_ci) if sps_ci else fmt_number(
            r.throughput / r.target_only_throughput)
        wall = r.tokens / r.step_wall_s if r.step_wall_s > 0 else math.nan
        rows.append([r.policy, str(r.concurrency), str(c.get("requests", len(r.requests))), sps,
                     fmt_ci(wall / r.target_only_wall, r.wall_ci),
                     fmt_number(wall, 1), fmt_number(r.target_only_wall, 1),
                     diff, c.get("verdict", "–")])
    note = ("Batched engine: one drafter and one target forward per step for every live request. The SPS clock "
            "prices each forward at its padded size rows · (1 + max ℓ); the wall clock is the steps' measured "
            "seconds (prefills excluded on both), against target-only decoding of the same requests at the same R "
            "(its interval over the requests, each left out of both decodes at once), the cells of one R and that "
            "decode served step by step in turn. SPS / wall ratio − 1: the two clocks' ratios to target-only "
            "decoding (its forwards priced on the same table, its sampling and bookkeeping as measured, like "
            "the cells' phases outside the forward), its interval over the requests (stratified "
            "jackknife) and the table's timing noise; \"agree\" when it holds 0.")
    return markdown_table(header, rows) + "\n\n" + note + "\n"


def calibration_markdown(report: Mapping[str, Any]) -> str:
    """Per position k of a ``calibrate_rounds`` report, on the part it was evaluated on:
    T_k, and ECE / AUROC / Brier of a_k (AUROC of c_k too) before and after STS."""
    part = report["per_position"][report["evaluated_on"]]
    header = ["k", "n", "T_k", "ECE a_k before", "after", "AUROC a_k before", "after", "AUROC c_k before", "after",
              "Brier a_k before", "after"]
    rows = []
    for k, t in enumerate(report["temperatures"]):
        b, a = part["before"][k], part["after"][k]
        cb, ca = part["conditional_before"][k], part["conditional_after"][k]
        rows.append([fmt_number(k + 1), fmt_number(b["count"]), fmt_number(t, 3),
                     fmt_ci(b["ece"], b.get("ece_ci"), 4), fmt_ci(a["ece"], a.get("ece_ci"), 4),
                     fmt_number(b["auroc"], 3), fmt_number(a["auroc"], 3),
                     fmt_number(cb["auroc"], 3), fmt_number(ca["auroc"], 3),
                     fmt_number(b["brier"], 4), fmt_number(a["brier"], 4)])
    return (markdown_table(header, rows)
            + "\nAUROC of a_k = Π c_i is unchanged by STS at k = 1 only; that of each c_k at every k.")


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(data), f, indent=2, ensure_ascii=False, allow_nan=False)
        f.write("\n")


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    write_jsonl(path, rows)


def write_outputs(
    out_dir: PathLike,
    report: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    temperatures: Any = None,
) -> None:
    """Write rounds.jsonl, requests.jsonl, report.json, report.md and the plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "rounds.jsonl", rounds)
    _write_jsonl(out / "requests.jsonl", records)
    _write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", report_markdown(report))
    plot_acceptance(report, out / "acceptance.png")
    if any(r["confidences"] is not None for r in rounds):
        plot_reliability(rounds, int(report["gamma"]), out / "reliability.png", temperatures)


def write_results(out_dir: PathLike, results: Sequence[SimResult], config: Mapping[str, Any] | None = None) -> Path:
    """Write results.json (config + summaries), results.md, rounds.jsonl (every round of
    every run, with policy and concurrency), figure8.png and frontier.png; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "results.json", {"config": dict(config or {}), "results": [r.summary() for r in results]})
    (out / "results.md").write_text("# Serving simulation\n\n" + results_markdown(results), encoding="utf-8")
    _write_jsonl(out / "rounds.jsonl",
                 [{"policy": r.policy, "concurrency": r.concurrency, **row} for r in results for row in r.rounds])
    plot_figure8(results, out / "figure8.png")
    plot_frontier(results, out / "frontier.png")
    return out


def write_sts_report(
    path: PathLike, report: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], n_bins: int = 20
) -> dict[str, str]:
    """Write a ``calibrate_rounds`` result: the STS JSON at ``path`` (SGLang fields first,
    then evaluated_on, split, per_position) and ``<stem>_reliability.png`` next to it
    (a_k before / after STS on ``rows``, the evaluated rows). Returns both paths."""
    save_sts_report(path, report)
    png = os.path.join(os.path.dirname(os.fspath(path)), os.path.splitext(os.path.basename(os.fspath(path)))[0]
                       + "_reliability.png")
    c, m, ell = round_arrays(rows)
    reliability_grid(c, apply_temperatures(c, report["temperatures"]), m, ell, png, n_bins=n_bins,
                     title=f"Prefix survival a_k before / after STS ({report['evaluated_on']} part, {len(rows)} rounds)")
    return {"json": os.fspath(path), "plot": png}


def write_profile(profile: SPSProfile, path: PathLike, meta: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write the SGLang table JSON at ``path``, ``<stem>.profile.json`` (timings, settings, the
    raw medians' speeds with their 95 % intervals, the noise-aware table's speeds, ``meta``)
    and ``<stem>.png`` next to it; returns the three paths."""
    from dspark.scheduling.sps_profile import profile_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.table.to_json(path)
    details = profile_path(path)
    data = {**asdict(profile), "steps_per_sec": profile.steps_per_sec,
            "steps_per_sec_interval": [list(x) for x in profile.steps_per_sec_interval],
            "table_steps_per_sec": list(profile.table.sample_steps_per_sec), **(meta or {})}
    with details.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str, allow_nan=False)
        f.write("\n")
    png = path.with_suffix(".png")
    plot_sps(profile, png)
    return {"table": path, "details": details, "plot": png}
