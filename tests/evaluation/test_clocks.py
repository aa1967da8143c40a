"""The wall clock against the SPS clock of the same requests (dspark.evaluation.clocks).

Oracles: the two ratios and their difference computed by hand from the formulas (module docstring)
on made-up requests and a made-up SPS profile, the stratified jackknife written out by deletion,
the variance over the profile's bootstrap tables priced by hand, Student's t from a table; and the
simulator's own ``vs_target_only`` of real R = 1 runs on the tiny models, priced by the same table."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from dspark.decoding.loop import target_generate
from dspark.evaluation.clocks import (
    CLOCK_COLUMNS,
    clock_difference,
    clock_verdict,
    forward_sizes,
    load_scheduled_evaluation,
    request_clock_aggregates,
)
from dspark.scheduling.simulator import DecodeSettings, Job, ServeSettings, run_requests
from dspark.scheduling.sps_profile import SPSProfile, bootstrap_tables

T4 = 2.776445  # Student's t, 0.975 quantile, 4 degrees of freedom (two benchmarks of 3 requests)
PHASES = ("draft", "verify", "accept", "bookkeeping", "schedule")

# The profile's medians: 10, 12.5 and 20 ms at B = 1, 2, 4; SPS(3) interpolated as the table does.
SPEEDS = {1: 100.0, 2: 80.0, 3: (80.0 + 50.0) / 2, 4: 50.0}


def make_profile(noise: bool = True) -> SPSProfile:
    """Five sweeps at B = 1, 2, 4 whose median is 10, 12.5, 20 ms; each B jitters on its own (a
    drift shared by every B would cancel in the ratio), or not at all."""
    jitter = {1: [1.0, 1.1, 0.9, 1.05, 0.95], 2: [1.0, 0.92, 1.08, 0.97, 1.04], 4: [1.0, 1.06, 0.93, 0.9, 1.1]}
    base = {1: 0.010, 2: 0.0125, 4: 0.020}
    seconds = [[base[b] * (j if noise else 1.0) for j in jitter[b]] for b in (1, 2, 4)]
    return SPSProfile([1, 2, 4], seconds, [statistics.median(s) for s in seconds], context_len=128,
                      tokens_per_request=None, warmup=1, repeats=5, device="cpu", dtype="float32", threads=1)


def _request(benchmark, request, tokens, sizes, phases, base_tokens, base_decode):
    """A requests.jsonl row (prefill 50 ms, baseline prefill 40 ms) and its rounds.jsonl rows."""
    timings = {"prefill": 0.05, **dict(zip(PHASES, phases))}
    timings["total"] = sum(timings.values())
    record = {"benchmark": benchmark, "request": request, "prompt_tokens": 12, "tokens": tokens,
              "wall_s": timings["total"], "timings": timings, "baseline_tokens": base_tokens,
              "baseline_wall_s": 0.04 + base_decode, "baseline_timings": {"prefill": 0.04, "decode": base_decode}}
    rounds = [{"benchmark": benchmark, "request": request, "round": i, "proposed": b - 1, "accepted": 0,
               "drafted": b > 1, "batch_tokens": b} for i, b in enumerate(sizes)]
    return record, rounds


def made_up(base_scale: float = 1.0):
    """Two benchmarks of three requests; mbpp's last ends at x_0 (no round, no verify phase).
    ``base_scale`` multiplies the baseline decode seconds (the wall clock's speedup with it)."""
    rows = [
        _request("gsm8k", 0, 8, [4, 4, 1], [0.012, 0.045, 0.003, 0.004, 0.001], 8, 0.070),
        _request("gsm8k", 1, 5, [2, 3], [0.008, 0.030, 0.002, 0.003, 0.001], 5, 0.045),
        _request("gsm8k", 2, 7, [4, 2, 2], [0.012, 0.047, 0.003, 0.0035, 0.0012], 7, 0.065),
        _request("mbpp", 0, 4, [3, 1], [0.006, 0.026, 0.002, 0.002, 0.0008], 4, 0.032),
        _request("mbpp", 1, 4, [4], [0.004, 0.021, 0.001, 0.001, 0.0004], 4, 0.030),
    ]
    records = [r for r, _ in rows]
    records.append({"benchmark": "mbpp", "request": 2, "prompt_tokens": 12, "tokens": 1, "wall_s": 0.05,
                    "timings": {"prefill": 0.05, "total": 0.05}, "baseline_tokens": 1, "baseline_wall_s": 0.041,
                    "baseline_timings": {"prefill": 0.04, "sample": 0.001}})
    for r in records:
        r["baseline_wall_s"] = r["baseline_timings"]["prefill"] + base_scale * (r["baseline_wall_s"] - 0.04)
    rounds = [row for _, rs in rows for row in rs]
    step = {}
    for row in rounds:  # one request at a time: one round per step
        row["step"] = step[row["benchmark"]] = step.get(row["benchmark"], -1) + 1
    return records, rounds


def by_hand(records, rounds, speed, weight=lambda r: 1.0):
    """(sps, wall) of the requests, each weighted, from the formulas: Σ (tokens − 1) / (t(1) · A ·
    (1 + O / V)) with A = Σ_rounds 1 / t(1 + ℓ), and the decode-only wall speedup."""
    key = lambda r: (r["benchmark"], r["request"])  # noqa: E731
    w = {key(r): weight(r) for r in records}
    tokens = sum(w[key(r)] * (r["tokens"] - 1) for r in records)
    wall_s = sum(w[key(r)] * (r["wall_s"] - r["timings"]["prefill"]) for r in records)
    base_tokens = sum(w[key(r)] * (r["baseline_tokens"] - 1) for r in records)
    base_s = sum(w[key(r)] * (r["baseline_wall_s"] - r["baseline_timings"]["prefill"]) for r in records)
    other = sum(w[key(r)] * v for r in records
                for k, v in r["timings"].items() if k not in ("verify", "prefill", "total"))
    verify = sum(w[key(r)] * r["timings"].get("verify", 0.0) for r in records)
    forwards = sum(w[key(r)] / speed(r["batch_tokens"]) for r in rounds)
    return tokens / (speed(1) * forwards * (1 + other / verify)), (tokens / wall_s) / (base_tokens / base_s)


def hand_difference(records, rounds, speed, weight=lambda r: 1.0):
    sps, wall = by_hand(records, rounds, speed, weight)
    return sps - wall


def jackknife_by_hand(records, rounds):
    """Σ_b (n_b − 1)/n_b Σ_i (θ_(i) − θ̄_b)², θ_(i) with request i deleted and its benchmark's others
    weighted n_b / (n_b − 1)."""
    variance = 0.0
    for name in ("gsm8k", "mbpp"):
        mine = [r for r in records if r["benchmark"] == name]
        n = len(mine)
        thetas = []
        for gone in mine:
            def weight(r, gone=gone, n=n, name=name):
                return 0.0 if r is gone else (n / (n - 1) if r["benchmark"] == name else 1.0)

            thetas.append(hand_difference(records, rounds, SPEEDS.__getitem__, weight))
        variance += (n - 1) / n * sum((t - sum(thetas) / n) ** 2 for t in thetas)
    return variance


# --------------------------------------------------------------------------- the oracle
def test_the_two_ratios_and_their_difference_are_the_formulas_by_hand():
    records, rounds = made_up()
    got = clock_difference((records, rounds), make_profile(), resamples=200)
    sps, wall = by_hand(records, rounds, SPEEDS.__getitem__)
    assert got.sps == pytest.approx(sps, rel=1e-12) and got.wall == pytest.approx(wall, rel=1e-12)
    assert got.difference == pytest.approx(sps - wall, rel=1e-12)
    assert got.requests == 6 and got.df == 4
    # by hand once more, in numbers: 4 rounds at B = 4, 3 at 2, 2 at 3, 2 at 1; O = 70.9 ms, V = 169 ms
    forwards = 4 / 50 + 3 / 80 + 2 / 65 + 2 / 100
    assert sps == pytest.approx(23 / (100 * forwards * (1 + 0.0709 / 0.169)), rel=1e-12)
    assert wall == pytest.approx((23 / 0.2399) / (23 / 0.243), rel=1e-12)


def test_the_per_request_sums_hold_each_request_and_count_its_forwards_by_size():
    records, rounds = made_up()
    sizes = forward_sizes(rounds)
    assert sizes == [1, 2, 3, 4]
    groups = request_clock_aggregates(records, rounds, sizes)
    assert list(groups) == ["gsm8k", "mbpp"] and [len(g) for g in groups.values()] == [3, 3]
    assert CLOCK_COLUMNS == ("tokens", "wall_s", "baseline_tokens", "baseline_s", "other_s", "verify_s")
    assert groups["gsm8k"][0] == pytest.approx([7, 0.065, 7, 0.070, 0.020, 0.045, 1, 0, 0, 2])
    assert groups["mbpp"][2] == pytest.approx([0, 0, 0, 0.001, 0, 0, 0, 0, 0, 0])  # x_0 ended it: no round


def test_the_interval_adds_the_tables_noise_to_the_jackknife_over_requests():
    """v_requests is the stratified jackknife written out; v_table the variance of the difference over
    the bootstrap tables, each priced by hand; the interval is d ± t_4 · sqrt(v_requests + v_table),
    wider than the jackknife's alone, and both hold the estimate."""
    records, rounds = made_up()
    profile = make_profile()
    got = clock_difference((records, rounds), profile, resamples=300, seed=7)
    assert got.v_requests == pytest.approx(jackknife_by_hand(records, rounds), rel=1e-9)
    priced = [hand_difference(records, rounds, table) for table in bootstrap_tables(profile, 300, 7)]
    assert got.v_table == pytest.approx(np.var(priced, ddof=1), rel=1e-9) and got.v_table > 0
    half = T4 * math.sqrt(got.v_requests + got.v_table)
    assert (got.lo, got.hi) == pytest.approx((got.difference - half, got.difference + half), rel=1e-5)
    request_half = T4 * math.sqrt(got.v_requests)
    assert (got.request_lo, got.request_hi) == pytest.approx(
        (got.difference - request_half, got.difference + request_half), rel=1e-5)
    assert got.lo < got.request_lo < got.difference < got.request_hi < got.hi


def test_a_profile_without_timing_noise_adds_nothing_to_the_interval():
    records, rounds = made_up()
    got = clock_difference((records, rounds), make_profile(noise=False), resamples=50)
    assert got.v_table == 0.0
    assert (got.lo, got.hi) == pytest.approx((got.request_lo, got.request_hi), rel=1e-12)
    assert got.sps == pytest.approx(by_hand(records, rounds, SPEEDS.__getitem__)[0], rel=1e-12)


def test_a_round_that_accepted_an_eos_is_priced_at_the_forward_it_ran():
    """An EOS accepted at draft 1 of ℓ = 3 records proposed = m = 1, but its forward verified 1 + ℓ = 4
    tokens (the step's batch_tokens at R = 1); without batch_tokens, 1 + proposed is all there is."""
    records, rounds = made_up()
    rounds[-1].update(proposed=1, accepted=1, eos_accepted=True)  # mbpp 1's only round, batch_tokens 4
    assert request_clock_aggregates(records, rounds, [1, 2, 3, 4])["mbpp"][1][-4:].tolist() == [0, 0, 0, 1]
    del rounds[-1]["batch_tokens"]
    assert request_clock_aggregates(records, rounds, [1, 2, 3, 4])["mbpp"][1][-4:].tolist() == [0, 1, 0, 0]


# --------------------------------------------------------------------------- verdicts, no interval, refusals
def test_the_verdict_says_which_clock_is_faster_beyond_the_noise():
    assert clock_verdict(-0.1, 0.2) == "agree" and clock_verdict(0.0, 0.1) == "agree"
    assert clock_verdict(0.01, 0.2) == "SPS clock above"
    assert clock_verdict(-0.3, -0.1) == "SPS clock below"
    assert clock_verdict(math.nan, 0.1) == "–"
    # the made-up SPS clock reads 0.96 against a wall clock of 1.01: a slower baseline lifts the wall clock
    verdicts = {}
    for scale in (0.6, 1.0, 1.5):
        got = clock_difference(made_up(scale), make_profile(), resamples=100)
        assert got.verdict == clock_verdict(got.lo, got.hi)
        verdicts[scale] = got.verdict
    assert verdicts == {0.6: "SPS clock above", 1.0: "agree", 1.5: "SPS clock below"}


def test_one_request_per_benchmark_gives_the_numbers_without_an_interval():
    records, rounds = made_up()
    firsts = [r for r in records if r["request"] == 0]
    got = clock_difference((firsts, [r for r in rounds if r["request"] == 0]), make_profile(), resamples=20)
    assert math.isfinite(got.difference) and math.isnan(got.df)
    assert math.isnan(got.lo) and math.isnan(got.hi) and got.verdict == "–"


def test_records_without_a_baseline_or_timings_give_no_difference():
    records, rounds = made_up()
    for r in records:
        del r["baseline_wall_s"]
    got = clock_difference((records, rounds), make_profile(), resamples=20)
    assert math.isfinite(got.sps) and math.isnan(got.wall) and math.isnan(got.difference)
    assert math.isnan(got.lo) and got.verdict == "–"
    records, rounds = made_up()
    for r in records:
        del r["timings"]
    got = clock_difference((records, rounds), make_profile(), resamples=20)
    assert math.isnan(got.sps) and math.isnan(got.wall) and got.verdict == "–"


def test_a_forward_larger_than_the_table_gives_no_price():
    """The table stops at B = 4 (as the simulator's _speed, which refuses such a step): B = 5 has no price."""
    records, rounds = made_up()
    rounds[0]["batch_tokens"] = 5
    got = clock_difference((records, rounds), make_profile(), resamples=20)
    assert math.isnan(got.sps) and math.isnan(got.difference) and got.verdict == "–"


def test_a_sum_of_requests_served_together_is_refused():
    records, rounds = made_up()
    rounds[1]["step"] = rounds[0]["step"]  # two requests... or two rounds, in one step: R > 1
    with pytest.raises(ValueError, match="share step 0.*--concurrency 1"):
        clock_difference((records, rounds), make_profile())


def _write_folder(folder, records, rounds, concurrency):
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"config": {"concurrency": concurrency}}))
    (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))


