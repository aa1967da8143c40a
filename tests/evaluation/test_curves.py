"""Learning-curve extraction from trainer logs."""

import json

import pytest

from dspark.evaluation.curves import curve, curves_table, read_log
from dspark.evaluation.plots import plot_learning_curves


def _log(tmp_path, name, records):
    d = tmp_path / name
    d.mkdir()
    (d / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def test_curve_keeps_only_records_with_the_metric(tmp_path):
    d = _log(tmp_path, "a", [{"step": 0, "wall_min": 0.0, "eval_tau_prob": 1.1}, {"step": 5, "wall_min": 1.5, "loss": 3.0},
                            {"step": 10, "wall_min": 3.0, "eval_tau_prob": 1.4}])
    assert curve(read_log(d)) == [(0.0, 1.1, 0), (3.0, 1.4, 10)]
    table = curves_table({"dspark": d})
    assert "| dspark | 3.0 | 10 | 1.4000 |" in table
    plot_learning_curves({"dspark": d}, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_missing_log_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train_log.jsonl not found"):
        read_log(tmp_path)
