"""Initialise a drafter's decoder layers from the target's own decoder layers (`drafter.init_from_target`).

A draft layer has the shape of a target decoder layer (`dspark.modeling.layers`), so it can start
from the weights of one instead of from noise.

- `choose_layer_ids`: which target layer feeds which draft layer ("last", "spread" or given ids).
- `check_init_from_target`: the checks, on configs and shapes only, before anything is copied.
- `init_draft_layers_from_target`: the copy; its `InitReport` names what was copied, what kept its
  init and which target tensors were not used.
- `DRAFT_LAYER_SOURCES`, `EAGLE3_LAYER_SOURCES`, `EAGLE3_HIDDEN_HALF`: the name maps it follows.

Why, and what maps where for DSpark / DFlash and Eagle3 layers: docs/method.md, "Draft layers from
the target".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dspark.modeling.config import DrafterConfig, resolve_attention_dims
from dspark.modeling.eagle3 import Eagle3Layer
from dspark.modeling.layers import DraftLayer

LAYER_CHOICES = ("last", "spread")

# Draft-layer tensor or module -> the target decoder-layer one it is copied from.
_SHARED_NAMES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "post_attention_layernorm",
)
_NORMS = ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm", "layer_scalar")
DRAFT_LAYER_SOURCES = {name: name for name in (*_SHARED_NAMES, *_NORMS)}
EAGLE3_LAYER_SOURCES = {**{name: name for name in _SHARED_NAMES}, "hidden_norm": "input_layernorm"}
# Eagle3 weights [out, 2d] over [embedding ; hidden]: the target's [out, d] fills the hidden half.
EAGLE3_HIDDEN_HALF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


@dataclass
class InitReport:
    """What `init_draft_layers_from_target` did, by drafter state-dict name ("layers.0.mlp.up_proj.weight")."""

    layer_ids: list[int]  # target decoder layer copied into draft layer j
    copied: dict[str, str] = field(default_factory=dict)  # drafter name -> target name, whole tensor
    hidden_half: dict[str, str] = field(default_factory=dict)  # Eagle3: into columns d:2d, columns :d zeroed
    kept: list[str] = field(default_factory=list)  # no counterpart in the target: left at their init
    unused: list[str] = field(default_factory=list)  # tensors of the copied target layers left out


def choose_layer_ids(choice: str | Sequence[int], num_draft_layers: int, num_target_layers: int) -> list[int]:
    """The target decoder layer for each draft layer, in draft-layer order.

    choice "last": the last n target layers, in order (the layers nearest the LM head the drafter
    shares); "spread": n ids evenly spaced over [0, N−1], round(i·(N−1)/(n−1)) for i = 0..n−1,
    so the first draft layer (which reads token embeddings) starts as the target's first and the last
    (which feeds the final norm and LM head) as its last; n = 1 gives [N−1]. A sequence of ids is
    taken as it is (repeats allowed). n = num_draft_layers, N = num_target_layers."""
    n, N = num_draft_layers, num_target_layers
    if not isinstance(choice, str):
        return [int(i) for i in choice]
    if choice not in LAYER_CHOICES:
        raise ValueError(f"drafter.init_from_target={choice!r} is not one of {LAYER_CHOICES} or a list of layer ids")
    if n > N:
        raise ValueError(
            f"drafter.init_from_target={choice!r} needs one target layer per draft layer, but "
            f"drafter.num_draft_layers={n} exceeds the target's {N} layers; give {n} ids instead "
            "(repeats allowed) or fewer draft layers"
        )
    if choice == "last":
        return list(range(N - n, N))
    if n == 1:
        return [N - 1]
    return [(2 * i * (N - 1) + n - 1) // (2 * (n - 1)) for i in range(n)]  # round half up


def check_init_from_target(config: DrafterConfig, target: Any, layer_ids: Sequence[int]) -> None:
    """Raise a ValueError naming the config field unless the drafter ``config`` describes can take
    the target's decoder layers ``layer_ids``: one id per draft layer, each in [0, N−1], the draft
    layers' widths equal to the target's, and every counterpart tensor of the same shape (a Gemma4
    sliding-attention layer does not fit the full-attention draft layers). Reads configs and shapes
    only: cheap enough to run before any data work."""
    ids, N = list(layer_ids), len(target.layers)
    if len(ids) != config.num_draft_layers:
        raise ValueError(
            f"drafter.init_from_target names {len(ids)} target layers {ids} for drafter.num_draft_layers="
            f"{config.num_draft_layers}: give one id per draft layer"
        )
    bad = [i for i in ids if not 0 <= i < N]
    if bad:
        raise ValueError(
            f"drafter.init_from_target has layer ids {bad} out of range: the target has {N} decoder layers, "
            f"ids 0..{N - 1}"
        )
    _check_widths(config, target.text_config)
    with torch.device("meta"):
        draft_layer = _draft_layer(config)
    for i in sorted(set(ids)):
        _layer_plan(draft_layer, target.layers[i], config.variant == "eagle3", i, _layer_types(target))


@torch.no_grad()
def init_draft_layers_from_target(drafter: nn.Module, target: Any, layer_ids: Sequence[int]) -> InitReport:
    """Copy target decoder layer ``layer_ids[j]`` into draft layer j of ``drafter`` (a `Drafter` or
    an `Eagle3Drafter`), cast to each drafter tensor's dtype and device; what maps where:
    docs/method.md, "Draft layers from the target". Checks everything first
    (`check_init_from_target`), so a refusal changes nothing. Returns what was copied and what was not."""
    config = drafter.config
    check_init_from_target(config, target, layer_ids)
    eagle3, types = config.variant == "eagle3", _layer_types(target)
    report = InitReport(layer_ids=list(layer_ids))
    copied: set[str] = set()
    for j, (draft_layer, i) in enumerate(zip(drafter.layers, layer_ids)):
        ours, theirs = draft_layer.state_dict(keep_vars=True), target.layers[i].state_dict(keep_vars=True)
        plan = _layer_plan(draft_layer, target.layers[i], eagle3, i, types)
        for name, source in plan.items():
            dst, src = ours[name], theirs[source]
            if eagle3 and name in EAGLE3_HIDDEN_HALF:
                d = src.shape[1]
                dst[:, :d].zero_()  # [out, d] embedding half
                dst[:, d:].copy_(src)  # [out, d] hidden half
                report.hidden_half[f"layers.{j}.{name}"] = f"layers.{i}.{source}"
            else:
                dst.copy_(src)
                report.copied[f"layers.{j}.{name}"] = f"layers.{i}.{source}"
            copied.add(f"layers.{j}.{name}")
        report.unused += [f"layers.{i}.{n}" for n in theirs if n not in plan.values()]
    report.kept = [name for name in drafter.state_dict() if name not in copied]
    report.unused = list(dict.fromkeys(report.unused))
    return report


def _draft_layer(config: DrafterConfig) -> nn.Module:
    return Eagle3Layer(config) if config.variant == "eagle3" else DraftLayer(config)


def _widths(base: dict[str, Any], intermediate: int | None) -> dict[str, int]:
    heads, kv_heads, head_dim = resolve_attention_dims(base)
    return {
        "hidden_size": int(base["hidden_size"]),
        "intermediate_size": int(intermediate or base["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


def _check_widths(config: DrafterConfig, text_config: Any) -> None:
    """The draft layers' widths (with `intermediate_size` None resolved to the target's) against the
    target's text config, field by field."""
    base = text_config.to_dict()
    base["model_type"] = getattr(text_config, "model_type", base.get("model_type"))
    ours, theirs = _widths(config.base_config, config.intermediate_size), _widths(base, None)
    for key, value in ours.items():
        if value == theirs[key]:
            continue
        if key == "intermediate_size":
            raise ValueError(
                f"drafter.intermediate_size={value} must equal the target's {theirs[key]} to copy its layers; "
                "set drafter.intermediate_size=None (the target's) or drafter.init_from_target='' (random init)"
            )
        raise ValueError(
            f"the draft layers have {key}={value}, the target {theirs[key]}: its layers do not fit the drafter; "
            "set drafter.init_from_target='' (random init)"
        )


