"""The scheduling commands: `dspark calibrate`, `dspark eval --policy`, `dspark simulate`, `dspark profile-sps`.

Oracles: a synthetic round log with a known miscalibration (confidences twice as
sharp in logit space as the truth), the per-request verification-length hook of
``speculative_generate`` (a policy in the serving loop must reproduce it round
for round), and the files each command promises.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from helpers.targets import make_tiny_target
from dspark.scheduling.calibration import split_rounds_by_request
from dspark.scheduling.calibration_metrics import roc_auc
import dspark.evaluation.eval_plain as eval_plain
import dspark.evaluation.evaluate as ev
from dspark.cli.main import main
from dspark.decoding.loop import speculative_generate
from dspark.evaluation.evaluate import DecodeSettings, ServeSettings, evaluate
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.policies import per_request_policy
from helpers.decoding import random_drafter
from helpers.benchmarks import CharTokenizer, write_benchmarks
from helpers.paths import REPO, SHARED

ROOT = REPO
SHARED = SHARED / "eval_datasets"
SMOLLM2_CONFIG = ROOT / "config" / "dspark" / "dspark_smollm2_135m.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPS = SPSTable(list(range(1, 33)), [100.0 / b**0.6 for b in range(1, 33)], 32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def no_warmup(monkeypatch):
    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)


# --------------------------------------------------------------------------- calibrate
def synthetic_rounds(num_requests: int = 240, rounds_each: int = 8, gamma: int = 3, seed: int = 0) -> list[dict]:
    """Rounds whose true conditional acceptance is p_k ~ U(0.1, 0.95) and whose confidences are
    σ(2·logit p_k): overconfident, so STS should find T ≈ 2. One round in four verifies fewer drafts."""
    rng = np.random.default_rng(seed)
    rows = []
    for request in range(num_requests):
        bench = "gsm8k" if request % 2 else "alpaca"
        for r in range(rounds_each):
            p = rng.uniform(0.1, 0.95, size=gamma)
            conf = 1 / (1 + np.exp(-2 * np.log(p / (1 - p))))
            proposed = gamma if r % 4 else int(rng.integers(1, gamma + 1))
            accepted = 0
            while accepted < proposed and rng.random() < p[accepted]:
                accepted += 1
            rows.append({"benchmark": bench, "request": request // 2, "round": r, "proposed": proposed,
                         "accepted": accepted, "confidences": conf.tolist()})
    return rows


def test_calibrate_lowers_held_out_ece_and_keeps_the_ranking(tmp_path, capsys):
    rounds = tmp_path / "rounds.jsonl"
    rounds.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rounds()))
    out = tmp_path / "sts" / "sts.json"
    assert main(["calibrate", "--rounds", str(rounds), "--out", str(out), "--fit-fraction", "0.5", "--seed", "1"]) == 0
    data = json.loads(out.read_text())
    assert {"temperatures", "ece_before", "ece_after", "per_position", "split", "evaluated_on"} <= set(data)
    assert data["evaluated_on"] == "test"
    assert data["split"]["fit_requests"] == data["split"]["test_requests"] == 120  # requests, not rounds
    assert len(data["temperatures"]) == 3 and 1.6 < data["temperatures"][0] < 2.5
    test = data["per_position"]["test"]
    assert test["after"][0]["brier"] < test["before"][0]["brier"]
    assert data["ece_after"][0] < data["ece_before"][0] / 2
    for k in range(3):
        assert data["ece_after"][k] < data["ece_before"][k]
        # STS is monotone per position: the AUROC of each c_k cannot move
        assert test["conditional_after"][k]["auroc"] == pytest.approx(test["conditional_before"][k]["auroc"], abs=1e-12)
    assert test["after"][0]["auroc"] == pytest.approx(test["before"][0]["auroc"], abs=1e-12)  # a_1 = c_1
    assert (tmp_path / "sts" / "sts_reliability.png").read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "| 3 |" in printed and "AUROC" in printed


def test_the_conditional_auroc_is_that_of_c_k_on_rounds_that_reached_k():
    rows = synthetic_rounds(num_requests=40)
    from dspark.scheduling.calibration_metrics import conditional_metrics

    conf = np.array([r["confidences"] for r in rows])
    m = np.array([r["accepted"] for r in rows])
    ell = np.array([r["proposed"] for r in rows])
    reached = (ell >= 2) & (m >= 1)
    assert conditional_metrics(conf, m, ell)[1]["auroc"] == pytest.approx(roc_auc(conf[reached, 1], m[reached] >= 2))


def test_the_split_keeps_each_request_on_one_side():
    rows = synthetic_rounds(num_requests=20, rounds_each=3)
    fit, test = split_rounds_by_request(rows, 0.25, seed=4)
    key = lambda r: (r["benchmark"], r["request"])  # noqa: E731
    assert len({key(r) for r in fit}) == 5 and len({key(r) for r in test}) == 15
    assert not {key(r) for r in fit} & {key(r) for r in test}
    assert len(fit) + len(test) == len(rows)
    assert split_rounds_by_request(rows, 0.25, seed=4) == (fit, test)  # seeded


# --------------------------------------------------------------------------- eval --policy
DECODING = DecodeSettings(max_new_tokens=12, temperature=1.0, seed=3, eos_token_ids=[0])


def rounds_of(folder: Path, keys=("benchmark", "request", "round", "proposed", "accepted", "confidences")):
    return [{k: json.loads(line)[k] for k in keys} for line in (folder / "rounds.jsonl").read_text().splitlines()]


def test_eval_through_the_serving_loop_reproduces_the_per_request_hook(tmp_path, monkeypatch, no_warmup):
    """A static ℓ = 2 policy at concurrency 2 gives the very rounds that
    speculative_generate gives with choose_length = 2: same seeds, same code path per request."""
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0"]})
    common = dict(decoding=DECODING, progress=False, tokenizer=CharTokenizer())
    served = evaluate(target, drafter, files, serving=ServeSettings(policy="static:2", concurrency=2),
                      out_dir=tmp_path / "served", **common)
    monkeypatch.setattr(eval_plain, "speculative_generate", functools.partial(speculative_generate, choose_length=lambda c, i: 2))
    plain = evaluate(target, drafter, files, out_dir=tmp_path / "plain", **common)
    rows = [rounds_of(tmp_path / d) for d in ("plain", "served")]
    assert rows[0] == rows[1] and {r["proposed"] for r in rows[1]} == {2}
    assert served["all"]["tau"] == plain["all"]["tau"]
    assert served["config"]["scheduler"] == "static:2 (serving loop, R = 2)"
    assert set(served["serving"]) == {"gsm8k", "mbpp"}
    assert all("baseline_tokens" in json.loads(line) for line in (tmp_path / "served" / "requests.jsonl").open())


def test_a_per_request_hook_as_a_policy_gives_the_rounds_of_speculative_generate(tmp_path, monkeypatch, no_warmup):
    """ℓ = (round + 1) mod 4 per request, in lockstep at R = 3 through per_request_policy, and one
    request at a time through speculative_generate's own hook: the same rounds."""
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0", "m1"]})
    hook = lambda confidences, round_index: (round_index + 1) % 4  # noqa: E731
    common = dict(decoding=DECODING, progress=False, tokenizer=CharTokenizer(), baseline=False)
    evaluate(target, drafter, files, serving=ServeSettings(policy=per_request_policy(hook), concurrency=3),
             out_dir=tmp_path / "served", **common)
    monkeypatch.setattr(eval_plain, "speculative_generate", functools.partial(speculative_generate, choose_length=hook))
    evaluate(target, drafter, files, out_dir=tmp_path / "plain", **common)
    rows = [rounds_of(tmp_path / d) for d in ("plain", "served")]
    assert rows[0] == rows[1] and {r["proposed"] for r in rows[1]} == {0, 1, 2, 3}


