"""SPS profiling (paper Section 3.2.2): what is timed, the table, its JSON and its plot."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.targets import make_tiny_target
from dspark.scheduling.algorithm1 import SPSTable
from dspark.evaluation.report import write_profile
from dspark.scheduling.sps_profile import profile_sps, profile_sps_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class ForwardSpy:
    """Delegates to a target and records (rows, cached length before, new tokens, logits rows) per forward."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, input_ids, **kwargs):
        cache = kwargs.get("past_key_values")
        before = cache.get_seq_length() if cache is not None else 0
        out = self.inner(input_ids, **kwargs)
        self.calls.append((input_ids.shape[0], before, input_ids.shape[1], out.logits.shape[1]))
        return out


def test_profile_gives_an_increasing_table_that_round_trips_through_json(tmp_path):
    target = make_tiny_target("llama")
    profile = profile_sps_runs(target, [8, 1, 4, 2, 4], context_len=32, warmup=1, repeats=3)
    table = profile.table
    assert table.sample_batch_tokens == (1, 2, 4, 8) and table.max_batch_tokens == 8
    assert all(s > 0 for s in table.sample_steps_per_sec)
    assert [len(s) for s in profile.seconds] == [3] * 4
    assert table.sample_steps_per_sec[0] == pytest.approx(1 / sorted(profile.seconds[0])[1])  # 1 / median
    paths = write_profile(profile, tmp_path / "sps.json", {"target": "tiny"})
    assert SPSTable.from_json(paths["table"]) == table
    assert set(json.loads(paths["table"].read_text())) == {"sample_batch_tokens", "sample_steps_per_sec",
                                                            "max_batch_tokens"}  # SGLang's fields only
    details = json.loads(paths["details"].read_text())
    assert details["context_len"] == 32 and details["target"] == "tiny" and len(details["seconds"]) == 4
    assert paths["plot"].read_bytes()[:8] == PNG_MAGIC
    assert isinstance(profile_sps(target, [1, 2], context_len=4, warmup=0, repeats=1), SPSTable)


def test_every_timed_forward_is_a_verification_over_b_tokens_after_the_context():
    """One sequence of B new tokens continuing context_len cached ones, logits at every new
    position (as SpeculativeRequest.verify); the cache is cropped back after each forward. The
    sweeps over B alternate increasing and decreasing order, the warm-up sweep first."""
    spy = ForwardSpy(make_tiny_target("llama"))
    profile_sps_runs(spy, [1, 3], context_len=10, warmup=1, repeats=2)
    one, three = (1, 10, 1, 1), (1, 10, 3, 3)
    assert spy.calls == [(1, 0, 10, 1), one, three, three, one, one, three]


def test_rows_of_q_tokens_each_continue_their_own_cache_and_other_sizes_are_skipped():
    spy = ForwardSpy(make_tiny_target("llama"))
    profile = profile_sps_runs(spy, [2, 3, 4, 8], context_len=5, warmup=0, repeats=1, tokens_per_request=2)
    assert profile.batch_tokens == [2, 4, 8]
    assert spy.calls == [(1, 0, 5, 1), (2, 0, 5, 1), (4, 0, 5, 1), (1, 5, 2, 2), (2, 5, 2, 2), (4, 5, 2, 2)]
    with pytest.raises(ValueError, match="multiple of tokens_per_request"):
        profile_sps_runs(spy, [3, 5], tokens_per_request=2)


