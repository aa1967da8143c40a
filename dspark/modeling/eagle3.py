"""Eagle3: an autoregressive drafter with one decoder layer over fused target features (the paper's
baseline, Section 4.1), in two presets (`DrafterConfig.eagle3_preset`): "eagle3_deepspec" (DeepSpec's
`Qwen3Eagle3Model`, the paper's) and "eagle3" (the standard EAGLE-3 that vLLM and SGLang serve).

- `Eagle3Drafter`: `forward` runs training-time test (TTT) over `ttt_length` steps; `new_context` /
  `extend_context` / `propose` draft γ tokens with γ sequential forwards over its own KV cache.
- `Eagle3Layer`, `Eagle3Attention`: the draft layer, whose q/k/v read [embedding ; hidden] (2d wide).
- `Eagle3Context`: that cache, per running sequence; `ttt_attention`: the attention of one TTT step.
- The draft vocabulary (`dspark.modeling.vocab`) is the `Drafter`'s, borrowed, not re-implemented.

The layer's equations, the presets, TTT, the inference cache and the draft vocabulary:
docs/method.md, "Eagle3 (Section 4.1)".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.modeling.config import DrafterConfig, resolve_attention_dims
from dspark.modeling.drafter import Drafter, Proposal, init_linears, shortened
from dspark.modeling.layers import GatedMLP, RMSNorm, Rotary, apply_rope, attention
from dspark.modeling.vocab import DraftVocab, register_vocab_buffers
from dspark.kernels.lm_head import vocab_logits
from dspark.sampling import Generators, sample_categorical


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read the 2d-wide [embedding ; hidden] input."""

    def __init__(self, config: DrafterConfig, qk_norm: bool) -> None:
        super().__init__()
        base = config.base_config
        d = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = resolve_attention_dims(base)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        bias = bool(base.get("attention_bias", False))
        eps = float(base.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(2 * d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.scaling = self.head_dim**-0.5

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2d] -> q [B, H, T, hd], k and v [B, Hkv, T, hd] (RoPE applied to q and k)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def out(self, o: Tensor) -> Tensor:
        """o [B, H, T, hd] -> [B, T, d]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """The one draft decoder layer (names as DeepSpec's `layers.0.*`, `hidden_norm` included)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        base = config.base_config
        d = config.hidden_size
        eps = float(base.get("rms_norm_eps", 1e-6))
        act = base.get("hidden_activation") or base.get("hidden_act") or "silu"
        self.self_attn = Eagle3Attention(config, qk_norm=config.eagle3_preset == "eagle3_deepspec")
        self.mlp = GatedMLP(d, config.intermediate_size or int(base["intermediate_size"]), act,
                            bias=bool(base.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def qkv(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2d]
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, hidden: Tensor, o: Tensor) -> Tensor:
        """Residual over the hidden input, then the MLP block. o: attention output [B, H, T, hd]."""
        h = hidden + self.self_attn.out(o)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class Eagle3Context:
    """The drafter's view of running sequences: features of positions 0..lengths−1 and their tokens.

    keys/values [B, Hkv, capacity, hd]: the K/V of draft rows j < cached[b] (a row's K/V need the
    token at j + 1, so the last row waits for the anchor). fused [B, capacity, d] = fc(features);
    tokens [B, capacity + γ + 1] the token at each position (−1 = not known yet)."""

    keys: Tensor
    values: Tensor
    fused: Tensor
    tokens: Tensor
    lengths: Tensor  # Long [B]: positions with features; the anchor sits at lengths[b]
    cached: Tensor  # Long [B]: rows whose K/V are stored

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def crop(self, lengths: Tensor | int) -> None:
        """Forget positions >= lengths (per row or for all rows)."""
        self.lengths = shortened(self.lengths, lengths, "Eagle3Context")
        self.cached = torch.minimum(self.cached, (self.lengths - 1).clamp_min(0))


class Eagle3Drafter(nn.Module):
    """Eagle3 drafter: `forward_ttt` for training, `new_context` / `extend_context` / `propose`
    for decoding (the protocol of `dspark.decoding.loop`)."""

    reads_tokens = True  # extend_context wants the tokens of the rows (decoding passes input_ids)

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        if config.variant != "eagle3":
            raise ValueError(f"Eagle3Drafter needs variant='eagle3', got {config.variant!r}")
        if config.num_draft_layers != 1:
            raise ValueError(f"num_draft_layers={config.num_draft_layers}: an Eagle3 drafter has exactly 1 layer")
        self.config = config
        d, m = config.hidden_size, len(config.target_layer_ids)
        eps = float(config.base_config.get("rms_norm_eps", 1e-6))
        self._shared: dict[str, Tensor] = {}
        self.fc = nn.Linear(m * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(d, eps)
        self.rotary = Rotary(config)
        register_vocab_buffers(self, config.draft_vocab_size, config.vocab_size)  # as Drafter
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_linears([self.fc, *self.layers.modules()], self.config)

    # ------------------------------------------- shared tables, draft vocabulary
    # The frozen tables and the draft vocabulary are exactly the Drafter's (same buffers, same checks,
    # the LM head's k rows cached per vocabulary): its methods only read config, d2t/t2d and _shared.
    attach_shared = Drafter.attach_shared
    attach_target = Drafter.attach_target
    shared_weights = Drafter.shared_weights
    vocab = Drafter.vocab
    set_vocab = Drafter.set_vocab
    _draft_head = Drafter._draft_head
    target_lm_head_weight = Drafter.target_lm_head_weight

    @property
    def draft_vocab(self) -> DraftVocab | None:
        """The draft vocabulary (None: the full target vocabulary); an alias of `vocab`."""
        return self.vocab

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def head_weight(self) -> Tensor:
        """LM head rows of the draft vocabulary: [V, d], or [k, d] with a reduced one."""
        return self.shared_weights()["lm_head.weight"]

    def to_target_tokens(self, draft_ids: Tensor) -> Tensor:
        """Draft ids -> target ids (target id = draft id + d2t[draft id])."""
        vocab = self.vocab
        return draft_ids if vocab is None else vocab.to_target_ids(draft_ids)

    def to_target_probs(self, probs: Tensor) -> Tensor:
        """[..., k] draft-vocabulary probabilities -> [..., V] (zeros outside the draft vocabulary)."""
        vocab = self.vocab
        return probs if vocab is None else vocab.to_target(probs)

    def to_target_logits(self, logits: Tensor) -> Tensor:
        """[..., k] draft-vocabulary logits -> [..., V] (-inf outside the draft vocabulary)."""
        vocab = self.vocab
        return logits if vocab is None else vocab.to_target(logits, float("-inf"))

    # ------------------------------------------------------------------ pieces
    def embed(self, ids: Tensor) -> Tensor:
        x = F.embedding(ids, self.shared_weights()["embed_tokens.weight"])
        scale = self.config.embed_scale
        return (x * torch.tensor(scale, dtype=x.dtype) if scale != 1.0 else x).to(self.fc.weight.dtype)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the draft vocabulary from pre-norm hidden states: lm_head(norm(h)) (+ soft-cap)."""
        w = self.head_weight()
        logits = vocab_logits(self.norm(hidden).to(w.dtype), w)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def fuse(self, features: Tensor) -> Tensor:
        """fc over the concatenated target features: [..., m·d] -> [..., d] (no norm: hidden_norm is in the layer)."""
        return self.fc(features.to(self.fc.weight.dtype))

    # ---------------------------------------------------------------- training
    def forward(self, features: Tensor, input_ids: Tensor, steps: int | None = None) -> list[Tensor]:
        """Training-time test: the pre-norm hidden states of every step, [B, S, d] each.

        features [B, S, m·d], input_ids [B, S]. Step s at position i reads the token
        input_ids[i+1+s] (0 past the end) at RoPE position i+s; rows i >= S−s run past the end and
        are never supervised (they see only themselves beyond the causal prefix)."""
        B, S = input_ids.shape
        T = self.config.ttt_length if steps is None else steps
        layer = self.layers[0]
        hidden = self.fuse(features)  # [B, S, d]
        base_pos = torch.arange(S, device=input_ids.device)
        k0 = v0 = None
        diag_k: list[Tensor] = []
        diag_v: list[Tensor] = []
        out = []
        for s in range(T):
            tokens = F.pad(input_ids[:, 1 + s :], (0, min(S, 1 + s)))[:, :S]  # [B, S]
            cos, sin = self.rotary(hidden, (base_pos + s).expand(B, S))
            q, k, v = layer.qkv(self.embed(tokens), hidden, cos, sin)
            if s == 0:
                k0, v0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            o = ttt_attention(q, k0, v0, diag_k, diag_v, layer.self_attn.scaling)
            hidden = layer.finish(hidden, o)
            out.append(hidden)
        return out

    # --------------------------------------------------------------- inference
    def new_context(self, batch_size: int, device: torch.device | str | None = None, capacity: int = 256) -> Eagle3Context:
        device = torch.device(device) if device is not None else self.fc.weight.device
        dtype = self.fc.weight.dtype
        attn = self.layers[0].self_attn
        capacity = max(1, capacity)
        return Eagle3Context(
            keys=torch.zeros(batch_size, attn.num_kv_heads, capacity, attn.head_dim, dtype=dtype, device=device),
            values=torch.zeros(batch_size, attn.num_kv_heads, capacity, attn.head_dim, dtype=dtype, device=device),
            fused=torch.zeros(batch_size, capacity, self.config.hidden_size, dtype=dtype, device=device),
            tokens=torch.full((batch_size, capacity + self.config.block_size + 1), -1, dtype=torch.long, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            cached=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @torch.no_grad()
    def extend_context(self, ctx: Eagle3Context, features: Tensor, num_valid: Tensor | None = None,
                       input_ids: Tensor | None = None) -> None:
        """Append target features [B, n, m·d] of positions lengths[b].. (row b's first num_valid[b]),
        with input_ids [B, n] the tokens at those positions. Without input_ids the tokens a previous
        propose() recorded there (its anchor and drafts, which is what an accepted prefix is) are used."""
        B, n, _ = features.shape
        device = ctx.lengths.device
        if B != ctx.batch_size:
            raise ValueError(f"features has batch {B}, the context has {ctx.batch_size}")
        counts = torch.full((B,), n, device=device) if num_valid is None else num_valid.to(device)
        if bool(((counts < 0) | (counts > n)).any()):
            raise ValueError(f"num_valid must lie in [0, {n}] (the number of feature rows given), got {counts.tolist()}")
        if n == 0 or int(counts.max()) == 0:
            return
        _grow(ctx, int((ctx.lengths + counts).max()), self.config.block_size)
        positions = ctx.lengths.unsqueeze(1) + torch.arange(n, device=device)  # [B, n]
        rows, steps = (torch.arange(n, device=device).unsqueeze(0) < counts.unsqueeze(1)).nonzero(as_tuple=True)
        cols = positions[rows, steps]
        ctx.fused[rows, cols] = self.fuse(features)[rows, steps].to(ctx.fused.dtype)
        if input_ids is not None:
            ctx.tokens[rows, cols] = input_ids.to(device)[rows, steps]
        ctx.lengths = ctx.lengths + counts

    @torch.no_grad()
    def propose(self, ctx: Eagle3Context, anchor_tokens: Tensor, *, temperature: float = 1.0,
                generator: Generators = None) -> Proposal:
        """Draft γ tokens per row, each from its own forward (the anchor of row b sits at lengths[b]).

        temperature > 0 samples x_k ~ softmax(logits_k / T) in fp32 and returns exactly those
        probabilities (over the target vocabulary); 0 takes the argmax (probs then at T = 1)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")

        def choose(k: int, row: Tensor) -> Tensor:
            if temperature > 0:
                probs = torch.softmax(row if temperature == 1 else row / temperature, dim=-1)
                return probs, sample_categorical(probs, generator)
            return torch.softmax(row, dim=-1), row.argmax(dim=-1)

        return self.draft_chain(ctx, anchor_tokens, choose)

    def draft_chain(self, ctx: Eagle3Context, anchor_tokens: Tensor,
                    choose: Callable[[int, Tensor], tuple[Tensor, Tensor]]) -> Proposal:
        """γ sequential forwards; `choose(k, fp32 logits [B, k_vocab])` -> (probs, draft ids) of draft k.
        Draft k's token is the input of forward k + 1."""
        gamma, device = self.config.block_size, ctx.lengths.device
        if bool((ctx.lengths < 1).any()):
            raise ValueError("propose() needs at least one context position per row (draft 1 reads its features)")
        B = ctx.batch_size
        ctx.tokens[torch.arange(B, device=device), ctx.lengths] = anchor_tokens.to(device)
        hidden = self._extend_rows(ctx)  # [B, 1, d]: the last context row, whose logits give draft 1
        tokens = torch.empty(B, gamma, dtype=torch.long, device=device)
        logits_out, probs_out = [], []
        step_k: list[Tensor] = []
        step_v: list[Tensor] = []
        for k in range(gamma):
            if k:
                hidden = self._draft_step(ctx, hidden, tokens[:, k - 1], k, step_k, step_v)
            row = self.compute_logits(hidden[:, 0]).float()  # [B, k_vocab]
            probs, ids = choose(k, row)
            tokens[:, k] = self.to_target_tokens(ids)
            logits_out.append(row)
            probs_out.append(self.to_target_probs(probs))
        span = ctx.lengths.unsqueeze(1) + 1 + torch.arange(gamma, device=device)  # drafts' positions
        ctx.tokens.scatter_(1, span, tokens)
        logits = self.to_target_logits(torch.stack(logits_out, 1))
        return Proposal(tokens=tokens, probs=torch.stack(probs_out, 1), logits=logits, confidences=None)

    def _extend_rows(self, ctx: Eagle3Context) -> Tensor:
        """One forward over the rows cached[b]..lengths[b]−1 (causal, over the cached K/V); stores
        their K/V and returns the last row's output [B, 1, d]. The last row is recomputed by the
        next call, since its token (the anchor) is only known per round."""
        device = ctx.lengths.device
        B = ctx.batch_size
        start, end = ctx.cached, ctx.lengths
        counts = end - start  # >= 1
        n, C = int(counts.max()), int(start.max())
        t = torch.arange(n, device=device)
        pos = (start.unsqueeze(1) + t).clamp_max(ctx.fused.shape[1] - 1)  # [B, n]
        valid = t.unsqueeze(0) < counts.unsqueeze(1)  # [B, n]
        bidx = torch.arange(B, device=device).unsqueeze(1)
        tok = ctx.tokens[bidx, pos + 1].clamp_min(0)
        if bool((ctx.tokens[bidx, pos + 1][valid] < 0).any()):
            raise ValueError("an Eagle3 context row needs the token that follows it: pass input_ids to extend_context")
        hidden = ctx.fused[bidx, pos]  # [B, n, d]
        layer = self.layers[0]
        cos, sin = self.rotary(hidden, pos)
        q, k, v = layer.qkv(self.embed(tok), hidden, cos, sin)
        cache_ok = torch.arange(C, device=device).unsqueeze(0) < start.unsqueeze(1)  # [B, C]
        causal = (t.unsqueeze(0) <= t.unsqueeze(1)).unsqueeze(0) & valid.unsqueeze(1)  # [B, n, n]
        causal = causal | torch.eye(n, dtype=torch.bool, device=device)  # padding rows see themselves
        mask = torch.cat([cache_ok.unsqueeze(1).expand(B, n, C), causal], dim=-1).unsqueeze(1)  # [B, 1, n, C+n]
        keys = torch.cat([ctx.keys[:, :, :C], k.to(ctx.keys.dtype)], dim=2)
        values = torch.cat([ctx.values[:, :, :C], v.to(ctx.values.dtype)], dim=2)
        o = attention(q, keys, values, mask, layer.self_attn.scaling, self._attn_impl())
        out = layer.finish(hidden, o)  # [B, n, d]
        rows, steps = valid.nonzero(as_tuple=True)
        ctx.keys[rows, :, pos[rows, steps]] = k.transpose(1, 2)[rows, steps].to(ctx.keys.dtype)
        ctx.values[rows, :, pos[rows, steps]] = v.transpose(1, 2)[rows, steps].to(ctx.values.dtype)
        ctx.cached = end - 1
        return out[torch.arange(B, device=device), counts - 1].unsqueeze(1)

    def _draft_step(self, ctx: Eagle3Context, hidden: Tensor, token: Tensor, k: int,
                    step_k: list[Tensor], step_v: list[Tensor]) -> Tensor:
        """Draft forward k >= 1: hidden [B, 1, d] of step k−1, its drafted token, RoPE position
        lengths−1+k; attends to the context rows and the round's earlier draft steps."""
        device = ctx.lengths.device
        L = int(ctx.lengths.max())
        layer = self.layers[0]
        pos = (ctx.lengths - 1 + k).unsqueeze(1)  # [B, 1]
        cos, sin = self.rotary(hidden, pos)
        q, kk, vv = layer.qkv(self.embed(token.unsqueeze(1)), hidden, cos, sin)
        step_k.append(kk.to(ctx.keys.dtype))
        step_v.append(vv.to(ctx.values.dtype))
        ctx_ok = torch.arange(L, device=device).unsqueeze(0) < ctx.lengths.unsqueeze(1)  # [B, L]
        mask = torch.cat([ctx_ok, ctx_ok.new_ones(ctx.batch_size, len(step_k))], dim=1)[:, None, None, :]
        keys = torch.cat([ctx.keys[:, :, :L], *step_k], dim=2)
        values = torch.cat([ctx.values[:, :, :L], *step_v], dim=2)
        o = attention(q, keys, values, mask, layer.self_attn.scaling, self._attn_impl())
        return layer.finish(hidden, o)

    def _attn_impl(self) -> str:
        return "eager" if self.config.attn_implementation == "eager" else "sdpa"

    @torch.no_grad()
    def propose_from_features(self, features: Tensor, anchor_tokens: Tensor, *, input_ids: Tensor | None = None,
                              temperature: float = 1.0, generator: Generators = None) -> Proposal:
        """One-shot propose(): context = features [B, S, m·d] with their tokens input_ids [B, S]; anchor at S."""
        if input_ids is None:
            raise ValueError("an Eagle3 drafter reads the context's tokens too: pass input_ids (the tokens of the "
                             "feature positions)")
        ctx = self.new_context(features.shape[0], features.device, capacity=max(1, features.shape[1]))
        self.extend_context(ctx, features, input_ids=input_ids)
        return self.propose(ctx, anchor_tokens, temperature=temperature, generator=generator)


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, diag_k: list[Tensor], diag_v: list[Tensor], scale: float) -> Tensor:
    """The TTT attention of step s = len(diag_k): query i attends the step-0 keys j <= i (causal)
    and its own position's keys of steps 1..s. q [B, H, S, hd]; k0, v0 and each diag [B, Hkv, S, hd].

    The diagonal blocks are scored as row-wise dot products, so the cost is one causal S×S attention
    plus s·S dot products (not an S×(s+1)S mask). Computed in fp32; returns q's dtype."""
    B, H, S, _ = q.shape
    groups = H // k0.shape[1]
    expand = (lambda t: t.float().repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t.float())
    qf = q.float()
    scores = torch.matmul(qf, expand(k0).transpose(-1, -2)) * scale  # [B, H, S, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(qf * expand(k)).sum(-1, keepdim=True) * scale for k in diag_k]  # s × [B, H, S, 1]
    weights = torch.cat([scores, *diag], dim=-1).softmax(-1)  # [B, H, S, S + s]
    out = torch.matmul(weights[..., :S], expand(v0))
    for j, v in enumerate(diag_v):
        out = out + weights[..., S + j : S + j + 1] * expand(v)
    return out.to(q.dtype)


def _grow(ctx: Eagle3Context, need: int, gamma: int) -> None:
    """Make room for `need` positions (doubling), keeping what is stored."""
    cap = ctx.fused.shape[1]
    if need <= cap:
        return
    grow = max(need, 2 * cap) - cap
    ctx.keys = torch.cat([ctx.keys, ctx.keys.new_zeros(*ctx.keys.shape[:2], grow, ctx.keys.shape[3])], dim=2)
    ctx.values = torch.cat([ctx.values, ctx.values.new_zeros(*ctx.values.shape[:2], grow, ctx.values.shape[3])], dim=2)
    ctx.fused = torch.cat([ctx.fused, ctx.fused.new_zeros(ctx.fused.shape[0], grow, ctx.fused.shape[2])], dim=1)
    ctx.tokens = torch.cat([ctx.tokens, ctx.tokens.new_full((ctx.tokens.shape[0], grow), -1)], dim=1)


__all__ = ["Eagle3Context", "Eagle3Drafter", "ttt_attention"]
