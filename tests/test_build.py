"""`dspark.build.drafter_config`: an experiment's `DrafterSpec` resolved against its target."""

from __future__ import annotations

from dataclasses import MISSING, fields

from dspark.build import drafter_config
from dspark.config import DrafterSpec
from dspark.modeling import DrafterConfig

# "auto" in the spec is resolved on the device (flex on a GPU, sdpa elsewhere); the config stores the result.
RESOLVED = {"attn_implementation"}


def test_fields_the_spec_and_the_config_both_carry_have_one_default():
    spec = {f.name: f.default for f in fields(DrafterSpec) if f.default is not MISSING}
    conf = {f.name: f.default for f in fields(DrafterConfig) if f.default is not MISSING}
    shared = sorted((spec.keys() & conf.keys()) - RESOLVED)
    assert shared, "no field in common: the comparison would check nothing"
    assert {k: spec[k] for k in shared} == {k: conf[k] for k in shared}


def test_the_default_spec_resolves_to_the_default_config(tiny_qwen3):
    spec = DrafterSpec(target_layer_ids=list(tiny_qwen3.target_layer_ids), mask_token_id=1)
    built = drafter_config(spec, tiny_qwen3)
    default = DrafterConfig.from_target_config(tiny_qwen3.text_config, target_layer_ids=spec.target_layer_ids,
                                               mask_token_id=1)
    assert built == default.replace(attn_implementation=built.attn_implementation)


def test_every_field_the_spec_and_the_config_share_passes_by_name(tiny_qwen3):
    """A non-default value in each shared field reaches the DrafterConfig (a dspark drafter, so no
    head field is switched off by the variant)."""
    spec = DrafterSpec(target_layer_ids=[0, 3], mask_token_id=2, block_size=5, num_draft_layers=2,
                       block_layout="anchor_plus_masks", markov_rank=6, markov_head_type="rnn", rnn_bias=False,
                       enable_confidence_head=True, confidence_head_with_markov=False, intermediate_size=96,
                       eagle3_preset="eagle3_deepspec", ttt_length=3, step_loss_decay=0.5, draft_vocab_size=32)
    built = drafter_config(spec, tiny_qwen3)
    shared = ({f.name for f in fields(DrafterSpec)} & {f.name for f in fields(DrafterConfig)}) - RESOLVED
    assert {name: getattr(built, name) for name in shared} == {name: getattr(spec, name) for name in shared}


def test_rnn_bias_is_set_from_a_config(tiny_qwen3):
    """drafter.rnn_bias=false builds the paper's Eq. 6 exactly (no joint bias); true is DeepSpec's form."""
    from dspark.config import Config, apply_overrides
    from dspark.modeling import Drafter

    config = Config(drafter=DrafterSpec(target_layer_ids=list(tiny_qwen3.target_layer_ids), mask_token_id=1,
                                        num_draft_layers=1, markov_rank=4, markov_head_type="rnn"))
    for text, has_bias in (("false", False), ("true", True)):
        spec = apply_overrides(config, [f"drafter.rnn_bias={text}"]).drafter
        drafter = Drafter(drafter_config(spec, tiny_qwen3))
        assert (drafter.markov_head.joint_proj.bias is not None) == has_bias
        assert drafter.config.to_hf_dict()["rnn_bias"] is has_bias


def test_head_options_are_a_checked_config_field():
    import pytest

    from dspark.config import Config, apply_overrides

    config = apply_overrides(Config(), ["drafter.head_options={'scale': 0.5}"])
    assert config.drafter.head_options == {"scale": 0.5}
    with pytest.raises(ValueError, match="drafter.head_options expects a dict"):
        apply_overrides(Config(), ["drafter.head_options=[1, 2]"])
    with pytest.raises(ValueError, match="drafter.markov_head_type='nope' is not one of.*register one"):
        apply_overrides(Config(), ["drafter.markov_head_type=nope"])
