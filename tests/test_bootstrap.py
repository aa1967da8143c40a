"""Bootstrap intervals over requests (dspark.bootstrap) and their use in the evaluation report
(dspark.evaluation.intervals via dspark.evaluation.report.build_report) and the STS report (dspark.scheduling.calibration).

Oracles: hand-computed quantiles of a fixed resample set; a brute-force bootstrap that resamples
the request records themselves and calls the plain metric functions; the exact τ of a synthetic
geometric acceptance process (coverage)."""

import copy
import math

import numpy as np
import pytest

from dspark.bootstrap import (
    bootstrap_ci,
    bootstrap_ci_from_indices,
    counts_from_indices,
    intervals_overlap,
    percentile_interval,
    resample_counts,
    satterthwaite_df,
    small_sample_factors,
    stratified_ci,
    student_t_quantile,
)
from dspark.scheduling.calibration import calibrate_rounds, confidence_metrics, ece, ece_from_sums, ece_sums, prefix_labels
from dspark.evaluation.intervals import add_intervals
from dspark.io.jsonsafe import to_jsonable
from dspark.evaluation.metrics import macro_average, macro_average_array, tau_pooled
from dspark.evaluation.report import build_report


def ratio(s):
    return s[..., 0] / s[..., 1]


# ------------------------------------------------------------------ the core


def test_interval_of_a_fixed_resample_set_is_its_hand_computed_percentiles():
    # Three requests with τ sums (6 over 2 rounds), (1 over 1), (4 over 1): pooled τ 11/4.
    aggregates = [[6, 2], [1, 1], [4, 1]]
    indices = [[0, 0, 0], [1, 1, 1], [2, 2, 2], [0, 1, 2], [0, 0, 1]]
    # Resampled τ: 18/6 = 3, 1, 4, 11/4, 13/5 -> sorted 1, 2.6, 2.75, 3, 4. The 2.5 % quantile sits at
    # position 0.025 · 4 = 0.1: 1 + 0.1 · (2.6 − 1); the 97.5 % one at 3.9: 3 + 0.9 · (4 − 3).
    estimate, lo, hi = bootstrap_ci_from_indices(aggregates, ratio, indices, small_sample=False)
    assert (estimate, lo, hi) == pytest.approx((2.75, 1.16, 3.9))
    # level 0.5: quartiles at positions 1 and 3 exactly.
    assert bootstrap_ci_from_indices(aggregates, ratio, indices, level=0.5, small_sample=False)[1:] == pytest.approx((2.6, 3.0))


def test_resamples_where_the_statistic_is_undefined_are_left_out():
    # Request 1 never reached position 2 (denominator 0): a resample of it alone has no value there.
    aggregates = [[[1, 1], [1, 2]], [[0, 1], [0, 0]]]  # [request, position, (passed, reached)]
    indices = [[0, 0], [1, 1], [0, 1]]
    _, lo, hi = bootstrap_ci_from_indices(aggregates, ratio, indices, level=0.5, small_sample=False)
    # Position 1: resampled 1, 0, 1/2 -> quartiles 1/4, 3/4. Position 2: only 1/2, 1/2 are defined.
    assert lo == pytest.approx([0.25, 0.5]) and hi == pytest.approx([0.75, 0.5])
    assert all(math.isnan(x) for x in percentile_interval([math.nan, math.nan]))  # no defined resample


def test_draw_counts_count_each_request_of_each_resample():
    counts = counts_from_indices([[0, 0, 2], [1, 2, 2]], 4)
    assert counts.tolist() == [[2, 0, 1, 0], [0, 1, 2, 0]]
    drawn = resample_counts(5, 300, np.random.default_rng(0))
    assert drawn.shape == (300, 5) and (drawn.sum(axis=1) == 5).all()
    with pytest.raises(ValueError, match="indices must lie in"):
        counts_from_indices([[0, 4]], 4)


def test_the_interval_is_seeded():
    aggregates = np.random.default_rng(1).integers(1, 9, size=(30, 2))
    assert bootstrap_ci(aggregates, ratio, seed=3) == bootstrap_ci(aggregates, ratio, seed=3)
    assert bootstrap_ci(aggregates, ratio, seed=3) != bootstrap_ci(aggregates, ratio, seed=4)
    with pytest.raises(ValueError, match="resamples must be an int >= 1"):
        bootstrap_ci(aggregates, ratio, resamples=0)


