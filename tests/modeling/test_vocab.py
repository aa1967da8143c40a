"""The draft vocabulary (dspark.modeling.vocab): its tables from hand-made counts, the restricted
and renormalised loss against a float64 reference written here, exact losslessness of
verification when the target puts mass outside the vocabulary (chi-square), the checkpoint round
trip, and a training run with a draft vocabulary."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers.targets import make_tiny_target, tiny_drafter_config
from dspark.decoding.loop import speculative_generate
from dspark.training.fused_loss import LogitFactors, fused_dspark_loss
from dspark.training.loss import LossWeights, dspark_loss
from dspark.modeling import Drafter, load_drafter, save_drafter
from dspark.modeling.vocab import DraftVocab
from dspark.decoding.verify import rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- tables
def test_tables_from_a_hand_made_count():
    # V = 10; counts favour ids 7, 2, 9 (9 and 4 tie at 3: the lower id, 4, wins the last place).
    counts = torch.tensor([0, 1, 8, 0, 3, 0, 0, 9, 0, 3])
    vocab = DraftVocab.from_counts(counts, 4)
    assert vocab.draft_ids.tolist() == [2, 4, 7, 9]
    # draft id i -> target id i + d2t[i]: 0->2, 1->4, 2->7, 3->9
    assert vocab.d2t.tolist() == [2, 3, 5, 6]
    assert vocab.t2d.tolist() == [False, False, True, False, True, False, False, True, False, True]
    assert vocab.to_target_ids(torch.tensor([3, 0])).tolist() == [9, 2]
    assert vocab.to_draft_ids(torch.tensor([7, 8])).tolist() == [2, -1]
    assert vocab.coverage(counts) == pytest.approx((8 + 3 + 9 + 3) / 24)
    assert DraftVocab.from_counts(counts, 3).draft_ids.tolist() == [2, 4, 7]  # 4 before 9 at equal counts


def test_d2t_round_trips_and_inconsistent_t2d_is_refused(tmp_path):
    vocab = DraftVocab.from_target_ids([5, 1, 3, 5], 8)
    assert vocab.draft_ids.tolist() == [1, 3, 5]
    path = vocab.save(tmp_path / "v.safetensors", {"mode": "hard"})
    assert DraftVocab.load(path) == vocab
    assert json.loads(path.with_suffix(".json").read_text()) == {"draft_vocab_size": 3, "vocab_size": 8, "mode": "hard"}
    bad = vocab.state()
    bad["t2d"][0] = True
    with pytest.raises(ValueError, match="t2d"):
        DraftVocab.from_state(bad)
    with pytest.raises(ValueError, match="strictly increasing"):
        DraftVocab(torch.tensor([3, 1]), 8)


def test_restrict_renormalises_and_drops_an_argmax_outside():
    vocab = DraftVocab.from_target_ids([0, 2], 4)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.3, 0.1]])
    probs, keep = vocab.restrict(p)
    assert torch.allclose(probs, torch.tensor([[0.25, 0.75], [0.625, 0.375]]))
    assert keep.tolist() == [False, True]  # row 0's argmax is id 3, outside
    logp, keep2, log_mass = vocab.restrict_logits(p.log())
    assert torch.allclose(logp.exp(), probs) and keep2.tolist() == [False, True]
    assert torch.allclose(log_mass.exp(), torch.tensor([0.4, 0.8]))
    full = vocab.to_target(probs)
    assert full.tolist() == [[0.25, 0.0, 0.75, 0.0], [0.625, 0.0, 0.375, 0.0]]


# --------------------------------------------------------------------------- the loss
def _reference_loss(draft, target, labels, valid, conf, weights, ids):
    """Float64, from the definitions (docs/training.md, "A draft vocabulary"): p^t restricted to ids and renormalised;
    CE only where the target argmax and the label lie in ids, TV where the target argmax does (against the
    full target where the label lies outside); c* against the full target."""
    draft, target, conf = draft.double(), target.double(), conf.double()
    w = torch.exp(-torch.arange(labels.shape[1], dtype=torch.float64) / weights.decay_gamma)
    p_full = torch.softmax(target, -1)
    p_in = p_full[..., ids]
    p_t = p_in / p_in.sum(-1, keepdim=True)
    in_ids = lambda x: (x.unsqueeze(-1) == ids).any(-1)  # noqa: E731
    label_in = in_ids(labels)
    keep_tv = valid & in_ids(target.argmax(-1))
    keep = keep_tv & label_in
    logp = torch.log_softmax(draft, -1)
    draft_label = (labels.unsqueeze(-1) == ids).long().argmax(-1)
    ce = -logp.gather(-1, draft_label.unsqueeze(-1)).squeeze(-1)
    p_d = logp.exp()
    tv = (p_d - p_t).abs().sum(-1)
    tv_full = (p_d - p_in).abs().sum(-1) + (1 - p_in.sum(-1))
    tv = torch.where(label_in, tv, tv_full)
    c_star = (1 - 0.5 * tv_full.detach()).clamp(0, 1)
    den = (w * valid).sum()
    kw, kw_tv = w * keep, w * keep_tv
    bce = F.binary_cross_entropy_with_logits(conf, c_star, reduction="none")
    loss = (weights.ce * (kw * ce).sum() + weights.tv * (kw_tv * tv).sum() + weights.conf * (w * valid * bce).sum()) / den
    return loss, c_star


def _loss_case(seed=0, N=6, gamma=4, V=12, d=8, r=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0, 2, 3, 5, 7, 8, 11])
    h = torch.randn(N, gamma, d, generator=g, dtype=torch.float64)
    t = torch.randn(N, gamma, d, generator=g, dtype=torch.float64)
    w_lm = torch.randn(V, d, generator=g, dtype=torch.float64)
    lat = torch.randn(N, gamma, r, generator=g, dtype=torch.float64)
    w2 = torch.randn(len(ids), r, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (N, gamma), generator=g)
    valid = torch.arange(gamma) < torch.randint(1, gamma + 1, (N, 1), generator=g)
    conf = torch.randn(N, gamma, generator=g, dtype=torch.float64)
    return ids, h, t, w_lm, lat, w2, labels, valid, conf


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_restricted_loss_and_gradients_equal_a_float64_reference(path):
    ids, h, t, w_lm, lat, w2, labels, valid, conf = _loss_case()
    vocab = DraftVocab(ids, w_lm.shape[0])
    weights = LossWeights(ce=0.3, tv=0.7, conf=0.5, decay_gamma=2.0)
    leaves = [x.clone().requires_grad_() for x in (h, lat, w2, conf)]
    hr, latr, w2r, confr = leaves
    ref, c_ref = _reference_loss(hr @ w_lm[ids].T + latr @ w2r.T, t @ w_lm.T, labels, valid, confr, weights, ids)
    ref_grads = torch.autograd.grad(ref, leaves)
    argmax_in = valid & vocab.contains((t @ w_lm.T).argmax(-1))
    kept = argmax_in & vocab.contains(labels)
    assert 0 < int(kept.sum()) < int(valid.sum())  # the case drops some positions and keeps others
    assert int((argmax_in & ~kept).sum()) > 0  # ... and has labels outside whose TV is kept

    ours = [x.clone().requires_grad_() for x in (h, lat, w2, conf)]
    ho, lato, w2o, confo = ours
    if path == "fused":
        factors = LogitFactors(ho, vocab.head_weight(w_lm), t, latent=lato, w2=w2o, vocab=vocab,
                               target_lm_head_weight=w_lm)
        out = fused_dspark_loss(factors, labels, valid, confo, weights, chunk_rows=2)
    else:
        out = dspark_loss(lambda a, b: ho[a:b] @ w_lm[ids].T + lato[a:b] @ w2o.T, lambda a, b: t[a:b] @ w_lm.T,
                          labels, valid, confo, weights, chunk_rows=2, vocab=vocab)
    grads = torch.autograd.grad(out.loss, ours)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)
    masked_c = torch.where(valid, c_ref, torch.zeros_like(c_ref)).sum(0)
    assert torch.allclose(out.accept_sum.double(), masked_c, rtol=1e-5)
    for mine, theirs in zip(grads, ref_grads):
        assert torch.allclose(mine, theirs, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_a_label_outside_keeps_its_tv_against_the_full_target(path):
    """Hand case: V = 3, vocabulary {0, 1}, p^t = (0.5, 0.3, 0.2), label 2 (outside), p^d = (0.8, 0.2) on
    {0, 1}. CE is undefined and dropped; TV against the full target is
    |0.8 − 0.5| + |0.2 − 0.3| + |0 − 0.2| = 0.6, so L = α_tv·0.6 with one supervised position."""
    vocab = DraftVocab(torch.tensor([0, 1]), 3)
    eye = torch.eye(3, dtype=torch.float64)
    t = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log().reshape(1, 1, 3)  # target logits log p^t
    h = torch.tensor([0.8, 0.2, 1.0], dtype=torch.float64).log().reshape(1, 1, 3).requires_grad_()
    labels, valid = torch.tensor([[2]]), torch.tensor([[True]])
    weights = LossWeights(ce=0.3, tv=0.7, conf=0.0)
    if path == "fused":
        factors = LogitFactors(h, vocab.head_weight(eye), t, vocab=vocab, target_lm_head_weight=eye)
        out = fused_dspark_loss(factors, labels, valid, None, weights)
    else:
        out = dspark_loss(lambda a, b: h[a:b] @ eye[:2].T, lambda a, b: t[a:b] @ eye.T, labels, valid, None,
                          weights, vocab=vocab)
    assert out.loss.item() == pytest.approx(0.7 * 0.6, abs=1e-12)
    assert out.ce.item() == 0.0 and out.tv.item() == pytest.approx(0.6, abs=1e-12)
    assert out.accept_sum.tolist() == pytest.approx([0.7], abs=1e-7)  # c* = 1 − ½·0.6
    # s = sign(p^d − p^t) = (+1, −1) on {0, 1}, ⟨p, s⟩ = 0.6: ∂TV/∂z = p ⊙ (s − ⟨p, s⟩) = (0.32, −0.32)
    (grad,) = torch.autograd.grad(out.loss, h)
    assert grad[0, 0, :2].tolist() == pytest.approx([0.7 * 0.32, -0.7 * 0.32], abs=1e-12)


def test_full_vocabulary_as_draft_vocabulary_is_the_plain_loss():
    """k = V (identity map) gives the loss without a vocabulary, when no argmax is dropped."""
    _, h, t, w_lm, lat, _, labels, valid, conf = _loss_case(seed=3)
    V = w_lm.shape[0]
    w2 = torch.randn(V, lat.shape[-1], dtype=torch.float64)
    weights = LossWeights()
    plain = fused_dspark_loss(LogitFactors(h, w_lm, t, latent=lat, w2=w2), labels, valid, conf, weights)
    vocab = DraftVocab(torch.arange(V), V)
    full = fused_dspark_loss(LogitFactors(h, w_lm, t, latent=lat, w2=w2, vocab=vocab, target_lm_head_weight=w_lm),
                             labels, valid, conf, weights)
    assert full.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert torch.allclose(full.accept_sum, plain.accept_sum)


# --------------------------------------------------------------------------- losslessness
def _first_token_pvalue(target_probs, draft_probs_k, vocab, n, seed, law=None):
    """One-draft rounds verified against target_probs [2, V]: the first emitted token (accepted
    draft or correction) against ``law`` (default: target_probs' first row)."""
    from helpers.decoding import chi_square_pvalue

    gen = torch.Generator().manual_seed(seed)
    q = vocab.to_target(draft_probs_k).expand(n, 1, -1)  # [n, 1, V], zero outside
    x = torch.multinomial(q[:, 0], 1, replacement=True, generator=gen)  # [n, 1]
    p = target_probs.expand(n, 2, -1)
    accepted, nxt = rejection_sample(x, q, p, generator=gen)
    first = torch.where(accepted > 0, x[:, 0], nxt)
    law = target_probs[0] if law is None else law
    return chi_square_pvalue(torch.bincount(first, minlength=vocab.vocab_size), law.double())


def test_verification_is_lossless_when_the_target_has_mass_outside_the_vocabulary():
    vocab = DraftVocab.from_target_ids([0, 1, 3], 6)
    p_t = torch.tensor([0.05, 0.3, 0.15, 0.1, 0.25, 0.15])  # 0.55 of the mass lies outside {0, 1, 3}
    target = torch.stack([p_t, p_t])
    draft = torch.tensor([0.6, 0.1, 0.3])
    assert _first_token_pvalue(target, draft, vocab, 60_000, seed=0) > 1e-3
    # Negative control: verifying against the target restricted to the vocabulary loses the outside mass.
    restricted = vocab.to_target(vocab.restrict(target)[0])
    assert _first_token_pvalue(restricted, draft, vocab, 60_000, seed=1, law=p_t) < 1e-3


def test_speculative_decoding_with_a_draft_vocabulary_keeps_the_targets_distribution():
    """End to end: a random drafter over 5 of 8 ids; the first three emitted tokens against the
    target's exact joint law (test_decoding's oracle), outside ids included."""
    from helpers.decoding import chi_square_pvalue, exact_joint, random_drafter

    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    base = random_drafter(target, gamma=1, seed=2)
    config = base.config.replace(draft_vocab_size=5)
    drafter = Drafter(config)
    state = {k: v for k, v in base.state_dict().items() if k != "markov_head.markov_w2.weight"}
    drafter.load_state_dict({**drafter.state_dict(), **state})
    vocab = DraftVocab.from_target_ids([0, 2, 3, 5, 6], 8)
    drafter.set_vocab(vocab).attach_target(target)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    prompt, V, samples = [1, 3, 2, 0], 8, 1000
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V, V)
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, max_new_tokens=3, temperature=1.0, generator=gen)
        counts[tuple(out.tokens)] += 1
    proposal = drafter.propose_from_features(torch.randn(1, 3, drafter.fc.in_features), torch.tensor([1]))
    assert bool(vocab.contains(proposal.tokens).all())
    assert float(proposal.probs[0, :, ~vocab.t2d].abs().sum()) == 0.0
    exact = exact_joint(target, prompt, 3, 1.0)
    assert float(exact.sum((1, 2))[~vocab.t2d].sum()) > 0.1  # the target has mass outside
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


