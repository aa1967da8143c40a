"""The summary of a `scripts/demo.sh` run folder: one markdown page (README.md) and a short text.

`dspark summary RUN_DIR` reads what the demo's stages wrote and says, top to bottom,
the results table (`results_table`: the one the repository's README shows), what was
trained, the accepted length τ with its intervals, the calibration, the scheduling table,
the simulation, the time each stage took and where every file is. Every input is
optional: a stage that has not run (or a file without some key) is named as missing,
never an error.

The run folder (``scripts/demo.sh`` writes it; the names are this module's contract):

    demo.json                     the demo's mode and budgets
    timings.json                  {stage: wall-clock seconds}, in run order
    <run>/train_log.jsonl         a training run (any subfolder holding one), drafter/ next to it
    eval-T<temp>/<name>/report.json   `dspark eval` reports (+ report.md, rounds.jsonl, plots)
    sps.json (.profile.json, .png)    `dspark profile-sps`
    sts.json (sts_reliability.png)    `dspark calibrate` (fitted on dev/<drafter>/rounds.jsonl, a dev-split evaluation)
    sched/<policy>-R<r>/report.json   `dspark eval --policy <policy> --concurrency <r>`
    simulate/results.json (figure8.png, frontier.png)   `dspark simulate`
    llamacpp/results.json (README.md)   `bench/llamacpp.py` (optional: the drafters in llama.cpp)

Intervals: a metric ``x`` of a report may carry a sibling ``x_ci: [lo, hi]`` (its 95 %
interval over requests, ``dspark.evaluation.intervals``); for macro averages ``x_ci`` is then a
dict of the same keys (``{"avg": [lo, hi], ...}``). Present intervals are shown as
``1.14 [1.09, 1.20]`` (intervals are asymmetric in general), absent ones leave the bare value,
and one resting on too few requests or rounds reads "(no interval)".

Prompts: every reported number decodes the test part of each benchmark (``eval.split``), STS is
fitted on the dev part (``dspark.data.benchmarks``: the two never share a prompt); the page says
which split each stage decoded, from the reports' own config.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dspark.io.atomic import atomic_write_text
from dspark.bootstrap import MIN_REQUESTS, MIN_ROUNDS
from dspark.evaluation.markdown import fmt_ci, fmt_number, markdown_table
from dspark.evaluation.metrics import DISPLAY_NAMES, TABLE1_ORDER

TAU_KEYS = ("tau_pooled", "tau")  # τ pooled over rounds; a report without intervals names it "tau"
DOMAIN_NAMES = {"math": "Math", "code": "Code", "chat": "Chat", "avg": "Avg"}
STAGE_NAMES = {"data": "answers, rendering, fp8 feature cache", "vocab": "draft vocabulary (dspark vocab)",
               "profile-sps": "SPS profile of the target", "calibrate": "STS calibration",
               "simulate": "serving simulation", "llamacpp": "llama.cpp beside dspark (bench/llamacpp.py)"}
STAGE_PREFIXES = {"train-": "training", "eval-": "evaluation", "sched-": "scheduled evaluation"}


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    """The JSON at ``path``, or None when the file is missing or damaged (a stage still running)."""
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a killed run
    except OSError:
        return []
    return rows


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Everything the summary shows, read from ``run_dir`` (layout: module docstring).

    Keys: dir, demo, timings, training {name: {...}}, evals {(temp, name): report},
    sps (the table dict), sts, sched {(policy, R): report}, simulate (results.json)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run folder (the folder scripts/demo.sh writes, e.g. runs/demo)")
    evals = {}
    for path in sorted(root.glob("eval-T*/*/report.json")):
        report = _read_json(path)
        if report is not None:
            evals[(path.parent.parent.name.removeprefix("eval-T"), path.parent.name)] = report
    sched = {}
    for path in sorted(root.glob("sched/*/report.json")):
        report = _read_json(path)
        policy, _, r = path.parent.name.rpartition("-R")
        if report is not None and policy and r.isdigit():
            sched[(policy, int(r))] = report
    return {
        "dir": root,
        "demo": _read_json(root / "demo.json") or {},
        "timings": _read_json(root / "timings.json") or {},
        "training": {p.parent.name: _training(p.parent) for p in sorted(root.glob("*/train_log.jsonl"))},
        "evals": evals,
        "sps": _read_json(root / "sps.json"),
        "sts": _read_json(root / "sts.json"),
        "sched": sched,
        "simulate": _read_json(root / "simulate" / "results.json"),
        "llamacpp": _read_json(root / "llamacpp" / "results.json"),
    }


def _training(run: Path) -> dict[str, Any]:
    """Steps, minutes and held-out τ_prob (first and last logged) of one training run."""
    log = _read_jsonl(run / "train_log.jsonl")
    evals = [r for r in log if "eval_tau_prob" in r]
    drafter = _read_json(run / "drafter" / "config.json") or {}
    return {
        "steps": max((int(r.get("step", 0)) for r in log), default=None),
        "minutes": max((float(r.get("wall_min", 0.0)) for r in log), default=None),
        "tau_prob_first": evals[0]["eval_tau_prob"] if evals else None,
        "tau_prob_last": evals[-1]["eval_tau_prob"] if evals else None,
        "variant": drafter.get("dspark_variant"),
        "block_size": drafter.get("block_size"),
        "layers": drafter.get("num_hidden_layers"),
        "finished": (run / "drafter" / "config.json").is_file(),
    }


# ---------------------------------------------------------------------------
# Values with intervals
# ---------------------------------------------------------------------------


def _interval(ci: Any) -> tuple[float, float] | None:
    """[lo, hi] as floats, or None when ``ci`` is not two finite numbers."""
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        return None
    try:
        lo, hi = float(ci[0]), float(ci[1])
    except (TypeError, ValueError):
        return None
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def _withheld_or_interval(ci: Any) -> tuple[float, float] | None:
    """``_interval``, or (NaN, NaN) for a pair the report left empty: an interval withheld because it
    would rest on too few requests or rounds (shown as "(no interval)")."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and _interval(ci) is None:
        return (math.nan, math.nan)
    return _interval(ci)