def test_stratified_resampling_keeps_each_group_and_its_size():
    # Group A has one request: every resample redraws it, so only group B's two requests vary.
    a, b = [[3, 1]], [[2, 1], [4, 1]]
    counts = [np.array([[1], [1], [1]]), np.array([[2, 0], [0, 2], [1, 1]])]
    macro = stratified_ci([a, b], lambda s: ratio(s).mean(axis=-1), counts=counts, level=0.5, small_sample=False)
    # Per resample: (3 + 2) / 2, (3 + 4) / 2, (3 + 3) / 2 -> 2.5, 3.5, 3; quartiles 2.75, 3.25.
    assert tuple(macro) == pytest.approx((3.0, 2.75, 3.25))
    with pytest.raises(ValueError, match="cover 1 requests but a group has 2"):
        stratified_ci([a, b], ratio, counts=[counts[0], counts[0]])


def test_overlap_is_sharing_a_point():
    assert intervals_overlap([1.0, 2.0], [2.0, 3.0]) is True
    assert intervals_overlap([1.0, 2.0], [2.1, 3.0]) is False
    assert intervals_overlap([1.0, 2.0], None) is None and intervals_overlap([1.0, None], [0, 1]) is None


def test_macro_average_of_many_rows_matches_the_table_1_columns():
    names = ["gsm8k", "math500", "mbpp", "alpaca", "custom"]
    rows = np.array([[2.0, 3.0, 1.5, np.nan, 9.0], [1.0, np.nan, np.nan, 4.0, 9.0]])
    got = macro_average_array(rows, names)
    for row, out in zip(rows, got):
        want = macro_average(dict(zip(names, row)))
        assert out == pytest.approx([want[k] for k in ("math", "code", "chat", "avg")], nan_ok=True)


# ------------------------------------------------------------------ ECE as sums over requests


def test_ece_from_request_sums_is_the_ece_of_their_rounds():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.05, 1.0, size=(60, 3))
    proposed = rng.integers(1, 4, size=60)
    accepted = np.minimum(rng.integers(0, 4, size=60), proposed)
    groups = rng.integers(0, 7, size=60)
    sums = ece_sums(conf, accepted, proposed, groups, 7, n_bins=20)
    want = [p["ece"] for p in confidence_metrics(conf, accepted, proposed, n_bins=20)]
    assert ece_from_sums(sums.sum(axis=0)) == pytest.approx(want)
    keep = np.isin(groups, [1, 4])  # a subset of requests: the ECE of their rounds alone
    a = np.cumprod(conf[keep], axis=1)
    label, valid = prefix_labels(accepted[keep], proposed[keep], 3)
    assert ece_from_sums(sums[[1, 4]].sum(axis=0))[1] == pytest.approx(ece(a[valid[:, 1], 1], label[valid[:, 1], 1]))


# ------------------------------------------------------------------ the evaluation report


def synthetic_run(rng, requests=(6, 4), gamma=3):
    """Records and rounds of two benchmarks with random acceptance, confidences and timings."""
    records, rounds = [], []
    for name, count in zip(("gsm8k", "alpaca"), requests):
        for q in range(count):
            for i in range(int(rng.integers(1, 5))):
                m = int(rng.integers(0, gamma + 1))
                rounds.append({"benchmark": name, "request": q, "round": i, "proposed": gamma, "accepted": m,
                               "confidences": rng.uniform(0.1, 1.0, gamma).tolist(), "eos_accepted": False})
            records.append({"benchmark": name, "request": q, "tokens": int(rng.integers(2, 20)),
                            "wall_s": float(rng.uniform(1, 2)), "baseline_tokens": int(rng.integers(2, 20)),
                            "baseline_wall_s": float(rng.uniform(1, 3))})
    return records, rounds


def brute_force(records, rounds, resamples, seed, metric):
    """The interval by resampling request records themselves, benchmark by benchmark, in the
    documented draw order, and calling the plain metric on the resampled rows."""
    rng = np.random.default_rng(seed)
    names = list(dict.fromkeys(r["benchmark"] for r in records))
    draws = {n: rng.integers(0, sum(r["benchmark"] == n for r in records), size=(resamples, sum(
        r["benchmark"] == n for r in records))) for n in names}
    values = []
    for r in range(resamples):
        rec, rows = [], []
        for n in names:
            mine = [x for x in records if x["benchmark"] == n]
            for copy, i in enumerate(draws[n][r]):
                rec.append(dict(mine[i], request=(mine[i]["request"], copy)))
                rows += [dict(x, request=(x["request"], copy)) for x in rounds
                         if x["benchmark"] == n and x["request"] == mine[i]["request"]]
        values.append(metric(rec, rows))
    return np.percentile(values, [2.5, 97.5])


