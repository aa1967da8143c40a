"""The serving simulator (paper Section 5.2, Fig. 8) and the per-request stepper it drives.

Oracles: ``speculative_generate`` (the one-request loop), greedy target-only
decoding (any verification-length schedule is exact at T = 0), the target's
exact joint distribution of the first tokens on a tiny vocabulary (lossless
scheduling at T = 1), the paper's Appendix A counterexample (a search without
the early-stopping break must be caught by the same test), and hand-computed
throughput / τ / budget for a scripted drafter whose acceptances are known.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.targets import make_tiny_target
from dspark.scheduling.calibration import apply_temperatures
from dspark.decoding.loop import PhaseClock, SpeculativeRequest, speculative_generate, target_generate
from dspark.modeling import Proposal
from dspark.scheduling.algorithm1 import SPSTable, schedule_prefix
from dspark.evaluation.report import write_results
from dspark.scheduling.simulator import (
    DecodeSettings,
    Job,
    Policy,
    ServeSettings,
    job_seed,
    make_policy,
    run_requests,
    simulate,
)
from helpers.serving import PROMPTS, greedy, joint_counts, scripted
from helpers.decoding import chi_square_pvalue, exact_joint, random_drafter


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A decaying cost curve: SPS(B) = 100 / B^0.6, so Algorithm 1 admits more drafts when fewer requests compete.
DECAYING = SPSTable(list(range(1, 65)), [100.0 / b**0.6 for b in range(1, 65)], 64)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------- the stepper
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_stepping_a_request_by_hand_is_speculative_generate(temperature):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    plan = [0, 2, 4, 1, 3]
    for prompt in PROMPTS:
        expected = speculative_generate(target, drafter, prompt, max_new_tokens=30, temperature=temperature,
                                        eos_token_ids=(5,), choose_length=lambda c, i: plan[i % 5],
                                        generator=torch.Generator().manual_seed(9))
        request = SpeculativeRequest(target, drafter, prompt, max_new_tokens=30, temperature=temperature,
                                     eos_token_ids=(5,), generator=torch.Generator().manual_seed(9))
        while not request.done:
            proposal = request.draft()
            assert request.confidences == proposal.confidences[0].tolist()
            request.verify(plan[len(request.rounds) % 5])
        got = request.result()
        assert got.tokens == expected.tokens and got.rounds == expected.rounds
        assert got.finished_by_eos == expected.finished_by_eos


def test_a_request_times_its_phases_only_with_a_clock_and_decodes_the_same_either_way():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)

    def run(clock):
        request = SpeculativeRequest(target, drafter, PROMPTS[0], max_new_tokens=12,
                                     generator=torch.Generator().manual_seed(3), clock=clock)
        while not request.done:
            request.draft()
            request.verify(2)
        return request.result()

    untimed, timed = run(None), run(PhaseClock(target.device))
    assert untimed.tokens == timed.tokens and untimed.rounds == timed.rounds
    assert untimed.timings == {}
    assert set(timed.timings) == {"prefill", "draft", "verify", "accept", "bookkeeping", "total"}


def test_an_eos_accepted_in_the_serving_loop_ends_the_round_with_tau_equal_to_accepted():
    """Same round code as speculative_generate: with drafts x_1..x_5 right (x_6 wrong) and the
    EOS at x_k, k < 5, the round accepts x_1..x_k, emits nothing after the EOS and verifies nothing past it."""
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    drafter = scripted(target, prompt, gamma=6, correct=5, confidences=[0.9] * 6)
    x = greedy(target, prompt, 8).tokens  # x[0] from the prefill, round 1 drafts x[1..6]
    k = next(i for i in range(2, 5) if x[i] not in x[:i])  # the first new token: the EOS
    sim = run_requests(target, drafter, [Job(prompt, seed=0, tag="r")],
                       decoding=DecodeSettings(max_new_tokens=20, temperature=0.0, eos_token_ids=(x[k],)),
                       serving=ServeSettings(policy="static"))
    (row,) = sim.rounds
    assert (row["proposed"], row["accepted"], row["eos_accepted"], row["emitted"]) == (k, k, True, k)
    assert sim.tau == k and sim.tokens == k and sim.requests[0]["finished_by_eos"]
    assert sim.proposed == 6  # the target still verified all six: the step's cost is what was sent


def test_the_stepper_refuses_out_of_order_calls_and_bad_lengths():
    target = make_tiny_target("llama")
    request = SpeculativeRequest(target, random_drafter(target, gamma=4), PROMPTS[0], max_new_tokens=8)
    with pytest.raises(RuntimeError, match="draft"):
        request.verify(1)
    request.draft()
    with pytest.raises(RuntimeError, match="twice"):
        request.draft()
    with pytest.raises(ValueError, match="0..4"):
        request.verify(5)


def test_each_served_request_is_speculative_generate_with_its_own_seed():
    """Under a static policy the other live requests change nothing: request i of a run at
    R = 3 produces exactly what speculative_generate produces alone with seed job_seed(seed, i)."""
    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=3)
    sim = simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=20, temperature=1.0, seed=4),
                   serving=ServeSettings(policy="static", sps=DECAYING, concurrency=3), cycle=False)
    assert [r["index"] for r in sim.requests] == [0, 1, 2] and all(r["finished"] for r in sim.requests)
    for i, prompt in enumerate(PROMPTS):
        alone = speculative_generate(target, drafter, prompt, max_new_tokens=20, temperature=1.0,
                                     generator=torch.Generator().manual_seed(job_seed(4, i)))
        served = sim.requests[i]["result"]
        assert served.tokens == alone.tokens and served.rounds == alone.rounds


# --------------------------------------------------------------------------- lossless under every policy
POLICIES = ["algorithm1", "algorithm1+skip", "async", "async:3", "static1", "static", "static:0", "threshold:0.5"]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_serving_reproduces_greedy_target_decoding_under_every_policy(policy):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    sts = np.random.default_rng(0).uniform(0.5, 2.0, size=4)  # any calibration: T = 0 is exact for every ℓ
    sim = simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=24, temperature=0.0, seed=0),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=2, sts_temperatures=sts),
                   cycle=False)
    for i, prompt in enumerate(PROMPTS):
        assert sim.requests[i]["result"].tokens == greedy(target, prompt, 24).tokens
    if policy in ("algorithm1", "threshold:0.5"):  # the schedule really varied
        assert len({r["proposed"] for r in sim.rounds}) >= 3


@pytest.mark.parametrize("policy", ["algorithm1", "async"])
def test_sampled_serving_keeps_the_targets_distribution(policy):
    """Joint of the first three tokens of 800 requests served four at a time (T = 1, V = 8)
    against the target's exact joint. The policy schedules from the drafter's real
    confidence head, and lengths 0, 1 and 2 all occur."""
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter = random_drafter(target, gamma=2, seed=2)
    with torch.no_grad():  # flatter drafts: about 60 % accepted
        drafter.norm.weight.mul_(0.3)
    prompt, V = [1, 3, 2, 0], target.vocab_size
    # Requests live up to three rounds, so async's capacity from two steps back is often > 0.
    sim = simulate(target, drafter, [prompt], decoding=DecodeSettings(max_new_tokens=4, temperature=1.0, seed=5),
                   serving=ServeSettings(policy=policy, sps=DECAYING, concurrency=4), num_requests=800)
    counts = joint_counts(sim, V)
    lengths = np.bincount([r["proposed"] for r in sim.rounds], minlength=3)
    assert counts.sum() >= 800 and (lengths > 100).all()  # a few more finish in the last step
    exact = exact_joint(target, prompt, 3, 1.0)
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


class CountingDrafter:
    """A drafter that counts its draft calls (``propose``) and otherwise is ``inner``."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs):
        self.calls += 1
        return self.inner.propose(*args, **kwargs)


