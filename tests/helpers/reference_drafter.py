"""A slow, float64, one-block-at-a-time re-implementation of the drafter (paper Eq. 2-7).

Written from the equations, not from `dspark.modeling`: it shares no code with
it and reads only parameter tensors (by DeepSpec's parameter names), the target's
transformers config and the drafter's plain settings (block size, layout, head
type; no derived property of its config). Every block is computed on its own, with the context cut
to the positions the block mask of Eq. 3 allows (strictly before the anchor), so the
reference has no mask tensor that could share a bug with the one under test.

    ref = ReferenceDrafter.from_drafter(drafter, target_config)
    out = ref.block(features, anchor_pos, prev_tokens)   # one sequence, one block

Per family (transformers' Llama, Qwen3 and Gemma4 text decoder layers):

| family | q/k norm | v norm (no weight) | sandwich norms + layer scalar | score scale | MLP act |
|--------|----------|--------------------|-------------------------------|-------------|---------|
| llama  | no       | no                 | no                            | hd^-1/2     | silu    |
| qwen3  | yes      | no                 | no                            | hd^-1/2     | silu    |
| gemma4 | yes      | yes                | yes                           | 1           | gelu-tanh |

Gemma4 draft layers take the target's *full-attention* geometry (its head_dim and KV
heads, values = raw keys with attention_k_eq_v) and its full-attention "proportional"
RoPE (only the first partial_rotary_factor·hd/2 frequency pairs rotate); the Gemma
embedding is scaled by sqrt(d) and the logits soft-capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64


@dataclass
class BlockOutput:
    """Everything the reference computes for one block (all float64)."""

    hidden: Tensor  # [γ, d] h_1..h_γ after the final norm
    base_logits: Tensor  # [γ, V] U_k
    bias: Tensor  # [γ, V] B_k (zeros without a sequential head)
    logits: Tensor  # [γ, V] U_k + B_k
    confidence_logits: Tensor | None  # [γ] w·[h_k; W1[x_{k-1}]] + b


def _family(model_type: str) -> str:
    return {"llama": "llama", "mistral": "llama", "qwen3": "qwen3", "gemma4": "gemma4", "gemma4_text": "gemma4"}[
        model_type
    ]


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) (* weight), over the last dim."""
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def rope_inverse_frequencies(rope: dict, head_dim: int) -> Tensor:
    """ω_i for i = 0..hd/2−1.

    default:      ω_i = θ^(−2i/hd).
    proportional: (Gemma4 full attention) the first ⌊p·hd/2⌋ frequencies as in default, the
                  remaining ones 0 (those dimension pairs are not rotated), all divided by `factor`.
    """
    theta = float(rope["rope_theta"])
    kind = rope.get("rope_type", "default")
    half = head_dim // 2
    omega = torch.tensor([theta ** (-2.0 * i / head_dim) for i in range(half)], dtype=F64)
    if kind == "default":
        return omega
    if kind == "proportional":
        rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        omega[rotated:] = 0.0
        return omega / float(rope.get("factor", 1.0))
    raise NotImplementedError(f"the reference drafter implements default and proportional RoPE, not {kind!r}")


