"""Sequential heads (paper Eq. 5, Eq. 6, DeepSpec's gated head) against the equations by hand, and
the head contract (dspark.modeling.heads.SequentialHead) that every consumer relies on."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

from dspark.modeling import GatedMarkovHead, MarkovHead, RNNHead
from dspark.modeling.heads import SequentialHead, build_sequential_head
from dspark.registry import HEADS

BUILTIN = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


# ------------------------------------------------------------------ the equations
def _random_head(cls, vocab: int = 11, rank: int = 3, hidden: int = 5, **kwargs):
    head = cls(vocab, rank, hidden, **kwargs)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return head.double()


def test_markov_bias_is_w1_row_times_w2():
    head = _random_head(MarkovHead)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V, r], [V, r]
    prev = torch.tensor([[2, 0, 10], [5, 5, 1]])
    hidden = torch.randn(2, 3, 5, dtype=torch.float64)
    expected = torch.zeros(2, 3, 11, dtype=torch.float64)
    for i in range(2):
        for k in range(3):
            for v in range(11):
                expected[i, k, v] = sum(w1[prev[i, k], j] * w2[v, j] for j in range(3))
    torch.testing.assert_close(head.block_bias(prev, hidden), expected)
    _, step_bias = head.step(head.init_state(2, "cpu", torch.float64), prev[:, 1], hidden[:, 1])
    torch.testing.assert_close(step_bias, expected[:, 1])


def _rnn_by_hand(head: RNNHead, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Eq. 6 for one block (plus DeepSpec's bias b when the head has one): prev [γ], hidden [γ, d] -> B [γ, V]."""
    w1, w2, wj = head.markov_w1.weight, head.markov_w2.weight, head.joint_proj.weight
    bj = head.joint_proj.bias
    r = w1.shape[1]
    s = [0.0] * r
    out = []
    for k in range(prev.shape[0]):
        z = s + w1[prev[k]].tolist() + hidden[k].tolist()
        y = [sum(wj[i, j].item() * z[j] for j in range(len(z))) + (bj[i].item() if bj is not None else 0.0)
             for i in range(3 * r)]
        g, c, o = y[:r], y[r : 2 * r], y[2 * r :]
        sig = [1 / (1 + math.exp(-x)) for x in g]
        s = [sig[i] * s[i] + (1 - sig[i]) * math.tanh(c[i]) for i in range(r)]
        t = [math.tanh(x) for x in o]
        out.append([sum(w2[v, i].item() * t[i] for i in range(r)) for v in range(w2.shape[0])])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("bias", [True, False], ids=["deepspec-bias", "paper-eq6"])
def test_rnn_block_bias_is_the_eq6_recurrence(bias):
    head = _random_head(RNNHead, bias=bias)
    assert (head.joint_proj.bias is not None) == bias
    gen = torch.Generator().manual_seed(8)
    prev = torch.randint(0, 11, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)
    bias = head.block_bias(prev, hidden)
    for i in range(2):
        torch.testing.assert_close(bias[i], _rnn_by_hand(head, prev[i], hidden[i]))


def test_rnn_step_with_a_fresh_zero_state_each_time_is_not_the_recurrence():
    """Gives the carried-state contract test its power: forgetting the state changes positions k >= 2."""
    head = _random_head(RNNHead)
    gen = torch.Generator().manual_seed(9)
    prev = torch.randint(0, 11, (3, 4), generator=gen)
    hidden = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    forgetful = [head.step(head.init_state(3, "cpu", torch.float64), prev[:, k], hidden[:, k])[1] for k in range(4)]
    forgetful = torch.stack(forgetful, 1)
    carried = head.block_bias(prev, hidden)
    torch.testing.assert_close(forgetful[:, 0], carried[:, 0])  # s_0 = 0 either way
    assert (forgetful[:, 1:] - carried[:, 1:]).abs().max() > 1e-2


def test_rnn_step_refuses_a_missing_state():
    head = _random_head(RNNHead)
    with pytest.raises(ValueError, match="state"):
        head.step(None, torch.tensor([1]), torch.zeros(1, 5, dtype=torch.float64))


def test_gated_block_bias_is_w2_of_the_gated_w1_row():
    head = _random_head(GatedMarkovHead)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight  # [V, r], [V, r]
    wg, bg = head.gate_proj.weight, head.gate_proj.bias  # [r, d + r], [r]
    gen = torch.Generator().manual_seed(10)
    prev = torch.randint(0, 11, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)
    expected = torch.zeros(2, 4, 11, dtype=torch.float64)
    for i in range(2):
        for k in range(4):
            e = w1[prev[i, k]].tolist()
            z = hidden[i, k].tolist() + e  # DeepSpec: hidden first, then W1[x_{k-1}]
            gate = [1 / (1 + math.exp(-(sum(wg[j, n].item() * z[n] for n in range(len(z))) + bg[j].item())))
                    for j in range(3)]
            for v in range(11):
                expected[i, k, v] = sum(w2[v, j].item() * gate[j] * e[j] for j in range(3))
    torch.testing.assert_close(head.block_bias(prev, hidden), expected)
    steps = [head.step(None, prev[:, k], hidden[:, k])[1] for k in range(4)]
    torch.testing.assert_close(torch.stack(steps, 1), expected)


