"""The sections of the demo page (``dspark.evaluation.demo_page``) besides its speed numbers
(``dspark.evaluation.demo_results``): what was trained, the accepted length τ per benchmark, the
conditional acceptance per draft position (paper Fig. 2) with DSpark's verdict against DFlash, the
calibration, llama.cpp beside dspark, the time per stage and where every file is.

Each takes ``load_run``'s dict and returns markdown; a stage that has not run is named as missing.
A value shows as ``1.14 [1.09, 1.20]`` with its 95 % interval over requests (asymmetric in general),
bare where the report has no interval, and with "(no interval)" where one would rest on too few
requests or rounds (``dspark.evaluation.markdown.fmt_ci``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dspark.bootstrap import MIN_REQUESTS, MIN_ROUNDS
from dspark.evaluation.demo_results import DRAFTER_NAMES
from dspark.evaluation.demo_runs import (TAU_KEYS, drafter_order, eval_columns, link, metric, split_of,
                                         withheld_or_interval)
from dspark.evaluation.markdown import fmt_ci, fmt_number, markdown_table
from dspark.evaluation.metrics import DISPLAY_NAMES, TABLE1_ORDER
from dspark.evaluation.verdicts import PAIRED_BASELINE, position_verdicts

DOMAIN_NAMES = {"math": "Math", "code": "Code", "chat": "Chat", "avg": "Avg"}


# ---------------------------------------------------------------------------
# What was trained
# ---------------------------------------------------------------------------


def drafters_trained(run: Mapping[str, Any]) -> str:
    """"a DSpark, a DFlash and an Eagle3 drafter" from the training runs found (their variants)."""
    shown = {"dspark": "a DSpark", "dflash": "a DFlash", "eagle3": "an Eagle3"}
    names = [shown.get(str(t.get("variant")), f"a {t.get('variant')}")
             for _, t in sorted(run["training"].items(), key=lambda kv: drafter_order(kv[0]))]
    if not names:
        return "drafters"
    return (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + " drafter"


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
            for name, t in sorted(run["training"].items(), key=lambda kv: drafter_order(kv[0]))]
    if not rows:
        return "\n".join(lines + ["No training run found."])
    header = ["run", "variant", "γ", "draft layers", "steps", "minutes", "held-out τ_prob (start)", "(end)", "drafter saved"]
    return "\n".join(lines + [markdown_table(header, rows)])


# ---------------------------------------------------------------------------
# Accepted length and conditional acceptance
# ---------------------------------------------------------------------------


def tau_table(run: Mapping[str, Any]) -> str:
    """τ per benchmark and Math / Code / Chat / Avg macro averages, one column per evaluation,
    and the macro wall-clock speedup; "" without evaluations."""
    columns = eval_columns(run)
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
    columns = eval_columns(run)
    counts = run["evals"][columns[0]].get("config", {})
    n = counts.get("num_samples")
    per = f"{'/'.join(str(v) for v in sorted(set(n.values())))} prompts per benchmark" if isinstance(n, Mapping) and n else "?"
    note = (f"{per} of the {split_of(run['evals'][columns[0]])} split, {counts.get('max_new_tokens', '?')} new "
            f"tokens each, dtype {counts.get('dtype', '?')}; τ pooled over rounds; Math / Code / Chat / Avg are macro "
            "averages; [lo, hi] is the 95 % interval over requests where the report has one (the jackknife on the log "
            "scale, stratified by benchmark, Student's t at Σ (requests − 1) degrees of freedom). Speedup: tokens/s "
            "against target-only decoding of the same prompts in the same process.")
    plots = ", ".join(link(run, f"eval-T{t}/{n}/acceptance.png", f"{n} T={t}") for t, n in columns)
    return "\n".join([table, "", note, "", f"Acceptance plots: {plots}."])


def acceptance_rows(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per evaluation (T = 1 first, then DSpark, DFlash, the rest), the conditional acceptance
    P(k accepted | 1..k−1 accepted) over all rounds (paper Fig. 2): ``values`` (γ floats),
    ``cis`` (γ intervals or None: the report's 95 % interval over requests; None where it has none) and
    ``reached`` (γ round counts, the denominators each position rests on)."""
    rows = []
    for temp, name in eval_columns(run):
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
                     "cis": [withheld_or_interval(ci) for ci in cis] + [None] * (gamma - len(cis)),
                     "reached": reached + [None] * (gamma - len(reached))})
    return rows


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
    figures = ", ".join(link(run, f"report-T{t}-acceptance.png", f"T={t}") for t in temps)
    note = ("P(k accepted | 1..k−1 accepted, k verified) over all rounds of the nine benchmarks (paper Fig. 2), "
            "with its 95 % interval over requests [lo, hi] (Wilson's interval on effective counts: it never leaves "
            f"[0, 1] and is asymmetric near its ends; none below {MIN_ROUNDS} reaching rounds or {MIN_REQUESTS} "
            "requests that reached the position); in brackets the rounds that reached position k, the count each "
            "value rests on. Every draft is verified (γ positions per round).")
    return "\n".join([table, "", note, "", *dspark_vs_dflash(run), "", f"Figures (the three drafters, intervals as bars): {figures}."])


