"""The demo page's speed numbers: the results table (the one the README shows), the scheduling
section and the serving simulation.

- ``results_table``     one row per drafter at T = 1 (τ at T = 1 and greedily, wall-clock speed), one per
                        verification policy (τ, speed, speed over static γ's paired, throughput at R > 1
                        on the SPS and the wall clock) and one for target-only decoding;
                        ``results_caption`` says which prompts it decodes.
- ``sched_rows``        per policy and R: the scheduled evaluations (wall clock, R = 1) and the
                        simulator's results (SPS clock); ``sched_section`` shows them with the paired
                        ratios (``paired_section``).
- ``simulate_section``  the serving simulation against target-only decoding at each R.

``DRAFTER_NAMES`` and ``POLICY_NAMES`` are the names the results table shows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dspark.choices import VARIANT_NAMES
from dspark.evaluation.demo_runs import (TAU_KEYS, eval_columns, is_float, link, load_run, metric, policy_order,
                                         simulated_results, split_of)
from dspark.evaluation.markdown import fmt_ci, fmt_number, markdown_table
from dspark.evaluation.verdicts import PAIRED_BASELINE, clock_cell, clock_rows, fmt_ratio, paired_rows, paired_verdict

DRAFTER_NAMES = VARIANT_NAMES
POLICY_NAMES = {"static": "static γ = {gamma}", "static1": "static ℓ = 1", "algorithm1": "Algorithm 1",
                "async": "async (Section 5.2)", "algorithm1+skip": "Algorithm 1 + skip"}
RESULTS_HEADER = ("", "requests", "R", "τ, T = 1", "τ, greedy", "speed vs target-only (T = 1, wall clock, at R)",
                  f"speed vs {PAIRED_BASELINE} γ (paired, R = 1)", "throughput vs target-only (R = {r}, SPS clock)",
                  "throughput vs target-only (R = {r}, wall clock)")


# ---------------------------------------------------------------------------
# The results table
# ---------------------------------------------------------------------------


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

    Each row says how many requests its intervals rest on (requests at T = 1 for a drafter, those of
    the scheduled evaluation or of the serving cell for a policy; the paired ratio uses the requests
    both policies decoded). One row per drafter evaluated at T = 1 (every draft verified): its
    macro-average τ at T = 1 and greedily, with its 95 % interval over requests, and its wall-clock
    speed against target-only decoding. One row per verification policy at R = 1 (DSpark, T = 1),
    from its scheduled evaluation, else from the serving simulation's cell at R = 1 (the loop's
    steps, prefills excluded): τ, wall-clock speed against target-only decoding, that speed over
    static γ's on the same requests (paired jackknife: estimate and 95 % interval), and, from the
    simulator, the throughput against target-only decoding at the smallest R > 1 on the SPS clock
    and on the wall clock. A last row: target-only decoding. "" when the folder has neither
    evaluations nor policy rows."""
    if not isinstance(run, Mapping):
        run = load_run(run)
    evals = {name: {temp: report for (temp, n), report in run["evals"].items() if n == name}
             for _, name in eval_columns(run)}
    all_rows = sched_rows(run)
    sched = [x for x in all_rows if x["R"] == 1]
    if not evals and not sched:
        return ""
    r = min((x["R"] for x in all_rows if x["R"] > 1), default=None)
    rows = []
    for name, by_temp in evals.items():
        hot = next((rep for t, rep in by_temp.items() if is_float(t) and float(t) > 0), None)
        greedy = next((rep for t, rep in by_temp.items() if is_float(t) and float(t) == 0), None)
        report = hot or greedy or {}
        gamma = report.get("gamma")
        label = _drafter_name(run, name, report) + (f" (γ = {gamma})" if gamma else "")
        rows.append([label, _requests(report), str((report.get("config") or {}).get("batch_size") or 1),
                     fmt_ci(*metric((hot or {}).get("macro"), TAU_KEYS, "avg")),
                     fmt_ci(*metric((greedy or {}).get("macro"), TAU_KEYS, "avg")),
                     fmt_ci(*metric((hot or {}).get("macro"), "speedup", "avg")), "–", "–", "–"])
    paired = {x["policy"]: x["paired"] for x in paired_rows(run)}
    at_r = {x["policy"]: fmt_ci(x["theta_ratio"], x["theta_ratio_ci"]) for x in all_rows if x["R"] == r}
    wall_r = {x["policy"]: fmt_ci(x.get("wall_ratio"), x.get("wall_ratio_ci")) for x in all_rows if x["R"] == r}
    served = run["simulate"] if isinstance(run["simulate"], Mapping) else {}
    served_gamma = (served.get("config") or {}).get("gamma")
    for x in sched:
        gamma = (run["sched"].get((x["policy"], 1)) or {}).get("gamma") or served_gamma
        p = paired.get(x["policy"])
        if x["policy"] == PAIRED_BASELINE:
            vs = "1 (baseline)"
        elif p is not None and p.speedup is not None:
            vs = fmt_ratio(p.speedup)
        else:
            vs = "–"
        # the scheduled evaluation's speed (prefills included), else the serving loop's steps at R = 1
        speed = ((x["speedup"], x["speedup_ci"]) if (x["policy"], 1) in run["sched"]
                 else (x.get("wall_ratio"), x.get("wall_ratio_ci")))
        rows.append([f"DSpark, {_policy_name(x['policy'], gamma)}", x["requests"], "1",
                     fmt_ci(x["tau"], x["tau_ci"]), "–", fmt_ci(*speed), vs,
                     at_r.get(x["policy"], "–"), wall_r.get(x["policy"], "–")])
    rows.append(["target-only decoding", "–", "–", "1", "1", "1", "–", "1", "1"])
    header = [h.replace("{r}", str(r) if r else "> 1") for h in RESULTS_HEADER]
    return markdown_table(header, rows)


