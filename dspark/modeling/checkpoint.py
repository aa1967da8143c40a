"""Drafter checkpoints: a folder with `config.json` and `model.safetensors` (SPEC 3.1 names).

The frozen embedding and LM head are optional in the file: by default they are
left out (they are the target's) and re-attached from the target on load.
Folders written by DeepSpec (including sharded `model.safetensors.index.json`
and a `model.` name prefix) load by name.
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

from dspark.fsutil import replace_dir
from dspark.modeling.config import DrafterConfig
from dspark.modeling.drafter import SHARED_PARAMS, Drafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

log = logging.getLogger(__name__)


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
    folder.parent.mkdir(parents=True, exist_ok=True)
    source = drafter.state_dict() if state_dict is None else state_dict
    state = {name: t.detach().contiguous().cpu() for name, t in source.items()}
    if include_shared:
        for name, t in drafter.shared_weights().items():
            state[name] = t.detach().cpu().clone()  # a copy: safetensors refuses shared storage
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(drafter.config.to_hf_dict(), f, indent=2, sort_keys=True)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", **(metadata or {})})
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_config(folder: str | os.PathLike) -> DrafterConfig:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a drafter folder holds config.json and model.safetensors")
    with open(path) as f:
        return DrafterConfig.from_hf_dict(json.load(f))


def read_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, with a leading `model.` stripped."""
    folder = Path(folder)
    if (folder / INDEX_NAME).is_file():
        with open(folder / INDEX_NAME) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (folder / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {folder}")
    state: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for key in f.keys():
                name = key[len("model."):] if key.startswith("model.") else key
                state[name] = f.get_tensor(key)
    return state


def load_drafter(
    folder: str | os.PathLike,
    target: Any = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_overrides: Any,
) -> Drafter:
    """Build a drafter from a folder; share `target`'s embedding/LM head when given, else
    load them from the file (which must then contain them)."""
    config = read_config(folder)
    if config_overrides:
        config = config.replace(**config_overrides)
    drafter = Drafter(config)
    state = read_weights(folder)
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
