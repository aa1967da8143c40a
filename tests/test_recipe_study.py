"""bench/recipe_study.py: each variant is its overrides on top of the study's pinned starting recipe
(whatever the demo config says), and its benchmark τ is paired against the baseline's on the same
requests (oracle: the hand-computed pooled τ ratio 8/7 of two small evaluations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.config import apply_overrides, load_config
from helpers.paths import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    return load_script("bench/recipe_study.py")


def _trained_config(study, tmp_path, monkeypatch, name):
    """The Config `dspark train` would build for variant ``name`` (its CLI call captured, not run)."""
    calls = []
    monkeypatch.setattr(study, "_dspark", lambda *cli: calls.append(cli))
    args = study.parse_args(["--out", str(tmp_path / "study"), "--data", "runs/x/data"])
    study.train(args, name, study.VARIANTS[name])
    (cli,) = calls
    assert cli[:3] == ("train", "--config", args.config)
    sets = list(cli[cli.index("--set") + 1:])
    return apply_overrides(load_config(ROOT / args.config), sets)


def test_the_base_is_the_pinned_recipe_whatever_the_demo_config_trains(study, tmp_path, monkeypatch):
    c = _trained_config(study, tmp_path, monkeypatch, "base")
    t = c.train
    assert (t.global_batch_size, t.micro_batch_size, t.epochs, t.eval_every, c.data.num_anchors) == (8, 4, 3.0, 8, 64)
    assert (t.max_wall_minutes, c.drafter.draft_vocab_size, str(c.data.data_dir)) == (4.5, 16384, "runs/x/data")


def test_a_variants_overrides_win_over_the_pinned_recipe(study, tmp_path, monkeypatch):
    c = _trained_config(study, tmp_path, monkeypatch, "b2a32")
    t = c.train
    assert (t.global_batch_size, t.micro_batch_size, t.epochs, c.data.num_anchors) == (2, 2, 5.0, 32)
    assert t.eval_every == 8  # not a lever: the same held-out looks as the base
    assert c.drafter.block_size == 7  # pinned: not the demo config's γ
    # The demo config is the g4v8 recipe.
    g4v8 = _trained_config(study, tmp_path / "g4v8", monkeypatch, "g4v8")
    demo = load_config(ROOT / "config" / "dspark" / "dspark_smollm2_135m.py")

    def recipe(c):
        return (c.train.global_batch_size, c.train.micro_batch_size, c.train.epochs, c.train.eval_every,
                c.data.num_anchors, c.drafter.block_size, c.drafter.draft_vocab_size)

    assert recipe(demo) == recipe(g4v8) == (2, 2, 20.0, 32, 16, 4, 8192)


def test_every_evaluation_of_a_study_reads_the_dev_prompts(study, tmp_path, monkeypatch):
    calls = []

    def dspark(*cli):
        calls.append(cli)
        out = Path(cli[cli.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "report.json").write_text(json.dumps({"config": {"split": cli[cli.index("--split") + 1]}}))

    monkeypatch.setattr(study, "_dspark", dspark)
    args = study.parse_args(["--out", str(tmp_path / "study")])
    assert args.split == "dev" and study.design(args)["split"] == "dev"
    study.evaluate(args, tmp_path / "study" / "base", 0.0)
    (cli,) = calls
    assert cli[0] == "eval" and cli[cli.index("--split") + 1] == "dev"


@pytest.mark.parametrize("split", ["test", "all"])
def test_a_study_refuses_any_split_but_dev(study, split):
    with pytest.raises(SystemExit, match=r"chooses recipes on the dev prompts and results are reported on test"):
        study.parse_args(["--split", split])


def test_an_evaluation_of_other_prompts_is_not_reused(study, tmp_path):
    """A variant's report.json from before the study read dev only (no split recorded: all) is refused."""
    out = tmp_path / "study" / "base" / "eval-T0.0"
    out.mkdir(parents=True)
    (out / "report.json").write_text(json.dumps({"gamma": 3}))
    with pytest.raises(SystemExit, match=r"'all' prompts, not 'dev'; delete that folder"):
        study.evaluate(study.parse_args(["--out", str(tmp_path / "study")]), tmp_path / "study" / "base", 0.0)


def _evaluation(folder: Path, accepted: dict[int, list[int]]) -> None:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"gamma": 3, "bootstrap": {"resamples": 200, "seed": 0},
                                                    "config": {"split": "dev"}}))
    (folder / "requests.jsonl").write_text("".join(
        json.dumps({"benchmark": "gsm8k", "request": r, "prompt_tokens": 10, "tokens": 10, "wall_s": 1.0}) + "\n"
        for r in accepted))
    (folder / "rounds.jsonl").write_text("".join(
        json.dumps({"benchmark": "gsm8k", "request": r, "round": i, "proposed": 3, "accepted": m}) + "\n"
        for r, ms in accepted.items() for i, m in enumerate(ms)))


