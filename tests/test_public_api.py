"""`import dspark`: the public names, each importable, documented and loaded lazily; the
boundary checks a researcher's own training code meets first."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import dspark

PUBLIC = sorted(set(dspark.__all__) - {"__version__"})


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_resolves_to_the_object_of_its_module(name):
    module = __import__(dspark._LOCATIONS[name], fromlist=[name])
    assert getattr(dspark, name) is getattr(module, name)
    assert name in dir(dspark)


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_docstring_of_its_own(name):
    """help(dspark.X) shows X's own text: a class's docstring is in its own __dict__ (not
    nn.Module's or a dataclass's generated signature), a function's is not empty."""
    obj = getattr(dspark, name)
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert own and own.strip(), f"dspark.{name} has no docstring of its own"
    if inspect.isclass(obj):
        assert not re.fullmatch(rf"{name}\(.*\)", own.strip(), flags=re.S), f"dspark.{name}: generated docstring"
        for base in obj.__mro__[1:]:
            assert own != base.__dict__.get("__doc__"), f"dspark.{name} repeats {base.__name__}'s docstring"


def test_public_api_has_the_names_a_researcher_imports():
    assert 25 <= len(PUBLIC) <= 36
    assert {"Drafter", "TargetModel", "verify_draft", "schedule_prefix", "evaluate", "build_drafter", "block_loss",
            "sample_anchors", "render_conversation", "count_draft_vocab", "apply_temperatures",
            "sts_inputs"} <= set(PUBLIC)


def test_the_module_docstring_names_every_public_name():
    for name in PUBLIC:
        assert f"``{name}``" in dspark.__doc__, f"dspark's docstring does not place {name}"


def test_import_dspark_loads_neither_torch_nor_transformers():
    code = "import sys, dspark; print('torch' in sys.modules, 'transformers' in sys.modules, dspark.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["False", "False"]


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        dspark.no_such_name  # noqa: B018


# --------------------------------------------------------------------------- sts_inputs
def _result(*rounds):
    return SimpleNamespace(rounds=[SimpleNamespace(proposed=p, accepted=a, confidences=c) for p, a, c in rounds])


def test_sts_inputs_are_the_keyword_arguments_of_fit_sts():
    results = [_result((3, 1, [0.9, 0.5, 0.2]), (2, 2, None)), _result((3, 0, [0.4, 0.3, 0.2]))]
    inputs = dspark.sts_inputs(results)
    np.testing.assert_array_equal(inputs["conf"], [[0.9, 0.5, 0.2], [0.4, 0.3, 0.2]])
    np.testing.assert_array_equal(inputs["accepted"], [1, 0])
    np.testing.assert_array_equal(inputs["proposed"], [3, 3])
    np.testing.assert_array_equal(inputs["groups"], [0, 1])  # the round without confidences is left out
    assert dspark.sts_inputs(results[1])["conf"].shape == (1, 3)  # one DecodeResult alone
    assert dspark.fit_sts(**inputs, min_events=0, folds=0).shape == (3,)


def test_sts_inputs_name_what_is_wrong():
    with pytest.raises(ValueError, match="confidence head"):
        dspark.sts_inputs([_result((3, 1, None))])
    with pytest.raises(ValueError, match="one drafter"):
        dspark.sts_inputs([_result((3, 1, [0.5] * 3)), _result((2, 1, [0.5] * 2))])
    with pytest.raises(TypeError, match="DecodeResult"):
        dspark.sts_inputs([[1, 2]])


