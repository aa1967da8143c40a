"""Draft skipping (``algorithm1+skip``): the cost model, the back-off state machine, and that
serving with it stays lossless and accounts a skipped request as a plain target step.

Oracles: hand-computed Algorithm 1 lengths, gains and costs on a small SPS table; the
throughput inequality the rule stands for at R = 1, evaluated directly; a hand-listed
drafting schedule of the back-off; greedy target-only decoding and the target's exact
joint distribution of the first tokens (chi-square) for losslessness.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.targets import make_tiny_target
from dspark.scheduling.policies import make_policy, skip_policy
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.simulator import DecodeSettings, ServeSettings, simulate
from dspark.scheduling.skipping import DraftSkipper, block_pays, expected_survival
from helpers.decoding import chi_square_pvalue, exact_joint, random_drafter
from helpers.serving import PROMPTS, greedy, joint_counts, scripted

SPS = SPSTable([1, 2, 4, 8], [100.0, 90.0, 80.0, 50.0], 8)  # T(1) = 10 ms, SPS(3) = 85, SPS(5) = 72.5
DECAYING = SPSTable(list(range(1, 65)), [100.0 / b**0.6 for b in range(1, 65)], 64)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------- the cost model
def test_block_pays_matches_the_hand_computed_gain_and_cost_at_r1():
    """a = (.9, .5, .1): Θ = 100, 1.9·90 = 171, 2.4·85 = 204, 2.5·80 = 200, so Algorithm 1 stops at ℓ = 2.
    gain = 1.4 · T(1) = 14 ms; cost = t_d + T(3) − T(1) = t_d + 1/85 − 1/100."""
    a = np.array([0.9, 0.5, 0.1])
    extra = 1 / 85 - 1 / 100
    pays, ell, gain, cost = block_pays(a, SPS, live=1, draft_s=0.002)
    assert (pays, ell) == (True, 2)
    assert gain == pytest.approx(0.014) and cost == pytest.approx(0.002 + extra)
    pays, ell, gain, cost = block_pays(a, SPS, live=1, draft_s=0.013)
    assert (pays, ell) == (False, 2) and cost == pytest.approx(0.013 + extra) and cost > gain


def test_block_pays_at_r2_shares_the_step_and_counts_the_other_base_token():
    """R = 2: Algorithm 1 on SPS(B + 1): 90, 1.9·85, 2.4·80 = 192, 2.5·72.5 = 181.25 → ℓ = 2.
    gain = 1.4 · T(2) / 2; cost = t_d + T(4) − T(2)."""
    a = np.array([0.9, 0.5, 0.1])
    gain_expected = 1.4 * (1 / 90) / 2
    extra = 1 / 80 - 1 / 90
    pays, ell, gain, cost = block_pays(a, SPS, live=2, draft_s=0.002)
    assert (pays, ell) == (True, 2) and gain == pytest.approx(gain_expected) and cost == pytest.approx(0.002 + extra)
    assert block_pays(a, SPS, live=2, draft_s=0.007)[0] is False  # 0.0084 > 0.0078


def test_a_block_algorithm1_would_not_verify_never_pays():
    a = np.array([0.05, 0.01, 0.0])  # 1.05 · 90 < 100: ℓ = 0
    assert block_pays(a, SPS, live=1, draft_s=0.0) == (False, 0, 0.0, 0.0)


def test_at_r1_the_rule_is_speculation_beating_the_target_alone():
    """Independent form at R = 1: (1 + Σ_{j≤ℓ} a_j) / (t_d + T(1 + ℓ)) > 1 / T(1)."""
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(400):
        a = np.cumprod(rng.uniform(0, 1, size=4) ** rng.uniform(0.05, 2))
        draft_s = rng.uniform(0, 0.02)
        pays, ell, _, _ = block_pays(a, DECAYING, live=1, draft_s=draft_s)
        direct = (1 + a[:ell].sum()) / (draft_s + 1 / DECAYING(1 + ell)) > DECAYING(1)
        assert pays == direct
        seen.add(pays)
    assert seen == {True, False}


def test_expected_survival_is_the_mean_of_the_rows():
    np.testing.assert_allclose(expected_survival([np.array([1.0, 0.5]), np.array([0.5, 0.0])]), [0.75, 0.25])


def test_cost_model_inputs_are_checked():
    with pytest.raises(ValueError, match="draft_s"):
        block_pays(np.ones(3), SPS, live=1, draft_s=-1.0)
    with pytest.raises(ValueError, match="live"):
        block_pays(np.ones(3), SPS, live=0, draft_s=0.0)
    with pytest.raises(ValueError, match="draft_time_s"):
        DraftSkipper(SPS, draft_time_s=float("nan"))
    with pytest.raises(ValueError, match="longest back-off"):
        make_policy("algorithm1+skip:0", SPS)
    with pytest.raises(ValueError, match="needs an SPS table"):
        make_policy("algorithm1+skip")


# --------------------------------------------------------------------------- the state machine
def _schedule(skipper: DraftSkipper, confidences, steps: int, rid: int = 0) -> list[int]:
    """Steps (0-based) at which request ``rid`` drafts, feeding the given confidences each time."""
    drafted = []
    for step in range(steps):
        if skipper.plan([rid])[0]:
            drafted.append(step)
            skipper.choose([rid], np.array([confidences(step)], dtype=np.float64))
    return drafted


def test_perfect_confidences_draft_at_every_step():
    skipper = DraftSkipper(DECAYING, draft_time_s=0.001)
    assert _schedule(skipper, lambda step: [1.0] * 4, 60) == list(range(60))


def test_zero_confidences_back_off_exponentially_and_almost_never_draft():
    """First step drafts (no history), then skip 1, 2, 4, 8, 16, 16, ... steps between re-probes."""
    skipper = DraftSkipper(DECAYING, draft_time_s=0.001, max_backoff=16)
    drafted = _schedule(skipper, lambda step: [0.0] * 4, 400)
    assert drafted[:9] == [0, 2, 5, 10, 19, 36, 53, 70, 87]
    assert len(drafted) / 400 < 0.07


def test_a_request_whose_drafts_improve_returns_to_speculation_at_the_next_probe():
    skipper = DraftSkipper(DECAYING, draft_time_s=0.001, window=1)
    drafted = _schedule(skipper, lambda step: [0.0] * 4 if step < 12 else [1.0] * 4, 40)
    assert drafted[:5] == [0, 2, 5, 10, 19]  # still backing off when the drafts improve at step 12
    assert drafted[4:] == list(range(19, 40))  # the probe at 19 sees good drafts: drafts from then on


def test_without_a_measured_draft_time_every_request_drafts_and_a_measurement_turns_the_rule_on():
    skipper = DraftSkipper(DECAYING)  # measured t_d
    assert _schedule(skipper, lambda step: [0.0] * 4, 5) == [0, 1, 2, 3, 4]
    skipper.observe_draft_time(0.004)
    skipper.observe_draft_time(0.002)
    skipper.observe_draft_time(0.100)
    assert skipper.draft_s == pytest.approx(0.004)  # the median
    assert skipper.plan([0]).tolist() == [False]


def test_choose_runs_algorithm1_and_gives_skipped_rows_nothing():
    skipper = DraftSkipper(SPS, draft_time_s=0.001)
    skipper.plan([0, 1])
    lengths = skipper.choose([0, 1], np.array([[0.9, 0.5, 0.1], [0.0, 0.0, 0.0]]))
    # two rows: Θ = 2·90, 2.9·85, 3.4·80 = 272, 3.5·72.5 < 272 → ℓ = (2, 0)
    assert lengths.tolist() == [2, 0]


# --------------------------------------------------------------------------- serving with skips
def test_greedy_serving_with_skips_reproduces_greedy_target_decoding():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    policy = skip_policy(DECAYING, draft_time_s=0.004)
    sim = simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=24, temperature=0.0, seed=0),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=2, draft_overhead="measured"),
                   cycle=False)
    for i, prompt in enumerate(PROMPTS):
        assert sim.requests[i]["result"].tokens == greedy(target, prompt, 24).tokens
    assert sim.skipped > 0 and sim.drafted > 0


def test_sampled_serving_with_skips_keeps_the_targets_distribution():
    """Joint of the first three tokens of 800 requests (T = 1, V = 8) against the target's exact joint,
    while the skip policy both drafts and skips (decisions from earlier rounds of each request)."""
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter = random_drafter(target, gamma=2, seed=2)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    prompt, V = [1, 3, 2, 0], target.vocab_size
    policy = skip_policy(DECAYING, draft_time_s=0.0035, window=1, max_backoff=1)
    sim = simulate(target, drafter, [prompt], decoding=DecodeSettings(max_new_tokens=4, temperature=1.0, seed=5),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=4), num_requests=800)
    counts = joint_counts(sim, V)
    skipped = sum(1 for r in sim.rounds if not r["drafted"])
    assert counts.sum() >= 800 and skipped > 150 and len(sim.rounds) - skipped > 150
    exact = exact_joint(target, prompt, 3, 1.0)
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_a_skipped_request_adds_one_token_to_the_batch_and_no_draft_time():
    """Request 0 drafts every step (scripted: 2 of 3 drafts right, ℓ = 3 → 3 tokens), request 1 never
    drafts (1 token a step). B = (1 + 3) + 1 = 5; with draft_overhead="measured" each step costs
    1 / SPS(5) plus the draft time measured in it, which is request 0's alone."""
    from dspark.scheduling.policies import Policy

    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    drafter = scripted(target, prompt)
    plan = lambda ids: np.array([i == 0 for i in ids])  # noqa: E731
    policy = Policy("plan", True, lambda ids, c: np.array([3 if i == 0 else 0 for i in ids]), plan=plan)
    sim = simulate(target, drafter, [prompt, prompt],
                   decoding=DecodeSettings(max_new_tokens=7, temperature=0.0, seed=0),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=2, draft_overhead="measured"),
                   cycle=False)
    assert [s["batch_tokens"] for s in sim.step_log[:2]] == [5, 5]
    assert [(r["request"], r["drafted"], r["proposed"], r["emitted"]) for r in sim.rounds[:2]] == [
        (0, True, 3, 3), (1, False, 0, 1)]
    assert all(r["confidences"] is None for r in sim.rounds if not r["drafted"])
    assert sim.requests[1]["result"].tokens == greedy(target, prompt, 7).tokens
    assert sim.drafted == 2 and sim.skipped == sim.request_steps - 2
    draft_steps = [s for s in sim.step_log if s["drafted"]]
    assert all(s["draft_s"] > 0 for s in draft_steps) and all(s["draft_s"] == 0 for s in sim.step_log[2:])
    assert sim.draft_s == pytest.approx(sum(s["draft_s"] for s in draft_steps))
    assert sim.sim_time_s == pytest.approx(sum(1 / DECAYING(s["batch_tokens"]) for s in sim.step_log)
                                           + sim.overhead_s * sim.time_scale)
    assert sim.overhead_s > sim.draft_s  # accept, bookkeeping and schedule are charged too
    assert sim.draft_cost_steps == pytest.approx(sim.draft_s / 2 * sim.time_scale * DECAYING(1))
    summary = sim.summary()
    assert summary["skipped_rounds"] == sim.skipped and summary["draft_clock"] == "measured"


def test_a_step_in_which_nobody_drafts_pays_no_draft_overhead():
    from dspark.scheduling.policies import Policy

    target = make_tiny_target("llama")
    policy = Policy("never", True, lambda ids, c: np.zeros(len(ids), dtype=np.int64),
                    plan=lambda ids: np.zeros(len(ids), dtype=bool))
    sim = simulate(target, random_drafter(target, gamma=4), PROMPTS,
                   decoding=DecodeSettings(max_new_tokens=6, temperature=1.0, seed=0),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=3, draft_overhead=0.5),
                   num_requests=3)
    assert sim.drafted == 0 and sim.draft_s == 0 and sim.tau == 1.0
    assert sim.throughput == pytest.approx(3 * DECAYING(3))  # plain steps, no (1 + 0.5) factor
    assert sim.summary()["vs_target_only"] == pytest.approx(1.0)
    assert all(len(request["result"].tokens) == 6 for request in sim.requests)


def test_draft_overhead_must_be_a_fraction_or_measured():
    for bad in (-0.1, "sometimes", float("inf")):
        with pytest.raises(ValueError, match="ServeSettings.draft_overhead"):
            ServeSettings(policy="static", sps=DECAYING, draft_overhead=bad)
