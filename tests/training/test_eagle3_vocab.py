"""Eagle3 with a draft vocabulary (dspark.modeling.vocab): the restricted loss, lossless decoding
when the target puts mass outside the vocabulary, checkpoints with and without one, and the
`dspark vocab` -> `dspark train` config route for every drafter variant.

Oracles: a float64 re-derivation of the restricted loss from its definition (EAGLE-3's rule), the
target's exact joint law by enumeration (chi-square), the saved tensors themselves.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.targets import make_tiny_target
from helpers.training import synthetic_samples, tiny_config
from safetensors.torch import load_file
from helpers.eagle3 import tiny_eagle3

from dspark.training.eagle3_loss import eagle3_loss, supervision_mask
from dspark.modeling import Eagle3Drafter, load_drafter, save_drafter
from dspark.modeling.vocab import DraftVocab

pytestmark = pytest.mark.usefixtures("one_thread")


def eagle3_with_vocab(target, ids, preset: str = "eagle3", seed: int = 0) -> tuple[Eagle3Drafter, DraftVocab]:
    vocab = DraftVocab.from_target_ids(ids, target.vocab_size)
    drafter = tiny_eagle3(target, preset, seed=seed, draft_vocab_size=vocab.size)
    return drafter.set_vocab(vocab), vocab


def reference_restricted_loss(drafter, vocab, hidden, final, loss_mask) -> tuple[float, list[int]]:
    """The default-convention TTT loss with EAGLE-3's restriction, entry by entry in float64:
    z over the k ids (the target LM head's rows), p_t renormalised over them, entries whose full
    argmax lies outside dropped from numerator and denominator. Returns (loss, kept per step)."""
    W = drafter.target_lm_head_weight().double()
    ids = vocab.draft_ids
    nw, eps = drafter.norm.weight.detach().double(), drafter.norm.eps
    B, S = loss_mask.shape
    total, denom, kept = 0.0, 0.0, []
    for s, h in enumerate(hidden):
        kept.append(0)
        for b in range(B):
            for i in range(S - s - 2):
                if loss_mask[b, i + s + 2] != 1:
                    continue
                p = torch.softmax(final[b, i + s + 1].double() @ W.T, -1)
                if int(p.argmax()) not in set(ids.tolist()):
                    continue
                x = h[b, i].double()
                z = (x / torch.sqrt(x.pow(2).mean() + eps) * nw) @ W[ids].T
                q = p[ids] / p[ids].sum()
                total += 0.8**s * float(-(q * torch.log_softmax(z, -1)).sum())
                denom += 0.8**s
                kept[-1] += 1
    return total / denom, kept


def test_restricted_loss_equals_a_float64_reference():
    target = make_tiny_target("qwen3")
    used = list(range(3, target.vocab_size, 3))
    drafter, vocab = eagle3_with_vocab(target, used)
    ids = torch.randint(2, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[1, 9:] = 0, 0
    with torch.no_grad():
        out = target(ids)
        hidden = drafter(out.features, ids)
        loss = eagle3_loss(drafter, hidden, out.last_hidden, mask, chunk_rows=5)
    ref, kept = reference_restricted_loss(drafter, vocab, hidden, out.last_hidden, mask)
    supervised = supervision_mask(mask, 7).sum((1, 2)).tolist()
    assert loss.kept.tolist() == kept and sum(kept) < sum(supervised)  # some entries were dropped
    assert loss.count.tolist() == supervised  # ... from the loss, not from the acceptance metrics
    assert float(loss.loss / loss.denominator) == pytest.approx(ref, rel=1e-5)


def _hand_acceptance(p_target: list[float], p_draft: list[float], draft_ids: list[int]) -> tuple[float, float, bool]:
    """(accept, correct) of one supervised entry through the TTT loss's own path, with heads that make
    the teacher's logits log p_target and the draft's log p_draft (identity rows)."""
    from dspark.training.eagle3_loss import _ttt_terms

    V = len(p_target)
    vocab = DraftVocab.from_target_ids(draft_ids, V)
    eye = torch.eye(V, dtype=torch.float64)
    final = torch.zeros(1, 3, V, dtype=torch.float64)
    final[0, 1] = torch.tensor(p_target, dtype=torch.float64).log()  # the teacher of position 0 at step 0
    normed = torch.zeros(1, 3, V, dtype=torch.float64)
    normed[0, 0, : len(p_draft)] = torch.tensor(p_draft, dtype=torch.float64).log()
    sup = torch.zeros(1, 1, 3, dtype=torch.bool)
    sup[0, 0, 0] = True
    head = eye[: len(draft_ids)]  # draft logit i = normed[i]
    _, acc, cor, keep, _ = _ttt_terms((normed,), final, sup, head, eye, vocab, None, 0.8, 4, False)
    return float(acc[0, 0, 0]), float(cor[0, 0, 0]), bool(keep[0, 0, 0])


def test_eagle3_acceptance_is_against_the_full_target_as_dsparks_c_star():
    # 70 % of the target's mass inside {0, 1}, the draft equal to the renormalised target there:
    # verification accepts Σ_v min(p_d, p_t) = 0.42 + 0.28 = 0.70 (the restricted scale says 1.00)
    acc, cor, keep = _hand_acceptance([0.42, 0.28, 0.20, 0.10], [0.6, 0.4], [0, 1])
    assert acc == pytest.approx(0.70, abs=1e-12) and cor == 1.0 and keep
    # the target's argmax (id 2) outside: min(0.6, 0.3) + min(0.4, 0.2) = 0.50, kept in the metric
    # (dropped from the loss), and the draft's argmax is not the target's
    acc, cor, keep = _hand_acceptance([0.30, 0.20, 0.40, 0.10], [0.6, 0.4], [0, 1])
    assert acc == pytest.approx(0.50, abs=1e-12) and cor == 0.0 and not keep


def test_eagle3_acceptance_sums_equal_a_float64_full_vocabulary_reference():
    """accept_sum over every supervised entry, Σ_v min(p_d(v), p_t(v)) with p_d zero outside the
    vocabulary and p_t the full target, and τ_prob's prefix sum, in float64 from the definition."""
    from dspark.training.eagle3_loss import checkpointed_eagle3_loss

    target = make_tiny_target("qwen3")
    drafter, vocab = eagle3_with_vocab(target, list(range(3, target.vocab_size, 3)))
    ids = torch.randint(2, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        out = target(ids)
        hidden = drafter(out.features, ids)
        got = eagle3_loss(drafter, hidden, out.last_hidden, mask, chunk_rows=5)
        general = checkpointed_eagle3_loss(drafter, hidden, out.last_hidden, mask, chunk_rows=5)
    W = drafter.target_lm_head_weight().double()
    nw, eps = drafter.norm.weight.detach().double(), drafter.norm.eps
    sup = supervision_mask(mask, 7)
    acc = torch.zeros(sup.shape, dtype=torch.float64)
    for s, h in enumerate(hidden):
        for b, i in sup[s].nonzero().tolist():
            p_t = torch.softmax(out.last_hidden[b, i + s + 1].double() @ W.T, -1)
            x = h[b, i].double()
            p_d = torch.zeros_like(p_t)
            p_d[vocab.draft_ids] = torch.softmax((x / torch.sqrt(x.pow(2).mean() + eps) * nw) @ W[vocab.draft_ids].T, -1)
            acc[s, b, i] = torch.minimum(p_d, p_t).sum()
    prefix = (torch.cumprod(acc, 0).sum(0) * sup[0]).sum()
    for res in (got, general):
        assert res.count.tolist() == sup.sum((1, 2)).tolist()
        torch.testing.assert_close(res.accept_sum.double(), acc.sum((1, 2)), rtol=1e-5, atol=1e-6)
        assert float(res.prefix_sum) == pytest.approx(float(prefix), rel=1e-5)


def test_proposals_are_target_ids_with_zero_probability_outside():
    target = make_tiny_target("qwen3")
    used = list(range(3, target.vocab_size, 3))
    drafter, vocab = eagle3_with_vocab(target, used)
    assert tuple(drafter.head_weight().shape) == (len(used), drafter.config.hidden_size)
    assert not drafter.head_weight().requires_grad
    ids = torch.randint(2, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = target(ids)
        prop = drafter.propose_from_features(out.features, ids[:, -1], input_ids=ids, temperature=1.0,
                                             generator=torch.Generator().manual_seed(0))
    outside = ~vocab.t2d
    assert bool(vocab.contains(prop.tokens).all())
    assert prop.probs.shape[-1] == target.vocab_size and float(prop.probs[..., outside].abs().max()) == 0
    assert torch.allclose(prop.probs.sum(-1), torch.ones(2, 4))
    assert bool(torch.isinf(prop.logits[..., outside]).all())


def test_speculative_decoding_with_a_draft_vocabulary_keeps_the_targets_distribution():
    """A random Eagle3 drafter over 5 of 8 ids; the first three emitted tokens against the target's
    exact joint law (enumerated), which puts mass outside the vocabulary."""
    from helpers.decoding import chi_square_pvalue, exact_joint

    from dspark.decoding.loop import speculative_generate

    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter, vocab = eagle3_with_vocab(target, [0, 2, 3, 5, 6], seed=2)
    drafter = drafter.eval()
    prompt, V, samples = [1, 3, 2, 0], 8, 1000
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V, V)
    accepted = 0
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, max_new_tokens=3, temperature=1.0, generator=gen)
        counts[tuple(out.tokens[:3])] += 1
        accepted += sum(r.accepted for r in out.rounds)
    assert accepted > samples // 10  # the drafts take part: not target-only decoding in disguise
    exact = exact_joint(target, prompt, 3, 1.0)
    assert float(exact.sum((1, 2))[~vocab.t2d].sum()) > 0.1  # the target has mass outside
    assert float(counts.sum((1, 2))[~vocab.t2d].sum()) > 0  # ... and tokens outside were emitted
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("with_vocab", [False, True])
def test_checkpoint_round_trip_with_and_without_a_draft_vocabulary(tmp_path, with_vocab):
    target = make_tiny_target("qwen3")
    if with_vocab:
        drafter, vocab = eagle3_with_vocab(target, torch.arange(3, 160, 4)[:40])
    else:
        drafter, vocab = tiny_eagle3(target, "eagle3"), None
    folder = save_drafter(drafter, tmp_path / "d", include_shared=True)
    raw = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    if with_vocab:
        assert raw["draft_vocab_size"] == 40
        assert torch.equal(tensors["d2t"], vocab.d2t) and torch.equal(tensors["t2d"], vocab.t2d)
        assert tuple(tensors["lm_head.weight"].shape) == (40, drafter.config.hidden_size)
    else:
        assert "draft_vocab_size" not in raw and "d2t" not in tensors and "t2d" not in tensors
        assert tuple(tensors["lm_head.weight"].shape) == (target.vocab_size, drafter.config.hidden_size)
    ids = torch.randint(2, target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        feats = target(ids).features
    for loaded in (load_drafter(folder, target), load_drafter(folder)):  # target's head / the file's rows
        assert isinstance(loaded, Eagle3Drafter) and loaded.vocab == vocab
        a, b = (d.propose_from_features(feats[:, :7], ids[:, 7], input_ids=ids[:, :7], temperature=0.0)
                for d in (drafter, loaded))
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs, atol=1e-6)


def test_a_wrong_sized_vocabulary_is_refused_by_name():
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target, "eagle3", draft_vocab_size=10)
    with pytest.raises(ValueError, match="draft_vocab_size=10"):
        drafter.set_vocab(DraftVocab.from_target_ids(list(range(12)), target.vocab_size))


