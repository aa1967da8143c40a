"""Drafter checkpoints: a folder with `config.json` and `model.safetensors` (DeepSpec's parameter names).

A drafter with a draft vocabulary (dspark.modeling.vocab) also stores `draft_vocab_size` in
config.json and its `d2t` / `t2d` tensors at the top level of the safetensors (vLLM's names);
its `lm_head.weight`, when included, is the k rows it uses.

The frozen embedding and LM head are optional in the file: by default they are
left out (they are the target's) and re-attached from the target on load.
Folders written by DeepSpec (including sharded `model.safetensors.index.json`
and a `model.` name prefix) and by z-lab load by name; which layouts are read,
and how, is `dspark.modeling.formats`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.io.atomic import replace_dir
from dspark.modeling.config import DrafterConfig
from dspark.registry import HEADS
from dspark.modeling.drafter import SHARED_PARAMS, Drafter
from dspark.modeling.eagle3 import Eagle3Drafter
from dspark.modeling.formats import (
    CONFIG_NAME,
    SERVING_EAGLE3_ARCHITECTURE,
    parse_config,
    read_json,
    resolve_folder,
    serving_eagle3_weight_name,
)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

log = logging.getLogger(__name__)


def make_drafter(config: DrafterConfig) -> Drafter | Eagle3Drafter:
    """A freshly initialised drafter of the config's variant: Eagle3 or the DSpark/DFlash backbone."""
    return Eagle3Drafter(config) if config.variant == "eagle3" else Drafter(config)


