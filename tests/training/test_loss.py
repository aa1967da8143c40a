"""DSpark loss (paper Eq. 8-12) against float64 oracles written from the formulas."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers.memory import LiveStorages

from dspark.training.loss import LossWeights, dspark_loss, naive_dspark_loss, position_weights

N, GAMMA, V = 3, 4, 11
LAMBDA = 4.0
VALID = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)


def _case(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draft = (2 * torch.randn(N, GAMMA, V, generator=gen)).to(dtype)
    target = (2 * torch.randn(N, GAMMA, V, generator=gen)).to(dtype)
    labels = torch.randint(0, V, (N, GAMMA), generator=gen)
    labels[~VALID] = -100  # garbage where unsupervised: the loss must not read it
    conf = torch.randn(N, GAMMA, generator=gen).to(dtype)
    return draft, target, labels, conf


def _loss_on_tensors(draft, target, labels, valid, conf, weights, **kwargs):
    return dspark_loss(
        lambda a, b: draft[a:b], lambda a, b: target[a:b], labels, valid, conf, weights, **kwargs
    )


def _oracle_terms(draft, target, labels, valid, conf, lam):
    """Explicit loops over rows, positions and vocabulary in Python floats (the paper's formulas)."""
    ce = tv = bce = den = 0.0
    accept = [0.0] * GAMMA
    for n in range(draft.shape[0]):
        for k in range(GAMMA):
            if not valid[n, k]:
                continue
            w = math.exp(-k / lam)  # k here is (k−1) of the paper
            zd, zt = draft[n, k].tolist(), target[n, k].tolist()
            sd = sum(math.exp(x) for x in zd)
            st = sum(math.exp(x) for x in zt)
            pd = [math.exp(x) / sd for x in zd]
            pt = [math.exp(x) / st for x in zt]
            l1 = sum(abs(pd[v] - pt[v]) for v in range(len(pd)))
            c_star = min(max(1.0 - 0.5 * l1, 0.0), 1.0)
            c = 1.0 / (1.0 + math.exp(-float(conf[n, k])))
            ce += -w * math.log(pd[int(labels[n, k])])
            tv += w * l1
            bce += -w * (c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            den += w
            accept[k] += c_star
    return ce / den, tv / den, bce / den, accept


def _reference_loss(draft, target, labels, valid, conf, weights, detach_c_star=True):
    """float64 autograd reference of Eq. 12; c* is a constant unless detach_c_star is False."""
    w = torch.exp(-torch.arange(GAMMA, dtype=torch.float64) / weights.decay_gamma) * valid
    p_d = torch.softmax(draft, -1)
    p_t = torch.softmax(target, -1)
    safe = torch.where(valid, labels, 0)
    ce = -torch.log(p_d).gather(-1, safe[..., None]).squeeze(-1)
    l1 = (p_d - p_t).abs().sum(-1)
    c_star = (1 - 0.5 * l1).clamp(0, 1)
    if detach_c_star:
        c_star = c_star.detach()
    c = torch.sigmoid(conf)
    bce = -(c_star * torch.log(c) + (1 - c_star) * torch.log(1 - c))
    den = w.sum()
    return (
        weights.ce * (w * ce).sum() / den
        + weights.tv * (w * l1).sum() / den
        + weights.conf * (w * bce).sum() / den
    )


def test_position_weights_hand_values():
    expected = torch.tensor(
        [1.0, 0.7788007830714049, 0.6065306597126334, 0.4723665527410147,
         0.36787944117144233, 0.2865047968601901, 0.22313016014842982]
    )
    w = position_weights(7, 4.0)
    assert w.dtype == torch.float32 and w.shape == (7,)
    torch.testing.assert_close(w, expected, atol=1e-7, rtol=0)


def test_each_term_matches_the_formulas_computed_by_hand():
    draft, target, labels, conf = _case()
    weights = LossWeights()
    out = _loss_on_tensors(draft, target, labels, VALID, conf, weights)
    ce, tv, bce, accept = _oracle_terms(draft, target, labels, VALID, conf, LAMBDA)
    assert out.ce.item() == pytest.approx(ce, rel=1e-12)
    assert out.tv.item() == pytest.approx(tv, rel=1e-12)
    assert out.conf.item() == pytest.approx(bce, rel=1e-12)
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * tv + 1.0 * bce, rel=1e-12)
    torch.testing.assert_close(out.accept_sum.double(), torch.tensor(accept, dtype=torch.float64))
    assert out.count.tolist() == [3, 2, 1, 1]


def test_mixing_weights_and_decay_are_applied():
    draft, target, labels, conf = _case(seed=1)
    weights = LossWeights(ce=0.3, tv=0.2, conf=0.7, decay_gamma=1.5)
    out = _loss_on_tensors(draft, target, labels, VALID, conf, weights)
    ce, tv, bce, _ = _oracle_terms(draft, target, labels, VALID, conf, 1.5)
    assert out.loss.item() == pytest.approx(0.3 * ce + 0.2 * tv + 0.7 * bce, rel=1e-12)


def test_low_precision_logits_are_reduced_in_fp32():
    draft, target, labels, conf = _case(seed=2)
    draft16, target16 = draft.bfloat16(), target.bfloat16()
    out = _loss_on_tensors(draft16, target16, labels, VALID, conf.float(), LossWeights())
    # Oracle on the same bf16-rounded values; a bf16 softmax would be off by ~1e-2.
    ce, tv, bce, _ = _oracle_terms(draft16.double(), target16.double(), labels, VALID, conf, LAMBDA)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * tv + bce, rel=1e-5)


