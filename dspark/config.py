"""Typed experiment configs, the Python config-file loader and `key.path=value` overrides.

A config file is plain Python that builds one `Config` and binds it to the
name `config` (nothing else in the file becomes configuration):

    from dspark.config import Config, TargetConfig, DrafterSpec
    config = Config(
        name="dspark_qwen3_4b",
        target=TargetConfig(name_or_path="Qwen/Qwen3-4B"),
        drafter=DrafterSpec(target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    )

`load_config(path, overrides=["train.lr=3e-4", "drafter.block_size=8"])`
applies overrides with type checking against the dataclass fields; an
unknown key or a value of the wrong type is a ValueError naming the key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import runpy
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints


@dataclass
class TargetConfig:
    name_or_path: str = "smollm2-135m"  # hub name, local folder, or the embedded default
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


@dataclass
class DrafterSpec:
    """The drafter's architecture (SPEC 3). Sizes not given here are the target's."""

    target_layer_ids: list[int] = field(default_factory=lambda: [1, 9, 17, 25, 33])
    mask_token_id: int = 0
    variant: str = "dspark"  # "dspark" | "dflash"
    block_size: int = 7
    num_draft_layers: int = 5
    block_layout: str = "anchor_first"  # "anchor_first" (DSpark) | "anchor_plus_masks" (original DFlash)
    markov_rank: int = 256
    markov_head_type: str = "vanilla"  # "vanilla" | "rnn"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    intermediate_size: int | None = None  # None: the target's
    attn_implementation: str = "sdpa"  # "sdpa" | "eager" | "flex" (GPU)
    dtype: str = "float32"  # parameter dtype of the drafter (master weights stay fp32 when training)


@dataclass
class DataConfig:
    train_prompts: str = "builtin"  # "builtin", a .jsonl path, or "hub:<dataset name>"
    eval_prompts: str = ""  # held-out prompts for validation τ ("" = split from train)
    holdout_fraction: float = 0.05
    max_samples: int = 0  # 0 = all
    max_length: int = 4096
    min_loss_tokens: int = 8
    num_anchors: int = 512
    data_dir: str = ""  # where regenerated answers and the cache live ("" = <out_dir>/data)
    feature_mode: str = "cache"  # "cache" (dspark cache) | "online" (target runs in the step)
    cache_precision: str = "fp8"  # "fp8" | "bf16" | "fp32"


@dataclass
class GenerationConfig:
    """The target's recommended sampling for regenerating answers (non-thinking)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 1024
    batch_size: int = 32
    backend: str = "transformers"  # "transformers" | "openai" (vLLM / SGLang server)
    server_url: str = ""
    request_timeout_s: float = 300.0
    max_retries: int = 3


@dataclass
class LossConfig:
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    loss_decay_gamma: float = 4.0
    chunk_rows: int = 64
    fused: bool = True  # LM-head gradients in the forward pass (no recomputation); False: generic chunked loss


@dataclass
class TrainConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    global_batch_size: int = 512  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 1  # sequences per forward on one rank
    epochs: float = 10.0
    max_steps: int = 0  # 0 = from epochs
    mixed_precision: str = "bf16"  # "bf16" (autocast; on CPU only worth it with native bf16) | "no" (fp32)
    compile: bool = False
    distributed: str = "ddp"  # "ddp" | "fsdp"
    save_every: int = 500
    eval_every: int = 100
    log_every: int = 10
    max_wall_minutes: float = 0.0  # 0 = no limit
    tensorboard: bool = False


@dataclass
class EvalConfig:
    benchmarks: list[str] = field(
        default_factory=lambda: ["gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2"]
    )
    data_dir: str = "eval_datasets"
    num_samples: int = 0  # 0 = SPEC 6 defaults per benchmark
    max_new_tokens: int = 2048
    temperature: float = 1.0
    seed: int = 0


