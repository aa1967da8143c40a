"""Intervals over requests (dspark.bootstrap: the stratified jackknife, the percentile bootstrap,
Wilson on effective counts) and their use in the evaluation report (dspark.evaluation.intervals via
dspark.evaluation.report.build_report) and the STS report (dspark.scheduling.calibration).

Oracles: hand-computed quantiles of a fixed resample set; hand-computed jackknife and Wilson
intervals; a brute-force jackknife that deletes request records and calls the plain metric
functions; a brute-force bootstrap that resamples the request records themselves; the exact τ of
a synthetic geometric acceptance process, and the simulated designs of bench/interval_coverage.py
(coverage)."""

import copy
import math

import numpy as np
import pytest

from dspark.bootstrap import (
    bootstrap_ci,
    bootstrap_ci_from_indices,
    counts_from_indices,
    intervals_overlap,
    design_df,
    jackknife_ci,
    percentile_interval,
    proportion_ci,
    resample_counts,
    small_sample_factors,
    stratified_ci,
    student_t_quantile,
)
from dspark.scheduling.calibration import calibrate_rounds
from dspark.scheduling.calibration_metrics import confidence_metrics, ece, ece_from_sums, ece_sums, prefix_labels
from dspark.evaluation.intervals import add_intervals
from dspark.io.jsonsafe import to_jsonable
from dspark.evaluation.metrics import macro_average, macro_average_array, tau_pooled
from helpers.paths import load_script
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
            for dup, i in enumerate(draws[n][r]):
                rec.append(dict(mine[i], request=(mine[i]["request"], dup)))
                rows += [dict(x, request=(x["request"], dup)) for x in rounds
                         if x["benchmark"] == n and x["request"] == mine[i]["request"]]
        values.append(metric(rec, rows))
    return np.percentile(values, [2.5, 97.5])


def brute_force_jackknife(records, rounds, metric, scale, t, floor=-math.inf):
    """The jackknife interval by deleting request records themselves: each remaining request of the
    deleted request's benchmark weighs n / (n − 1) (every benchmark keeps its weight); ``metric``
    takes the kept records, rounds and a weight per (benchmark, request)."""
    names = list(dict.fromkeys(r["benchmark"] for r in records))
    h, inverse = {"log": (math.log, math.exp)}[scale]
    variance = 0.0
    for n in names:
        mine = [x for x in records if x["benchmark"] == n]
        values = []
        for gone in mine:
            weight = {(x["benchmark"], x["request"]): (len(mine) / (len(mine) - 1) if x["benchmark"] == n else 1.0)
                      for x in records if x is not gone}
            kept = [x for x in records if x is not gone]
            rows = [x for x in rounds if (x["benchmark"], x["request"]) in weight]
            values.append(h(metric(kept, rows, weight)))
        variance += (len(mine) - 1) / len(mine) * sum((v - sum(values) / len(values)) ** 2 for v in values)
    estimate = h(metric(records, rounds, {(x["benchmark"], x["request"]): 1.0 for x in records}))
    return [max(floor, inverse(estimate - t * math.sqrt(variance))), inverse(estimate + t * math.sqrt(variance))]


def test_report_intervals_match_a_brute_force_jackknife_of_the_plain_metrics():
    records, rounds = synthetic_run(np.random.default_rng(5))  # gsm8k 6 requests, alpaca 4: ν = 5 + 3
    report = build_report(records, rounds, gamma=3, label="x", bootstrap_resamples=60, bootstrap_seed=11)
    t8 = 2.306004  # Student's t, 0.975 quantile, 8 degrees of freedom (any table)

    def all_tau(rec, rows, weight):
        w = [weight[(x["benchmark"], x["request"])] for x in rows]
        return sum(wi * (x["accepted"] + 1) for wi, x in zip(w, rows)) / sum(w)

    def macro_speedup(rec, rows, weight):  # within a benchmark every kept request weighs the same
        per = {}
        for n in ("gsm8k", "alpaca"):
            mine = [x for x in rec if x["benchmark"] == n]
            per[n] = (sum(x["tokens"] for x in mine) / sum(x["wall_s"] for x in mine)) / (
                sum(x["baseline_tokens"] for x in mine) / sum(x["baseline_wall_s"] for x in mine))
        return macro_average(per)["avg"]

    assert report["all"]["tau_ci"] == pytest.approx(brute_force_jackknife(records, rounds, all_tau, "log", t8, floor=1.0))
    assert report["macro"]["speedup_ci"]["avg"] == pytest.approx(
        brute_force_jackknife(records, rounds, macro_speedup, "log", t8))
    assert all_tau(records, rounds, {(x["benchmark"], x["request"]): 1.0 for x in records}) == pytest.approx(
        tau_pooled([x["accepted"] for x in rounds]))  # the weighted oracle is the plain metric at weight 1