def test_eval_with_algorithm1_reads_the_sps_and_sts_files(tmp_path, no_warmup):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    SPS.to_json(tmp_path / "sps.json")
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.5, 1.0, 0.8]}))
    serving = ServeSettings(policy="algorithm1", sps=tmp_path / "sps.json", sts_temperatures=tmp_path / "sts.json",
                            concurrency=3)
    report = evaluate(target, drafter, write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"]}),
                      decoding=DecodeSettings(max_new_tokens=16, seed=0, eos_token_ids=[0]), serving=serving,
                      progress=False, baseline=False, tokenizer=CharTokenizer(), out_dir=tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    assert len({r["proposed"] for r in rows}) >= 2 and all(0 <= r["proposed"] <= 3 for r in rows)
    assert report["config"]["sps"] == SPS.to_dict()
    assert report["serving"]["gsm8k"]["throughput"] > 0
    steps = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r)
    assert all(rs[0]["batch_tokens"] == sum(1 + r["proposed"] for r in rs) for rs in steps.values())


def test_eval_checks_the_policy_before_decoding_anything(tmp_path, monkeypatch):
    target = make_tiny_target("llama")
    monkeypatch.setattr(eval_plain, "speculative_generate", lambda *a, **k: pytest.fail("decoded before the check"))
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0"]})
    with pytest.raises(ValueError, match="'algorithm1' needs an SPS table"):
        evaluate(target, random_drafter(target, gamma=3), files, serving=ServeSettings(policy="algorithm1"),
                 tokenizer=CharTokenizer(), progress=False)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        evaluate(target, random_drafter(target, gamma=3), files, serving=ServeSettings(policy="fastest"),
                 tokenizer=CharTokenizer(), progress=False)