def test_a_folder_is_read_at_concurrency_1_and_refused_otherwise(tmp_path):
    records, rounds = made_up()
    _write_folder(tmp_path / "r1", records, rounds, 1)
    assert load_scheduled_evaluation(tmp_path / "r1") == (records, rounds)
    from_folder = clock_difference(tmp_path / "r1", make_profile(), resamples=30)
    assert from_folder == clock_difference((records, rounds), make_profile(), resamples=30)
    _write_folder(tmp_path / "r2", records, rounds, 2)
    with pytest.raises(ValueError, match=r"config.concurrency is 2 \(R = 2\).*--concurrency 1"):
        clock_difference(tmp_path / "r2", make_profile())
    _write_folder(tmp_path / "plain", records, rounds, None)
    with pytest.raises(ValueError, match=r"config.concurrency is None \(a plain evaluation"):
        load_scheduled_evaluation(tmp_path / "plain")


# --------------------------------------------------------------------------- the simulator's clock
def served_rows(sim, target, jobs, decoding):
    """requests.jsonl / rounds.jsonl rows of a serving run, as a scheduled evaluation writes them
    (``dspark.evaluation.eval_scheduled.scheduled_benchmark``), each with its target-only baseline."""
    records, rounds = [], []
    for info, job in zip(sim.requests, jobs):
        benchmark, request = job.tag
        base = target_generate(target, job.prompt_ids, max_new_tokens=decoding.max_new_tokens,
                               temperature=decoding.temperature, eos_token_ids=decoding.eos_token_ids or (),
                               generator=torch.Generator().manual_seed(job.seed))
        records.append({"benchmark": benchmark, "request": request, "tokens": len(info["result"].tokens),
                        "wall_s": info["timings"]["total"], "timings": info["timings"],
                        "baseline_tokens": len(base.tokens), "baseline_wall_s": base.timings["total"],
                        "baseline_timings": base.timings})
    for row in sim.rounds:
        benchmark, request = row["tag"]
        rounds.append({"benchmark": benchmark, "request": request, "round": row["round"],
                       "proposed": row["proposed"], "accepted": row["accepted"], "drafted": row["drafted"],
                       "eos_accepted": row["eos_accepted"], "step": row["step"], "batch_tokens": row["batch_tokens"]})
    return records, rounds


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("policy", ["algorithm1+skip", "static"])
def test_on_the_runs_own_table_the_sps_ratio_is_the_simulators_vs_target_only(policy):
    """Real R = 1 runs on the tiny models with draft_overhead="measured", priced by the profile's
    measured table: the SPS ratio of their requests is ``SimResult.summary()["vs_target_only"]``
    (algorithm1+skip: plain target steps among the rounds; static: every round verifies γ)."""
    from helpers.decoding import random_drafter
    from helpers.serving import PROMPTS
    from helpers.targets import make_tiny_target

    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    profile = make_profile()
    decoding = DecodeSettings(max_new_tokens=16, temperature=1.0, eos_token_ids=(0,))
    jobs = [Job(p, 11 + i, ("gsm8k", i)) for i, p in enumerate(PROMPTS)]
    sim = run_requests(target, drafter, jobs, decoding=decoding,
                       serving=ServeSettings(policy=policy, sps=profile.measured_table, draft_overhead="measured"))
    records, rounds = served_rows(sim, target, jobs, decoding)
    if policy == "algorithm1+skip":
        assert {r["drafted"] for r in rounds} == {True, False}
    got = clock_difference((records, rounds), profile, resamples=50)
    assert got.sps == pytest.approx(sim.summary()["vs_target_only"], rel=1e-9)
    assert math.isfinite(got.lo) and got.lo < got.difference < got.hi