# --------------------------------------------------------------------------- checkpoint, training
@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_a_drafter_with_a_draft_vocabulary_round_trips_through_its_checkpoint(tmp_path, variant):
    target = make_tiny_target("qwen3")
    heads = {} if variant == "dspark" else dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    config = tiny_drafter_config(target, draft_vocab_size=40, variant=variant, **heads)
    drafter = Drafter(config).attach_target(target)
    vocab = DraftVocab.from_target_ids(torch.arange(3, 160, 4)[:40], target.vocab_size)
    drafter.set_vocab(vocab)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = save_drafter(drafter, tmp_path / "d", include_shared=True)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["draft_vocab_size"] == 40
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(tensors["d2t"], vocab.d2t) and torch.equal(tensors["t2d"], vocab.t2d)
    assert tuple(tensors["lm_head.weight"].shape) == (40, config.hidden_size)
    if variant == "dspark":
        assert tuple(tensors["markov_head.markov_w2.weight"].shape) == (40, 8)
        assert tuple(tensors["markov_head.markov_w1.weight"].shape) == (target.vocab_size, 8)
    for loaded in (load_drafter(folder, target), load_drafter(folder)):  # target's head / the file's k rows
        assert loaded.vocab == vocab
        feats = torch.randn(2, 5, drafter.fc.in_features, generator=torch.Generator().manual_seed(0))
        a = drafter.propose_from_features(feats, torch.tensor([3, 4]), temperature=0.0)
        b = loaded.propose_from_features(feats, torch.tensor([3, 4]), temperature=0.0)
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs, atol=1e-6)