def test_a_rise_within_the_repeat_spread_is_flattened_and_a_real_rise_is_kept():
    """SPS(1) = 26.2 and SPS(4) = 28.1 with repeats spread wider than the 1.9 difference: noise, so
    SPS(4) <= SPS(1) and Algorithm 1 cannot buy drafts with it; the same rise with a spread of 0.5
    is real and stays. A fall is never touched, and the envelope is idempotent."""
    noisy = SPSTable([1, 4, 8], [26.2, 28.1, 20.0], 8, sample_spread=[3.0, 2.5, 1.0]).noise_aware()
    assert noisy.sample_steps_per_sec == (26.2, 26.2, 20.0) and noisy(4) <= noisy(1)
    assert noisy.sample_spread == (3.0, 2.5, 1.0) and noisy.noise_aware().sample_steps_per_sec == (26.2, 26.2, 20.0)
    real = SPSTable([1, 4, 8], [26.2, 28.1, 20.0], 8, sample_spread=[0.5, 0.5, 0.5]).noise_aware()
    assert real.sample_steps_per_sec == (26.2, 28.1, 20.0)
    assert SPSTable([1, 4], [26.2, 28.1], 4).noise_aware().sample_steps_per_sec == (26.2, 28.1)  # no spread given
    # a rise measured against the envelope level, not the raw neighbour: 10 -> 9 -> 10.5 with spread 1
    walk = SPSTable([1, 2, 3], [10.0, 9.0, 10.5], 3, sample_spread=[1.0, 1.0, 1.0]).noise_aware()
    assert walk.sample_steps_per_sec == (10.0, 9.0, 10.5)
    walk = SPSTable([1, 2, 3], [10.0, 9.0, 9.8], 3, sample_spread=[1.0, 1.0, 1.0]).noise_aware()
    assert walk.sample_steps_per_sec == (10.0, 9.0, 9.0)
    with pytest.raises(ValueError, match="sample_spread"):
        SPSTable([1, 4], [26.2, 28.1], 4, sample_spread=[1.0])


def test_the_profiled_table_carries_the_repeat_spread_and_flattens_within_it():
    from dspark.scheduling.sps_profile import SPSProfile

    seconds = [[1 / 25.0, 1 / 26.2, 1 / 27.5], [1 / 26.0, 1 / 28.1, 1 / 29.0], [1 / 38.0, 1 / 40.0, 1 / 42.0]]
    profile = SPSProfile([1, 4, 8], seconds, [sorted(s)[1] for s in seconds], context_len=0,
                         tokens_per_request=None, warmup=0, repeats=3, device="cpu", dtype="float32", threads=1)
    assert profile.steps_per_sec_spread == pytest.approx([2.5, 3.0, 4.0])
    table = profile.table
    assert table.sample_spread == pytest.approx((2.5, 3.0, 4.0))
    assert table.sample_steps_per_sec == pytest.approx((26.2, 26.2, 40.0))  # 40 - 26.2 > 4: a real rise
    assert profile.steps_per_sec == pytest.approx([26.2, 28.1, 40.0])  # the raw medians stay in the profile


def test_the_median_interval_is_the_order_statistic_interval_and_covers():
    """n = 20: P(Bin(20, ½) <= 5) = 0.0207, so (x_(6), x_(15)) covers the median with 1 − 2·0.0207 =
    0.959 and (x_(7), x_(14)) would not (0.885); n = 5 is too few for 95 %: the range. The
    coverage of the true median by simulation (lognormal timings) is at least the nominal."""
    import numpy as np

    from dspark.scheduling.sps_profile import median_interval

    xs = list(range(20, 0, -1))  # 20 .. 1
    assert median_interval(xs) == (6, 15)
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)
    assert median_interval([7.0]) == (7.0, 7.0)
    with pytest.raises(ValueError, match="at least one sample"):
        median_interval([])
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(2000):
        lo, hi = median_interval(rng.lognormal(0.0, 0.3, size=20))
        covered += lo <= 1.0 <= hi  # the lognormal(0, σ) median is e^0 = 1
    assert covered / 2000 >= 0.94