def test_async_draws_no_draft_on_a_capacity_0_step_and_stays_lossless():
    """An SPS curve on which no verified draft pays (SPS collapses past B = R) gives K = 0 from any
    two-step-old draft: by hand, steps 1, 2 draft at the fallback K0 = R (no draft two steps back),
    steps 3, 4 have K = 0 (drafts from steps 1, 2) and draft nothing, steps 5, 6 fall back again
    (steps 3, 4 drew none), and so on."""
    target = make_tiny_target("llama")
    R, gamma = 2, 4
    cliff = SPSTable(list(range(1, 12)), [1.0, 1.0] + [1e-3] * 9, 11)
    drafter = CountingDrafter(random_drafter(target, gamma=gamma))
    calls = []
    sim = simulate(target, drafter, PROMPTS[:R], decoding=DecodeSettings(max_new_tokens=24, temperature=0.0, seed=0),
                   serving=ServeSettings(policy="async", sps=cliff, concurrency=R), cycle=False,
                   on_step=lambda res: calls.append(drafter.calls))
    per_step = np.diff([0, *calls]).tolist()
    steps = len(per_step)
    assert steps >= 8
    expected = [R if t % 4 in (0, 1) else 0 for t in range(steps)]
    full = [t for t, s in enumerate(sim.step_log) if s["live"] == R]  # the pattern while both requests live
    assert len(full) >= 8 and [per_step[t] for t in full] == [expected[t] for t in full]
    assert [s["drafted"] for s in sim.step_log] == per_step
    assert sim.skipped > 0 and all(r["proposed"] == 0 for r in sim.rounds if not r["drafted"])
    for i, prompt in enumerate(PROMPTS[:R]):
        assert sim.requests[i]["result"].tokens == greedy(target, prompt, 24).tokens


