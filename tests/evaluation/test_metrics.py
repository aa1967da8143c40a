"""Draft-quality metrics over round logs, against hand-computed values.

The synthetic log, γ = 3 (m accepted, ℓ verified, τ = m + 1):

    request A (gsm8k/0): (m, ℓ) = (3, 3) (1, 3) (0, 3) (0, 3)    τ = 4 2 1 1  mean 2
    request B (gsm8k/1): (m, ℓ) = (2, 3) (2, 2) (1, 1)           τ = 3 3 2    mean 8/3

B's last two rounds verified fewer than γ drafts (a scheduler's choice).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dspark.scheduling.calibration import apply_temperatures
from dspark.scheduling.calibration_metrics import confidence_metrics
from dspark.data.benchmarks import BENCHMARKS
from dspark.evaluation.metrics import (
    MACRO_COLUMNS,
    MACRO_KEYS,
    acceptance_rate,
    conditional_acceptance,
    conditional_acceptance_counts,
    confidence_quality,
    macro_average,
    prefix_survival,
    round_tau,
    summarize_rounds,
    tau_per_request,
    tau_pooled,
    verify_rate,
)

GAMMA = 3
M = [3, 1, 0, 0, 2, 2, 1]
L = [3, 3, 3, 3, 3, 2, 1]
REQ = [0, 0, 0, 0, 1, 1, 1]


def round_log(confidences=None):
    confidences = confidences or [[0.5, 0.5, 0.5]] * len(M)
    return [
        {"benchmark": "gsm8k", "request": q, "round": i, "proposed": ell, "accepted": m, "confidences": c}
        for i, (m, ell, q, c) in enumerate(zip(M, L, REQ, confidences))
    ]


def test_pooled_tau_is_the_mean_of_accepted_plus_one_over_rounds():
    assert tau_pooled(M) == pytest.approx(16 / 7)


def test_per_request_tau_averages_each_requests_mean():
    assert tau_per_request(M, REQ) == pytest.approx((2 + 8 / 3) / 2)


def test_a_round_that_accepted_an_eos_counts_no_token_after_it():
    """Round 5 (m = 2 = ℓ) ended on an accepted EOS: τ = 2, not 3. Pooled (16 − 1) / 7;
    request 1: (3 + 2 + 2) / 3."""
    eos = [False] * 5 + [True, False]
    assert tau_pooled(M, eos) == pytest.approx(15 / 7)
    assert tau_per_request(M, REQ, eos) == pytest.approx((2 + 7 / 3) / 2)
    assert [round_tau({"accepted": m, "eos_accepted": e}) for m, e in zip(M, eos)] == [4, 2, 1, 1, 3, 2, 2]
    rows = [{**r, "eos_accepted": e} for r, e in zip(round_log(), eos)]
    assert summarize_rounds(rows, GAMMA)["tau"] == pytest.approx(15 / 7)
    with pytest.raises(ValueError, match="eos_accepted"):
        tau_pooled(M, eos[:3])


def test_tau_of_an_empty_log_is_nan():
    assert math.isnan(tau_pooled([])) and math.isnan(tau_per_request([], []))


def test_conditional_acceptance_counts_only_rounds_that_reached_and_verified_position_k():
    # k=1: all 7 reached, 5 accepted. k=2: m≥1 and ℓ≥2 -> 4 rounds ((3,3) (1,3) (2,3) (2,2)), 3 with m≥2.
    # k=3: m≥2 and ℓ≥3 -> (3,3) (2,3); only (3,3) accepts it. (2,2) reached k=3 but did not verify it.
    num, den = conditional_acceptance_counts(M, L, GAMMA)
    assert num.tolist() == [5, 3, 1]
    assert den.tolist() == [7, 4, 2]
    assert conditional_acceptance(M, L, GAMMA) == pytest.approx([5 / 7, 3 / 4, 1 / 2])


def test_conditional_acceptance_is_nan_where_no_round_reached_the_position():
    rates = conditional_acceptance([0, 0], [3, 3], GAMMA)
    assert rates[0] == 0.0 and math.isnan(rates[1]) and math.isnan(rates[2])


def test_prefix_survival_is_the_fraction_of_rounds_with_at_least_k_accepted():
    assert prefix_survival(M, GAMMA) == pytest.approx([5 / 7, 3 / 7, 1 / 7])


def test_verify_rate_is_the_mean_verified_length_over_gamma():
    assert verify_rate(L, GAMMA) == pytest.approx((18 / 7) / 3)


def test_acceptance_rate_is_accepted_over_verified_tokens():
    assert acceptance_rate(M, L) == pytest.approx(9 / 18)


def test_a_round_accepting_more_than_it_verified_is_rejected():
    with pytest.raises(ValueError, match="round 1 has accepted=3, proposed=2"):
        conditional_acceptance_counts([1, 3], [3, 2], GAMMA)
    with pytest.raises(ValueError, match="gamma=3"):
        conditional_acceptance_counts([1], [4], GAMMA)


def test_confidence_quality_with_constant_confidence_matches_hand_values():
    # a_k = 0.5, 0.25, 0.125. Position 1: 7 valid rounds, 5 positives -> ECE |0.5 − 5/7|, Brier 0.25.
    # Position 2: ℓ≥2 -> 6 rounds, labels m≥2 -> 3 of 6 -> Brier (3·0.75² + 3·0.25²)/6 = 0.3125.
    quality = confidence_quality([[0.5, 0.5, 0.5]] * 7, M, L)
    assert quality[0]["count"] == 7 and quality[1]["count"] == 6 and quality[2]["count"] == 5
    assert quality[0]["ece"] == pytest.approx(abs(0.5 - 5 / 7))
    assert quality[0]["brier"] == pytest.approx(0.25)
    assert quality[1]["brier"] == pytest.approx(0.3125)
    assert quality[1]["ece"] == pytest.approx(abs(0.25 - 0.5))
    assert quality[0]["auroc"] == pytest.approx(0.5)  # constant scores rank nothing


def test_confidence_quality_leaves_out_rounds_without_confidences():
    conf = [[0.5, 0.5, 0.5]] * 6 + [None]  # B's (1, 1) round has none
    quality = confidence_quality(conf, M, L)
    assert quality[0]["count"] == 6
    assert quality[0]["ece"] == pytest.approx(abs(0.5 - 4 / 6))
    assert confidence_quality([None, None], [1, 0], [3, 3]) is None


def test_confidence_quality_applies_sts_temperatures_before_the_product():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.05, 0.95, (7, GAMMA))
    temps = [0.5, 2.0, 1.5]
    got = confidence_quality(conf.tolist(), M, L, temperatures=temps)
    want = confidence_metrics(apply_temperatures(conf, temps), M, L, n_bins=20)
    for g, w in zip(got, want):
        assert g["ece"] == pytest.approx(w["ece"]) and g["brier"] == pytest.approx(w["brier"])


def test_summarize_rounds_collects_every_metric_of_the_log():
    s = summarize_rounds(round_log(), GAMMA, temperatures=[1.0, 1.0, 1.0])
    assert s["num_rounds"] == 7 and s["num_requests"] == 2
    assert s["tau"] == pytest.approx(16 / 7)
    assert s["tau_per_request"] == pytest.approx(7 / 3)
    assert s["conditional_acceptance"] == pytest.approx([5 / 7, 3 / 4, 1 / 2])
    assert s["conditional_acceptance_num"] == [5, 3, 1] and s["conditional_acceptance_den"] == [7, 4, 2]
    assert s["prefix_survival"] == pytest.approx([5 / 7, 3 / 7, 1 / 7])
    assert s["verify_rate"] == pytest.approx(6 / 7)
    assert s["acceptance_rate"] == pytest.approx(0.5)
    assert s["confidence"][0]["brier"] == pytest.approx(0.25)
    assert s["confidence_calibrated"][0]["ece"] == pytest.approx(s["confidence"][0]["ece"])  # T = 1 changes nothing


def test_summarize_rounds_tells_requests_of_different_benchmarks_apart():
    log = round_log()
    for r in log[4:]:
        r["benchmark"] = "math500"
        r["request"] = 0  # same request index as A, other benchmark
    assert summarize_rounds(log, GAMMA)["num_requests"] == 2


def test_macro_columns_are_table_1s_domain_headers_then_avg():
    assert MACRO_KEYS == ("math", "code", "chat", "avg")
    assert list(MACRO_COLUMNS.values()) == ["Math", "Code", "Chat", "Avg"]


def test_macro_average_means_per_domain_and_over_present_benchmarks():
    values = {"gsm8k": 4.0, "math500": 5.0, "humaneval": 3.0, "alpaca": float("nan"), "custom": 10.0}
    macro = macro_average(values)
    assert macro["math"] == pytest.approx(4.5)
    assert macro["code"] == pytest.approx(3.0)
    assert math.isnan(macro["chat"])
    assert macro["avg"] == pytest.approx(4.0)


def test_macro_average_of_all_nine_equals_the_mean_of_the_domain_means():
    values = {name: float(i) for i, name in enumerate(BENCHMARKS)}
    macro = macro_average(values)
    assert macro["avg"] == pytest.approx(np.mean([macro["math"], macro["code"], macro["chat"]]))
