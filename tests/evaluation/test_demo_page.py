"""The demo summary (dspark.evaluation.demo_page, `dspark summary`) on a run folder built by hand.

Every number the tests check is computed by hand from the small JSON files below."""

import json
import math
from pathlib import Path

import pytest

from dspark.cli.main import main
from dspark.evaluation.demo_page import summary_markdown, write_summary
from dspark.evaluation.demo_results import results_table, sched_row
from dspark.evaluation.demo_runs import load_run, metric
from dspark.evaluation.markdown import fmt_ci
from dspark.evaluation.verdicts import clock_cell, clock_rows

SPS = {"sample_batch_tokens": [1, 4], "sample_steps_per_sec": [10.0, 8.0], "max_batch_tokens": 512}


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _eval_report(tau, tau_ci=None, macro_ci=None):
    """An eval report with two benchmarks; τ under the bootstrap work's key names when intervals are given."""
    key = "tau_pooled" if tau_ci else "tau"
    bench = {key: tau}
    if tau_ci:
        bench[f"{key}_ci"] = tau_ci
    macro = {key: {"math": tau, "code": tau, "chat": tau, "avg": tau}, "speedup": {"avg": 0.8}}
    if macro_ci:
        macro[f"{key}_ci"] = {"avg": macro_ci}
    return {"label": "dspark", "gamma": 4, "benchmarks": {"gsm8k": dict(bench), "mt-bench": dict(bench)},
            "all": {"num_requests": 6}, "macro": macro, "config": {"num_samples": {"gsm8k": 3, "mt-bench": 3}, "max_new_tokens": 16,
                                       "dtype": "float32"}}