class DriftingTarget:
    """A stand-in target whose forward costs ``base`` seconds of a virtual clock whatever B is,
    on a machine that slows down linearly in time (``drift`` more per second): the speed of
    every B is the same, so any slope of the profiled table comes from the order of timing."""

    device, vocab_size = "cpu", 10

    def __init__(self, base: float = 0.05, drift: float = 1.0) -> None:
        self.base, self.drift, self.now = base, drift, 0.0

    def clock(self) -> float:
        return self.now

    def new_cache(self):
        return object()

    def crop_cache(self, cache, length) -> None:
        return None

    def __call__(self, input_ids, **kwargs):
        self.now += self.base * (1.0 + self.drift * self.now)


def test_interleaved_sweeps_keep_a_drifting_machine_from_sloping_the_table(monkeypatch):
    """The machine slows down by half over the profile: timing every repeat of B = 1 before B = 2
    and so on would make SPS fall with B by about that half; the interleaved sweeps give every B
    the same drift, so the medians agree to well within it and the table stays flat."""
    import dspark.scheduling.sps_profile as sps_profile

    target = DriftingTarget()
    monkeypatch.setattr(sps_profile.time, "perf_counter", target.clock)
    profile = profile_sps_runs(target, [1, 2, 4, 8], context_len=0, warmup=0, repeats=20)
    assert target.now > 1.5 and target.base * (1 + target.now) > 2 * target.base  # the drift is large
    speeds = profile.steps_per_sec
    assert max(speeds) / min(speeds) < 1.03
    table = profile.table.sample_steps_per_sec
    assert max(table) / min(table) < 1.03


# --------------------------------------------------------------------------- the SPS clock's own interval
def _hand_run(draft_clock: str = "measured"):
    """A hand-made R = 1 run of three steps verifying 1, 3 and 3 tokens (ℓ = 0, 2, 2), 5 tokens out,
    measured overheads 0.01, 0.02, 0.03 s and 0.3 s of measured verification."""
    from dspark.scheduling.simulator import SimResult

    table = SPSTable([1, 2, 4], [10.0, 8.0, 5.0], 4)
    batches, overheads = [1, 3, 3], [0.01, 0.02, 0.03]
    step_log = [{"batch_tokens": b, "overhead_s": o, "verify_step_s": 1 / table(b),
                 "step_time_s": (1.5 if draft_clock != "measured" and b > 1 else 1.0) / table(b)}
                for b, o in zip(batches, overheads)]
    rounds = [{"proposed": b - 1} for b in batches]
    return SimResult(policy="static", concurrency=1, tokens=5, draft_clock=draft_clock, verify_s=0.3,
                     step_log=step_log, rounds=rounds), table


def test_a_run_priced_by_a_table_by_hand():
    """SPS(3) = 6.5 by interpolation. Measured: verification 1/10 + 2/6.5 = 0.40769 s; the table
    prices the three forwards the same, so time_scale = 0.40769 / 0.3 and the overhead 0.06 s costs
    0.08154; Θ = 5 / 0.48923 = 10.220 against SPS(1) = 10. A fraction f = 0.5 charged on the
    drafting steps: 1/10 + 2 · 1.5/6.5 = 0.56154 s, Θ / SPS(1) = 0.8904. A table twice as fast gives
    the same ratios (the overhead goes on its time scale)."""
    run, table = _hand_run()
    verify = 1 / 10 + 2 / 6.5
    expected = 5 / (verify + 0.06 * verify / 0.3) / 10
    assert run.priced_by(table) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(1.0220, abs=1e-4)
    fast = SPSTable([1, 2, 4], [20.0, 16.0, 10.0], 4)
    assert run.priced_by(fast) == pytest.approx(expected, rel=1e-12)
    frac, _ = _hand_run("fraction 0.5")
    assert frac.priced_by(table) == pytest.approx(5 / (1 / 10 + 3 / 6.5) / 10, rel=1e-12)
    assert frac.priced_by(fast) == pytest.approx(frac.priced_by(table), rel=1e-12)
    steeper = SPSTable([1, 2, 4], [10.0, 6.0, 3.0], 4)  # SPS(3) = 4.5: verification dearer against SPS(1)
    assert run.priced_by(steeper) == pytest.approx(5 / ((1 / 10 + 2 / 4.5) * (1 + 0.06 / 0.3)) / 10, rel=1e-12)
    # A round whose accepted EOS cut ``proposed`` to m still paid the forward over 1 + ℓ tokens (``verified``).
    cut = type(run)(**{**run.__dict__, "rounds": [{"proposed": 0, "verified": r["proposed"]} for r in run.rounds]})
    assert cut.priced_by(steeper) == pytest.approx(run.priced_by(steeper), rel=1e-12)
    with pytest.raises(ValueError, match="step_log"):
        type(run)(policy="static", concurrency=1).priced_by(table)


