"""The evidence guards of Sequential Temperature Scaling (dspark/scheduling/sts.py, dspark.scheduling.calibration.fit_sts)."""

import numpy as np
import pytest

from dspark.scheduling.calibration import calibrate_rounds, default_temperature_grid, ece, fit_sts, fit_sts_explained
from dspark.cli.main import build_parser
from dspark.cli.flags import flag_values
from dspark.config import Config, load_config, set_values, validate
from dspark.scheduling.sts import fold_ids


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def logit(p):
    return np.log(p) - np.log1p(-p)


def brute_force_sts(conf, accepted, proposed, grid):
    """The paper's plain STS by definition: per position, the grid T with the lowest ECE
    (dspark.scheduling.calibration.ece, one candidate at a time) of Π_{i<k} c'_i·σ(logit(c_k)/T), ties to
    the T closest to 1 in log scale."""
    n, gamma = conf.shape
    temps, prefix = np.ones(gamma), np.ones(n)
    order = sorted(grid, key=lambda t: abs(np.log(t)))
    for k in range(gamma):
        rows = proposed >= k + 1
        y = accepted[rows] >= k + 1
        z = logit(np.clip(conf[rows, k], 1e-6, 1 - 1e-6))
        scores = [ece(prefix[rows] * sigmoid(z / t), y) for t in order]
        temps[k] = order[int(np.argmin(scores))]
        prefix = prefix * sigmoid(logit(np.clip(conf[:, k], 1e-6, 1 - 1e-6)) / temps[k])
    return temps


def only_rejections_at_two():
    """40 rounds, γ = 2: c_1 = 0.6 with 24 of 40 first drafts accepted (calibrated: ECE 0 at T = 1),
    c_2 = 0.3 and no second draft ever accepted."""
    conf = np.tile([0.6, 0.3], (40, 1))
    accepted = np.r_[np.ones(24, int), np.zeros(16, int)]
    return conf, accepted, np.full(40, 2)


def test_position_with_only_rejections_keeps_one_while_plain_fit_hits_the_grid_bound():
    conf, accepted, proposed = only_rejections_at_two()
    # All labels 0 at k = 2: ECE = mean prediction 0.6·σ(logit(0.3)/T), smallest at the grid's 0.05.
    np.testing.assert_array_equal(fit_sts(conf, accepted, proposed, min_events=0, folds=0), [1.0, 0.05])
    temps, records = fit_sts_explained(conf, accepted, proposed, min_events=10, folds=0)
    np.testing.assert_array_equal(temps, [1.0, 1.0])
    assert records[0]["kept"] is None and records[0]["t_argmin"] == 1.0  # fitted, and the argmin is 1
    assert (records[1]["accepted"], records[1]["rejected"], records[1]["t_argmin"]) == (0, 40, 0.05)
    assert records[1]["kept"] == "0 accepted prefixes < min_events=10"


def test_min_events_counts_both_classes():
    conf, accepted, proposed = only_rejections_at_two()
    accepted[:3] = 2  # second drafts: 3 accepted, 37 rejected
    assert fit_sts(conf, accepted, proposed, min_events=3, folds=0)[1] != 1.0
    _, records = fit_sts_explained(conf, accepted, proposed, min_events=4, folds=0)
    assert records[1]["kept"] == "3 accepted prefixes < min_events=4"
    accepted[:] = 2
    accepted[:1] = 1  # second drafts: 39 accepted, 1 rejected
    assert fit_sts(conf, accepted, proposed, min_events=1, folds=0)[1] != 1.0
    _, records = fit_sts_explained(conf, accepted, proposed, min_events=2, folds=0)
    assert records[1]["kept"] == "1 rejected prefix < min_events=2"


def test_guards_off_is_the_plain_ece_argmin():
    rng = np.random.default_rng(5)
    n, grid = 300, default_temperature_grid()[::10]
    conf = sigmoid(rng.normal([1.0, 0.3], 1.0, (n, 2)) * 1.7)
    accepted = np.minimum(rng.integers(0, 3, n), 2)
    proposed = np.where(rng.random(n) < 0.3, 1, 2)
    accepted = np.minimum(accepted, proposed)
    np.testing.assert_array_equal(fit_sts(conf, accepted, proposed, grid=grid, min_events=0, folds=0),
                                  brute_force_sts(conf, accepted, proposed, np.r_[grid, 1.0]))


def test_guarded_fit_recovers_a_known_temperature():
    # conf = σ(2·logit(p)) with labels ~ Bernoulli(p): σ(logit(conf)/2) = p, the true T is 2.
    rng = np.random.default_rng(7)
    p = sigmoid(rng.normal(0.0, 1.2, 20_000))
    conf, accepted = sigmoid(2.0 * logit(p))[:, None], (rng.random(p.size) < p).astype(int)
    groups = np.repeat(np.arange(200), 100)  # 200 requests of 100 rounds
    temps, records = fit_sts_explained(conf, accepted, np.ones(p.size, int), groups=groups)
    assert records[0]["kept"] is None and records[0]["gain_ci"][0] > 0
    assert temps[0] == pytest.approx(2.0, rel=0.1)


