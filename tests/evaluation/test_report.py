"""Markdown of the reports (dspark.evaluation.markdown, dspark.evaluation.report): cells, tables, the calibration table.

The evaluation report itself is tested end to end with the recipe in test_evaluate.py,
the serving files in test_simulator.py, the SPS files in test_sps_profile.py."""

import math

import numpy as np

from dspark.evaluation.markdown import fmt_ci, fmt_number, markdown_table
from dspark.evaluation.report import calibration_markdown, compare_reports


def test_a_missing_or_non_finite_number_is_a_dash():
    assert fmt_number(None) == fmt_number(math.nan) == fmt_number(math.inf) == "–"


def test_integers_keep_their_digits_and_other_numbers_round_to_the_given_places():
    assert fmt_number(12) == fmt_number(np.int64(12)) == "12"
    assert fmt_number(2.0) == "2.00" and fmt_number(1 / 3, 4) == "0.3333" and fmt_number(np.float32(0.5), 1) == "0.5"


def test_a_table_is_a_header_a_rule_and_one_line_per_row():
    assert markdown_table(["a", "b"], [["1", "2"], ["3", "–"]]) == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | – |"


def test_the_calibration_table_has_one_row_per_position_of_the_evaluated_part():
    def metrics(ece, auroc, brier):
        return {"count": 10, "ece": ece, "auroc": auroc, "brier": brier}

    part = {"before": [metrics(0.1, 0.8, 0.2), metrics(0.3, math.nan, 0.4)],
            "after": [metrics(0.05, 0.8, 0.15), metrics(0.1, math.nan, 0.3)],
            "conditional_before": [metrics(0, 0.75, 0), metrics(0, 0.6, 0)],
            "conditional_after": [metrics(0, 0.75, 0), metrics(0, 0.6, 0)]}
    report = {"temperatures": [2.0, 0.5], "evaluated_on": "test", "per_position": {"test": part}}
    lines = calibration_markdown(report).splitlines()
    assert lines[0].startswith("| k | n | T_k | ECE a_k before | after |")
    assert lines[2] == "| 1 | 10 | 2.000 | 0.1000 | 0.0500 | 0.800 | 0.800 | 0.750 | 0.750 | 0.2000 | 0.1500 |"
    assert lines[3] == "| 2 | 10 | 0.500 | 0.3000 | 0.1000 | – | – | 0.600 | 0.600 | 0.4000 | 0.3000 |"
    assert lines[4].startswith("AUROC of a_k = Π c_i is unchanged by STS at k = 1 only")


# ------------------------------------------------------------------ intervals in the tables


def test_a_number_with_its_interval_shows_its_bounds_in_the_same_format():
    assert fmt_ci(1.14, [1.10, 1.20]) == "1.14 [1.10, 1.20]"
    assert fmt_ci(0.5, [0.4, 0.7], 3) == "0.500 [0.400, 0.700]"
    assert fmt_ci(1.14) == "1.14"  # no interval computed
    assert fmt_ci(1.14, [None, None]) == "1.14 (no interval)"  # refused, as report.json keeps it (null)
    assert fmt_ci(1.14, [math.nan, 1.2]) == "1.14 (no interval)"  # one refused: too few requests
    assert fmt_ci(None, [1.0, 2.0]) == "–"


def tau_report(label, taus_and_cis, avg_ci):
    """A minimal report.json: per-benchmark τ with its interval, and the macro Avg interval."""
    benchmarks = {n: {"tau": t, "tau_ci": ci} for n, (t, ci) in taus_and_cis.items()}
    return {"label": label, "benchmarks": benchmarks, "macro": {"tau_ci": {"avg": avg_ci}}}


def test_compare_shows_intervals_and_says_which_pairs_overlap():
    a = tau_report("A", {"gsm8k": (2.0, [1.9, 2.1]), "mbpp": (1.5, [1.4, 1.6])}, [1.70, 1.80])
    b = tau_report("B", {"gsm8k": (2.06, [2.0, 2.2]), "mbpp": (1.2, [1.1, 1.3])}, [1.58, 1.68])
    c = tau_report("C", {"gsm8k": (2.0, None), "mbpp": (1.5, None)}, None)  # a report without intervals
    lines = compare_reports({"A": a, "B": b, "C": c}).splitlines()
    assert lines[2] == ("| A | 2.00 [1.90, 2.10] | – | – | 1.50 [1.40, 1.60] | – | – | – | – | – | 2.00 | 1.50 | – "
                        "| 1.75 [1.70, 1.80] |")
    assert lines[4] == "| C | 2.00 | – | – | 1.50 | – | – | – | – | – | 2.00 | 1.50 | – | 1.75 |"
    table = lines[lines.index("| pair | GSM8K | MBPP | Avg |"):]
    # GSM8K: [1.9, 2.1] and [2.0, 2.2] share [2.0, 2.1]; MBPP: [1.4, 1.6] and [1.1, 1.3] do not; Avg: 1.70 > 1.68.
    assert table[2] == "| A vs B | overlap | apart | apart |"
    assert table[3] == "| A vs C | – | – | – |"
    assert table[-1] == ("Intervals apart: A vs B on MBPP (1.50 [1.40, 1.60] vs 1.20 [1.10, 1.30]); "
                         "A vs B on Avg (1.75 [1.70, 1.80] vs 1.63 [1.58, 1.68]).")


def test_compare_of_overlapping_drafters_says_so():
    a = tau_report("A", {"gsm8k": (2.0, [1.9, 2.1])}, [1.9, 2.1])
    b = tau_report("B", {"gsm8k": (2.1, [2.05, 2.15])}, [2.05, 2.15])
    text = compare_reports({"A": a, "B": b})
    assert "| A vs B | overlap | overlap |" in text and text.endswith("Every compared pair of intervals overlaps.")


def test_compare_lists_macro_speedups_with_intervals():
    a = tau_report("A", {"gsm8k": (2.0, [1.9, 2.1])}, [1.9, 2.1])
    a["macro"].update(speedup={"avg": 0.9}, speedup_ci={"avg": [0.8, 1.0]})
    b = tau_report("B", {"gsm8k": (2.0, [1.9, 2.1])}, [1.9, 2.1])
    b["macro"].update(speedup={"avg": 1.3}, speedup_ci={"avg": [1.2, 1.4]})
    lines = compare_reports({"A": a, "B": b}).splitlines()
    assert "| drafter | speedup Avg |" in lines  # only the speedups the reports hold
    assert "| A | 0.90 [0.80, 1.00] |" in lines and "| B | 1.30 [1.20, 1.40] |" in lines
    assert "| pair | GSM8K | Avg | speedup Avg |" in lines
    assert "| A vs B | overlap | overlap | apart |" in lines


def test_the_calibration_table_shows_the_ece_intervals():
    def metrics(ece, ci):
        return {"count": 10, "ece": ece, "ece_ci": ci, "auroc": 0.5, "brier": 0.1}

    part = {"before": [metrics(0.1, [0.06, 0.14])], "after": [metrics(0.05, [0.03, 0.09])],
            "conditional_before": [metrics(0, None)], "conditional_after": [metrics(0, None)]}
    report = {"temperatures": [2.0], "evaluated_on": "test", "per_position": {"test": part}}
    assert calibration_markdown(report).splitlines()[2].startswith(
        "| 1 | 10 | 2.000 | 0.1000 [0.0600, 0.1400] | 0.0500 [0.0300, 0.0900] |")
