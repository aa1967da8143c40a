"""The vocabulary projection's kernel choice and the decode dtype resolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark import build as runtime
from dspark.kernels.lm_head import vocab_logits


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_logits_equals_the_float64_projection(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 48, generator=gen).to(dtype)
    hidden = torch.randn(rows, 48, generator=gen).to(dtype)
    got = vocab_logits(hidden, weight)
    want = hidden.double() @ weight.double().T
    assert got.shape == (rows, 1000) and got.dtype == dtype and got.is_contiguous()
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.1}
    torch.testing.assert_close(got.double(), want, **tol)


def test_vocab_logits_keeps_leading_dims_and_takes_strided_input():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 32, generator=gen)
    hidden = torch.randn(2, 32, 9, generator=gen).transpose(1, 2)[:, :3]  # [2, 3, 32], not contiguous
    got = vocab_logits(hidden, weight)  # 6 rows: the W @ hᵀ branch
    assert got.shape == (2, 3, 500)
    torch.testing.assert_close(got, F.linear(hidden, weight), rtol=1e-5, atol=1e-5)


def test_vocab_logits_gradient_matches_f_linear():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=gen)
    hidden = torch.randn(5, 16, generator=gen, requires_grad=True)
    grad_out = torch.randn(5, 300, generator=gen)
    (g_ours,) = torch.autograd.grad((vocab_logits(hidden, weight) * grad_out).sum(), hidden)
    (g_ref,) = torch.autograd.grad((F.linear(hidden, weight) * grad_out).sum(), hidden)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-5)


def test_resolve_dtype_names_and_errors():
    assert runtime.resolve_dtype("float32", "cpu") == torch.float32
    assert runtime.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert runtime.dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="dtype='fp8'.*auto"):
        runtime.resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("native", [True, False])
def test_resolve_dtype_auto_on_cpu_follows_native_bf16(monkeypatch, native):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native)
    assert runtime.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def test_cpu_has_native_bf16_reads_torch_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert runtime.cpu_has_native_bf16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert runtime.cpu_has_native_bf16() is True


def test_vocab_logits_bits_do_not_depend_on_the_weights_address():
    """MKL's W @ hᵀ changes its bits for a weight that is not 16-byte aligned (a view into a
    memory-mapped checkpoint); such a weight takes F.linear, aligned ones all agree."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(5000, 64, generator=gen)
    hidden = torch.randn(7, 64, generator=gen)
    buffer = torch.empty(weight.numel() + 16)
    results = {}
    for offset in (0, 1, 2, 4, 8):  # floats: 0, 4, 8, 16, 32 bytes past an aligned start
        placed = buffer[offset : offset + weight.numel()].view_as(weight)
        placed.copy_(weight)
        results[placed.data_ptr() % 16 == 0, offset] = vocab_logits(hidden, placed)
    aligned = [v for (ok, _), v in results.items() if ok]
    misaligned = [v for (ok, _), v in results.items() if not ok]
    assert len(aligned) >= 2 and len(misaligned) >= 1
    assert all(torch.equal(v, aligned[0]) for v in aligned)
    assert all(torch.equal(v, F.linear(hidden, weight)) for v in misaligned)
    torch.testing.assert_close(aligned[0], misaligned[0], rtol=1e-5, atol=1e-5)


def test_auto_device_and_attention_follow_the_hardware(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.resolve_device("auto") == torch.device("cpu")
    assert runtime.resolve_device("cpu") == torch.device("cpu")
    assert runtime.resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert runtime.resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert runtime.resolve_attention("eager", torch.device("cuda", 0)) == "eager"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert runtime.resolve_device("auto") == torch.device("cuda", 3)  # this torchrun rank's GPU
    assert runtime.resolve_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("rows", [1, 7, 9])
def test_vocab_logits_without_the_row_major_copy_has_the_same_values(rows):
    """contiguous=False may hand back the W·hᵀ product's transposed view (7 rows: the W @ hᵀ
    branch); the values are those of the row-major result, bit for bit, and of the float64 product."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1000, 48, generator=gen)
    hidden = torch.randn(1, rows, 48, generator=gen)
    loose, tight = vocab_logits(hidden, weight, contiguous=False), vocab_logits(hidden, weight)
    assert loose.shape == tight.shape == (1, rows, 1000) and tight.is_contiguous()
    assert loose.is_contiguous() == (rows != 7)  # only the few-row branch skips the copy
    assert torch.equal(loose, tight)
    torch.testing.assert_close(loose.double(), hidden.double() @ weight.double().T, rtol=1e-5, atol=1e-4)
