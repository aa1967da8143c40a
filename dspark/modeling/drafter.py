"""The DSpark / DFlash drafter `Drafter`: the parallel backbone (Eq. 2-3), the sequential head
(Eq. 4-6) and the confidence head (Eq. 7), sharing the target's frozen embedding and LM head.

- `Drafter.forward(features, input_ids, anchors, keep)`: training, every anchor's block of a batch
  in one pass under the block mask of Eq. 3 -> h_1..h_γ; `draft_logits` / `confidence_logits` turn
  them into teacher-forced logits and confidences.
- `Drafter.propose(context, anchor_tokens, ...)`: decoding, one block per running sequence against
  a `DraftContext` (the injected keys/values of every context position, per layer) -> `Proposal`.
- `init_linears`, `shortened`: shared with `dspark.modeling.eagle3`.

The two entry points, the block layouts ("anchor_first", "anchor_plus_masks") and what a block
sees: docs/method.md, "The backbone (Eq. 2-3)".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.sampling import Generators, sample_categorical
from dspark.modeling.config import DrafterConfig
from dspark.modeling.heads import ConfidenceHead, SequentialHead, build_sequential_head
from dspark.modeling.blocks import check_forward_inputs, training_mask
from dspark.modeling.layers import DraftLayer, Rotary, RMSNorm
from dspark.modeling.vocab import DraftVocab, register_vocab_buffers
from dspark.kernels import cpu_linear
from dspark.kernels.lm_head import vocab_logits

SHARED_PARAMS = ("embed_tokens.weight", "lm_head.weight")


@dataclass
class DraftContext:
    """Incremental drafter context for a batch of running sequences.

    keys/values: per draft layer, [B, Hkv, capacity, hd]; entries at index
    j < lengths[b] are the injected K/V of context position j of row b.
    """

    keys: list[Tensor]
    values: list[Tensor]
    lengths: Tensor  # Long [B]

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def crop(self, lengths: Tensor | int) -> None:
        """Forget context positions >= lengths (per row or for all rows)."""
        self.lengths = shortened(self.lengths, lengths, "DraftContext")


def shortened(current: Tensor, lengths: Tensor | int, owner: str) -> Tensor:
    """The new per-row lengths [B] of a context crop to ``lengths`` (per row or for all rows);
    a crop only shortens."""
    new = torch.as_tensor(lengths, device=current.device).expand_as(current)
    if bool((new > current).any()):
        raise ValueError(f"{owner}.crop can only shorten the context")
    return new.clone()


@dataclass
class Proposal:
    tokens: Tensor  # Long [B, γ]
    probs: Tensor  # fp32 [B, γ, V]: the distributions the tokens were sampled from
    logits: Tensor  # fp32 [B, γ, V]: U_k + B_k before temperature
    confidences: Tensor | None  # fp32 [B, γ], c_k (not cumulative)



def init_linears(modules, config) -> float:
    """N(0, initializer_range) weights and zero biases for the nn.Linear among ``modules``; returns the std."""
    std = float(config.base_config.get("initializer_range", 0.02))
    for sub in modules:
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
    return std


class Drafter(nn.Module):
    """The DSpark / DFlash drafter of a ``DrafterConfig`` (paper Eq. 2-7): the parallel backbone
    over the target's features, the sequential head (bias of Eq. 5-6) and the confidence head
    (Eq. 7), reading the target's frozen embedding and LM head (``attach_target``).

    Training: ``forward(features, input_ids, anchors, keep)`` -> h_1..h_γ [B, A, γ, d] of every
    anchor's block, turned into logits by ``draft_logits`` and confidences by ``confidence_logits``
    (``dspark.block_loss`` wires them into the loss). Decoding: ``new_context`` /
    ``extend_context`` / ``propose``, the protocol of ``dspark.speculative_generate``. A draft
    vocabulary (``draft_vocab_size`` k > 0) is set with ``set_vocab``.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d, V = config.hidden_size, config.vocab_size
        m = len(config.target_layer_ids)
        eps = float(config.base_config.get("rms_norm_eps", 1e-6))
        # The target's frozen embedding table and LM head, shared by reference (attach_shared).
        # Deliberately not registered as parameters: no optimizer, `.to()` or state_dict
        # ever touches them. Checkpoints may still carry them under DeepSpec's names.
        self._shared: dict[str, Tensor] = {}
        self.fc = nn.Linear(m * d, d, bias=False)  # W_c of Eq. 2
        self.hidden_norm = RMSNorm(d, eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_draft_layers))
        self.norm = RMSNorm(d, eps)
        self.rotary = Rotary(config)
        self.markov_head: SequentialHead | None = None
        if config.has_sequential_head:
            self.markov_head = build_sequential_head(config)
        self.confidence_head: ConfidenceHead | None = None
        if config.has_confidence_head:
            with_prev = config.confidence_head_with_markov and self.markov_head is not None
            in_dim = d + (self.markov_head.embedding_dim if with_prev else 0)
            self.confidence_head = ConfidenceHead(in_dim)
        register_vocab_buffers(self, config.draft_vocab_size, V)
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    def reset_parameters(self) -> None:
        std = init_linears([self.fc, *self.layers.modules()], self.config)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=std)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def attach_shared(self, embed_weight: Tensor, lm_head_weight: Tensor) -> "Drafter":
        """Share the target's frozen embedding table [V, d] and LM head [V, d] (no copy). With a draft
        vocabulary of k ids the LM head may also be its k rows [k, d] (a checkpoint's), which then
        serves drafting but not training (the loss needs the target's full distribution)."""
        V, d = self.config.vocab_size, self.config.hidden_size
        k = self.config.draft_vocab_size
        head_ok = tuple(lm_head_weight.shape) == (V, d) or (k and tuple(lm_head_weight.shape) == (k, d))
        for name, w, ok in (("embedding", embed_weight, tuple(embed_weight.shape) == (V, d)), ("LM head", lm_head_weight, head_ok)):
            if not ok:
                raise ValueError(
                    f"target {name} has shape {tuple(w.shape)}, the drafter config expects {(V, d)}"
                    f"{f' (or {(k, d)} for the LM head)' if k and name == 'LM head' else ''}: "
                    "the drafter was built for a different target"
                )
        self._shared = {"embed_tokens.weight": embed_weight.detach(), "lm_head.weight": lm_head_weight.detach()}
        self.__dict__.pop("_head_rows", None)
        return self

    def attach_target(self, target: Any) -> "Drafter":
        """Share a `dspark.target.TargetModel`'s embedding and LM head."""
        return self.attach_shared(target.embed_tokens.weight, target.lm_head_weight())

    def shared_weights(self) -> dict[str, Tensor]:
        """{"embed_tokens.weight": [V, d], "lm_head.weight": [k, d]} (frozen, the target's): the LM
        head is the target's rows for the draft vocabulary (all V rows without one)."""
        if not self._shared:
            raise RuntimeError("attach the target's embedding and LM head first (attach_target / attach_shared)")
        if not self.config.draft_vocab_size:
            return self._shared
        return {"embed_tokens.weight": self._shared["embed_tokens.weight"], "lm_head.weight": self._draft_head()}

    # ------------------------------------------------------- draft vocabulary
    @property
    def vocab(self) -> DraftVocab | None:
        """The draft vocabulary (None: the full target vocabulary)."""
        if not self.config.draft_vocab_size:
            return None
        # Keyed on the content (k integers), not the tensor's version: DDP rewrites buffers in place
        # every step, and a rebuilt vocabulary would re-gather the LM head rows each time.
        cached = self.__dict__.get("_vocab")
        if cached is None or cached[0].device != self.d2t.device or not torch.equal(cached[0], self.d2t):
            cached = (self.d2t.clone(), DraftVocab.from_d2t(self.d2t, self.config.vocab_size))
            self.__dict__["_vocab"] = cached
        return cached[1]

    def set_vocab(self, vocab: DraftVocab) -> "Drafter":
        """Use this draft vocabulary (its size must be the config's draft_vocab_size)."""
        k, V = self.config.draft_vocab_size, self.config.vocab_size
        if (vocab.size, vocab.vocab_size) != (k, V):
            raise ValueError(
                f"the draft vocabulary has k={vocab.size} over V={vocab.vocab_size}, the drafter config says "
                f"draft_vocab_size={k} over vocab_size={V}: set drafter.draft_vocab_size={vocab.size}"
            )
        with torch.no_grad():
            self.d2t.copy_(vocab.d2t)
            self.t2d.copy_(vocab.t2d)
        return self

    def _draft_head(self) -> Tensor:
        """The LM head's rows [k, d] for the draft ids, gathered once per (vocabulary, head)."""
        w = self._shared["lm_head.weight"]
        if w.shape[0] == self.config.draft_vocab_size:
            return w
        key, vocab = (w.data_ptr(), w.dtype, w.device), self.vocab
        cached = self.__dict__.get("_head_rows")
        if cached is None or cached[0] != key or cached[1] is not vocab:
            cached = (key, vocab, vocab.head_weight(w))
            if cpu_linear.is_registered(w):  # the k rows decode through oneDNN like the head they come from
                cpu_linear.register(cached[2])
            self.__dict__["_head_rows"] = cached
        return cached[2]

    def target_lm_head_weight(self) -> Tensor:
        """The target's full LM head [V, d], which the loss reads p^t from (also with a draft vocabulary)."""
        self.shared_weights()  # raises when nothing is attached
        w = self._shared["lm_head.weight"]
        if w.shape[0] != self.config.vocab_size:
            raise RuntimeError(
                "this drafter holds only its draft vocabulary's LM head rows (loaded from a checkpoint): "
                "attach the target (attach_target) for the full distribution the loss needs"
            )
        return w

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # --------------------------------------------------------------- pieces
    def embed(self, ids: Tensor) -> Tensor:
        x = F.embedding(ids, self.shared_weights()["embed_tokens.weight"])
        scale = self.config.embed_scale
        return x * torch.tensor(scale, dtype=x.dtype) if scale != 1.0 else x

    def compute_logits(self, hidden: Tensor, *, full: bool = False, contiguous: bool = True) -> Tensor:
        """Frozen LM head (+ Gemma soft-capping): U = LMHead(h), [..., k] over the draft vocabulary
        (k = V without one); ``full`` gives the target's logits over all V ids. ``contiguous=False``:
        see ``dspark.kernels.lm_head.vocab_logits`` (for a caller that copies the logits anyway)."""
        w = self.target_lm_head_weight() if full else self.shared_weights()["lm_head.weight"]
        logits = vocab_logits(hidden.to(w.dtype), w, contiguous=contiguous)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def fuse_context(self, features: Tensor) -> Tensor:
        """Eq. 2: H_ctx = RMSNorm(W_c [H^{l_1}; ...; H^{l_m}]). features [B, S, m·d] -> [B, S, d]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _block_inputs(self, anchor_tokens: Tensor) -> Tensor:
        """anchor_tokens [...] -> block token ids [..., L] = [x_0, MASK, ..., MASK]."""
        L = self.config.block_len
        ids = torch.full((*anchor_tokens.shape, L), self.config.mask_token_id, dtype=torch.long, device=anchor_tokens.device)
        ids[..., 0] = anchor_tokens
        return ids

    def _predictions(self, block_hidden: Tensor) -> Tensor:
        """[..., L, d] -> hidden states h_1..h_γ [..., γ, d] of the prediction slots."""
        s = self.config.first_prediction_slot
        return block_hidden[..., s : s + self.config.block_size, :]

    def _run_layers(self, x: Tensor, positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]], mask: Any) -> Tensor:
        cos, sin = self.rotary(x, positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def _context_kv(self, h_ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        cos, sin = self.rotary(h_ctx, positions)
        return [layer.context_kv(h_ctx, cos, sin) for layer in self.layers]

    # ------------------------------------------------------------- training
    def forward(self, features: Tensor, input_ids: Tensor, anchors: Tensor, keep: Tensor | None = None) -> Tensor:
        """Training forward over many blocks per sequence.

        features [B, S, m·d] target features; input_ids [B, S]; anchors Long [B, A]
        anchor positions; keep Bool [B, A] (False = padding block, ignored by the loss).
        Returns h_1..h_γ of every block: [B, A, γ, d] (after the final norm).
        """
        check_forward_inputs(self.config, features, input_ids, anchors, keep)
        B, S = input_ids.shape
        A = anchors.shape[1]
        L = self.config.block_len
        device = input_ids.device
        if keep is None:
            keep = torch.ones_like(anchors, dtype=torch.bool)
        h_ctx = self.fuse_context(features)
        ctx_pos = torch.arange(S, device=device).expand(B, S)
        ctx_kv = self._context_kv(h_ctx, ctx_pos)
        anchor_tokens = torch.where(keep, input_ids.gather(1, anchors), self.config.mask_token_id)
        x = self.embed(self._block_inputs(anchor_tokens)).reshape(B, A * L, -1)  # [B, A·L, d]
        x = x.to(self.fc.weight.dtype)
        blk_pos = (anchors.unsqueeze(-1) + torch.arange(L, device=device)).reshape(B, A * L)
        mask = training_mask(anchors, keep, S, L, self.config.attn_implementation)
        out = self._run_layers(x, blk_pos, ctx_kv, mask)
        return self._predictions(out.reshape(B, A, L, -1))  # [B, A, γ, d]

    def draft_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """Teacher-forced U_k + B_k. hidden [..., γ, d]; prev_tokens [..., γ] = [x_0, x*_1..x*_{γ-1}]
        (target ids) -> logits [..., γ, k] over the draft vocabulary (V without one; Eq. 4 numerators)."""
        logits = self.compute_logits(hidden)
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(prev_tokens, hidden).to(logits.dtype)
        return logits

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """Eq. 7 logits w·[h_k; W1[x_{k-1}]] + b for [..., γ] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.config.confidence_head_with_markov:
            feats = torch.cat([hidden, self.markov_head.prev_embedding(prev_tokens).to(hidden.dtype)], dim=-1)
        return self.confidence_head(feats)

    # ------------------------------------------------------------ inference
    def new_context(self, batch_size: int, device: torch.device | str | None = None, capacity: int = 256) -> DraftContext:
        device = torch.device(device) if device is not None else self.fc.weight.device
        dtype = self.fc.weight.dtype
        attn = self.layers[0].self_attn
        shape = (batch_size, attn.num_kv_heads, capacity, attn.head_dim)
        return DraftContext(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @torch.no_grad()
    def extend_context(self, ctx: DraftContext, features: Tensor, num_valid: Tensor | None = None) -> None:
        """Append target features of new context positions.

        features [B, n, m·d]: row b's first num_valid[b] rows (all n by default) are the
        features of positions lengths[b], lengths[b]+1, ...; the rest is ignored.
        """
        B, n, _ = features.shape
        device = ctx.lengths.device
        if B != ctx.batch_size:
            raise ValueError(f"features has batch {B}, the context has {ctx.batch_size}")
        counts = torch.full((B,), n, device=device) if num_valid is None else num_valid.to(device)
        if num_valid is not None and bool(((counts < 0) | (counts > n)).any()):
            raise ValueError(f"num_valid must lie in [0, {n}] (the number of feature rows given), got {counts.tolist()}")
        if n == 0 or int(counts.max()) == 0:
            return
        positions = ctx.lengths.unsqueeze(1) + torch.arange(n, device=device)  # [B, n]
        need = int((ctx.lengths + counts).max())
        cap = ctx.keys[0].shape[2]
        if need > cap:
            grow = max(need, 2 * cap) - cap
            pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])], dim=2)  # noqa: E731
            ctx.keys = [pad(t) for t in ctx.keys]
            ctx.values = [pad(t) for t in ctx.values]
        kv = self._context_kv(self.fuse_context(features), positions)
        valid = torch.arange(n, device=device).unsqueeze(0) < counts.unsqueeze(1)  # [B, n]
        rows, steps = valid.nonzero(as_tuple=True)
        cols = positions[rows, steps]
        for store_k, store_v, (k, v) in zip(ctx.keys, ctx.values, kv):
            store_k[rows, :, cols] = k.transpose(1, 2)[rows, steps].to(store_k.dtype)  # [N, Hkv, hd]
            store_v[rows, :, cols] = v.transpose(1, 2)[rows, steps].to(store_v.dtype)
        ctx.lengths = ctx.lengths + counts

    @torch.no_grad()
    def propose(
        self,
        ctx: DraftContext,
        anchor_tokens: Tensor,
        *,
        temperature: float = 1.0,
        generator: Generators = None,
    ) -> Proposal:
        """Draft one block per row. The anchor of row b sits at position ctx.lengths[b].

        temperature > 0 samples x_k ~ softmax((U_k + B_k)/T) in fp32 and returns exactly
        those probabilities; temperature == 0 takes the argmax (probs are then at T=1).
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        B = ctx.batch_size
        device = ctx.lengths.device
        L = self.config.block_len
        S = int(ctx.lengths.max())
        ctx_kv = [(k[:, :, :S], v[:, :, :S]) for k, v in zip(ctx.keys, ctx.values)]
        mask = None
        if bool((ctx.lengths != S).any()):
            ctx_ok = torch.arange(S, device=device).unsqueeze(0) < ctx.lengths.unsqueeze(1)  # [B, S]
            mask = torch.cat([ctx_ok, ctx_ok.new_ones(B, L)], dim=1)[:, None, None, :]  # [B, 1, 1, S+L]
        x = self.embed(self._block_inputs(anchor_tokens.to(device))).to(self.fc.weight.dtype)  # [B, L, d]
        positions = ctx.lengths.unsqueeze(1) + torch.arange(L, device=device)
        hidden = self._predictions(self._run_layers(x, positions, ctx_kv, mask))  # [B, γ, d]
        # U_1..U_γ, one LM-head matmul; sample_block copies it into its own fp32 row-major buffer
        base = self.compute_logits(hidden, contiguous=False)
        proposal = self.sample_block(hidden, base, anchor_tokens.to(device), temperature=temperature, generator=generator)
        return self._on_target_vocab(proposal)

    def _on_target_vocab(self, proposal: Proposal) -> Proposal:
        """With a draft vocabulary: probs and logits [B, γ, k] -> [B, γ, V], zero probability (−inf
        logit) outside, so that verification against the full target stays exactly lossless."""
        vocab = self.vocab
        if vocab is None:
            return proposal
        return Proposal(tokens=proposal.tokens, probs=vocab.to_target(proposal.probs),
                        logits=vocab.to_target(proposal.logits, float("-inf")), confidences=proposal.confidences)

    def sample_block(
        self,
        hidden: Tensor,
        base_logits: Tensor,
        anchor_tokens: Tensor,
        *,
        temperature: float = 1.0,
        generator: Generators = None,
    ) -> Proposal:
        """The sequential stage (Eq. 4): left-to-right sampling with the head's carried state.

        hidden [B, γ, d], base_logits [B, γ, V] (any float dtype; used in fp32), anchor_tokens [B].
        With a draft vocabulary base_logits are [B, γ, k], and so are the returned probs and logits
        (propose puts them on the full vocabulary); the tokens are target ids either way.
        """
        B, gamma, _ = hidden.shape
        head = self.markov_head
        state = head.init_state(B, hidden.device, hidden.dtype) if head is not None else None
        # Outputs are written in place, row by row: no per-step [B, V] copies to stack at the end.
        # [B, γ, V] fp32 row-major; a new tensor unless base_logits is that already (one copy
        # serves both the dtype and the layout of propose()'s column-major LM-head output).
        logits = base_logits.float()
        if logits is base_logits and (head is not None or not logits.is_contiguous()):
            # the biases are added in place: never into the caller's tensor
            logits = logits.clone(memory_format=torch.contiguous_format)
        elif not logits.is_contiguous():
            logits = logits.contiguous()
        probs = torch.empty_like(logits)
        prev_block = torch.empty(B, gamma, dtype=torch.long, device=hidden.device)  # x_{k-1} of slot k
        tokens = torch.empty_like(prev_block)
        prev = anchor_tokens
        to_target = None if self.vocab is None else self.vocab.to_target_ids  # draft id -> target id
        for k in range(gamma):
            prev_block[:, k] = prev
            row = logits[:, k]
            if head is not None:
                state, bias = head.step(state, prev, hidden[:, k])
                row.add_(bias)
            if temperature > 0:
                probs[:, k] = torch.softmax(row if temperature == 1 else row / temperature, dim=-1)
                tok = sample_categorical(probs[:, k], generator)  # inverse CDF: much cheaper than multinomial
            else:
                probs[:, k] = torch.softmax(row, dim=-1)
                tok = row.argmax(dim=-1)
            if to_target is not None:
                tok = to_target(tok)
            tokens[:, k] = tok
            prev = tok
        conf = None
        if self.confidence_head is not None:  # c_k needs only h_k and x_{k-1}: one call after the loop
            conf = torch.sigmoid(self.confidence_logits(hidden, prev_block))
        return Proposal(tokens=tokens, probs=probs, logits=logits, confidences=conf)

    @torch.no_grad()
    def propose_from_features(
        self,
        features: Tensor,
        anchor_tokens: Tensor,
        *,
        temperature: float = 1.0,
        generator: Generators = None,
    ) -> Proposal:
        """One-shot propose(): context = all positions of features [B, S, m·d]; anchor at S."""
        ctx = self.new_context(features.shape[0], features.device, capacity=max(1, features.shape[1]))
        self.extend_context(ctx, features)
        return self.propose(ctx, anchor_tokens, temperature=temperature, generator=generator)