@pytest.mark.usefixtures("one_thread")
def test_an_eos_accepted_before_the_last_draft_is_priced_as_the_simulator_prices_it():
    """A scripted drafter at T = 0 whose second round accepts an EOS at draft 1 of ℓ = 3: the round
    records proposed = 1, the simulator charged its forward 1 / SPS(4), and so does the SPS ratio."""
    from helpers.serving import PROMPTS, greedy, scripted
    from helpers.targets import make_tiny_target

    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    continuation = greedy(target, prompt, 8).tokens
    eos = continuation[4]  # round 1 accepts x_1, x_2 of its anchor x_0; round 2 drafts x_4 first
    assert eos not in continuation[:4]
    profile = make_profile()
    decoding = DecodeSettings(max_new_tokens=20, temperature=0.0, eos_token_ids=(eos,))
    jobs = [Job(prompt, 3 + i, ("gsm8k", i)) for i in range(2)]
    sim = run_requests(target, scripted(target, prompt), jobs, decoding=decoding,
                       serving=ServeSettings(policy="static", sps=profile.measured_table, draft_overhead="measured"))
    records, rounds = served_rows(sim, target, jobs, decoding)
    assert [(r["proposed"], r["batch_tokens"], r["eos_accepted"]) for r in rounds if r["request"] == 0] == [
        (3, 4, False), (1, 4, True)]
    got = clock_difference((records, rounds), profile, resamples=20)
    assert got.sps == pytest.approx(sim.summary()["vs_target_only"], rel=1e-9)


