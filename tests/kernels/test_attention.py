"""dspark.kernels.attention: the CPU grouped-query sdpa the target loads as, against independent oracles."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from dspark.kernels.attention import (
    NAME,
    PACKED_ROWS,
    _pack_heads,
    _packed_attention,
    _ragged_attention,
    _ragged_split,
    register,
    row_extents,
    sdpa_gqa_attention,
)
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


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("additive", [False, True])
def test_packed_heads_match_float64(per_head, additive):
    """The packed layout (g query heads of a key/value head as g·q rows) against the float64
    oracle: ragged rows (a padded column, a row that sees less), a mask shared by the heads or one
    per head, boolean or additive."""
    g = torch.Generator().manual_seed(7)
    B, H, H_kv, q_len, kv, D = 3, 6, 2, 4, 13, 8
    query = torch.randn(B, H, q_len, D, generator=g)
    key, value = torch.randn(B, H_kv, kv, D, generator=g), torch.randn(B, H_kv, kv, D, generator=g)
    past = kv - q_len
    allowed = (torch.arange(kv)[None, :] <= past + torch.arange(q_len)[:, None]).expand(B, H if per_head else 1,
                                                                                       q_len, kv).clone()
    allowed[1, ..., 0] = False
    allowed[2, ..., past - 3 : past] = False
    if per_head:
        allowed[0, 3, :, 1] = False  # one head of one row sees one column less
    mask = allowed if not additive else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    out = _packed_attention(query, key, value, mask, D ** -0.5, H // H_kv)
    assert out.shape == (B, q_len, H, D)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_packing_is_chosen_for_few_rows_over_many_heads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    key = torch.zeros(8, 3, 10, 4)
    assert _pack_heads(torch.zeros(8, 9, 5, 4), key, 3)  # 15 packed rows, 24 (row, head) pairs
    assert not _pack_heads(torch.zeros(8, 9, PACKED_ROWS // 3 + 1, 4), key, 3)  # too many packed rows
    assert not _pack_heads(torch.zeros(1, 9, 5, 4), key[:1], 3)  # 3 pairs for 2 threads
    # through the registered function: the packed branch gives the plain branch's numbers
    g = torch.Generator().manual_seed(3)
    query, k, v = torch.randn(8, 9, 5, 4, generator=g), torch.randn(8, 3, 10, 4, generator=g), torch.randn(8, 3, 10, 4, generator=g)
    allowed = torch.ones(8, 1, 5, 10, dtype=torch.bool).tril(diagonal=5)
    packed, _ = sdpa_gqa_attention(_Module(3), query, k, v, allowed, scaling=0.5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    plain, _ = sdpa_gqa_attention(_Module(3), query, k, v, allowed, scaling=0.5)
    torch.testing.assert_close(packed, plain, atol=1e-6, rtol=1e-6)


def _rows_of_lengths(lengths, q_len, g, H=9, H_kv=3, D=8, spare=6):
    """A batched forward's operands: row r holds lengths[r] cached columns and q_len new ones, in a
    cache wider than any row (stale columns past each row's end hold garbage)."""
    B, kv = len(lengths), max(lengths) + q_len
    query = torch.randn(B, H, q_len, D, generator=g)
    key = torch.randn(B, H_kv, kv + spare, D, generator=g)[:, :, :kv]
    value = torch.randn(B, H_kv, kv + spare, D, generator=g)[:, :, :kv]
    qpos = torch.tensor(lengths)[:, None] + torch.arange(q_len)  # [B, q]
    allowed = (torch.arange(kv)[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # [B, 1, q, kv]
    return query, key, value, allowed, [n + q_len for n in lengths]


@pytest.mark.parametrize("split", [7, 12, 30])
def test_rows_of_different_lengths_split_at_a_column_match_float64(split):
    """``_ragged_attention``: every row over its first C columns, the longer rows over their own
    columns past C, merged by log-sum-exp, against the float64 oracle over the whole mask."""
    g = torch.Generator().manual_seed(split)
    lengths = [31, 4, 9, 40, 2]
    query, key, value, allowed, extents = _rows_of_lengths(lengths, 3, g)
    assert not any(split < e < split + 3 for e in extents)  # a split the chooser may take
    with torch.inference_mode(), row_extents(extents):
        out = _ragged_attention(query, key, value, allowed, 8 ** -0.5, 3, split)
    assert out.shape == (5, 3, 9, 8)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, 8 ** -0.5), atol=1e-5, rtol=1e-5)


def test_the_split_is_taken_where_one_row_is_far_longer_and_never_inside_a_rows_new_columns(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = torch.Generator().manual_seed(5)
    module = _Module(3)
    query, key, value, allowed, extents = _rows_of_lengths([1200, 100, 120, 90, 80, 110, 95, 130], 5, g)
    with torch.inference_mode(), row_extents(extents):
        assert _ragged_split(module, query, key) == 135  # one extra row past the 8 rows' first 135 columns
        out, _ = sdpa_gqa_attention(module, query, key, value, allowed, scaling=8 ** -0.5)
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, 8 ** -0.5), atol=1e-5, rtol=1e-5)
    # rows of similar lengths: one pass; outside row_extents, or on a sliding-window layer: never
    _, key2, _, _, similar = _rows_of_lengths([100, 120, 90, 80, 110, 95, 130, 105], 5, g)
    with row_extents(similar):
        assert _ragged_split(module, query, key2) is None
    assert _ragged_split(module, query, key) is None
    module.sliding_window = 64
    with row_extents(extents):
        assert _ragged_split(module, query, key) is None
    # a split must not fall inside a row's new columns (that row's first queries would see nothing past it)
    _, key3, _, _, near = _rows_of_lengths([1200, 133, 120, 90, 80, 110, 95, 130], 5, g)
    with row_extents(near):
        split = _ragged_split(_Module(3), query, key3)
    assert split is not None and not any(split < e < split + 5 for e in near)