def test_confidence_target_is_detached():
    draft, target, labels, conf = _case(seed=3)
    weights = LossWeights()
    leaf = draft.clone().requires_grad_(True)
    conf_leaf = conf.clone().requires_grad_(True)
    _loss_on_tensors(leaf, target, labels, VALID, conf_leaf, weights).loss.backward()

    detached = draft.clone().requires_grad_(True)
    _reference_loss(detached, target, labels, VALID, conf, weights).backward()
    attached = draft.clone().requires_grad_(True)
    _reference_loss(attached, target, labels, VALID, conf, weights, detach_c_star=False).backward()

    torch.testing.assert_close(leaf.grad, detached.grad, atol=1e-12, rtol=1e-9)
    # The attached version differs, so the comparison above can tell them apart.
    assert (attached.grad - detached.grad).abs().max() > 1e-3
    expected_conf_grad = torch.autograd.grad(
        _reference_loss(draft, target, labels, VALID, conf_leaf, weights), conf_leaf
    )[0]
    torch.testing.assert_close(conf_leaf.grad, expected_conf_grad, atol=1e-12, rtol=1e-9)


class _DraftSource(torch.nn.Module):
    """Draft logits from hidden states through a bias-free linear LM head."""

    def __init__(self, rows, dim, vocab, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.hidden = torch.nn.Parameter(torch.randn(rows, GAMMA, dim, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen) / dim**0.5)
        self.calls = []

    def logits(self, start, end):
        self.calls.append(end - start)
        return self.hidden[start:end] @ self.head.T  # [n, γ, V]


def _chunk_setup(rows=6, dim=5, vocab=13):
    gen = torch.Generator().manual_seed(11)
    target = torch.randn(rows, GAMMA, vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows, GAMMA), generator=gen)
    lengths = torch.randint(0, GAMMA + 1, (rows,), generator=gen)
    valid = torch.arange(GAMMA)[None] < lengths[:, None]
    conf = torch.randn(rows, GAMMA, generator=gen)
    return target, labels, valid, conf


def _run_chunked(source, target, labels, valid, conf, chunk_rows, denominator=None, rows=slice(None)):
    conf_leaf = conf.clone().requires_grad_(True)
    offset = rows.start or 0
    out = dspark_loss(
        lambda a, b: source.logits(offset + a, offset + b),
        lambda a, b: target[rows][a:b],
        labels[rows], valid[rows], conf_leaf[rows], LossWeights(),
        chunk_rows=chunk_rows, denominator=denominator,
    )
    out.loss.backward()
    grads = [source.hidden.grad.clone(), source.head.grad.clone(), conf_leaf.grad.clone()]
    source.zero_grad()
    return out, grads