USER_POLICIES = """
import numpy as np


def verify_two(request_ids, confidences):
    return np.full(len(request_ids), min(2, confidences.shape[1]), dtype=np.int64)
"""


def test_simulate_runs_a_users_module_function_policy(tmp_path, monkeypatch, capsys):
    """`dspark simulate --policy module:function` (the module on sys.path) serves every request under the
    user's function, named by its __name__ in the results, next to a built-in policy."""
    import sys

    import dspark.build

    (tmp_path / "dspark_cli_user_policies.py").write_text(USER_POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = make_tiny_target("llama")
    target.tokenizer = CharTokenizer()
    drafter = random_drafter(target, gamma=3)
    monkeypatch.setattr(dspark.build, "load_models", lambda config: (target, drafter, "a random drafter"))
    write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1"], "mbpp": ["m0"]})
    SPS.to_json(tmp_path / "sps.json")
    try:
        assert main(["simulate", "--data-dir", str(tmp_path / "data"), "--benchmarks", "gsm8k", "mbpp",
                     "--num-prompts", "2", "--concurrency", "1,2", "--max-new-tokens", "8", "--engine", "per-request",
                     "--policy", "dspark_cli_user_policies:verify_two", "static1", "--sps", str(tmp_path / "sps.json"),
                     "--threads", "1", "--out", str(tmp_path / "sim")]) == 0
    finally:
        sys.modules.pop("dspark_cli_user_policies", None)
    results = json.loads((tmp_path / "sim" / "results.json").read_text())["results"]
    assert [(r["policy"], r["concurrency"]) for r in results] == [
        ("verify_two", 1), ("verify_two", 2), ("static1", 1), ("static1", 2)]
    rounds = [json.loads(line) for line in (tmp_path / "sim" / "rounds.jsonl").read_text().splitlines()]
    mine = [r for r in rounds if r["policy"] == "verify_two"]
    assert mine and {r["proposed"] for r in mine if not r["eos_accepted"]} == {2}
    assert "verify_two" in capsys.readouterr().out


def test_scheduled_eval_reports_speed_mean_length_and_draft_cost_in_target_steps(tmp_path, no_warmup):
    """report["scheduled"] against the records: draft cost = draft seconds per drafted round over the
    target-only step (forward + sampling seconds per forward); skipped rounds are marked in rounds.jsonl."""
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3)
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0", "m1"]})
    report = evaluate(target, drafter, files, serving=ServeSettings(policy="algorithm1+skip", sps=SPS, concurrency=2),
                      decoding=DecodeSettings(max_new_tokens=16, seed=0, eos_token_ids=[0]), progress=False,
                      tokenizer=CharTokenizer(), out_dir=tmp_path / "out")
    records = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    rounds = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    s = report["scheduled"]
    drafted = [r for r in rounds if r["drafted"]]
    assert all(r["proposed"] == 0 and r["confidences"] is None for r in rounds if not r["drafted"])
    step = (sum(r["baseline_timings"]["decode"] + r["baseline_timings"]["sample"] for r in records)
            / sum(r["baseline_tokens"] - 1 for r in records))
    draft = sum(r["timings"]["draft"] for r in records) / len(drafted)
    assert s["policy"] == "algorithm1+skip" and s["concurrency"] == 2
    assert s["target_step_basis"] == "target-only decode" and s["target_step_s"] == pytest.approx(step)
    assert s["draft_cost_steps"] == pytest.approx(draft / step)
    assert s["mean_verified"] == pytest.approx(np.mean([r["proposed"] for r in rounds]))
    assert s["skipped_rounds"] == len(rounds) - len(drafted) and s["speedup"] == report["all"]["speedup"]
    assert s["round_cost_steps"] > s["draft_cost_steps"] > 0
    assert "## Scheduled verification" in (tmp_path / "out" / "report.md").read_text()