def metric(container: Mapping[str, Any] | None, keys: str | Sequence[str], sub: str | None = None
           ) -> tuple[float | None, tuple[float, float] | None]:
    """(value, interval) of the first of ``keys`` present in ``container``; with ``sub`` the
    value is ``container[key][sub]`` (a macro dict) and the interval ``container[key + "_ci"][sub]``
    ((NaN, NaN) where the report withheld it, None where it has none)."""
    if not isinstance(container, Mapping):
        return None, None
    for key in (keys,) if isinstance(keys, str) else keys:
        if key not in container:
            continue
        value, ci = container[key], container.get(f"{key}_ci")
        if sub is not None:
            value = value.get(sub) if isinstance(value, Mapping) else None
            ci = ci.get(sub) if isinstance(ci, Mapping) else None
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        return number, _withheld_or_interval(ci)
    return None, None


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def _stage_name(stage: str) -> str:
    if stage in STAGE_NAMES:
        return STAGE_NAMES[stage]
    return next((what for prefix, what in STAGE_PREFIXES.items() if stage.startswith(prefix)), "")


def _drafters_trained(run: Mapping[str, Any]) -> str:
    """"a DSpark, a DFlash and an Eagle3 drafter" from the training runs found (their variants)."""
    shown = {"dspark": "a DSpark", "dflash": "a DFlash", "eagle3": "an Eagle3"}
    names = [shown.get(str(t.get("variant")), f"a {t.get('variant')}")
             for _, t in sorted(run["training"].items(), key=lambda kv: _drafter_order(kv[0]))]
    if not names:
        return "drafters"
    return (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + " drafter"


def _link(run: Mapping[str, Any], rel: str, text: str | None = None) -> str:
    return f"[{text or rel}]({rel})" if (run["dir"] / rel).exists() else f"{text or rel} (missing)"


def training_section(run: Mapping[str, Any]) -> str:
    demo = run["demo"]
    budget = (f"{demo['epochs']} epochs over the regenerated answers (wall-clock cap {demo.get('max_wall_minutes')} min)"
              if "epochs" in demo else "budget not recorded (no demo.json)")
    extra = " ".join(demo.get("train_overrides") or [])
    lines = [f"Mode `{demo.get('mode', '?')}`; configs {', '.join(f'`{c}`' for c in demo.get('configs', [])) or '?'}; "
             f"{budget}{'; overrides `' + extra + '`' if extra else ''}.", ""]
    rows = [[name, str(t["variant"] or "?"), fmt_number(t["block_size"]), fmt_number(t["layers"]),
             fmt_number(t["steps"]), fmt_number(t["minutes"], 1), fmt_number(t["tau_prob_first"], 3),
             fmt_number(t["tau_prob_last"], 3), "yes" if t["finished"] else "no"]
            for name, t in sorted(run["training"].items(), key=lambda kv: _drafter_order(kv[0]))]
    if not rows:
        return "\n".join(lines + ["No training run found."])
    header = ["run", "variant", "γ", "draft layers", "steps", "minutes", "held-out τ_prob (start)", "(end)", "drafter saved"]
    return "\n".join(lines + [markdown_table(header, rows)])


def _eval_columns(run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(temperature, name) of the evaluations, T = 1 first."""
    return sorted(run["evals"], key=lambda k: (-float(k[0]) if _is_float(k[0]) else 0.0, _drafter_order(k[1])))


def _drafter_order(name: str) -> tuple[int, str]:
    """DSpark first, then DFlash, then the rest by name."""
    return (0 if name.startswith("dspark") else 1 if name.startswith("dflash") else 2, name)


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_of(report: Mapping[str, Any] | None) -> str:
    """The split an evaluation decoded ("all", "dev" or "test"), from its report's config."""
    return str(((report or {}).get("config") or {}).get("split", "all"))


def tau_table(run: Mapping[str, Any]) -> str:
    """τ per benchmark and Math / Code / Chat / Avg macro averages, one column per evaluation,
    and the macro wall-clock speedup; "" without evaluations."""
    columns = _eval_columns(run)
    if not columns:
        return ""
    reports = [run["evals"][c] for c in columns]
    header = ["benchmark"] + [f"{r.get('label') or name} T={temp}" for (temp, name), r in zip(columns, reports)]
    names = [n for n in TABLE1_ORDER if any(n in r.get("benchmarks", {}) for r in reports)]
    rows = [[DISPLAY_NAMES.get(n, n)] + [fmt_ci(*metric(r.get("benchmarks", {}).get(n), TAU_KEYS)) for r in reports]
            for n in names]
    for domain, shown in DOMAIN_NAMES.items():
        rows.append([f"**{shown}**"] + [fmt_ci(*metric(r.get("macro"), TAU_KEYS, domain)) for r in reports])
    rows.append(["speedup (wall, avg)"] + [fmt_ci(*metric(r.get("macro"), "speedup", "avg")) for r in reports])
    return markdown_table(header, rows)


def tau_section(run: Mapping[str, Any]) -> str:
    table = tau_table(run)
    if not table:
        return "No evaluation report found."
    columns = _eval_columns(run)
    counts = run["evals"][columns[0]].get("config", {})
    n = counts.get("num_samples")
    per = f"{'/'.join(str(v) for v in sorted(set(n.values())))} prompts per benchmark" if isinstance(n, Mapping) and n else "?"
    note = (f"{per} of the {split_of(run['evals'][columns[0]])} split, {counts.get('max_new_tokens', '?')} new "
            f"tokens each, dtype {counts.get('dtype', '?')}; τ pooled over rounds; Math / Code / Chat / Avg are macro "
            "averages; [lo, hi] is the 95 % interval over requests where the report has one (the jackknife on the log "
            "scale, stratified by benchmark, Student's t at Σ (requests − 1) degrees of freedom). Speedup: tokens/s "
            "against target-only decoding of the same prompts in the same process.")
    plots = ", ".join(_link(run, f"eval-T{t}/{n}/acceptance.png", f"{n} T={t}") for t, n in columns)
    return "\n".join([table, "", note, "", f"Acceptance plots: {plots}."])


def acceptance_rows(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per evaluation (T = 1 first, then DSpark, DFlash, the rest), the conditional acceptance
    P(k accepted | 1..k−1 accepted) over all rounds (paper Fig. 2): ``values`` (γ floats),
    ``cis`` (γ intervals or None: the report's 95 % interval over requests; None where it has none) and
    ``reached`` (γ round counts, the denominators each position rests on)."""
    rows = []
    for temp, name in _eval_columns(run):
        report = run["evals"][(temp, name)]
        pooled = report.get("all") or {}
        values = pooled.get("conditional_acceptance")
        if not values:
            continue
        gamma = len(values)
        cis = list(pooled.get("conditional_acceptance_ci") or [])[:gamma]
        reached = list(pooled.get("conditional_acceptance_den") or [])[:gamma]
        rows.append({"temperature": temp, "name": name, "label": report.get("label") or name,
                     "values": [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values],
                     "cis": [_withheld_or_interval(ci) for ci in cis] + [None] * (gamma - len(cis)),
                     "reached": reached + [None] * (gamma - len(reached))})
    return rows


def position_verdicts(row: Mapping[str, Any], other: Mapping[str, Any], first: int = 2) -> dict[str, list[int]]:
    """Positions k ≥ ``first`` at which ``row``'s conditional acceptance lies "above" or "below"
    ``other``'s beyond both 95 % intervals (they do not overlap), where the intervals "overlap",
    and where either has no interval ("unmeasured": no round reached k, or no interval was
    computed). Separate intervals that do not overlap are a conservative test of a difference."""
    out: dict[str, list[int]] = {"above": [], "below": [], "overlap": [], "unmeasured": []}
    for k in range(first, min(len(row["cis"]), len(other["cis"])) + 1):
        a, b = row["cis"][k - 1], other["cis"][k - 1]
        if a is None or b is None or not all(math.isfinite(x) for x in (*a, *b)):
            out["unmeasured"].append(k)
        elif a[0] > b[1]:
            out["above"].append(k)
        elif a[1] < b[0]:
            out["below"].append(k)
        else:
            out["overlap"].append(k)
    return out


def _positions(ks: Sequence[int]) -> str:
    return ", ".join(str(k) for k in ks)


def _claim(row: Mapping[str, Any], other: Mapping[str, Any], k: int) -> str:
    """"k (0.40 [0.33, 0.48] against 0.23 [0.17, 0.31])": both values with the bounds a verdict rests on."""
    return (f"{k} ({fmt_ci(row['values'][k - 1], row['cis'][k - 1])} against "
            f"{fmt_ci(other['values'][k - 1], other['cis'][k - 1])})")


def dspark_vs_dflash(run: Mapping[str, Any]) -> list[str]:
    """One sentence per temperature on the paper's first claim (Section 3: a semi-autoregressive
    head keeps acceptance from decaying along the block): where DSpark's conditional acceptance at
    positions k ≥ 2 lies above DFlash's beyond both intervals, each such position with both values
    and their bounds. [] without both evaluations."""
    rows = acceptance_rows(run)
    sentences = []
    for temp in dict.fromkeys(r["temperature"] for r in rows):
        mine = {r["name"].split("_")[0]: r for r in rows if r["temperature"] == temp}
        if "dspark" not in mine or "dflash" not in mine:
            continue
        a, b = mine["dspark"], mine["dflash"]
        v = position_verdicts(a, b)
        parts = [f"above beyond both intervals at k = {', '.join(_claim(a, b, k) for k in v['above'])}" if v["above"]
                 else "above beyond both intervals at no position k ≥ 2"]
        if v["below"]:
            parts.append(f"below beyond both intervals at k = {', '.join(_claim(a, b, k) for k in v['below'])}")
        if v["overlap"]:
            parts.append(f"intervals overlap at k = {_positions(v['overlap'])}")
        if v["unmeasured"]:
            parts.append(f"no interval at k = {_positions(v['unmeasured'])}")
        sentences.append(f"T={temp}: DSpark against DFlash: " + "; ".join(parts) + ".")
    return sentences


def acceptance_table(run: Mapping[str, Any], last: int | None = None) -> str:
    """One row per evaluation, one column per draft position (up to ``last``): the conditional
    acceptance with its 95 % interval [lo, hi], and in brackets the rounds that reached the position."""
    rows = acceptance_rows(run)
    if not rows:
        return ""
    gamma = max(len(r["values"]) for r in rows)
    gamma = min(gamma, last) if last else gamma

    def cell(row: Mapping[str, Any], k: int) -> str:
        if k > len(row["values"]):
            return ""
        reached = row["reached"][k - 1]
        value = fmt_ci(row["values"][k - 1], row["cis"][k - 1], 2)
        return value if reached is None else f"{value} ({reached})"

    body = [[f"{r['label']} T={r['temperature']}"] + [cell(r, k) for k in range(1, gamma + 1)] for r in rows]
    return markdown_table(["drafter", *(f"k={k}" for k in range(1, gamma + 1))], body)


def acceptance_section(run: Mapping[str, Any]) -> str:
    table = acceptance_table(run)
    if not table:
        return "No evaluation report found."
    temps = list(dict.fromkeys(r["temperature"] for r in acceptance_rows(run)))
    figures = ", ".join(_link(run, f"report-T{t}-acceptance.png", f"T={t}") for t in temps)
    note = ("P(k accepted | 1..k−1 accepted, k verified) over all rounds of the nine benchmarks (paper Fig. 2), "
            "with its 95 % interval over requests [lo, hi] (Wilson's interval on effective counts: it never leaves "
            f"[0, 1] and is asymmetric near its ends; none below {MIN_ROUNDS} reaching rounds or {MIN_REQUESTS} "
            "requests that reached the position); in brackets the rounds that reached position k, the count each "
            "value rests on. Every draft is verified (γ positions per round).")
    return "\n".join([table, "", note, "", *dspark_vs_dflash(run), "", f"Figures (the three drafters, intervals as bars): {figures}."])


def calibration_section(run: Mapping[str, Any]) -> str:
    sts = run["sts"]
    if not isinstance(sts, Mapping) or "temperatures" not in sts:
        return "No STS file (sts.json) found."
    split = sts.get("split", {})
    before, after = sts.get("ece_before") or [], sts.get("ece_after") or []
    brier_before, brier_after = sts.get("brier_before") or [], sts.get("brier_after") or []
    kept = sts.get("kept") or []
    test_raw, test_sts, test_name = _scored_calibration(run)
    rows = [[str(k + 1), fmt_number(t, 3), "fitted" if k < len(kept) and _at(kept, k) is None else (_at(kept, k) or "–"),
             fmt_number(_at(before, k), 4), fmt_number(_at(after, k), 4),
             fmt_number(_at(brier_before, k), 4), fmt_number(_at(brier_after, k), 4),
             fmt_number(_at(test_raw, k), 4), fmt_number(_at(test_sts, k), 4)]
            for k, t in enumerate(sts["temperatures"])]
    fitted = sts.get("fitted_on") or []
    fit_splits = sorted({str(f.get("split")) for f in fitted if isinstance(f, Mapping)})
    scored = sorted({split_of(r) for r in run["sched"].values()})
    where = (f"the {', '.join(fit_splits)} split" if fit_splits else "round logs of unrecorded split")
    if fit_splits == ["dev"] and scored and "dev" not in scored and "all" not in scored:
        disjoint = (f"The policies below are scored on the {', '.join(scored)} split: prompts the fit never saw "
                    "(dev and test never share a prompt).")
    elif scored:
        disjoint = (f"The policies below are scored on the {', '.join(scored)} split, which may share prompts with "
                    "the rounds STS was fitted on: their gains from calibration are not measured out of sample.")
    else:
        disjoint = ""
    return "\n".join([
        f"Sequential Temperature Scaling fitted on {split.get('fit_requests', '?')} requests "
        f"({split.get('fit_rounds', '?')} rounds) of DSpark's T = 1 evaluation on {where}; ECE of a_k = Π c_i "
        f"checked on that evaluation's other requests (calibrate's held-out half, {split.get('test_requests', '?')} "
        "requests). "
        + disjoint, "",
        markdown_table(["k", "T_k", "the guard's decision (T_k = 1 kept because)", "ECE before", "ECE after",
                        "Brier before", "Brier after", f"ECE raw ({test_name})", f"ECE after STS ({test_name})"], rows),
        "", "STS moves T_k off 1 only where the fit half holds `calibrate.min_events` accepted and rejected "
        "prefixes and a cross-fitted ECE gain whose 95 % interval excludes 0 (`dspark/scheduling/sts.py`); the "
        "guard's column says, per position, whether the temperature was fitted or why it was kept at 1. The last "
        "two columns: the same ECE on the rounds the policies are scored on, raw and with these temperatures.", "",
        f"Reliability diagrams: {_link(run, 'sts_reliability.png')}; the STS file: {_link(run, 'sts.json')}.",
    ])


def _scored_calibration(run: Mapping[str, Any]) -> tuple[list[Any], list[Any], str]:
    """ECE of a_k per position on the rounds of the static γ scheduled evaluation (every draft verified,
    the policies' prompts), raw and with the STS temperatures; empty lists without it."""
    report = run["sched"].get((PAIRED_BASELINE, 1))
    pooled = (report or {}).get("all") or {}
    raw = [c.get("ece") for c in pooled.get("confidence") or []]
    calibrated = [c.get("ece") for c in pooled.get("confidence_calibrated") or []]
    return raw, calibrated, f"{split_of(report)} split, static γ" if report else "scored rounds"


def _at(values: Sequence[Any], k: int) -> Any:
    return values[k] if k < len(values) else None


def _target_only_theta(run: Mapping[str, Any], r: int) -> float | None:
    """Target-only tokens per SPS-clock second with R requests always live: R · SPS(R), on the
    simulator's clock (its ``target_only_throughput``: the measured medians where the profile was
    there), else on the SPS table."""
    for sim in _simulated(run).values():
        theta0 = sim.get("target_only_throughput")
        if int(sim["concurrency"]) == r and isinstance(theta0, (int, float)) and math.isfinite(theta0) and theta0 > 0:
            return float(theta0)
    if not isinstance(run["sps"], Mapping):
        return None
    from dspark.scheduling.algorithm1 import SPSTable

    try:
        return r * float(SPSTable.from_dict(run["sps"])(r))
    except (ValueError, KeyError, TypeError):
        return None


def _simulated(run: Mapping[str, Any]) -> dict[tuple[str, int], Mapping[str, Any]]:
    """The simulator's results by (policy, R)."""
    sim = run["simulate"] if isinstance(run["simulate"], Mapping) else {}
    return {(str(r["policy"]), int(r["concurrency"])): r for r in sim.get("results", [])
            if isinstance(r, Mapping) and "policy" in r and "concurrency" in r}


def sched_row(run: Mapping[str, Any], policy: str, r: int, report: Mapping[str, Any] | None,
              simulated: Mapping[str, Any] | None) -> dict[str, Any]:
    """One row of the scheduling table. From the scheduled evaluation (``report``, R = 1): τ with
    its interval, mean ℓ, wall-clock tokens/s against target-only decoding, and per round the
    drafting / verification time in target steps. From the simulator (``simulated``): Θ on the
    SPS clock against target-only decoding, R·SPS(R); its τ and mean ℓ where there is no report."""
    a = (report or {}).get("all", {})
    tau, tau_ci = metric(a, TAU_KEYS)
    gamma, rate = (report or {}).get("gamma"), a.get("verify_rate")
    mean_ell = rate * gamma if isinstance(rate, (int, float)) and gamma else None
    sim = simulated or {}
    if report is None:
        tau, mean_ell = sim.get("tau"), sim.get("mean_ell")
    theta, theta0 = sim.get("throughput"), _target_only_theta(run, r)
    speedup, speedup_ci = metric(a, "speedup")
    decode, decode_ci = metric(a, "decode_speedup")
    ratio = theta / theta0 if isinstance(theta, (int, float)) and theta0 else None
    ratio_ci = sim.get("vs_target_only_table_ci")
    if not (isinstance(ratio_ci, Sequence) and len(ratio_ci) == 2 and ratio is not None):
        ratio_ci = None
    clocks = clock_rows(run).get(policy) if r == 1 and report is not None else None
    cell = clock_cell(clocks)
    served = sim.get("clocks") if isinstance(sim.get("clocks"), Mapping) else None
    if cell == "–" and served is not None and served.get("difference") is not None:
        # the batched serving loop: Θ_sps / Θ_wall − 1 on the run's own steps (dspark.evaluation.clocks)
        cell = f"{fmt_ci(served['difference'], [served.get('lo'), served.get('hi')])} (rel.): {served.get('verdict', '–')}"
    return {"policy": policy, "R": r, "tau": tau, "tau_ci": tau_ci, "mean_ell": mean_ell,
            "wall_ratio": sim.get("wall_vs_target_only"),
            "tokens_per_s": a.get("tokens_per_s"), "baseline_tokens_per_s": a.get("baseline_tokens_per_s"),
            "speedup": speedup, "speedup_ci": speedup_ci, "decode_speedup": decode, "decode_speedup_ci": decode_ci,
            "theta": theta, "theta_target": theta0, "theta_ratio": ratio, "theta_ratio_ci": ratio_ci,
            "clock_difference": clocks, "clocks": cell, **_round_costs(report or {})}


def clock_rows(run: Mapping[str, Any]) -> dict[str, Any]:
    """policy -> the paired difference of the SPS clock and the wall clock on its scheduled evaluation at
    R = 1 (``dspark.evaluation.clocks.clock_difference``, the profile behind sps.json), or None where it
    cannot be computed (no profile, a folder still being written). Kept in ``run`` once computed."""
    cached = run.get("clock_rows")
    if cached is not None:
        return cached
    from dspark.evaluation.clocks import clock_difference

    out: dict[str, Any] = {}
    profile = run["dir"] / "sps.json"
    for policy, r in run["sched"]:
        if r != 1:
            continue
        try:
            out[policy] = clock_difference(run["dir"] / "sched" / f"{policy}-R1", profile)
        except (OSError, ValueError, KeyError, TypeError):
            out[policy] = None
    if isinstance(run, dict):
        run["clock_rows"] = out
    return out


def clock_cell(diff: Any) -> str:
    """"−0.03 [−0.07, 0.01]: agree" for a ``ClockDifference`` (SPS clock minus wall clock, paired on
    the same requests: "agree" means its interval holds 0); "–" without one."""
    if diff is None or not math.isfinite(diff.difference):
        return "–"
    return f"{fmt_ci(diff.difference, [diff.lo, diff.hi])}: {diff.verdict}"


def _round_costs(report: Mapping[str, Any]) -> dict[str, float | None]:
    """Draft and verify seconds per round over the target-only seconds per decode step (prefills out)."""
    t, a = report.get("timings", {}), report.get("all", {})
    phases, base_phases = t.get("spec_phases_s") or {}, t.get("baseline_phases_s") or {}
    rounds, base_tokens, requests = a.get("num_rounds"), a.get("baseline_tokens"), a.get("num_requests")
    base_s = t.get("baseline_s")
    if not (rounds and base_tokens and requests and base_s) or base_tokens <= requests:
        return {"draft_steps": None, "verify_steps": None}
    step = (base_s - float(base_phases.get("prefill", 0.0))) / (base_tokens - requests)
    if step <= 0:
        return {"draft_steps": None, "verify_steps": None}
    return {"draft_steps": float(phases.get("draft", math.nan)) / rounds / step,
            "verify_steps": float(phases.get("verify", math.nan)) / rounds / step}


def _policy_order(run: Mapping[str, Any]) -> Any:
    """Sort key of (policy, R): the demo's policy order, then the name, then R."""
    order = {p: i for i, p in enumerate((run["demo"].get("schedule") or {}).get("policies", []))}
    return lambda k: (order.get(k[0], len(order)), k[0], k[1])


def sched_rows(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per policy and R of the demo's scheduling concurrencies (default 1 and 4), in the
    demo's policy order: the scheduled evaluations and the simulator's results of those R."""
    wanted = set((run["demo"].get("schedule") or {}).get("concurrencies") or (1, 4))
    simulated = _simulated(run)
    keys = set(run["sched"]) | {k for k in simulated if k[1] in wanted}
    keys = sorted(keys, key=_policy_order(run))
    return [sched_row(run, p, r, run["sched"].get((p, r)), simulated.get((p, r))) for p, r in keys]


PAIRED_BASELINE = "static"  # the paper's fixed γ: every other policy is compared with it


def paired_rows(run: Mapping[str, Any], baseline: str = PAIRED_BASELINE) -> list[dict[str, Any]]:
    """For every other policy with a scheduled evaluation at R = 1: its speedup and τ over the
    baseline's on the same requests (``dspark.evaluation.paired.paired_ratio``, each speedup against its own
    target-only decodes), as {policy, paired: PairedRatio or None, error: why not or None}.
    Empty without the baseline's evaluation. Kept in ``run`` (a dict) once computed: the page
    shows them twice and each is a bootstrap."""
    cached = run.get("paired_rows", {}).get(baseline)
    if cached is not None:
        return cached
    rows = _paired_rows(run, baseline)
    if isinstance(run, dict):
        run.setdefault("paired_rows", {})[baseline] = rows
    return rows


def _paired_rows(run: Mapping[str, Any], baseline: str) -> list[dict[str, Any]]:
    from dspark.evaluation.paired import paired_ratio

    if (baseline, 1) not in run["sched"]:
        return []
    folder = run["dir"] / "sched"
    rows = []
    for policy, _ in sorted((k for k in run["sched"] if k[1] == 1 and k[0] != baseline), key=_policy_order(run)):
        try:
            paired, error = paired_ratio(folder / f"{policy}-R1", folder / f"{baseline}-R1"), None
        except (OSError, ValueError, KeyError, TypeError) as e:  # a stage still running, a folder without round logs
            paired, error = None, str(e)
        rows.append({"policy": policy, "paired": paired, "error": error})
    return rows


def _fmt_ratio(interval: Any) -> str:
    """"1.04 [1.01, 1.08]" of an Interval, "–" without one."""
    if interval is None:
        return "–"
    return fmt_ci(interval.estimate, [interval.lo, interval.hi])


def _paired_verdict(interval: Any, baseline: str) -> str:
    from dspark.evaluation.paired import verdict

    words = {"above 1": f"above {baseline} beyond the interval", "below 1": f"below {baseline} beyond the interval",
             "includes 1": "not separated (the interval includes 1)"}
    return words.get(verdict(interval), "–")


def paired_section(run: Mapping[str, Any], baseline: str = PAIRED_BASELINE) -> str:
    """The short table "speedup vs static (paired)" under the scheduling table ('' without rows)."""
    rows = paired_rows(run, baseline)
    if not rows:
        return ""
    cells = []
    for x in rows:
        p = x["paired"]
        if p is None:
            cells.append([x["policy"], "–", "–", f"not computed: {x['error']}", "–"])
            continue
        cells.append([x["policy"], _fmt_ratio(p.speedup), _fmt_ratio(p.tau), _paired_verdict(p.speedup, baseline),
                      str(p.common)])
    header = ["policy (R = 1)", f"speedup vs {baseline} (paired) [95 %]", f"τ vs {baseline} (paired) [95 %]",
              "speedup verdict", "common requests"]
    note = (f"Speedup vs {baseline} (paired): the policy's wall-clock speedup over {baseline}'s, each against its "
            "own target-only decodes, pooled over the requests both evaluated; its 95 % interval takes those "
            "requests jointly (the jackknife leaves a request out of both policies at once, within each benchmark), "
            "so the request-to-request variation both policies share cancels. An interval that excludes 1 separates "
            "the two policies even where their own intervals above overlap.")
    return "\n".join([markdown_table(header, cells), "", note])


def sched_section(run: Mapping[str, Any]) -> str:
    rows = sched_rows(run)
    if not rows:
        return "No scheduled evaluation found."
    header = ["policy", "R", "τ", "mean ℓ", "tok/s (wall)", "target-only tok/s", "speedup (wall)",
              "decode-only speedup (wall)", "Θ (SPS clock)", "target-only Θ = R·SPS(R)", "Θ ratio",
              "Θ ratio (wall clock, batched)", "SPS vs wall clock (same decode)", "draft / round", "verify / round"]
    cells = [[x["policy"], str(x["R"]), fmt_ci(x["tau"], x["tau_ci"]), fmt_number(x["mean_ell"]),
              fmt_number(x["tokens_per_s"], 1), fmt_number(x["baseline_tokens_per_s"], 1),
              fmt_ci(x["speedup"], x["speedup_ci"]), fmt_ci(x["decode_speedup"], x["decode_speedup_ci"]),
              fmt_number(x["theta"], 1), fmt_number(x["theta_target"], 1), fmt_ci(x["theta_ratio"], x["theta_ratio_ci"]),
              fmt_number(x.get("wall_ratio")), x["clocks"], fmt_number(x["draft_steps"]), fmt_number(x["verify_steps"])]
             for x in rows]
    note = (
        "DSpark at T = 1 on the same prompts under each policy. **Wall clock** (R = 1, `dspark eval --policy "
        "POLICY`, folders `sched/`): tokens/s of the speculative decode against target-only decoding of the same "
        "prompts, measured in the same process; τ, mean ℓ and the per-round costs come from it. Draft / verify per "
        "round: seconds per round over the target-only seconds per decode step (prefills excluded); a round costs "
        "about draft + verify target steps and yields τ tokens, so the drafting cost is what keeps a policy that "
        "verifies nothing (ℓ = 0) below target-only speed. **SPS clock** (`dspark simulate`, folder `simulate/`): "
        "R requests live at every step (the prompts are cycled), each step charged 1 / SPS(B) for its "
        "B = Σ(1 + ℓ_r) tokens at the profile's measured medians (the policies decide on the noise-aware table, "
        "whose rises within the timing noise are flattened) plus every other phase measured in it (drafting, acceptance, cache and context bookkeeping, the policy's decision; the demo runs it with `--draft-overhead measured`), put on the table's time scale by the ratio of the table's price of the run's verification forwards to their measured seconds, against R·SPS(R) for target-only "
        "decoding. The serving loop is batched (one drafter and one target forward per step for every live "
        "request, each forward padded to 1 + max ℓ_r and priced at that size), so the same steps are also timed "
        "on the wall clock: **Θ ratio (wall clock, batched)** is their tokens/s over target-only decoding of the "
        "same requests at the same R, measured in the same process. Rows without a scheduled evaluation (R > 1) "
        "show the simulator's τ and mean ℓ. The Θ ratio's interval is the SPS table's own timing noise: the run's steps "
        "priced by 1000 tables of the profile's sweeps resampled jointly across B (every decision kept). "
        "**SPS vs wall clock**: at R > 1 (\"rel.\"), Θ_sps / Θ_wall − 1 on the serving loop's own steps, with "
        "its interval over the requests (each takes its share of every step) and the table's noise; at R = 1, "
        "the scheduled evaluation's own requests timed by both clocks (the same "
        "decode, the same tokens): the SPS clock's ratio to target-only decoding (its verification forwards "
        "priced by the measured table, every other phase as measured, `dspark.evaluation.clocks`) minus the "
        "wall clock's decode-only speedup, with the 95 % interval of that paired difference over requests and "
        "the table's timing noise; \"agree\" means the interval holds 0.")
    paired = paired_section(run)
    return "\n".join([markdown_table(header, cells), "", note] + (["", paired] if paired else []))


DRAFTER_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}
POLICY_NAMES = {"static": "static γ = {gamma}", "static1": "static ℓ = 1", "algorithm1": "Algorithm 1",
                "async": "async (Section 5.2)", "algorithm1+skip": "Algorithm 1 + skip"}
RESULTS_HEADER = ("", "requests", "R", "τ, T = 1", "τ, greedy", "speed vs target-only (T = 1, wall clock, at R)",
                  f"speed vs {PAIRED_BASELINE} γ (paired, R = 1)", "throughput vs target-only (R = {r}, SPS clock)",
                  "throughput vs target-only (R = {r}, wall clock)")


def _drafter_name(run: Mapping[str, Any], name: str, report: Mapping[str, Any]) -> str:
    """"DSpark" / "DFlash" / "Eagle3" from the training run's variant, the report's label or the name."""
    for key in ((run["training"].get(name) or {}).get("variant"), report.get("label"), name.split("_")[0]):
        if key in DRAFTER_NAMES:
            return DRAFTER_NAMES[key]
    return name


def _policy_name(policy: str, gamma: Any) -> str:
    return POLICY_NAMES.get(policy, policy).replace("{gamma}", fmt_number(gamma) if gamma else "γ")


def _requests(report: Mapping[str, Any]) -> str:
    """How many requests a report's intervals rest on ("–" when unknown)."""
    n = (report.get("all") or {}).get("num_requests")
    return str(int(n)) if isinstance(n, (int, float)) else "–"


def results_table(run: Mapping[str, Any] | str | os.PathLike) -> str:
    """The results table of a demo run (a folder, or ``load_run``'s dict): the README's table.

    Each row says how many requests its intervals rest on (requests at T = 1 for a drafter, the
    scheduled evaluation's for a policy; the paired ratio uses the requests both policies decoded).
    One row per drafter evaluated at T = 1 (every draft verified): its macro-average τ at T = 1
    and greedily, with half the 95 % interval over requests, and its wall-clock speed against
    target-only decoding. One row per verification policy of the scheduled evaluations (DSpark,
    T = 1, R = 1): τ, wall-clock speed, that speed over static γ's on the same requests (paired
    bootstrap: estimate and 95 % interval), and, from the simulator, the throughput against
    target-only decoding at the smallest R > 1 on the SPS clock. A last row: target-only decoding.
    "" when the folder has neither evaluations nor scheduled evaluations."""
    if not isinstance(run, Mapping):
        run = load_run(run)
    evals = {name: {temp: report for (temp, n), report in run["evals"].items() if n == name}
             for _, name in _eval_columns(run)}
    all_rows = sched_rows(run)
    sched = [x for x in all_rows if x["R"] == 1]
    if not evals and not sched:
        return ""
    r = min((x["R"] for x in all_rows if x["R"] > 1), default=None)
    rows = []
    for name, by_temp in evals.items():
        hot = next((rep for t, rep in by_temp.items() if _is_float(t) and float(t) > 0), None)
        greedy = next((rep for t, rep in by_temp.items() if _is_float(t) and float(t) == 0), None)
        report = hot or greedy or {}
        gamma = report.get("gamma")
        label = _drafter_name(run, name, report) + (f" (γ = {gamma})" if gamma else "")
        rows.append([label, _requests(report), str((report.get("config") or {}).get("batch_size") or 1),
                     fmt_ci(*metric((hot or {}).get("macro"), TAU_KEYS, "avg")),
                     fmt_ci(*metric((greedy or {}).get("macro"), TAU_KEYS, "avg")),
                     fmt_ci(*metric((hot or {}).get("macro"), "speedup", "avg")), "–", "–", "–"])
    paired = {x["policy"]: x["paired"] for x in paired_rows(run)}
    at_r = {x["policy"]: fmt_ci(x["theta_ratio"], x["theta_ratio_ci"]) for x in all_rows if x["R"] == r}
    wall_r = {x["policy"]: fmt_number(x.get("wall_ratio")) for x in all_rows if x["R"] == r}
    for x in sched:
        gamma = (run["sched"].get((x["policy"], 1)) or {}).get("gamma")
        p = paired.get(x["policy"])
        if x["policy"] == PAIRED_BASELINE:
            vs = "1 (baseline)"
        elif p is not None and p.speedup is not None:
            vs = _fmt_ratio(p.speedup)
        else:
            vs = "–"
        sched_report = run["sched"].get((x["policy"], 1)) or {}
        rows.append([f"DSpark, {_policy_name(x['policy'], gamma)}", _requests(sched_report), "1",
                     fmt_ci(x["tau"], x["tau_ci"]), "–", fmt_ci(x["speedup"], x["speedup_ci"]), vs,
                     at_r.get(x["policy"], "–"), wall_r.get(x["policy"], "–")])
    rows.append(["target-only decoding", "–", "–", "1", "1", "1", "–", "1", "1"])
    header = [h.replace("{r}", str(r) if r else "> 1") for h in RESULTS_HEADER]
    return markdown_table(header, rows)


def results_caption(run: Mapping[str, Any]) -> str:
    """Which prompts the results table decodes: the split, requests per benchmark and new tokens of the
    evaluations, and the splits STS was fitted on; "" without evaluations."""
    reports = [run["evals"][c] for c in _eval_columns(run)] + list(run["sched"].values())
    if not reports:
        return ""
    splits = sorted({split_of(r) for r in reports})
    config = reports[0].get("config") or {}
    counts = config.get("num_samples")
    per = "/".join(str(v) for v in sorted(set(counts.values()))) if isinstance(counts, Mapping) and counts else "?"
    sts = run["sts"] if isinstance(run["sts"], Mapping) else {}
    fitted = sorted({str(f.get("split")) for f in sts.get("fitted_on") or [] if isinstance(f, Mapping)})
    text = (f"Prompts: the {' and '.join(splits)} split of each benchmark, {per} per benchmark × "
            f"{config.get('max_new_tokens', '?')} new tokens.")
    if splits == ["test"]:
        text += (" The drafters' recipe is chosen on the dev split (bench/recipe_study.py), which shares no prompt "
                 "with it.")
    if fitted:
        text += f" STS was fitted on the {' and '.join(fitted)} split."
    return text


def simulate_section(run: Mapping[str, Any]) -> str:
    sim = run["simulate"]
    if not isinstance(sim, Mapping) or not sim.get("results"):
        return "No serving simulation (simulate/results.json) found."
    rows = []
    for r in sim["results"]:
        theta0 = _target_only_theta(run, int(r["concurrency"]))
        ratio = r["throughput"] / theta0 if theta0 and isinstance(r.get("throughput"), (int, float)) else None
        rows.append([str(r["policy"]), str(r["concurrency"]), fmt_number(r.get("throughput"), 1),
                     fmt_number(theta0, 1), fmt_number(ratio), fmt_number(r.get("wall_throughput"), 1),
                     fmt_number(r.get("target_only_wall"), 1), fmt_number(r.get("wall_vs_target_only")),
                     fmt_number(r.get("tau")), fmt_number(r.get("mean_ell"))])
    config = sim.get("config", {})
    return "\n".join([
        markdown_table(["policy", "R", "Θ (SPS clock, tok/s)", "target-only R·SPS(R)", "ratio", "wall clock tok/s",
                        "target-only wall tok/s", "wall ratio", "τ", "mean ℓ"], rows), "",
        f"{config.get('num_prompts', '?')} prompts cycled, {config.get('max_new_tokens', '?')} new tokens, "
        f"drafting charged {_draft_charge(config.get('draft_overhead', 0))}. Plots: "
        f"{_link(run, 'simulate/figure8.png')}, {_link(run, 'simulate/frontier.png')}, SPS table "
        f"{_link(run, 'sps.png')}.",
    ])


def _triple(entry: Mapping[str, Any] | None, key: str, bench: str = "macro") -> str:
    """A [estimate, lo, hi] of bench/llamacpp.py's results as "x ± h"; "–" when missing."""
    value = ((entry or {}).get(key) or {}).get(bench)
    return fmt_ci(value[0], value[1:]) if value else "–"


def llamacpp_section(run: Mapping[str, Any]) -> str:
    """The same drafters served by llama.cpp (bench/llamacpp.py): macro τ in both engines, llama.cpp's
    tokens/s with and without the drafter, greedy outputs equal to the target's, and the target
    alone in both engines."""
    results = run.get("llamacpp")
    if not isinstance(results, Mapping) or not results.get("temperatures"):
        return "Not run (no llamacpp/results.json): see bench/llamacpp.py."
    settings = results.get("settings", {})
    rows = []
    for temp, entry in results["temperatures"].items():
        t = "greedy" if float(temp) == 0.0 else f"T = {float(temp):g}"
        target = entry.get("target", {})
        for name, d in sorted(entry.get("drafters", {}).items(), key=lambda kv: _drafter_order(kv[0])):
            equal = d.get("greedy_equal")
            facts = settings.get("drafters", {}).get(name, {})
            shown = DRAFTER_NAMES.get(str(facts.get("variant")), name)
            if facts.get("static_of"):
                shown += f", chosen: n-max {facts.get('gamma')}, p-min {float(facts.get('p_min') or 0):g}"
            rows.append([shown, t, _triple(d, "tau"), _triple(d, "dspark_tau"), _triple(target, "tokens_per_s"),
                         _triple(d, "tokens_per_s"), _triple(d, "speedup"), _triple(d, "over_static"),
                         f"{equal[0]}/{equal[1]}" if equal else "–"])
        rows.append(["target alone", t, "–", "–", _triple(target, "tokens_per_s"),
                     f"dspark loop: {_triple(target, 'dspark_tokens_per_s')}", _triple(target, "llamacpp_over_dspark"),
                     "–", "–"])
    header = ["drafter", "", "τ llama.cpp", "τ dspark", "llama.cpp tok/s, target alone", "tok/s with the drafter",
              "speedup (target alone: llama.cpp / dspark)", "over the static setting (paired)",
              "greedy output = target's"]
    return "\n".join([
        markdown_table(header, rows), "",
        f"The drafters exported to GGUF and served by `llama-server` ({settings.get('threads', '?')} threads) with "
        f"the target's Q4_1 GGUF, on the {settings.get('requests', '?')} requests of the evaluation: each at the "
        "static setting (n-max γ, p-min 0) and, where a row says so, at the setting dspark chose for it from its "
        "greedy rounds on the dev prompts and the engine's own cost table (`bench/llamacpp.py --tune`). Macro averages "
        "over the benchmarks with their 95 % intervals over requests [lo, hi]; τ counts the target's token of "
        "each round in both engines; tokens/s are the server's, prefill excluded. Per benchmark: "
        f"{_link(run, 'llamacpp/README.md')}.",
    ])


def _draft_charge(overhead: Any) -> str:
    if overhead == "measured":
        return "as measured (each step pays every phase it took but the target's verification)"
    return f"as {overhead} of a step" if overhead else "not at all (draft_overhead 0)"


def timings_section(run: Mapping[str, Any]) -> str:
    timings = run["timings"]
    if not timings:
        return "No timings.json found."
    rows = [[stage, _stage_name(stage), fmt_number(float(s) / 60, 1)] for stage, s in timings.items()]
    rows.append(["**total**", "", fmt_number(sum(float(s) for s in timings.values()) / 60, 1)])
    return markdown_table(["stage", "", "minutes"], rows) + "\n\nTimes of the stages run in this folder (a resumed " \
        "stage counts its last, completing run only)."


FILES = (
    ("demo.json", "the demo's mode and budgets"), ("timings.json", "wall-clock seconds per stage"),
    ("data/", "regenerated answers (responses.jsonl), rendered samples, split.json, the fp8 feature cache"),
    ("*/drafter/", "the trained drafters (config.json + model.safetensors); train_log.jsonl and checkpoints/ next to them"),
    ("curves.png", "held-out τ_prob against wall-clock minutes"),
    ("eval-T*/*/", "evaluations: report.md / report.json, requests.jsonl, rounds.jsonl (the log STS is fitted on), plots"),
    ("report-T*.md", "Table-1-style comparisons (dspark compare; report-T*-acceptance.png: the conditional acceptance of every drafter)"),
    ("sps.json", "the SPS table (sps.profile.json: timings; sps.png)"),
    ("sts.json", "STS temperatures and ECE before / after (sts_reliability.png)"),
    ("sched/*/", "scheduled evaluations, one folder per policy and R"),
    ("simulate/", "the serving simulation: results.md / .json, rounds.jsonl, figure8.png, frontier.png"),
    ("llamacpp/", "llama.cpp beside dspark: results.json, README.md, requests.jsonl, the drafters' GGUFs, server logs"),
)


def files_section(run: Mapping[str, Any]) -> str:
    root = run["dir"]
    lines = []
    for pattern, what in FILES:
        found = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern.rstrip("/")))
        where = ", ".join(f"`{f}`" for f in found[:8]) + (" ..." if len(found) > 8 else "") if found else "(not yet)"
        lines.append(f"- {what}: {where}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The page and the short text
# ---------------------------------------------------------------------------


def summary_markdown(run: Mapping[str, Any]) -> str:
    """The run's README.md: the sections above, with the plots linked relative to the run folder."""
    parts = [
        f"# dspark demo: {run['dir'].name}", "",
        f"SmolLM2-135M-Instruct as the target; {_drafters_trained(run)} trained with the same budget, "
        "evaluated against target-only decoding, calibrated, and served under verification policies.",
        "", "## Results", "", results_table(run) or "No evaluation found.", "",
        results_caption(run), "",
        "τ: accepted tokens per round, macro average over the benchmarks, with its 95 % interval over requests "
        "[lo, hi]. R: requests decoded together (one drafter and one target forward per round for all of them). "
        "Speeds: tokens/s against target-only decoding of the same prompts at the same R; the last two columns "
        "serve R requests in the batched serving loop, on the SPS clock (its interval the SPS table's timing "
        "noise) and on the wall clock; the sections below give every number this table is made of.",
        "", "## 1. What was trained", "", training_section(run),
        "", f"Learning curves: {_link(run, 'curves.png')}.",
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
    for name, t in sorted(run["training"].items(), key=lambda kv: _drafter_order(kv[0])):
        lines.append(f"trained {name}: {fmt_number(t['steps'])} steps, {fmt_number(t['minutes'], 1)} min, "
                     f"held-out τ_prob {fmt_number(t['tau_prob_first'], 3)} -> {fmt_number(t['tau_prob_last'], 3)}")
    for temp, name in _eval_columns(run):
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
                     f"SPS-clock Θ ratio {fmt_ci(x['theta_ratio'], x['theta_ratio_ci'])}{'' if x['clocks'] == '–' else ' (' + x['clocks'] + ')'}"
                     f", draft/round {fmt_number(x['draft_steps'])} steps")
    if run["sched"] or run["simulate"]:
        lines.append("(R = 1: wall clock of dspark eval --policy; R > 1: the simulator's SPS clock)")
    for x in paired_rows(run):
        if x["paired"] is not None:
            speed = _fmt_ratio(x["paired"].speedup)
            lines.append(f"{x['policy']:>12} / {PAIRED_BASELINE} (paired, R=1): speedup ratio {speed}, "
                         f"{_paired_verdict(x['paired'].speedup, PAIRED_BASELINE)}; τ ratio {_fmt_ratio(x['paired'].tau)}")
    for line in _llamacpp_short(run):
        lines.append(line)
    if run["timings"]:
        lines.append("minutes per stage: " + ", ".join(f"{k} {float(v) / 60:.1f}" for k, v in run["timings"].items())
                     + f"; total {sum(float(v) for v in run['timings'].values()) / 60:.1f}")
    lines.append(f"files in {run['dir']}: data/, <drafter>/drafter/, eval-T*/<drafter>/ (report.md, rounds.jsonl), "
                 "sps.json, sts.json, sched/<policy>-R1/, simulate/ (figure8.png); README.md lists each")
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