def results_caption(run: Mapping[str, Any]) -> str:
    """Which prompts the results table decodes: the split, requests per benchmark and new tokens of the
    evaluations, and the splits STS was fitted on; "" without evaluations."""
    reports = [run["evals"][c] for c in eval_columns(run)] + list(run["sched"].values())
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


# ---------------------------------------------------------------------------
# Scheduled verification
# ---------------------------------------------------------------------------


def _target_only_theta(run: Mapping[str, Any], r: int) -> float | None:
    """Target-only tokens per SPS-clock second with R requests always live: R · SPS(R), on the
    simulator's clock (its ``target_only_throughput``: the measured medians where the profile was
    there), else on the SPS table."""
    for sim in simulated_results(run).values():
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
        tau_ci = sim.get("tau_ci") if isinstance(sim.get("tau_ci"), Sequence) else None
    theta, theta0 = sim.get("throughput"), _target_only_theta(run, r)
    speedup, speedup_ci = metric(a, "speedup")
    decode, decode_ci = metric(a, "decode_speedup")
    ratio = theta / theta0 if isinstance(theta, (int, float)) and theta0 else None
    ratio_ci = sim.get("vs_target_only_table_ci")
    if not (isinstance(ratio_ci, Sequence) and len(ratio_ci) == 2 and ratio is not None):
        ratio_ci = None
    clocks = clock_rows(run).get(policy) if r == 1 and report is not None else None
    cell = clock_cell(clocks)
    wall_ratio, wall_ratio_ci = sim.get("wall_vs_target_only"), sim.get("wall_vs_target_only_ci")
    if simulated is None and clocks is not None and math.isfinite(clocks.sps):
        # R = 1 without a serving cell: the scheduled evaluation is the serving loop at R = 1; its SPS
        # clock's ratio (dspark.evaluation.clocks) and its decode-only wall-clock speedup
        ratio, ratio_ci, wall_ratio, wall_ratio_ci = clocks.sps, None, decode, decode_ci
        theta = ratio * theta0 if theta0 else None
    served = sim.get("clocks") if isinstance(sim.get("clocks"), Mapping) else None
    if cell == "–" and served is not None and served.get("difference") is not None:
        # the batched serving loop: the two clocks' ratios to target-only, sps / wall − 1 (dspark.evaluation.clocks)
        cell = f"{fmt_ci(served['difference'], [served.get('lo'), served.get('hi')])} (rel.): {served.get('verdict', '–')}"
    return {"policy": policy, "R": r, "tau": tau, "tau_ci": tau_ci, "mean_ell": mean_ell,
            "wall_ratio": wall_ratio, "wall_ratio_ci": wall_ratio_ci,
            "tokens_per_s": a.get("tokens_per_s") if report is not None else sim.get("wall_throughput"),
            "baseline_tokens_per_s": (a.get("baseline_tokens_per_s") if report is not None
                                      else sim.get("target_only_wall")),
            "speedup": speedup, "speedup_ci": speedup_ci, "decode_speedup": decode, "decode_speedup_ci": decode_ci,
            "theta": theta, "theta_target": theta0, "theta_ratio": ratio, "theta_ratio_ci": ratio_ci,
            "clock_difference": clocks, "clocks": cell,
            "requests": _requests(report) if report is not None else _served_requests(sim),
            **(_round_costs(report) if report is not None else _served_round_costs(sim, r))}