def test_scheduled_summary_and_table_equal_hand_computed_costs():
    """Target step t = (0.9 + 0.1 + 0.45 + 0.05) s / (10 + 5) forwards = 0.1 s. Draft: 0.6 s over 4 drafted
    rounds = 0.15 s = 1.5 steps; a round: 2.6 s over 6 rounds = 4.33 steps; mean ℓ = 6 / 6."""
    from dspark.evaluation.scheduled_report import scheduled_summary, scheduling_table

    records = [
        {"timings": {"prefill": 1.0, "draft": 0.2, "verify": 0.6, "accept": 0.1, "bookkeeping": 0.1, "total": 2.0},
         "baseline_tokens": 11, "baseline_timings": {"prefill": 1.0, "decode": 0.9, "sample": 0.1}},
        {"timings": {"prefill": 1.0, "draft": 0.4, "verify": 1.0, "accept": 0.2, "total": 2.6},
         "baseline_tokens": 6, "baseline_timings": {"prefill": 1.0, "decode": 0.45, "sample": 0.05}},
    ]
    rounds = [{"proposed": p, "drafted": d} for p, d in
              zip([2, 1, 0, 3, 0, 0], [True, True, True, True, False, False])]
    pooled = {"tokens_per_s": 10.0, "baseline_tokens_per_s": 20.0, "speedup": 0.5, "decode_speedup": 0.45, "tau": 1.2}
    s = scheduled_summary(records, rounds, pooled, policy="algorithm1+skip", concurrency=1, sps_step_s=0.5)
    assert s["target_step_s"] == pytest.approx(0.1) and s["target_step_basis"] == "target-only decode"
    assert s["draft_s_per_round"] == pytest.approx(0.15) and s["draft_cost_steps"] == pytest.approx(1.5)
    assert s["round_cost_steps"] == pytest.approx(2.6 / 6 / 0.1)
    assert (s["mean_verified"], s["skipped_rounds"], s["skip_rate"]) == (1.0, 2, pytest.approx(1 / 3))
    assert "| algorithm1+skip | 1 | 10.0 | 20.0 | 0.50 | 0.45 | 1.20 | 1.00 | 0.33 | 150.0 | 1.50 | 4.33 |" \
        in scheduling_table([s])