def test_report_ece_intervals_match_a_brute_force_bootstrap_of_the_plain_metric(plain_bootstrap):
    records, rounds = synthetic_run(np.random.default_rng(5))
    report = build_report(records, rounds, gamma=3, label="x", bootstrap_resamples=60, bootstrap_seed=11)

    def ece_k2(rec, rows):
        return confidence_metrics([x["confidences"] for x in rows], [x["accepted"] for x in rows],
                                  [x["proposed"] for x in rows])[1]["ece"]

    assert report["all"]["confidence"][1]["ece_ci"] == pytest.approx(brute_force(records, rounds, 60, 11, ece_k2))


def test_report_proportions_get_wilson_intervals_on_effective_counts():
    records, rounds = synthetic_run(np.random.default_rng(5), requests=(6, 6))
    report = build_report(records, rounds, gamma=3, label="x", bootstrap_resamples=60)
    passed = {n: np.zeros((6, 3)) for n in ("gsm8k", "alpaca")}
    reached = {n: np.zeros((6, 3)) for n in ("gsm8k", "alpaca")}
    for r in rounds:
        for k in range(3):
            passed[r["benchmark"]][r["request"], k] += r["accepted"] >= k + 1
            reached[r["benchmark"]][r["request"], k] += r["accepted"] >= k
    groups = [np.stack([passed[n], reached[n]], axis=-1) for n in ("gsm8k", "alpaca")]
    _, lo, hi = proportion_ci(groups)
    np.testing.assert_allclose(np.array(report["all"]["conditional_acceptance_ci"], dtype=float), np.c_[lo, hi])
    for (a, b), value in zip(report["all"]["conditional_acceptance_ci"], report["all"]["conditional_acceptance"]):
        assert math.isnan(a) or 0.0 <= a <= value <= b <= 1.0


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


def test_small_sample_factors_and_design_df_by_hand():
    assert small_sample_factors([2, 4, 1]) == pytest.approx([math.sqrt(2), math.sqrt(4 / 3), 0.0])
    assert design_df([2, 4, 3]) == 6.0 and design_df([2, 1, 1]) == 1.0  # a group of one adds nothing
    assert math.isnan(design_df([1, 1]))  # no group of two: no interval


def test_corrected_interval_of_a_fixed_resample_set_by_hand():
    # Group A: requests (2 over 1), (4 over 1); group B: (3 over 1), (5 over 1), (7 over 1). Statistic: pooled ratio.
    a, b = np.array([[2.0, 1], [4, 1]]), np.array([[3.0, 1], [5, 1], [7, 1]])
    counts = [np.array([[2, 0], [0, 2], [1, 1]]), np.array([[3, 0, 0], [1, 1, 1], [0, 0, 3]])]
    statistic = lambda s: ratio(s.sum(axis=-2))  # noqa: E731
    values = sorted([(4 + 9) / 5, (8 + 15) / 5, (6 + 21) / 5])  # the three resamples' pooled ratios
    q_lo, q_hi = np.percentile(values, [25, 75])
    theta = 21 / 5
    # Groups of unequal sizes: f² weighs f_A² = 2 and f_B² = 3/2 by each group's variance on the scale.
    for scale, h, inverse in (("identity", lambda x: x, lambda y: y), ("log", math.log, math.exp)):
        va = np.var([h((4 + 15) / 5), h((8 + 15) / 5), h((6 + 15) / 5)])
        vb = np.var([h((6 + 9) / 5), h((6 + 15) / 5), h((6 + 21) / 5)])
        f = math.sqrt((2 * va + 1.5 * vb) / (va + vb))
        w = f * student_t_quantile(0.75, 3.0) / 0.6744897501960817  # ν = 1 + 2, z at 0.75
        estimate, lo, hi = stratified_ci([a, b], statistic, counts=counts, level=0.5, scale=scale)
        assert estimate == pytest.approx(theta)
        assert (lo, hi) == pytest.approx((inverse(h(theta) - w * (h(theta) - h(q_lo))),
                                          inverse(h(theta) + w * (h(q_hi) - h(theta)))))
    plain = stratified_ci([a, b], statistic, counts=counts, level=0.5, small_sample=False)
    assert (plain.lo, plain.hi) == pytest.approx((q_lo, q_hi))