def test_async_refuses_a_zero_default_capacity():
    with pytest.raises(ValueError, match="K0 must be >= 1"):
        make_policy("async:0", DECAYING)


def test_the_policys_decision_time_is_inside_each_requests_wall_time():
    """A policy that sleeps 20 ms per decision: every live request's timings carry a "schedule" phase of at
    least 20 ms per step it lived through, and its total (the sum of its phases) includes it."""
    import time

    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    pause = 0.02

    def slow(ids, c):
        time.sleep(pause)
        return np.full(len(ids), 1, dtype=np.int64)

    sim = simulate(target, drafter, PROMPTS[:2], decoding=DecodeSettings(max_new_tokens=6, temperature=0.0, seed=0),
                   serving=ServeSettings(policy=Policy("slow", False, slow), sps=DECAYING, concurrency=2), cycle=False)
    for req in sim.requests:
        timings = req["timings"]
        assert timings["schedule"] >= pause * req["rounds"]
        assert timings["total"] == pytest.approx(sum(v for k, v in timings.items() if k != "total"))
        assert timings["total"] >= timings["schedule"] + timings["draft"] + timings["verify"]


def test_measured_overhead_charges_the_context_update_and_every_phase_but_verify():
    """A drafter whose context update sleeps 20 ms: with draft_overhead="measured" every step
    that updates the context (all but the last) costs 1 / SPS(B) plus at least 20 ms on the SPS
    clock's time scale, and each step costs 1 / SPS(B) plus exactly its measured draft, accept,
    bookkeeping and schedule seconds times the run's time_scale; a fraction f charges none of them."""
    import time

    target = make_tiny_target("llama")
    prompt, pause = PROMPTS[0], 0.02
    drafter = scripted(target, prompt)
    update = drafter.extend_context

    def slow_update(ctx, features, num_valid=None):
        time.sleep(pause)
        update(ctx, features, num_valid)

    drafter.extend_context = slow_update
    sps = SPSTable([1, 8], [1000.0, 1000.0], 8)
    sims = {overhead: simulate(target, drafter, [prompt], cycle=False,
                               decoding=DecodeSettings(max_new_tokens=10, temperature=0.0, seed=0),
                               serving=ServeSettings(policy="static", sps=sps, draft_overhead=overhead))
            for overhead in ("measured", 0.0)}
    sim = sims["measured"]
    assert sim.steps == 3  # 1 + 3 + 3 + 3 tokens, the last round ends the request: no context update
    scale = sim.time_scale
    assert scale == pytest.approx(sim.steps / 1000 / sim.verify_s)  # the table prices each forward at 1 ms
    for step in sim.step_log[:-1]:
        assert step["step_time_s"] >= 1 / 1000 + pause * scale
    timings = sim.requests[0]["timings"]
    charged = sum(v for k, v in timings.items() if k not in ("verify", "prefill", "total"))
    assert sim.overhead_s == pytest.approx(charged) and charged >= timings["draft"] + 2 * pause
    assert sim.verify_s == pytest.approx(timings["verify"])
    assert sim.sim_time_s == pytest.approx(sim.steps / 1000 + sim.overhead_s * scale)
    assert all(s["step_time_s"] == pytest.approx(1 / 1000 + s["overhead_s"] * scale) for s in sim.step_log)
    assert sims[0.0].sim_time_s == pytest.approx(3 / 1000)


class AppendixADrafter:
    """Appendix A's drafter: x_1 uniform over {A, B}; c_1 = 0.8, and c_2 = 0.9 after A, 0 after B."""

    def __init__(self, vocab: int, a: int, b: int):
        self.vocab, self.a, self.b = vocab, a, b

    def new_context(self, batch_size, device=None, capacity=256):
        return SimpleNamespace(lengths=torch.zeros(batch_size, dtype=torch.long))

    def extend_context(self, ctx, features, num_valid=None):
        ctx.lengths = ctx.lengths + features.shape[1]

    def propose(self, ctx, anchor_tokens, *, temperature=1.0, generator=None):
        probs = torch.full((1, 2, self.vocab), 1.0 / self.vocab)
        probs[0, 0] = 0.0
        probs[0, 0, [self.a, self.b]] = 0.5
        x1 = self.a if float(torch.rand((), generator=generator)) < 0.5 else self.b
        confidences = torch.tensor([[0.8, 0.9 if x1 == self.a else 0.0]])
        return Proposal(torch.tensor([[x1, self.a]]), probs, probs.log(), confidences)