def save_drafter(
    drafter: Drafter,
    folder: str | os.PathLike,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    include_shared: bool = False,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write config.json + model.safetensors atomically (a temp folder renamed into place).

    `state_dict` replaces `drafter.state_dict()` when the drafter's own tensors are not
    whole, e.g. full tensors gathered from an FSDP-sharded drafter (same names).
    """
    folder = Path(folder)
    config = config_of_parts(drafter)
    folder.parent.mkdir(parents=True, exist_ok=True)
    source = drafter.state_dict() if state_dict is None else state_dict
    state = {name: t.detach().contiguous().cpu() for name, t in source.items()}
    if include_shared:
        for name, t in drafter.shared_weights().items():
            state[name] = t.detach().cpu().clone()  # a copy: safetensors refuses shared storage
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(config.to_hf_dict(), f, indent=2, sort_keys=True)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", **(metadata or {})})
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def config_of_parts(drafter: Drafter) -> DrafterConfig:
    """The config that rebuilds `drafter` as it is: a sequential head assigned after construction is
    recorded by the name it is registered under in dspark.registry.HEADS (an unregistered one is
    refused: config.json could not name it, and the folder would load as another head)."""
    config = drafter.config
    head = getattr(drafter, "markov_head", None)
    if head is None:
        return config
    if HEADS.get(config.markov_head_type) is type(head):
        return config
    names = [name for name in HEADS.names() if HEADS.get(name) is type(head)]
    if not names:
        cls = type(head)
        raise ValueError(
            f"drafter.markov_head is a {cls.__module__}.{cls.__qualname__}, which is not registered in "
            f"dspark.registry.HEADS, so config.json cannot name it (it says {config.markov_head_type!r}); "
            f"register it first: dspark.registry.HEADS.register('<name>', {cls.__qualname__}) (docs/extending.md)"
        )
    return config.replace(markov_head_type=names[0])


def read_config(folder: str | os.PathLike) -> DrafterConfig:
    """The DrafterConfig of any accepted folder layout (see `dspark.modeling.formats`)."""
    path = resolve_folder(folder) / CONFIG_NAME
    return parse_config(read_json(path), str(path))


def _safetensors_files(folder: Path) -> list[Path]:
    if (folder / INDEX_NAME).is_file():
        index = read_json(folder / INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{folder / INDEX_NAME} has no weight_map object naming the shard files")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path} (named by {INDEX_NAME}) not found: the checkpoint is incomplete")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {folder}")


def read_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, with a leading `model.` stripped.

    A truncated or corrupted file is a ValueError naming it (safetensors checks the header and
    that the data section covers every tensor)."""
    folder = resolve_folder(folder)
    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = key[len("model."):] if key.startswith("model.") else key
                    state[name] = f.get_tensor(key)
        except Exception as e:  # SafetensorError, or OSError/RuntimeError from a broken mapping
            raise ValueError(
                f"{path} is not a readable safetensors file (truncated or corrupted?): {e}; "
                "copy the checkpoint again or re-save it"
            ) from None
    return state


def _with_rnn_bias_of_file(config: DrafterConfig, raw: dict[str, Any], state: dict[str, torch.Tensor]) -> DrafterConfig:
    """Folders without an `rnn_bias` field (DeepSpec's, and dspark's written without one) say it by the tensor."""
    if config.markov_head_type != "rnn" or "rnn_bias" in raw:
        return config
    return config.replace(rnn_bias="markov_head.joint_proj.bias" in state)


def _check_shapes(drafter: Drafter, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Every tensor has the shape the config implies (named on mismatch); so do the shared tables."""
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    V, d = drafter.config.vocab_size, drafter.config.hidden_size
    expected.update({name: (V, d) for name in SHARED_PARAMS})
    # A draft vocabulary's checkpoint stores the LM head's k rows (what vLLM loads with d2t).
    expected["lm_head.weight"] = (drafter.config.output_vocab_size, d)
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{folder}: tensor {name} has shape {tuple(tensor.shape)}, its config.json implies {expected[name]}"
            )


def check_against_target(config: DrafterConfig, target: Any, folder: Path | str = "the drafter") -> None:
    """The drafter was built for this target: hidden size, vocabulary, layer count and the feature
    layers the target captures agree. Raises ValueError naming the field that differs and the fix,
    before any forward runs (a mismatch would otherwise surface as a shape error inside decoding)."""
    embed = target.embed_tokens.weight
    checks = (
        ("hidden_size", config.hidden_size, int(embed.shape[1])),
        ("vocab_size", config.vocab_size, int(embed.shape[0])),
        ("num_target_layers", config.num_target_layers, len(target.layers)),
    )
    for field, ours, theirs in checks:
        if ours != theirs:
            raise ValueError(
                f"{folder}: its {field} is {ours}, the target's is {theirs}: the drafter was built for another "
                "target; load the target it was trained with (its config.json names it)"
            )
    captured = getattr(target, "target_layer_ids", None)
    if captured is not None and [int(i) for i in captured] != list(config.target_layer_ids):
        raise ValueError(
            f"{folder}: the drafter reads the target's layers {list(config.target_layer_ids)} "
            f"(target_layer_ids), the target captures {[int(i) for i in captured]}; pass "
            f"target.with_layers({list(config.target_layer_ids)}) (the same model, nothing reloaded), or load the "
            f"target with them: dspark.load_target(config, target_layer_ids={list(config.target_layer_ids)})"
        )


def load_drafter(
    folder: str | os.PathLike,
    target: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_overrides: Any,
) -> Drafter:
    """Build a drafter from a folder of any accepted layout (dspark, DeepSpec, z-lab DFlash, a
    training output folder); share `target`'s embedding/LM head when given, else load them from the
    file (which must then contain them)."""
    folder = resolve_folder(folder)
    raw = read_json(folder / CONFIG_NAME)
    config = parse_config(raw, str(folder / CONFIG_NAME))
    state = read_weights(folder)
    if raw.get("architectures") == [SERVING_EAGLE3_ARCHITECTURE]:
        state = {serving_eagle3_weight_name(name): t for name, t in state.items()}
    config = _with_rnn_bias_of_file(config, raw, state)
    if not config.draft_vocab_size and "d2t" in state and not bool(state["d2t"].any()):
        state.pop("d2t"), state.pop("t2d", None)  # draft_vocab_size = vocab_size: the identity map
    if config_overrides:
        config = config.replace(**config_overrides)
    if target is not None:
        check_against_target(config, target, folder)
    drafter = make_drafter(config)
    _check_shapes(drafter, state, folder)
    expected = set(drafter.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected - set(SHARED_PARAMS))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match its config.json: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    own = {k: v for k, v in state.items() if k not in SHARED_PARAMS}
    drafter.load_state_dict(own, strict=True)
    drafter.to(device=device, dtype=dtype)
    if target is not None:
        drafter.attach_target(target)
    elif all(k in state for k in SHARED_PARAMS):
        # Copies into freshly allocated memory: the file's tensors are views of the memory-mapped
        # file at arbitrary offsets, which would keep the file mapped and, misaligned, steer CPU
        # kernels to other (numerically different) code paths than a freshly built drafter takes.
        shared = [state[name].to(device, dtype, copy=True) for name in SHARED_PARAMS]
        drafter.attach_shared(*shared)
    else:
        log.warning("%s holds no embedding / LM head and no target was given: call attach_target() before use", folder)
    return drafter