def test_a_logit_scale_bootstrap_interval_stays_in_zero_one():
    # A proportion-like statistic whose resamples are often 0: the stretched bounds stay in [0, 1].
    rng = np.random.default_rng(0)
    for _ in range(200):
        groups = [np.c_[rng.binomial(2, 0.1, 3), np.full(3, 2)].astype(float) for _ in range(4)]
        _, lo, hi = stratified_ci(groups, lambda s: ratio(s.sum(axis=-2)), resamples=100, seed=1, scale="logit")
        assert math.isnan(lo) or 0.0 <= lo <= hi <= 1.0


def test_an_interval_from_single_request_groups_is_refused_as_nan():
    for interval in (stratified_ci([[[2.0, 1]], [[3.0, 1]]], lambda s: ratio(s.sum(axis=-2)), resamples=50),
                     jackknife_ci([[[2.0, 1]], [[3.0, 1]]], lambda s: ratio(s.sum(axis=-2)))):
        assert math.isnan(interval.lo) and math.isnan(interval.hi)


# ------------------------------------------------------------------ the jackknife


def test_jackknife_interval_by_hand():
    # Group A: (2 over 1), (4 over 1); group B: (3 over 1), (5 over 2), (7 over 1). Pooled ratio 21 / 6.
    a, b = np.array([[2.0, 1], [4, 1]]), np.array([[3.0, 1], [5, 2], [7, 1]])
    statistic = lambda s: ratio(s.sum(axis=-2))  # noqa: E731
    # Deleting a request of A doubles the other (n / (n − 1) = 2); of B multiplies the other two by 3/2.
    del_a = [(2 * 4 + 15) / (2 * 1 + 4), (2 * 2 + 15) / (2 * 1 + 4)]
    del_b = [(6 + 1.5 * 12) / (2 + 1.5 * 3), (6 + 1.5 * 10) / (2 + 1.5 * 2), (6 + 1.5 * 8) / (2 + 1.5 * 3)]
    for scale, h, inverse in (("identity", lambda x: x, lambda y: y), ("log", math.log, math.exp)):
        ha, hb = [h(x) for x in del_a], [h(x) for x in del_b]
        v = 1 / 2 * sum((x - np.mean(ha)) ** 2 for x in ha) + 2 / 3 * sum((x - np.mean(hb)) ** 2 for x in hb)
        t3 = 3.182446  # Student's t, 0.975 quantile, ν = 1 + 2 (any table)
        estimate, lo, hi = jackknife_ci([a, b], statistic, scale=scale)
        assert estimate == pytest.approx(21 / 6)
        assert (lo, hi) == pytest.approx((inverse(h(21 / 6) - t3 * math.sqrt(v)), inverse(h(21 / 6) + t3 * math.sqrt(v))))


def test_jackknife_bounds_stay_in_the_statistics_support():
    groups = [np.array([[1.0, 1], [1.3, 1]]), np.array([[1.0, 1], [5.0, 1]])]  # τ near 1, one long request
    statistic = lambda s: ratio(s.sum(axis=-2))  # noqa: E731
    free = jackknife_ci(groups, statistic, scale="log")
    clipped = jackknife_ci(groups, statistic, scale="log", support=(1.0, math.inf))
    assert free.lo < 1.0 and clipped.lo == 1.0 and clipped.hi == free.hi  # τ >= 1: the bound is clipped
    assert jackknife_ci(groups, statistic, scale="log").lo > 0  # the log scale keeps a ratio positive
    with pytest.raises(ValueError, match="scale must be one of"):
        jackknife_ci(groups, statistic, scale="sqrt")


# ------------------------------------------------------------------ proportions


def wilson_by_hand(passed, reached, groups_of, t):
    """Wilson on effective counts for one position, from per-request lists, by the formulas."""
    theta = sum(passed) / sum(reached)
    n_total = sum(reached)
    v = 0.0
    for g in set(groups_of):
        e = [p - theta * r for p, r, x in zip(passed, reached, groups_of) if x == g]
        v += len(e) / (len(e) - 1) * sum((x - sum(e) / len(e)) ** 2 for x in e)
    v /= n_total**2
    deff = max(v / (theta * (1 - theta) / n_total), 0.5)
    n = n_total / deff
    center = (theta + t * t / (2 * n)) / (1 + t * t / n)
    half = t * math.sqrt(theta * (1 - theta) / n + t * t / (4 * n * n)) / (1 + t * t / n)
    return theta, center - half, center + half