def test_one_query_per_row_splits_too_and_otherwise_runs_transformers_own_attention(monkeypatch):
    """A target-only step of R rows (one new token each) over rows far apart: the split, against the
    float64 oracle; rows of similar lengths, or outside ``row_extents``: transformers' sdpa."""
    import dspark.kernels.attention as attention

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = torch.Generator().manual_seed(6)
    module = _Module(3)
    calls = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    query, key, value, allowed, extents = _rows_of_lengths([1200, 100, 120, 90, 80, 110, 95, 130], 1, g)
    with torch.inference_mode(), row_extents(extents):
        assert _ragged_split(module, query, key) == 131
        out, _ = sdpa_gqa_attention(module, query, key, value, allowed, scaling=8 ** -0.5)
    assert not calls
    torch.testing.assert_close(out.double(), _reference(query, key, value, allowed, 8 ** -0.5), atol=1e-5, rtol=1e-5)
    query2, key2, value2, allowed2, similar = _rows_of_lengths([100, 120, 90, 80, 110, 95, 130, 105], 1, g)
    for extents_or_none in (similar, None):
        with torch.inference_mode(), row_extents(extents_or_none) if extents_or_none else contextlib.nullcontext():
            out, _ = sdpa_gqa_attention(module, query2, key2, value2, allowed2, scaling=8 ** -0.5)
        torch.testing.assert_close(out.double(), _reference(query2, key2, value2, allowed2, 8 ** -0.5),
                                   atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
    # a kernel call costs more columns at one query per row than at five: fewer rows of their own
    _, key4, _, _, mixed = _rows_of_lengths([57, 75, 100, 127, 164, 232, 361, 662], 1, g)
    with row_extents(mixed):
        assert _ragged_split(module, query, key4) == 362
    query5, key5, _, _, mixed5 = _rows_of_lengths([57, 75, 100, 127, 164, 232, 361, 662], 5, g)
    with row_extents(mixed5):
        assert _ragged_split(module, query5, key5) == 237


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