@pytest.mark.parametrize("chunk_rows", [1, 2, 6])
def test_chunked_loss_and_gradients_equal_the_unchunked_formula(chunk_rows):
    target, labels, valid, conf = _chunk_setup()
    source = _DraftSource(6, 5, 13, seed=0)
    conf_leaf = conf.clone().requires_grad_(True)
    naive = naive_dspark_loss(source.logits(0, 6), target, labels, valid, conf_leaf, LossWeights())
    naive.loss.backward()
    naive_grads = [source.hidden.grad.clone(), source.head.grad.clone(), conf_leaf.grad.clone()]
    source.zero_grad()

    out, grads = _run_chunked(source, target, labels, valid, conf, chunk_rows)
    torch.testing.assert_close(out.loss, naive.loss, atol=1e-6, rtol=0)
    for got, want in zip(grads, naive_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for name in ("ce", "tv", "conf", "accept_sum"):
        torch.testing.assert_close(getattr(out, name), getattr(naive, name), atol=1e-6, rtol=0)
    assert torch.equal(out.count, naive.count)


def test_global_denominator_makes_micro_batches_add_up_to_the_full_batch():
    target, labels, valid, conf = _chunk_setup()
    source = _DraftSource(6, 5, 13, seed=0)
    full, full_grads = _run_chunked(source, target, labels, valid, conf, chunk_rows=2)
    denominator = (position_weights(GAMMA, LAMBDA) * valid).sum()
    first, first_grads = _run_chunked(source, target, labels, valid, conf, 2, denominator, slice(0, 4))
    second, second_grads = _run_chunked(source, target, labels, valid, conf, 2, denominator, slice(4, 6))
    torch.testing.assert_close(first.loss + second.loss, full.loss, atol=1e-6, rtol=0)
    for a, b, want in zip(first_grads, second_grads, full_grads):
        torch.testing.assert_close(a + b, want, atol=1e-6, rtol=0)


def test_explicit_denominator_scales_loss_and_gradients():
    target, labels, valid, conf = _chunk_setup()
    source = _DraftSource(6, 5, 13, seed=0)
    local, local_grads = _run_chunked(source, target, labels, valid, conf, chunk_rows=4)
    denominator = 3.0 * (position_weights(GAMMA, LAMBDA) * valid).sum()
    scaled, scaled_grads = _run_chunked(source, target, labels, valid, conf, 4, denominator)
    torch.testing.assert_close(scaled.loss * 3.0, local.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(scaled.ce * 3.0, local.ce, atol=1e-6, rtol=0)
    for got, want in zip(scaled_grads, local_grads):
        torch.testing.assert_close(got * 3.0, want, atol=1e-6, rtol=0)


def _peak_fraction(rows, chunk_rows, vocab, naive=False):
    gen = torch.Generator().manual_seed(5)
    source = _DraftSource(rows, 4, vocab, seed=1)
    target = torch.randn(rows, GAMMA, vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows, GAMMA), generator=gen)
    valid = torch.ones(rows, GAMMA, dtype=torch.bool)
    conf = torch.randn(rows, GAMMA, requires_grad=True)
    mode = LiveStorages()
    with mode:
        if naive:
            out = naive_dspark_loss(source.logits(0, rows), target, labels, valid, conf, LossWeights())
        else:
            out = dspark_loss(source.logits, lambda a, b: target[a:b], labels, valid, conf,
                              LossWeights(), chunk_rows=chunk_rows)
        out.loss.backward()
    return mode.peak / (rows * GAMMA * vocab * 4), source.calls


def test_peak_memory_grows_with_the_chunk_not_the_batch():
    rows, vocab = 32, 32_000  # one fp32 [N, γ, V] tensor = 16 MB
    small, calls = _peak_fraction(rows, 2, vocab)
    # Each call covers at most one chunk, and backward recomputes every chunk once.
    assert max(calls) <= 2 and sum(calls) == 2 * rows
    larger, _ = _peak_fraction(rows, 8, vocab)
    whole, _ = _peak_fraction(rows, rows, vocab)
    naive, _ = _peak_fraction(rows, rows, vocab, naive=True)
    # The LM-head gradient ([V, 4], 1/32 of a full tensor here) is the only unchunked buffer.
    assert small < 0.5  # keeping even one full-size tensor would exceed this
    assert small < larger < whole
    assert whole > 2.0 and naive > whole  # the measurement sees full-size tensors when they exist


class _CountSoftmax(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default):
            self.calls.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_forward_runs_one_vocabulary_softmax_for_draft_and_one_for_target():
    target, labels, valid, conf = _chunk_setup()
    source = _DraftSource(6, 5, 13, seed=0)
    mode = _CountSoftmax()
    with mode:
        dspark_loss(source.logits, lambda a, b: target[a:b], labels, valid, conf.requires_grad_(True),
                    LossWeights(), chunk_rows=6)
    assert sorted(mode.calls) == ["_log_softmax", "_softmax"]
    mode = _CountSoftmax()
    with mode:  # the baseline pays for extra softmaxes: the counter can see them
        naive_dspark_loss(source.logits(0, 6), target, labels, valid, conf, LossWeights())
    assert len(mode.calls) > 2


def test_empty_batch_gives_a_zero_loss_that_still_backpropagates():
    source = _DraftSource(0, 5, 13, seed=0)
    out = dspark_loss(source.logits, lambda a, b: torch.zeros(b - a, GAMMA, 13),
                      torch.zeros(0, GAMMA, dtype=torch.long), torch.zeros(0, GAMMA, dtype=torch.bool),
                      torch.zeros(0, GAMMA, requires_grad=True), LossWeights())
    out.loss.backward()
    assert out.loss.item() == 0.0 and (source.head.grad == 0).all()


def test_accept_sum_and_count_hand_values():
    neg = -1e4  # exp(neg) = 0: a one-hot draft
    draft = torch.tensor(
        [[[0.0, 0.0], [0.0, 0.0], [0.0, neg]], [[0.0, 0.0], [0.0, neg], [0.0, 0.0]]],
        dtype=torch.float64,
    )
    p_t = torch.tensor(
        [[[0.7, 0.3], [0.5, 0.5], [0.3, 0.7]], [[0.7, 0.3], [0.3, 0.7], [0.5, 0.5]]],
        dtype=torch.float64,
    )
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    labels = torch.zeros(2, 3, dtype=torch.long)
    out = dspark_loss(lambda a, b: draft[a:b], lambda a, b: p_t.log()[a:b], labels, valid,
                      torch.zeros(2, 3, dtype=torch.float64), LossWeights())
    # acceptance 1 − ½‖p_d − p_t‖₁: (.5,.5) vs (.7,.3) → 0.8; equal → 1; (1,0) vs (.3,.7) → 0.3.
    torch.testing.assert_close(out.accept_sum, torch.tensor([0.8 + 0.8, 1.0 + 0.3, 0.3]))
    assert out.count.tolist() == [2, 2, 1]


def test_dflash_mode_is_weighted_cross_entropy_only():
    draft, target, labels, _ = _case(seed=4)
    weights = LossWeights(ce=1.0, tv=0.0, conf=0.0)
    leaf = draft.clone().requires_grad_(True)
    out = _loss_on_tensors(leaf, target, labels, VALID, None, weights)
    out.loss.backward()
    ce, tv, _, accept = _oracle_terms(draft, target, labels, VALID, torch.zeros(N, GAMMA), LAMBDA)
    assert out.loss.item() == pytest.approx(ce, rel=1e-12)
    assert out.conf.item() == 0.0
    assert out.tv.item() == pytest.approx(tv, rel=1e-12)  # still reported as a metric
    torch.testing.assert_close(out.accept_sum.double(), torch.tensor(accept, dtype=torch.float64))
    ref = draft.clone().requires_grad_(True)
    no_conf = torch.zeros(N, GAMMA, dtype=torch.float64)
    _reference_loss(ref, target, labels, VALID, no_conf, weights).backward()
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-12, rtol=1e-9)