def test_a_simulated_run_priced_by_its_own_table_gives_its_ratio():
    """The simulator's vs_target_only is priced_by(its table), for measured overheads and a fraction."""
    from dspark.scheduling.simulator import DecodeSettings, ServeSettings, simulate
    from helpers.decoding import random_drafter
    from helpers.serving import PROMPTS

    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    table = SPSTable([1, 2, 4, 8, 16], [100.0, 90.0, 70.0, 40.0, 25.0], 16)
    for overhead in ("measured", 0.3, 0.0):
        for r in (1, 2):
            sim = simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=12, temperature=1.0, seed=3),
                           serving=ServeSettings(policy="static", sps=table, draft_overhead=overhead, concurrency=r),
                           num_requests=4)
            assert sim.priced_by(table) == pytest.approx(sim.throughput / sim.target_only_throughput, rel=1e-9)


def _profile(seconds, batch_tokens):
    import statistics

    from dspark.scheduling.sps_profile import SPSProfile

    return SPSProfile(list(batch_tokens), [list(s) for s in seconds], [statistics.median(s) for s in seconds],
                      128, None, 1, len(seconds[0]), "cpu", "float32", 1)


def test_bootstrap_tables_of_noiseless_timings_are_the_table_and_a_profile_round_trips(tmp_path):
    from dspark.scheduling.sps_profile import bootstrap_tables, load_profile, table_interval

    profile = _profile([[0.1] * 8, [0.125] * 8, [0.2] * 8], [1, 2, 4])
    tables = list(bootstrap_tables(profile, resamples=5, seed=0))
    assert len(tables) == 5
    for t in tables:
        assert t.sample_steps_per_sec == pytest.approx(profile.table.sample_steps_per_sec)
    run, _ = _hand_run()
    lo, hi = table_interval(run, profile, resamples=20)
    assert lo == pytest.approx(hi) and lo == pytest.approx(run.priced_by(profile.table))
    write_profile(profile, tmp_path / "sps.json")
    back = load_profile(tmp_path / "sps.profile.json")
    assert back == profile
    (tmp_path / "bad.profile.json").write_text(json.dumps({"batch_tokens": [1]}))
    with pytest.raises(ValueError, match="not an SPS profile"):
        load_profile(tmp_path / "bad.profile.json")


def test_the_measured_table_keeps_a_rise_that_the_noise_aware_table_flattens():
    """B = 4 measured faster than B = 2 within the noise: the policy's table (``table``) flattens
    it to B = 2's speed, the clock's (``measured_table``) keeps the medians; the bootstrap draws
    either kind."""
    from dspark.scheduling.sps_profile import bootstrap_tables

    jitter = [1.0, 1.04, 0.97, 1.02, 0.99, 1.03, 0.96, 1.01]
    profile = _profile([[0.050 * j for j in jitter], [0.052 * j for j in jitter], [0.0498 * j for j in jitter]], [1, 2, 4])
    medians = [1 / m for m in profile.median_s]
    assert profile.measured_table.sample_steps_per_sec == pytest.approx(medians)
    assert profile.table.sample_steps_per_sec == pytest.approx([medians[0], medians[1], medians[1]])
    assert medians[2] > medians[1]
    flat = next(bootstrap_tables(profile, resamples=1, seed=0, noise_aware=True)).sample_steps_per_sec
    raw = next(bootstrap_tables(profile, resamples=1, seed=0)).sample_steps_per_sec
    assert flat[2] == flat[1] and raw[:2] == flat[:2] and raw[2] >= flat[2]


