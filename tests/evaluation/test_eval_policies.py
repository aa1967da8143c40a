"""Several verification-length policies evaluated together (``evaluate_policies``, ``dspark eval --policy A B``).

Oracles: the evaluation of each policy on its own (same seeds: the same rounds and tokens per
request), the count of target-only decodes (one per benchmark, whatever the number of policies) and
of prompt prefills (one per prompt on the batched engine, where the decodes advance in turn), and
a run killed mid-way, which a rerun finishes to the rounds of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import dspark.evaluation.eval_scheduled as eval_scheduled
import dspark.evaluation.evaluate as ev
from dspark.decoding.prefill_store import PrefillStore
from dspark.evaluation.evaluate import DecodeSettings, ServeSettings, evaluate, evaluate_policies, policy_folder
from dspark.scheduling.algorithm1 import SPSTable
from helpers.benchmarks import CharTokenizer, write_benchmarks
from helpers.decoding import random_drafter
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SPS = SPSTable(list(range(1, 33)), [100.0 / b**0.6 for b in range(1, 33)], 32)
POLICIES = ["static", "static1", "algorithm1"]
DECODING = DecodeSettings(max_new_tokens=10, seed=3, eos_token_ids=[0])
SERVING = ServeSettings(policy="static", sps=SPS, concurrency=2, engine="batched")  # R and the table: every policy's


@pytest.fixture
def no_warmup(monkeypatch):
    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)


@pytest.fixture(scope="module")
def models():
    target = make_tiny_target("llama")
    return target, random_drafter(target, gamma=3)


def _files(tmp_path: Path) -> dict:
    return write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "g2"], "mbpp": ["m0", "m1"]})


def _rows(folder: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (folder / name).read_text().splitlines()]


def _together(models, files, out, serving=SERVING, **kwargs):
    target, drafter = models
    return evaluate_policies(target, drafter, files, POLICIES, serving=serving,
                             decoding=DECODING, progress=False, tokenizer=CharTokenizer(), out_dir=out, **kwargs)


def _decisions(rows: list[dict]) -> list[tuple]:
    return [(r["benchmark"], r["request"], r["round"], r["proposed"], r["accepted"]) for r in rows]


@pytest.mark.parametrize("engine", ["batched", "per-request"])
def test_policies_evaluated_together_decode_what_each_decodes_alone_against_one_target_only_decode(
        models, tmp_path, no_warmup, monkeypatch, engine):
    import dspark.decoding.prefill_store as prefill_store
    from dspark.scheduling import batched_serving

    calls, turns = [], []
    single, together = eval_scheduled.run_baseline, batched_serving.interleaved

    class CountedRun(batched_serving.TargetOnlyRun):
        def __init__(self, target, jobs, **kwargs):
            calls.append(len(jobs))
            super().__init__(target, jobs, **kwargs)

    def recorded(runs):  # which decodes advance, in which order
        for run in runs:
            real = run.advance
            run.advance = lambda real=real, run=run: turns.append(runs.index(run)) or real()
        together(runs)

    monkeypatch.setattr(batched_serving, "TargetOnlyRun", CountedRun)
    monkeypatch.setattr(batched_serving, "interleaved", recorded)
    monkeypatch.setattr(eval_scheduled, "run_baseline", lambda *a, **k: calls.append(1) or single(*a, **k))
    stores = []

    class Counted(PrefillStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            stores.append(self)

    monkeypatch.setattr(eval_scheduled, "PrefillStore", Counted)
    monkeypatch.setattr(prefill_store, "PrefillStore", Counted)
    files = _files(tmp_path)
    serving = dataclasses.replace(SERVING, engine=engine)
    reports = _together(models, files, tmp_path / "sched", serving=serving)
    for module, name, value in ((batched_serving, "TargetOnlyRun", CountedRun.__base__),
                                (batched_serving, "interleaved", together), (eval_scheduled, "run_baseline", single),
                                (eval_scheduled, "PrefillStore", PrefillStore),
                                (prefill_store, "PrefillStore", PrefillStore)):
        monkeypatch.setattr(module, name, value)
    # one target-only decode of each benchmark's requests for the three policies (each request alone: 1 each)
    assert calls == ([3, 2] if engine == "batched" else [1] * 5)
    if engine == "batched":  # the three policies and target-only decoding (run 3) advanced in turn
        assert set(turns) == {0, 1, 2, 3}
        first_done = min(max(i for i, t in enumerate(turns) if t == run) for run in range(4))
        assert len(set(turns[:first_done])) == 4  # every decode stepped before any of them finished
    else:
        assert turns == []
    assert list(reports) == POLICIES
    baselines = None
    for policy in POLICIES:
        folder = tmp_path / "sched" / f"{policy}-R2"
        alone = evaluate(*models, files, serving=dataclasses.replace(serving, policy=policy),
                         decoding=DECODING, progress=False, tokenizer=CharTokenizer(), out_dir=tmp_path / policy)
        assert _decisions(_rows(folder, "rounds.jsonl")) == _decisions(_rows(tmp_path / policy, "rounds.jsonl"))
        records = _rows(folder, "requests.jsonl")
        assert [r["tokens"] for r in records] == [r["tokens"] for r in _rows(tmp_path / policy, "requests.jsonl")]
        mine = [(r["baseline_tokens"], r["baseline_wall_s"]) for r in records]
        assert baselines is None or mine == baselines  # every policy's records carry the same baseline
        baselines = mine
        report = json.loads((folder / "report.json").read_text())
        assert report["label"] == policy == reports[policy]["label"]
        assert report["config"]["scheduler"] == f"{policy} (serving loop, R = 2)"
        assert report["all"]["tau"] == pytest.approx(alone["all"]["tau"])
        assert report["scheduled"]["speedup"] == pytest.approx(report["all"]["speedup"])
    # batched: one store per benchmark, each prompt prefilled once for the three policies and target-only
    # decoding; per-request: every policy prefilled the prompts itself (the engine keeps none)
    misses_hits = [(3, 9), (2, 6)] if engine == "batched" else [(0, 0)] * 6
    assert [(store.misses, store.hits) for store in stores] == misses_hits


def test_a_killed_run_of_several_policies_finishes_to_the_rounds_of_an_uninterrupted_one(
        models, tmp_path, no_warmup, monkeypatch):
    from dspark.scheduling import batched_serving

    files = _files(tmp_path)
    _together(models, files, tmp_path / "whole")
    real, served = batched_serving.interleaved, []

    def dies_in_the_second_benchmark(runs):  # gsm8k served whole; killed after six steps of mbpp's decodes
        served.append(len(runs))
        if len(served) == 2:
            for _ in range(6):
                min(runs, key=lambda r: r.emitted).advance()
            raise KeyboardInterrupt
        real(runs)

    monkeypatch.setattr(batched_serving, "interleaved", dies_in_the_second_benchmark)
    with pytest.raises(KeyboardInterrupt):
        _together(models, files, tmp_path / "killed")
    monkeypatch.setattr(batched_serving, "interleaved", real)
    assert served == [4, 4]
    _together(models, files, tmp_path / "killed")
    for policy in POLICIES:
        done, whole = tmp_path / "killed" / f"{policy}-R2", tmp_path / "whole" / f"{policy}-R2"
        assert _decisions(_rows(done, "rounds.jsonl")) == _decisions(_rows(whole, "rounds.jsonl"))
        assert [r["tokens"] for r in _rows(done, "requests.jsonl")] == \
            [r["tokens"] for r in _rows(whole, "requests.jsonl")]


def test_a_finished_policys_folder_is_read_back_and_only_a_new_policy_decodes(models, tmp_path, no_warmup,
                                                                              monkeypatch):
    files = _files(tmp_path)
    target, drafter = models
    evaluate_policies(target, drafter, files, POLICIES[:2], serving=SERVING,
                      decoding=DECODING, progress=False, tokenizer=CharTokenizer(), out_dir=tmp_path / "sched")
    real, served = eval_scheduled._serve_together, []

    def recorded(states, todo, jobs, name):
        served.append((name, [states[k].serving.policy for k in todo]))
        return real(states, todo, jobs, name)

    monkeypatch.setattr(eval_scheduled, "_serve_together", recorded)
    _together(models, files, tmp_path / "sched")
    assert served == [("gsm8k", ["algorithm1"]), ("mbpp", ["algorithm1"])]


def test_the_policies_are_checked_before_decoding_and_named_once(models, tmp_path):
    target, drafter = models
    files = _files(tmp_path)
    with pytest.raises(ValueError, match="policies is empty"):
        evaluate_policies(target, drafter, files, [], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match=r"name a policy twice"):
        evaluate_policies(target, drafter, files, ["static", " static"], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="unknown policy 'nonsense'"):
        evaluate_policies(target, drafter, files, ["static", "nonsense"], tokenizer=CharTokenizer(),
                          out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_policys_folder_name_keeps_letters_digits_and_plus_and_replaces_the_rest():
    assert policy_folder("algorithm1+skip", 1) == "algorithm1+skip-R1"
    assert policy_folder("threshold:0.5", 8) == "threshold_0.5-R8"
    assert policy_folder("my.module:choose", 4) == "my.module_choose-R4"


def test_dspark_eval_with_several_policies_writes_a_rerunnable_config_per_policy(models, tmp_path, no_warmup):
    from dspark.config import Config, EvalConfig, ServeConfig, load_config
    from dspark.evaluation.eval_config import evaluate_from_config

    files = _files(tmp_path)
    SPS.to_json(tmp_path / "sps.json")
    config = Config(eval=EvalConfig(data_dir=str(tmp_path / "data"), benchmarks=["gsm8k"], max_new_tokens=6,
                                    out=str(tmp_path / "sched")),
                    serve=ServeConfig(policy=["static", "threshold:0.5"], sps=str(tmp_path / "sps.json")))
    target, drafter = models
    reports = evaluate_from_config(target, drafter, config, tokenizer=CharTokenizer(), progress=False)
    assert list(reports) == ["static", "threshold:0.5"]
    assert files["gsm8k"].is_file()
    for policy, folder in (("static", "static-R1"), ("threshold:0.5", "threshold_0.5-R1")):
        single = load_config(tmp_path / "sched" / folder / "config.json")
        assert single.serve.policy == [policy] and single.eval.label == policy
        assert Path(single.eval.out) == tmp_path / "sched" / folder
        assert (tmp_path / "sched" / folder / "report.md").is_file()