def test_the_appendix_a_leak_is_caught_and_algorithm1_is_not_leaky():
    """With SPS(1..3) = 1.0, 0.5, 0.45, a search without the break verifies x_1 only when it is A
    (Appendix A), which skews the second token; Algorithm 1 stops at Θ_1 < Θ_0 and verifies nothing."""
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    prompt, V = [1, 3, 2, 0], target.vocab_size
    exact = exact_joint(target, prompt, 2, 1.0)  # [V, V]: (x_0, x_1)
    likely = exact.sum(0).argsort(descending=True).tolist()  # A = the likeliest x_1: the largest skew
    drafter = AppendixADrafter(V, a=likely[0], b=likely[1])
    sps = SPSTable([1, 2, 3], [1.0, 0.5, 0.45], 3)
    leaky = Policy("no break", True, lambda ids, c: schedule_prefix(c, sps, early_stop=False))
    pvalues, lengths = {}, {}
    for name, policy in (("algorithm1", "algorithm1"), ("no break", leaky)):
        sim = simulate(target, drafter, [prompt], decoding=DecodeSettings(max_new_tokens=2, temperature=1.0, seed=1),
                       serving=ServeSettings(policy=policy, sps=sps, concurrency=1), num_requests=1000)
        counts = torch.zeros(V, V)
        for request in sim.requests:
            counts[tuple(request["result"].tokens)] += 1
        pvalues[name] = chi_square_pvalue(counts.sum(0), exact.sum(0))  # x_1, where the skew is
        lengths[name] = {r["proposed"] for r in sim.rounds}
    assert lengths == {"algorithm1": {0}, "no break": {0, 2}}
    assert pvalues["algorithm1"] > 1e-3
    assert pvalues["no break"] < 1e-6


# --------------------------------------------------------------------------- accounting
def test_throughput_tau_and_budget_equal_the_hand_computed_values():
    """R = 2 slots, two requests of 7 tokens, γ = 3, drafts right at positions 1-2 (T = 0).
    Request 0 verifies ℓ = 3: each round accepts 2 and emits 3, so 1 + 3 + 3 = 7 tokens in 2 rounds.
    Request 1 verifies ℓ = 1: each round emits 2, so 1 + 2 + 2 + 2 in 3 rounds.
    Steps: B = 4 + 2 = 6 emitting 3 + 2 tokens, again B = 6 and 3 + 2, then B = 2 and 2 (request 1 alone)."""
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    drafter = scripted(target, prompt)
    seen = []

    def script(request_ids, confidences):
        seen.append(confidences.copy())
        return np.array([3 if i == 0 else 1 for i in request_ids])

    sps = SPSTable([2, 6], [50.0, 20.0], 8)
    sts = [2.0, 0.5, 1.0]
    for overhead in (0.0, 0.5):
        sim = simulate(target, drafter, [prompt, prompt],
                       decoding=DecodeSettings(max_new_tokens=7, temperature=0.0, seed=0),
                       serving=ServeSettings(policy=script, sps=sps, concurrency=2, sts_temperatures=sts,
                                             draft_overhead=overhead),
                       cycle=False)
        assert [s["batch_tokens"] for s in sim.step_log] == [6, 6, 2]
        assert [s["tokens"] for s in sim.step_log] == [5, 5, 2]
        assert [(r["request"], r["proposed"], r["accepted"], r["emitted"]) for r in sim.rounds] == [
            (0, 3, 2, 3), (1, 1, 1, 2), (0, 3, 2, 3), (1, 1, 1, 2), (1, 1, 1, 2)]
        seconds = (1 + overhead) * (1 / 20 + 1 / 20 + 1 / 50)
        assert sim.steps == 3 and sim.tokens == 12
        assert sim.sim_time_s == pytest.approx(seconds)
        assert sim.throughput == pytest.approx(12 / seconds)
        assert sim.tau == pytest.approx(12 / 5)  # (3 + 2 + 3 + 2 + 2) / 5
        assert sim.mean_ell == pytest.approx(9 / 5) and sim.budget_tokens == pytest.approx(14 / 5)
        assert sim.mean_batch_tokens == pytest.approx(14 / 3)
        assert sim.tokens_per_s_per_user == pytest.approx(12 / ((1 + overhead) * (2 / 20 + 2 / 20 + 1 / 50)))
    for confidences in seen:  # the policy saw STS-calibrated confidences
        np.testing.assert_allclose(confidences, apply_temperatures(np.array([[0.9, 0.8, 0.7]] * len(confidences)), sts))
    a = np.cumprod(apply_temperatures(np.array([[0.9, 0.8, 0.7]]), sts)[0])
    assert sim.rounds[0]["expected_accepted"] == pytest.approx(a.sum())
    assert sim.rounds[1]["expected_accepted"] == pytest.approx(a[0])


