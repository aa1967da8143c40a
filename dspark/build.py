"""Build the runtime objects (target, drafter) that a `dspark.config.Config` describes."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from dspark.kernels import cpu_linear
from dspark.config import Config, DrafterSpec
from dspark.config_checks import init_from_target_choice
from dspark.modeling import Drafter, DrafterConfig, Eagle3Drafter, make_drafter
from dspark.modeling.init import check_init_from_target, choose_layer_ids, init_draft_layers_from_target
from dspark.target import TargetModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), through oneDNN."""
    return cpu_linear.native_bf16()


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype to decode in: a DTYPES name, or "auto".

    "auto" picks what the hardware runs fastest without losing range: bfloat16 on
    a GPU that supports it (float16 on older ones), bfloat16 on a CPU with native
    bf16 (faster than fp32 there: `bench/decode_round.py` measures it), float32 otherwise.
    Speculative decoding is lossless with respect to the target run in that dtype.
    """
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype={name!r}; use one of {', '.join(DTYPE_CHOICES)}")
        return DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_mixed_precision(name: str, device: torch.device | str) -> str:
    """The training precision of `train.mixed_precision`: "bf16" or "no".

    "auto" is "bf16" (autocast over fp32 master weights) where bf16 matmuls run in hardware:
    a GPU with bf16 support, a CPU with native bf16 (AVX512-BF16 or AMX: faster there, with the
    same loss; `bench/train_step.py` measures it); "no" (fp32) elsewhere, where CPU bf16 is
    emulated and slower than fp32 and fp16-only GPUs would need loss scaling.
    """
    if name != "auto":
        if name not in ("bf16", "no"):
            raise ValueError(f"train.mixed_precision={name!r}; use auto, bf16 or no")
        return name
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    if device.type == "cpu" and cpu_has_native_bf16():
        return "bf16"
    return "no"


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def resolve_device(name: str) -> torch.device:
    """The device of a config's `target.device`: "auto" (and a bare "cuda") is this rank's GPU
    (LOCAL_RANK under torchrun) when there is one, else the CPU."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu" if name == "auto" else name)


def resolve_attention(name: str, device: torch.device) -> str:
    """The drafter's attention kernel: "auto" is flex attention on a GPU and sdpa elsewhere
    (flex attention has no CPU backward)."""
    if name != "auto":
        return name
    return "flex" if device.type == "cuda" else "sdpa"


def load_target(config: Config, target_layer_ids: list[int] | None = None) -> TargetModel:
    """The frozen target of `config.target`, capturing `target_layer_ids` (default
    `config.drafter.target_layer_ids`), on the resolved device in the resolved dtype."""
    t = config.target
    device = resolve_device(t.device)
    return TargetModel.from_pretrained(
        t.name_or_path,
        list(config.drafter.target_layer_ids if target_layer_ids is None else target_layer_ids),
        dtype=resolve_dtype(t.dtype, device),
        device=device,
        attn_implementation=t.attn_implementation,
        trust_remote_code=t.trust_remote_code,
        cpu_linear=t.cpu_linear,
    )


def drafter_config(spec: DrafterSpec, target: TargetModel, num_anchors: int = 512) -> DrafterConfig:
    """The architecture an experiment's drafter section describes for `target`: the sizes are the
    target's; a "dflash" or "eagle3" drafter gets no sequential or confidence head; the attention
    kernel "auto" is resolved on the target's device."""
    shared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(DrafterConfig) if hasattr(spec, f.name)}
    is_dspark = spec.variant == "dspark"
    shared.update(
        num_anchors=num_anchors,
        markov_rank=spec.markov_rank if is_dspark else 0,
        enable_confidence_head=spec.enable_confidence_head and is_dspark,
        confidence_head_with_markov=spec.confidence_head_with_markov and is_dspark,
        attn_implementation=resolve_attention(spec.attn_implementation, torch.device(target.device)),
    )
    return DrafterConfig.from_target_config(target.text_config, layer_family=spec.layer_family, **shared)


def init_layer_ids(config: Config, target: TargetModel) -> list[int]:
    """The target decoder layers that `drafter.init_from_target` copies into draft layers 0, 1, ...
    ([] for a random init), checked against `target` (dspark.modeling.init.check_init_from_target:
    configs and shapes only, cheap enough to run before the data work)."""
    choice = init_from_target_choice(config.drafter.init_from_target)
    if not choice:
        return []
    arch = drafter_config(config.drafter, target, config.data.num_anchors)
    ids = choose_layer_ids(choice, arch.num_draft_layers, len(target.layers))
    check_init_from_target(arch, target, ids)
    return ids


def build_drafter(config: Config, target: TargetModel, seed: int | None = None) -> Drafter | Eagle3Drafter:
    """A freshly initialised drafter attached to `target` (seeded by config.seed), in
    `config.drafter.dtype` (the training master weights); with `drafter.init_from_target` its
    decoder layers start as copies of the target's (dspark.modeling.init). A resumed run then
    overwrites every tensor with the checkpoint's (`Trainer.load_checkpoint`)."""
    layer_ids = init_layer_ids(config, target)
    torch.manual_seed(config.seed if seed is None else seed)
    drafter = make_drafter(drafter_config(config.drafter, target, config.data.num_anchors))
    drafter.to(device=target.device, dtype=DTYPES[config.drafter.dtype])
    if layer_ids:
        report = init_draft_layers_from_target(drafter, target, layer_ids)
        log.info("draft layers initialised from target layers %s: %d tensors copied whole, %d into the hidden "
                 "half, %d kept at init", layer_ids, len(report.copied), len(report.hidden_half), len(report.kept))
    return drafter.attach_target(target)


def prepare_for_decoding(target: TargetModel, drafter: Drafter | Eagle3Drafter) -> Drafter | Eagle3Drafter:
    """The drafter in eval mode, its few-row products on oneDNN-packed weights when the target's are
    (``target.cpu_linear``, dspark.kernels.cpu_linear)."""
    if cpu_linear.is_registered(target.lm_head_weight()):
        cpu_linear.pack_linears(drafter)
    return drafter.eval()


def load_models(config: Config) -> tuple[TargetModel, Drafter | Eagle3Drafter, str]:
    """The target and the drafter that `propose`, `eval` and `simulate` decode with, and where
    the drafter comes from: the trained folder `eval.draft`, or else a fresh drafter built from
    `config.drafter` (untrained). Both run in the target's dtype (fp32 for an fp16 target's
    fresh drafter), in eval mode; `eval.block_size` overrides the drafter's γ."""
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config

    draft, gamma = config.eval.draft, config.eval.block_size
    if draft:
        target = load_target(config, read_config(draft).target_layer_ids)
        drafter = load_drafter(draft, target, dtype=target.dtype, device=target.device,
                               **({"block_size": gamma} if gamma else {}))
        return target, prepare_for_decoding(target, drafter), f"loaded from {draft}"
    target = load_target(config)
    dtype = torch.float32 if target.dtype == torch.float16 else target.dtype
    spec = dataclasses.replace(config.drafter, dtype=dtype_name(dtype), **({"block_size": gamma} if gamma else {}))
    drafter = build_drafter(dataclasses.replace(config, drafter=spec), target)
    return target, prepare_for_decoding(target, drafter), "freshly initialised from the config's drafter section (untrained: expect τ near 1)"
