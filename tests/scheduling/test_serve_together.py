"""Cells of one R served together with their target-only decode, step by step in turn
(dspark.scheduling.simulator.serve_together, dspark.scheduling.batched_serving.interleaved), and the
clock check that pairing makes robust to a machine whose speed drifts.

Oracles: each cell served alone (the same rounds and tokens), target-only decoding alone (the same
tokens), and a target whose forwards are made to cost a known price that grows as the run goes on:
the SPS table profiled before the drift prices them right only up to the drift's factor, which the
target-only decode served in turn with the cell meets alike, and a target-only decode served after
the cell does not."""

from __future__ import annotations

import time

import pytest

from dspark.decoding.prefill_store import PrefillStore
from dspark.evaluation.clocks import serving_clock_difference
from dspark.scheduling.batched_serving import BatchedRun, TargetOnlyRun, interleaved, target_only_wall
from dspark.scheduling.simulator import DecodeSettings, ServeSettings, _jobs, serve_together, set_target_only, \
    simulate, simulate_grid
from dspark.scheduling.sps_profile import profile_sps_runs
from dspark.scheduling.algorithm1 import SPSTable
from helpers.decoding import random_drafter
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TABLE = SPSTable([1, 4, 8, 16, 64], [100.0, 95.0, 80.0, 50.0, 20.0], 256)
PROMPTS = [[3, 17, 42, 5, 99], [7, 8], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23], [31, 5, 9, 2, 77, 6],
           [40, 41]]