# ------------------------------------------------------------------ the contract
def _config(kind: str, **fields):
    """The fields of a DrafterConfig that a head's from_config reads."""
    values = dict(markov_head_type=kind, vocab_size=11, markov_rank=3, hidden_size=5, output_vocab_size=7,
                  rnn_bias=True, head_options={})
    values.update(fields)
    return types.SimpleNamespace(**values)


def test_the_builtin_heads_are_registered_by_their_config_names():
    assert {name: HEADS.get(name) for name in BUILTIN} == BUILTIN
    assert all(HEADS.is_builtin(name) for name in BUILTIN)


@pytest.mark.parametrize("kind", list(BUILTIN))
def test_from_config_builds_a_head_with_the_configured_sizes(kind):
    head = build_sequential_head(_config(kind))
    assert isinstance(head, SequentialHead) and type(head) is BUILTIN[kind]
    assert head.embedding_dim == 3 and head.markov_w1.weight.shape == (11, 3) and head.markov_w2.weight.shape == (7, 3)
    assert head.prev_embedding(torch.tensor([[1, 2]])).shape == (1, 2, 3)


def test_rnn_bias_reaches_the_rnn_head():
    assert build_sequential_head(_config("rnn", rnn_bias=False)).joint_proj.bias is None
    assert build_sequential_head(_config("rnn", rnn_bias=True)).joint_proj.bias is not None


@pytest.mark.parametrize("kind", list(BUILTIN))
def test_step_with_the_carried_state_equals_block_bias(kind):
    """Sampling (init_state + step, left to right) gives the teacher-forced block_bias of training."""
    head = _random_head(BUILTIN[kind])
    gen = torch.Generator().manual_seed(11)
    prev = torch.randint(0, 11, (3, 4), generator=gen)
    hidden = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    state = head.init_state(3, "cpu", torch.float64)
    steps = []
    for k in range(4):
        state, bias = head.step(state, prev[:, k], hidden[:, k])
        steps.append(bias.double())
    torch.testing.assert_close(torch.stack(steps, 1), head.block_bias(prev, hidden))


@pytest.mark.parametrize("kind", list(BUILTIN))
def test_fused_factors_multiply_to_the_block_bias(kind):
    """What the fused loss builds its logits from: latent @ w2ᵀ is the head's bias."""
    head = _random_head(BUILTIN[kind])
    gen = torch.Generator().manual_seed(12)
    prev = torch.randint(0, 11, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)
    latent, w2 = head.fused_factors(prev, hidden)
    torch.testing.assert_close(latent @ w2.t(), head.block_bias(prev, hidden))


class _Bigram(SequentialHead):
    def __init__(self, vocab_size, rank, hidden_size, out_size=None, scale=1.0):
        super().__init__()
        self.embedding_dim = rank
        self.scale = scale
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, out_size or vocab_size, bias=False)

    def prev_embedding(self, tokens):
        return self.w1(tokens)

    def block_bias(self, prev_tokens, hidden):
        return self.scale * self.w2(self.w1(prev_tokens))

    def step(self, state, prev_token, hidden):
        return state, self.scale * self.w2(self.w1(prev_token))


def test_a_registered_head_gets_its_options_and_says_it_cannot_feed_the_fused_loss():
    HEADS.register("test-bigram", _Bigram)
    try:
        head = build_sequential_head(_config("test-bigram", head_options={"scale": 0.25}))
    finally:
        HEADS.unregister("test-bigram")
    assert type(head) is _Bigram and head.scale == 0.25 and head.w2.weight.shape == (7, 3)
    assert head.init_state(2, "cpu", torch.float32) is None
    assert head.fused_factors(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 5)) is None


def test_an_unknown_head_names_the_registry_and_the_choices():
    with pytest.raises(ValueError, match=r"drafter.markov_head_type='nope'.*\['vanilla', 'gated', 'rnn'"):
        build_sequential_head(_config("nope"))


def test_a_builder_that_returns_no_sequential_head_is_refused():
    HEADS.register("not-a-head", lambda: None)
    HEADS.get("not-a-head").from_config = lambda config: nn.Linear(1, 1)  # type: ignore[attr-defined]
    try:
        with pytest.raises(TypeError, match="not a dspark.modeling.heads.SequentialHead"):
            build_sequential_head(_config("not-a-head"))
    finally:
        HEADS.unregister("not-a-head")


def test_the_registry_refuses_a_second_registration_and_keeps_the_builtins():
    with pytest.raises(ValueError, match="already registered"):
        HEADS.register("rnn", _Bigram)
    with pytest.raises(ValueError, match="built in"):
        HEADS.unregister("vanilla")