def test_the_bootstrap_resamples_sweeps_jointly_so_a_drift_shared_by_every_b_cancels():
    """Sweep j times every B as base_B · drift_j, the drift wandering threefold between sweeps (a
    machine whose speed changes during the profile). One draw of sweeps per table, applied to every
    B, keeps each sweep's B together: every table is the base table times one factor, so SPS(4) /
    SPS(1) is the base ratio in each, and a run's ratio to target-only decoding (unchanged by a
    common factor) has an interval of width 0 at the base table's price. Drawing each B's repeats on
    its own (emulated by hand) breaks the pairing and scatters both."""
    import numpy as np

    from dspark.scheduling.sps_profile import bootstrap_tables, table_interval

    batch_tokens, base = [1, 2, 4], np.array([0.10, 0.125, 0.20])
    drift = np.array([1.0, 2.7, 0.9, 1.6, 3.0, 1.1, 0.95, 2.2, 1.3])
    profile = _profile(np.outer(base, drift).tolist(), batch_tokens)
    tables = list(bootstrap_tables(profile, resamples=200, seed=1))
    assert all(t(4) / t(1) == pytest.approx(base[0] / base[2], rel=1e-12) for t in tables)
    assert len({round(t(1), 9) for t in tables}) > 1  # the common factor itself is resampled
    run, _ = _hand_run()
    truth = run.priced_by(SPSTable(batch_tokens, list(1 / base), 4))
    lo, hi = table_interval(run, profile, resamples=200, seed=1)
    assert lo == pytest.approx(truth, rel=1e-9) and hi == pytest.approx(truth, rel=1e-9)

    rng = np.random.default_rng(1)
    seconds = np.asarray(profile.seconds)  # [B, sweep]
    apart = np.stack([1 / np.median(s[rng.integers(0, len(s), (200, len(s)))], axis=1) for s in seconds], axis=1)
    ratios = apart[:, 2] / apart[:, 0]
    assert ratios.max() / ratios.min() > 1.5
    priced = np.array([run.priced_by(SPSTable(batch_tokens, list(row), 4)) for row in apart])
    assert np.quantile(priced, 0.975) / np.quantile(priced, 0.025) > 1.2


def test_the_bootstrap_needs_one_timing_per_sweep_at_every_b():
    from dspark.scheduling.sps_profile import bootstrap_tables

    profile = _profile([[0.1] * 6, [0.125] * 6, [0.2] * 6], [1, 2, 4])
    profile.seconds[1] = profile.seconds[1][:5]
    with pytest.raises(ValueError, match=r"B = 2 holds 5 timings but repeats = 6"):
        next(bootstrap_tables(profile))

