"""dspark.scheduling.batch_size: how many rows `--batch-size auto` decodes together, and evaluate's use of it."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import dspark.scheduling.batch_size as batch_size
import dspark.evaluation.evaluate as ev
from dspark.scheduling.batch_size import measured_batch_size, pick_rows
from dspark.scheduling.sps_profile import expected_longest, profile_sps_runs
from helpers.benchmarks import CharTokenizer, write_benchmarks
from helpers.decoding import random_drafter
from helpers.targets import make_tiny_target


def test_pick_rows_stops_at_the_first_doubling_that_gains_less_than_a_tenth():
    # 1 -> 2: ×1.9; 2 -> 4: ×1.2; 4 -> 8: ×1.09 (< 1.1): R = 4
    table = {1: 10.0, 2: 19.0, 4: 22.8, 8: 22.8 * 1.09, 16: 100.0}
    assert pick_rows(table.__getitem__) == 4
    assert pick_rows(lambda r: 10.0 * r) == 128 and pick_rows(lambda r: 10.0 * r, max_rows=12) == 8
    assert pick_rows(lambda r: 10.0 if r == 1 else math.nan) == 1  # R = 2 cannot be priced


def test_measured_batch_size_times_r_rows_of_one_plus_gamma_over_the_expected_longest_row(monkeypatch):
    """The engine's forward at each R the search reaches: R rows × (1 + γ) tokens after
    E[longest of R prompts] + max_new / 2 cached; the rule on R / median seconds."""
    seconds = {1: 0.10, 2: 0.11, 4: 0.16, 8: 0.30}  # throughputs 10, 18.2, 25, 26.7: stop at 4
    calls = []

    def fake_profile(target, sizes, *, context_len, warmup, repeats, rows, seed, context):
        assert context is None  # a stand-in target without caches: nothing to share
        calls.append((rows, list(sizes), context_len))
        if rows == 16:
            raise torch.OutOfMemoryError("no room")
        return SimpleNamespace(median_s=[seconds[rows]])

    monkeypatch.setattr("dspark.scheduling.sps_profile.profile_sps_runs", fake_profile)
    lengths = [10, 40, 20, 30, 50, 60, 70, 80, 90]
    rows, measured = measured_batch_size(object(), lengths, 3, 20)
    assert rows == 4 and measured == pytest.approx({1: 10.0, 2: 2 / 0.11, 4: 25.0, 8: 8 / 0.30})
    assert [c[:2] for c in calls] == [(1, [4]), (2, [8]), (4, [16]), (8, [32])]
    assert [c[2] for c in calls] == [round(expected_longest(lengths, r) + 10) for r in (1, 2, 4, 8)]
    # every doubling pays: the search goes on until R exceeds the prompts, or memory runs out
    seconds.update({8: 0.16, 16: 0.16})
    assert measured_batch_size(object(), lengths, 3, 20)[0] == 8  # 9 prompts: R = 16 is never tried
    calls.clear()
    assert measured_batch_size(object(), lengths * 2, 3, 20)[0] == 8 and calls[-1][0] == 16  # out of memory at 16
    with pytest.raises(ValueError, match="prompt lengths"):
        measured_batch_size(object(), [], 3, 20)


def _record_forwards(target) -> list:
    """Make ``target`` record (input shape, cached length before the forward) of every forward."""
    seen = []
    forward = target.forward

    def spy(x, past_key_values=None, **kwargs):
        seen.append((tuple(x.shape), past_key_values.get_seq_length()))
        return forward(x, past_key_values=past_key_values, **kwargs)

    target.forward = spy
    return seen


def test_the_profile_fills_r_rows_from_one_prefilled_row_and_times_r_rows():
    """With fixed rows the context is one row's prefill copied to every row: the timed forwards
    continue a cache of R rows of context_len columns (the engine's column cache)."""
    target = make_tiny_target("llama", vocab_size=128)
    widths = _record_forwards(target)
    profile = profile_sps_runs(target, [3, 6], context_len=7, warmup=0, repeats=1, rows=3)
    assert profile.rows == 3 and profile.batch_tokens == [3, 6]
    assert widths[0] == ((1, 7), 0)  # one row prefilled
    # then R rows of B / R tokens, each after the 7 columns (a forward of 3 rows over a 1-row cache would fail)
    assert sorted(widths[1:]) == [((3, 1), 7), ((3, 2), 7)]


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_a_real_measurement_on_a_tiny_target_picks_a_power_of_two(family):
    """On a real cache (gemma4: sliding-window layers too), from one shared prefill where it can be cropped."""
    target = make_tiny_target(family, vocab_size=128)
    rows, measured = measured_batch_size(target, [5, 9, 12, 7], 3, 6, max_rows=4)
    assert rows in (1, 2, 4) and set(measured) <= {1, 2, 4} and 1 in measured
    assert all(v > 0 for v in measured.values())


def test_profiles_from_a_shared_context_time_the_same_shapes_as_their_own_prefill():
    """``context``: every row starts from the shared cache's first context_len columns; the timed
    forwards are R rows of B / R tokens after exactly context_len columns, as with a prefill."""
    from dspark.scheduling.batch_size import _shared_context

    target = make_tiny_target("llama", vocab_size=128)
    shared = _shared_context(target, 11, seed=0)
    assert shared.get_seq_length() == 11
    seen = _record_forwards(target)
    profile_sps_runs(target, [4, 8], context_len=6, warmup=0, repeats=1, rows=4, context=shared)
    assert sorted(seen) == [((4, 1), 6), ((4, 2), 6)]  # no prefill: the rows came from the shared cache
    assert shared.get_seq_length() == 11  # the shared cache itself is untouched


def test_evaluate_auto_measures_once_and_a_resumed_folder_keeps_its_rows(tmp_path, monkeypatch):
    target = make_tiny_target("llama", vocab_size=256)
    drafter = random_drafter(target, gamma=3, seed=1)
    seen = []

    def fake_measure(target_, lengths, gamma, max_new_tokens, *, seed):
        seen.append((sorted(lengths), gamma, max_new_tokens))
        return 2, {1: 5.0, 2: 9.0, 4: 9.5}

    monkeypatch.setattr(batch_size, "measured_batch_size", fake_measure)
    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)
    data, out = write_benchmarks(tmp_path / "data"), tmp_path / "out"
    kwargs = dict(out_dir=out, progress=False, tokenizer=CharTokenizer(), baseline=False, batch_size="auto",
                  decoding=ev.DecodeSettings(max_new_tokens=5, temperature=1.0, seed=5))
    report = ev.evaluate(target, drafter, data, **kwargs)
    assert report["config"]["batch_size"] == 2
    assert report["config"]["batch_size_auto"] == {"1": 5.0, "2": 9.0, "4": 9.5}
    assert len(seen) == 1 and seen[0][1:] == (3, 5) and len(seen[0][0]) == report["all"]["num_requests"]
    settings = json.loads((out / "settings.json").read_text())
    assert settings["config"]["batch_size"] == 2
    again = ev.evaluate(target, drafter, data, resume=True, **kwargs)  # read back, not measured again
    assert len(seen) == 1 and again["config"]["batch_size"] == 2 and again["all"]["tau"] == report["all"]["tau"]
    with pytest.raises(ValueError, match="'auto'"):
        ev.evaluate(target, drafter, data, **{**kwargs, "batch_size": "eight", "out_dir": None})


