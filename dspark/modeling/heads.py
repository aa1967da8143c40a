"""Sequential heads (Eq. 5, 6, and DeepSpec's gated variant) and the confidence head (Eq. 7).

``SequentialHead`` is the contract every head follows (docs/extending.md adds one);
``dspark.registry.HEADS`` names the heads a config can choose by
``drafter.markov_head_type``; ``build_sequential_head`` builds one from a DrafterConfig.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class SequentialHead(nn.Module):
    """The contract of a sequential head: a prefix-dependent bias B_k on the backbone's logits U_k.

    A head is built by ``from_config(config)`` (a DrafterConfig: target vocabulary V, rank r =
    ``markov_rank``, hidden size d, output size k = ``output_vocab_size``, and its own
    hyperparameters in ``head_options``). Its consumers use only these members:

    - ``embedding_dim`` (int) and ``prev_embedding(tokens [...]) -> [..., embedding_dim]``: the
      x_{k-1} features the confidence head reads with h_k (Eq. 7, confidence_head_with_markov);
    - ``block_bias(prev_tokens [..., γ], hidden [..., γ, d]) -> [..., γ, k]``: teacher-forced
      biases of whole blocks (training, the float64 reference checks);
    - ``init_state(B, device, dtype)`` and ``step(state, prev_token [B], hidden [B, d]) ->
      (state, bias [B, k])``: left-to-right sampling, carrying the state (None for a stateless
      head; passing a fresh state at every step would silently change the head);
    - ``fused_factors(prev_tokens, hidden) -> (latent [..., γ, q], w2 [k, q]) | None``: a head whose
      bias is latent @ w2ᵀ feeds the fused loss (dspark.training.fused_loss), which never forms
      the [N, γ, k] logits; None says it cannot, and training falls back to the chunked loss.
    """

    embedding_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "SequentialHead":
        """The head of a DrafterConfig; ``config.head_options`` are passed as keyword arguments."""
        return cls(config.vocab_size, config.markov_rank, config.hidden_size,
                   out_size=config.output_vocab_size, **dict(config.head_options))

    def prev_embedding(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def block_bias(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Any:
        return None

    def step(self, state: Any, prev_token: Tensor, hidden: Tensor) -> tuple[Any, Tensor]:
        raise NotImplementedError

    def fused_factors(self, prev_tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor] | None:
        return None


class MarkovHead(SequentialHead):
    """Eq. 5: B(x_{k-1}, ·) = W1[x_{k-1}] W2, a rank-r factorisation of a V×V transition table.

    With a draft vocabulary of k ids (dspark.modeling.vocab) the table is V×k: W1 stays [V, r]
    (x_{k-1} is a target id: the anchor may lie outside the vocabulary), W2 is [k, r], as vLLM
    builds its DSpark head (`markov_w1` over the target vocabulary, `markov_w2` over the draft one).
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int | None = None, out_size: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.embedding_dim = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        self.markov_w2 = nn.Linear(rank, out_size or vocab_size, bias=False)  # r -> k (V by default)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        # Zero output projection: an untrained head is exactly the parallel (DFlash) drafter.
        nn.init.zeros_(self.markov_w2.weight)

    def prev_embedding(self, tokens: Tensor) -> Tensor:
        """W1[x] for token ids of any shape -> [..., r]."""
        return self.markov_w1(tokens)

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        return None

    def project(self, latent: Tensor) -> Tensor:
        """latent [B, r] -> W2 latent [B, V]. Without grad (drafting), multiplies by a cached
        contiguous fp32 W2ᵀ [r, V] and returns fp32: on CPU several times faster than the [V, r] layout
        the checkpoint keeps, and faster in fp32 than in bf16 for one row (the bias is added to
        fp32 logits anyway)."""
        w = self.markov_w2.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return self.markov_w2(latent)
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        cache = self.__dict__.get("_w2t")
        if cache is None or cache[0] != key:
            cache = (key, w.detach().t().float().contiguous())
            self.__dict__["_w2t"] = cache
        return latent.float() @ cache[1]

    def step(self, state: Tensor | None, prev_token: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor]:
        """prev_token [B], hidden [B, d] (unused) -> (state, bias [B, V])."""
        return state, self.project(self.prev_embedding(prev_token))

    def block_latent(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """The rank-r vectors whose W2 projection is the bias: W1[x_{k-1}] -> [..., γ, r]."""
        return self.prev_embedding(prev_tokens).to(self.markov_w2.weight.dtype)

    def block_bias(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """prev_tokens [..., γ] (x_0, x*_1, ..., x*_{γ-1}) -> bias [..., γ, V] = W2 · block_latent."""
        return self.markov_w2(self.block_latent(prev_tokens, hidden))

    def fused_factors(self, prev_tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(block_latent [..., γ, r], W2 [k, r]): the bias is their product."""
        return self.block_latent(prev_tokens, hidden), self.markov_w2.weight


class GatedMarkovHead(MarkovHead):
    """DeepSpec's `markov_head_type="gated"` (not in the paper; SGLang serves it):
    g_k = σ(W_g [h_k; W1[x_{k-1}]] + b_g) ∈ (0,1)^r, B_k = W2 (g_k ⊙ W1[x_{k-1}]).

    `gate_proj` is a (d+r -> r) linear with a bias, named and shaped as in DeepSpec's checkpoints
    (`markov_head.gate_proj.{weight,bias}`); the hidden state comes first in its input.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None) -> None:
        super().__init__(vocab_size, rank, hidden_size, out_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def block_latent(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """g_k ⊙ W1[x_{k-1}]: prev_tokens [..., γ], hidden [..., γ, d] -> [..., γ, r]."""
        w = self.gate_proj.weight
        prev = self.prev_embedding(prev_tokens).to(w.dtype)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(w.dtype), prev], dim=-1)))
        return gate * prev

    def step(self, state: Tensor | None, prev_token: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor]:
        """prev_token [B], hidden [B, d] -> (state, bias [B, V])."""
        return state, self.project(self.block_latent(prev_token, hidden))


