"""The choice lists of dspark's configs and architectures, in one torch-free home.

``dspark.config`` validates experiment configs against them and
``dspark.modeling.config`` validates drafter architectures against them, so a name
offered in one is accepted by the other. Sequential heads, verification policies
and target families are registries (``dspark.registry``) because a researcher adds
to them; ``CHOICES`` reads those at validation time.
"""

from __future__ import annotations

VARIANTS = ("dspark", "dflash", "eagle3")
VARIANT_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}  # as tables and reports show them
# "eagle3": the standard EAGLE-3 that vLLM / SGLang serve (Llama-style layer, no q/k norms, 3 fused
# layers, reduced draft vocabulary); "eagle3_deepspec": DeepSpec's Qwen3Eagle3Model (q/k norms, the
# 5 DSpark layers, full vocabulary), the paper's baseline.
EAGLE3_PRESETS = ("eagle3", "eagle3_deepspec")
BLOCK_LAYOUTS = ("anchor_first", "anchor_plus_masks")  # DSpark's | the original DFlash's
ATTENTION_KERNELS = ("sdpa", "eager", "flex")  # a built drafter's; a config also takes "auto"
LAYER_FAMILIES = ("", "qwen3")  # "": the target's family; "qwen3": Qwen3 layers for a Llama target
DTYPES = ("auto", "float32", "bfloat16", "float16")

# config key -> its allowed values; a registry name ("heads") is read from dspark.registry when checked
CHOICES: dict[str, tuple[str, ...] | str] = {
    "target.dtype": DTYPES,
    "target.cpu_linear": ("auto", "onednn", "torch"),
    "drafter.variant": VARIANTS,
    "drafter.eagle3_preset": EAGLE3_PRESETS,
    "drafter.block_layout": BLOCK_LAYOUTS,
    "drafter.markov_head_type": "heads",
    "drafter.attn_implementation": ("auto", *ATTENTION_KERNELS),
    "drafter.layer_family": LAYER_FAMILIES,
    "drafter.dtype": ("float32", "bfloat16"),
    "data.feature_mode": ("cache", "online"),
    "data.cache_precision": ("fp8", "bf16", "fp32"),
    "data.vocab_counts": ("hard", "soft", "hard+soft"),
    "eval.split": ("all", "dev", "test"),
    "serve.engine": ("batched", "per-request"),
    "generation.backend": ("transformers", "openai"),
    "train.mixed_precision": ("auto", "bf16", "no"),
    "train.distributed": ("ddp", "fsdp"),
}
POSITIVE = (
    "drafter.block_size", "drafter.num_draft_layers", "data.max_length", "data.num_anchors",
    "train.global_batch_size", "train.micro_batch_size", "train.bucket_window", "generation.batch_size",
    "generation.max_new_tokens", "eval.max_new_tokens", "loss.chunk_rows", "serve.concurrency",
    "serve.max_new_tokens", "profile.context_len", "profile.repeats", "calibrate.bins", "propose.max_new_tokens",
    "propose.num_blocks", "eval.bootstrap_resamples", "drafter.ttt_length", "train.save_every", "train.log_every",
)
NON_NEGATIVE = (
    "threads", "eval.num_samples", "eval.block_size", "serve.num_prompts", "serve.num_requests",
    "profile.tokens_per_request", "profile.warmup", "eval.temperature",
    "propose.temperature", "drafter.draft_vocab_size", "calibrate.min_events", "calibrate.folds",
)


def choices_of(key: str) -> tuple[str, ...]:
    """The allowed values of config key ``key`` (a registry's names for a registry key)."""
    allowed = CHOICES[key]
    if allowed == "heads":
        from dspark.registry import HEADS

        return HEADS.names()
    return allowed  # type: ignore[return-value]
