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
    position (as SpeculativeRequest.verify); the cache is cropped back after each forward."""
    spy = ForwardSpy(make_tiny_target("llama"))
    profile_sps_runs(spy, [1, 3], context_len=10, warmup=1, repeats=2)
    assert spy.calls == [(1, 0, 10, 1)] + [(1, 10, 1, 1)] * 3 + [(1, 10, 3, 3)] * 3


def test_rows_of_q_tokens_each_continue_their_own_cache_and_other_sizes_are_skipped():
    spy = ForwardSpy(make_tiny_target("llama"))
    profile = profile_sps_runs(spy, [2, 3, 4, 8], context_len=5, warmup=0, repeats=1, tokens_per_request=2)
    assert profile.batch_tokens == [2, 4, 8]
    assert spy.calls == [(1, 0, 5, 1), (1, 5, 2, 2), (2, 0, 5, 1), (2, 5, 2, 2), (4, 0, 5, 1), (4, 5, 2, 2)]
    with pytest.raises(ValueError, match="multiple of tokens_per_request"):
        profile_sps_runs(spy, [3, 5], tokens_per_request=2)
