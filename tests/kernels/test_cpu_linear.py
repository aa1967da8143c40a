"""oneDNN-packed weights for few-row CPU products (dspark.kernels.cpu_linear).

Oracles: a float64 matmul for the values; ``F.linear`` itself, bit for bit, wherever the
packed kernel must not be taken (many rows, autograd, unregistered weights, ``suspended``);
a counter on the packed kernel for which path ran.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.kernels import cpu_linear
from dspark.config import load_config
from dspark.config_checks import validate
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.kernels.lm_head import vocab_logits
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")

ATOL = 1e-5  # fp32 products of length <= 64 with values O(1): a different summation order


@pytest.fixture
def packed_calls(monkeypatch):
    """How many times the packed kernel ran."""
    calls = []
    real = cpu_linear._packed_product

    def counted(x, packed, bias):
        calls.append(tuple(x.shape))
        return real(x, packed, bias)

    monkeypatch.setattr(cpu_linear, "_packed_product", counted)
    return calls


def _weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 7, 8, cpu_linear.FEW_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_a_float64_product(rows, with_bias, packed_calls):
    w, x = _weight(48, 64), _weight(rows, 64, seed=1).reshape(1, rows, 64)
    bias = _weight(1, 48, seed=2)[0] if with_bias else None
    cpu_linear.register(w)
    out = cpu_linear.linear(x, w, bias)
    expected = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert out.shape == (1, rows, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=ATOL)
    assert len(packed_calls) == 1


@pytest.mark.skipif(not cpu_linear.can_pack(torch.bfloat16), reason="this CPU cannot pack bf16 weights")
@pytest.mark.parametrize("rows", [1, 8])
def test_packed_bfloat16_linear_matches_a_float64_product_of_the_bf16_operands(rows, packed_calls):
    w, x = _weight(48, 64).bfloat16(), _weight(rows, 64, seed=1).bfloat16()
    cpu_linear.register(w)
    out = cpu_linear.linear(x, w)
    expected = x.double() @ w.double().T  # exact products of the bf16 values, rounded once at the end
    assert out.dtype == torch.bfloat16 and len(packed_calls) == 1
    # the output is rounded to bf16 (8 bits of mantissa): 2^-8 of the value, plus fp32 accumulation
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("case", ["many rows", "unregistered", "suspended", "autograd", "float64"])
def test_everything_else_is_f_linear_bit_for_bit(case, packed_calls):
    w = _weight(48, 64)
    rows = cpu_linear.FEW_ROWS + 1 if case == "many rows" else 8
    x = _weight(rows, 64, seed=1)
    if case != "unregistered":
        cpu_linear.register(w)
    if case == "autograd":
        x.requires_grad_(True)
    if case == "float64":
        w, x = w.double(), x.double()
        cpu_linear.register(w)
    if case == "suspended":
        with cpu_linear.suspended():
            out = cpu_linear.linear(x, w)
    else:
        out = cpu_linear.linear(x, w)
    assert torch.equal(out, F.linear(x, w)) and packed_calls == []
    if case == "autograd":  # gradients flow as through F.linear
        out.sum().backward()
        torch.testing.assert_close(x.grad, w.sum(0).expand(rows, -1))


def test_a_weight_changed_in_place_is_packed_again():
    w, x = _weight(48, 64), _weight(4, 64, seed=1)
    cpu_linear.register(w)
    first = cpu_linear.linear(x, w)
    with torch.no_grad():
        w.mul_(-2.0)
    torch.testing.assert_close(cpu_linear.linear(x, w), -2.0 * first, rtol=0, atol=ATOL)


def test_a_detached_view_shares_the_registration_and_a_dead_weight_leaves_the_registry():
    w = _weight(48, 64)
    cpu_linear.register(w)
    assert cpu_linear.is_registered(w.detach())
    assert not cpu_linear.is_registered(w[:10])  # other rows: another product
    before = len(cpu_linear._REGISTRY)
    del w
    gc.collect()
    assert len(cpu_linear._REGISTRY) == before - 1


def test_vocab_logits_takes_the_packed_head(packed_calls):
    head, h = _weight(500, 32), _weight(7, 32, seed=1)
    plain = vocab_logits(h, head)
    cpu_linear.register(head)
    packed = vocab_logits(h, head, contiguous=False)
    torch.testing.assert_close(packed, plain, rtol=0, atol=ATOL)
    assert packed.is_contiguous() and len(packed_calls) == 1


def test_resolve_picks_float32_cpu_for_auto_and_names_the_field_on_a_bad_value():
    cpu = torch.device("cpu")
    assert cpu_linear.resolve("auto", cpu, torch.float32)
    if cpu_linear.can_pack(torch.bfloat16):
        assert cpu_linear.resolve("onednn", cpu, torch.bfloat16)
    else:  # this CPU cannot pack bf16 (no AVX512 / AVX-NE-CONVERT): an explicit request is an error
        with pytest.raises(ValueError, match="target.cpu_linear='onednn' cannot pack"):
            cpu_linear.resolve("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_linear.resolve("onednn", cpu, torch.float64)
    assert not cpu_linear.resolve("torch", cpu, torch.float32)
    assert not cpu_linear.resolve("auto", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="target.cpu_linear"):
        cpu_linear.resolve("mkl", cpu, torch.float32)


@pytest.mark.parametrize("native", [True, False])
def test_auto_packs_bfloat16_only_on_a_cpu_with_native_bf16(monkeypatch, native):
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: native)
    monkeypatch.setitem(cpu_linear._CAN_PACK, torch.bfloat16, True)  # whatever this CPU can
    assert cpu_linear.resolve("auto", torch.device("cpu"), torch.bfloat16) is native
    assert cpu_linear.resolve("onednn", torch.device("cpu"), torch.bfloat16)  # asked for: packed either way
    assert not cpu_linear.resolve("auto", torch.device("cpu"), torch.float16)


def test_config_rejects_an_unknown_cpu_linear():
    with pytest.raises(ValueError, match="target.cpu_linear"):
        validate(load_config(None, ["target.cpu_linear=fast"]))


def test_packing_a_target_keeps_its_state_and_its_outputs(packed_calls):
    target = make_tiny_target("llama")
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    keys = set(target.model.state_dict())
    cache = target.new_cache()
    prefix = target(ids[:, :4], past_key_values=cache, use_cache=True)
    plain_step = target(ids[:, 4:12], past_key_values=cache, use_cache=True)  # 8 rows: a verification forward
    n = cpu_linear.pack_linears(target.model)
    assert n == sum(isinstance(m, nn.Linear) for m in target.model.modules()) and n > 0
    assert set(target.model.state_dict()) == keys
    cache = target.new_cache()
    target(ids[:, :4], past_key_values=cache, use_cache=True)
    packed_calls.clear()
    packed_step = target(ids[:, 4:12], past_key_values=cache, use_cache=True)
    assert len(packed_calls) >= n  # every linear of the 8-row forward, plus the LM head
    torch.testing.assert_close(packed_step.logits, plain_step.logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(packed_step.features, plain_step.features, rtol=0, atol=1e-4)
    assert prefix.logits is not None
    assert cpu_linear.unpack_linears(target.model) == n
    assert all(type(m) is nn.Linear for m in target.model.modules() if isinstance(m, nn.Linear))


def test_greedy_speculative_decoding_with_packed_weights_reproduces_greedy_target_decoding():
    from dspark.build import prepare_for_decoding
    from helpers.decoding import random_drafter

    target = make_tiny_target("llama")
    expected = target_generate(target, [1, 5, 9, 2], max_new_tokens=30, temperature=0.0).tokens
    drafter = random_drafter(target)
    cpu_linear.pack_linears(target.model)
    drafter = prepare_for_decoding(target, drafter)
    assert any(type(m) is cpu_linear.PackedLinear for m in drafter.modules())
    assert target_generate(target, [1, 5, 9, 2], max_new_tokens=30, temperature=0.0).tokens == expected
    out = speculative_generate(target, drafter, [1, 5, 9, 2], max_new_tokens=30, temperature=0.0)
    assert out.tokens == expected
