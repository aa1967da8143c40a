"""What a drafter folder is (`dspark inspect`'s first step), read without building a model.

``describe_folder(path)``: the folder's format, algorithm, block layout, γ, layer ids and their
convention, mask token, heads, draft vocabulary, parameter counts and stored dtypes, from
``config.json`` and the safetensors headers only. The folder and its layout are those
``load_drafter`` reads (``dspark.modeling.formats``: ``locate_drafter``, ``detect_format``);
``FORMATS`` says how each layout is described. ``dspark.interop.inspect`` checks the description
against a target.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.modeling.formats import CONFIG_NAME, detect_format, locate_drafter, read_json

# Frozen copies of the target's tensors that a folder may carry (DeepSpec does, we do not by default).
FROZEN_TENSORS = ("embed_tokens.weight", "lm_head.weight")
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                      "BOOL": "bool", "U8": "uint8", "I8": "int8"}
OUR_CONVENTION = "output of decoder layer i (HF hidden_states[i+1]; -1 = embeddings)"


# ----------------------------------------------------------------------------- description
@dataclass
class ParamCounts:
    """Numbers of stored parameters: the drafter's own, and frozen copies of the target's."""

    trainable: int
    frozen: int
    frozen_tensors: list[str]


@dataclass
class FolderDescription:
    """What a drafter folder is. Fields a format does not state are None."""

    path: Path  # the folder read (the drafter or checkpoint of a run folder resolved)
    format: str  # a detect_format name, or "other"
    format_summary: str
    architecture: str
    algorithm: str  # "dspark" | "dflash" | "eagle3" | "unknown"
    block_layout: str | None  # "anchor_first" | "anchor_plus_masks"
    gamma: int | None  # draft tokens per block
    block_size: int | None  # as stored in config.json
    target_layer_ids: list[int] | None
    layer_convention: str
    num_target_layers: int | None
    mask_token_id: int | None
    hidden_size: int | None
    vocab_size: int | None
    heads: list[str]
    draft_vocab_size: int | None
    params: ParamCounts
    dtypes: dict[str, int]  # stored dtype -> number of parameters in it
    shapes: dict[str, list[int]]  # tensor name (a leading "model." stripped) -> shape
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FolderFormat:
    """How a layout of `dspark.modeling.formats.detect_format` is described.

    `read(config, shapes)` returns the FolderDescription fields the format states
    (algorithm, block_layout, gamma, target_layer_ids, layer_convention, mask_token_id,
    num_target_layers, heads, draft_vocab_size).
    """

    summary: str
    read: Callable[[dict[str, Any], dict[str, list[int]]], dict[str, Any]]


def _archs(config: dict[str, Any]) -> list[str]:
    return [str(a) for a in config.get("architectures") or []]


def _heads(config: dict[str, Any], shapes: dict[str, list[int]]) -> list[str]:
    """The sequential and confidence heads, from the DeepSpec fields checked against the tensors."""
    heads = []
    rank = int(config.get("markov_rank") or 0)
    if rank > 0:
        kind = str(config.get("markov_head_type", "vanilla"))
        bias = " with joint_proj bias (DeepSpec)" if "markov_head.joint_proj.bias" in shapes else ""
        heads.append(f"sequential head: {kind}, Markov rank {rank}{bias}")
    conf = shapes.get("confidence_head.proj.weight")
    if conf is not None:
        with_markov = bool(config.get("confidence_head_with_markov")) and rank > 0
        source = f"[h_k; W1[x_(k-1)]] (H + r = {conf[-1]})" if with_markov else f"h_k (H = {conf[-1]})"
        heads.append(f"confidence head on {source}")
    return heads or ["none (parallel drafts only)"]


def _read_dspark_fields(config: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Ours and DeepSpec's: flat fields; DeepSpec writes both DSpark and DFlash as *DSparkModel."""
    variant = config.get("dspark_variant")
    if variant is None:
        dflash = any("DFlash" in a for a in _archs(config))
        has_head = int(config.get("markov_rank") or 0) > 0 or bool(config.get("enable_confidence_head"))
        variant = "dflash" if dflash or not has_head else "dspark"
    layout = config.get("block_layout", "anchor_first")
    block = config.get("block_size")
    return dict(  # our block_size is γ in both layouts
        algorithm=variant, block_layout=layout, gamma=None if block is None else int(block),
        target_layer_ids=config.get("target_layer_ids"), layer_convention=OUR_CONVENTION,
        mask_token_id=config.get("mask_token_id"), heads=_heads(config, shapes),
        num_target_layers=config.get("num_target_layers", config.get("target_num_hidden_layers")),
        draft_vocab_size=config.get("draft_vocab_size"),
    )


