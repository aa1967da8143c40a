"""The serving loop on the batched decoder (dspark.scheduling.batched_serving) and its two clocks
(dspark.evaluation.clocks.serving_clock_difference, serving_wall_ratio).

Oracles: the per-request engine on the same jobs (every request decodes the same rounds), the SPS
clock's step prices computed by hand from the step log, the clocks' difference and the wall-clock
ratio written out from their definitions on a made-up run, and the ratio's interval's coverage of a
known truth on simulated requests at the demo's serving design."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from dspark.evaluation.clocks import serving_clock_difference, serving_wall_ratio, throughput_ratio_ci
from dspark.evaluation.report import results_markdown
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.simulator import DecodeSettings, ServeSettings, SimResult, simulate
from dspark.scheduling.sps_profile import SPSProfile
from helpers.decoding import random_drafter
from helpers.serving import PROMPTS
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DECAYING = SPSTable([1, 4, 8, 16, 64], [100.0, 95.0, 80.0, 50.0, 20.0], 256)


def _rounds(sim):
    return sorted((r["request"], r["round"], r["verified"], r["accepted"], r["emitted"]) for r in sim.rounds)


@pytest.mark.parametrize("policy", ["static", "algorithm1", "static1"])
def test_the_batched_engine_serves_the_rounds_of_the_per_request_engine(policy):
    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=4)
    runs = {}
    for engine in ("per-request", "batched"):
        runs[engine] = simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=12, temperature=1.0),
                                serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=3, engine=engine),
                                num_requests=7)
    a, b = runs["per-request"], runs["batched"]
    assert _rounds(a) == _rounds(b) and a.tokens == b.tokens and a.requests_finished == b.requests_finished
    assert b.engine == "batched" and b.step_wall_s > 0 and b.target_only_wall > 0
    assert math.isnan(a.target_only_wall)


def test_the_sps_clock_prices_each_padded_forward_and_the_wall_clock_is_the_steps():
    """draft_overhead 0: the SPS clock is Σ_steps 1 / SPS(rows · (1 + max ℓ)); the rounds keep the
    policy's B = Σ (1 + ℓ); the requests' shares add up to the steps' wall clock plus their prefills."""
    target = make_tiny_target("llama")
    sim = simulate(target, random_drafter(target, gamma=4), PROMPTS,
                   decoding=DecodeSettings(max_new_tokens=10, temperature=1.0, seed=0),
                   serving=ServeSettings(policy="algorithm1", sps=DECAYING, concurrency=3, engine="batched"),
                   num_requests=6, target_only=False)
    assert math.isnan(sim.target_only_wall)
    price = 0.0
    for step in sim.step_log:
        rows = [r for r in sim.rounds if r["step"] == step["step"]]
        assert step["priced_tokens"] == len(rows) * (1 + max(r["verified"] for r in rows))
        assert step["batch_tokens"] == sum(1 + r["verified"] for r in rows)
        price += 1.0 / float(DECAYING(step["priced_tokens"]))
    assert sim.sim_time_s == pytest.approx(price)
    assert sim.step_wall_s == pytest.approx(sum(s["wall_s"] for s in sim.step_log))
    shares = sum(r["timings"]["total"] - r["timings"]["prefill"] for r in sim.requests if "timings" in r)
    assert shares == pytest.approx(sim.step_wall_s, rel=0.05)  # the steps' phases; the loop's own code aside
    assert sim.pricing()(DECAYING) == pytest.approx(sim.throughput / (3 * float(DECAYING(3))))


def _profile(noise: bool, common: bool = False) -> SPSProfile:
    """Five sweeps of B = 1, 2, 4, 8; ``noise``: each B's timings jitter on their own (``common``: every
    sweep scaled alike, as a machine that ran faster or slower during the profile)."""
    jitter = [1.0, 1.1, 0.9, 1.05, 0.95]
    base = {1: 0.010, 2: 0.0125, 4: 0.020, 8: 0.040}
    seconds = [[base[b] * (jitter[(k + (0 if common else i)) % 5] if noise else 1.0) for k in range(5)]
               for i, b in enumerate(base)]
    return SPSProfile(list(base), seconds, [statistics.median(s) for s in seconds], context_len=128,
                      tokens_per_request=None, warmup=1, repeats=5, device="cpu", dtype="float32", threads=1)