def test_no_supervised_position_gives_zero_loss_not_nan():
    draft, target, labels, conf = _case(seed=5)
    leaf = draft.clone().requires_grad_(True)
    out = _loss_on_tensors(leaf, target, labels, torch.zeros(N, GAMMA, dtype=torch.bool), conf, LossWeights())
    out.loss.backward()
    assert out.loss.item() == 0.0 and (leaf.grad == 0).all()
    assert out.count.tolist() == [0] * GAMMA


def test_shape_errors_name_the_argument():
    draft, target, labels, conf = _case()
    with pytest.raises(ValueError, match="valid"):
        _loss_on_tensors(draft, target, labels, VALID[:, :3], conf, LossWeights())
    with pytest.raises(ValueError, match="confidence_logits"):
        _loss_on_tensors(draft, target, labels, VALID, conf[:2], LossWeights())
    with pytest.raises(ValueError, match="confidence_logits"):
        _loss_on_tensors(draft, target, labels, VALID, None, LossWeights())  # conf weight 1.0
    with pytest.raises(ValueError, match="draft_logits_fn"):
        _loss_on_tensors(draft[:, :3], target, labels, VALID, conf, LossWeights())
    with pytest.raises(ValueError, match="target_logits_fn"):
        _loss_on_tensors(draft, target[..., :5], labels, VALID, conf, LossWeights())
    with pytest.raises(ValueError, match="draft_logits"):
        naive_dspark_loss(draft[:2], target, labels, VALID, conf, LossWeights())
    with pytest.raises(ValueError, match="decay_gamma"):
        LossWeights(decay_gamma=0.0)