def test_report_intervals_match_a_brute_force_bootstrap_of_the_plain_metrics(plain_bootstrap):
    records, rounds = synthetic_run(np.random.default_rng(5))
    report = build_report(records, rounds, gamma=3, label="x", bootstrap_resamples=60, bootstrap_seed=11)

    def all_tau(rec, rows):
        return tau_pooled([x["accepted"] for x in rows])

    def macro_speedup(rec, rows):
        per = {}
        for n in ("gsm8k", "alpaca"):
            mine = [x for x in rec if x["benchmark"] == n]
            per[n] = (sum(x["tokens"] for x in mine) / sum(x["wall_s"] for x in mine)) / (
                sum(x["baseline_tokens"] for x in mine) / sum(x["baseline_wall_s"] for x in mine))
        return macro_average(per)["avg"]

    def ece_k2(rec, rows):
        return confidence_metrics([x["confidences"] for x in rows], [x["accepted"] for x in rows],
                                  [x["proposed"] for x in rows])[1]["ece"]

    assert report["all"]["tau_ci"] == pytest.approx(brute_force(records, rounds, 60, 11, all_tau))
    assert report["macro"]["speedup_ci"]["avg"] == pytest.approx(brute_force(records, rounds, 60, 11, macro_speedup))
    assert report["all"]["confidence"][1]["ece_ci"] == pytest.approx(brute_force(records, rounds, 60, 11, ece_k2))


def test_report_adds_ci_siblings_and_keeps_every_other_value():
    records, rounds = synthetic_run(np.random.default_rng(2))
    plain = build_report(records, rounds, gamma=3, label="x", temperatures=[1.0, 2.0, 0.5], bootstrap_resamples=50)
    config = {"seed": 7, "run": {"eval": {"bootstrap_resamples": 40}}}
    report = build_report(records, rounds, gamma=3, label="x", config=config, temperatures=[1.0, 2.0, 0.5])
    assert report["bootstrap"] == {"resamples": 40, "seed": 7, "level": 0.95}  # from eval.* in the config

    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if not k.endswith("_ci") and k not in ("bootstrap", "config")}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    assert to_jsonable(strip(report)) == to_jsonable(strip(plain))  # NaN -> None, so that NaN equals NaN
    gsm8k = report["benchmarks"]["gsm8k"]
    for key in ("tau", "tau_per_request", "acceptance_rate", "verify_rate", "speedup"):
        lo, hi = gsm8k[f"{key}_ci"]
        assert lo <= gsm8k[key] <= hi, key
    assert len(gsm8k["conditional_acceptance_ci"]) == 3 and len(gsm8k["conditional_acceptance_ci"][0]) == 2
    assert "ece_ci" in report["all"]["confidence"][0] and "ece_ci" in report["all"]["confidence_calibrated"][2]
    assert set(report["macro"]["tau_ci"]) == {"math", "code", "chat", "avg"}
    assert report["domains"]["math"]["tau_macro_ci"] == report["macro"]["tau_ci"]["math"]
    again = add_intervals(copy.deepcopy(report), records, rounds, resamples=40, seed=7, temperatures=[1.0, 2.0, 0.5])
    assert to_jsonable(again) == to_jsonable(report)  # seeded, and a second pass over a report changes nothing


# ------------------------------------------------------------------ coverage


def geometric_rounds(rng, requests, gamma, a, b):
    """Rounds of requests whose per-token acceptance p ~ Beta(a, b) varies by request; m counts
    the accepted tokens before the first rejection, at most γ."""
    rounds = []
    for q in range(requests):
        p = rng.beta(a, b)
        n = int(rng.integers(1, 9))
        m = np.minimum(rng.geometric(1.0 - p, size=n) - 1, gamma)
        rounds += [{"benchmark": "gsm8k", "request": q, "round": i, "proposed": gamma, "accepted": int(x),
                    "confidences": None} for i, x in enumerate(m)]
    return rounds