def test_scheduled_eval_without_baseline_measures_the_step_on_the_sps_table(tmp_path, no_warmup):
    target = make_tiny_target("llama")
    report = evaluate(target, random_drafter(target, gamma=3), write_benchmarks(tmp_path / "d", {"gsm8k": ["g0"]}),
                      serving=ServeSettings(policy="static1", sps=SPS),
                      decoding=DecodeSettings(max_new_tokens=8, eos_token_ids=[0]), progress=False, baseline=False,
                      tokenizer=CharTokenizer())
    assert report["scheduled"]["target_step_basis"] == "SPS(1)"
    assert report["scheduled"]["target_step_s"] == pytest.approx(1 / SPS(1))


# --------------------------------------------------------------------------- the CLI on SmolLM2
@pytest.fixture
def reuse_smollm2(monkeypatch, smollm2_target):
    """Let the commands' TargetModel.from_pretrained("smollm2-135m", ids) reuse the loaded weights."""
    from dspark.target import TargetModel

    def from_pretrained(name, target_layer_ids, **kwargs):
        assert name == "smollm2-135m"
        return TargetModel(smollm2_target.model, target_layer_ids, tokenizer=smollm2_target.tokenizer)

    monkeypatch.setattr(TargetModel, "from_pretrained", staticmethod(from_pretrained))
    return smollm2_target


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/eval_datasets")
def test_eval_and_simulate_commands_run_end_to_end_on_smollm2(reuse_smollm2, tmp_path, capsys, monkeypatch):
    from dspark.build import build_drafter
    from dspark.config import load_config
    from dspark.modeling import save_drafter

    config = load_config(str(SMOLLM2_CONFIG))
    save_drafter(build_drafter(config, reuse_smollm2), tmp_path / "drafter")
    SPS.to_json(tmp_path / "sps.json")
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.2] * config.drafter.block_size}))
    common = ["--target", "smollm2-135m", "--data-dir", str(SHARED), "--benchmarks", "gsm8k", "--seed", "294",
              "--max-new-tokens", "4", "--sps", str(tmp_path / "sps.json"), "--sts", str(tmp_path / "sts.json")]

    assert main(["eval", "--draft", str(tmp_path / "drafter"), "--num-samples", "2", "--policy", "algorithm1",
                 "--concurrency", "2", "--no-baseline", "--out", str(tmp_path / "eval"), *common]) == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["config"]["scheduler"] == "algorithm1 (serving loop, R = 2)"
    assert report["benchmarks"]["gsm8k"]["num_requests"] == 2
    rounds = [json.loads(line) for line in (tmp_path / "eval" / "rounds.jsonl").read_text().splitlines()]
    gamma = config.drafter.block_size
    assert rounds and all(len(r["confidences"]) == gamma and 0 <= r["proposed"] <= gamma for r in rounds)

    assert main(["simulate", "--config", str(SMOLLM2_CONFIG), "--num-prompts", "2", "--concurrency", "1,2",
                 "--policy", "algorithm1,async", "static1", "algorithm1+skip", "--draft-overhead", "measured",
                 "--out", str(tmp_path / "sim"), *common]) == 0
    data = json.loads((tmp_path / "sim" / "results.json").read_text())
    cells = [(r["policy"], r["concurrency"]) for r in data["results"]]
    assert cells == [(p, r) for p in ("algorithm1", "async", "static1", "algorithm1+skip") for r in (1, 2)]
    assert all(r["throughput"] > 0 and r["tau"] >= 1 for r in data["results"])
    assert all(r["draft_clock"] == "measured" and r["draft_cost_steps"] > 0 for r in data["results"])
    assert data["config"]["draft_overhead"] == "measured"
    assert data["config"]["sts_temperatures"] == [1.2] * gamma
    for name in ("results.md", "rounds.jsonl", "figure8.png", "frontier.png"):
        assert (tmp_path / "sim" / name).is_file()
    assert "| static1 | 2 |" in capsys.readouterr().out
    # Served R by R; every cell has its τ interval over its requests.
    served = [json.loads(line) for line in (tmp_path / "sim" / "cells.jsonl").read_text().splitlines()]
    assert [(c["policy"], c["concurrency"]) for c in served] == [
        (p, r) for r in (1, 2) for p in ("algorithm1", "async", "static1", "algorithm1+skip")]
    assert all(r["tau_ci"][0] <= r["tau"] <= r["tau_ci"][1] for r in data["results"])
    # Each request's share of the steps, as the target-only decode records it: the cell's tokens and seconds.
    for c in served:
        assert sum(r["step_tokens"] for r in c["requests"]) == c["tokens"]
        assert sum(r["step_s"] for r in c["requests"]) == pytest.approx(c["step_wall_s"])

    # A simulation killed before its last cell was committed serves only that cell again, with the
    # rounds of an uninterrupted run.
    sim = tmp_path / "sim"
    full_rounds = (sim / "rounds.jsonl").read_text()
    cells_file = sim / "cells.jsonl"
    committed = cells_file.read_text().splitlines(keepends=True)
    cells_file.write_text("".join(committed[:-1]))
    last = json.loads(committed[-1])
    kept = [r for r in full_rounds.splitlines(keepends=True)
            if not (json.loads(r).get("policy") == last.get("policy") and json.loads(r).get("concurrency") == last.get("concurrency"))]
    (sim / "rounds.jsonl").write_text("".join(kept))
    import dspark.scheduling.simulator as simulator

    calls = []
    real_grid = simulator.simulate_grid
    monkeypatch.setattr(simulator, "simulate_grid", lambda *a, **k: calls.append(k["policies"]) or real_grid(*a, **k))
    assert main(["simulate", "--config", str(SMOLLM2_CONFIG), "--num-prompts", "2", "--concurrency", "1,2",
                 "--policy", "algorithm1,async", "static1", "algorithm1+skip", "--draft-overhead", "measured",
                 "--out", str(sim), *common]) == 0
    assert calls == [["algorithm1+skip"]]
    assert sorted((sim / "rounds.jsonl").read_text().splitlines()) == sorted(full_rounds.splitlines())
    again = json.loads((sim / "results.json").read_text())
    assert [(r["policy"], r["concurrency"], r["tau"], r["tau_ci"]) for r in again["results"]] == [
        (r["policy"], r["concurrency"], r["tau"], r["tau_ci"]) for r in data["results"]]

    # `dspark report` rebuilds an evaluation's report from its files, without decoding.
    (tmp_path / "eval" / "report.json").unlink()
    assert main(["report", str(tmp_path / "eval")]) == 0
    rebuilt = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert rebuilt["all"]["tau"] == report["all"]["tau"] and rebuilt["benchmarks"]["gsm8k"]["num_requests"] == 2


def test_profile_sps_command_writes_the_table_the_timings_and_the_plot(tmp_path, monkeypatch, capsys):
    from dspark.target import TargetModel

    tiny = make_tiny_target("llama")
    monkeypatch.setattr(TargetModel, "from_pretrained",
                        staticmethod(lambda name, ids, **kw: TargetModel(tiny.model, ids)))
    out = tmp_path / "sps.json"
    assert main(["profile-sps", "--target", "tiny", "--out", str(out), "--batch-tokens", "1,2", "4",
                 "--context-len", "16", "--warmup", "0", "--repeats", "2", "--threads", "1"]) == 0
    assert SPSTable.from_json(out).sample_batch_tokens == (1, 2, 4)
    assert json.loads((tmp_path / "sps.profile.json").read_text())["repeats"] == 2
    assert (tmp_path / "sps.png").read_bytes()[:8] == PNG_MAGIC
    assert "load average" in capsys.readouterr().out