def test_the_clock_prices_on_price_sps_while_the_policy_decides_on_sps():
    """Algorithm 1 decides on a table where B = 2 costs as much as B = 1 (so it verifies), the
    clock charges another: every step is priced 1 / SPS'(B) and target-only R·SPS'(R), and the
    decisions are those of the run without a separate clock table."""
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    decide = SPSTable([1, 2, 8], [50.0, 50.0, 10.0], 8)
    price = SPSTable([1, 2, 8], [40.0, 45.0, 10.0], 8)  # a rise the policy's table flattened
    runs = [simulate(target, scripted(target, prompt), [prompt],
                     decoding=DecodeSettings(max_new_tokens=7, temperature=0.0, seed=0),
                     serving=ServeSettings(policy="algorithm1", sps=decide, price_sps=clock), cycle=False)
            for clock in (None, price)]
    own, priced = runs
    assert [r["proposed"] for r in priced.rounds] == [r["proposed"] for r in own.rounds]
    assert priced.target_only_throughput == pytest.approx(40.0) and own.target_only_throughput == pytest.approx(50.0)
    assert priced.sim_time_s == pytest.approx(sum(1 / float(price(s["batch_tokens"])) for s in priced.step_log))
    assert own.sim_time_s == pytest.approx(sum(1 / float(decide(s["batch_tokens"])) for s in own.step_log))
    assert priced.throughput / priced.target_only_throughput == pytest.approx(own.priced_by(price))
    with pytest.raises(ValueError, match="price_sps needs sps"):
        ServeSettings(price_sps=price)


def test_verifying_nothing_gives_tau_one_and_a_batch_of_one_token_per_request():
    target = make_tiny_target("llama")
    sim = simulate(target, random_drafter(target, gamma=4), PROMPTS,
                   decoding=DecodeSettings(max_new_tokens=6, temperature=1.0, seed=0),
                   serving=ServeSettings(policy="static:0", sps=DECAYING, concurrency=3), num_requests=5)
    assert sim.tau == 1.0 and sim.mean_ell == 0.0 and sim.budget_tokens == 1.0
    assert all(s["batch_tokens"] == s["live"] == 3 for s in sim.step_log)
    assert sim.throughput == pytest.approx(3 * DECAYING(3))  # one token per request per step


def test_cycling_keeps_r_requests_live_and_stops_after_num_requests_finished():
    target = make_tiny_target("llama")
    sim = simulate(target, random_drafter(target, gamma=4), PROMPTS,
                   decoding=DecodeSettings(max_new_tokens=10, temperature=1.0, seed=0),
                   serving=ServeSettings(policy="algorithm1", sps=DECAYING, concurrency=4), num_requests=6)
    assert all(s["live"] == 4 for s in sim.step_log)
    assert sim.requests_finished == 6 and len(sim.requests) >= 6 + 4 - 1
    assert [r["tag"] for r in sim.requests] == [i % 3 for i in range(len(sim.requests))]  # prompt i mod N
    assert sum(s["batch_tokens"] for s in sim.step_log) == sim.batch_tokens == sim.request_steps + sim.proposed
    for step in sim.step_log:
        rows = [r for r in sim.rounds if r["step"] == step["step"]]
        assert step["batch_tokens"] == sum(1 + r["proposed"] for r in rows)


def test_policy_specs_and_their_errors():
    conf = np.array([[0.9, 0.5, 0.1], [0.6, 0.6, 0.6]])
    assert make_policy("static1")([0, 1], conf).tolist() == [1, 1]
    assert make_policy("static")([0, 1], conf).tolist() == [3, 3]
    assert make_policy("static:2")([0, 1], conf).tolist() == [2, 2]
    assert make_policy("threshold:0.4")([0, 1], conf).tolist() == [2, 1]  # a = (.9, .45, .045), (.6, .36, ...)
    assert make_policy("first-below:0.4")([0, 1], conf).tolist() == [2, 3]  # c = (.9, .5, .1), (.6, .6, .6)
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\]"):
        make_policy("first-below:2")
    with pytest.raises(ValueError, match="needs an SPS table"):
        make_policy("algorithm1")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("greedy-please", DECAYING)
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=4, seed=0),
                 serving=ServeSettings(policy="static", sps=SPSTable([1, 4], [10.0, 5.0], 4), concurrency=2))