@pytest.mark.usefixtures("one_thread")
def test_a_scheduled_evaluation_folder_gives_each_benchmarks_serving_ratio(tmp_path, monkeypatch):
    """``evaluate`` with a policy at R = 1 and draft_overhead="measured" serves each benchmark in a run
    of its own: the SPS ratio of a benchmark's rows is that run's vs_target_only in report["serving"],
    and the folder it wrote reads back into the same difference as its rows."""
    import dspark.evaluation.evaluate as ev
    from dspark.evaluation.paired import load_evaluation
    from helpers.benchmarks import CharTokenizer, write_benchmarks
    from helpers.decoding import random_drafter
    from helpers.targets import make_tiny_target

    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)
    target = make_tiny_target("llama")
    profile = make_profile()
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0", "m1"]})
    report = ev.evaluate(target, random_drafter(target, gamma=3), files, progress=False, tokenizer=CharTokenizer(),
                         decoding=DecodeSettings(max_new_tokens=12, temperature=1.0, seed=3, eos_token_ids=(0,)),
                         serving=ServeSettings(policy="algorithm1+skip", sps=profile.measured_table,
                                               draft_overhead="measured"), out_dir=tmp_path / "out")
    _, records, rounds = load_evaluation(tmp_path / "out")
    for name in ("gsm8k", "mbpp"):
        mine = ([r for r in records if r["benchmark"] == name], [r for r in rounds if r["benchmark"] == name])
        got = clock_difference(mine, profile, resamples=20)
        assert got.sps == pytest.approx(report["serving"][name]["vs_target_only"], rel=1e-9)
    pooled = clock_difference(tmp_path / "out", profile, resamples=20)
    assert pooled == clock_difference((records, rounds), profile, resamples=20) and pooled.requests == 5