def _made_up_run() -> SimResult:
    """R = 2, three requests of two benchmarks over four steps (request 2 takes request 0's row)."""
    result = SimResult(policy="static", concurrency=2, engine="batched", draft_clock="measured",
                       target_only_wall=150.0)
    steps = [  # (rows: [(request, emitted)], priced tokens, wall, overhead, verify)
        ([(0, 2), (1, 1)], 4, 0.030, 0.010, 0.018),
        ([(0, 3), (1, 2)], 8, 0.050, 0.012, 0.035),
        ([(2, 1), (1, 1)], 4, 0.028, 0.009, 0.017),
        ([(2, 2)], 2, 0.020, 0.006, 0.013),
    ]
    result.requests = [{"index": i, "tag": tag, "finished": True} for i, tag in enumerate([("a", 0), ("b", 0), ("a", 1)])]
    for s, (rows, priced, wall, over, verify) in enumerate(steps):
        result.step_log.append({"step": s, "priced_tokens": priced, "wall_s": wall, "overhead_s": over,
                                "verify_s": verify})
        for request, emitted in rows:
            result.rounds.append({"step": s, "request": request, "emitted": emitted, "rows": len(rows)})
    return result


def _with_target_only(result: SimResult) -> SimResult:
    """The target-only decode of the made-up run's three requests at R = 2: request 0 six tokens in six
    steps beside request 1 (three steps), request 2 two steps beside request 0 and two alone; each
    request's share of the steps' forwards ("decode") and of their sampling and bookkeeping."""
    result.target_only_requests = [
        {"index": 0, "tag": ("a", 0), "step_tokens": 6, "step_s": 0.060, "step_forwards": {2: 3.0},
         "timings": {"prefill": 0.5, "decode": 0.054, "sample": 0.004, "bookkeeping": 0.002, "total": 0.56}},
        {"index": 1, "tag": ("b", 0), "step_tokens": 3, "step_s": 0.040, "step_forwards": {2: 1.5},
         "timings": {"prefill": 0.4, "decode": 0.037, "sample": 0.002, "bookkeeping": 0.001, "total": 0.44}},
        {"index": 2, "tag": ("a", 1), "step_tokens": 4, "step_s": 0.030, "step_forwards": {1: 2.0, 2: 1.0},
         "timings": {"prefill": 0.3, "decode": 0.026, "sample": 0.003, "bookkeeping": 0.001, "total": 0.33}}]
    return result


def test_the_clocks_difference_is_the_formula_by_hand():
    result, profile = _with_target_only(_made_up_run()), _profile(noise=False)
    got = serving_clock_difference(result, profile)
    speed = {1: 1 / 0.010, 2: 1 / 0.0125, 4: 1 / 0.020, 8: 1 / 0.040}
    # Shares per request: request 0 is in steps 0, 1 (2 rows), request 1 in 0, 1, 2, request 2 in 2 (2 rows), 3 (1).
    tokens = 2 + 1 + 3 + 2 + 1 + 1 + 2
    wall = 0.030 + 0.050 + 0.028 + 0.020
    other, verify = 0.010 + 0.012 + 0.009 + 0.006, 0.018 + 0.035 + 0.017 + 0.013
    forwards = 1 / speed[4] + 1 / speed[8] + 1 / speed[4] + 1 / speed[2]  # every step's forward, once
    sps_time = forwards * (1 + other / verify)
    base_tokens, base_wall = 6 + 3 + 4, 0.060 + 0.040 + 0.030
    base_other, base_forward = 0.006 + 0.003 + 0.004, 0.054 + 0.037 + 0.026  # sampling + bookkeeping; forwards
    # the target-only steps' forwards on the table, their other phases as measured
    base_time = ((3.0 + 1.5 + 1.0) / speed[2] + 2.0 / speed[1]) * (1 + base_other / base_forward)
    assert got.sps == pytest.approx((tokens / sps_time) / (base_tokens / base_time))
    assert got.wall == pytest.approx((tokens / wall) / (base_tokens / base_wall))
    assert got.difference == pytest.approx((wall / sps_time) / (base_wall / base_time) - 1)
    assert got.difference == pytest.approx(got.sps / got.wall - 1)
    assert got.v_table == 0.0 and got.requests == 3 and got.df == 1  # groups a (2 requests) and b (1)
    # the jackknife: only benchmark a has two requests; deleting one rescales a's sum by 2. Columns:
    # tokens, W, O, V, counts at B = 2, 4, 8; target-only tokens, W', O', V', counts at B = 1, 2.
    shares = {0: [2 + 3, 0.030 / 2 + 0.050 / 2, 0.010 / 2 + 0.012 / 2, 0.018 / 2 + 0.035 / 2, 0, 0.5, 0.5,
                  6, 0.060, 0.006, 0.054, 0, 3.0],
              1: [1 + 2 + 1, 0.030 / 2 + 0.050 / 2 + 0.028 / 2, (0.010 + 0.012 + 0.009) / 2,
                  (0.018 + 0.035 + 0.017) / 2, 0, 1.0, 0.5, 3, 0.040, 0.003, 0.037, 0, 1.5],
              2: [1 + 2, 0.028 / 2 + 0.020, 0.009 / 2 + 0.006, 0.017 / 2 + 0.013, 1.0, 0.5, 0, 4, 0.030, 0.004, 0.026,
                  2.0, 1.0]}
    shares = {i: np.array(v) for i, v in shares.items()}
    price = np.array([1 / speed[2], 1 / speed[4], 1 / speed[8]])
    base_price = np.array([1 / speed[1], 1 / speed[2]])

    def diff(total):
        cell = total[1] / ((total[4:7] * price).sum() * (1 + total[2] / total[3]))
        return cell / (total[8] / ((total[11:] * base_price).sum() * (1 + total[9] / total[10]))) - 1

    b = shares[1]
    deleted = [diff((shares[0 if i else 2] * 2) + b) for i in (0, 1)]  # delete request 2, then request 0
    mean = sum(deleted) / 2
    var = (2 - 1) / 2 * sum((d - mean) ** 2 for d in deleted)
    t1 = 12.706205  # Student's t, 0.975 quantile, 1 degree of freedom
    assert diff(shares[0] + shares[1] + shares[2]) == pytest.approx(got.difference)
    assert (got.hi - got.lo) / 2 == pytest.approx(t1 * math.sqrt(var), rel=1e-6)
    # the target-only decode is required, with its forwards and phases
    with pytest.raises(ValueError, match="target-only decode"):
        serving_clock_difference(_made_up_run(), profile)
    bare = _with_target_only(_made_up_run())
    del bare.target_only_requests[1]["timings"]
    with pytest.raises(ValueError, match="forwards and phases"):
        serving_clock_difference(bare, profile)