def test_95_percent_intervals_cover_the_true_tau_about_95_percent_of_the_time():
    gamma, a, b = 7, 3.0, 2.0
    # E[τ] = 1 + Σ_{k≤γ} E[p^k], E[p^k] = Π_{j<k} (a + j) / (a + b + j) for p ~ Beta(a, b); the number of
    # rounds is independent of p, so the pooled τ estimates it.
    true_tau = 1 + sum(math.prod((a + j) / (a + b + j) for j in range(k)) for k in range(1, gamma + 1))
    rng = np.random.default_rng(2024)
    hits = round_hits = 0
    for rep in range(200):
        rounds = geometric_rounds(rng, 40, gamma, a, b)
        records = [{"benchmark": "gsm8k", "request": q, "tokens": 1, "wall_s": 1.0} for q in range(40)]
        report = build_report(records, rounds, gamma=gamma, label="x", bootstrap_resamples=400, bootstrap_seed=rep)
        lo, hi = report["benchmarks"]["gsm8k"]["tau_ci"]
        hits += lo <= true_tau <= hi
        # The same bootstrap over rounds ignores that rounds of one request share its p: too narrow.
        _, lo, hi = bootstrap_ci([[r["accepted"] + 1, 1] for r in rounds], ratio, resamples=400, seed=rep)
        round_hits += lo <= true_tau <= hi
    assert 0.90 <= hits / 200 <= 0.99  # measured: 0.94
    assert round_hits / 200 < 0.88  # measured: 0.785


# ------------------------------------------------------------------ the STS report


def test_calibration_report_carries_ece_intervals_over_the_test_requests(plain_bootstrap):
    rng = np.random.default_rng(0)
    rounds = [{"benchmark": "gsm8k", "request": q, "proposed": 3, "accepted": int(rng.integers(0, 4)),
               "confidences": rng.uniform(0.5, 1.0, 3).tolist()} for q in range(30) for _ in range(4)]
    report, rows = calibrate_rounds(rounds, seed=3, resamples=50)
    assert report["bootstrap"] == {"resamples": 50, "seed": 3, "level": 0.95}
    assert len(report["ece_before_ci"]) == len(report["ece_after_ci"]) == 3
    assert report["per_position"]["test"]["after"][0]["ece_ci"] == report["ece_after_ci"][0]
    # Oracle: resample the test part's requests with the documented draw and recompute the ECE of a_1.
    requests = list(dict.fromkeys(r["request"] for r in rows))
    draws = np.random.default_rng(3).integers(0, len(requests), size=(50, len(requests)))
    values = []
    for draw in draws:
        picked = [r for i in draw for r in rows if r["request"] == requests[i]]
        values.append(ece(np.array([r["confidences"][0] for r in picked]), [r["accepted"] >= 1 for r in picked]))
    assert report["ece_before_ci"][0] == pytest.approx(np.percentile(values, [2.5, 97.5]))


# ------------------------------------------------------------------ small strata


def test_student_t_quantiles_match_the_tables():
    # Two-sided 95 % critical values of Student's t (any statistics table) and the normal's limit.
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 18: 2.101, 30: 2.042, 1000: 1.962}
    for df, value in table.items():
        assert student_t_quantile(0.975, df) == pytest.approx(value, abs=1e-3), df
    # A fractional ν (Satterthwaite's): the t density integrated independently up to the quantile gives p.
    nu, q = 2.5, student_t_quantile(0.95, 2.5)
    x = np.linspace(0.0, q, 200_001)
    density = math.gamma((nu + 1) / 2) / (math.sqrt(nu * math.pi) * math.gamma(nu / 2)) * (1 + x * x / nu) ** (-(nu + 1) / 2)
    assert 0.5 + float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(x))) == pytest.approx(0.95, abs=1e-6)
    assert student_t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-12)


def test_small_sample_factors_and_satterthwaite_df_by_hand():
    assert small_sample_factors([2, 4, 1]) == pytest.approx([math.sqrt(2), math.sqrt(4 / 3), 0.0])
    # Equal shares: ν = Σ (n_g − 1); one group carrying everything: ν = its n_g − 1.
    assert satterthwaite_df([1.0, 1.0, 1.0], [2, 4, 3]) == pytest.approx((3.0**2) / (1 / 1 + 1 / 3 + 1 / 2))
    assert satterthwaite_df([0.0, 5.0, 0.0], [2, 4, 3]) == pytest.approx(3.0)
    assert satterthwaite_df([0.0, 0.0], [2, 4]) == pytest.approx(4.0)  # no spread: the plain count
    assert math.isnan(float(satterthwaite_df([1.0, 2.0], [1, 1])))  # no group of two: no interval