def _layer_types(target: Any) -> list[str]:
    return list(getattr(target.text_config, "layer_types", None) or [])


def _source_name(name: str, sources: dict[str, str]) -> str | None:
    """The target-layer tensor a draft-layer tensor copies ("mlp.up_proj.bias" -> "mlp.up_proj.bias"), or None."""
    if name in sources:
        return sources[name]
    module, _, leaf = name.rpartition(".")
    return f"{sources[module]}.{leaf}" if module in sources else None


def _layer_plan(draft_layer: nn.Module, target_layer: nn.Module, eagle3: bool, layer_id: int,
                layer_types: list[str]) -> dict[str, str]:
    """{draft-layer tensor name: target-layer tensor name} of the copies from one target layer,
    every pair of matching shape (Eagle3's q/k/v: the target's [out, d] against half of [out, 2d])."""
    sources = EAGLE3_LAYER_SOURCES if eagle3 else DRAFT_LAYER_SOURCES
    theirs = target_layer.state_dict(keep_vars=True)
    plan = {}
    for name, tensor in draft_layer.state_dict(keep_vars=True).items():
        source = _source_name(name, sources)
        if source is None or source not in theirs:
            continue
        want = tuple(tensor.shape)
        if eagle3 and name in EAGLE3_HIDDEN_HALF:
            want = (want[0], want[1] // 2)
        if tuple(theirs[source].shape) != want:
            raise ValueError(_shape_error(layer_id, source, tuple(theirs[source].shape), name, want, layer_types))
        plan[name] = source
    return plan


def _shape_error(layer_id: int, source: str, got: tuple, name: str, want: tuple, layer_types: list[str]) -> str:
    kind = f" ({layer_types[layer_id]})" if layer_id < len(layer_types) else ""
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    hint = f" (the target's full-attention layers: {full})" if full and len(full) < len(layer_types) else ""
    return (
        f"target layer {layer_id}{kind} has {source} of shape {got}, the draft layers' {name} needs {want}: "
        f"it does not fit the drafter; choose other layer ids in drafter.init_from_target{hint}"
    )