# ---------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------


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
    scored = sorted({split_of(r) for r in run["sched"].values()} or _served_split(run))
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
        f"Reliability diagrams: {link(run, 'sts_reliability.png')}; the STS file: {link(run, 'sts.json')}.",
    ])


def _served_split(run: Mapping[str, Any]) -> set[str]:
    """The split the serving simulation decoded (its results.json config), as a set; empty without one."""
    config = run["simulate"].get("config") if isinstance(run["simulate"], Mapping) else None
    return {str(config["split"])} if isinstance(config, Mapping) and config.get("split") else set()


def _scored_calibration(run: Mapping[str, Any]) -> tuple[list[Any], list[Any], str]:
    """ECE of a_k per position on the rounds of the static γ scheduled evaluation (every draft verified,
    the policies' prompts), raw and with the STS temperatures; without it, on the rounds of the serving
    simulation's static γ cell at R = 1 (the same requests); empty lists without either."""
    report = run["sched"].get((PAIRED_BASELINE, 1))
    if report is None and _served_split(run):
        return _served_calibration(run)
    pooled = (report or {}).get("all") or {}
    raw = [c.get("ece") for c in pooled.get("confidence") or []]
    calibrated = [c.get("ece") for c in pooled.get("confidence_calibrated") or []]
    return raw, calibrated, f"{split_of(report)} split, static γ" if report else "scored rounds"


def _served_calibration(run: Mapping[str, Any]) -> tuple[list[Any], list[Any], str]:
    from dspark.evaluation.metrics import confidence_quality
    from dspark.io.jsonl import read_jsonl

    rounds, _ = read_jsonl(run["dir"] / "simulate" / "rounds.jsonl")
    mine = [r for r in rounds if r.get("policy") == PAIRED_BASELINE and int(r.get("concurrency", 0)) == 1]
    temps = (run["sts"] or {}).get("temperatures") if isinstance(run["sts"], Mapping) else None
    if not mine:
        return [], [], "scored rounds"
    args = ([r.get("confidences") for r in mine], [int(r["accepted"]) for r in mine],
            [int(r["proposed"]) for r in mine])
    raw = [c.get("ece") for c in confidence_quality(*args) or []]
    calibrated = [c.get("ece") for c in (confidence_quality(*args, temps) or [])] if temps else []
    return raw, calibrated, f"{'/'.join(sorted(_served_split(run)))} split, static γ, R = 1"


def _at(values: Sequence[Any], k: int) -> Any:
    return values[k] if k < len(values) else None


# ---------------------------------------------------------------------------
# llama.cpp beside dspark
# ---------------------------------------------------------------------------


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
        for name, d in sorted(entry.get("drafters", {}).items(), key=lambda kv: drafter_order(kv[0])):
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
        f"{link(run, 'llamacpp/README.md')}.",
    ])


# ---------------------------------------------------------------------------
# Time per stage and files
# ---------------------------------------------------------------------------


STAGE_NAMES = {"data": "answers, rendering, fp8 feature cache", "vocab": "draft vocabulary (dspark vocab)",
               "profile-sps": "SPS profile of the target", "calibrate": "STS calibration",
               "simulate": "serving simulation", "llamacpp": "llama.cpp beside dspark (bench/llamacpp.py)"}
STAGE_PREFIXES = {"train-": "training", "eval-": "evaluation", "sched-": "scheduled evaluation"}


def _stage_name(stage: str) -> str:
    if stage in STAGE_NAMES:
        return STAGE_NAMES[stage]
    return next((what for prefix, what in STAGE_PREFIXES.items() if stage.startswith(prefix)), "")


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
