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