# ------------------------------------------------------------- the config route: vocab, then train
def _route_config(tmp_path, target, variant: str):
    from dspark.config import dflash_of, eagle3_of
    from dspark.data.dataset import save_rendered

    data = tmp_path / "data"
    save_rendered(synthetic_samples(target.vocab_size, n=8), data / "rendered.jsonl")
    (data / "split.json").write_text(json.dumps({"train": list(range(6)), "holdout": [6, 7]}))
    config = tiny_config(target, str(tmp_path / "run"), max_steps=2, save_every=100)
    if variant == "eagle3":
        config = eagle3_of(config, "eagle3_deepspec")
    elif variant == "dflash":
        config = dflash_of(config)
    config = dataclasses.replace(
        config, drafter=dataclasses.replace(config.drafter, draft_vocab_size=40),
        data=dataclasses.replace(config.data, data_dir=str(data), feature_mode="online", vocab_counts="hard"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    return path, Path(config.out_dir)


@pytest.mark.parametrize("variant", ["dspark", "dflash", "eagle3"])
def test_dspark_vocab_then_dspark_train_uses_the_written_vocabulary(tmp_path, monkeypatch, variant):
    import dspark.build
    from dspark.cli.main import main

    target = make_tiny_target("llama")
    monkeypatch.setattr(dspark.build, "load_target", lambda config, layer_ids=None: target)
    config, out_dir = _route_config(tmp_path, target, variant)
    assert main(["vocab", "--config", str(config)]) == 0
    path = tmp_path / "data" / "draft_vocab_40.safetensors"
    written = DraftVocab.load(path)
    assert written != DraftVocab(torch.arange(40), target.vocab_size)  # not the placeholder first ids
    assert main(["train", "--config", str(config)]) == 0
    loaded = load_drafter(out_dir / "drafter", target)
    assert loaded.config.variant == variant and loaded.vocab == written
    # without the file, `dspark train` counts the same vocabulary itself first
    path.unlink()
    assert main(["train", "--config", str(config), "--set", f"out_dir={tmp_path / 'again'}"]) == 0
    assert DraftVocab.load(path) == written
    assert load_drafter(tmp_path / "again" / "drafter", target).vocab == written
