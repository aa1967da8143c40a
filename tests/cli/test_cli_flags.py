"""The command line: every flag is a shorthand for one config field, and --config / --set reach every command."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from dspark.cli.main import build_parser
from dspark.cli.flags import COMMANDS, FLAGS, flag_values
from dspark.config import SIMULATE_POLICIES, Config, ServeConfig, apply_overrides, load_config, set_values
from dspark.config_fields import get_key


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
                 "--policy", "algorithm1", "--concurrency", "4", "--sps", "s.json", "--dtype", "float32",
                 "--trust-remote-code", "--out", "o", "--builtin-eval"])
    assert c.target.name_or_path == "smollm2-135m" and c.target.dtype == "float32" and c.target.trust_remote_code
    assert (c.eval.draft, c.eval.benchmarks, c.eval.num_samples, c.eval.max_new_tokens) == (
        "runs/x/drafter", ["gsm8k", "mbpp", "humaneval"], 2, 16)
    assert (c.eval.temperature, c.eval.baseline, c.eval.label, c.eval.out, c.eval.builtin_prompts) == (0.0, False, "7", "o", True)
    assert (c.serve.policy, c.serve.concurrency, c.serve.sps) == (["algorithm1"], 4, "s.json")


def test_the_same_flag_sets_the_field_of_its_command():
    sim = _config(["simulate", "--concurrency", "1,4", "16", "--policy", "static1,async", "algorithm1",
                   "--max-new-tokens", "9", "--no-cycle", "--out", "s"])
    assert (sim.serve.concurrencies, sim.serve.policy, sim.serve.max_new_tokens, sim.serve.cycle, sim.serve.out) == (
        [1, 4, 16], ["static1", "async", "algorithm1"], 9, False, "s")
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


def test_repeated_set_flags_add_up_and_the_last_value_of_a_key_wins():
    c = _config(["prepare", "--set", "data.data_dir=d1", "seed=3", "--set", "data.train_prompts=builtin+self:4",
                 "--set", "data.data_dir=d2"])
    assert (c.data.data_dir, c.data.train_prompts, c.seed) == ("d2", "builtin+self:4", 3)
    assert _config(["prepare"]).data.data_dir == Config().data.data_dir  # the default list is not shared


def test_a_bad_flag_value_names_the_field():
    with pytest.raises(ValueError, match="eval.num_samples expects an integer"):
        _config(["eval", "--num-samples", "two"])
    with pytest.raises(ValueError, match="serve.concurrencies"):
        _config(["simulate", "--concurrency", "0"])


def test_the_split_flag_sets_eval_split_on_eval_and_simulate():
    assert _config(["eval"]).eval.split == "all"  # DeepSpec's subsets unless a split is asked for
    assert _config(["eval", "--split", "test"]).eval.split == "test"
    assert _config(["simulate", "--split", "dev"]).eval.split == "dev"
    with pytest.raises(ValueError, match="eval.split"):
        _config(["eval", "--split", "train"])


# --------------------------------------------------------------------------- one name for the policy
def test_the_policy_has_one_flag_and_one_config_key_on_both_commands():
    assert COMMANDS["eval"][1]["--policy"] == COMMANDS["simulate"][1]["--policy"] == "serve.policy"
    assert _config(["eval"]).serve.policy == []  # verify all γ drafts
    assert _config(["eval", "--set", "serve.policy=threshold:0.5"]).serve.policy == ["threshold:0.5"]  # one string
    assert ServeConfig(policy="algorithm1").policy == ["algorithm1"] and ServeConfig(policy="").policy == []


def test_the_deprecated_scheduler_flag_still_sets_the_policy_and_names_its_replacement(capsys):
    with pytest.warns(FutureWarning, match="--scheduler is deprecated; use --policy"):
        c = _config(["eval", "--scheduler", "algorithm1", "--concurrency", "2"])
    assert (c.serve.policy, c.serve.concurrency) == (["algorithm1"], 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    help_text = capsys.readouterr().out
    assert "--policy" in help_text and "--scheduler" not in help_text  # hidden from the help


def test_the_policy_flag_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _config(["eval", "--policy", "static1"]).serve.policy == ["static1"]


def test_the_deprecated_policies_key_still_sets_the_policy_and_names_its_replacement():
    with pytest.warns(FutureWarning, match="config key serve.policies is deprecated; use serve.policy"):
        c = _config(["simulate", "--set", "serve.policies=['static1', 'async']"])
    assert c.serve.policy == ["static1", "async"]
    with pytest.warns(FutureWarning, match="serve.policies is deprecated; serve.policy holds the policies"):
        assert ServeConfig(policies=["static"]).policy == ["static"]


def old_config_json(tmp_path, policy: str, policies: list[str]):
    """A config.json in the deprecated form: serve.policy a string (eval's), serve.policies a list (simulate's)."""
    data = Config().to_dict()
    data["serve"].pop("policy")
    data["serve"].update(policy=policy, policies=policies)
    path = tmp_path / f"config-{policy or 'none'}-{len(policies)}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("policy, policies, expected", [
    ("", SIMULATE_POLICIES, []),  # a plain eval (and simulate's default list): nothing set
    ("algorithm1", SIMULATE_POLICIES, ["algorithm1"]),  # a scheduled eval
    ("", ["static1", "algorithm1+skip"], ["static1", "algorithm1+skip"]),  # a simulate run that chose its policies
])
def test_an_old_config_json_loads_with_its_policies_under_the_new_key(tmp_path, policy, policies, expected):
    with pytest.warns(FutureWarning, match="serve.policies is deprecated; serve.policy holds the policies"):
        c = load_config(old_config_json(tmp_path, policy, policies))
    assert c.serve.policy == expected
    for command in ("eval", "simulate"):  # both commands read it
        with pytest.warns(FutureWarning):
            assert _config([command, "--config", str(old_config_json(tmp_path, policy, policies))]).serve.policy == expected


def test_a_config_json_of_the_current_form_loads_without_a_warning(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(Config(serve=ServeConfig(policy=["async", "static"])).to_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(path).serve.policy == ["async", "static"]


def test_an_empty_policy_name_is_refused_with_the_key():
    with pytest.raises(ValueError, match=r"serve.policy=\['static', ''\] holds an empty policy name"):
        _config(["simulate", "--set", "serve.policy=['static', '']"])


def test_the_flag_help_lists_the_policies_of_the_library():
    from dspark.cli.flags import POLICY_HELP
    from dspark.scheduling.policies import POLICY_HELP as LIBRARY

    assert POLICY_HELP == LIBRARY