def test_guard_keeps_one_on_noise_where_the_plain_fit_moves():
    # Calibrated confidences (conf = p, labels ~ Bernoulli(p) drawn independently), 200 rounds:
    # T = 1 is the truth, so any other T fits noise. 40 seeded sets.
    plain, guarded = [], []
    for seed in range(40):
        rng = np.random.default_rng(100 + seed)
        p = sigmoid(rng.normal(0.0, 1.0, 200))
        conf, accepted = p[:, None], (rng.random(p.size) < p).astype(int)
        plain.append(fit_sts(conf, accepted, np.ones(p.size, int), min_events=0, folds=0)[0])
        guarded.append(fit_sts(conf, accepted, np.ones(p.size, int), seed=seed)[0])
    assert sum(t != 1.0 for t in plain) >= 36  # measured 38 of 40
    assert sum(t == 1.0 for t in guarded) >= 36  # measured 40 of 40 (dspark/scheduling/sts.py: 0-7.5 % false moves)


def test_fold_ids_keep_groups_whole_and_are_seeded():
    groups = np.array([5, 5, 7, 7, 7, 9, 11, 11, 13])
    fold = fold_ids(groups, 3, seed=1)
    for g in np.unique(groups):
        assert np.unique(fold[groups == g]).size == 1
    assert sorted(np.bincount([fold[groups == g][0] for g in np.unique(groups)])) == [1, 2, 2]  # 5 groups, 3 folds
    np.testing.assert_array_equal(fold, fold_ids(groups, 3, seed=1))
    assert np.unique(fold_ids(groups, 10, seed=1)).size == 5  # at most one fold per group


def test_one_group_cannot_be_checked_and_keeps_one():
    rng = np.random.default_rng(3)
    p = sigmoid(rng.normal(0.0, 1.0, 2_000))
    conf, accepted = sigmoid(2.0 * logit(p))[:, None], (rng.random(p.size) < p).astype(int)
    temps, records = fit_sts_explained(conf, accepted, np.ones(p.size, int), groups=np.zeros(p.size, int))
    assert temps[0] == 1.0 and records[0]["kept"] == "one group (request) only: no held-out fold to check on"


def test_bad_guard_settings_raise():
    conf, accepted, proposed = only_rejections_at_two()
    with pytest.raises(ValueError, match="folds"):
        fit_sts(conf, accepted, proposed, folds=1)
    with pytest.raises(ValueError, match="groups"):
        fit_sts(conf, accepted, proposed, groups=[0, 1])
    config = Config()
    config.calibrate.folds = 1
    with pytest.raises(ValueError, match="calibrate.folds"):
        validate(config)
    config.calibrate.folds, config.calibrate.min_events = 5, -1
    with pytest.raises(ValueError, match="calibrate.min_events"):
        validate(config)


def test_calibrate_rounds_reports_why_each_position_kept_one():
    conf, accepted, proposed = only_rejections_at_two()
    rows = [{"benchmark": "b", "request": i // 4, "round": i % 4, "proposed": 2, "accepted": int(a),
             "confidences": list(c)} for i, (c, a) in enumerate(zip(conf.tolist(), accepted))]
    report, _ = calibrate_rounds(rows, fit_fraction=0.5, seed=0, resamples=20, min_events=1, folds=0)
    assert report["temperatures"][1] == 1.0
    assert report["kept"][1].startswith("0 accepted prefixes")
    assert report["sts_fit"]["min_events"] == 1 and report["sts_fit"]["folds"] == 0
    assert [r["position"] for r in report["sts_fit"]["positions"]] == [1, 2]


def test_calibrate_flags_set_the_guard_fields():
    args = build_parser().parse_args(["calibrate", "--rounds", "r.jsonl", "--min-events", "0", "--folds", "0"])
    config = set_values(load_config(args.config), flag_values(args, args.command), parse=True)
    assert (config.calibrate.min_events, config.calibrate.folds) == (0, 0)
    assert (Config().calibrate.min_events, Config().calibrate.folds) == (10, 5)


def test_the_held_out_check_alone_cannot_see_a_one_class_position():
    # Held-out rounds of a one-class position are one class too, so T = 0.05 really lowers their
    # ECE: every resample sees the same per-round gain 0.6·0.3 − 0.6·σ(logit(0.3)/0.05) ≈ 0.18.
    # This is why min_events exists beside the held-out check.
    conf, accepted, proposed = only_rejections_at_two()
    temps, records = fit_sts_explained(conf, accepted, proposed, min_events=0, folds=2, groups=np.arange(40) // 4)
    gain = 0.6 * 0.3 - 0.6 * sigmoid(logit(0.3) / 0.05)
    assert temps[1] == 0.05 and records[1]["kept"] is None
    np.testing.assert_allclose(records[1]["gain_ci"], [gain, gain], rtol=1e-9)
    assert fit_sts(conf, accepted, proposed, min_events=10, folds=2, groups=np.arange(40) // 4)[1] == 1.0