def test_results_files_hold_the_table_the_rounds_and_figure_8(tmp_path):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    results = [simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=6, seed=0),
                        serving=ServeSettings(policy=p, sps=DECAYING, concurrency=r))
               for p in ("algorithm1", "static1") for r in (1, 2)]
    write_results(tmp_path, results, {"note": "test"})
    import json

    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["policy"], r["concurrency"]) for r in data["results"]] == [
        ("algorithm1", 1), ("algorithm1", 2), ("static1", 1), ("static1", 2)]
    assert data["results"][0]["throughput"] == pytest.approx(results[0].throughput)
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert len(lines) == sum(len(r.rounds) for r in results)
    table = (tmp_path / "results.md").read_text()
    assert "| static1 | 2 |" in table and "draft cost (steps)" in table and "Drafting on the SPS clock: none" in table
    assert data["results"][0]["draft_cost_steps"] == pytest.approx(results[0].draft_s_per_round * DECAYING(1))
    for png in ("figure8.png", "frontier.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_run_requests_serves_given_jobs_with_their_seeds_and_tags():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    jobs = [Job(PROMPTS[0], 123, ("gsm8k", 7)), Job(PROMPTS[1], 456, ("gsm8k", 9))]
    sim = run_requests(target, drafter, jobs, decoding=DecodeSettings(max_new_tokens=8),
                       serving=ServeSettings(policy="static", concurrency=2))
    assert [r["tag"] for r in sim.requests] == [("gsm8k", 7), ("gsm8k", 9)]
    assert np.isnan(sim.throughput)  # no SPS table: no simulated clock
    alone = speculative_generate(target, drafter, PROMPTS[1], max_new_tokens=8,
                                 generator=torch.Generator().manual_seed(456))
    assert sim.requests[1]["result"].tokens == alone.tokens



# --------------------------------------------------------------------------- the two clocks decode the same requests
SMALL_SPS = SPSTable([1, 2, 3, 4], [30.0, 29.0, 24.0, 18.0], 4)  # R = 1, γ = 3: B = 1 + ℓ <= 4


@pytest.mark.parametrize("policy", ["static", "algorithm1"])
def test_at_r_1_eval_and_simulate_decode_every_request_with_the_same_tokens(tmp_path, monkeypatch, policy):
    """The wall clock (``evaluate`` with a policy, one benchmark at a time) and the SPS clock
    (``simulate`` on the interleaved prompts with their keys, as ``dspark simulate`` builds them)
    seed every request with ``request_seed``, so at R = 1 each prompt gets the very same tokens
    and rounds on both. Without keys the simulator's own seeds give other tokens (the oracle bites)."""
    import dspark.evaluation.eval_scheduled as scheduled
    import dspark.evaluation.evaluate as ev
    from dspark.config import Config, EvalConfig, ServeConfig
    from dspark.evaluation.scheduling_runs import _simulation_prompts
    from helpers.benchmarks import CharTokenizer, write_benchmarks

    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    data = tmp_path / "data"
    write_benchmarks(data, {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0", "m1", "m2"], "alpaca": ["a0"]})
    decoding = DecodeSettings(max_new_tokens=12, temperature=1.0, seed=3, eos_token_ids=[0])
    serving = ServeSettings(policy=policy, sps=SMALL_SPS, concurrency=1)
    served = []

    def capture(*args, **kwargs):
        served.append(run_requests(*args, **kwargs))
        return served[-1]

    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)
    monkeypatch.setattr(scheduled, "run_requests", capture)
    ev.evaluate(target, drafter, data, names=["gsm8k", "mbpp", "alpaca"], num_samples=2, decoding=decoding,
                serving=serving, baseline=False, progress=False, tokenizer=CharTokenizer())
    wall = {tuple(r["tag"]): r["result"] for sim in served for r in sim.requests}

    config = Config(eval=EvalConfig(data_dir=str(data), benchmarks=["gsm8k", "mbpp", "alpaca"], seed=3),
                    serve=ServeConfig(num_prompts=2))
    _, prompts, keys = _simulation_prompts(config, CharTokenizer())
    assert keys == [("gsm8k", 0), ("mbpp", 0), ("alpaca", 0), ("gsm8k", 1), ("mbpp", 1)]  # interleaved
    sim = simulate(target, drafter, prompts, keys=keys, decoding=decoding, serving=serving, cycle=False)
    assert [r["tag"] for r in sim.requests] == keys and set(wall) == set(keys)
    for request, prompt in zip(sim.requests, prompts):
        got, expected = request["result"], wall[request["tag"]]
        assert got.prompt_len == len(prompt) == expected.prompt_len
        assert got.tokens == expected.tokens and got.rounds == expected.rounds
    assert len({r.proposed for r in wall.values() for r in r.rounds}) >= (2 if policy == "algorithm1" else 1)
    unkeyed = simulate(target, drafter, prompts, decoding=decoding, serving=serving, cycle=False)
    assert any(a["result"].tokens != b["result"].tokens for a, b in zip(unkeyed.requests, sim.requests))


def test_a_cycled_prompt_draws_a_stream_of_its_own_at_each_reuse():
    """With keys and cycle=True, request i serves prompt i mod N with request_seed(seed, key, i // N):
    the second use of a prompt (cycle 1) is speculative_generate with its cycle-1 seed, not a replay
    of its first use."""
    from dspark.seeds import request_seed

    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=3)
    keys = [("gsm8k", 4), ("mbpp", 0), ("gsm8k", 5)]
    sim = simulate(target, drafter, PROMPTS, keys=keys, decoding=DecodeSettings(max_new_tokens=16, seed=4),
                   serving=ServeSettings(policy="static", sps=DECAYING, concurrency=1), num_requests=6)
    assert [r["tag"] for r in sim.requests] == keys + keys
    for i, request in enumerate(sim.requests):
        alone = speculative_generate(target, drafter, PROMPTS[i % 3], max_new_tokens=16, temperature=1.0,
                                     generator=torch.Generator().manual_seed(request_seed(4, *keys[i % 3], i // 3)))
        assert request["result"].tokens == alone.tokens
    first, again = sim.requests[0]["result"], sim.requests[3]["result"]
    assert first.tokens != again.tokens


def test_simulate_names_bad_keys():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    common = dict(decoding=DecodeSettings(max_new_tokens=4), serving=ServeSettings(policy="static", sps=DECAYING))
    with pytest.raises(ValueError, match="keys has 2 entries but there are 3 prompts"):
        simulate(target, drafter, PROMPTS, keys=[("gsm8k", 0), ("gsm8k", 1)], **common)
    with pytest.raises(ValueError, match=r"keys must be \(benchmark, index\) pairs.*got 3"):
        simulate(target, drafter, PROMPTS, keys=[("gsm8k", 0), ("gsm8k", 1), 3], **common)

# --------------------------------------------------------------------------- settings
@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 0, r"DecodeSettings.max_new_tokens must be an int >= 1, got 0"),
    ("max_new_tokens", 8.0, r"DecodeSettings.max_new_tokens must be an int >= 1, got 8.0"),
    ("temperature", -0.5, r"DecodeSettings.temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    ("temperature", float("nan"), r"DecodeSettings.temperature .* got nan"),
    ("seed", "3", r"DecodeSettings.seed must be an int, got '3'"),
    ("eos_token_ids", 2, r"DecodeSettings.eos_token_ids must be a list of token ids or None, got 2"),
    ("eos_token_ids", [2, -1], r"DecodeSettings.eos_token_ids must hold token ids \(ints >= 0\), got \[2, -1\]"),
])
def test_decode_settings_name_the_bad_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        DecodeSettings(**{field: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy=""), r"ServeSettings.policy must be None, a non-empty spec"),
    (dict(policy=3), r"ServeSettings.policy must be None, .* got 3"),
    (dict(sps=[1, 2]), r"ServeSettings.sps must be an SPSTable or the path of its JSON .* got list"),
    (dict(sps="sps.json", price_sps=3), r"ServeSettings.price_sps must be an SPSTable or the path .* got int"),
    (dict(policy="static", concurrency=0), r"ServeSettings.concurrency must be an int >= 1, got 0"),
    (dict(concurrency=4), r"ServeSettings.concurrency=4 needs a policy"),
    (dict(draft_overhead="sometimes"), r"ServeSettings.draft_overhead must be .* got 'sometimes'"),
    (dict(sts_temperatures=[1.0, 0.0]), r"ServeSettings.sts_temperatures must be finite and > 0"),
])
def test_serve_settings_name_the_bad_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(**kwargs)