KEYS = [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def _rounds(sim):
    return sorted((r["request"], r["round"], r["verified"], r["accepted"], r["emitted"]) for r in sim.rounds)


def _tokens(sim):
    return [tuple(r["result"].tokens) for r in sim.requests if r["finished"]]


def test_cells_served_together_decode_what_each_decodes_alone_and_target_only_what_it_decodes_alone(monkeypatch):
    lookups = []  # whether each admission found its prompt's prefill kept
    get = PrefillStore.get

    def counting_get(self, target, prompt_ids):
        found = get(self, target, prompt_ids)
        lookups.append(found is not None)
        return found

    monkeypatch.setattr(PrefillStore, "get", counting_get)
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    decoding = DecodeSettings(max_new_tokens=10, temperature=1.0, seed=3)
    serving = ServeSettings(sps=TABLE, engine="batched")
    policies = ["static", "algorithm1", "static1"]
    together = simulate_grid(target, drafter, PROMPTS, policies=policies, concurrencies=[3], decoding=decoding,
                             serving=serving, num_requests=8, keys=KEYS)
    lookups_together = list(lookups)
    for policy, got in zip(policies, together):
        alone = simulate(target, drafter, PROMPTS, decoding=decoding, keys=KEYS, num_requests=8, target_only=False,
                         serving=ServeSettings(policy=policy, sps=TABLE, concurrency=3, engine="batched"))
        assert got.policy == alone.policy and _rounds(got) == _rounds(alone) and _tokens(got) == _tokens(alone)
        assert got.tokens == alone.tokens and got.steps == alone.steps
    # each prompt was prefilled once for the three cells and target-only decoding, every other admission
    # of it started from the kept prefill
    admitted = [r["tag"] for cell in together for r in cell.requests]
    admitted += [r["tag"] for r in together[0].target_only_requests]
    assert len(lookups_together) == len(admitted)
    assert lookups_together.count(False) == len(set(admitted)) == len(PROMPTS)
    # one target-only decode, shared by the cells: what target-only decoding alone gives
    make_jobs, stop = _jobs([list(p) for p in PROMPTS], KEYS, 3, True, 8, 3)
    base = target_only_wall(target, make_jobs(), decoding=decoding, rows=3, stop_after_finished=stop)
    assert all(r.target_only_requests == together[0].target_only_requests for r in together)
    assert [r["step_tokens"] for r in together[0].target_only_requests] == [r["step_tokens"] for r in base["requests"]]
    # every target-only request's forwards: one token per step, its share 1 / rows at B = rows
    for request in together[0].target_only_requests:
        assert sum(count * rows for rows, count in request["step_forwards"].items()) == request["step_tokens"]
        assert set(request["step_forwards"]) <= {1, 2, 3}


def test_interleaving_advances_the_run_that_has_emitted_the_fewest_tokens():
    class Run:
        def __init__(self, name, per_step, steps, log):
            self.name, self.per_step, self.left, self.log, self.emitted = name, per_step, steps, log, 0

        def advance(self):
            if self.left == 0:
                return False
            self.left -= 1
            self.emitted += self.per_step
            self.log.append(self.name)
            return True

    log = []
    interleaved([Run("fast", 3, 4, log), Run("slow", 1, 12, log)])
    # the run behind in tokens goes next (ties: the first): both reach 12 tokens together
    assert log == ["fast", "slow", "slow", "slow", "fast", "slow", "slow", "slow", "fast", "slow", "slow", "slow",
                   "fast", "slow", "slow", "slow"]


class _Drift:
    """Every target forward costs a known price, f · (8 ms + 0.25 ms · tokens) (spun, not slept: a sleep
    can wake late), where the machine's slowness f = 1 until ``start()`` and then grows by ``rate``
    per forward."""

    def __init__(self, target, rate: float):
        self.rate, self.forwards, self.on = rate, 0, False
        self.began = 0.0
        target.register_forward_pre_hook(lambda module, args: self._begin())
        target.register_forward_hook(lambda module, args, out: self._end(args[0]))

    def start(self):
        self.on, self.forwards = True, 0

    def _begin(self):
        self.began = time.perf_counter()

    def _end(self, input_ids):
        f = 1.0 + self.rate * self.forwards if self.on else 1.0
        self.forwards += self.on
        deadline = self.began + f * (0.008 + 0.00025 * input_ids.numel())
        while time.perf_counter() < deadline:
            pass


def _drifting_setup(rows: int):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    drift = _Drift(target, rate=0.01)
    profile = profile_sps_runs(target, [rows * q for q in range(1, 5)], context_len=16, warmup=2, repeats=7,
                               rows=rows)
    serving = ServeSettings(policy="static", sps=TABLE, price_sps=profile.measured_table, concurrency=rows,
                            engine="batched")
    return target, drafter, drift, profile, serving


@pytest.mark.slow
def test_a_machine_that_slows_down_during_the_run_moves_both_decodes_alike_when_they_are_served_in_turn():
    rows = 3
    decoding = DecodeSettings(max_new_tokens=12, temperature=1.0, seed=0)
    target, drafter, drift, profile, serving = _drifting_setup(rows)
    drift.start()
    paired = simulate(target, drafter, PROMPTS, decoding=decoding, serving=serving, keys=KEYS, num_requests=12)
    got = serving_clock_difference(paired, profile)
    # the table, profiled before the drift, prices target-only decoding well above what it ran at ...
    assert paired.target_only_wall < 0.8 * rows * float(profile.measured_table(rows))
    # ... and the cell's forwards alike, in the same minutes: the two clocks' ratios agree
    assert got.lo <= 0.0 <= got.hi and abs(got.difference) < 0.1, got

    # served one after the other (the cell, then target-only decoding), the drift separates them
    drift.start()
    alone = simulate(target, drafter, PROMPTS, decoding=decoding, serving=serving, keys=KEYS, num_requests=12,
                     target_only=False)
    make_jobs, stop = _jobs([list(p) for p in PROMPTS], KEYS, 0, True, 12, rows)
    base = target_only_wall(target, make_jobs(), decoding=decoding, rows=rows, stop_after_finished=stop)
    set_target_only(alone, base)
    late = serving_clock_difference(alone, profile)
    assert late.hi < 0.0 and late.difference < -0.2, late  # the wall ratio credits the cell with the drift
    assert _rounds(alone) == _rounds(paired)


def test_runs_stop_once_and_count_only_their_own_seconds():
    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=2)
    decoding = DecodeSettings(max_new_tokens=6, temperature=0.0)
    make_jobs, stop = _jobs([list(p) for p in PROMPTS], None, 0, False, None, 2)
    spec = BatchedRun(target, drafter, make_jobs(), decoding=decoding, stop_after_finished=stop,
                      serving=ServeSettings(policy="static", sps=TABLE, concurrency=2, engine="batched"))
    base = TargetOnlyRun(target, make_jobs(), decoding=decoding, rows=2, stop_after_finished=stop)
    started = time.perf_counter()
    interleaved([spec, base])
    elapsed = time.perf_counter() - started
    assert not spec.advance() and not base.advance()  # stopped runs stay stopped
    result, wall = spec.finish(), base.finish()
    assert all(r["finished"] for r in result.requests) and len(result.requests) == len(PROMPTS)
    assert len(wall["requests"]) == len(PROMPTS) and wall["tokens"] == sum(r["step_tokens"] for r in wall["requests"])
    # each run's clock is its own share of the interleaved minutes
    assert result.wall_s > 0 and wall["step_wall_s"] > 0 and result.wall_s + wall["step_wall_s"] <= elapsed
    with pytest.raises(ValueError, match="one R on the batched engine"):
        serve_together(target, drafter, make_jobs, [ServeSettings(policy="static", sps=TABLE, concurrency=2),
                                                    ServeSettings(policy="static", sps=TABLE, concurrency=3)],
                       decoding=decoding, stop=stop)
