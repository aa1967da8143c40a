"""Markdown of the reports (dspark.markdown, dspark.report): cells, tables, the calibration table.

The evaluation report itself is tested end to end with the recipe in test_evaluate.py,
the serving files in test_serving.py, the SPS files in test_sps.py."""

import math

import numpy as np

from dspark.markdown import fmt_number, markdown_table
from dspark.report import calibration_markdown


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