def test_training_a_tiny_drafter_with_a_draft_vocabulary_runs(tmp_path):
    import dataclasses

    from helpers.training import synthetic_samples, tiny_config
    from dspark.data.dataset import RenderedSource
    from dspark.build import build_drafter
    from dspark.training.trainer import Trainer

    target = make_tiny_target("llama")
    config = tiny_config(target, str(tmp_path), max_steps=3)
    config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter, draft_vocab_size=48))
    vocab = DraftVocab.from_target_ids(torch.arange(0, 128, 2)[:48], 128)
    drafter = build_drafter(config, target).set_vocab(vocab)
    w2_before = drafter.markov_head.markov_w2.weight.detach().clone()
    result = Trainer(config, target, drafter, RenderedSource(synthetic_samples(128)), progress=False).fit()
    assert result.steps == 3
    assert not torch.equal(drafter.markov_head.markov_w2.weight, w2_before)
    assert all(math.isfinite(r["loss"]) for r in result.history if "loss" in r)
    assert tuple(drafter.shared_weights()["lm_head.weight"].shape) == (48, 64)
    assert not drafter.shared_weights()["lm_head.weight"].requires_grad
    assert load_drafter(result.out_dir / "drafter", target).vocab == vocab


def test_export_writes_what_vllm_reads_and_refuses_destinations_without_d2t(tmp_path):
    from dspark.interop.export import ExportRefused, export_drafter

    target = make_tiny_target("qwen3")
    drafter = Drafter(tiny_drafter_config(target, draft_vocab_size=40)).attach_target(target)
    vocab = DraftVocab.from_target_ids(torch.arange(1, 160, 4), target.vocab_size)
    drafter.set_vocab(vocab)
    folder = export_drafter(drafter, tmp_path / "vllm", "vllm")
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == target.vocab_size
    assert torch.equal(tensors["d2t"], vocab.d2t)  # target id = draft id + d2t[draft id]
    assert torch.equal(tensors["lm_head.weight"], target.lm_head_weight()[vocab.draft_ids])
    assert tuple(tensors["markov_head.markov_w2.weight"].shape) == (40, 8)
    for destination in ("sglang", "deepspec"):
        with pytest.raises(ExportRefused, match="draft vocabulary"):
            export_drafter(drafter, tmp_path / destination, destination)