def test_paired_tau_ratio_against_the_baseline_and_its_table_cell(study, tmp_path):
    out = tmp_path / "study"
    # τ pooled: A (2 + 1 + 4 + 1) / 4 rounds = 2, base (1 + 2 + 2 + 2) / 4 = 7/4: ratio 8/7.
    _evaluation(out / "mine" / "eval-T0.0", {0: [1, 0], 1: [3], 2: [0]})
    _evaluation(out / "base" / "eval-T0.0", {0: [0], 1: [1], 2: [1, 1]})
    paired = study.paired_summary(out / "mine", out / "base", 0.0)
    assert paired["ratio"] == pytest.approx(8 / 7) and paired["requests"] == 3
    assert paired["ci"][0] <= 8 / 7 <= paired["ci"][1]
    assert study.paired_summary(out / "base", out / "base", 0.0) is None  # the baseline itself
    assert study.paired_summary(out / "mine", out / "absent", 0.0) is None  # no baseline run
    bench = {"tau": 2.0, "tau_ci": [1.5, 2.5], "cond_accept": [0.5, None, None], "cond_accept_den": [4, 2, 0]}
    results = {"mine": {"sets": ["train.lr=2e-3"], "train": {"steps": 9, "minutes": 1.0, "heldout_tau_prob": 1.2},
                        "bench": {"0.0": dict(bench, paired=paired)}},
               "base": {"sets": [], "train": {"steps": 9, "minutes": 1.0, "heldout_tau_prob": None},
                        "bench": {"0.0": dict(bench, paired=None)}}}
    lines = study.table(results, [0.0], "base").splitlines()
    assert "τ / base T=0 [95 %, paired]" in lines[0]
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells[0] == "mine" and cells[6] == f"1.143 [{paired['ci'][0]:.3f}, {paired['ci'][1]:.3f}]"
    assert cells[7] == "0.50/–/– (4/2/0)"
    assert [c.strip() for c in lines[3].split("|")[1:-1]][6] == "–"


def test_one_variant_at_a_time_keeps_one_table_paired_against_the_current_baseline(study, tmp_path, monkeypatch):
    """`--only NAME` adds its row to the rows an earlier call wrote under the same design, and every
    row is re-paired against the baseline of the latest call; another design starts a new table."""
    import dspark.evaluation.plots as plots

    out = tmp_path / "study"
    _evaluation(out / "mine" / "eval-T0.0", {0: [1, 0], 1: [3], 2: [0]})
    _evaluation(out / "base" / "eval-T0.0", {0: [0], 1: [1], 2: [1, 1]})
    for name in ("mine", "base"):
        (out / name / "drafter").mkdir()
        (out / name / "drafter" / "config.json").write_text("{}")  # trained: train() skips it
    monkeypatch.setattr(study, "training_summary", lambda run: {"steps": 9, "minutes": 1.0, "heldout_tau_prob": 1.2})
    monkeypatch.setattr(study, "benchmark_summary", lambda report: {
        "tau": 2.0, "tau_ci": [1.5, 2.5], "cond_accept": [0.5, None, None], "cond_accept_den": [4, 2, 0]})
    monkeypatch.setattr(plots, "plot_learning_curves", lambda *a, **k: None)
    common = ["--out", str(out), "--variant", "mine=train.lr=2e-3"]

    def rows():
        return json.loads((out / "study.json").read_text())["results"]

    assert study.main([*common, "--only", "mine", "--baseline", "mine"]) == 0
    assert list(rows()) == ["mine"] and rows()["mine"]["bench"]["0.0"]["paired"] is None  # its own baseline
    assert study.main([*common, "--only", "base", "--baseline", "base"]) == 0
    kept = rows()
    assert list(kept) == ["mine", "base"] and kept["base"]["bench"]["0.0"]["paired"] is None
    assert kept["mine"]["bench"]["0.0"]["paired"]["ratio"] == pytest.approx(8 / 7)  # re-paired against base
    assert "| mine |" in (out / "study.md").read_text() and "| base |" in (out / "study.md").read_text()
    assert study.main([*common, "--only", "base", "--baseline", "base", "--minutes", "9"]) == 0
    assert list(rows()) == ["base"]  # another cap: a new table