def test_settings_hold_their_values_in_a_canonical_form():
    assert DecodeSettings(eos_token_ids=[np.int64(2), 7]).eos_token_ids == (2, 7)
    assert ServeSettings(sts_temperatures=np.array([1.5, 0.5])).sts_temperatures == (1.5, 0.5)
    assert ServeSettings(sts_temperatures="sts.json").sts_temperatures == "sts.json"  # a path is read when used


def test_the_serving_loop_needs_a_policy_and_the_simulator_a_clock():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    with pytest.raises(ValueError, match="ServeSettings.policy is None; the serving loop needs"):
        run_requests(target, drafter, [Job(PROMPTS[0], 0)], decoding=DecodeSettings(max_new_tokens=4),
                     serving=ServeSettings())
    with pytest.raises(ValueError, match="ServeSettings.sps is None; simulate charges every step"):
        simulate(target, drafter, PROMPTS, decoding=DecodeSettings(max_new_tokens=4),
                 serving=ServeSettings(policy="static"))


def test_a_job_seed_is_derived_from_the_run_seed_and_the_request_index():
    for seed, index in ((0, 0), (4, 2), (980406, 1234), (2**62, 7)):
        assert job_seed(seed, index) == (seed * 1_000_003 + 7_919 * index + 1) % 2**63



