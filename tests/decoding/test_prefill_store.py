"""dspark.decoding.prefill_store: a decode that starts from a kept prefill gives the tokens of one that
prefills itself, is charged the kept forward's seconds, and the store keeps no more than its budget.

Oracles: the same batched decodes without a store (and batch 1, which they equal), plain byte counts."""

from __future__ import annotations

import pytest
import torch

from dspark.decoding.batch_jobs import BatchJob, speculative_batch_generate, target_batch_generate
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.decoding.prefill_store import PrefillStore
from helpers.decoding import random_drafter
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompts(vocab: int, n: int = 5, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 15, (n,), generator=g)]


def _by_tag(rows):
    return {r.tag: r for r in rows}


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_decodes_from_kept_prefills_give_the_tokens_of_fresh_ones(T):
    """A speculative decode fills the store; a target-only decode and a second speculative decode
    (another R) start from it: the same tokens and rounds as without a store, each request charged
    the kept forward's seconds as its prefill."""
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=3, seed=2)
    prompts = _prompts(target.vocab_size)
    jobs = [BatchJob(p, 50 + i, i) for i, p in enumerate(prompts)]
    kw = dict(max_new_tokens=12, temperature=T, eos_token_ids=[])
    store = PrefillStore()
    first = _by_tag(speculative_batch_generate(target, drafter, jobs, batch_size=3, prefills=store, **kw))
    assert len(store) == len(prompts) and store.misses == len(prompts) and store.hits == 0
    plain = _by_tag(speculative_batch_generate(target, drafter, jobs, batch_size=3, **kw))
    again = _by_tag(speculative_batch_generate(target, drafter, jobs, batch_size=2, prefills=store, **kw))
    base = _by_tag(target_batch_generate(target, jobs, batch_size=3, prefills=store, **kw))
    assert store.hits == 2 * len(prompts) and len(store) == len(prompts)
    for i, p in enumerate(prompts):
        for got in (first[i], again[i]):
            assert got.tokens == plain[i].tokens
            assert [(r.proposed, r.accepted) for r in got.rounds] == [(r.proposed, r.accepted) for r in plain[i].rounds]
        want = target_generate(target, p, generator=torch.Generator().manual_seed(50 + i), **kw)
        assert base[i].tokens == want.tokens
        kept = store.get(target, p).seconds
        assert first[i].timings["prefill"] >= kept  # the forward, then the drafter's context
        assert base[i].timings["prefill"] == kept


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_batch_one_decodes_share_a_kept_prefill_and_never_write_into_it(family):
    """Batch 1 (``dspark.decoding.loop``): the speculative decode keeps its prompt's prefill; a second
    speculative decode and a target-only decode start from copies of it. Same tokens and rounds as
    their own prefills give, the kept forward's seconds charged as their prefill and in their total,
    and the kept cache still holds the prompt alone (gemma4: sliding-window layers too)."""
    target = make_tiny_target(family)
    drafter = random_drafter(target, gamma=3, seed=2)
    prompt = _prompts(target.vocab_size, n=1, seed=8)[0]
    kw = dict(max_new_tokens=14, temperature=1.0, eos_token_ids=[])

    def gen():
        return torch.Generator().manual_seed(21)

    store = PrefillStore()
    first = speculative_generate(target, drafter, prompt, generator=gen(), prefills=store, **kw)
    kept = store.get(target, prompt)
    keys = [layer.keys.clone() for layer in kept.cache.layers]
    again = speculative_generate(target, drafter, prompt, generator=gen(), prefills=store, **kw)
    base = target_generate(target, prompt, generator=gen(), prefills=store, **kw)
    plain = speculative_generate(target, drafter, prompt, generator=gen(), **kw)
    for got in (first, again):
        assert got.tokens == plain.tokens
        assert [(r.proposed, r.accepted) for r in got.rounds] == [(r.proposed, r.accepted) for r in plain.rounds]
    assert base.tokens == target_generate(target, prompt, generator=gen(), **kw).tokens
    assert base.timings["prefill"] == kept.seconds and base.timings["total"] > kept.seconds
    assert again.timings["prefill"] >= kept.seconds  # charged, then the drafter's context and x_0
    assert store.hits == 3 and store.misses == 1 and len(store) == 1
    assert kept.cache.get_seq_length() == len(prompt)
    for before, layer in zip(keys, kept.cache.layers):
        assert torch.equal(before, layer.keys)


def test_the_store_keeps_no_more_than_its_budget_and_only_for_its_target():
    target, other = make_tiny_target("llama"), make_tiny_target("llama")
    prompts = _prompts(target.vocab_size, n=4)
    store = PrefillStore()
    jobs = [BatchJob(p, i, i) for i, p in enumerate(prompts)]
    target_batch_generate(target, jobs, batch_size=2, max_new_tokens=2, prefills=store)
    sizes = {}
    for p in prompts:
        kept = store.get(target, p)
        layers = kept.cache.layers
        want = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        want += sum(t.numel() * t.element_size() for t in (kept.out.logits, kept.out.features, kept.out.last_hidden))
        assert kept.nbytes == want
        sizes[tuple(p)] = want
    assert store.nbytes == sum(sizes.values())
    assert store.get(other, prompts[0]) is None  # another target's prefill is never handed out
    small = PrefillStore(max_bytes=sizes[tuple(prompts[0])] + sizes[tuple(prompts[1])])
    target_batch_generate(target, jobs, batch_size=1, max_new_tokens=2, prefills=small)
    assert len(small) == 2 and small.nbytes <= small.max_bytes  # the first two fit, the others do not
    assert small.get(target, prompts[2]) is None
    with pytest.raises(ValueError, match="max_bytes"):
        PrefillStore(max_bytes=-1)
