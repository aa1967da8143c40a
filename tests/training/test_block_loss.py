"""dspark.block_loss: the trainer's micro-step loss in one call, with the same numbers."""

from __future__ import annotations

import pytest
import torch
from helpers.targets import make_tiny_target
from helpers.training import synthetic_samples, tiny_config

import dspark
from dspark.data.dataset import RenderedSource, collate
from dspark.training.schedule import anchors_for
from dspark.training.step import build_loss_module


def _batch(target, n=3):
    data = RenderedSource(synthetic_samples(target.vocab_size, n=n, seed=4))
    batch = collate([data[i] for i in range(n)])
    drawn = [anchors_for(data[i]["loss_mask"], 6, 7, 0, i) for i in range(n)]
    return batch, torch.stack([a for a, _ in drawn]), torch.stack([k for _, k in drawn])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chunked"])
@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_block_loss_is_the_trainers_micro_step_loss(tmp_path, family, fused, one_thread):
    target = make_tiny_target(family)
    config = tiny_config(target, str(tmp_path))
    config.loss.fused = fused
    drafter = dspark.build_drafter(config, target)
    module = build_loss_module(drafter, target, config.loss)
    batch, anchors, keep = _batch(target)
    raw, metrics = module(batch, anchors, keep)
    raw_grads = torch.autograd.grad(raw, drafter.trainable_parameters(), allow_unused=True)

    target_out = target(batch["input_ids"], return_logits=False)
    kwargs = dict(weights=module.weights, chunk_rows=config.loss.chunk_rows, fused=fused)
    out = dspark.block_loss(drafter, target_out, batch["input_ids"], batch["loss_mask"], anchors, keep,
                            denominator=torch.ones(()), **kwargs)
    grads = torch.autograd.grad(out.loss, drafter.trainable_parameters(), allow_unused=True)
    assert torch.equal(out.loss, raw)  # the same bits as the trainer's step
    for mine, theirs in zip(grads, raw_grads):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    for name in ("ce", "tv", "conf", "accept_sum", "prefix_sum"):
        assert torch.equal(getattr(out, name), metrics[name])

    # Default: the weighted mean over the batch's supervised positions (Eq. 12 as a mean).
    mean = dspark.block_loss(drafter, (target_out.features, target_out.last_hidden), batch["input_ids"],
                             batch["loss_mask"], anchors, keep, **kwargs)
    torch.testing.assert_close(mean.loss, raw / metrics["weight"], rtol=1e-5, atol=1e-6)
    assert metrics["weight"] > 0


def test_block_loss_keeps_every_anchor_without_keep_and_refuses_an_eagle3_drafter(tmp_path):
    from helpers.eagle3 import tiny_eagle3

    target = make_tiny_target("qwen3")
    drafter = dspark.build_drafter(tiny_config(target, str(tmp_path)), target)
    batch, anchors, _ = _batch(target, n=1)
    out = target(batch["input_ids"], return_logits=False)
    every = torch.ones_like(anchors, dtype=torch.bool)
    args = (drafter, out, batch["input_ids"], batch["loss_mask"], anchors)
    assert torch.equal(dspark.block_loss(*args).loss, dspark.block_loss(*args, every).loss)
    with pytest.raises(ValueError, match="Eagle3"):
        dspark.block_loss(tiny_eagle3(target), *args[1:])