def slowed(target, base: float = 0.02, per_token: float = 0.004):
    """``target`` with every forward held for ``base + per_token · (tokens in the input)`` seconds on
    the wall clock, so that verification costs dominate the tiny model's microsecond compute and its
    Python noise on a shared CPU: the SPS table and the decode loop then time the same known cost."""
    import time

    def hold(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        time.sleep(base + per_token * ids.numel())

    target.register_forward_pre_hook(hold, with_kwargs=True)
    return target


def slow_drafting(drafter, pause: float):
    """``drafter`` with every proposal held ``pause`` more seconds: drafting a known share of a round."""
    import time

    propose = drafter.propose

    def slow_propose(*args, **kwargs):
        time.sleep(pause)
        return propose(*args, **kwargs)

    drafter.propose = slow_propose
    return drafter


@pytest.mark.parametrize("policy", ["static", "algorithm1"])
def test_at_r_1_the_measured_sps_clock_agrees_with_the_wall_clock(policy):
    """R = 1 on a tiny target whose forwards take a known time growing with the tokens verified and
    a drafter whose proposals take a known time, an SPS table profiled for the target here: with
    draft_overhead="measured" the SPS clock's ratio to target-only decoding, Θ / SPS(1), matches
    the wall clock's decode-only speedup (tokens per second of the requests' phases but the
    prefill, against target-only decoding of the same prompts timed here, step = decode +
    sample); the overhead charged is exactly the measured non-verify time. Charging no overhead
    reads about 1.5x the wall clock here, outside the tolerance."""
    from dspark.scheduling.sps_profile import profile_sps

    target = slowed(make_tiny_target("llama"))
    drafter = slow_drafting(random_drafter(target, gamma=4), 0.02)  # half a verification: must be charged
    sps = profile_sps(target, [1, 2, 3, 4, 5], context_len=24, warmup=3, repeats=9)
    decoding = DecodeSettings(max_new_tokens=20, temperature=0.0, seed=0)
    serving = ServeSettings(policy=policy, sps=sps, draft_overhead="measured")
    simulate(target, drafter, PROMPTS[:1], decoding=decoding, serving=serving, cycle=False)  # warm-up
    sim = simulate(target, drafter, PROMPTS, decoding=decoding, serving=serving, cycle=False)
    wall = sum(v for req in sim.requests for k, v in req["timings"].items() if k not in ("prefill", "total"))
    verify = sum(req["timings"]["verify"] for req in sim.requests)
    assert sim.overhead_s == pytest.approx(wall - verify)
    base = [target_generate(target, p, max_new_tokens=20, temperature=0.0) for p in PROMPTS]
    step = sum(b.timings["decode"] + b.timings["sample"] for b in base) / sum(len(b.tokens) - 1 for b in base)
    wall_ratio = sim.tokens / wall * step
    sps_ratio = sim.throughput / sim.target_only_throughput
    assert sps_ratio == pytest.approx(wall_ratio, rel=0.2)  # wake-up latency and the drafter's compute on a busy CPU


def test_measured_overhead_is_charged_on_the_tables_time_scale():
    """The same greedy run priced by a table and by the same table twice as fast: time_scale is the
    table's price of the run's verification forwards over their measured seconds, every step costs
    1 / SPS(B) + overhead · time_scale, and the ratio to target-only decoding R·SPS(R) does not
    depend on the table's speed (without the scale the faster table would leave the measured
    drafting twice as heavy against it)."""
    from dspark.scheduling.sps_profile import profile_sps

    target = slowed(make_tiny_target("llama"))
    drafter = slow_drafting(random_drafter(target, gamma=4), 0.012)  # the scale's effect is plain
    sps = profile_sps(target, [1, 2, 3, 4, 5], context_len=24, warmup=3, repeats=9)
    fast = SPSTable(sps.sample_batch_tokens, [2 * x for x in sps.sample_steps_per_sec], sps.max_batch_tokens)
    decoding = DecodeSettings(max_new_tokens=24, temperature=0.0, seed=0)
    simulate(target, drafter, PROMPTS[:1], decoding=decoding,
             serving=ServeSettings(policy="static", sps=sps, draft_overhead="measured"), cycle=False)  # warm-up
    runs = [simulate(target, drafter, PROMPTS, decoding=decoding, cycle=False,
                     serving=ServeSettings(policy="static", sps=table, draft_overhead="measured"))
            for table in (sps, fast)]
    for run, table in zip(runs, (sps, fast)):
        assert run.time_scale == pytest.approx(run.verify_table_s / run.verify_s)
        assert run.verify_table_s == pytest.approx(sum(1 / table(1 + r["proposed"]) for r in run.rounds))
        assert run.sim_time_s == pytest.approx(sum(1 / table(row["batch_tokens"]) for row in run.step_log)
                                               + run.overhead_s * run.time_scale)
    assert runs[1].time_scale == pytest.approx(runs[0].time_scale / 2, rel=0.1)  # sleep overshoot
    ratios = [run.throughput / run.target_only_throughput for run in runs]
    assert ratios[1] == pytest.approx(ratios[0], rel=0.08)
    unscaled = [run.tokens / (run.sim_time_s - run.overhead_s * (run.time_scale - 1)) / run.target_only_throughput
                for run in runs]
    assert unscaled[1] < 0.85 * unscaled[0]