def test_corrected_interval_of_a_fixed_resample_set_by_hand():
    # Group A: requests (2 over 1), (4 over 1); group B: (3 over 1), (5 over 1), (7 over 1). Statistic: pooled ratio.
    a, b = np.array([[2.0, 1], [4, 1]]), np.array([[3.0, 1], [5, 1], [7, 1]])
    counts = [np.array([[2, 0], [0, 2], [1, 1]]), np.array([[3, 0, 0], [1, 1, 1], [0, 0, 3]])]
    estimate, lo, hi = stratified_ci([a, b], lambda s: ratio(s.sum(axis=-2)), counts=counts, level=0.5)
    fa, fb = math.sqrt(2), math.sqrt(3 / 2)
    # Resampled sums rescaled about the observed (6, 2) and (15, 3): numerators only move (rounds are 1 each).
    da, db = [fa * (4 - 6), fa * (8 - 6), 0.0], [fb * (9 - 15), 0.0, fb * (21 - 15)]
    values = sorted((21 + x + y) / 5 for x, y in zip(da, db))
    q_lo, q_hi = np.percentile(values, [25, 75])
    # Each group's share: the variance of the statistic with it alone resampled; ν by Satterthwaite.
    va, vb = np.var([x / 5 for x in da]), np.var([y / 5 for y in db])
    nu = (va + vb) ** 2 / (va**2 / 1 + vb**2 / 2)
    w = student_t_quantile(0.75, nu) / 0.6744897501960817  # z at 0.75
    assert estimate == pytest.approx(21 / 5)
    assert (lo, hi) == pytest.approx((21 / 5 - w * (21 / 5 - q_lo), 21 / 5 + w * (q_hi - 21 / 5)))
    plain = stratified_ci([a, b], lambda s: ratio(s.sum(axis=-2)), counts=counts, level=0.5, small_sample=False)
    assert plain.hi - plain.lo < hi - lo


def test_an_interval_from_single_request_groups_is_refused_as_nan():
    _, lo, hi = stratified_ci([[[2.0, 1]], [[3.0, 1]]], lambda s: ratio(s.sum(axis=-2)), resamples=50)
    assert math.isnan(lo) and math.isnan(hi)


def _synthetic_benchmarks(rng, per_benchmark, paired):
    """9 benchmarks of requests with a benchmark effect and a request effect; per request (tokens,
    rounds), and for ``paired`` a second evaluation B of the same requests (sharing the request
    effect, its τ 0.9 of A's in expectation). Returns groups [n, 2] or [n, 4] (A's then B's)."""
    groups = []
    for g in range(9):
        tau = 1.1 + 0.1 * g
        rounds_a = rng.integers(5, 40, per_benchmark).astype(float)
        effect = np.clip(rng.normal(0.0, 0.3, per_benchmark), -0.5, None)
        tokens_a = rounds_a * (tau + effect) + rng.normal(0, 1.0, per_benchmark) * np.sqrt(rounds_a)
        if not paired:
            groups.append(np.c_[tokens_a, rounds_a])
            continue
        rounds_b = rng.integers(5, 40, per_benchmark).astype(float)
        tokens_b = rounds_b * 0.9 * (tau + effect) + rng.normal(0, 1.0, per_benchmark) * np.sqrt(rounds_b)
        groups.append(np.c_[tokens_a, rounds_a, tokens_b, rounds_b])
    return groups


def _pooled(s):
    s = s.sum(axis=-2)
    return s[..., 0] / s[..., 1]


def _paired(s):  # the statistic of dspark.evaluation.paired: τ_A / τ_B over jointly resampled requests
    s = s.sum(axis=-2)
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


@pytest.mark.parametrize("paired", [False, True], ids=["pooled-ratio", "paired-ratio"])
def test_95_percent_intervals_cover_at_the_designs_evaluations_use(paired):
    statistic = _paired if paired else _pooled
    truth_groups = _synthetic_benchmarks(np.random.default_rng(99), 100_000, paired)  # the truth, to ~1e-3
    truth = float(statistic(np.stack([g.sum(axis=0) for g in truth_groups])))
    rng = np.random.default_rng(7)
    reps = 1000  # Monte Carlo error of a coverage near 0.95: about 0.007
    for per_benchmark in (2, 4, 8):
        hits = plain_hits = 0
        for rep in range(reps):
            groups = _synthetic_benchmarks(rng, per_benchmark, paired)
            _, lo, hi = stratified_ci(groups, statistic, resamples=400, seed=rep)
            hits += lo <= truth <= hi
            if per_benchmark == 2:
                _, lo, hi = stratified_ci(groups, statistic, resamples=400, seed=rep, small_sample=False)
                plain_hits += lo <= truth <= hi
        assert hits / reps >= 0.93, (per_benchmark, hits / reps)
        if per_benchmark == 2:
            assert plain_hits / reps < 0.90  # what the correction is for: n of n resampling undercovers