class RNNHead(MarkovHead):
    """Eq. 6: z_k = [s_{k-1}; W1[x_{k-1}]; h_k]; one linear (2r+d -> 3r) gives gate g, candidate c,
    output o; s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c); B_k = W2 tanh(o); s_0 = 0.

    `bias=True` adds a bias to that linear, as DeepSpec's `markov_head.joint_proj` has; the
    paper's Eq. 6 has none (`bias=False`). DrafterConfig.rnn_bias chooses (default True).
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, bias: bool = True, out_size: int | None = None) -> None:
        super().__init__(vocab_size, rank, hidden_size, out_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=bias)

    @classmethod
    def from_config(cls, config: Any) -> "RNNHead":
        return cls(config.vocab_size, config.markov_rank, config.hidden_size, bias=config.rnn_bias,
                   out_size=config.output_vocab_size, **dict(config.head_options))

    def init_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        return torch.zeros(batch_size, self.rank, device=device, dtype=dtype)

    def _cell(self, state: Tensor, prev_token: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """One Eq. 6 update: (s_{k-1}, x_{k-1}, h_k) -> (s_k, tanh(o_k) [B, r])."""
        w = self.joint_proj.weight
        z = torch.cat([state.to(w.dtype), self.prev_embedding(prev_token).to(w.dtype), hidden.to(w.dtype)], dim=-1)
        g, c, o = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        return gate * state.to(w.dtype) + (1 - gate) * torch.tanh(c), torch.tanh(o)

    def step(self, state: Tensor, prev_token: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """state [B, r], prev_token [B], hidden [B, d] -> (new state [B, r], bias [B, V])."""
        if state is None:
            raise ValueError("RNNHead.step needs the carried state; start from init_state()")
        new_state, latent = self._cell(state, prev_token, hidden)
        return new_state, self.project(latent)

    def block_latent(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """tanh(o_k) of the teacher-forced recurrence: prev_tokens [..., γ], hidden [..., γ, d] -> [..., γ, r]."""
        lead = prev_tokens.shape[:-1]
        gamma = prev_tokens.shape[-1]
        flat_tokens = prev_tokens.reshape(-1, gamma)  # [N, γ]
        flat_hidden = hidden.reshape(-1, gamma, hidden.shape[-1])  # [N, γ, d]
        state = self.init_state(flat_tokens.shape[0], hidden.device, self.joint_proj.weight.dtype)
        latents = []
        for k in range(gamma):
            state, latent = self._cell(state, flat_tokens[:, k], flat_hidden[:, k])
            latents.append(latent)
        return torch.stack(latents, dim=1).reshape(*lead, gamma, -1)


class ConfidenceHead(nn.Module):
    """Eq. 7 (with DeepSpec's bias): c_k = σ(w·[h_k ; W1[x_{k-1}]] + b). Returns the logit."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        """features [..., input_dim] -> logits [...] (fp32)."""
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


def build_sequential_head(config: Any) -> SequentialHead:
    """The sequential head ``config.markov_head_type`` names in ``dspark.registry.HEADS``, built by
    its ``from_config`` (the RNN head also reads ``config.rnn_bias``)."""
    from dspark.registry import HEADS

    cls = HEADS.get(config.markov_head_type)
    head = cls.from_config(config)
    if not isinstance(head, SequentialHead):
        raise TypeError(f"markov_head_type={config.markov_head_type!r} built a {type(head).__name__}, which is not a "
                        "dspark.modeling.heads.SequentialHead (docs/extending.md: the head contract)")
    return head