# --------------------------------------------------------------------------- training boundary checks
def _never(what):
    def boom(*args, **kwargs):
        raise AssertionError(f"{what} ran before the boundary check")

    return boom


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Every step after the trainer's checks fails the test: the loss module, the data's lengths, any
    forward of the target or the drafter (returns the patcher for the models of a test)."""
    import dspark.training.trainer as trainer

    monkeypatch.setattr(trainer, "build_loss_module", _never("build_loss_module"))
    monkeypatch.setattr(trainer, "sample_lengths", _never("sample_lengths"))

    def forbid_forward(*modules):
        for module in modules:
            monkeypatch.setattr(module, "forward", _never(f"{type(module).__name__}.forward"))

    return forbid_forward


def _setup(tmp_path, target_layer_ids=None, **drafter_fields):
    from helpers.targets import make_tiny_target
    from helpers.training import synthetic_samples, tiny_config
    from dspark.data.dataset import RenderedSource

    target = make_tiny_target("llama")
    config = tiny_config(target, str(tmp_path))
    config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter, **drafter_fields))
    drafter = dspark.build_drafter(config, target)
    if target_layer_ids is not None:
        target = make_tiny_target("llama", target_layer_ids=target_layer_ids)
    return config, target, drafter, RenderedSource(synthetic_samples(target.vocab_size))


def test_trainer_refuses_a_drafter_built_for_other_target_layers_before_any_forward(tmp_path, no_heavy_work):
    config, target, drafter, data = _setup(tmp_path, target_layer_ids=[0, 2, 3])
    no_heavy_work(target, drafter)
    with pytest.raises(ValueError, match=r"the drafter reads the target's layers \[-1, 1, 3\]"):
        dspark.Trainer(config, target, drafter, data, progress=False)


def test_trainer_names_a_missing_loss_mask_and_what_it_holds_before_any_forward(tmp_path, no_heavy_work):
    config, target, drafter, data = _setup(tmp_path)
    no_heavy_work(target, drafter)
    ids_only = [{"input_ids": data[i]["input_ids"]} for i in range(len(data))]
    with pytest.raises(ValueError, match=r"the training data: sample 0 has no 'loss_mask'.*1 on the supervised"):
        dspark.Trainer(config, target, drafter, ids_only, progress=False)
    with pytest.raises(ValueError, match=r"the held-out data: sample 0 has no 'input_ids'"):
        dspark.Trainer(config, target, drafter, data, [{"loss_mask": data[0]["loss_mask"]}], progress=False)
    cached = [{**data[0], "features": data[0]["input_ids"][:, None].float()}]
    with pytest.raises(ValueError, match=r"no 'final_hidden'"):
        dspark.Trainer(config, target, drafter, cached, progress=False)


def test_trainer_refuses_an_uncounted_draft_vocabulary_and_names_the_line_that_counts_it(tmp_path, no_heavy_work,
                                                                                          monkeypatch):
    config, target, drafter, train_data = _setup(tmp_path, draft_vocab_size=48)
    no_heavy_work(drafter)
    with pytest.raises(ValueError, match=r"never counted") as caught:
        dspark.Trainer(config, target, drafter, train_data, progress=False)
    fix = re.search(r"drafter\.set_vocab\(.*?\)\)", str(caught.value)).group(0)
    monkeypatch.undo()  # the named fix runs the target: forwards allowed again
    exec(fix, {"dspark": dspark, "drafter": drafter, "train_data": train_data, "target": target})
    assert bool(drafter.d2t.any())
    dspark.Trainer(config, target, drafter, train_data, progress=False)  # accepted now


def test_block_loss_names_one_dimensional_anchors_before_any_forward(tmp_path, no_heavy_work):
    _, target, drafter, data = _setup(tmp_path)
    item = data[0]
    out = target(item["input_ids"][None], return_logits=False)
    no_heavy_work(target, drafter)
    anchors, keep = dspark.sample_anchors(item["loss_mask"][None], 4)
    with pytest.raises(ValueError, match=r"anchors must be 2-D \[B, A\].*anchors\[None\]"):
        dspark.block_loss(drafter, out, item["input_ids"][None], item["loss_mask"][None], anchors[0], keep[0])
    with pytest.raises(ValueError, match=r"input_ids must be 2-D \[B, S\]"):
        dspark.block_loss(drafter, out, item["input_ids"], item["loss_mask"], anchors, keep)
    with pytest.raises(ValueError, match=r"features must be \[B, S, m·d\]"):
        dspark.block_loss(drafter, (out.last_hidden, out.last_hidden), item["input_ids"][None],
                          item["loss_mask"][None], anchors, keep)