def test_the_lm_head_rows_are_gathered_once_and_follow_a_new_vocabulary():
    target = make_tiny_target("llama")
    drafter = Drafter(tiny_drafter_config(target, draft_vocab_size=10)).attach_target(target)
    drafter.set_vocab(DraftVocab.from_target_ids(torch.arange(10, 20), 128))
    rows = drafter.shared_weights()["lm_head.weight"]
    with torch.no_grad():
        drafter.d2t.copy_(drafter.d2t.clone())  # an in-place rewrite of the same ids (as DDP's buffer sync)
    assert drafter.shared_weights()["lm_head.weight"] is rows
    assert torch.equal(rows, target.lm_head_weight()[10:20])
    drafter.set_vocab(DraftVocab.from_target_ids(torch.arange(30, 40), 128))
    assert torch.equal(drafter.shared_weights()["lm_head.weight"], target.lm_head_weight()[30:40])


def test_fused_and_chunked_restricted_losses_agree_with_a_softcap():
    ids, h, t, w_lm, lat, w2, labels, valid, conf = _loss_case(seed=5)
    vocab, cap, weights = DraftVocab(ids, w_lm.shape[0]), 2.0, LossWeights()
    softcap = lambda x: torch.tanh(x / cap) * cap  # noqa: E731
    ours = [x.clone().requires_grad_() for x in (h, lat, w2)]
    factors = LogitFactors(ours[0], vocab.head_weight(w_lm), t, latent=ours[1], w2=ours[2], softcap=cap, vocab=vocab,
                           target_lm_head_weight=w_lm)
    fused = fused_dspark_loss(factors, labels, valid, conf, weights)
    theirs = [x.clone().requires_grad_() for x in (h, lat, w2)]
    chunked = dspark_loss(lambda a, b: softcap(theirs[0][a:b] @ w_lm[ids].T) + theirs[1][a:b] @ theirs[2].T,
                          lambda a, b: softcap(t[a:b] @ w_lm.T), labels, valid, conf, weights, vocab=vocab)
    assert fused.loss.item() == pytest.approx(chunked.loss.item(), rel=1e-10)
    for a, b in zip(torch.autograd.grad(fused.loss, ours), torch.autograd.grad(chunked.loss, theirs)):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)
