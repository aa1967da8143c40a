"""The answer generator's sampler (dspark.data.answer_sampling).

Oracles: transformers' own warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper) for
the distribution, computed on the whole vocabulary; a chi-square test (Wilson-Hilferty) of the sampler's draws against
it; and transformers' generate for the plumbing (greedy selection of the drawn token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dspark.data.answer_sampling import TopKTopPSampler, topk_topp_probs


def _reference(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling distribution [B, V] (float64), warpers in generate's order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)]
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
    return warpers(None, scores.clone()).double().softmax(dim=-1)


def _dense(probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(probs.shape[0], vocab, dtype=torch.float64).scatter_(-1, ids, probs.double())


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 5, 1.0), (1.3, 50, 0.95), (0.5, 1, 0.8),
                                                     (0.7, 400, 0.8), (2.0, 20, 0.05)])
def test_the_distribution_is_that_of_the_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(top_k)
    scores = torch.randn(6, 300, generator=gen) * 3.0  # continuous: no ties at the k-th logit
    probs, ids = topk_topp_probs(scores, temperature, top_k, top_p)
    assert probs.shape == ids.shape == (6, min(top_k, 300))
    got = _dense(probs, ids, 300)
    want = _reference(scores, temperature, top_k, top_p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, want > 0)  # the same support, token by token


def test_draws_follow_the_distribution():
    torch.manual_seed(0)
    scores = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]]).repeat(40_000, 1)
    sampler = TopKTopPSampler(temperature=0.9, top_k=6, top_p=0.9)
    out = sampler(None, scores)  # [N, 8]: 0 at the drawn token, -inf elsewhere
    assert torch.all((out == 0).sum(-1) == 1) and torch.all(torch.isinf(out[out != 0]))
    drawn = out.argmax(-1)
    counts = np.bincount(drawn.numpy(), minlength=8)
    want = _reference(scores[:1], 0.9, 6, 0.9)[0].numpy()
    support = want > 0
    assert counts[~support].sum() == 0
    expected = want[support] / want[support].sum() * counts.sum()
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))  # Wilson-Hilferty
    assert z < 3.09, (counts, want, chi2)  # p > 0.001


def test_generate_takes_the_drawn_token_and_the_same_seed_draws_the_same():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.tensor([[1, 5, 9, 3], [7, 2, 8, 4]])
    seen = []

    class Spy(TopKTopPSampler):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            seen.append(out.argmax(-1))
            return out

    def run(seed):
        seen.clear()
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             logits_processor=LogitsProcessorList([Spy(0.8, 10, 0.9)]), pad_token_id=0)
        return out[:, ids.shape[1]:], torch.stack(seen, dim=1)

    tokens, drawn = run(3)
    assert torch.equal(tokens, drawn)  # greedy selection takes exactly the sampler's draw
    assert torch.equal(run(3)[0], tokens) and not torch.equal(run(4)[0], tokens)


def test_bad_settings_are_refused_with_the_field():
    with pytest.raises(ValueError, match="temperature"):
        TopKTopPSampler(0.0, 20, 0.8)
    with pytest.raises(ValueError, match="top_k"):
        TopKTopPSampler(0.7, 0, 0.8)
    with pytest.raises(ValueError, match="top_p"):
        TopKTopPSampler(0.7, 20, 0.0)
