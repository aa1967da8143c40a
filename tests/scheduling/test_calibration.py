"""Confidence metrics and Sequential Temperature Scaling (paper Sections 3.2.1 and 4.3.3)."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from dspark.scheduling.calibration import (
    apply_temperatures,
    calibrate_rounds,
    fit_sts,
    load_sts_json,
    save_sts_json,
    save_sts_report,
)
from dspark.scheduling.calibration_metrics import (
    binned_residuals,
    brier,
    confidence_metrics,
    ece,
    ece_from_residuals,
    ece_from_sums,
    ece_sums,
    log_loss,
    prefix_labels,
    reliability_bins,
    roc_auc,
)
from dspark.scheduling.sts import _ece as _sts_ece
from helpers.calibration import sigmoid, synthetic_rounds


def conditional_auroc(conf, accepted, k):
    """AUROC of c_k for 'position k accepted' among rounds that accepted 1..k-1."""
    reached = accepted >= k - 1
    return roc_auc(conf[reached, k - 1], accepted[reached] >= k)


# ----------------------------------------------------------------------------
# Metrics by hand
# ----------------------------------------------------------------------------


def test_ece_by_hand():
    # bins of width 0.05: 0.1 -> |0.1-0|, 0.2 -> |0.2-1|, 0.9 -> |0.9-1|, 1.0 -> 0
    assert ece([0.1, 0.2, 0.9, 1.0], [0, 1, 1, 1]) == pytest.approx((0.1 + 0.8 + 0.1 + 0.0) / 4)


def test_ece_puts_one_in_the_last_bin():
    # Same bin: |0.98 - 0.5| = 0.48; separate bins would give (0.04 + 1.0)/2 = 0.52.
    assert ece([0.96, 1.0], [1, 0]) == pytest.approx(0.48)


def test_ece_bin_edges_belong_to_the_upper_bin():
    # n_bins=2: 0.5 joins 0.75 in [0.5, 1]: (0.25 + 2·|0.625 - 0.5|)/3
    assert ece([0.25, 0.5, 0.75], [0, 0, 1], n_bins=2) == pytest.approx(0.5 / 3)


def test_every_ece_is_computed_from_binned_residuals_alike():
    """ece, the per-request sums behind its intervals and the STS search give one number: Σ_b |Σ_{i∈b}(p_i − y_i)| / N,
    which is Σ_b (n_b/N)·|mean pred_b − mean label_b| over the reliability bins."""
    rng = np.random.default_rng(3)
    p = rng.random(500)
    y = rng.random(500) < p
    given = p.copy()
    value = ece(p, y)
    np.testing.assert_array_equal(p, given)  # the caller's predictions are left alone
    count, mean_pred, mean_label = reliability_bins(p, y)
    seen = count > 0
    assert value == pytest.approx(np.sum(count[seen] * np.abs(mean_pred[seen] - mean_label[seen])) / 500, rel=1e-12)
    assert value == _sts_ece(p, y.astype(np.float64), 20)
    assert value == float(ece_from_residuals(binned_residuals(p[None, :].copy(), y.astype(np.float64), 20), 500)[0])
    sums = ece_sums(p[:, None], y.astype(int), np.ones(500, int), np.arange(500) % 7, 7)  # [7 requests, 1, 21]
    assert ece_from_sums(sums.sum(axis=0))[0] == pytest.approx(value, rel=1e-12)


def test_roc_auc_counts_ties_as_half():
    # positives 0.4, 0.8 vs negatives 0.1, 0.4: 1 + 0.5 + 1 + 1 = 3.5 of 4 pairs
    assert roc_auc([0.1, 0.4, 0.4, 0.8], [0, 0, 1, 1]) == pytest.approx(0.875)


def test_roc_auc_matches_pairwise_count_on_tied_data():
    rng = np.random.default_rng(0)
    pred = rng.integers(0, 5, 60) / 4.0
    label = rng.random(60) < 0.4
    pos, neg = pred[label], pred[~label]
    pairs = [(p > q) + 0.5 * (p == q) for p, q in itertools.product(pos, neg)]
    assert roc_auc(pred, label) == pytest.approx(np.mean(pairs))


def test_roc_auc_is_nan_with_one_class():
    assert np.isnan(roc_auc([0.2, 0.9], [1, 1]))
    assert np.isnan(roc_auc([0.2, 0.9], [0, 0]))


def test_brier_by_hand():
    assert brier([0.2, 0.9], [0, 1]) == pytest.approx((0.04 + 0.01) / 2)


def test_log_loss_by_hand_and_clipped():
    assert log_loss([0.2, 0.9], [0, 1]) == pytest.approx(-(np.log(0.8) + np.log(0.9)) / 2)
    # A certain miss costs log(1e6) (p clipped to [1e-6, 1 - 1e-6]), a certain hit about 1e-6.
    assert log_loss([0.0, 1.0], [1, 1]) == pytest.approx((np.log(1e6) - np.log1p(-1e-6)) / 2)
    assert np.isnan(log_loss([], []))


def test_metrics_return_python_floats():
    for fn in (ece, roc_auc, brier, log_loss):
        assert type(fn(np.array([0.2, 0.7]), np.array([0, 1]))) is float


# ----------------------------------------------------------------------------
# Labels and per-position metrics
# ----------------------------------------------------------------------------


def test_prefix_labels_by_hand():
    label, valid = prefix_labels(accepted=[0, 2, 3], proposed=[1, 3, 3], gamma=3)
    assert label.astype(int).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert valid.astype(int).tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 1]]


def test_prefix_labels_reject_accepted_beyond_proposed():
    with pytest.raises(ValueError, match="accepted"):
        prefix_labels(accepted=[2], proposed=[1], gamma=3)


def test_confidence_metrics_use_cumulative_product_on_valid_rounds():
    conf = [[0.5, 0.5], [1.0, 0.8], [0.9, 0.1]]
    # round 3 verified only position 1, so it has no label at position 2
    out = confidence_metrics(conf, accepted=[0, 2, 1], proposed=[2, 2, 1])
    assert [m["position"] for m in out] == [1, 2]
    assert [m["count"] for m in out] == [3, 2]
    assert out[0]["mean_pred"] == pytest.approx((0.5 + 1.0 + 0.9) / 3)
    assert out[0]["mean_label"] == pytest.approx(2 / 3)
    assert out[1]["mean_pred"] == pytest.approx((0.25 + 0.8) / 2)  # a_2 = c_1·c_2
    assert out[1]["mean_label"] == pytest.approx(0.5)
    assert out[1]["brier"] == pytest.approx((0.25**2 + 0.2**2) / 2)
    assert out[1]["auroc"] == pytest.approx(1.0)
    assert out[1]["log_loss"] == pytest.approx(-(np.log(1 - 0.25) + np.log(0.8)) / 2)
    assert set(out[0]) == {"position", "count", "ece", "auroc", "brier", "log_loss", "mean_pred", "mean_label"}


# ----------------------------------------------------------------------------
# STS
# ----------------------------------------------------------------------------


def test_apply_temperatures_by_hand():
    conf = np.array([[sigmoid(2.0), 0.5, sigmoid(-3.0)]])
    out = apply_temperatures(conf, [2.0, 7.0, 0.5])
    np.testing.assert_allclose(out, [[sigmoid(1.0), 0.5, sigmoid(-6.0)]], rtol=1e-12)


def test_apply_temperatures_clips_zero_and_one():
    out = apply_temperatures([[0.0, 1.0]], [1.0, 1.0])
    np.testing.assert_allclose(out, [[1e-6, 1 - 1e-6]], rtol=1e-9)


@pytest.fixture(scope="module")
def overconfident():
    rng = np.random.default_rng(1)
    fit = synthetic_rounds(40_000, 2.0, rng)
    held_out = synthetic_rounds(40_000, 2.0, rng)
    return fit, held_out, fit_sts(*fit)


def test_sts_lowers_held_out_ece_at_every_position(overconfident):
    _, (conf, accepted, proposed), temps = overconfident
    before = confidence_metrics(conf, accepted, proposed)
    after = confidence_metrics(apply_temperatures(conf, temps), accepted, proposed)
    for b, a in zip(before, after):
        assert b["ece"] > 0.05  # the synthetic data is clearly miscalibrated
        assert a["ece"] < 0.25 * b["ece"]
        assert a["ece"] < 0.02


def test_sts_recovers_the_miscalibration_scale(overconfident):
    # σ(logit(c)/2) = p exactly, so the best temperature is 2 at every position.
    _, _, temps = overconfident
    np.testing.assert_allclose(temps, 2.0, rtol=0.12)


def test_sts_leaves_per_position_ranking_unchanged(overconfident):
    _, (conf, accepted, proposed), temps = overconfident
    calibrated = apply_temperatures(conf, temps)
    for k in range(1, conf.shape[1] + 1):
        assert conditional_auroc(calibrated, accepted, k) == conditional_auroc(conf, accepted, k)
    before = confidence_metrics(conf, accepted, proposed)
    after = confidence_metrics(calibrated, accepted, proposed)
    # a_1 = c_1 is a monotone transform: exactly equal. For k ≥ 2 the product of
    # per-position monotone transforms is not order preserving, so only close.
    assert after[0]["auroc"] == before[0]["auroc"]
    for b, a in zip(before[1:], after[1:]):
        assert a["auroc"] == pytest.approx(b["auroc"], abs=0.01)


@pytest.mark.filterwarnings("ignore:fit_sts kept T = 1:UserWarning")  # calibrated: kept at 1 by design
def test_sts_keeps_temperature_near_one_on_calibrated_data():
    rng = np.random.default_rng(2)
    temps = fit_sts(*synthetic_rounds(40_000, 1.0, rng))
    assert np.all(np.abs(np.log(temps)) < 0.1)


def test_sts_only_uses_verified_positions():
    # Position 2 is never verified in half the rounds; labelling them as
    # rejected would drag T_2 far from 2.
    rng = np.random.default_rng(3)
    conf, accepted, proposed = synthetic_rounds(20_000, 2.0, rng, mu=(2.0, 1.2))
    short = np.arange(accepted.size) % 2 == 0
    proposed = np.where(short, 1, proposed)
    accepted = np.minimum(accepted, proposed)
    temps = fit_sts(conf, accepted, proposed)
    np.testing.assert_allclose(temps, 2.0, rtol=0.15)


def test_sts_json_round_trip(tmp_path):
    path = tmp_path / "sts.json"
    temps = np.array([1.5, 2.0, 0.8])
    per_position = {"before": [{"position": 1, "auroc": float("nan")}], "after": []}
    save_sts_json(path, temps, [0.05, 0.06, 0.07], [0.01, 0.01, 0.02], per_position=per_position)
    raw = json.loads(path.read_text())
    assert raw["temperatures"] == [1.5, 2.0, 0.8]
    assert raw["ece_before"] == [0.05, 0.06, 0.07]
    assert raw["ece_after"] == [0.01, 0.01, 0.02]
    assert raw["per_position"]["before"][0]["auroc"] is None  # NaN written as null
    np.testing.assert_array_equal(load_sts_json(path, gamma=3), temps)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"ece_before": []}, "temperatures"),
        ({"temperatures": [1.0, -2.0]}, "temperatures"),
        ({"temperatures": [1.0, "hot"]}, "temperatures"),
        ({"temperatures": [1.0, 2.0]}, "positions"),  # gamma=3 expected
    ],
)
def test_malformed_sts_json_raises(tmp_path, data, match):
    path = tmp_path / "sts.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_sts_json(path, gamma=3)


def test_importing_calibration_does_not_import_matplotlib():
    code = "import sys, dspark.scheduling.calibration; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibration_report_carries_proper_scores_as_strict_json(tmp_path):
    rng = np.random.default_rng(4)
    conf, accepted, proposed = synthetic_rounds(2_000, 2.0, rng, mu=(1.0, 1.0, 1.0))
    proposed[:] = 2  # position 3 is never verified: its scores are NaN, written as null
    accepted = np.minimum(accepted, proposed)
    rows = [{"benchmark": "b", "request": i // 10, "round": i % 10, "proposed": int(m), "accepted": int(a),
             "confidences": c.tolist()} for i, (c, a, m) in enumerate(zip(conf, accepted, proposed))]
    report, evaluated = calibrate_rounds(rows, resamples=50)
    c, a, m = conf[[r["request"] * 10 + r["round"] for r in evaluated]], \
        np.array([r["accepted"] for r in evaluated]), np.array([r["proposed"] for r in evaluated])
    before = confidence_metrics(c, a, m)
    assert report["brier_before"][:2] == [b["brier"] for b in before[:2]]
    assert report["log_loss_before"][:2] == [b["log_loss"] for b in before[:2]]
    assert report["brier_after"][0] < report["brier_before"][0]  # overconfident head, T_1 fitted
    record = report["sts_fit"]["positions"][0]
    assert record["kept"] is None and record["brier_held_out"] < record["brier_held_out_t1"]
    assert {"brier_t1", "brier_argmin", "log_loss_t1", "log_loss_argmin", "log_loss_held_out"} <= set(record)
    path = tmp_path / "sts.json"
    save_sts_report(path, report)

    def refuse(constant):
        raise ValueError(constant)

    raw = json.loads(path.read_text(), parse_constant=refuse)  # no NaN / Infinity tokens
    assert raw["brier_before"][2] is None and raw["log_loss_after"][2] is None
    assert raw["sts_fit"]["positions"][2]["brier_t1"] is None  # no round verified position 3