def _served_requests(sim: Mapping[str, Any]) -> str:
    n = sim.get("requests_finished")
    return str(int(n)) if isinstance(n, (int, float)) else "–"


def _served_round_costs(sim: Mapping[str, Any], r: int) -> dict[str, float | None]:
    """Draft and verify seconds per round of a serving cell at R = 1 over its target-only decode's
    seconds per token (one token a step); None at R > 1, where a step serves several rounds."""
    rounds, drafted, base = sim.get("request_steps"), sim.get("drafted_rounds"), sim.get("target_only_wall")
    ok = r == 1 and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (rounds, base))
    if not ok:
        return {"draft_steps": None, "verify_steps": None}
    draft = float(sim.get("draft_s", math.nan)) / drafted * base if drafted else None
    return {"draft_steps": draft, "verify_steps": float(sim.get("verify_s", math.nan)) / rounds * base}


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


def sched_rows(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per policy and R of the demo's scheduling concurrencies (default 1 and 4), in the
    demo's policy order: the scheduled evaluations and the simulator's results of those R."""
    wanted = set((run["demo"].get("schedule") or {}).get("concurrencies") or (1, 4))
    simulated = simulated_results(run)
    keys = set(run["sched"]) | {k for k in simulated if k[1] in wanted}
    keys = sorted(keys, key=policy_order(run))
    return [sched_row(run, p, r, run["sched"].get((p, r)), simulated.get((p, r))) for p, r in keys]


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
        cells.append([x["policy"], fmt_ratio(p.speedup), fmt_ratio(p.tau), paired_verdict(p.speedup, baseline),
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
              fmt_ci(x.get("wall_ratio"), x.get("wall_ratio_ci")), x["clocks"], fmt_number(x["draft_steps"]),
              fmt_number(x["verify_steps"])]
             for x in rows]
    scheduled = any(r == 1 for _, r in run["sched"])
    wall = (
        "**Wall clock** (R = 1, `dspark eval --policy POLICY`, folders `sched/`): tokens/s of the speculative "
        "decode against target-only decoding of the same prompts, measured in the same process; τ, mean ℓ and the "
        "per-round costs come from it. Draft / verify per round: seconds per round over the target-only seconds per "
        "decode step (prefills excluded)" if scheduled else
        "**Wall clock**: every row, R = 1 included, from the serving loop below (`dspark simulate`, folder "
        "`simulate/`, column Θ ratio (wall clock, batched)); τ with its 95 % interval over the requests, and mean ℓ, "
        "from its rounds. Draft / verify per round (R = 1): seconds per round over the seconds per token of "
        "target-only decoding of the same requests (prefills excluded)")
    same_decode = (
        "at R = 1, the scheduled evaluation's own requests timed by both clocks (the same "
        "decode, the same tokens): the SPS clock's ratio to target-only decoding (its verification forwards "
        "priced by the measured table, every other phase as measured, `dspark.evaluation.clocks`) minus the "
        "wall clock's decode-only speedup, with the 95 % interval of that paired difference over requests and "
        "the table's timing noise" if scheduled else "at R = 1 the same")
    note = (
        f"DSpark at T = 1 on the same prompts under each policy. {wall}; a round costs "
        "about draft + verify target steps and yields τ tokens, so the drafting cost is what keeps a policy that "
        "verifies nothing (ℓ = 0) below target-only speed. **SPS clock** (`dspark simulate`, folder `simulate/`): "
        "R requests live at every step (the prompts are cycled), each step charged 1 / SPS(B) for its "
        "B = Σ(1 + ℓ_r) tokens at the profile's measured medians (the policies decide on the noise-aware table, "
        "whose rises within the timing noise are flattened) plus every other phase measured in it (drafting, "
        "acceptance, cache and context bookkeeping, the policy's decision; the demo runs it with "
        "`--draft-overhead measured`), put on the table's time scale by the ratio of the table's price of the run's "
        "verification forwards to their measured seconds, against R·SPS(R) for target-only "
        "decoding. The serving loop is batched (one drafter and one target forward per step for every live "
        "request, each forward padded to 1 + max ℓ_r and priced at that size), so the same steps are also timed "
        "on the wall clock: **Θ ratio (wall clock, batched)** is their tokens/s over target-only decoding of the "
        "same requests at the same R, measured in the same process, with its 95 % interval over the requests (each "
        "takes its share of every step in both decodes and is left out of both at once: the stratified jackknife, "
        "`dspark.evaluation.clocks.serving_wall_ratio`). Rows without a scheduled evaluation "
        "show the simulator's τ and mean ℓ. The Θ ratio's interval is the SPS table's own timing noise: the run's steps "
        "priced by 1000 tables of the profile's sweeps resampled jointly across B (every decision kept). "
        "**SPS vs wall clock**: at R > 1 (\"rel.\"), the SPS clock's ratio to target-only decoding over the wall "
        "clock's, minus 1 (the target-only decode served step by step in turn with the five policies' cells of "
        "that R, its forwards priced on the same table, its sampling and bookkeeping as measured), with "
        f"its interval over the requests (each takes its share of every step) and the table's noise; {same_decode}; "
        "\"agree\" means the interval holds 0.")
    served_at_1 = {p for p, r in simulated_results(run) if r == 1}
    if any(x["R"] == 1 and x["policy"] not in served_at_1 and x["theta"] is not None for x in rows):
        note += (" At R = 1 the scheduled evaluation is the serving loop's run (one request live), so rows without "
                 "a serving cell at R = 1 take Θ from its SPS clock (the ratio of the SPS vs wall clock column) and "
                 "Θ ratio (wall clock, batched) from its decode-only speedup.")
    paired = paired_section(run)
    return "\n".join([markdown_table(header, cells), "", note] + (["", paired] if paired else []))


# ---------------------------------------------------------------------------
# The serving simulation
# ---------------------------------------------------------------------------


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
        f"{link(run, 'simulate/figure8.png')}, {link(run, 'simulate/frontier.png')}, SPS table "
        f"{link(run, 'sps.png')}.",
    ])


def _draft_charge(overhead: Any) -> str:
    if overhead == "measured":
        return "as measured (each step pays every phase it took but the target's verification)"
    return f"as {overhead} of a step" if overhead else "not at all (draft_overhead 0)"
