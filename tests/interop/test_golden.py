"""Golden fixtures: dspark reproduces the numbers the reference implementations computed.

The fixtures live in tests/golden (helpers.paths.GOLDEN; $DSPARK_GOLDEN names another copy): checkpoints written by
DeepSpec (`Qwen3DSparkModel.save_pretrained`) and by z-lab (`DFlashDraftModel.save_pretrained`), plus the
tensors those implementations computed from them (see the folder's README.md). Each test loads a
checkpoint with `load_drafter`, exactly as a user would, and compares:

- the training case: labels, supervision mask, teacher-forced previous tokens, position weights,
  block hidden states, draft and confidence logits of the supervised slots, and the loss scalars;
- the inference case: three incremental greedy rounds over one context (tokens exactly; logits,
  raw confidence logits and block hidden states within the README's tolerance).

Conventions that differ and are compared as they correspond: DeepSpec's "tv" is its l1 term
(Σ|p_d - p_t|, 2x the total variation), which is what `dspark_loss` reports as `tv` too;
DeepSpec's total divides by (den + 1e-6), ours by den (a relative 1e-7 here).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.data.anchors import block_labels, target_positions
from dspark.training.loss import LossWeights, dspark_loss, position_weights
from dspark.modeling import load_drafter
from dspark.target import TargetModel
from helpers.paths import GOLDEN

DEEPSPEC_FIXTURES = ("dspark_vanilla", "dspark_rnn", "dflash")
pytestmark = pytest.mark.skipif(
    not (GOLDEN / "deepspec" / "target").is_dir(),
    reason=f"needs the golden fixtures in {GOLDEN} (tests/golden, or the folder $DSPARK_GOLDEN names)",
)


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The README's tolerance: max|got - ref| <= 1e-5 * max(1, max|ref|)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got.double() - ref.double()).abs().max().item()
    bound = 1e-5 * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@functools.lru_cache(maxsize=None)
def golden_target(layer_ids: tuple[int, ...]) -> TargetModel:
    return TargetModel.from_pretrained(str(GOLDEN / "deepspec" / "target"), list(layer_ids))


@functools.lru_cache(maxsize=None)
def fixture(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = GOLDEN / path
    return json.loads((folder / "cases.json").read_text()), load_file(str(folder / "cases.safetensors"))


def loaded(path: str):
    """(drafter, target, cases.json, tensors) of one fixture, the drafter via load_drafter."""
    meta, cases = fixture(path)
    folder = GOLDEN / path / "checkpoint"
    ids = json.loads((folder / "config.json").read_text())
    ids = ids.get("target_layer_ids") or ids["dflash_config"]["target_layer_ids"]
    target = golden_target(tuple(ids))
    return load_drafter(folder, target), target, meta, cases


def test_target_features_match_the_reference_extraction():
    _, cases = fixture("deepspec/target_cases")
    target = golden_target((-1, 1, 4))
    with torch.no_grad():
        out = target(cases["train.input_ids"])
        infer = target(cases["infer.context_ids"])
    assert_close(out.features, cases["train.features"], "train.features")
    assert_close(out.last_hidden, cases["train.last_hidden"], "train.last_hidden")
    assert_close(infer.features, cases["infer.features"], "infer.features")


# ------------------------------------------------------------------------------ training
@functools.lru_cache(maxsize=None)
def training_outputs(name: str) -> dict:
    drafter, target, meta, cases = loaded(f"deepspec/{name}")
    ids, loss_mask = cases["train.input_ids"], cases["train.loss_mask"]
    anchors, keep = cases["train.anchors"], cases["train.keep"]
    gamma = drafter.config.block_size
    with torch.no_grad():
        out = target(ids)
        hidden = drafter(out.features, ids, anchors, keep)  # [B, A, γ, d]
        labels, valid, prev = block_labels(ids, loss_mask, anchors, keep, gamma)
        logits = drafter.draft_logits(hidden, prev)  # [B, A, γ, V]
        conf = drafter.confidence_logits(hidden, prev)
        teacher_pos = target_positions(anchors, gamma, ids.shape[1])  # [B, A, γ]
        teacher_hidden = out.last_hidden.gather(1, teacher_pos.reshape(ids.shape[0], -1, 1).expand(-1, -1, out.last_hidden.shape[-1]))
        teacher = target.compute_logits(teacher_hidden).reshape(*labels.shape, -1)
        w = meta["training"]["loss"]["weights"]
        weights = LossWeights(ce=w["ce"], tv=w["tv"], conf=w["conf"], decay_gamma=meta["training"]["loss"]["decay_gamma"])
        flat = lambda t: t.reshape(-1, gamma, *t.shape[3:])  # noqa: E731  [B·A, γ, ...]
        loss = dspark_loss(
            lambda s, e: flat(logits)[s:e], lambda s, e: flat(teacher)[s:e], flat(labels), flat(valid),
            None if conf is None else flat(conf), weights,
        )
    return dict(hidden=hidden, labels=labels, valid=valid, prev=prev, logits=logits, conf=conf, loss=loss,
                keep=keep, gamma=gamma, cases=cases, meta=meta)


@pytest.mark.parametrize("name", DEEPSPEC_FIXTURES)
def test_training_labels_mask_and_previous_tokens_match(name):
    r = training_outputs(name)
    cases, valid = r["cases"], r["valid"]
    assert torch.equal(valid, cases["train.valid"])
    assert torch.equal(r["labels"][valid], cases["train.labels"][valid])
    assert torch.equal(r["prev"][valid], cases["train.prev_tokens"][valid])
    weights = position_weights(r["gamma"], r["meta"]["training"]["loss"]["decay_gamma"]) * valid
    assert_close(weights, cases["train.loss_weight"], "loss_weight")


@pytest.mark.parametrize("name", DEEPSPEC_FIXTURES)
def test_training_hidden_and_logits_match(name):
    r = training_outputs(name)
    cases, valid = r["cases"], r["valid"]
    kept = r["keep"][:, :, None, None]
    assert_close(torch.where(kept, r["hidden"], 0.0), cases["train.hidden"], "hidden")
    assert_close(r["logits"][valid], cases["train.draft_logits"], "draft_logits")
    if "train.confidence_logits" in cases:
        assert_close(r["conf"][valid], cases["train.confidence_logits"], "confidence_logits")
    else:
        assert r["conf"] is None


@pytest.mark.parametrize("name", DEEPSPEC_FIXTURES)
def test_training_loss_scalars_match(name):
    r = training_outputs(name)
    ref = r["meta"]["training"]["loss"]
    loss = r["loss"]
    terms = {"ce": loss.ce, "tv": loss.tv, "total": loss.loss}
    if r["conf"] is not None:
        terms["conf"] = loss.conf
    for key, value in terms.items():
        assert value.item() == pytest.approx(ref[key], rel=1e-5), key


# ----------------------------------------------------------------------------- inference
def greedy_rounds(drafter, cases: dict) -> dict[str, torch.Tensor]:
    """The fixture's three incremental rounds: extend the context by the new rows, propose greedily.

    The block hidden states are read off the drafter's final norm (the only place propose() calls it).
    """
    context = cases["infer.context_ids"]
    captured: list[torch.Tensor] = []
    hook = drafter.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    target = golden_target(tuple(drafter.config.target_layer_ids))
    try:
        with torch.no_grad():
            features = target(context).features
            ctx = drafter.new_context(1)
            tokens, logits, conf = [], [], []
            for start, anchor in zip(cases["infer.context_start"].tolist(), cases["infer.anchor_positions"].tolist()):
                drafter.extend_context(ctx, features[:, start:anchor])
                anchor_token = context[:, anchor]
                prop = drafter.propose(ctx, anchor_token, temperature=0.0)
                tokens.append(prop.tokens[0])
                logits.append(prop.logits[0])
                prev = torch.cat([anchor_token, prop.tokens[0, :-1]])[None]
                if drafter.confidence_head is not None:
                    conf.append(drafter.confidence_logits(captured[-1][:, : drafter.config.block_size], prev)[0])
    finally:
        hook.remove()
    out = {"tokens": torch.stack(tokens), "draft_logits": torch.stack(logits),
           "block_hidden": torch.cat(captured)}
    if conf:
        out["confidence_logits"] = torch.stack(conf)
    return out


@pytest.mark.parametrize("path", [f"deepspec/{n}" for n in DEEPSPEC_FIXTURES] + ["zlab_dflash"])
def test_greedy_rounds_match(path):
    drafter, _, _, cases = loaded(path)
    got = greedy_rounds(drafter, cases)
    assert torch.equal(got["tokens"], cases["infer.tokens"])
    for key in ("draft_logits", "block_hidden", "confidence_logits"):
        if f"infer.{key}" in cases:
            assert_close(got[key], cases[f"infer.{key}"], key)
        else:
            assert key not in got, key


def test_zlab_fixture_loads_as_anchor_plus_masks_with_gamma_block_size_minus_one():
    drafter, *_ = loaded("zlab_dflash")
    c = drafter.config
    assert (c.variant, c.block_layout, c.block_size, c.block_len) == ("dflash", "anchor_plus_masks", 7, 8)
    assert (c.target_layer_ids, c.mask_token_id, c.num_target_layers) == ([1, 3], 999, 6)
