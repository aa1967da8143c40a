"""The drafter (paper Eq. 2-7) against a float64 reference written from the equations.

Every drafter here has *all* of its parameters randomised (norm weights away from
1, the Markov W2 away from its zero init, a non-zero confidence bias, Gemma's
layer scalar away from 1), so that a term dropped from an equation changes the
output by much more than the fp32 rounding the tolerances allow.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from helpers.targets import make_tiny_target, tiny_drafter_config
from dspark.modeling import DrafterConfig, Drafter
from helpers.reference_drafter import ReferenceDrafter

FAMILIES = ("llama", "qwen3", "gemma4")
GAMMA = 4
RANK = 8
SEQ = 12

# Anchor positions [B=2, A=4]: anchor 0 (empty context), the last position, and a padding
# block (keep=False) sitting between real ones.
ANCHORS = torch.tensor([[0, 4, 9, 2], [3, 7, 11, 10]])
KEEP = torch.tensor([[True, True, True, False], [True, True, True, True]])


@functools.lru_cache(maxsize=None)
def _target(family: str, **overrides):
    """Tiny frozen targets are read-only, so one per family (and config override) serves every test."""
    return make_tiny_target(family, **overrides)


def _randomize(drafter: Drafter, seed: int = 0) -> Drafter:
    """Give every parameter and buffer a random value of a sensible scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*drafter.named_parameters(), *drafter.named_buffers()]:
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name or name.endswith("layer_scalar"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("markov_w1.weight"):  # an embedding table [V, r]
                p.copy_(noise)
            elif p.dim() == 2:  # a projection [out, in]
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise)
    return drafter


def _drafter(family: str, *, seed: int = 0, randomize: bool = True, target_overrides: dict | None = None, **fields):
    """(target, drafter) for a tiny target; `fields` go to DrafterConfig.from_target_config."""
    target = _target(family, **(target_overrides or {}))
    config = tiny_drafter_config(target, **{"block_size": GAMMA, "markov_rank": RANK, **fields})
    torch.manual_seed(seed)
    drafter = Drafter(config).attach_target(target)
    if randomize:
        _randomize(drafter, seed)
    return target, drafter


def _sequences(target, batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, length + γ] (the tail supplies teacher-forced tokens past the end) and
    the target features [B, length, m·d] of the first `length` positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, length + GAMMA), generator=gen)
    return ids, target(ids[:, :length]).features