def _sched_report():
    """A scheduled evaluation at γ = 4: 10 rounds of 2 requests, target-only 22 tokens in 12 s (2 s prefill)."""
    return {
        "label": "algorithm1", "gamma": 4,
        "all": {"tau": 1.2, "tau_ci": [1.1, 1.3], "verify_rate": 0.5, "num_rounds": 10, "num_requests": 2,
                "tokens_per_s": 3.0, "baseline_tokens_per_s": 4.0, "baseline_tokens": 22, "speedup": 0.75},
        "timings": {"spec_phases_s": {"draft": 1.0, "verify": 3.0}, "baseline_s": 12.0,
                    "baseline_phases_s": {"prefill": 2.0}},
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as scripts/demo.sh writes it, with one of each file (no plots but one)."""
    root = tmp_path / "demo"
    _write(root / "demo.json", {"mode": "quick", "epochs": 1, "configs": ["config/dspark/x.py"],
                                "schedule": {"policies": ["static", "algorithm1"]}})
    _write(root / "timings.json", {"data": 60.0, "train-dspark": 120.0, "calibrate": 30.0})
    log = [{"step": 0, "wall_min": 0.0, "eval_tau_prob": 1.02}, {"step": 5, "wall_min": 2.5, "eval_tau_prob": 1.08}]
    (root / "dspark_x").mkdir(parents=True)
    (root / "dspark_x" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    _write(root / "dspark_x" / "drafter" / "config.json", {"dspark_variant": "dspark", "block_size": 4,
                                                           "num_hidden_layers": 2})
    _write(root / "eval-T1.0" / "dspark_x" / "report.json", _eval_report(1.14, [1.10, 1.20], [1.09, 1.19]))
    (root / "eval-T1.0" / "dspark_x" / "acceptance.png").write_bytes(b"png")
    _write(root / "eval-T0.0" / "dspark_x" / "report.json", _eval_report(1.05))
    _write(root / "sps.json", SPS)
    _write(root / "sts.json", {"temperatures": [1.5, 1.0], "ece_before": [0.2, 0.1], "ece_after": [0.05, 0.1],
                               "brier_before": [0.09, 0.01], "brier_after": [0.08, 0.01],
                               "kept": [None, "0 accepted prefixes < min_events=10"],
                               "evaluated_on": "test", "split": {"fit_requests": 3, "test_requests": 4}})
    _write(root / "sched" / "algorithm1-R1" / "report.json", _sched_report())
    _write(root / "sched" / "static-R1" / "report.json", _sched_report())
    results = [{"policy": p, "concurrency": r, "throughput": 20.0, "tau": 1.05, "mean_ell": 0.5}
               for p in ("static", "algorithm1") for r in (1, 4, 16)]
    _write(root / "simulate" / "results.json", {"config": {"num_prompts": 2}, "results": results})
    return root


def test_an_interval_is_shown_as_its_bounds_and_its_absence_leaves_the_value():
    assert fmt_ci(1.14, (1.09, 1.19)) == "1.14 [1.09, 1.19]"
    assert fmt_ci(0.03, (0.005, 0.16)) == "0.03 [0.01, 0.16]"  # asymmetric: what "±" could not say
    assert fmt_ci(1.14, None) == "1.14"
    assert fmt_ci(1.14, (float("nan"), float("nan"))) == "1.14 (no interval)"
    assert fmt_ci(None, (1.0, 2.0)) == "–"


def test_an_interval_narrower_than_the_last_digit_gets_one_more_decimal():
    assert fmt_ci(1.1412, (1.1400, 1.1424)) == "1.141 [1.140, 1.142]"


def test_metric_reads_the_sibling_interval_or_the_older_key_without_one():
    assert metric({"tau_pooled": 1.2, "tau_pooled_ci": [1.1, 1.3]}, ("tau_pooled", "tau")) == (1.2, (1.1, 1.3))
    assert metric({"tau": 1.2}, ("tau_pooled", "tau")) == (1.2, None)
    macro = {"tau": {"avg": 1.3}, "tau_ci": {"avg": [1.2, 1.4]}}
    assert metric(macro, "tau", "avg") == (1.3, (1.2, 1.4))
    value, ci = metric({"tau": 1.2, "tau_ci": [None, 1.3]}, "tau")  # withheld (null in report.json)
    assert value == 1.2 and all(math.isnan(x) for x in ci) and fmt_ci(value, ci) == "1.20 (no interval)"
    assert metric({"tau": 1.2, "tau_ci": "broken"}, "tau") == (1.2, None)
    assert metric(None, "tau") == (None, None)


def test_a_scheduling_row_accounts_the_round_in_target_steps_and_compares_the_sps_clock_to_target_only(run_dir):
    run = load_run(run_dir)
    simulated = {"throughput": 20.0, "tau": 1.05, "mean_ell": 0.5}
    row = sched_row(run, "algorithm1", 1, run["sched"][("algorithm1", 1)], simulated)
    # mean ℓ = verify_rate · γ = 0.5 · 4; a target step = (12 - 2) s / (22 - 2 requests' first tokens) = 0.5 s
    assert row["mean_ell"] == pytest.approx(2.0) and row["tau"] == 1.2
    assert row["draft_steps"] == pytest.approx(1.0 / 10 / 0.5)
    assert row["verify_steps"] == pytest.approx(3.0 / 10 / 0.5)
    assert row["tau_ci"] == (1.1, 1.3) and row["speedup"] == 0.75 and row["speedup_ci"] is None
    # target-only Θ at R = 1 is SPS(1) = 10
    assert (row["theta"], row["theta_target"], row["theta_ratio"]) == pytest.approx((20.0, 10.0, 2.0))


def _clock_folder(folder: Path) -> None:
    """requests.jsonl and rounds.jsonl of a scheduled evaluation at R = 1: two benchmarks of two requests."""
    records, rounds = [], []
    for b, bench in enumerate(("gsm8k", "mt-bench")):
        step = 0  # one request at a time: every round is a step of its own
        for q in range(2):
            ells = [4, 2, 4] if q == 0 else [1, 4]
            records.append({"benchmark": bench, "request": q, "prompt_tokens": 9, "tokens": 8 + b + q, "wall_s": 2.0 + q,
                            "timings": {"prefill": 0.2, "draft": 0.3, "verify": 1.0 + 0.5 * q, "accept": 0.1,
                                        "bookkeeping": 0.1, "schedule": 0.05, "total": 1.75 + 0.5 * q},
                            "baseline_tokens": 8 + b + q, "baseline_wall_s": 2.2 + q,
                            "baseline_timings": {"prefill": 0.2, "decode": 1.9 + q, "sample": 0.1}})
            rounds += [{"benchmark": bench, "request": q, "round": i, "proposed": ell, "accepted": 1, "step": step + i,
                        "batch_tokens": 1 + ell, "drafted": True} for i, ell in enumerate(ells)]
            step += len(ells)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    report = json.loads((folder / "report.json").read_text())
    report["config"] = {"concurrency": 1}
    (folder / "report.json").write_text(json.dumps(report))


def test_a_scheduling_row_at_r1_carries_the_paired_difference_of_the_two_clocks(run_dir):
    from dspark.evaluation.clocks import clock_difference
    from dspark.evaluation.report import write_profile
    from dspark.scheduling.sps_profile import SPSProfile

    _clock_folder(run_dir / "sched" / "algorithm1-R1")
    sweeps = [[0.10, 0.102, 0.098, 0.101, 0.099, 0.1], [0.12, 0.121, 0.119, 0.12, 0.122, 0.118],
              [0.14, 0.141, 0.139, 0.14, 0.142, 0.138]]
    profile = SPSProfile([1, 2, 8], sweeps, [sorted(x)[3] for x in sweeps], 128, None, 1, 6, "cpu", "float32", 1)
    write_profile(profile, run_dir / "sps.json")
    run = load_run(run_dir)
    row = sched_row(run, "algorithm1", 1, run["sched"][("algorithm1", 1)], {"throughput": 20.0})
    want = clock_difference(run_dir / "sched" / "algorithm1-R1", run_dir / "sps.json")
    assert row["clock_difference"] == want and row["clocks"] == clock_cell(want)
    assert row["clocks"] == f"{fmt_ci(want.difference, [want.lo, want.hi])}: {want.verdict}"
    assert want.verdict in ("agree", "SPS clock above", "SPS clock below")
    assert clock_rows(run)["static"] is None  # no round logs there: no difference, the cell says "–"
    assert sched_row(run, "static", 1, run["sched"][("static", 1)], None)["clocks"] == "–"
    assert sched_row(run, "algorithm1", 4, None, {"throughput": 20.0})["clocks"] == "–"  # R > 1: no wall clock


def test_a_scheduling_row_at_r1_without_a_serving_cell_takes_both_clocks_from_the_scheduled_evaluation(run_dir):
    """simulate ran at R > 1 only: Θ ratio at R = 1 is the evaluation's SPS-clock ratio, Θ that ratio times
    SPS(1) = 10 tok/s, and the wall-clock Θ ratio its decode-only speedup (the same serving loop at R = 1)."""
    from dspark.evaluation.demo_results import sched_section
    from dspark.evaluation.report import write_profile
    from dspark.scheduling.sps_profile import SPSProfile

    _clock_folder(run_dir / "sched" / "algorithm1-R1")
    report = json.loads((run_dir / "sched" / "algorithm1-R1" / "report.json").read_text())
    report["all"].update(decode_speedup=0.8, decode_speedup_ci=[0.7, 0.9])
    _write(run_dir / "sched" / "algorithm1-R1" / "report.json", report)
    sweeps = [[0.10, 0.102, 0.098, 0.101, 0.099, 0.1], [0.12, 0.121, 0.119, 0.12, 0.122, 0.118],
              [0.14, 0.141, 0.139, 0.14, 0.142, 0.138]]
    write_profile(SPSProfile([1, 2, 8], sweeps, [sorted(x)[3] for x in sweeps], 128, None, 1, 6, "cpu", "float32", 1),
                  run_dir / "sps.json")
    results = json.loads((run_dir / "simulate" / "results.json").read_text())
    results["results"] = [r for r in results["results"] if r["concurrency"] != 1]
    _write(run_dir / "simulate" / "results.json", results)
    run = load_run(run_dir)
    diff = clock_rows(run)["algorithm1"]
    row = sched_row(run, "algorithm1", 1, run["sched"][("algorithm1", 1)], None)
    theta0 = float(json.loads((run_dir / "sps.json").read_text())["sample_steps_per_sec"][0])
    assert row["theta_ratio"] == pytest.approx(diff.sps) and row["theta_ratio_ci"] is None
    assert row["theta"] == pytest.approx(diff.sps * theta0) and row["theta_target"] == pytest.approx(theta0)
    assert (row["wall_ratio"], row["wall_ratio_ci"]) == (0.8, (0.7, 0.9))
    assert "rows without a serving cell at R = 1 take Θ from its SPS clock" in sched_section(run)
    with_cell = sched_row(run, "algorithm1", 1, run["sched"][("algorithm1", 1)], {"throughput": 20.0})
    assert with_cell["theta"] == 20.0 and with_cell["wall_ratio"] is None  # a cell's own clocks win


def test_a_scheduling_row_carries_the_simulators_table_interval(run_dir):
    run = load_run(run_dir)
    simulated = {"throughput": 20.0, "tau": 1.05, "mean_ell": 0.5, "vs_target_only_table_ci": [1.8, 2.2]}
    row = sched_row(run, "algorithm1", 1, run["sched"][("algorithm1", 1)], simulated)
    assert row["theta_ratio"] == pytest.approx(2.0) and row["theta_ratio_ci"] == [1.8, 2.2]
    assert sched_row(run, "algorithm1", 1, None, {"throughput": 20.0})["theta_ratio_ci"] is None


def test_a_row_without_a_scheduled_evaluation_takes_tau_and_ell_from_the_simulator(run_dir):
    row = sched_row(load_run(run_dir), "algorithm1", 4, None, {"throughput": 20.0, "tau": 1.05, "mean_ell": 0.5})
    assert (row["tau"], row["tau_ci"], row["mean_ell"]) == (1.05, None, 0.5)
    # target-only Θ at R = 4 is 4 · SPS(4) = 32; no wall clock at R = 4
    assert (row["theta_target"], row["theta_ratio"]) == pytest.approx((32.0, 20.0 / 32.0))
    assert row["speedup"] is None and row["draft_steps"] is None


def test_the_page_has_every_section_with_intervals_links_and_missing_stages_named(run_dir):
    page = summary_markdown(load_run(run_dir))
    for heading in ("## 1. What was trained", "## 2. Accepted length τ", "## 3. Calibration",
                    "## 4. Scheduled verification", "## 5. Serving simulation", "## 6. Time per stage", "## 7. Files"):
        assert heading in page
    assert "| GSM8K | 1.14 [1.10, 1.20] | 1.05 |" in page  # per benchmark, and no interval at T = 0
    assert "| **Avg** | 1.14 [1.09, 1.19] | 1.05 |" in page
    assert "| dspark_x | dspark | 4 | 2 | 5 | 2.5 | 1.020 | 1.080 | yes |" in page
    assert "| 1 | 1.500 | fitted | 0.2000 | 0.0500 | 0.0900 | 0.0800 |" in page  # the guard, ECE and Brier before/after
    assert "| 2 | 1.000 | 0 accepted prefixes < min_events=10 | 0.1000 | 0.1000 | 0.0100 | 0.0100 |" in page
    assert "[dspark_x T=1.0](eval-T1.0/dspark_x/acceptance.png)" in page
    assert "dspark_x T=0.0 (missing)" in page
    assert "simulate/figure8.png (missing)" in page
    assert "| algorithm1 | 4 | 1.05 | 0.50 | – |" in page and "| algorithm1 | 16 |" not in page.split("## 5.")[0]
    assert "| **total** |  | 3.5 |" in page
    lines = page.splitlines()
    static, alg = (next(i for i, line in enumerate(lines) if line.startswith(f"| {p} | 1 |")) for p in ("static", "algorithm1"))
    assert static < alg  # the demo's policy order, not the alphabet


def test_a_training_log_line_cut_by_a_killed_run_is_skipped(run_dir):
    with (run_dir / "dspark_x" / "train_log.jsonl").open("a") as f:
        f.write('{"step": 6, "wa')
    training = load_run(run_dir)["training"]["dspark_x"]
    assert (training["steps"], training["tau_prob_last"]) == (5, 1.08)
    write_summary(run_dir)  # the learning-curve plot is left out, the page is still written
    assert "curves.png (missing)" in (run_dir / "README.md").read_text()


def test_write_summary_writes_the_page_and_the_learning_curves_and_returns_the_short_text(run_dir):
    path, short = write_summary(run_dir)
    assert path == run_dir / "README.md" and path.read_text().startswith("# dspark demo: demo")
    assert (run_dir / "curves.png").stat().st_size > 0
    assert "τ macro avg, dspark_x T=1.0: 1.14 [1.09, 1.19]" in short
    assert "ECE per position before->after STS: 0.200->0.050 0.100->0.100" in short
    assert "total 3.5" in short


def test_the_summary_command_prints_the_short_text_and_names_a_missing_folder(run_dir, tmp_path, capsys):
    assert main(["summary", str(run_dir)]) == 0
    assert "summary with the plots linked" in capsys.readouterr().out
    assert main(["summary", str(tmp_path / "nowhere")]) == 2
    assert "no such run folder" in capsys.readouterr().err


def test_the_headline_names_the_trained_drafters_and_stages_get_a_description():
    from dspark.evaluation.demo_sections import _stage_name, drafters_trained

    run = {"training": {"dflash_x": {"variant": "dflash"}, "dspark_x": {"variant": "dspark"}, "eagle3_x": {"variant": "eagle3"}}}
    assert drafters_trained(run) == "a DSpark, a DFlash and an Eagle3 drafter"
    assert drafters_trained({"training": {}}) == "drafters"
    assert _stage_name("train-eagle3_x") == "training" and _stage_name("sched-algorithm1+skip-R1") == "scheduled evaluation"
    assert _stage_name("vocab").startswith("draft vocabulary") and _stage_name("other") == ""


def test_the_results_table_has_a_row_per_drafter_per_policy_and_target_only(run_dir):
    rows = results_table(run_dir).splitlines()  # a folder, read with load_run
    assert rows[0] == ("|  | requests | R | τ, T = 1 | τ, greedy | speed vs target-only (T = 1, wall clock, at R) "
                       "| speed vs static γ (paired, R = 1) | throughput vs target-only (R = 4, SPS clock) "
                       "| throughput vs target-only (R = 4, wall clock) |")
    # macro τ at T = 1 in [1.09, 1.19]; greedy without an interval; macro speedup 0.8 (R: a report without
    # batch_size decoded one request at a time)
    assert rows[2] == "| DSpark (γ = 4) | 6 | 1 | 1.14 [1.09, 1.19] | 1.05 | 0.80 | – | – | – |"  # 3 + 3 requests
    # scheduled: τ 1.2 in [1.1, 1.3], speed 0.75; R = 4 on the SPS clock: Θ 20 over 4 · SPS(4) = 32 → 0.625;
    # no wall clock in the simulation's results: "–"
    assert rows[3] == "| DSpark, static γ = 4 | 2 | 1 | 1.20 [1.10, 1.30] | – | 0.75 | 1 (baseline) | 0.62 | – |"
    # no round logs in the folder: the paired ratio cannot be computed and is left blank
    assert rows[4] == "| DSpark, Algorithm 1 | 2 | 1 | 1.20 [1.10, 1.30] | – | 0.75 | – | 0.62 | – |"
    assert rows[5] == "| target-only decoding | – | – | 1 | 1 | 1 | – | 1 | 1 |" and len(rows) == 6


def test_without_scheduled_evaluations_the_policy_rows_come_from_the_serving_cells_at_r1(run_dir):
    import shutil

    shutil.rmtree(run_dir / "sched")
    cell = {"throughput": 20.0, "tau": 1.3, "tau_ci": [1.2, 1.4], "mean_ell": 2.0, "requests_finished": 36,
            "wall_vs_target_only": 0.96, "wall_vs_target_only_ci": [0.92, 1.0], "target_only_wall": 20.0,
            "request_steps": 100, "drafted_rounds": 100, "draft_s": 0.5, "verify_s": 4.0}
    results = [{"policy": "static", "concurrency": 1, **cell},
               {"policy": "algorithm1", "concurrency": 1, **cell},
               {"policy": "static", "concurrency": 4, "throughput": 40.0, "tau": 1.3, "mean_ell": 4.0},
               {"policy": "algorithm1", "concurrency": 4, "throughput": 48.0, "tau": 1.3, "mean_ell": 1.0}]
    _write(run_dir / "simulate" / "results.json", {"config": {"gamma": 4}, "results": results})
    run = load_run(run_dir)
    row = sched_row(run, "algorithm1", 1, None, results[1])
    # per round: 0.5 s / 100 rounds of drafting and 4 s / 100 of verification over 1 / 20 s per target-only token
    assert (row["requests"], row["draft_steps"], row["verify_steps"]) == ("36", pytest.approx(0.1), pytest.approx(0.8))
    rows = results_table(run).splitlines()
    # τ with the cell's interval, the wall clock of the loop's steps; no paired ratio without scheduled
    # evaluations (each policy against its own target-only decode); R = 4 on the SPS clock: 48 / (4 · SPS(4) = 32)
    assert rows[3] == "| DSpark, static γ = 4 | 36 | 1 | 1.30 [1.20, 1.40] | – | 0.96 [0.92, 1.00] | 1 (baseline) | 1.25 | – |"
    assert rows[4] == "| DSpark, Algorithm 1 | 36 | 1 | 1.30 [1.20, 1.40] | – | 0.96 [0.92, 1.00] | – | 1.50 | – |"
    page = summary_markdown(run)
    assert "| policy (R = 1) |" not in page and "folders `sched/`" not in page


def test_the_results_table_is_empty_without_evaluations_and_leads_the_page(run_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert results_table(empty) == ""
    page = summary_markdown(load_run(run_dir))
    assert page.index("## Results") < page.index("## 1. What was trained")
    assert results_table(load_run(run_dir)) in page


def _acceptance_report(label, values, cis, reached):
    """An eval report whose pooled rounds carry the conditional acceptance per position."""
    return {"label": label, "gamma": len(values), "benchmarks": {}, "macro": {},
            "all": {"conditional_acceptance": values, "conditional_acceptance_ci": cis,
                    "conditional_acceptance_den": reached}}


@pytest.fixture
def acceptance_run(tmp_path: Path) -> Path:
    """DSpark and DFlash at T = 0 over γ = 4: k = 2 DSpark's interval wholly above, k = 3 overlapping,
    k = 4 reached by no DFlash round (no interval)."""
    root = tmp_path / "acc"
    _write(root / "eval-T0.0" / "dspark_x" / "report.json", _acceptance_report(
        "dspark", [0.30, 0.20, 0.10, 0.0], [[0.26, 0.34], [0.15, 0.25], [0.02, 0.20], [None, None]], [900, 270, 54, 5]))
    _write(root / "eval-T0.0" / "dflash_x" / "report.json", _acceptance_report(
        "dflash", [0.28, 0.05, 0.12, None], [[0.24, 0.32], [0.01, 0.09], [0.0, 0.30], None], [900, 252, 13, 0]))
    return root


def test_the_acceptance_table_shows_each_position_with_its_interval_and_the_rounds_it_rests_on(acceptance_run):
    from dspark.evaluation.demo_sections import acceptance_table

    rows = acceptance_table(load_run(acceptance_run)).splitlines()
    assert rows[0] == "| drafter | k=1 | k=2 | k=3 | k=4 |"
    # DSpark first; a position no round reached shows a dash and its zero count
    assert rows[2] == ("| dspark T=0.0 | 0.30 [0.26, 0.34] (900) | 0.20 [0.15, 0.25] (270) | 0.10 [0.02, 0.20] (54) "
                       "| 0.00 (no interval) (5) |")
    assert rows[3] == "| dflash T=0.0 | 0.28 [0.24, 0.32] (900) | 0.05 [0.01, 0.09] (252) | 0.12 [0.00, 0.30] (13) | – (0) |"
    assert acceptance_table(load_run(acceptance_run), last=2).splitlines()[0] == "| drafter | k=1 | k=2 |"


def test_dspark_is_above_dflash_only_where_the_two_intervals_are_apart(acceptance_run):
    from dspark.evaluation.demo_sections import acceptance_rows, dspark_vs_dflash
    from dspark.evaluation.verdicts import position_verdicts

    dspark, dflash = acceptance_rows(load_run(acceptance_run))
    # k = 2: 0.15 > 0.09 apart; k = 3: [0.02, 0.20] and [0.0, 0.30] overlap; k = 4: DFlash has none.
    assert position_verdicts(dspark, dflash) == {"above": [2], "below": [], "overlap": [3], "unmeasured": [4]}
    assert position_verdicts(dflash, dspark) == {"above": [], "below": [2], "overlap": [3], "unmeasured": [4]}
    assert dspark_vs_dflash(load_run(acceptance_run)) == [
        "T=0.0: DSpark against DFlash: above beyond both intervals at k = 2 (0.20 [0.15, 0.25] against "
        "0.05 [0.01, 0.09]); intervals overlap at k = 3; no interval at k = 4."]


def test_the_page_and_the_short_text_carry_the_acceptance_table_and_the_verdict(acceptance_run):
    page = summary_markdown(load_run(acceptance_run))
    assert "### Conditional acceptance per draft position" in page
    assert "| dspark T=0.0 | 0.30 [0.26, 0.34] (900) |" in page
    assert "T=0.0 (missing)" in page  # the comparison figure of `dspark compare` is not in this folder
    _, short = write_summary(acceptance_run)
    assert "above beyond both intervals at k = 2" in short and "| dflash T=0.0 |" in short


def test_without_dflash_there_is_no_verdict_and_without_evaluations_no_table(run_dir, tmp_path):
    from dspark.evaluation.demo_sections import acceptance_section, dspark_vs_dflash

    run = load_run(run_dir)  # DSpark alone, reports without per-position curves
    assert dspark_vs_dflash(run) == [] and acceptance_section(run) == "No evaluation report found."


def test_the_page_says_which_split_each_stage_decoded_and_whether_sts_saw_the_scored_prompts(run_dir):
    from dspark.evaluation.demo_results import results_caption
    from dspark.evaluation.demo_sections import calibration_section

    # The fixture's reports record no split ("all"), and its STS file no fitted_on: overlap is possible.
    run = load_run(run_dir)
    assert "may share prompts with the rounds STS was fitted on" in calibration_section(run)
    assert results_caption(run).startswith("Prompts: the all split of each benchmark, 3 per benchmark × 16 new tokens.")
    # The demo's design: evaluations and policies on test, STS fitted on a dev evaluation.
    for folder in ("eval-T1.0/dspark_x", "eval-T0.0/dspark_x", "sched/algorithm1-R1", "sched/static-R1"):
        report = json.loads((run_dir / folder / "report.json").read_text())
        report.setdefault("config", {})["split"] = "test"
        (run_dir / folder / "report.json").write_text(json.dumps(report))
    sts = json.loads((run_dir / "sts.json").read_text())
    sts["fitted_on"] = [{"rounds": "dev/dspark_x/rounds.jsonl", "split": "dev"}]
    (run_dir / "sts.json").write_text(json.dumps(sts))
    run = load_run(run_dir)
    section = calibration_section(run)
    assert "DSpark's T = 1 evaluation on the dev split" in section
    assert "scored on the test split: prompts the fit never saw" in section
    assert results_caption(run) == ("Prompts: the test split of each benchmark, 3 per benchmark × 16 new tokens. The "
                                    "drafters' recipe is chosen on the dev split (bench/recipe_study.py), which shares "
                                    "no prompt with it. STS was fitted on the dev split.")
    assert results_caption(run) in summary_markdown(run)


def test_the_calibration_table_shows_the_ece_on_the_scored_rounds_raw_and_with_sts(run_dir):
    from dspark.evaluation.demo_sections import calibration_section

    report = json.loads((run_dir / "sched" / "static-R1" / "report.json").read_text())
    report["all"]["confidence"] = [{"ece": 0.12}, {"ece": 0.05}]
    report["all"]["confidence_calibrated"] = [{"ece": 0.08}, {"ece": 0.05}]
    (run_dir / "sched" / "static-R1" / "report.json").write_text(json.dumps(report))
    section = calibration_section(load_run(run_dir))
    assert "| ECE raw (all split, static γ) | ECE after STS (all split, static γ) |" in section
    assert "| 1 | 1.500 | fitted | 0.2000 | 0.0500 | 0.0900 | 0.0800 | 0.1200 | 0.0800 |" in section


def test_the_llamacpp_section_shows_the_chosen_setting_beside_the_static_one_and_target_alone():
    from dspark.evaluation.demo_sections import llamacpp_section

    tri = lambda x: {"macro": [x, x - 0.1, x + 0.1]}  # noqa: E731
    results = {
        "settings": {"threads": 2, "requests": 36, "drafters": {
            "dspark_smollm2_135m": {"variant": "dspark", "gamma": 4},
            "dspark_smollm2_135m@chosen": {"variant": "dspark", "gamma": 2, "p_min": 0.5,
                                           "static_of": "dspark_smollm2_135m"}}},
        "temperatures": {"0.0": {
            "target": {"tokens_per_s": tri(120.0)},
            "drafters": {"dspark_smollm2_135m": {"tau": tri(1.5), "tokens_per_s": tri(40.0), "speedup": tri(0.33)},
                         "dspark_smollm2_135m@chosen": {"tau": tri(1.4), "tokens_per_s": tri(90.0),
                                                        "speedup": tri(0.75), "over_static": tri(2.25)}}}},
    }
    text = llamacpp_section({"llamacpp": results, "dir": Path(".")})
    rows = [line for line in text.splitlines() if line.startswith("| DSpark") or line.startswith("| target alone")]
    assert len(rows) == 3
    assert "chosen: n-max 2, p-min 0.5" in rows[1] and "2.25 [2.15, 2.35]" in rows[1]
    assert "0.33 [0.23, 0.43]" in rows[0] and rows[0].count("–") >= 1
    assert "over the static setting (paired)" in text and "--tune" in text
