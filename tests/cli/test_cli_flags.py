"""The command line: every flag is a shorthand for one config field, and --config / --set reach every command."""

from __future__ import annotations

import dataclasses

import pytest

from dspark.cli.main import build_parser
from dspark.cli.flags import COMMANDS, FLAGS, flag_values
from dspark.config import Config, apply_overrides, get_key, load_config, set_values


def _config(argv: list[str]) -> Config:
    """What a command would run with, without running it (the cli's own resolution)."""
    args = build_parser().parse_args(argv)
    config = load_config(args.config)
    config = set_values(config, flag_values(args, args.command), parse=True)
    return apply_overrides(config, args.overrides)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_names_a_config_field_and_is_declared_once(command):
    keys = {f.name for f in dataclasses.fields(Config)}
    for flag, key in COMMANDS[command][1].items():
        assert flag in FLAGS
        get_key(Config(), key)  # raises on a wrong key
        assert key.split(".")[0] in keys


@pytest.mark.parametrize("command", ["train", "prepare", "cache", "eval", "simulate", "profile-sps", "calibrate", "propose"])
def test_every_model_command_takes_config_and_set(command, tmp_path):
    c = _config([command, "--config", "config/dspark/dspark_smollm2_135m.py", "--set", "seed=3", "threads=1"])
    assert (c.name, c.seed, c.threads) == ("dspark_smollm2_135m", 3, 1)


def test_eval_flags_set_their_fields():
    c = _config(["eval", "--target", "smollm2-135m", "--draft", "runs/x/drafter", "--benchmarks", "gsm8k", "mbpp,humaneval",
                 "--num-samples", "2", "--max-new-tokens", "16", "--temperature", "0", "--no-baseline", "--label", "7",
                 "--scheduler", "algorithm1", "--concurrency", "4", "--sps", "s.json", "--dtype", "float32",
                 "--trust-remote-code", "--out", "o", "--builtin-eval"])
    assert c.target.name_or_path == "smollm2-135m" and c.target.dtype == "float32" and c.target.trust_remote_code
    assert (c.eval.draft, c.eval.benchmarks, c.eval.num_samples, c.eval.max_new_tokens) == (
        "runs/x/drafter", ["gsm8k", "mbpp", "humaneval"], 2, 16)
    assert (c.eval.temperature, c.eval.baseline, c.eval.label, c.eval.out, c.eval.builtin_prompts) == (0.0, False, "7", "o", True)
    assert (c.serve.policy, c.serve.concurrency, c.serve.sps) == ("algorithm1", 4, "s.json")


def test_the_same_flag_sets_the_field_of_its_command():
    sim = _config(["simulate", "--concurrency", "1,4", "16", "--policy", "static1", "--max-new-tokens", "9",
                   "--no-cycle", "--out", "s"])
    assert (sim.serve.concurrencies, sim.serve.policies, sim.serve.max_new_tokens, sim.serve.cycle, sim.serve.out) == (
        [1, 4, 16], ["static1"], 9, False, "s")
    assert sim.eval.max_new_tokens == Config().eval.max_new_tokens
    cal = _config(["calibrate", "--rounds", "a.jsonl", "b.jsonl", "--seed", "5", "--out", "sts.json"])
    assert (cal.calibrate.rounds, cal.calibrate.seed, cal.calibrate.out, cal.eval.seed) == (["a.jsonl", "b.jsonl"], 5, "sts.json", Config().eval.seed)
    prof = _config(["profile-sps", "--batch-tokens", "1,2", "4", "--repeats", "2", "--out", "p.json"])
    assert (prof.profile.batch_tokens, prof.profile.repeats, prof.profile.out) == ([1, 2, 4], 2, "p.json")
    assert _config(["prepare", "--config", "config/dspark/dspark_smollm2_135m.py", "--no-cache"]).data.feature_mode == "online"
    assert _config(["train", "--resume"]).train.resume


def test_set_is_applied_after_the_flags():
    c = _config(["eval", "--temperature", "0.5", "--set", "eval.temperature=0.7"])
    assert c.eval.temperature == 0.7


def test_a_bad_flag_value_names_the_field():
    with pytest.raises(ValueError, match="eval.num_samples expects an integer"):
        _config(["eval", "--num-samples", "two"])
    with pytest.raises(ValueError, match="serve.concurrencies"):
        _config(["simulate", "--concurrency", "0"])
