"""SPS profiling (paper Section 3.2.2): what is timed, the table, its JSON and its plot."""

from __future__ import annotations

import json

import pytest

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