def _teacher_forced(ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """prev_tokens [B, A, γ] = ids at anchor, anchor+1, ..., anchor+γ−1 (x_0, x*_1, ...)."""
    offsets = anchors.unsqueeze(-1) + torch.arange(GAMMA)  # [B, A, γ]
    return torch.gather(ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, offsets)


def _assert_close64(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """fp32 result vs float64 reference: error relative to the reference's overall scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=rel, atol=rel * max(scale, 1e-6))


# ------------------------------------------------------------------ training forward
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["anchor_first", "anchor_plus_masks"])
def test_training_forward_matches_reference_per_block(family, layout):
    target, drafter = _drafter(family, block_layout=layout)
    ids, features = _sequences(target, 2, SEQ)
    prev = _teacher_forced(ids, ANCHORS)
    hidden = drafter(features, ids[:, :SEQ], ANCHORS, KEEP)
    logits = drafter.draft_logits(hidden, prev)
    conf = drafter.confidence_logits(hidden, prev)
    assert hidden.shape == (2, 4, GAMMA, target.hidden_size)
    ref = ReferenceDrafter.from_drafter(drafter, target.model.config)
    for b in range(2):
        for a in range(4):
            if not KEEP[b, a]:
                continue
            out = ref.block(features[b], int(ANCHORS[b, a]), prev[b, a])
            _assert_close64(hidden[b, a], out.hidden)
            _assert_close64(logits[b, a], out.logits)
            _assert_close64(conf[b, a], out.confidence_logits)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("option", ["rnn", "rnn_paper", "gated", "eager_attention", "flex_attention", "hidden_only_confidence"])
def test_training_forward_matches_reference_for_other_options(option):
    fields = {
        "rnn": dict(markov_head_type="rnn"),
        "rnn_paper": dict(markov_head_type="rnn", rnn_bias=False),
        "gated": dict(markov_head_type="gated"),
        "eager_attention": dict(attn_implementation="eager"),
        "flex_attention": dict(attn_implementation="flex"),
        "hidden_only_confidence": dict(confidence_head_with_markov=False),
    }[option]
    target, drafter = _drafter("qwen3", **fields)
    ids, features = _sequences(target, 2, SEQ, seed=1)
    prev = _teacher_forced(ids, ANCHORS)
    # flex_attention has no CPU backward; its forward (the BlockMask path) still runs here
    with torch.set_grad_enabled(option != "flex_attention"):
        hidden = drafter(features, ids[:, :SEQ], ANCHORS, KEEP)
        logits = drafter.draft_logits(hidden, prev)
        conf = drafter.confidence_logits(hidden, prev)
    ref = ReferenceDrafter.from_drafter(drafter, target.model.config)
    for b, a in [(0, 0), (0, 2), (1, 1), (1, 2)]:
        out = ref.block(features[b], int(ANCHORS[b, a]), prev[b, a])
        _assert_close64(logits[b, a], out.logits)
        _assert_close64(conf[b, a], out.confidence_logits)


def test_dflash_variant_has_no_heads_and_matches_reference():
    target, drafter = _drafter("llama", variant="dflash", block_layout="anchor_plus_masks")
    assert drafter.markov_head is None and drafter.confidence_head is None
    ids, features = _sequences(target, 2, SEQ, seed=2)
    prev = _teacher_forced(ids, ANCHORS)
    hidden = drafter(features, ids[:, :SEQ], ANCHORS, KEEP)
    assert drafter.confidence_logits(hidden, prev) is None
    logits = drafter.draft_logits(hidden, prev)
    ref = ReferenceDrafter.from_drafter(drafter, target.model.config)
    for b, a in [(0, 1), (1, 2)]:
        out = ref.block(features[b], int(ANCHORS[b, a]), prev[b, a])
        _assert_close64(logits[b, a], out.base_logits)


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_gemma4_draft_layers_take_the_full_attention_geometry(k_eq_v):
    """Real Gemma4 full-attention layers differ from sliding ones (head_dim 512 vs 256, and with
    attention_k_eq_v fewer KV heads whose values are the raw keys): draft layers use the former."""
    overrides = dict(global_head_dim=32)  # sliding layers keep head_dim 16
    if k_eq_v:
        overrides.update(attention_k_eq_v=True, num_global_key_value_heads=1)
    target, drafter = _drafter("gemma4", target_overrides=overrides)
    attn = drafter.layers[0].self_attn
    assert attn.k_proj.weight.shape == ((1 if k_eq_v else 2) * 32, target.hidden_size)
    assert (attn.v_proj is None) == k_eq_v
    ids, features = _sequences(target, 2, SEQ, seed=15)
    prev = _teacher_forced(ids, ANCHORS)
    logits = drafter.draft_logits(drafter(features, ids[:, :SEQ], ANCHORS, KEEP), prev)
    ref = ReferenceDrafter.from_drafter(drafter, target.model.config)
    for b, a in [(0, 1), (1, 2)]:
        _assert_close64(logits[b, a], ref.block(features[b], int(ANCHORS[b, a]), prev[b, a]).logits)


# ------------------------------------------------------------------ propose
@pytest.mark.parametrize("family,head", [("llama", "vanilla"), ("qwen3", "rnn"), ("gemma4", "vanilla"), ("qwen3", "gated")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_propose_equals_training_forward_teacher_forced_on_its_own_tokens(family, head, temperature):
    target, drafter = _drafter(family, markov_head_type=head)
    ids, features = _sequences(target, 2, SEQ, seed=3)
    p = 7  # anchor position: the context is positions 0..6
    anchor_tokens = ids[:, p]
    gen = torch.Generator().manual_seed(0)
    prop = drafter.propose_from_features(features[:, :p], anchor_tokens, temperature=temperature, generator=gen)
    prev = torch.cat([anchor_tokens[:, None], prop.tokens[:, :-1]], dim=1)  # [B, γ]
    anchors = torch.full((2, 1), p)
    hidden = drafter(features, ids[:, :SEQ], anchors)[:, 0]  # [B, γ, d]
    torch.testing.assert_close(prop.logits, drafter.draft_logits(hidden, prev), rtol=1e-5, atol=1e-5)
    conf = torch.sigmoid(drafter.confidence_logits(hidden, prev))
    torch.testing.assert_close(prop.confidences, conf, rtol=1e-5, atol=1e-6)
    ref = ReferenceDrafter.from_drafter(drafter, target.model.config)
    for b in range(2):
        out = ref.block(features[b], p, prev[b])
        _assert_close64(prop.logits[b], out.logits)
        _assert_close64(prop.confidences[b], torch.sigmoid(out.confidence_logits))


def _fresh_logits(drafter, features_of_row: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    prop = drafter.propose_from_features(features_of_row[None], anchor[None], temperature=0.0)
    return prop.logits[0]


def test_incremental_context_in_chunks_with_ragged_rows_equals_fresh_context():
    target, drafter = _drafter("qwen3", markov_head_type="rnn")
    ids, features = _sequences(target, 3, SEQ, seed=4)
    lengths = torch.tensor([5, 12, 9])
    anchors = ids[torch.arange(3), lengths]
    ctx = drafter.new_context(3, capacity=2)  # small on purpose: extending must grow it
    fed = torch.zeros(3, dtype=torch.long)
    for chunk in (3, 1, 4, 5):
        take = torch.clamp(lengths - fed, min=0, max=chunk)
        block = torch.full((3, chunk, features.shape[-1]), 1e3)  # garbage beyond num_valid must be ignored
        for b in range(3):
            rows = features[b, fed[b] : fed[b] + take[b]]
            block[b, : rows.shape[0]] = rows
        drafter.extend_context(ctx, block, num_valid=take)
        fed += take
    assert torch.equal(ctx.lengths, lengths)
    prop = drafter.propose(ctx, anchors, temperature=0.0)
    for b in range(3):
        expected = _fresh_logits(drafter, features[b, : lengths[b]], anchors[b])
        torch.testing.assert_close(prop.logits[b], expected, rtol=1e-5, atol=1e-5)


def test_crop_then_extend_forgets_the_cropped_positions():
    target, drafter = _drafter("gemma4")
    ids, features = _sequences(target, 2, SEQ, seed=5)
    _, other = _sequences(target, 2, SEQ, seed=6)  # different features for the re-extended part
    ctx = drafter.new_context(2)
    drafter.extend_context(ctx, features[:, :10])
    keep = torch.tensor([4, 7])
    ctx.crop(keep)
    assert torch.equal(ctx.lengths, keep)
    new = torch.stack([other[0, 4:9], other[1, 7:12]])  # 5 new positions for each row
    drafter.extend_context(ctx, new)
    anchors = torch.tensor([3, 11])
    prop = drafter.propose(ctx, anchors, temperature=0.0)
    for b, (k, n) in enumerate([(4, 5), (7, 5)]):
        row = torch.cat([features[b, :k], other[b, k : k + n]])
        torch.testing.assert_close(prop.logits[b], _fresh_logits(drafter, row, anchors[b]), rtol=1e-5, atol=1e-5)
    ctx.crop(3)  # one length for all rows
    assert ctx.lengths.tolist() == [3, 3]
    with pytest.raises(ValueError):
        ctx.crop(4)


def test_propose_with_an_empty_context_equals_the_block_at_position_zero():
    target, drafter = _drafter("llama")
    ids, features = _sequences(target, 2, SEQ, seed=16)
    prop = drafter.propose_from_features(features[:, :0], ids[:, 0], temperature=0.0)
    prev = torch.cat([ids[:, :1], prop.tokens[:, :-1]], dim=1)
    hidden = drafter(features, ids[:, :SEQ], torch.zeros(2, 1, dtype=torch.long))[:, 0]
    torch.testing.assert_close(prop.logits, drafter.draft_logits(hidden, prev), rtol=1e-5, atol=1e-5)


def test_extend_context_rejects_num_valid_beyond_the_chunk():
    """Counting more valid rows than were given would advance the context over positions whose
    keys/values were never written (stale or zero) without any error."""
    target, drafter = _drafter("qwen3", randomize=False)
    _, features = _sequences(target, 2, SEQ)
    ctx = drafter.new_context(2)
    with pytest.raises(ValueError, match="num_valid"):
        drafter.extend_context(ctx, features[:, :3], num_valid=torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="num_valid"):
        drafter.extend_context(ctx, features[:, :3], num_valid=torch.tensor([-1, 1]))


# ------------------------------------------------------------------ confidence head
@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_is_sigmoid_of_hidden_and_previous_token_embedding(with_markov):
    _, drafter = _drafter("llama", confidence_head_with_markov=with_markov)
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(2, GAMMA, drafter.config.hidden_size, generator=gen)
    prev = torch.randint(0, drafter.config.vocab_size, (2, GAMMA), generator=gen)
    w = drafter.confidence_head.proj.weight[0].double()
    b = drafter.confidence_head.proj.bias[0].double()
    w1 = drafter.markov_head.markov_w1.weight.double()
    d = drafter.config.hidden_size
    assert w.shape[0] == d + (RANK if with_markov else 0)
    expected = torch.zeros(2, GAMMA, dtype=torch.float64)
    for i in range(2):
        for k in range(GAMMA):
            z = (w[:d] * hidden[i, k].double()).sum() + b
            if with_markov:
                z = z + (w[d:] * w1[prev[i, k]]).sum()
            expected[i, k] = 1 / (1 + math.exp(-z.item()))
    actual = torch.sigmoid(drafter.confidence_logits(hidden, prev))
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ sampling
def test_proposal_probs_are_fp32_softmax_of_logits_over_temperature():
    target, drafter = _drafter("qwen3")
    _, features = _sequences(target, 3, SEQ, seed=11)
    T = 0.7
    prop = drafter.propose_from_features(features, torch.tensor([1, 2, 3]), temperature=T,
                                         generator=torch.Generator().manual_seed(0))
    assert prop.probs.dtype == torch.float32 and prop.logits.dtype == torch.float32
    torch.testing.assert_close(prop.probs, torch.softmax(prop.logits / T, dim=-1), rtol=0, atol=1e-7)
    # the sampled tokens have positive probability under the returned distributions
    assert bool((prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all())


def test_temperature_zero_takes_the_argmax():
    target, drafter = _drafter("gemma4")
    _, features = _sequences(target, 3, SEQ, seed=12)
    prop = drafter.propose_from_features(features, torch.tensor([1, 2, 3]), temperature=0.0)
    assert torch.equal(prop.tokens, prop.logits.argmax(-1))
    torch.testing.assert_close(prop.probs, torch.softmax(prop.logits, dim=-1))


def _chi_square_critical(df: int, z: float = 4.0) -> float:
    """Upper quantile of χ²_df at the normal z-score z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@functools.lru_cache(maxsize=None)
def _many_proposals(temperature: float = 0.6, n: int = 4000):
    """n rows with one and the same context and anchor, sampled at a fixed seed."""
    target, drafter = _drafter("qwen3", seed=3)
    _, features = _sequences(target, 1, 6, seed=13)
    prop = drafter.propose_from_features(features.expand(n, -1, -1), torch.full((n,), 3), temperature=temperature,
                                         generator=torch.Generator().manual_seed(1234))
    return drafter.config.vocab_size, prop


def _chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of token counts against expected counts [V]; rare cells (< 5) pooled."""
    observed = torch.bincount(tokens, minlength=expected.shape[0]).double()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    return ((obs - exp) ** 2 / exp).sum().item(), obs.numel() - 1


def test_sampled_tokens_follow_the_returned_probabilities():
    """N identical rows: the first token's counts match probs[:, 0] (chi-square); later positions'
    counts match the sum of each row's own conditional probs (the sequential head makes them
    differ per row)."""
    _, prop = _many_proposals()
    n = prop.tokens.shape[0]
    torch.testing.assert_close(prop.probs[:, 0], prop.probs[:1, 0].expand(n, -1))  # same context, same p_1
    for k in range(GAMMA):
        stat, df = _chi_square(prop.tokens[:, k], prop.probs[:, k].double().sum(0))
        assert df >= 5, "the distribution is too peaked for a meaningful test"
        assert stat < _chi_square_critical(df), f"position {k}: chi2={stat:.1f} with {df} dof"


def test_sampling_check_has_power_against_the_wrong_temperature():
    """The same statistic rejects the T=1 distribution for tokens sampled at T=0.6."""
    _, prop = _many_proposals()
    n = prop.tokens.shape[0]
    stat, df = _chi_square(prop.tokens[:, 0], n * torch.softmax(prop.logits[0, 0].double(), -1))
    assert stat > _chi_square_critical(df)


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_backward_reaches_every_trainable_parameter_and_nothing_frozen(head):
    target, drafter = _drafter("qwen3", markov_head_type=head)
    ids, features = _sequences(target, 2, SEQ, seed=14)
    prev = _teacher_forced(ids, ANCHORS)
    hidden = drafter(features, ids[:, :SEQ], ANCHORS, KEEP)
    logits = drafter.draft_logits(hidden, prev)
    labels = _teacher_forced(ids, ANCHORS + 1)
    loss = -logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).mean()
    loss = loss + drafter.confidence_logits(hidden, prev).sigmoid().mean()
    loss.backward()
    trainable = dict(drafter.named_parameters())
    expected_groups = {"fc", "hidden_norm", "layers", "norm", "markov_head", "confidence_head"}
    assert {name.split(".")[0] for name in trainable} == expected_groups
    for name, p in trainable.items():
        assert p.requires_grad, name
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, f"{name} has an all-zero gradient"
    for name, w in drafter.shared_weights().items():
        assert not w.requires_grad and w.grad is None, name
    for name, p in target.model.named_parameters():
        assert not p.requires_grad and p.grad is None, name
    assert "embed_tokens.weight" not in drafter.state_dict() and "lm_head.weight" not in drafter.state_dict()


# ------------------------------------------------------------------ families and config
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_builds_and_runs_forward_and_propose_with_default_sizes(family):
    target = _target(family)
    config = DrafterConfig.from_target_config(
        target.model.config, target_layer_ids=list(target.target_layer_ids), mask_token_id=1, num_draft_layers=1
    )  # default block size 7, markov rank 256 > V
    drafter = Drafter(config).attach_target(target)
    ids, _ = _sequences(target, 2, SEQ)
    features = target(ids[:, :SEQ]).features
    hidden = drafter(features, ids[:, :SEQ], torch.tensor([[2, 5], [8, 1]]))
    assert hidden.shape == (2, 2, 7, target.hidden_size) and torch.isfinite(hidden).all()
    prop = drafter.propose_from_features(features, ids[:, SEQ], generator=torch.Generator().manual_seed(0))
    assert prop.tokens.shape == (2, 7) and prop.probs.shape == (2, 7, target.vocab_size)
    assert prop.confidences.shape == (2, 7) and bool(((prop.confidences > 0) & (prop.confidences < 1)).all())
    assert torch.isfinite(prop.logits).all()


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(target_layer_ids=[0, 4]), "target_layer_ids"),  # the tiny target has 4 layers: ids 0..3
        (dict(target_layer_ids=[-2, 1]), "target_layer_ids"),
        (dict(target_layer_ids=[2, 1]), "target_layer_ids"),
        (dict(target_layer_ids=[1, 1]), "target_layer_ids"),
        (dict(target_layer_ids=[]), "target_layer_ids"),
        (dict(variant="medusa"), "variant"),
        (dict(block_layout="masks_first"), "block_layout"),
        (dict(markov_head_type="lstm"), "markov_head_type"),
        (dict(mask_token_id=160), "mask_token_id"),  # tiny Qwen3 vocabulary: 160
        (dict(mask_token_id=-1), "mask_token_id"),
        (dict(block_size=0), "block_size"),
        (dict(markov_rank=0), "confidence_head_with_markov"),
        (dict(attn_implementation="flash"), "attn_implementation"),
    ],
)
def test_config_rejects_bad_fields_naming_the_field(fields, name):
    text = _target("qwen3").model.config
    kwargs = {"target_layer_ids": [0, 2, 3], "mask_token_id": 5, **fields}
    with pytest.raises(ValueError, match=name):
        DrafterConfig.from_target_config(text, **kwargs)


def test_attach_shared_rejects_a_table_of_the_wrong_shape():
    target, drafter = _drafter("llama", randomize=False)
    with pytest.raises(ValueError, match="shape"):
        drafter.attach_shared(torch.zeros(7, target.hidden_size), target.lm_head_weight())


@pytest.mark.parametrize("head", ["vanilla", "rnn", None])
def test_sample_block_takes_column_major_base_logits_without_touching_them(head):
    """propose() hands sample_block the LM head's transposed W·hᵀ view (no row-major copy):
    the proposal is the one a row-major copy of the same values gives, bit for bit, and the
    caller's logits are left as they were (the Markov biases go into sample_block's own copy)."""
    fields = {"markov_head_type": head} if head else {"markov_rank": 0, "confidence_head_with_markov": False}
    target, drafter = _drafter("qwen3", **fields)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, GAMMA, drafter.config.hidden_size, generator=gen)
    row_major = torch.randn(2, GAMMA, drafter.config.vocab_size, generator=gen)
    column_major = row_major.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other layout
    assert not column_major.is_contiguous() and torch.equal(column_major, row_major)
    kept = column_major.clone()
    anchors = torch.tensor([1, 2])
    a = drafter.sample_block(hidden, row_major, anchors, generator=torch.Generator().manual_seed(0))
    b = drafter.sample_block(hidden, column_major, anchors, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs) and torch.equal(a.logits, b.logits)
    assert b.logits.is_contiguous() and torch.equal(column_major, kept)
    # the biases were added: with a sequential head the returned logits are not the base ones
    assert torch.equal(b.logits, row_major) == (drafter.markov_head is None)


def test_the_training_forward_names_a_wrong_input_before_any_work(monkeypatch):
    """Features from other layers, 1-D anchors, float ids or a mis-shaped keep: a ValueError naming the
    argument and the shape it needs, raised before the fusion layer or any draft layer runs."""
    target, drafter = _drafter("llama", randomize=False)
    monkeypatch.setattr(drafter, "fuse_context", lambda *a: pytest.fail("ran before the check"))
    ids, features = _sequences(target, 2, SEQ)
    ids = ids[:, :SEQ]
    m_d = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    with pytest.raises(ValueError, match=rf"features must be \[B, S, m·d\] = \[2, {SEQ}, {m_d}\].*target_layer_ids"):
        drafter(features[..., :-1], ids, ANCHORS, KEEP)
    with pytest.raises(ValueError, match=r"anchors must be integer positions \[B, A\]"):
        drafter(features, ids, ANCHORS[0], KEEP)
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        drafter(features, ids.float(), ANCHORS, KEEP)
    with pytest.raises(ValueError, match="keep must be a bool tensor shaped like anchors"):
        drafter(features, ids, ANCHORS, KEEP[:, :2])
