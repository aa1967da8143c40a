"""layers.tiled_sdpa: the training attention over tiles of query rows equals one dense SDPA call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.data.anchors import sample_anchors
from dspark.modeling import training_mask
from dspark.modeling import layers


def _inputs(B=2, S=90, A=24, L=4, H=4, Hkv=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[0, :30] = False
    loss_mask[1:, 20:] = False  # row 1 has fewer candidates than A: padding blocks (keep False)
    anchors, keep = sample_anchors(loss_mask, A, generator=g)
    mask = training_mask(anchors, keep, S, L)  # [B, 1, A·L, S + A·L]
    Q, K = A * L, S + A * L
    q, k, v = (torch.randn(B, h, n, hd, generator=g, dtype=torch.float64, requires_grad=True)
               for h, n in ((H, Q), (Hkv, K), (Hkv, K)))
    return q, k, v, mask, keep


def test_tiled_sdpa_equals_dense_sdpa_and_its_gradients(monkeypatch):
    q, k, v, mask, keep = _inputs()
    assert not bool(keep.all())  # the padding-block path is exercised
    for rows in (7, 20, 64):  # 7: tiles that cut blocks of L = 4
        monkeypatch.setattr(layers, "TILE_ROWS", rows)
        got = layers.attention(q, k, v, mask, 0.3, "sdpa")
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        w = torch.randn_like(ref)
        g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
        g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_tiles_really_drop_keys():
    """Power check: a first tile of 20 rows (5 blocks, earliest anchors) sees far fewer keys
    than the dense call."""
    _, _, _, mask, _ = _inputs(B=1)
    first = mask[:, :, :20].any(dim=2).any(dim=0).sum()
    assert int(first) < 0.5 * mask.shape[-1]


def test_drafter_training_forward_with_tiles_equals_dense_attention(tiny_qwen3, tmp_path, monkeypatch):
    """The whole training forward (30 anchors × 3 slots = 90 query rows > TILE_ROWS, so tiled)
    in float64 equals the same drafter with one dense SDPA call per layer."""
    from helpers.training import tiny_config

    from dspark.build import build_drafter

    drafter = build_drafter(tiny_config(tiny_qwen3, str(tmp_path)), tiny_qwen3).double()
    g = torch.Generator().manual_seed(1)
    B, S, A = 2, 80, 30
    ids = torch.randint(2, tiny_qwen3.vocab_size, (B, S), generator=g)
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[1, 25:] = False  # padding blocks in row 1
    anchors, keep = sample_anchors(loss_mask, A, generator=g)
    features = torch.randn(B, S, drafter.fc.in_features, generator=g, dtype=torch.float64)
    assert A * drafter.config.block_len > layers.TILE_ROWS
    tiled = drafter(features, ids, anchors, keep)
    monkeypatch.setattr(layers, "TILE_ROWS", 10**9)  # no tiling: one dense call
    dense = drafter(features, ids, anchors, keep)
    torch.testing.assert_close(tiled, dense, rtol=1e-10, atol=1e-10)