def test_the_sps_clock_interval_covers_at_the_demos_design():
    """The demo's design: 8 B (1 … 128), 20 interleaved repeats, a table flat up to B = 4 and then
    falling (the demo's own shape), timing noise lognormal with σ = 0.08 per forward plus a drift
    shared by every B of a sweep (σ = 0.04), and an R = 1 run verifying 1 … 8 tokens with a
    measured overhead. The 95 % interval of table_interval covers the ratio priced by the true
    table in at least 92 % of 300 profiles (the binomial noise of 300 draws at 95 % is ± 1.3 %)."""
    import numpy as np

    from dspark.scheduling.simulator import SimResult
    from dspark.scheduling.sps_profile import table_interval

    batch_tokens = [1, 2, 4, 8, 16, 32, 64, 128]
    true_sps = np.array([25.3, 25.3, 25.3, 23.6, 21.5, 16.2, 9.4, 6.0])
    truth_table = SPSTable(batch_tokens, list(true_sps), 128)
    rng = np.random.default_rng(11)
    ells = rng.integers(0, 8, 300)
    run = SimResult(policy="async", concurrency=1, tokens=450, draft_clock="measured", verify_s=300 * 0.045,
                    step_log=[{"batch_tokens": 1 + int(ell), "overhead_s": 0.012, "verify_step_s": 0.04,
                               "step_time_s": 0.05} for ell in ells],
                    rounds=[{"proposed": int(ell)} for ell in ells])
    truth = run.priced_by(truth_table)
    covered, draws = 0, 300
    for d in range(draws):
        drift = np.exp(rng.normal(0.0, 0.04, 20))
        seconds = [(1 / v) * drift * np.exp(rng.normal(0.0, 0.08, 20)) for v in true_sps]
        lo, hi = table_interval(run, _profile(seconds, batch_tokens), resamples=300, seed=d)
        covered += lo <= truth <= hi
    assert covered / draws >= 0.92


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_the_batched_layout_is_timed_as_the_engine_runs_its_verification_forward(family, monkeypatch):
    """``rows=R`` on a target with the engine's interface: every timed forward is ``BatchKVCache.forward``
    of R rows × q tokens (the engine's mask and per-row positions, no logits) plus the LM head on the
    first min(q, HEAD_POSITIONS) positions, each after exactly context_len cached columns per row."""
    from dspark.decoding.batch_state import BatchKVCache
    from dspark.decoding.batched import HEAD_POSITIONS

    target = make_tiny_target(family, vocab_size=128)
    forwards, heads = [], []
    forward, head = BatchKVCache.forward, type(target).compute_logits

    def spied(kv, tokens, counts, *, logits=True):
        forwards.append((tuple(tokens.shape), kv.columns, [layer.keys.shape[2] for layer in kv.cache.layers][0],
                         counts.tolist(), logits))
        return forward(kv, tokens, counts, logits=logits)

    monkeypatch.setattr(BatchKVCache, "forward", spied)
    monkeypatch.setattr(type(target), "compute_logits",
                        lambda self, h: heads.append(tuple(h.shape[:2])) or head(self, h))
    profile = profile_sps_runs(target, [3, 6, 9, 12], context_len=7, warmup=1, repeats=2, rows=3)
    assert profile.rows == 3 and [len(s) for s in profile.seconds] == [2] * 4
    # 3 sweeps (one warm-up) of q = 1..4, alternating order; each after 7 columns, the cache as before it
    assert sorted(forwards) == sorted([((3, q), 7, 7, [q] * 3, False) for q in (1, 2, 3, 4)] * 3)
    timed_heads = heads[1:]  # after the context's prefill (its last position)
    assert heads[0] == (1, 1) and sorted(timed_heads) == sorted([(3, min(q, HEAD_POSITIONS)) for q in (1, 2, 3, 4)] * 3)


def test_a_discarded_forward_leaves_the_engine_cache_as_it_was():
    """``BatchKVCache.discard``: the next forward gives what it gives on a cache that never ran the
    discarded one (the timed forwards of the batched layout profile leave nothing behind)."""
    from dspark.decoding.batch_state import BatchKVCache

    target = make_tiny_target("llama", vocab_size=128)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    x = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([3, 2])

    def filled():
        single = target.new_cache()
        with torch.inference_mode():
            target(prompt, past_key_values=single, use_cache=True)
            kv = BatchKVCache(target)
            for r in range(2):
                kv.add_row()
                kv.write_row(r, single)
            kv.reserve(4)
        return kv

    fresh, used = filled(), filled()
    with torch.inference_mode():
        used.forward(torch.randint(0, 128, (2, 4)), torch.tensor([4, 4]))
        used.discard()
        assert [layer.keys.shape[2] for layer in used.cache.layers] == [9] * len(used.cache.layers)
        a = fresh.forward(x, counts).logits
        b = used.forward(x, counts).logits
    torch.testing.assert_close(b, a, rtol=0, atol=0)
