"""Paired ratios of two evaluations of the same requests (dspark.evaluation.paired), in the demo summary's
scheduling section (dspark.evaluation.demo_results) and in `dspark compare` (dspark.evaluation.compare).

Oracles: speedup and τ ratios and their jackknife intervals computed by hand; coverage of the known
ratio of a synthetic paired population; the report's own pooled numbers (build_report)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dspark.bootstrap import jackknife_ci
from dspark.cli.main import main
from dspark.evaluation.compare import compare_reports
from dspark.evaluation.paired import (paired_ratio, paired_ratio_from_records, serving_paired_ratio, serving_tau,
                                     verdict)
from dspark.scheduling.results import SimResult
from dspark.evaluation.report import build_report
from dspark.evaluation.demo_page import summary_markdown, summary_short
from dspark.evaluation.demo_runs import load_run
from dspark.evaluation.verdicts import paired_rows


def _record(request, tokens, wall, base_tokens, base_wall, benchmark="gsm8k", prompt=10):
    return {"benchmark": benchmark, "request": request, "prompt_tokens": prompt, "tokens": tokens, "wall_s": wall,
            "baseline_tokens": base_tokens, "baseline_wall_s": base_wall}


def _rounds(request, accepted, benchmark="gsm8k"):
    return [{"benchmark": benchmark, "request": request, "round": i, "proposed": 3, "accepted": m}
            for i, m in enumerate(accepted)]


# A: speedups 0.5, 0.5, 0.8 per request; τ sums 3 / 2 rounds, 4 / 1, 1 / 1.
RECORDS_A = [_record(0, 10, 2.0, 10, 1.0), _record(1, 10, 4.0, 10, 2.0), _record(2, 20, 5.0, 20, 4.0)]
ROUNDS_A = _rounds(0, [1, 0]) + _rounds(1, [3]) + _rounds(2, [0])
# B: speedups 1, 1, 2; τ sums 1 / 1, 2 / 1, 4 / 2.
RECORDS_B = [_record(0, 10, 1.0, 10, 1.0), _record(1, 10, 2.0, 10, 2.0), _record(2, 20, 2.0, 20, 4.0)]
ROUNDS_B = _rounds(0, [0]) + _rounds(1, [1]) + _rounds(2, [1, 1])
T2 = 4.302653  # Student's t, 0.975 quantile, 2 degrees of freedom (one benchmark of 3 requests; any table)


def _hand_case(**kw):
    return paired_ratio_from_records(RECORDS_A, ROUNDS_A, RECORDS_B, ROUNDS_B, gamma_a=3, gamma_b=3, **kw)


def _jackknife_by_hand(estimate, deleted, t):
    """exp(log θ̂ ∓ t · sqrt((n − 1)/n · Σ (log θ_(i) − mean)²)): one group of n requests."""
    logs = [math.log(x) for x in deleted]
    n, mean = len(logs), sum(logs) / len(logs)
    half = t * math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in logs))
    return estimate, math.exp(math.log(estimate) - half), math.exp(math.log(estimate) + half)


def test_the_ratios_and_their_jackknife_intervals_by_hand():
    p = _hand_case()
    # Speedup A pooled (40 / 11) / (40 / 7) = 7/11, B (40 / 5) / (40 / 7) = 7/5: ratio 5/11. Without request 0:
    # A (30 / 9)/(30 / 6), B (30 / 4)/(30 / 6): 4/9; without 1: (30/7)/(30/5) over (30/3)/(30/5) = 3/7; without 2:
    # (20/6)/(20/3) over (20/3)/(20/3) = 1/2. (One benchmark: the n / (n − 1) weight cancels in each ratio.)
    assert tuple(p.speedup) == pytest.approx(_jackknife_by_hand(5 / 11, [4 / 9, 3 / 7, 1 / 2], T2))
    # τ A 8 / 4 = 2, B 7 / 4: ratio 8/7. Without request 0: (5/2)/(6/3) = 5/4; without 1: (4/3)/(5/3) = 4/5;
    # without 2: (7/3)/(3/2) = 14/9.
    assert tuple(p.tau) == pytest.approx(_jackknife_by_hand(8 / 7, [5 / 4, 4 / 5, 14 / 9], T2))
    assert (p.common, p.only_a, p.only_b, p.level) == (3, 0, 0, 0.95)
    t_half = 0.816497  # t at 0.75, 2 degrees of freedom: a 50 % interval
    assert tuple(_hand_case(level=0.5).tau) == pytest.approx(_jackknife_by_hand(8 / 7, [5 / 4, 4 / 5, 14 / 9], t_half))


def _cell(policy, shares, accepted, concurrency=1, benchmarks=None):
    """A batched serving cell: request i made shares[i] = (tokens, seconds of its steps) and its rounds accepted
    accepted[i] drafts each (no EOS)."""
    benchmarks = benchmarks or ["gsm8k"] * len(shares)
    requests = [{"index": i, "tag": [b, i], "step_tokens": t, "step_s": w} for i, ((t, w), b) in
                enumerate(zip(shares, benchmarks))]
    rounds = [{"request": i, "step": 0, "accepted": m, "eos_accepted": False, "proposed": 3}
              for i, ms in enumerate(accepted) for m in ms]
    return SimResult(policy=policy, concurrency=concurrency, engine="batched", requests=requests, rounds=rounds)


def test_serving_cells_pair_request_by_request_as_evaluations_do():
    # The hand case above as two serving cells: A's and B's tokens and step seconds per request, and the same
    # rounds. Both cells share one target-only decode, so the ratio of their speedups is that of their throughputs:
    # (40 / 11) / (40 / 5) = 5/11, and without request 0, 1, 2: 4/9, 3/7, 1/2 (as above).
    a = _cell("a", [(10, 2.0), (10, 4.0), (20, 5.0)], [[1, 0], [3], [0]])
    b = _cell("b", [(10, 1.0), (10, 2.0), (20, 2.0)], [[0], [1], [1, 1]])
    p = serving_paired_ratio(a, b)
    assert tuple(p.speedup) == pytest.approx(_jackknife_by_hand(5 / 11, [4 / 9, 3 / 7, 1 / 2], T2))
    assert tuple(p.tau) == pytest.approx(_jackknife_by_hand(8 / 7, [5 / 4, 4 / 5, 14 / 9], T2))
    assert (p.common, p.only_a, p.only_b) == (3, 0, 0)
    # τ of A alone: 8 / 4 rounds = 2; without request 0, 1, 2: 5/2, 4/3, 7/3 (log-scale jackknife, clipped at 1).
    estimate, lo, hi = _jackknife_by_hand(2.0, [5 / 2, 4 / 3, 7 / 3], T2)
    assert lo < 1 and tuple(serving_tau(a)) == pytest.approx((estimate, 1.0, hi))
    # A request only B served (its stop rule admitted one more) counts zeros in A.
    extra = _cell("b", [(10, 1.0), (10, 2.0), (20, 2.0), (8, 1.0)], [[0], [1], [1, 1], [0]])
    q = serving_paired_ratio(a, extra)
    assert (q.common, q.only_a, q.only_b) == (3, 0, 1)
    assert q.speedup.estimate == pytest.approx((40 / 11) / (48 / 6))


def test_serving_pairs_are_refused_across_r_other_jobs_or_without_step_shares():
    a = _cell("a", [(10, 2.0), (10, 4.0)], [[1], [0]])
    with pytest.raises(ValueError, match="same R"):
        serving_paired_ratio(a, _cell("b", [(10, 2.0), (10, 4.0)], [[1], [0]], concurrency=4))
    with pytest.raises(ValueError, match="same jobs"):
        serving_paired_ratio(a, _cell("b", [(10, 2.0), (10, 4.0)], [[1], [0]], benchmarks=["gsm8k", "mbpp"]))
    bare = _cell("b", [(10, 2.0), (10, 4.0)], [[1], [0]])
    for r in bare.requests:
        del r["step_s"]
    with pytest.raises(ValueError, match="step_tokens, step_s"):
        serving_paired_ratio(a, bare)


def test_the_serving_pair_interval_covers_the_request_noise_at_9_benchmarks_of_4():
    """9 benchmarks x 4 requests (the demo's scheduling size, the machine's speed held fixed): each
    request's speed shares a slowdown s_i under both policies (a long prompt is slow under both), with its
    own 5 % timing noise per decode, and A is 1.05x faster; acceptance p_i is shared too, A's 0.9 of B's."""
    rng = np.random.default_rng(7)
    trials, hit_speed, hit_tau = 200, 0, 0
    for _ in range(trials):
        n = 36
        s = rng.lognormal(0.0, 0.3, n)
        q = rng.uniform(0.2, 0.6, n)
        tokens = rng.integers(20, 25, n)
        shares_a = [(t, t / (1.05 * s[i] * rng.lognormal(0, 0.05))) for i, t in enumerate(tokens)]
        shares_b = [(t, t / (s[i] * rng.lognormal(0, 0.05))) for i, t in enumerate(tokens)]
        acc_a = [rng.binomial(1, 0.9 * q[i], 12).tolist() for i in range(n)]
        acc_b = [rng.binomial(1, q[i], 12).tolist() for i in range(n)]
        benchmarks = [f"b{i % 9}" for i in range(n)]
        p = serving_paired_ratio(_cell("a", shares_a, acc_a, benchmarks=benchmarks),
                                 _cell("b", shares_b, acc_b, benchmarks=benchmarks))
        hit_speed += p.speedup.lo <= 1.05 <= p.speedup.hi
        true_tau = (1 + 0.9 * q.mean()) / (1 + q.mean())  # E τ_A / E τ_B: rounds per request are equal
        hit_tau += p.tau.lo <= true_tau <= p.tau.hi
    # 95 % nominal; 200 trials: binomial sd 1.5 %.
    assert 0.9 <= hit_speed / trials <= 0.99 and 0.88 <= hit_tau / trials <= 0.99


def test_requests_are_matched_on_benchmark_and_request_whatever_their_order():
    # B's rows shuffled and an extra request in A that B lacks: the same ratios on the three common requests.
    extra = [_record(7, 10, 9.0, 10, 1.0)]
    p = paired_ratio_from_records(RECORDS_A + extra, ROUNDS_A + _rounds(7, [0, 0]), RECORDS_B[::-1], ROUNDS_B[::-1],
                                  gamma_a=3, gamma_b=3)
    assert (p.common, p.only_a, p.only_b) == (3, 1, 0)
    assert tuple(p.speedup) == pytest.approx(tuple(_hand_case().speedup))
    assert tuple(p.tau) == pytest.approx(tuple(_hand_case().tau))


def test_pairs_of_different_prompts_or_without_common_requests_are_refused():
    other = [dict(r, prompt_tokens=99) for r in RECORDS_B]
    with pytest.raises(ValueError, match="did not decode the same prompts"):
        paired_ratio_from_records(RECORDS_A, ROUNDS_A, other, ROUNDS_B, gamma_a=3, gamma_b=3)
    elsewhere = [dict(r, benchmark="mbpp") for r in RECORDS_B]
    with pytest.raises(ValueError, match="share no"):
        paired_ratio_from_records(RECORDS_A, ROUNDS_A, elsewhere, ROUNDS_B, gamma_a=3, gamma_b=3)


def test_the_interval_is_deterministic_and_a_report_against_itself_is_exactly_one():
    assert _hand_case() == _hand_case()
    same = paired_ratio_from_records(RECORDS_A, ROUNDS_A, RECORDS_A, ROUNDS_A, gamma_a=3, gamma_b=3)
    assert tuple(same.speedup) == pytest.approx((1.0, 1.0, 1.0)) and verdict(same.speedup) == "includes 1"


def test_verdict_says_which_side_of_1_an_interval_lies():
    p = _hand_case()
    assert verdict(p.speedup) == "below 1" and verdict(p.tau) == "includes 1" and verdict(None) == "–"


def _population(rng, n_per_bench, ratio_speed, p_scale):
    """Two policies on the same requests: request i has a target-only cost d_i (lognormal), a slowdown of
    speculation s_i shared by both policies (lognormal, wide: e.g. how its prompt suits the drafter) and a
    shared acceptance q_i ~ U(0.2, 0.8). Baseline seconds d_i; A's d_i · s_i · ratio⁻¹ · e, B's d_i · s_i · e'
    (e, e' lognormal noise of mean 1, independent of the rest): the ratio of the pooled speedups tends to
    ratio_speed. Ten rounds per request with τ = 1 + Bernoulli(q_i) for A and 1 + Bernoulli(p_scale · q_i)
    for B: τ ratio → 1.5 / (1 + 0.5 p_scale)."""
    recs, rnds = ([], []), ([], [])
    sigma = 0.1
    for bench in ("gsm8k", "mt-bench"):
        d = rng.lognormal(0.0, 0.4, n_per_bench)
        slow = rng.lognormal(0.3, 0.4, n_per_bench)
        q = rng.uniform(0.2, 0.8, n_per_bench)
        for i in range(n_per_bench):
            noise = rng.lognormal(-sigma**2 / 2, sigma, 2)
            walls = (d[i] * slow[i] / ratio_speed * noise[0], d[i] * slow[i] * noise[1])
            for k, (wall, p) in enumerate(zip(walls, (q[i], p_scale * q[i]))):
                recs[k].append(_record(i, 32, wall, 32, d[i], benchmark=bench))
                rnds[k].extend(_rounds(i, rng.binomial(1, p, 10).tolist(), benchmark=bench))
    return recs, rnds


def test_the_paired_interval_covers_the_known_ratio_and_is_narrower_than_one_speedups_own():
    rng = np.random.default_rng(0)
    true_speed, true_tau = 1.25, 1.5 / 1.25
    trials, hit_speed, hit_tau, narrower = 120, 0, 0, 0
    for t in range(trials):
        (ra, rb), (na, nb) = _population(rng, 30, true_speed, 0.5)
        p = paired_ratio_from_records(ra, na, rb, nb, gamma_a=3, gamma_b=3)
        hit_speed += p.speedup.lo <= true_speed <= p.speedup.hi
        hit_tau += p.tau.lo <= true_tau <= p.tau.hi
        # A's own speedup interval (unpaired, as dspark.evaluation.intervals computes it), relative to its value.
        groups = [np.array([[r["tokens"], r["wall_s"], r["baseline_tokens"], r["baseline_wall_s"]]
                            for r in ra if r["benchmark"] == b]) for b in ("gsm8k", "mt-bench")]
        own = jackknife_ci(groups, lambda s: (s.sum(-2)[..., 0] / s.sum(-2)[..., 1]) /
                           (s.sum(-2)[..., 2] / s.sum(-2)[..., 3]), scale="log")
        narrower += (p.speedup.hi - p.speedup.lo) / p.speedup.estimate < (own.hi - own.lo) / own.estimate
    # 95 % nominal; 120 trials: binomial sd 2 %.
    assert 0.87 <= hit_speed / trials <= 0.99 and 0.87 <= hit_tau / trials <= 0.99
    assert narrower == trials  # the shared slowdown s_i cancels in the paired ratio, not in one speedup


# ------------------------------------------------------------------ folders: summary and compare
def _eval_folder(folder: Path, records, rounds, label):
    folder.mkdir(parents=True)
    report = build_report(records, rounds, gamma=3, label=label, bootstrap_resamples=200, bootstrap_seed=5)
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return report


@pytest.fixture
def sched_run(tmp_path: Path) -> Path:
    """A run folder with static and algorithm1 scheduled at R = 1 on the same 40 requests (algorithm1 1.25x
    faster), and algorithm1 at R = 4 (not paired: only R = 1 has wall-clock evaluations)."""
    (ra, rb), (na, nb) = _population(np.random.default_rng(3), 20, 1.25, 0.5)
    root = tmp_path / "demo"
    _eval_folder(root / "sched" / "static-R1", rb, nb, "static")
    _eval_folder(root / "sched" / "algorithm1-R1", ra, na, "algorithm1")
    _eval_folder(root / "sched" / "algorithm1-R4", ra, na, "algorithm1")
    (root / "demo.json").write_text(json.dumps({"schedule": {"policies": ["static", "algorithm1"]}}))
    return root


def test_the_summary_shows_each_policys_paired_speedup_over_static(sched_run):
    run = load_run(sched_run)
    rows = paired_rows(run)
    assert [x["policy"] for x in rows] == ["algorithm1"]
    expected = paired_ratio(sched_run / "sched" / "algorithm1-R1", sched_run / "sched" / "static-R1")
    assert rows[0]["paired"] == expected
    # The estimate is the ratio of the two reports' own pooled speedups (all requests are common).
    reports = {p: json.loads((sched_run / "sched" / f"{p}-R1" / "report.json").read_text()) for p in ("algorithm1", "static")}
    assert expected.speedup.estimate == pytest.approx(reports["algorithm1"]["all"]["speedup"] / reports["static"]["all"]["speedup"])
    assert expected.tau.estimate == pytest.approx(reports["algorithm1"]["all"]["tau"] / reports["static"]["all"]["tau"])
    assert expected.speedup.lo > 1.0
    page = summary_markdown(run)
    assert "| policy (R = 1) | speedup vs static (paired) [95 %] | τ vs static (paired) [95 %] |" in page
    row = f"| algorithm1 | {expected.speedup.estimate:.2f} [{expected.speedup.lo:.2f}, {expected.speedup.hi:.2f}] |"
    assert row in page and "above static beyond the interval | 40 |" in page
    assert "algorithm1 / static (paired, R=1): speedup ratio" in summary_short(run)


def test_the_summary_names_a_pair_it_cannot_compute_and_skips_the_table_without_static(sched_run):
    (sched_run / "sched" / "algorithm1-R1" / "rounds.jsonl").unlink()
    run = load_run(sched_run)
    assert "not computed:" in summary_markdown(run) and "rounds.jsonl" in paired_rows(run)[0]["error"]
    (sched_run / "sched" / "static-R1" / "report.json").unlink()
    assert paired_rows(load_run(sched_run)) == [] and "(paired)" not in summary_markdown(load_run(sched_run))


def test_compare_adds_a_paired_line_per_pair_that_shares_requests(sched_run, tmp_path, capsys):
    a, b = sched_run / "sched" / "algorithm1-R1", sched_run / "sched" / "static-R1"
    expected = paired_ratio(a, b)
    line = (f"- algorithm1 / static: speedup ratio {expected.speedup.estimate:.3f} [{expected.speedup.lo:.3f}, "
            f"{expected.speedup.hi:.3f}] (above 1), τ ratio {expected.tau.estimate:.3f}")
    assert line in compare_reports({"algorithm1": a, "static": b})
    # Reports given as dicts (no folders) or of different prompts: no paired lines.
    loaded = {k: json.loads((f / "report.json").read_text()) for k, f in (("algorithm1", a), ("static", b))}
    assert "Paired ratios" not in compare_reports(loaded)
    other = tmp_path / "other"
    _eval_folder(other, [dict(r, benchmark="mbpp") for r in RECORDS_B], [dict(r, benchmark="mbpp") for r in ROUNDS_B],
                 "other")
    assert "- algorithm1 / other" not in compare_reports({"algorithm1": a, "other": other})
    assert main(["compare", str(a), str(b), str(other)]) == 0
    assert line in capsys.readouterr().out
