"""The frozen target LLM: feature capture, final hidden state, LM head (the features of paper Eq. 2).

- `TargetModel`: wraps a `transformers` causal LM of a family in `dspark.registry.FAMILIES` and
  gives the drafter what it needs from it, and nothing more: `forward` -> `TargetOutput`
  (`features` [B, S, m*d] at `target_layer_ids`, `last_hidden`, `logits`), the frozen `embed` and
  `compute_logits` the drafter shares, and a KV cache that can be cropped.
- `validate_layer_ids`: the layer-id rules.

The layer-id convention (DeepSpec's, for the l_1..l_m of Eq. 2) and how features are captured:
docs/method.md, "The target".
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dspark.kernels import cpu_linear as _cpu_linear
from dspark import hub
from dspark.registry import FAMILIES
from dspark.kernels.lm_head import vocab_logits

logger = logging.getLogger(__name__)

# Families by config.model_type: dspark.registry.FAMILIES. Multimodal wrappers (gemma3, gemma4)
# hold the decoder under model.language_model and its config under text_config.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class TargetOutput:
    """What one target forward returns.

    features:        [B, S, m*d] hidden states at target_layer_ids, concatenated in id order.
    last_hidden:     [B, S, d] final hidden state after the final norm (LM head input).
    logits:          [B, S', V] (S' = S, or fewer with logits_to_keep), soft-capped; None unless asked.
    past_key_values: the transformers Cache used (extended in place), None when no cache was used.
    """

    features: Tensor
    last_hidden: Tensor
    logits: Tensor | None = None
    past_key_values: Any = None


@dataclass(frozen=True)
class _Anatomy:
    """References into the wrapped model (kept outside nn.Module registration)."""

    text_model: nn.Module  # the decoder stack: embed_tokens, layers, norm
    layers: nn.ModuleList
    embed_tokens: nn.Module
    norm: nn.Module
    lm_head: nn.Module


def _find_anatomy(model: nn.Module) -> _Anatomy:
    base = getattr(model, "model", None)
    if base is None:
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    # Multimodal wrappers (Gemma3/Gemma4ForConditionalGeneration): model.model.language_model.
    text_model = getattr(base, "language_model", base)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    missing = [n for n in ("layers", "embed_tokens", "norm") if not hasattr(text_model, n)]
    if text_model is None or missing or lm_head is None:
        raise ValueError(
            f"cannot find the decoder layers / embedding / final norm / LM head in {type(model).__name__} "
            f"(missing: {missing or 'lm_head'}); TargetModel expects a transformers causal LM "
            f"of a family in dspark.registry.FAMILIES: {list(FAMILIES.names())}"
        )
    return _Anatomy(text_model, text_model.layers, text_model.embed_tokens, text_model.norm, lm_head)


def _family_of(config: Any) -> str:
    """The family (dspark.registry.FAMILIES) of a target config; an unknown model_type names the table."""
    model_type = getattr(config, "model_type", None)
    try:
        return FAMILIES.of_model_type(str(model_type)).name
    except ValueError as e:
        raise ValueError(f"unsupported target architecture: {e}") from None


def _own_cpu_memory(model: nn.Module, alignment: int = 64) -> int:
    """Copy CPU parameters and buffers that are views into a memory-mapped checkpoint (at
    arbitrary file offsets) into freshly allocated, aligned memory. Returns how many moved.

    transformers keeps float32 safetensors weights as views of the mapped file, 8-byte
    aligned; MKL's small-batch GEMMs then take slower, numerically different paths (a
    few-token SmolLM2 forward is markedly slower unaligned, `bench/decode_round.py`).
    Tied weights are one Parameter, so they stay tied.
    """
    moved = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % alignment:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
                moved += 1
    return moved


def validate_layer_ids(target_layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Check the layer-id rules: non-empty, integers, strictly increasing, each in {-1} ∪ [0, L-1]."""
    ids = tuple(target_layer_ids)
    valid = f"-1 (embeddings) or 0..{num_layers - 1} (decoder layers of a {num_layers}-layer target)"
    if not ids:
        raise ValueError(f"target_layer_ids is empty; give at least one id in {valid}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"target_layer_ids={list(ids)} must be integers in {valid}")
    bad = [i for i in ids if not -1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(f"target_layer_ids={list(ids)} has ids {bad} out of range; valid ids are {valid}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"target_layer_ids={list(ids)} must be strictly increasing (e.g. sorted, no duplicates)")
    return ids


class TargetModel(nn.Module):
    """A frozen causal LM with feature capture at the layer ids of paper Eq. 2.

    The whole target is frozen: parameters never require grad, the module is
    always in eval mode (``train()`` is a no-op), and ``forward`` runs under
    ``torch.no_grad()``. ``embed`` and ``compute_logits`` are *not* under
    no_grad, so a drafter can backpropagate through them into its own inputs.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int], tokenizer: Any = None):
        super().__init__()
        config = model.config
        self.family: str = _family_of(config)
        self.model = model
        self.tokenizer = tokenizer
        self.text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self._parts = _find_anatomy(model)
        self.num_layers: int = len(self._parts.layers)
        self.hidden_size: int = int(self.text_config.hidden_size)
        self.vocab_size: int = int(self._parts.lm_head.weight.shape[0])
        self.final_logit_softcapping: float | None = getattr(self.text_config, "final_logit_softcapping", None)
        self.target_layer_ids: tuple[int, ...] = validate_layer_ids(target_layer_ids, self.num_layers)
        forward_params = inspect.signature(self._parts.text_model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache in model forwards.
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        model.requires_grad_(False)
        super().train(False)

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        target_layer_ids: Sequence[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        cpu_linear: str = "auto",
    ) -> TargetModel:
        """Load a target by hub name, local folder, or ``"smollm2-135m"`` (see :mod:`dspark.hub`).

        Multimodal Gemma checkpoints load as their ConditionalGeneration class
        (transformers' AutoModelForCausalLM mapping); only the text path is used.
        The tokenizer is loaded too (``.tokenizer``, None if the folder has none).
        ``"sdpa"`` on CPU loads as ``dspark.kernels.attention``'s ``sdpa_gqa``: the same kernel and
        numbers, without the key/value head copies of a multi-token (verification) forward.
        ``cpu_linear`` (``"auto"`` | ``"onednn"`` | ``"torch"``, :func:`dspark.kernels.cpu_linear.resolve`):
        whether the few-row products of decoding (1-128 rows) use oneDNN-packed weights; ``"auto"``
        does on a CPU in float32. Prefill and training products are unchanged.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dspark.kernels import attention

        path = hub.resolve_target_path(name_or_path)
        device = torch.device(device)
        if attn_implementation == "sdpa" and device.type == "cpu":
            attn_implementation = attention.register()
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            # Load straight onto an accelerator instead of materialising the weights in CPU memory first.
            device_map=None if device.type == "cpu" else {"": device},
        )
        model.to(device)
        _own_cpu_memory(model)
        if _cpu_linear.resolve(cpu_linear, device, dtype):
            _cpu_linear.pack_linears(model)
        tokenizer = None
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
            # transformers 5 would otherwise build an empty tokenizer from the model type.
            logger.warning("no tokenizer files in %s; TargetModel.tokenizer is None", path)
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            except Exception as err:  # the tokenizer is optional for the target itself
                logger.warning("no tokenizer loaded for %s: %s", name_or_path, err)
        return cls(model, target_layer_ids, tokenizer=tokenizer)

    def with_layers(self, target_layer_ids: Sequence[int]) -> TargetModel:
        """The same frozen model and tokenizer (shared, nothing copied or reloaded), capturing
        ``target_layer_ids`` instead: the target of a drafter that reads other layers."""
        if tuple(target_layer_ids) == self.target_layer_ids:
            return self
        return type(self)(self.model, target_layer_ids, tokenizer=self.tokenizer)

    # ------------------------------------------------------------ frozen parts
    def train(self, mode: bool = True) -> TargetModel:
        """No-op: the target stays in eval mode (no dropout) whatever its parent does."""
        return super().train(False)

    @property
    def embed_tokens(self) -> nn.Module:
        """The frozen input embedding module (Gemma: includes the sqrt(d) scale)."""
        return self._parts.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self._parts.lm_head

    @property
    def layers(self) -> nn.ModuleList:
        return self._parts.layers

    @property
    def device(self) -> torch.device:
        return self._parts.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._parts.lm_head.weight.dtype

    @property
    def tie_word_embeddings(self) -> bool:
        return self._parts.lm_head.weight is self._parts.embed_tokens.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, S] ids -> [B, S, d] input embeddings exactly as the target's first layer sees them."""
        return self._parts.embed_tokens(input_ids)

    def lm_head_weight(self) -> Tensor:
        """The frozen LM head matrix, [V, d] (the embedding matrix when tied)."""
        return self._parts.lm_head.weight

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., d] final-normed hidden -> [..., V] logits, with final_logit_softcapping if the family has it."""
        head = self._parts.lm_head
        bias = getattr(head, "bias", None)
        plain = type(head) in (nn.Linear, _cpu_linear.PackedLinear) and bias is None and not head._forward_hooks and not head._forward_pre_hooks
        if plain and not hasattr(head, "_hf_hook"):  # no offloading hooks: use the CPU-friendly kernel choice
            logits = vocab_logits(hidden, head.weight)
        else:
            logits = head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ----------------------------------------------------------------- caching
    def new_cache(self) -> Any:
        """An empty DynamicCache for :meth:`forward` (sliding-window layers keep their past so they can be cropped)."""
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.text_config)
        except TypeError:  # older transformers without the config argument
            cache = DynamicCache()
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    @staticmethod
    def crop_cache(cache: Any, length: int) -> None:
        """Keep the first ``length`` positions of ``cache`` in place (drop rejected draft tokens)."""
        current = cache.get_seq_length()
        if not 0 <= length <= current:
            raise ValueError(f"crop_cache length={length} must be in 0..{current} (the cached length)")
        if length < current:
            cache.crop(length - current)  # a negative count removes that many trailing positions

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        *,
        past_key_values: Any = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        use_cache: bool = False,
        return_logits: bool = True,
        logits_to_keep: int | Tensor | None = None,
    ) -> TargetOutput:
        """Run the target over ``input_ids`` [B, S], continuing whatever ``past_key_values`` holds.

        A given cache is extended in place (and returned); ``use_cache`` without
        one starts a fresh cache.

        attention_mask: [B, past+S] padding mask (1 = real token), as in transformers.
        logits_to_keep: int k keeps the last k positions (0/None: all); a 1-D tensor keeps those positions.
        """
        ids = self.target_layer_ids
        last = self.num_layers - 1
        captured: dict[int, Tensor] = {}
        cache = self.new_cache() if use_cache and past_key_values is None else past_key_values
        with self._capturing(captured):
            out = self._parts.text_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_kwarg: cache},
            )
        last_hidden = out.last_hidden_state  # [B, S, d], after the final norm
        if last in ids:
            captured[last] = last_hidden
        features = torch.cat([captured[i] for i in ids], dim=-1)  # [B, S, m*d]
        return TargetOutput(
            features=features,
            last_hidden=last_hidden,
            logits=self._kept_logits(last_hidden, logits_to_keep) if return_logits else None,
            past_key_values=cache,
        )

    @contextmanager
    def _capturing(self, captured: dict[int, Tensor]) -> Iterator[None]:
        """While active, forward hooks on the requested decoder layers only store their hidden
        states [B, S, d] in ``captured`` by layer id (id -1: the first layer's input). Id L-1,
        the final-normed state, is the model's output and is not hooked."""
        layers = self._parts.layers

        def keep_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[-1] = args[0] if args else kwargs["hidden_states"]

        def keep_output(layer_id: int):
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = []
        if -1 in self.target_layer_ids:
            handles.append(layers[0].register_forward_pre_hook(keep_input, with_kwargs=True))
        for i in self.target_layer_ids:
            if 0 <= i < self.num_layers - 1:
                handles.append(layers[i].register_forward_hook(keep_output(i)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _kept_logits(self, last_hidden: Tensor, logits_to_keep: int | Tensor | None) -> Tensor:
        """The LM head over the positions ``logits_to_keep`` keeps of ``last_hidden`` [B, S, d]: [B, S', V]."""
        kept = last_hidden
        if isinstance(logits_to_keep, Tensor):
            kept = last_hidden[:, logits_to_keep]
        elif logits_to_keep:
            kept = last_hidden[:, -logits_to_keep:]
        return self.compute_logits(kept)  # [B, S', V]

    def extra_repr(self) -> str:
        return (
            f"family={self.family}, layers={self.num_layers}, d={self.hidden_size}, V={self.vocab_size}, "
            f"target_layer_ids={list(self.target_layer_ids)}, softcap={self.final_logit_softcapping}"
        )
