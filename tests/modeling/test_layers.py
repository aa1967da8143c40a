"""The draft layers' parts (dspark.modeling.layers): the per-family adapter and RoPE read from the
family table (dspark.registry.FAMILIES), RMSNorm and the rotation against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.modeling.layers import FamilyAdapter, RMSNorm, Rotary, apply_rope
from dspark.registry import FAMILIES
from helpers.targets import make_tiny_target, tiny_drafter_config

DRAFTER_FAMILIES = ("llama", "qwen3", "gemma4")


@pytest.mark.parametrize("family", DRAFTER_FAMILIES)
def test_the_adapter_is_the_family_tables_entry(family):
    facts = FAMILIES.get(family)
    adapter = FamilyAdapter.of(family)
    assert (adapter.qk_norm, adapter.v_norm, adapter.sandwich_norm, adapter.unit_score_scale,
            adapter.layer_scalar) == (facts.qk_norm, facts.v_norm, facts.sandwich_norm, facts.unit_score_scale,
                                      facts.layer_scalar)


def test_the_paper_families_differ_where_the_models_do():
    assert not FamilyAdapter.of("llama").qk_norm and FamilyAdapter.of("qwen3").qk_norm
    gemma = FamilyAdapter.of("gemma4")
    assert gemma.v_norm and gemma.sandwich_norm and gemma.unit_score_scale and gemma.layer_scalar


@pytest.mark.parametrize("family", ["qwen2", "gemma3", "nope"])
def test_no_adapter_for_a_family_without_draft_layers(family):
    with pytest.raises(ValueError, match="no draft-layer adapter.*FAMILIES"):
        FamilyAdapter.of(family)


@pytest.mark.parametrize("family", DRAFTER_FAMILIES)
def test_rotary_is_the_families_transformers_class_and_matches_the_target(family):
    """cos/sin at arbitrary positions equal those the target's own rotary module computes."""
    target = make_tiny_target(family)
    config = tiny_drafter_config(target)
    rotary = Rotary(config)
    inner = rotary._inner["module"]
    assert f"{type(inner).__module__}:{type(inner).__name__}" == FAMILIES.get(family).rotary
    positions = torch.tensor([[0, 3, 7, 100]])
    like = torch.zeros(1, 4, config.hidden_size)
    cos, sin = rotary(like, positions)
    own = target.model.model.rotary_emb
    args = (like, positions) if family != "gemma4" else (like, positions, "full_attention")
    ref_cos, ref_sin = own(*args)
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)


def test_rmsnorm_is_x_over_root_mean_square_times_w():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 0.5, -1.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    rms = math.sqrt(sum(v * v for v in x[0].tolist()) / 4 + 1e-6)
    expected = torch.tensor([[1.0 / rms, -4.0 / rms, 1.5 / rms, -0.5 / rms]])
    torch.testing.assert_close(norm(x), expected)
    assert torch.equal(RMSNorm(4, eps=1e-6, with_scale=False)(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def test_apply_rope_rotates_each_half_pair_by_its_angle():
    """x [1, 1, 1, 4]: pairs (x0, x2) and (x1, x3) rotate by θ0 and θ1 (the halves convention)."""
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])
    t0, t1 = 0.3, 1.1
    cos = torch.tensor([[[math.cos(t0), math.cos(t1), math.cos(t0), math.cos(t1)]]])
    sin = torch.tensor([[[math.sin(t0), math.sin(t1), math.sin(t0), math.sin(t1)]]])
    out = apply_rope(x, cos, sin)[0, 0, 0]
    expected = [1 * math.cos(t0) - 3 * math.sin(t0), 2 * math.cos(t1) - 4 * math.sin(t1),
                3 * math.cos(t0) + 1 * math.sin(t0), 4 * math.cos(t1) + 2 * math.sin(t1)]
    torch.testing.assert_close(out, torch.tensor(expected))