def _read_zlab(config: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """z-lab DFlash: block_size = γ + 1 (slot 0 is the anchor), ids and mask under dflash_config."""
    inner = config.get("dflash_config") or {}
    block = config.get("block_size")
    return dict(  # vLLM also takes the ids and the mask token at the top level
        algorithm="dflash", block_layout="anchor_plus_masks", gamma=None if block is None else int(block) - 1,
        target_layer_ids=inner.get("target_layer_ids", config.get("target_layer_ids")),
        layer_convention=OUR_CONVENTION + " (z-lab reads hidden_states[i+1] too)",
        mask_token_id=inner.get("mask_token_id", config.get("mask_token_id")),
        num_target_layers=config.get("num_target_layers"), heads=["none (parallel drafts only)"],
        draft_vocab_size=config.get("draft_vocab_size"),
    )


def _read_eagle3(config: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """EAGLE-3: an …Eagle3Model (output-of-layer `target_layer_ids`; dspark's also states γ as
    `block_size`) or the standard LlamaForCausalLMEagle3, whose top-level
    `eagle_aux_hidden_state_layer_ids` vLLM reads as input-of-layer (ours + 1) while
    `eagle_config`'s copy is output-of-layer (SGLang)."""
    eagle = config.get("eagle_config") or {}
    if "target_layer_ids" in config:
        ids, convention = config["target_layer_ids"], OUR_CONVENTION
    elif "eagle_aux_hidden_state_layer_ids" in eagle:
        ids, convention = eagle["eagle_aux_hidden_state_layer_ids"], OUR_CONVENTION + " (eagle_config)"
    else:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        convention = "input of decoder layer i (HF hidden_states[i]; vLLM's top-level EAGLE-3 field)"
    d2t = shapes.get("d2t")
    return dict(
        algorithm="eagle3", block_layout=None, gamma=config.get("block_size"), target_layer_ids=ids,
        layer_convention=convention, mask_token_id=None, num_target_layers=config.get("num_target_layers"),
        heads=[f"none (autoregressive draft steps; trained over ttt_length = {config.get('ttt_length', '?')})"],
        draft_vocab_size=config.get("draft_vocab_size", d2t[0] if d2t else None),
    )


FORMATS: dict[str, FolderFormat] = {
    "dspark": FolderFormat("written by dspark (DeepSpec's layout + dspark_variant, block_layout)", _read_dspark_fields),
    "deepspec": FolderFormat("DeepSpec DSpark/DFlash checkpoint (Qwen3DSparkModel / Gemma4DSparkModel)",
                             _read_dspark_fields),
    "zlab": FolderFormat("z-lab DFlash (DFlashDraftModel, fields under dflash_config)", _read_zlab),
    "dspark-eagle3": FolderFormat("EAGLE-3 written by dspark (…Eagle3Model + eagle3_preset)", _read_eagle3),
    "deepspec-eagle3": FolderFormat("DeepSpec EAGLE-3 (Qwen3Eagle3Model)", _read_eagle3),
    "eagle3": FolderFormat("standard EAGLE-3 (LlamaForCausalLMEagle3: midlayer.*, d2t)", _read_eagle3),
}


def read_tensor_header(folder: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(shape, dtype) of every stored tensor, from the safetensors headers only (no data read).
    A leading `model.` is stripped from names, as `dspark.modeling.checkpoint` does."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index with a weight_map ({err!r})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file (or model.safetensors.index.json) in {folder}")
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_slice(key)
                    short = key[len("model."):] if key.startswith("model.") else key
                    shapes[short] = list(tensor.get_shape())
                    dtypes[short] = SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())
        except Exception as err:  # safetensors raises its own SafetensorError for a bad header
            raise ValueError(f"{folder / name} is not a readable safetensors file ({err}); "
                             "the file is truncated or corrupted: copy or export it again") from None
    return shapes, dtypes


def _count(shapes: dict[str, list[int]], dtypes: dict[str, str]) -> tuple[ParamCounts, dict[str, int]]:
    trainable = frozen = 0
    per_dtype: dict[str, int] = {}
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= int(s)
        if name in FROZEN_TENSORS:
            frozen += n
        elif name not in ("d2t", "t2d"):
            trainable += n
        per_dtype[dtypes[name]] = per_dtype.get(dtypes[name], 0) + n
    present = [name for name in FROZEN_TENSORS if name in shapes]
    return ParamCounts(trainable, frozen, present), per_dtype


def describe_folder(path: str | os.PathLike) -> FolderDescription:
    """Read a drafter folder's config.json and safetensors headers (no model is built)."""
    folder, note = locate_drafter(path)
    notes = [note] if note else []
    config = read_json(folder / CONFIG_NAME)
    shapes, dtypes = read_tensor_header(folder)
    name = detect_format(config)
    fmt = FORMATS.get(name) if name else None
    if fmt is None:
        fields: dict[str, Any] = dict(
            algorithm="unknown", block_layout=None, gamma=None, target_layer_ids=config.get("target_layer_ids"),
            layer_convention="unknown", mask_token_id=config.get("mask_token_id"),
            num_target_layers=config.get("num_target_layers"), heads=[], draft_vocab_size=None)
        notes.append(f"architectures {_archs(config)} match no known drafter format ({', '.join(FORMATS)})")
    else:
        fields = fmt.read(config, shapes)
    params, per_dtype = _count(shapes, dtypes)
    ids = fields.pop("target_layer_ids")
    return FolderDescription(
        path=folder, format=name if fmt else "other", format_summary=fmt.summary if fmt else "unrecognised",
        architecture=", ".join(_archs(config)) or "(none)", block_size=config.get("block_size"),
        target_layer_ids=None if ids is None else [int(i) for i in ids],
        hidden_size=config.get("hidden_size"), vocab_size=config.get("vocab_size"),
        params=params, dtypes=per_dtype, shapes=shapes, notes=notes, **fields,
    )