def test_proportion_interval_by_hand():
    # Two benchmarks of 3 requests: (passed, reached) per request.
    a = [(1, 4), (0, 3), (3, 5)]
    b = [(2, 2), (0, 4), (1, 3)]
    groups = [np.array(a, dtype=float)[:, None, :], np.array(b, dtype=float)[:, None, :]]
    t4 = 2.776445  # Student's t, 0.975 quantile, ν = 2 + 2 (any table)
    want = wilson_by_hand([p for p, _ in a + b], [r for _, r in a + b], [0, 0, 0, 1, 1, 1], t4)
    got = proportion_ci(groups, min_rounds=1, min_requests=1)
    assert [float(np.asarray(x)[0]) for x in got] == pytest.approx(want)


def test_a_proportion_below_its_minimum_counts_has_no_interval():
    few_rounds = [np.array([[[1, 3]], [[0, 2]], [[1, 2]]], dtype=float)] * 2  # 14 rounds, 6 requests
    assert not math.isnan(float(proportion_ci(few_rounds, min_rounds=10, min_requests=5).lo[0]))
    assert math.isnan(float(proportion_ci(few_rounds, min_rounds=15, min_requests=5).lo[0]))  # < 15 rounds
    assert math.isnan(float(proportion_ci(few_rounds, min_rounds=10, min_requests=7).lo[0]))  # < 7 requests
    # Zero passes: an interval [0, hi] with hi > 0, not a point.
    none_passed = [np.array([[[0, 5]], [[0, 4]], [[0, 3]]], dtype=float)] * 2
    _, lo, hi = proportion_ci(none_passed)
    assert float(lo[0]) == 0.0 and 0.0 < float(hi[0]) < 0.5


def test_no_proportion_interval_leaves_zero_one_at_sparse_designs():
    # Property: random sparse designs (2-8 requests per benchmark, most requests reaching a late position
    # zero or one times), every interval given lies in [0, 1] and holds its estimate.
    rng = np.random.default_rng(3)
    for _ in range(2000):
        groups = []
        for _ in range(int(rng.integers(1, 10))):
            n = int(rng.integers(1, 9))
            reached = rng.poisson(rng.uniform(0.05, 2.0), size=(n, 4)).astype(float)
            passed = rng.binomial(reached.astype(int), rng.uniform(0.0, 1.0)).astype(float)
            groups.append(np.stack([passed, reached], axis=-1))
        theta, lo, hi = proportion_ci(groups, min_rounds=1, min_requests=1)
        for t, a, b in zip(np.atleast_1d(theta), np.atleast_1d(lo), np.atleast_1d(hi)):
            if not math.isnan(a):
                assert 0.0 <= a <= t <= b <= 1.0, (t, a, b)


# ------------------------------------------------------------------ coverage at the designs evaluations use


@pytest.fixture(scope="module")
def coverage_bench():
    return load_script("bench/interval_coverage.py")


@pytest.mark.parametrize("design", ["sparse:4", "sparse:2", "sparse:8", "dense:2", "dense:4", "dense:8"])
def test_95_percent_intervals_cover_between_0_93_and_0_985_at_the_designs_evaluations_use(coverage_bench, design):
    # 2000 simulated evaluations: the Monte Carlo error of a coverage near 0.95 is about 0.005.
    profile, per_benchmark = design.split(":")
    rows = coverage_bench.coverage(coverage_bench.Design(profile, int(per_benchmark)), reps=2000)
    for name, row in rows.items():  # tau, paired, cond k=2..4
        assert 0.93 <= row["coverage"] <= 0.985, (design, name, row)
        assert row["outside"] == 0.0, (design, name, row)
        assert row["given"] >= (0.5 if name == "cond k=4" and per_benchmark == "2" else 0.95), (design, name, row)


def test_the_rescaled_sums_reference_leaves_zero_one_at_the_demo_design(coverage_bench):
    # What the corrections on the statistic's scale and Wilson's interval avoid: stretching resampled
    # sums about the observed ones turns sparse counts negative.
    rows = coverage_bench.coverage(coverage_bench.Design("sparse", 2), reps=100, method="rescaled-sums")
    assert rows["cond k=4"]["outside"] > 0.2