def test_row_lengths_time_rows_of_their_own_lengths_and_each_row_continues_its_own_prefix(monkeypatch):
    """``row_lengths``: row r's cache holds the first row_lengths[r] tokens of the context, so a timed
    forward's attention reads each row's own n_r + q columns, and row r's logits are those of a
    fresh prefill of its first n_r tokens followed by the new ones."""
    import dspark.kernels.attention as attention
    from dspark.scheduling.sps_profile import _engine_rows

    target = make_tiny_target("llama", vocab_size=128)
    seen = []
    real = attention.row_extents

    def spy(extents, dtype=torch.float32):
        seen.append(list(extents))
        return real(extents, dtype)

    monkeypatch.setattr(attention, "row_extents", spy)
    profile = profile_sps_runs(target, [4, 8], context_len=9, warmup=0, repeats=1, rows=4, row_lengths=[3, 5, 9, 6])
    assert profile.row_lengths == [3, 5, 9, 6] and profile.context_len == 9
    assert sorted(seen) == [[4, 6, 10, 7], [5, 7, 11, 8]]  # B = 4: 1 token a row; B = 8: 2
    # the cropped rows hold each row's own prefix: the next token's logits match a fresh prefill
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    new = torch.tensor([[7], [8], [9], [10]])
    with torch.inference_mode():
        single = target.new_cache()
        target(ids, past_key_values=single, use_cache=True, logits_to_keep=1)
        kv = _engine_rows(target, single, 4, 1, [3, 5, 9, 6])
        got = kv.forward(new, torch.ones(4, dtype=torch.long)).logits[:, 0]
        for r, n in enumerate([3, 5, 9, 6]):
            fresh = target(torch.cat([ids[:, :n], new[r : r + 1]], dim=1)).logits[0, -1]
            torch.testing.assert_close(got[r], fresh, rtol=1e-4, atol=1e-4)


def test_row_lengths_are_checked_before_anything_is_timed():
    target = make_tiny_target("llama", vocab_size=128)
    with pytest.raises(ValueError, match="one per row"):
        profile_sps_runs(target, [4], context_len=9, repeats=1, rows=4, row_lengths=[3, 5, 9])
    with pytest.raises(ValueError, match="context_len = 9"):
        profile_sps_runs(target, [4], context_len=9, repeats=1, rows=4, row_lengths=[3, 5, 10, 6])
    with pytest.raises(ValueError, match="compute_logits"):
        profile_sps_runs(object(), [4], context_len=9, repeats=1, rows=4, row_lengths=[3, 5, 9, 6])


def test_expected_order_statistics_match_every_draw_enumerated():
    """E[i-th smallest of R drawn without replacement], against the mean over all C(N, R) draws."""
    import itertools

    from dspark.scheduling.sps_profile import expected_order_statistics

    assert expected_order_statistics([3, 1, 2], 2) == pytest.approx([4 / 3, 8 / 3])  # {1,2} {1,3} {2,3}
    lengths = [40, 7, 7, 19, 3, 88, 25]
    for rows in (1, 3, 5, 7):
        draws = [sorted(c) for c in itertools.combinations(lengths, rows)]
        want = [sum(d[i] for d in draws) / len(draws) for i in range(rows)]
        assert expected_order_statistics(lengths, rows) == pytest.approx(want)
        assert expected_longest(lengths, rows) == pytest.approx(want[-1])
    assert expected_order_statistics(lengths, 9) == sorted(lengths)  # fewer lengths than rows: all of them