def test_the_wall_ratio_is_the_formula_by_hand_and_leaves_each_request_out_of_both_decodes():
    got, lo, hi, requests = serving_wall_ratio(_with_target_only(_made_up_run()))
    # per request: (speculative tokens, its share of the steps' seconds, target-only tokens, seconds)
    rows = {0: np.array([2 + 3, 0.030 / 2 + 0.050 / 2, 6, 0.060]),
            1: np.array([1 + 2 + 1, 0.030 / 2 + 0.050 / 2 + 0.028 / 2, 3, 0.040]),
            2: np.array([1 + 2, 0.028 / 2 + 0.020, 4, 0.030])}

    def ratio(t):
        return (t[0] / t[1]) / (t[2] / t[3])

    assert requests == 3
    assert got == pytest.approx(ratio(rows[0] + rows[1] + rows[2]))
    assert got == pytest.approx((12 / 0.128) / (13 / 0.130))
    # benchmark a holds requests 0 and 2: deleting one doubles the other; b (one request) adds nothing
    logs = [math.log(ratio(rows[2] * 2 + rows[1])), math.log(ratio(rows[0] * 2 + rows[1]))]
    mean = sum(logs) / 2
    half = 12.706205 * math.sqrt((2 - 1) / 2 * sum((x - mean) ** 2 for x in logs))
    assert lo == pytest.approx(got * math.exp(-half), rel=1e-6)
    assert hi == pytest.approx(got * math.exp(half), rel=1e-6)
    # a request only one decode served counts zeros in the other
    cut = _with_target_only(_made_up_run())
    cut.target_only_requests = cut.target_only_requests[:2]
    assert serving_wall_ratio(cut)[0] == pytest.approx((12 / 0.128) / (9 / 0.100))
    with pytest.raises(ValueError, match="target-only requests"):
        serving_wall_ratio(_made_up_run())


@pytest.mark.parametrize("per_benchmark", [4, 8])
def test_the_wall_ratio_interval_covers_at_the_serving_design(per_benchmark):
    # The demo's serving design: 9 benchmarks × 4 prompts (8 in its long mode) decoded by both engines at
    # R rows. Request i of benchmark g: speculative tokens n_i, seconds n_i · s_g · e^{u_i + ε_i}; target-
    # only the same n_i tokens in n_i · c · e^{u_i + δ_i} (u_i shared: a long context slows both). The
    # truth is the ratio of expected sums; 2000 simulated runs, coverage within [0.93, 0.985].
    rng = np.random.default_rng(11)
    speed = np.linspace(0.8, 1.3, 9)  # s_g: where speculation pays more or less

    def draw(n):
        tokens = rng.integers(8, 40, size=(9, n)).astype(float)
        u = rng.normal(0, 0.4, size=(9, n))
        spec = tokens * speed[:, None] * np.exp(u + rng.normal(0, 0.25, size=(9, n)))
        base = tokens * np.exp(u + rng.normal(0, 0.15, size=(9, n)))
        return np.stack([tokens, spec, tokens, base], axis=-1)  # [9, n, 4]

    big = draw(20_000).sum(axis=(0, 1))
    truth = (big[0] / big[1]) / (big[2] / big[3])
    covered = 0
    for _ in range(2000):
        rows = draw(per_benchmark)
        _, lo, hi = throughput_ratio_ci(list(rows))
        covered += lo <= truth <= hi
    assert 0.93 <= covered / 2000 <= 0.985, covered / 2000


