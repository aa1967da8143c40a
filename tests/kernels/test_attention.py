"""dspark.kernels.attention: the CPU grouped-query sdpa the target loads as, against independent oracles."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.kernels.attention import NAME, register, sdpa_gqa_attention
from dspark.target import TargetModel
from tests.helpers.targets import build_tiny_model


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _reference(query, key, value, allowed, scale):
    """float64 attention with the key/value heads repeated by hand: [B, q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_masked_grouped_heads_match_float64(q_len):
    g = torch.Generator().manual_seed(q_len)
    B, H, H_kv, kv, D = 2, 6, 2, 11, 16
    query = torch.randn(B, H, q_len, D, generator=g)
    key, value = torch.randn(B, H_kv, kv, D, generator=g), torch.randn(B, H_kv, kv, D, generator=g)
    # causal over a cache of kv - q_len positions, and one padded position in the second request
    past = kv - q_len
    allowed = torch.arange(kv)[None, :] <= past + torch.arange(q_len)[:, None]  # [q, kv]
    allowed = allowed.expand(B, 1, q_len, kv).clone()
    allowed[1, :, :, 0] = False
    out, weights = sdpa_gqa_attention(_Module(H // H_kv), query, key, value, allowed, scaling=D ** -0.5)
    assert weights is None and out.shape == (B, q_len, H, D)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_unmasked_square_is_causal():
    g = torch.Generator().manual_seed(0)
    query, key, value = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    out, _ = sdpa_gqa_attention(_Module(2), query, key, value, None, scaling=0.5)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(1, 1, 5, 5)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4"])
def test_from_pretrained_loads_sdpa_gqa_with_eager_numbers(family, tmp_path):
    """A target loaded by from_pretrained with "sdpa" on CPU runs sdpa_gqa, and its prefill,
    multi-token (verification) and one-token forwards over a cache give eager attention's logits."""
    build_tiny_model(family, seed=1).save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(str(tmp_path), [0, 1])
    eager = TargetModel(_eager(tmp_path), [0, 1])
    assert target.model.config._attn_implementation == NAME
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    caches = target.new_cache(), eager.new_cache()
    for chunk in (ids[:, :9], ids[:, 9:17], ids[:, 17:18], ids[:, 18:]):
        a = target(chunk, past_key_values=caches[0], use_cache=True)
        b = eager(chunk, past_key_values=caches[1], use_cache=True)
        torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(a.features, b.features, atol=2e-5, rtol=1e-4)


def _eager(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def test_register_is_idempotent():
    from transformers import AttentionInterface

    assert register() == register() == NAME
    assert AttentionInterface()[NAME] is sdpa_gqa_attention
