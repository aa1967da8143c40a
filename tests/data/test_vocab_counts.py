"""Token counts that choose a draft vocabulary (dspark.data.vocab_counts): hard counts and the
top-up rule by hand, soft counts against the target's own logits (transformers' forward), from
online forwards and from the feature cache, and the `dspark vocab` recipe end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.targets import make_tiny_target
from helpers.training import synthetic_samples, tiny_config
from dspark.data.dataset import CachedSource, RenderedSource, save_rendered
from dspark.data.render import RenderedSample
from dspark.data.vocab_counts import (
    coverage_table,
    hard_counts,
    soft_counts_from_cache,
    soft_counts_online,
    topped_up,
    write_draft_vocab,
)
from dspark.modeling.vocab import DraftVocab

pytestmark = pytest.mark.usefixtures("one_thread")


def test_hard_counts_count_only_supervised_tokens():
    samples = RenderedSource([RenderedSample(input_ids=[1, 2, 2, 3], loss_mask=[0, 1, 1, 1]),
                              RenderedSample(input_ids=[3, 3, 0], loss_mask=[1, 0, 1])])
    assert hard_counts(samples, 5).tolist() == [1, 0, 2, 2, 0]


def test_top_up_takes_hard_ids_first_then_the_soft_ranking():
    hard = torch.tensor([0, 5, 0, 1, 0, 0], dtype=torch.float64)
    soft = torch.tensor([0.1, 0.2, 0.3, 0.05, 0.9, 0.4], dtype=torch.float64)
    assert topped_up(hard, soft, 1).draft_ids.tolist() == [1]  # k below the seen ids: hard counts alone
    assert topped_up(hard, soft, 2).draft_ids.tolist() == [1, 3]
    assert topped_up(hard, soft, 4).draft_ids.tolist() == [1, 3, 4, 5]  # then 4 (0.9) and 5 (0.4)
    assert DraftVocab.from_counts(soft, 4).draft_ids.tolist() == [1, 2, 4, 5]


def _target_probs_of_next(target, sample):
    """p_t(· | x_≤j) [n, V] at the positions j whose next token is supervised, from transformers' logits."""
    ids = torch.tensor(sample.input_ids)[None]
    with torch.no_grad():
        logits = target.model(ids).logits[0].double()
    rows = torch.tensor([j for j in range(len(sample.input_ids) - 1) if sample.loss_mask[j + 1]])
    return rows, torch.softmax(logits[rows], -1)


def test_soft_counts_sum_the_targets_own_probabilities(tmp_path):
    from dspark.data.cache import TargetCache, build_cache

    target = make_tiny_target("llama")
    samples = synthetic_samples(target.vocab_size, n=3)
    expected = sum(_target_probs_of_next(target, s)[1].sum(0) for s in samples)
    online = soft_counts_online(RenderedSource(samples), target, progress=False)
    assert torch.allclose(online, expected, atol=1e-5)
    # The cache keeps the final hidden state where positions j and j+1 are both supervised.
    cached_expected = 0
    for s in samples:
        rows, probs = _target_probs_of_next(target, s)
        both = torch.tensor([bool(s.loss_mask[j]) for j in rows.tolist()])
        cached_expected = cached_expected + probs[both].sum(0)
    build_cache(target, samples, tmp_path / "cache", precision="fp32", progress=False)
    cache = CachedSource(TargetCache(tmp_path / "cache"))
    assert torch.allclose(soft_counts_from_cache(cache, target, progress=False), cached_expected, atol=1e-4)


def test_coverage_table_measures_each_mode_on_each_set():
    train = torch.tensor([5, 0, 3, 0, 2, 0], dtype=torch.float64)
    soft = torch.tensor([0.1, 0.6, 0.2, 0.0, 0.1, 0.0], dtype=torch.float64)
    held = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.float64)
    rows = coverage_table(["hard", "soft", "hard+soft"], [2, 4], train, soft, {"held": held})
    by = {(r["mode"], r["k"]): r for r in rows}
    assert by["hard", 2] == {"mode": "hard", "k": 2, "train": 0.8, "held": 0.5}  # ids {0, 2}
    assert by["soft", 2]["held"] == 0.5  # ids {1, 2}
    assert by["hard+soft", 4]["held"] == 0.75  # ids {0, 2, 4} + 1
    assert by["hard", 4]["held"] == 0.75  # ids {0, 2, 4} + the lowest id of count 0, 1


def _prepared_run(tmp_path):
    """A tiny target, 8 rendered samples split 6 / 2 in <tmp>/data, and a config asking for k = 40
    from hard counts in online mode: (target, samples, data folder, config)."""
    target = make_tiny_target("llama")
    samples = synthetic_samples(target.vocab_size, n=8)
    data = tmp_path / "data"
    save_rendered(samples, data / "rendered.jsonl")
    (data / "split.json").write_text(json.dumps({"train": list(range(6)), "holdout": [6, 7]}))
    config = tiny_config(target, str(tmp_path))
    config = dataclasses.replace(
        config, drafter=dataclasses.replace(config.drafter, draft_vocab_size=40),
        data=dataclasses.replace(config.data, data_dir=str(data), feature_mode="online", vocab_counts="hard"))
    return target, samples, data, config


def test_the_vocab_recipe_writes_the_vocabulary_its_counts_and_coverage(tmp_path):
    target, samples, data, config = _prepared_run(tmp_path)
    path, info = write_draft_vocab(config, target, ks=[40], progress=False)
    assert path == data / "draft_vocab_40.safetensors"
    train_hard = hard_counts(RenderedSource(samples[:6]), target.vocab_size)
    assert DraftVocab.load(path) == DraftVocab.from_counts(train_hard, 40)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["draft_vocab_size"] == 40 and meta["mode"] == "hard"
    held = hard_counts(RenderedSource(samples[6:]), target.vocab_size)
    assert meta["coverage"]["held-out"] == round(DraftVocab.from_counts(train_hard, 40).coverage(held), 4)
    counts = load_file(str(path.with_suffix(".counts.safetensors")))
    assert torch.equal(counts["train"], train_hard) and "train_soft" in counts


def test_train_counts_a_missing_vocabulary_at_its_default_place_only(tmp_path):
    """`dspark train` with drafter.draft_vocab_size = k and no file writes what `dspark vocab`
    would; a missing file the config names explicitly is an error, not a silent recount."""
    from dspark.cli.main import _draft_vocab_file

    target, samples, data, config = _prepared_run(tmp_path)
    path = _draft_vocab_file(config, target, rank=0, world=1)
    assert path == data / "draft_vocab_40.safetensors"
    train_hard = hard_counts(RenderedSource(samples[:6]), target.vocab_size)
    assert DraftVocab.load(path) == DraftVocab.from_counts(train_hard, 40)
    named = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter, draft_vocab=str(tmp_path / "no.safetensors")))
    assert not _draft_vocab_file(named, target, rank=0, world=1).exists()
    with pytest.raises(FileNotFoundError, match="dspark vocab"):
        DraftVocab.load(_draft_vocab_file(named, target, rank=0, world=1))