def test_timing_noise_of_the_table_widens_the_interval_and_the_table_says_which_clock_is_faster():
    result = _with_target_only(_made_up_run())
    quiet, noisy = serving_clock_difference(result, _profile(False)), serving_clock_difference(result, _profile(True))
    assert noisy.v_table > 0 and noisy.hi - noisy.lo > quiet.hi - quiet.lo
    # a profile whose sweeps ran uniformly faster or slower prices the cell and target-only alike
    assert serving_clock_difference(result, _profile(True, common=True)).v_table == pytest.approx(0.0, abs=1e-20)
    assert quiet.verdict in ("agree", "SPS clock above", "SPS clock below")


def test_the_per_request_engine_is_refused_and_the_table_prints_both_clocks():
    target = make_tiny_target("llama")
    sim = simulate(target, random_drafter(target, gamma=4), PROMPTS,
                   decoding=DecodeSettings(max_new_tokens=8, temperature=1.0),
                   serving=ServeSettings(policy="static", sps=DECAYING, concurrency=2), num_requests=3)
    with pytest.raises(ValueError, match="batched engine"):
        serving_clock_difference(sim, _profile(False))
    with pytest.raises(ValueError, match="engine"):
        ServeSettings(policy="static", engine="vectorised")
    batched = _made_up_run()
    batched.tokens, batched.sim_time_s, batched.step_wall_s = 12, 0.1, 0.128
    batched.target_only_throughput = 160.0
    batched.clocks = {"difference": 0.1, "lo": -0.05, "hi": 0.2, "verdict": "agree", "requests": 3}
    text = results_markdown([batched])
    assert "wall clock: vs target-only" in text and "0.10 [-0.05, 0.20]" in text and "agree" in text


def test_the_serving_loops_profile_holds_rows_of_the_expected_ordered_lengths(monkeypatch):
    """R rows of 1..γ+1 tokens, row i after E[i-th shortest of R prompts] + max_new / 2 cached (the loop
    admits requests in interleaved order, so a batch's rows are R prompts taken at random)."""
    import itertools

    from dspark.evaluation.scheduling_runs import _layout_profile

    calls = []
    monkeypatch.setattr("dspark.scheduling.sps_profile.profile_sps_runs",
                        lambda target, sizes, **kw: calls.append((list(sizes), kw)) or "profile")
    prompts = [[0] * n for n in (30, 4, 17, 9, 60)]
    assert _layout_profile(object(), prompts, 3, 4, 20, 0, lambda text: None) == "profile"
    draws = [sorted(c) for c in itertools.combinations([30, 4, 17, 9, 60], 3)]
    want = [round(sum(d[i] for d in draws) / len(draws) + 10) for i in range(3)]
    sizes, kw = calls[0]
    assert sizes == [3, 6, 9, 12, 15] and kw["rows"] == 3 and kw["row_lengths"] == want
    assert kw["context_len"] == max(want)
    _layout_profile(object(), prompts[:2], 3, 4, 20, 0, lambda text: None)  # fewer prompts than rows
    assert calls[1][1]["row_lengths"] == [14, 40, 40]


def test_the_layout_profile_times_r_rows_of_b_over_r_tokens_and_the_expected_longest_row():
    from dspark.scheduling.sps_profile import expected_longest, profile_sps_runs

    calls = []

    class Recording:
        """A target stand-in that records the shape of every forward (and keeps a cache of lengths)."""
        vocab_size, device, dtype = 50, "cpu", "float32"

        def new_cache(self):
            return {"len": 0}

        def __call__(self, x, past_key_values=None, use_cache=True, logits_to_keep=None):
            calls.append(tuple(x.shape))
            past_key_values["len"] += x.shape[1]

        @staticmethod
        def crop_cache(cache, length):
            cache["len"] = length

    profile = profile_sps_runs(Recording(), [4, 8, 12, 6, 20], context_len=3, warmup=0, repeats=2, rows=4)
    assert profile.batch_tokens == [4, 8, 12, 20] and profile.rows == 4  # the multiples of R only
    assert set(calls) == {(4, 3), (4, 1), (4, 2), (4, 3), (4, 5)}  # the prefill, then R rows of B / R tokens
    with pytest.raises(ValueError, match="not both"):
        profile_sps_runs(Recording(), [4], context_len=3, repeats=1, rows=4, tokens_per_request=2)
    # E[max] of R lengths without replacement: by hand for {1, 2, 3}
    assert expected_longest([3, 1, 2], 1) == pytest.approx(2.0)
    assert expected_longest([3, 1, 2], 2) == pytest.approx((2 * 1 + 3 * 2) / 3)  # max 2 once, max 3 twice
    assert expected_longest([3, 1, 2], 5) == 3
