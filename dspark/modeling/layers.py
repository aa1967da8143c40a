"""KV-injected draft decoder layers (Eq. 3) with small per-family adapters.

- `DraftLayer`: a pre-norm decoder layer of the target's family whose attention (`DraftAttention`)
  reads keys/values injected from the fused context; `attention`, `tiled_sdpa`: its kernels.
- `FamilyAdapter`: what differs between Llama, Qwen3 and Gemma4 draft layers, read from the
  family's entry in `dspark.registry.FAMILIES`; `Rotary`: the family's transformers RoPE class.
- `RMSNorm`, `GatedMLP`, `apply_rope`: the pieces `dspark.modeling.eagle3` shares.

Parameter names follow the transformers modeling files and DeepSpec's drafters, so checkpoints
load by name. The per-family table and the names: docs/method.md, "Draft layers".
"""

from __future__ import annotations

import weakref

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

from dspark.modeling.config import DrafterConfig, resolve_attention_dims
from dspark.registry import load_object


@dataclass(frozen=True)
class FamilyAdapter:
    qk_norm: bool
    v_norm: bool
    sandwich_norm: bool
    unit_score_scale: bool
    layer_scalar: bool

    @staticmethod
    def of(family: str) -> "FamilyAdapter":
        """The adapter of a family in dspark.registry.FAMILIES (by family name)."""
        from dspark.registry import FAMILIES

        if family not in FAMILIES or not FAMILIES.get(family).drafter:
            raise ValueError(f"no draft-layer adapter for family {family!r} in dspark.registry.FAMILIES")
        f = FAMILIES.get(family)
        return FamilyAdapter(qk_norm=f.qk_norm, v_norm=f.v_norm, sandwich_norm=f.sandwich_norm,
                             unit_score_scale=f.unit_score_scale, layer_scalar=f.layer_scalar)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 (the same formula for all three families)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, hd]; cos/sin: [B, T, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """RoPE cos/sin for arbitrary positions, delegated to the family's transformers class
    (so every RoPE scaling type the target uses is reproduced exactly)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        rope_cfg = config.rope_config()
        facts = config.family_facts
        cls = load_object(facts.rotary, f"FAMILIES[{facts.name!r}].rotary")
        self.layer_type = facts.rotary_layer_type
        # Kept out of the module tree on purpose: `drafter.to(bfloat16)` must not round the
        # fp32 inverse frequencies, and they are not part of a checkpoint.
        self._inner = {"module": cls(rope_cfg)}

    def forward(self, like: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: Long [B, T] -> cos, sin [B, T, hd] in like.dtype."""
        inner = self._inner["module"]
        if next(inner.buffers()).device != positions.device:
            inner.to(positions.device)
        if self.layer_type:
            return inner(like, positions, self.layer_type)
        return inner(like, positions)


class DraftAttention(nn.Module):
    """Eq. 3: queries from the block; keys/values = [W_K H_ctx ; W_K H_d], [W_V H_ctx ; W_V H_d]."""

    def __init__(self, config: DrafterConfig, adapter: FamilyAdapter) -> None:
        super().__init__()
        base = config.base_config
        d = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = resolve_attention_dims(base)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        bias = bool(base.get("attention_bias", False))
        eps = float(base.get("rms_norm_eps", 1e-6))
        k_eq_v_field = config.family_facts.k_eq_v_field
        self.k_eq_v = bool(k_eq_v_field) and bool(base.get(k_eq_v_field, False))
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = None if self.k_eq_v else nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if adapter.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if adapter.qk_norm else None
        self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False) if adapter.v_norm else None
        self.scaling = 1.0 if adapter.unit_score_scale else self.head_dim**-0.5
        self.attn_implementation = config.attn_implementation

    def project_kv(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values of rows h [B, T, d] at the positions of cos/sin -> [B, Hkv, T, hd] each.

        Used both for the context (once per context position, cacheable) and for the block.
        """
        B, T, _ = h.shape
        k_raw = self.k_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        v = k_raw if self.v_proj is None else self.v_proj(h).view(B, T, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k_raw) if self.k_norm is not None else k_raw
        if self.v_norm is not None:
            v = self.v_norm(v)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return k, v.transpose(1, 2)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        mask: Any = None,
    ) -> Tensor:
        """h: block rows [B, Q, d]; ctx_k/ctx_v: [B, Hkv, S, hd]; mask: None (all visible),
        a bool [B, 1, Q, S+Q] (True = attend) or a flex BlockMask."""
        B, Q, _ = h.shape
        q = self.q_proj(h).view(B, Q, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, Q, hd]
        blk_k, blk_v = self.project_kv(h, cos, sin)
        k = torch.cat([ctx_k.to(blk_k.dtype), blk_k], dim=2)  # [B, Hkv, S+Q, hd]
        v = torch.cat([ctx_v.to(blk_v.dtype), blk_v], dim=2)
        out = attention(q, k, v, mask, self.scaling, self.attn_implementation)  # [B, H, Q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Any, scale: float, impl: str) -> Tensor:
    """Grouped-query attention. q [B, H, Q, hd]; k, v [B, Hkv, K, hd]."""
    if impl == "flex" and mask is not None and not isinstance(mask, Tensor):
        return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    if impl == "eager":
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    if isinstance(mask, Tensor) and mask.dtype == torch.bool and q.device.type == "cpu" and q.shape[2] > TILE_ROWS:
        return tiled_sdpa(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


TILE_ROWS = 64  # query rows per tile of tiled_sdpa (among the fastest at settings S2/S3 of bench/train_step.py)


def tiled_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA over tiles of TILE_ROWS query rows, each against only the keys some row of the tile
    can see: the same attention (masked keys have zero weight either way), less work.

    The training mask is sparse: block a's rows see the context before its anchor and their own
    block (`drafter.training_mask`), so a tile of consecutive rows (anchors ascending) needs a
    prefix of the context and a few block columns, not all S + A·L keys; the CPU's SDPA kernels
    do not skip masked keys, so skipping them shortens the attention (fwd + bwd; bench/train_step.py).
    Every layer of a forward gets the same mask: the tiles (their key columns and mask
    slices) are worked out once per mask (:func:`_tile_plan`).
    q [B, H, Q, hd]; k, v [B, Hkv, K, hd]; mask bool [B, 1, Q, K]."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for r0, r1, cols, tile_mask in _tile_plan(mask):
        outs.append(F.scaled_dot_product_attention(
            q[:, :, r0:r1], k.index_select(2, cols), v.index_select(2, cols),
            attn_mask=tile_mask, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


_PLAN: list[Any] = []  # the last mask's (weakref, version, tile rows, plan)


def _tile_plan(mask: Tensor) -> list[tuple[int, int, Tensor, Tensor]]:
    """(first row, end row, key columns some row of the tile sees, the tile's mask over them) per
    tile of TILE_ROWS query rows of ``mask`` [B, 1, Q, K]; kept for the last mask seen."""
    version = 0 if mask.is_inference() else mask._version  # inference tensors keep no counter
    if _PLAN:
        ref, seen, rows, plan = _PLAN[0]
        if ref() is mask and seen == version and rows == TILE_ROWS:
            return plan
    plan = []
    for r0 in range(0, mask.shape[2], TILE_ROWS):
        m = mask[:, :, r0 : r0 + TILE_ROWS]  # [B, 1, t, K]
        cols = m.any(dim=2).any(dim=0).reshape(-1).nonzero().squeeze(1)  # keys a row of the tile sees
        plan.append((r0, r0 + m.shape[2], cols, m.index_select(-1, cols)))
    _PLAN[:] = [(weakref.ref(mask), version, TILE_ROWS, plan)]
    return plan


_FLEX: list[Any] = []


def _compiled_flex() -> Any:
    """flex_attention must run compiled to be fused (uncompiled it materialises the scores)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


class DraftLayer(nn.Module):
    """A pre-norm decoder layer of the target's family whose attention is KV-injected."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        base = config.base_config
        adapter = FamilyAdapter.of(config.family)
        d = config.hidden_size
        eps = float(base.get("rms_norm_eps", 1e-6))
        act = base.get("hidden_activation") or base.get("hidden_act") or "silu"
        intermediate = config.intermediate_size or int(base["intermediate_size"])
        self.self_attn = DraftAttention(config, adapter)
        self.mlp = GatedMLP(d, intermediate, act, bias=bool(base.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.sandwich = adapter.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)
        if adapter.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None

    def context_kv(self, h_ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Injected keys/values of fused context rows H_ctx (not normed by this layer: Eq. 3)."""
        return self.self_attn.project_kv(h_ctx, cos, sin)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Any = None) -> Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        if self.sandwich:
            h = h + self.post_attention_layernorm(a)
            h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        else:
            h = h + a
            h = h + self.mlp(self.post_attention_layernorm(h))
        if self.layer_scalar is not None:
            h = h * self.layer_scalar
        return h
