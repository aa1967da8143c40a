"""Typed configs: the shipped config files, the recipe values of paper Section 3.3, overrides and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.config import Config, apply_overrides, config_from_dict, dflash_of, load_config, set_values

ROOT = Path(__file__).resolve().parents[1]
PAPER_LAYERS = {
    "qwen3_4b": [1, 9, 17, 25, 33],
    "qwen3_8b": [1, 9, 17, 25, 33],
    "qwen3_14b": [1, 10, 19, 28, 37],
    "gemma4_12b": [5, 17, 29, 41, 46],
}
MASK = {"qwen3_4b": 151669, "qwen3_8b": 151669, "qwen3_14b": 151669, "gemma4_12b": 4}


@pytest.mark.parametrize("target", sorted(PAPER_LAYERS))
@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_reference_configs_reproduce_the_paper_recipe(variant, target):
    c = load_config(ROOT / "config" / variant / f"{variant}_{target}.py")
    assert c.drafter.variant == variant
    assert c.drafter.target_layer_ids == PAPER_LAYERS[target]
    assert c.drafter.mask_token_id == MASK[target]
    assert (c.drafter.block_size, c.drafter.num_draft_layers, c.data.num_anchors, c.data.max_length) == (7, 5, 512, 4096)
    t = c.train
    assert (t.lr, t.weight_decay, t.warmup_ratio, t.min_lr_ratio, t.grad_clip) == (6e-4, 0.0, 0.04, 0.0, 1.0)
    assert (t.global_batch_size, t.epochs, c.seed) == (512, 10, 42)
    assert t.mixed_precision == "auto"  # bf16 on the recipes' bf16 GPUs (tests/test_bucketing.py)
    assert (c.generation.temperature, c.generation.top_p, c.generation.top_k) == (0.7, 0.8, 20)
    assert c.loss.loss_decay_gamma == 4.0
    if variant == "dspark":
        assert (c.loss.ce_weight, c.loss.tv_weight, c.loss.conf_weight) == (0.1, 0.9, 1.0)
        assert (c.drafter.markov_rank, c.drafter.markov_head_type, c.drafter.enable_confidence_head) == (256, "vanilla", True)
    else:
        assert (c.loss.ce_weight, c.loss.tv_weight, c.loss.conf_weight) == (1.0, 0.0, 0.0)
        assert c.drafter.markov_rank == 0 and not c.drafter.enable_confidence_head


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*/*.py")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), Config)


def test_overrides_are_typed_and_do_not_mutate_the_original():
    c = Config()
    d = apply_overrides(c, ["train.lr=3e-4", "drafter.target_layer_ids=[2, 4]", "drafter.intermediate_size=None",
                            "train.compile=true", "name=x"])
    assert (d.train.lr, d.drafter.target_layer_ids, d.drafter.intermediate_size, d.train.compile, d.name) == (3e-4, [2, 4], None, True, "x")
    assert c.train.lr == 6e-4 and c.drafter.target_layer_ids == [1, 9, 17, 25, 33]


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.lrr=1", ["unknown config key 'train.lrr'", "train.lr"]),
        ("train.lr=fast", ["train.lr", "number"]),
        ("drafter.block_size=2.5", ["drafter.block_size", "integer"]),
        ("drafter.target_layer_ids=3", ["drafter.target_layer_ids", "list"]),
        ("drafter.variant=eagle", ["drafter.variant", "dspark"]),
        ("train.micro_batch_size=3", ["train.global_batch_size", "micro_batch_size"]),
        ("drafter.target_layer_ids=[3, 1]", ["drafter.target_layer_ids", "strictly increasing"]),
        ("trainlr", ["key.path=value"]),
    ],
)
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ValueError) as e:
        apply_overrides(Config(), [override])
    for w in words:
        assert w in str(e.value)


def test_config_file_must_bind_a_config(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("lr = 3e-4\n")
    with pytest.raises(ValueError, match="must bind a dspark.config.Config"):
        load_config(bad)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from dspark.config import Config, TrainConfig\nconfig = Config(train=TrainConfig(lr='x'))\n")
    with pytest.raises(ValueError, match="train.lr expects a number"):
        load_config(wrong)


def test_the_defaults_are_the_qwen3_4b_recipe_file():
    """config/dspark/dspark_qwen3_4b.py spells the defaults out: nothing in it differs but the out_dir it names."""
    spelled = load_config(ROOT / "config" / "dspark" / "dspark_qwen3_4b.py")
    assert spelled.run_dir == Config().run_dir == Path("runs/dspark_qwen3_4b_block7")
    assert spelled.to_dict() == {**Config().to_dict(), "out_dir": "runs/dspark_qwen3_4b_block7"}


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*/*.py")), ids=lambda p: p.stem)
def test_model_config_files_state_only_what_differs(path):
    if path.stem == "dspark_qwen3_4b":  # the one full file to copy from
        return
    assert len(path.read_text().splitlines()) <= 30


def test_dflash_of_drops_the_heads_and_trains_on_ce_only():
    base = load_config(ROOT / "config" / "dspark" / "dspark_smollm2_135m.py")
    d = dflash_of(base)
    assert (d.name, d.drafter.variant, d.drafter.markov_rank) == ("dflash_smollm2_135m", "dflash", 0)
    assert not d.drafter.enable_confidence_head and not d.drafter.confidence_head_with_markov
    assert (d.loss.ce_weight, d.loss.tv_weight, d.loss.conf_weight, d.loss.chunk_rows) == (1.0, 0.0, 0.0, 32)
    same = {k: v for k, v in base.to_dict().items() if k not in ("name", "drafter", "loss")}
    assert {k: v for k, v in d.to_dict().items() if k not in ("name", "drafter", "loss")} == same
    assert d.run_dir == Path("runs/dflash_smollm2_135m")


def test_a_written_config_json_loads_back_to_the_same_config(tmp_path):
    c = apply_overrides(load_config(ROOT / "config" / "dspark" / "dspark_smollm2_135m.py"),
                        ["eval.benchmarks=['gsm8k']", "serve.concurrencies=[1, 2]", "eval.draft=runs/x/drafter"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c.to_dict()))
    assert load_config(path) == c
    assert load_config(path, ["train.lr=0.5"]).train.lr == 0.5


@pytest.mark.parametrize(
    "data, words",
    [
        ({"trian": {}}, ["unknown config key", "trian"]),
        ({"train": {"lrr": 1}}, ["train.lrr"]),
        ({"train": {"lr": "fast"}}, ["train.lr", "number"]),
        ({"eval": [1]}, ["eval", "JSON object"]),
    ],
)
def test_a_bad_config_json_names_the_key(tmp_path, data, words):
    with pytest.raises(ValueError) as e:
        config_from_dict(data, "run/config.json")
    for w in ["run/config.json", *words]:
        assert w in str(e.value)


def test_a_string_field_takes_the_text_as_it_is():
    c = apply_overrides(Config(), ["eval.label=123", "eval.draft=runs/1e3/drafter", "name='quoted'"])
    assert (c.eval.label, c.eval.draft, c.name) == ("123", "runs/1e3/drafter", "quoted")
    assert set_values(Config(), {"serve.concurrencies": ["1", "4"]}, parse=True).serve.concurrencies == [1, 4]


@pytest.mark.parametrize(
    "values, words",
    [
        ({"serve.concurrencies": [0]}, ["serve.concurrencies", ">= 1"]),
        ({"target.device": "tpu"}, ["target.device", "auto"]),
        ({"calibrate.fit_fraction": 1.0}, ["calibrate.fit_fraction", "[0, 1)"]),
        ({"eval.num_samples": -1}, ["eval.num_samples", ">= 0"]),
        ({"eval.bootstrap_resamples": 0}, ["eval.bootstrap_resamples", "> 0"]),
    ],
)
def test_bad_values_of_the_run_sections_name_the_key(values, words):
    with pytest.raises(ValueError) as e:
        set_values(Config(), values)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*/*.py")), ids=lambda p: p.stem)
def test_paper_configs_cache_in_bf16_as_deepspec_and_the_smollm2_demo_in_fp8(path):
    expected = "fp8" if "smollm2" in path.stem else "bf16"
    assert load_config(path).data.cache_precision == expected


def test_default_eval_benchmarks_are_the_table_in_evaluation_order():
    from dspark.data.benchmarks import BENCHMARKS

    assert Config().eval.benchmarks == list(BENCHMARKS)


def test_periodic_training_steps_must_be_positive():
    """A period of 0 steps has no multiples: refused when the config is read, not at the first checkpoint."""
    import pytest

    from dspark.config import Config, apply_overrides

    for key in ("train.save_every", "train.log_every"):
        with pytest.raises(ValueError, match=f"{key} must be > 0, got 0"):
            apply_overrides(Config(), [f"{key}=0"])
