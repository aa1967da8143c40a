"""Draft layers initialised from the target's decoder layers (dspark.modeling.init).

The tiny targets here have every norm weight and Gemma's layer scalar moved away from 1, so a
norm that was copied differs from one left at its init (ones). The expected tensor names per
family are spelled out by hand from the transformers decoder layers."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from helpers.targets import make_tiny_target, tiny_config as tiny_hf_config, tiny_drafter_config
from helpers.training import fit_killed_after, synthetic_samples, tiny_config
from dspark.build import build_drafter, init_layer_ids
from dspark.config import apply_overrides, set_values
from dspark.config_checks import init_from_target_choice
from dspark.data.dataset import RenderedSource
from dspark.modeling import DrafterConfig, load_drafter, make_drafter, save_drafter
from dspark.modeling.init import choose_layer_ids, init_draft_layers_from_target
from dspark.training.checkpoints import latest_checkpoint
from dspark.training.trainer import Trainer

LLAMA_LAYER = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
QWEN3_LAYER = (*LLAMA_LAYER, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
GEMMA4_LAYER = (*QWEN3_LAYER, "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", "layer_scalar")
COPIED = {"llama": LLAMA_LAYER, "qwen3": QWEN3_LAYER, "gemma4": GEMMA4_LAYER}
# The drafter's own tensors, outside the draft layers, with no counterpart in a target layer.
DSPARK_OWN = (
    "fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
)
# Real Gemma4 geometry: full-attention layers (1, 3) have a larger head_dim and share k and v.
GEMMA4_FULL = (("global_head_dim", 32), ("attention_k_eq_v", True), ("num_global_key_value_heads", 1))


@functools.lru_cache(maxsize=None)
def _target(family: str, overrides: tuple = ()):
    """A tiny target whose 1-D layer tensors (norm weights, layer scalars) are away from 1."""
    target = make_tiny_target(family, **dict(overrides))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in target.layers:
            for t in layer.state_dict(keep_vars=True).values():
                if t.dim() == 1:
                    t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
    return target


def _drafter(family: str, target_overrides: tuple = (), seed: int = 0, **fields):
    target = _target(family, target_overrides)
    torch.manual_seed(seed)
    return target, make_drafter(tiny_drafter_config(target, **fields)).attach_target(target)


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _run_config(target, tmp_path, init_from_target: str, **drafter_fields):
    config = tiny_config(target, str(tmp_path))
    drafter = dataclasses.replace(config.drafter, init_from_target=init_from_target, **drafter_fields)
    return dataclasses.replace(config, drafter=drafter)


# ------------------------------------------------------------------ layer choice
def test_layer_choices_by_hand():
    assert choose_layer_ids("last", 2, 4) == [2, 3]
    assert choose_layer_ids("spread", 2, 4) == [0, 3]
    assert choose_layer_ids("spread", 3, 4) == [0, 2, 3]  # round(1.5) = 2
    assert choose_layer_ids("spread", 5, 36) == [0, 9, 18, 26, 35]  # 0, 8.75, 17.5, 26.25, 35
    assert choose_layer_ids("spread", 4, 4) == [0, 1, 2, 3]
    assert choose_layer_ids("spread", 1, 4) == [3]
    assert choose_layer_ids([3, 1], 2, 4) == [3, 1]


def test_config_field_reads_ids_and_rejects_bad_ones():
    config = tiny_config(_target("llama"), "unused")
    two = apply_overrides(config, ["drafter.init_from_target=2,3", "drafter.num_draft_layers=2"])
    assert two.drafter.init_from_target == "2,3"
    assert init_from_target_choice("2,3") == init_from_target_choice("[2, 3]") == [2, 3]
    with pytest.raises(ValueError, match=r"drafter.init_from_target='x,1'; use '' \(random init\), 'last', 'spread'"):
        set_values(config, {"drafter.init_from_target": "x,1"})
    with pytest.raises(ValueError, match="init_from_target='2,3' names 2 target layers for drafter.num_draft_layers=1"):
        set_values(config, {"drafter.init_from_target": "2,3"})


# ------------------------------------------------------------------ what is copied
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4"])
@pytest.mark.parametrize("choice, ids", [("last", [2, 3]), ("spread", [0, 3]), ([3, 1], [3, 1])])
def test_each_draft_layer_is_a_copy_of_its_target_layer(family, choice, ids):
    target, drafter = _drafter(family)
    assert choose_layer_ids(choice, 2, len(target.layers)) == ids
    report = init_draft_layers_from_target(drafter, target, ids)
    assert report.copied == {f"layers.{j}.{n}": f"layers.{i}.{n}" for j, i in enumerate(ids) for n in COPIED[family]}
    for j, i in enumerate(ids):
        ours, theirs = drafter.layers[j].state_dict(), target.layers[i].state_dict()
        for name in COPIED[family]:
            assert torch.equal(ours[name], theirs[name]), (j, name)
    assert report.hidden_half == {} and report.unused == []


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_tensors_without_counterpart_keep_their_init(family):
    target, drafter = _drafter(family)
    before = _state(drafter)
    report = init_draft_layers_from_target(drafter, target, [2, 3])
    assert report.kept == [n for n in before if n in DSPARK_OWN]
    assert sorted(report.kept) == sorted(DSPARK_OWN)
    after = drafter.state_dict()
    for name in report.kept:
        assert torch.equal(after[name], before[name]), name
    assert set(report.kept) | set(report.copied) == set(before)


def test_qwen3_layers_over_a_llama_target_keep_their_qk_norms():
    target, drafter = _drafter("llama", layer_family="qwen3")
    report = init_draft_layers_from_target(drafter, target, [2, 3])
    norms = [f"layers.{j}.self_attn.{n}_norm.weight" for j in (0, 1) for n in ("q", "k")]
    assert set(norms) <= set(report.kept)
    for name in norms:
        assert torch.equal(drafter.state_dict()[name], torch.ones(16))
    assert set(report.copied) == {f"layers.{j}.{n}" for j in (0, 1) for n in LLAMA_LAYER}


def test_biases_are_copied_with_their_weights():
    overrides = (("attention_bias", True), ("mlp_bias", True))
    target, drafter = _drafter("llama", target_overrides=overrides)
    with torch.no_grad():
        for _, t in target.layers[3].named_parameters():
            t.add_(0.5)  # biases start at zero in both
    report = init_draft_layers_from_target(drafter, target, [0, 3])
    biases = [n.replace("weight", "bias") for n in LLAMA_LAYER if "proj" in n]
    for name in biases:
        assert report.copied[f"layers.1.{name}"] == f"layers.3.{name}"
        assert torch.equal(drafter.layers[1].state_dict()[name], target.layers[3].state_dict()[name])


@pytest.mark.parametrize("family, preset, copied", [
    ("llama", "eagle3", ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                         "mlp.down_proj.weight", "post_attention_layernorm.weight")),
    ("qwen3", "eagle3_deepspec", ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_norm.weight", "self_attn.k_norm.weight")),
])
def test_eagle3_takes_the_target_qkv_into_its_hidden_half(family, preset, copied):
    target, drafter = _drafter(family, variant="eagle3", eagle3_preset=preset, num_draft_layers=1)
    before = _state(drafter)
    report = init_draft_layers_from_target(drafter, target, [3])
    ours, theirs = drafter.layers[0].state_dict(), target.layers[3].state_dict()
    d = target.hidden_size
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        assert report.hidden_half[f"layers.0.{name}"] == f"layers.3.{name}"
        assert torch.equal(ours[name][:, d:], theirs[name])  # [out, d] acting on hidden_norm(g)
        assert not ours[name][:, :d].any()  # the embedding half starts at zero
    for name in copied:
        assert report.copied[f"layers.0.{name}"] == f"layers.3.{name}"
        assert torch.equal(ours[name], theirs[name])
    assert report.copied["layers.0.hidden_norm.weight"] == "layers.3.input_layernorm.weight"
    assert torch.equal(ours["hidden_norm.weight"], theirs["input_layernorm.weight"])
    assert report.kept == ["fc.weight", "layers.0.input_layernorm.weight", "norm.weight"]
    for name in report.kept:
        assert torch.equal(drafter.state_dict()[name], before[name])


def test_copies_are_cast_to_the_drafter_dtype():
    target, drafter = _drafter("qwen3")
    drafter.to(torch.bfloat16)
    init_draft_layers_from_target(drafter, target, [2, 3])
    for name in QWEN3_LAYER:
        ours = drafter.layers[1].state_dict()[name]
        assert ours.dtype == torch.bfloat16
        assert torch.equal(ours, target.layers[3].state_dict()[name].to(torch.bfloat16)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_land_on_the_drafter_device():
    target, drafter = _drafter("qwen3")
    drafter.to("cuda")
    init_draft_layers_from_target(drafter, target, [2, 3])
    for name in QWEN3_LAYER:
        ours = drafter.layers[0].state_dict()[name]
        assert ours.device.type == "cuda"
        assert torch.equal(ours.cpu(), target.layers[2].state_dict()[name]), name


# ------------------------------------------------------------------ refusals
def test_a_different_intermediate_size_names_the_field(tmp_path):
    target = _target("llama")
    config = _run_config(target, tmp_path, "last", intermediate_size=96)
    message = ("drafter.intermediate_size=96 must equal the target's 128 to copy its layers; "
               "set drafter.intermediate_size=None")
    with pytest.raises(ValueError, match=message):
        init_layer_ids(config, target)
    _, drafter = _drafter("llama", intermediate_size=96)
    before = _state(drafter)
    with pytest.raises(ValueError, match=message):
        init_draft_layers_from_target(drafter, target, [2, 3])
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())  # a refusal changes nothing


def test_other_widths_are_named_too():
    target = _target("llama")
    config = DrafterConfig.from_target_config(tiny_hf_config("llama", num_key_value_heads=4), target_layer_ids=[1, 3],
                                              mask_token_id=1, num_draft_layers=2, markov_rank=8)
    with pytest.raises(ValueError, match="the draft layers have num_key_value_heads=4, the target 2"):
        init_draft_layers_from_target(make_drafter(config), target, [2, 3])


def test_bad_layer_ids_name_the_field(tmp_path):
    target = _target("llama")
    with pytest.raises(ValueError, match=r"drafter.init_from_target has layer ids \[7\] out of range: .* ids 0..3"):
        init_layer_ids(_run_config(target, tmp_path, "1,7", num_draft_layers=2), target)
    with pytest.raises(ValueError, match=r"init_from_target names 1 target layers \[3\] for drafter.num_draft_layers=2"):
        init_draft_layers_from_target(_drafter("llama")[1], target, [3])
    with pytest.raises(ValueError, match="drafter.num_draft_layers=5 exceeds the target's 4 layers"):
        init_layer_ids(_run_config(target, tmp_path, "last", num_draft_layers=5), target)


def test_gemma4_sliding_layers_do_not_fit_full_attention_draft_layers():
    target, drafter = _drafter("gemma4", target_overrides=GEMMA4_FULL)
    with pytest.raises(ValueError, match=r"target layer 2 \(sliding_attention\) has self_attn.q_proj.weight .*"
                                         r"drafter.init_from_target \(the target's full-attention layers: \[1, 3\]\)"):
        init_draft_layers_from_target(drafter, target, [2, 3])
    report = init_draft_layers_from_target(drafter, target, [1, 3])
    names = [n for n in GEMMA4_LAYER if n != "self_attn.v_proj.weight"]  # k = v: neither has a v_proj
    assert set(report.copied) == {f"layers.{j}.{n}" for j in (0, 1) for n in names}
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, target.layers[1].self_attn.q_proj.weight)


# ------------------------------------------------------------------ in training
def test_build_drafter_copies_only_when_asked(tmp_path):
    target = _target("qwen3")
    plain = build_drafter(_run_config(target, tmp_path, "", num_draft_layers=2), target)
    copied = build_drafter(_run_config(target, tmp_path, "spread", num_draft_layers=2), target)
    for j, i in enumerate([0, 3]):
        for name in QWEN3_LAYER:
            assert torch.equal(copied.layers[j].state_dict()[name], target.layers[i].state_dict()[name])
            assert not torch.equal(plain.layers[j].state_dict()[name], target.layers[i].state_dict()[name])
    # the same seed gives the same random init to everything the copy leaves alone
    assert torch.equal(plain.fc.weight, copied.fc.weight)
    assert torch.equal(plain.markov_head.markov_w1.weight, copied.markov_head.markov_w1.weight)


def _trainer(target, out_dir, init_from_target: str, **train):
    config = _run_config(target, out_dir, init_from_target)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, **train))
    samples = RenderedSource(synthetic_samples(target.vocab_size, n=4, seed=3))
    return Trainer(config, target, build_drafter(config, target), samples, progress=False)


def test_an_initialised_drafter_trains(tmp_path, one_thread):
    target = _target("qwen3")
    trainer = _trainer(target, tmp_path, "last", max_steps=8, lr=1e-2, save_every=100)
    start = _state(trainer.drafter.layers[0])
    assert torch.equal(start["mlp.up_proj.weight"], target.layers[3].state_dict()["mlp.up_proj.weight"])
    losses = [trainer.train_step()["loss"] for _ in range(8)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0]
    after = trainer.drafter.layers[0].state_dict()
    for name in QWEN3_LAYER:
        assert not torch.equal(after[name], start[name]), name


def test_resume_restores_the_trained_weights_not_the_target_copy(tmp_path, one_thread):
    target = _target("qwen3")
    fit_killed_after(_trainer(target, tmp_path, "last"), 2)  # checkpoint at step 2
    resumed = _trainer(target, tmp_path, "last")
    resumed.load_checkpoint(latest_checkpoint(tmp_path))
    trained = load_drafter(latest_checkpoint(tmp_path) / "drafter", target).state_dict()
    ours = resumed.drafter.state_dict()
    assert all(torch.equal(ours[k], trained[k]) for k in trained)
    assert not torch.equal(ours["layers.0.mlp.up_proj.weight"], target.layers[3].state_dict()["mlp.up_proj.weight"])


@pytest.mark.parametrize("family, fields", [
    ("gemma4", {}),
    ("qwen3", {"variant": "eagle3", "eagle3_preset": "eagle3_deepspec", "num_draft_layers": 1}),
])
def test_checkpoint_round_trip_is_bit_exact(family, fields, tmp_path):
    target, drafter = _drafter(family, **fields)
    init_draft_layers_from_target(drafter, target, choose_layer_ids("spread", drafter.config.num_draft_layers, 4))
    loaded = load_drafter(save_drafter(drafter, tmp_path / "drafter"), target)
    ours, theirs = drafter.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