@dataclass
class Config:
    name: str = "dspark"
    out_dir: str = "runs"
    seed: int = 42
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------- validation
_CHOICES = {
    "target.dtype": ("float32", "bfloat16", "float16"),
    "drafter.variant": ("dspark", "dflash"),
    "drafter.block_layout": ("anchor_first", "anchor_plus_masks"),
    "drafter.markov_head_type": ("vanilla", "rnn"),
    "drafter.attn_implementation": ("sdpa", "eager", "flex"),
    "drafter.dtype": ("float32", "bfloat16"),
    "data.feature_mode": ("cache", "online"),
    "data.cache_precision": ("fp8", "bf16", "fp32"),
    "generation.backend": ("transformers", "openai"),
    "train.mixed_precision": ("bf16", "no"),
    "train.distributed": ("ddp", "fsdp"),
}
_POSITIVE = (
    "drafter.block_size", "drafter.num_draft_layers", "data.max_length", "data.num_anchors",
    "train.global_batch_size", "train.micro_batch_size", "generation.batch_size",
    "generation.max_new_tokens", "eval.max_new_tokens", "loss.chunk_rows",
)


def validate(config: Config) -> None:
    for key, choices in _CHOICES.items():
        value = get_key(config, key)
        if value not in choices:
            raise ValueError(f"{key}={value!r} is not one of {choices}")
    for key in _POSITIVE:
        value = get_key(config, key)
        if value <= 0:
            raise ValueError(f"{key} must be > 0, got {value}")
    ids = config.drafter.target_layer_ids
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
        raise ValueError(
            f"drafter.target_layer_ids={ids} must be non-empty, strictly increasing, each >= -1 "
            "(-1 = embedding output, i = output of decoder layer i)"
        )
    if config.train.global_batch_size % config.train.micro_batch_size:
        raise ValueError(
            f"train.global_batch_size={config.train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={config.train.micro_batch_size}"
        )
    if not 0 <= config.data.holdout_fraction < 1:
        raise ValueError(f"data.holdout_fraction must be in [0, 1), got {config.data.holdout_fraction}")
    if config.eval.temperature < 0:
        raise ValueError(f"eval.temperature must be >= 0, got {config.eval.temperature}")


# ------------------------------------------------------------------ overrides
def get_key(config: Any, key: str) -> Any:
    obj = config
    for part in key.split(".") if key else []:
        obj = getattr(obj, part)
    return obj


def _field_types(obj: Any) -> dict[str, Any]:
    return get_type_hints(type(obj), globalns=globals())


def _keys(obj: Any, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _keys(value, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Check/convert `raw` (already a Python value) to the field's annotated type."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if raw is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, raw, option)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: bad value {raw!r}")
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        if isinstance(raw, tuple):
            raw = list(raw)
        if not isinstance(raw, list):
            raise ValueError(f"{key} expects a list, got {raw!r}; write e.g. {key}=[1,2,3]")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(raw)]
    if annotation is Any:
        return raw
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ValueError(f"{key} expects true/false, got {raw!r}")
    if annotation is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"{key} expects an integer, got {raw!r}")
        return raw
    if annotation is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"{key} expects a number, got {raw!r}")
        return float(raw)
    if annotation is str:
        if not isinstance(raw, str):
            raise ValueError(f"{key} expects a string, got {raw!r}")
        return raw
    raise ValueError(f"{key}: unsupported field type {annotation}")


def _parse_literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered in ("none", "null"):
            return None
        return text  # a bare string


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Apply `key.path=value` strings; returns a new validated Config."""
    valid = _keys(config)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, text = (s.strip() for s in item.split("=", 1))
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(valid)}"
            raise ValueError(f"unknown config key {key!r}{hint}")
        *path, leaf = key.split(".")
        owner = get_key(config, ".".join(path)) if path else config
        value = _coerce(key, _parse_literal(text), _field_types(owner)[leaf])
        config = _replace_path(config, key.split("."), value)
    validate(config)
    return config


def _replace_path(obj: Any, parts: list[str], value: Any) -> Any:
    """A copy of `obj` with the field at `parts` set to value (the original is not mutated)."""
    if len(parts) == 1:
        return dataclasses.replace(obj, **{parts[0]: value})
    child = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(child, parts[1:], value)})


def check_types(config: Config) -> None:
    """Every field of every section holds a value of its annotated type."""
    for key in _keys(config):
        *path, leaf = key.split(".")
        obj = config
        for part in path:
            obj = getattr(obj, part)
        _coerce(key, getattr(obj, leaf), _field_types(obj)[leaf])


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Run a Python config file in its own namespace and take its `config` object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    namespace = runpy.run_path(str(path))
    config = namespace.get("config")
    if not isinstance(config, Config):
        raise ValueError(
            f"{path} must bind a dspark.config.Config to the name `config` "
            f"(found {type(config).__name__})"
        )
    check_types(config)
    return apply_overrides(config, list(overrides or []))