def rotate(x: Tensor, positions: Tensor, omega: Tensor) -> Tensor:
    """RoPE in transformers' half-split layout: dimension i pairs with i + hd/2.

    x [T, n_heads, hd], positions [T] -> rotated x.
    """
    half = omega.shape[0]
    angle = positions.to(F64)[:, None] * omega[None, :]  # [T, hd/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class ReferenceDrafter:
    """Float64 reference. `params` maps DeepSpec's parameter names (as in `Drafter.state_dict()`) to tensors."""

    def __init__(
        self,
        target_config,
        params: dict[str, Tensor],
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        *,
        mask_token_id: int,
        block_size: int,
        num_draft_layers: int,
        anchor_plus_masks: bool = False,
        head_type: str | None = "vanilla",  # "vanilla" | "gated" | "rnn" | None (no sequential head)
        confidence: str | None = "with_markov",  # "with_markov" | "hidden_only" | None
    ) -> None:
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        self.family = _family(cfg.model_type)
        self.p = {k: v.detach().to(F64) for k, v in params.items()}
        self.embed = embed_weight.detach().to(F64)
        self.lm_head = lm_head_weight.detach().to(F64)
        self.d = int(cfg.hidden_size)
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = int(cfg.num_attention_heads)
        rope = cfg.rope_parameters
        self.k_eq_v = False
        if self.family == "gemma4":
            # Draft layers attend globally: the geometry of the target's full-attention layers
            # (transformers keeps it in per_layer_config) and the full-attention RoPE.
            geometry = cfg.per_layer_config[cfg.layer_types.index("full_attention")]
            self.k_eq_v = bool(getattr(cfg, "attention_k_eq_v", False))  # values = raw key projection
            rope = rope["full_attention"]
        else:
            geometry = cfg
        self.n_kv = int(geometry.num_key_value_heads)
        self.head_dim = int(getattr(geometry, "head_dim", None) or self.d // self.n_heads)
        self.omega = rope_inverse_frequencies(rope, self.head_dim)
        self.act = gelu_tanh if self.family == "gemma4" else silu
        self.score_scale = 1.0 if self.family == "gemma4" else 1.0 / math.sqrt(self.head_dim)
        self.embed_scale = math.sqrt(self.d) if self.family == "gemma4" else 1.0
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.mask_token_id = mask_token_id
        self.gamma = block_size
        self.num_layers = num_draft_layers
        self.anchor_plus_masks = anchor_plus_masks
        self.head_type = head_type
        self.confidence = confidence

    @classmethod
    def from_drafter(cls, drafter, target_config, **overrides) -> "ReferenceDrafter":
        """Read a `Drafter`'s tensors and plain settings (no derived property of its config)."""
        c = drafter.config
        shared = drafter.shared_weights()
        head = None
        if c.variant == "dspark" and c.markov_rank > 0:
            head = c.markov_head_type
        conf = None
        if c.variant == "dspark" and c.enable_confidence_head:
            conf = "with_markov" if c.confidence_head_with_markov else "hidden_only"
        settings = dict(
            mask_token_id=c.mask_token_id,
            block_size=c.block_size,
            num_draft_layers=c.num_draft_layers,
            anchor_plus_masks=c.block_layout == "anchor_plus_masks",
            head_type=head,
            confidence=conf,
        )
        settings.update(overrides)
        embed, lm_head = shared["embed_tokens.weight"], shared["lm_head.weight"]
        return cls(target_config, drafter.state_dict(), embed, lm_head, **settings)

    # ------------------------------------------------------------- backbone
    def _w(self, name: str) -> Tensor:
        return self.p[name]

    def _kv(self, prefix: str, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of rows [T, d] -> [T, n_kv, hd] each (Eq. 3, one half of the concatenation)."""
        T = rows.shape[0]
        k = (rows @ self._w(prefix + "k_proj.weight").T).reshape(T, self.n_kv, self.head_dim)
        if self.k_eq_v:
            v = k
        else:
            v = (rows @ self._w(prefix + "v_proj.weight").T).reshape(T, self.n_kv, self.head_dim)
        if self.family in ("qwen3", "gemma4"):
            k = rms_norm(k, self._w(prefix + "k_norm.weight"), self.eps)
        if self.family == "gemma4":
            v = rms_norm(v, None, self.eps)
        return rotate(k, positions, self.omega), v

    def _attention(self, i: int, x_normed: Tensor, h_ctx: Tensor, ctx_pos: Tensor, blk_pos: Tensor) -> Tensor:
        prefix = f"layers.{i}.self_attn."
        L = x_normed.shape[0]
        q = (x_normed @ self._w(prefix + "q_proj.weight").T).reshape(L, self.n_heads, self.head_dim)
        if self.family in ("qwen3", "gemma4"):
            q = rms_norm(q, self._w(prefix + "q_norm.weight"), self.eps)
        q = rotate(q, blk_pos, self.omega)
        k_ctx, v_ctx = self._kv(prefix, h_ctx, ctx_pos)  # the context is not normed by this layer
        k_blk, v_blk = self._kv(prefix, x_normed, blk_pos)
        keys = torch.cat([k_ctx, k_blk], dim=0)  # [p + L, n_kv, hd]
        values = torch.cat([v_ctx, v_blk], dim=0)
        group = self.n_heads // self.n_kv
        out = torch.zeros(L, self.n_heads, self.head_dim, dtype=F64)
        for h in range(self.n_heads):
            g = h // group  # query heads h·n_kv/n_heads share one kv head (GQA)
            scores = (q[:, h, :] @ keys[:, g, :].T) * self.score_scale  # [L, p + L]
            scores = scores - scores.max(dim=-1, keepdim=True).values
            weights = torch.exp(scores)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[:, h, :] = weights @ values[:, g, :]
        return out.reshape(L, self.n_heads * self.head_dim) @ self._w(prefix + "o_proj.weight").T

    def _mlp(self, i: int, x: Tensor) -> Tensor:
        prefix = f"layers.{i}.mlp."
        gate = x @ self._w(prefix + "gate_proj.weight").T
        up = x @ self._w(prefix + "up_proj.weight").T
        return (self.act(gate) * up) @ self._w(prefix + "down_proj.weight").T

    def _layer(self, i: int, x: Tensor, h_ctx: Tensor, ctx_pos: Tensor, blk_pos: Tensor) -> Tensor:
        prefix = f"layers.{i}."
        normed = rms_norm(x, self._w(prefix + "input_layernorm.weight"), self.eps)
        a = self._attention(i, normed, h_ctx, ctx_pos, blk_pos)
        if self.family == "gemma4":
            x = x + rms_norm(a, self._w(prefix + "post_attention_layernorm.weight"), self.eps)
            m = self._mlp(i, rms_norm(x, self._w(prefix + "pre_feedforward_layernorm.weight"), self.eps))
            x = x + rms_norm(m, self._w(prefix + "post_feedforward_layernorm.weight"), self.eps)
            return x * self._w(prefix + "layer_scalar")
        x = x + a
        return x + self._mlp(i, rms_norm(x, self._w(prefix + "post_attention_layernorm.weight"), self.eps))

    def backbone(self, features: Tensor, anchor_pos: int, anchor_token: int) -> Tensor:
        """h_1..h_γ [γ, d] of the block whose anchor sits at `anchor_pos`.

        features [S, m·d] of one sequence; only rows 0..anchor_pos−1 are read (the block mask of Eq. 3).
        """
        p = int(anchor_pos)
        ctx = features[:p].to(F64)
        h_ctx = rms_norm(ctx @ self._w("fc.weight").T, self._w("hidden_norm.weight"), self.eps)  # Eq. 2
        L = self.gamma + (1 if self.anchor_plus_masks else 0)
        ids = [int(anchor_token)] + [self.mask_token_id] * (L - 1)
        x = self.embed[torch.tensor(ids)] * self.embed_scale  # [L, d]
        ctx_pos = torch.arange(p)
        blk_pos = torch.arange(p, p + L)  # slot i at position p + i
        for i in range(self.num_layers):
            x = self._layer(i, x, h_ctx, ctx_pos, blk_pos)
        x = rms_norm(x, self._w("norm.weight"), self.eps)
        first = 1 if self.anchor_plus_masks else 0  # DFlash: only the mask slots predict
        return x[first : first + self.gamma]

    def base_logits(self, hidden: Tensor) -> Tensor:
        u = hidden @ self.lm_head.T
        if self.softcap:
            u = torch.tanh(u / self.softcap) * self.softcap
        return u

    # --------------------------------------------------------- heads (by hand)
    def markov_bias(self, prev_token: int) -> Tensor:
        """Eq. 5: B(x, v) = Σ_j W1[x, j] W2[j, v] (W2 stored as Linear(r → V): weight [V, r])."""
        w1 = self._w("markov_head.markov_w1.weight")[int(prev_token)]  # [r]
        w2 = self._w("markov_head.markov_w2.weight")  # [V, r]
        V, r = w2.shape
        out = torch.zeros(V, dtype=F64)
        for j in range(r):
            out += w1[j] * w2[:, j]
        return out

    def rnn_biases(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """Eq. 6 unrolled: z_k = [s_{k−1}; W1[x_{k−1}]; h_k] -> (g, c, o); s_0 = 0. Returns [γ, V].
        With DeepSpec's bias b (rnn_bias) the three affine maps are W z + b."""
        w1 = self._w("markov_head.markov_w1.weight")
        w2 = self._w("markov_head.markov_w2.weight")  # [V, r]
        joint = self._w("markov_head.joint_proj.weight")  # [3r, 2r + d]
        r = w1.shape[1]
        b = self.p.get("markov_head.joint_proj.bias", torch.zeros(3 * r, dtype=F64))
        w_gate, w_cand, w_out = joint[:r], joint[r : 2 * r], joint[2 * r :]
        b_gate, b_cand, b_out = b[:r], b[r : 2 * r], b[2 * r :]
        s = torch.zeros(r, dtype=F64)
        biases = []
        for k in range(len(prev_tokens)):
            z = torch.cat([s, w1[int(prev_tokens[k])], hidden[k]])
            gate = sigmoid(w_gate @ z + b_gate)
            s = gate * s + (1.0 - gate) * torch.tanh(w_cand @ z + b_cand)
            biases.append(w2 @ torch.tanh(w_out @ z + b_out))
        return torch.stack(biases)

    def gated_biases(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """DeepSpec's gated head: g = σ(W_g [h_k; W1[x_{k−1}]] + b_g), B_k = W2 (g ⊙ W1[x_{k−1}]). [γ, V]."""
        w1 = self._w("markov_head.markov_w1.weight")
        w2 = self._w("markov_head.markov_w2.weight")  # [V, r]
        wg, bg = self._w("markov_head.gate_proj.weight"), self._w("markov_head.gate_proj.bias")  # [r, d + r], [r]
        biases = []
        for k in range(len(prev_tokens)):
            e = w1[int(prev_tokens[k])]
            gate = sigmoid(wg @ torch.cat([hidden[k], e]) + bg)
            biases.append(w2 @ (gate * e))
        return torch.stack(biases)

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """Eq. 7 (+ bias): w·[h_k; W1[x_{k−1}]] + b, or w·h_k + b without the Markov embedding."""
        if self.confidence is None:
            return None
        w = self._w("confidence_head.proj.weight")[0]
        b = self._w("confidence_head.proj.bias")[0]
        out = []
        for k in range(hidden.shape[0]):
            feats = hidden[k]
            if self.confidence == "with_markov":
                feats = torch.cat([feats, self._w("markov_head.markov_w1.weight")[int(prev_tokens[k])]])
            out.append((w * feats).sum() + b)
        return torch.stack(out)

    # ------------------------------------------------------------------ block
    def block(self, features: Tensor, anchor_pos: int, prev_tokens: Tensor) -> BlockOutput:
        """One block. features [S, m·d]; prev_tokens [γ] = [x_0, x_1, ..., x_{γ−1}] (x_0 the anchor)."""
        prev_tokens = torch.as_tensor(prev_tokens).reshape(-1)
        hidden = self.backbone(features, anchor_pos, int(prev_tokens[0]))
        base = self.base_logits(hidden)
        if self.head_type == "vanilla":
            bias = torch.stack([self.markov_bias(int(t)) for t in prev_tokens])
        elif self.head_type == "rnn":
            bias = self.rnn_biases(prev_tokens, hidden)
        elif self.head_type == "gated":
            bias = self.gated_biases(prev_tokens, hidden)
        else:
            bias = torch.zeros_like(base)
        return BlockOutput(hidden, base, bias, base + bias, self.confidence_logits(hidden, prev_tokens))
