"""`dspark inspect`: what a drafter folder is, and whether it fits a target.

Two steps, each returning data (the CLI prints it):

- ``describe_folder(path)``: the folder's format, algorithm, block layout, γ,
  layer ids and their convention, mask token, heads, draft vocabulary,
  parameter counts and stored dtypes, read from ``config.json`` and the
  safetensors headers only (no model is built). The folder and its layout are
  those ``load_drafter`` reads (``dspark.modeling.formats``: ``locate_drafter``,
  ``detect_format``); ``FORMATS`` says how each layout is described.
- ``check_target(...)``: the folder against a target: layer ids exist, hidden
  and vocabulary sizes match, the mask token is inside the vocabulary; then a
  short greedy speculative decode (``dspark.decoding.loop.speculative_generate`` at
  T = 0) on a few prompts. When the acceptance is low, the decode is re-run
  with the layer ids shifted by ±1, the block layout switched and other mask
  tokens, and the variant that recovers the acceptance names the likely cause.
  The two conventions that fail silently: layer ids (ours: id i = output of
  decoder layer i = HF hidden_states[i+1]; vLLM's EAGLE-3 field is
  input-of-layer, i.e. ours + 1) and the block layout (anchor-first vs
  anchor + γ masks; renaming across them gives τ ≈ 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


# ----------------------------------------------------------------------------- target check
@dataclass(frozen=True)
class TargetFacts:
    """The sizes of a target that a drafter must fit."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the LM head


@dataclass
class Finding:
    """One result of a check. level: "ok" | "warning" | "error" (an error stops the decode check);
    code names the check (layer_ids, hidden_size, vocab_size, mask_token, acceptance, ...)."""

    level: str
    code: str
    message: str


@dataclass
class AcceptanceRun:
    """A short greedy decode with the folder read as stated (label "as stored") or as a variant."""

    label: str
    overrides: dict[str, Any]
    rounds: int
    accepted: int

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per round; τ = this + 1 (the bonus token counts)."""
        return self.accepted / max(1, self.rounds)

    @property
    def tau(self) -> float:
        return self.mean_accepted + 1.0


@dataclass
class TargetCheck:
    facts: TargetFacts
    findings: list[Finding]
    runs: list[AcceptanceRun]  # the folder as stored first, then the diagnosis variants tried
    prompts: str  # where the decode prompts came from


@dataclass
class Inspection:
    description: FolderDescription
    check: TargetCheck | None = None


def check_structure(desc: FolderDescription, facts: TargetFacts) -> list[Finding]:
    """Layer ids exist in the target, hidden sizes (fc input = m·d) and vocabularies match, the
    mask token is a vocabulary row. Pure: the description's numbers against the target's."""
    out: list[Finding] = []
    ids, L, d, V = desc.target_layer_ids, facts.num_layers, facts.hidden_size, facts.vocab_size
    if not ids:
        out.append(Finding("error", "layer_ids", "the folder states no target layer ids"))
    else:
        bad = [i for i in ids if not -1 <= i <= L - 1]
        level, verb = ("error", f"{bad} do not exist") if bad else ("ok", "all exist")
        out.append(Finding(level, "layer_ids", f"layer ids {ids}: {verb} in a {L}-layer target "
                                               f"(valid: -1 .. {L - 1}, {OUR_CONVENTION})"))
    if desc.num_target_layers not in (None, L):
        out.append(Finding("warning", "num_target_layers", f"the drafter was built for a {desc.num_target_layers}-"
                                                         f"layer target (num_target_layers), this one has {L}"))
    fc = desc.shapes.get("fc.weight")
    if desc.hidden_size is not None and int(desc.hidden_size) != d:
        out.append(Finding("error", "hidden_size", f"hidden size mismatch: the drafter's hidden_size is "
                                                  f"{desc.hidden_size}, the target's is {d}"))
    elif fc is not None and ids and fc[-1] != len(ids) * d:
        out.append(Finding("error", "hidden_size", f"hidden size mismatch: fc.weight reads {fc[-1]} features, "
                                                  f"the target gives {len(ids)} layers x {d} = {len(ids) * d}"))
    else:
        out.append(Finding("ok", "hidden_size", f"hidden size {d} matches (fc input {len(ids or [])} x {d})"))
    out.append(_check_vocab(desc, V))
    mask = desc.mask_token_id
    if mask is not None and not 0 <= int(mask) < V:
        out.append(Finding("error", "mask_token", f"mask token {mask} is outside the target's vocabulary [0, {V})"))
    elif mask is not None:
        out.append(Finding("ok", "mask_token", f"mask token {mask} is inside the vocabulary [0, {V})"))
    return out


def _check_vocab(desc: FolderDescription, V: int) -> Finding:
    rows = {name: desc.shapes[name][0] for name in (*FROZEN_TENSORS, "markov_head.markov_w1.weight",
                                                     "markov_head.markov_w2.weight") if name in desc.shapes}
    if desc.vocab_size is not None:
        rows = {"vocab_size (config.json)": int(desc.vocab_size), **rows}
    if desc.draft_vocab_size is not None:
        rows.pop("lm_head.weight", None)  # a reduced-vocabulary LM head has draft_vocab_size rows
    wrong = {name: n for name, n in rows.items() if n != V}
    if wrong:
        return Finding("error", "vocab_size", f"vocabulary size mismatch: the target has {V} tokens, the drafter "
                                              f"has {', '.join(f'{k} = {n}' for k, n in wrong.items())}")
    return Finding("ok", "vocab_size", f"vocabulary size {V} matches")


def default_prompts(tokenizer: Any, num_prompts: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """The decode prompts: the built-in evaluation prompts (math, code, chat in turn) rendered with
    the target's chat template, or seeded random tokens in [0, V-1) for a target without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab_size - 1, (12,), generator=g).tolist() for _ in range(num_prompts)]
        return prompts, f"{num_prompts} seeded random-token prompts (the target has no tokenizer)"
    from dspark.data.prompts import builtin_eval_sets
    from dspark.data.render import render_prompt

    sets = list(builtin_eval_sets().values())
    order = [s[i] for i in range(max(map(len, sets))) for s in sets if i < len(s)]  # math, code, chat in turn
    if num_prompts > len(order):
        raise ValueError(f"num_prompts={num_prompts}: there are {len(order)} built-in evaluation prompts")
    chosen = [render_prompt(tokenizer, conv) for conv in order[:num_prompts]]
    return chosen, f"{num_prompts} built-in evaluation prompt{'s' if num_prompts > 1 else ''}"


def run_acceptance(folder: Path, target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   label: str = "as stored", **overrides: Any) -> AcceptanceRun:
    """Greedy speculative decoding of `prompts` with the drafter of `folder` (its config fields
    replaced by `overrides`; `target_layer_ids` also changes what the target captures)."""
    from dspark.decoding.loop import speculative_generate
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config
    from dspark.target import TargetModel

    ids = overrides.get("target_layer_ids") or read_config(folder).target_layer_ids
    if tuple(ids) != tuple(target.target_layer_ids):
        target = TargetModel(target.model, ids, tokenizer=target.tokenizer)
    drafter = load_drafter(folder, target, dtype=target.dtype, device=target.device, **overrides).eval()
    eos = getattr(target.tokenizer, "eos_token_id", None) if target.tokenizer is not None else None
    rounds = accepted = 0
    for prompt in prompts:
        result = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                      eos_token_ids=() if eos is None else (eos,))
        rounds += len(result.rounds)
        accepted += sum(r.accepted for r in result.rounds)
    return AcceptanceRun(label, dict(overrides), rounds, accepted)


# ----------------------------------------------------------------------------- diagnosis
@dataclass(frozen=True)
class Variant:
    """Another reading of the folder, and the cause it names when it recovers the acceptance."""

    code: str
    label: str
    overrides: dict[str, Any]
    cause: str


def mask_candidates(tokenizer: Any, vocab_size: int, current: int | None, limit: int = 3) -> list[tuple[int, str]]:
    """Mask tokens more likely than `current`: the tokenizer's mask / pad / unk tokens, the first
    embedding row past the tokenizer (where z-lab adds its mask token) and the last row V-1."""
    named = []
    if tokenizer is not None:
        for attr in ("mask_token_id", "pad_token_id", "unk_token_id"):
            named.append((getattr(tokenizer, attr, None), f"the tokenizer's {attr[:-9]} token"))
        named.append((len(tokenizer), "the first embedding row past the tokenizer's vocabulary"))
    named.append((vocab_size - 1, "the last vocabulary row (V - 1)"))
    out: list[tuple[int, str]] = []
    for token, why in named:
        if isinstance(token, int) and 0 <= token < vocab_size and token != current and token not in dict(out):
            out.append((token, why))
    return out[:limit]


def diagnosis_variants(desc: FolderDescription, facts: TargetFacts, tokenizer: Any) -> list[Variant]:
    """The readings tried when the acceptance is low: ids ∓ 1, the other layout, other mask tokens."""
    out: list[Variant] = []
    ids = desc.target_layer_ids or []
    for step in (-1, 1):
        shifted = [i + step for i in ids]
        if ids and shifted[0] >= -1 and shifted[-1] <= facts.num_layers - 1:
            why = ("this folder's ids are probably input-of-layer ids (vLLM EAGLE-3 convention, id i = "
                   "hidden_states[i]); dspark reads output-of-layer ids (hidden_states[i+1])") if step < 0 else (
                  "this folder's ids are one lower than the layers the drafter was trained on "
                  "(an input-of-layer to output-of-layer conversion applied twice)")
            out.append(Variant("layer_ids", f"layer ids {shifted}", {"target_layer_ids": shifted},
                               f"layer ids look shifted by one: {why}; set target_layer_ids to {shifted}"))
    if desc.block_layout in ("anchor_first", "anchor_plus_masks") and desc.algorithm in ("dspark", "dflash"):
        other = "anchor_plus_masks" if desc.block_layout == "anchor_first" else "anchor_first"
        out.append(Variant("block_layout", f"block layout {other}", {"block_layout": other},
                           f"wrong block layout: the folder says {desc.block_layout}, the drafter was trained "
                           f"{other} (DeepSpec: anchor_first; z-lab DFlash: anchor_plus_masks, block_size = "
                           f"γ + 1); set block_layout to {other}"))
    for token, why in mask_candidates(tokenizer, facts.vocab_size, desc.mask_token_id):
        out.append(Variant("mask_token", f"mask token {token}", {"mask_token_id": token},
                           f"wrong mask token: the folder says {desc.mask_token_id}, the drafter accepts with "
                           f"{token} ({why}); set mask_token_id to {token}"))
    return out


def recovers(variant: AcceptanceRun, stored: AcceptanceRun) -> bool:
    """A variant recovers the acceptance when it accepts at least half a draft more per round and
    at least 1.5 times as many as the folder as stored (both greedy, same prompts)."""
    gain = variant.mean_accepted - stored.mean_accepted
    return gain >= 0.5 and variant.mean_accepted >= 1.5 * stored.mean_accepted


def diagnose_acceptance(folder: Path, desc: FolderDescription, target: Any, facts: TargetFacts,
                        prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        stored: AcceptanceRun) -> tuple[list[AcceptanceRun], list[Finding]]:
    """Re-run the decode with each variant; the best one that recovers names the cause."""
    runs: list[tuple[Variant, AcceptanceRun]] = []
    for variant in diagnosis_variants(desc, facts, target.tokenizer):
        try:
            run = run_acceptance(folder, target, prompts, max_new_tokens, variant.label, **variant.overrides)
        except ValueError:  # e.g. a layer id the folder's own config forbids: not a candidate
            continue
        runs.append((variant, run))
    good = [(v, r) for v, r in runs if recovers(r, stored)]
    tried = ", ".join(v.label for v, _ in runs) or "none applicable"
    if good:
        variant, run = max(good, key=lambda vr: vr[1].mean_accepted)
        message = (f"{variant.cause} (greedy acceptance {stored.mean_accepted:.2f} -> {run.mean_accepted:.2f} "
                   f"accepted per round, τ {stored.tau:.2f} -> {run.tau:.2f})")
        return [r for _, r in runs], [Finding("warning", variant.code, message)]
    if stored.mean_accepted < TRIVIAL_ACCEPTANCE:
        message = (f"acceptance is trivially low (τ = {stored.tau:.2f}) and no variant recovers it (tried: {tried}): "
                   "the drafter is probably untrained, or trained for another target")
        return [r for _, r in runs], [Finding("warning", "acceptance", message)]
    return [r for _, r in runs], [Finding("ok", "diagnosis", f"no variant does better (tried: {tried})")]


# Below this many accepted drafts per round (τ < 1.5) the acceptance is "trivially low".
TRIVIAL_ACCEPTANCE = 0.5


def diagnosis_threshold(gamma: int) -> float:
    """Mean accepted per round below which `diagnose="auto"` tries the variants: half of γ, at
    least 1. A wrong mask token or layout in an anchor-first drafter often still accepts about
    one draft (slot 0 sees the anchor), so 'trivially zero' alone would miss them."""
    return max(1.0, gamma / 2)


# ----------------------------------------------------------------------------- entry points
def target_facts(target: Any, name: str = "") -> TargetFacts:
    """The sizes of a `dspark.target.TargetModel`."""
    return TargetFacts(name or type(target.model).__name__, target.num_layers, target.hidden_size, target.vocab_size)


def load_target_for(name_or_path: str, dtype: str = "auto", device: str = "auto") -> Any:
    """A TargetModel capturing only the embeddings (id -1): each decode check wraps its model
    again with the ids it needs, so an out-of-range id in a folder cannot stop the loading."""
    from dspark.build import resolve_device, resolve_dtype
    from dspark.target import TargetModel

    dev = resolve_device(device)
    return TargetModel.from_pretrained(name_or_path, [-1], dtype=resolve_dtype(dtype, dev), device=dev)


def check_target(desc: FolderDescription, target: Any, *, name: str = "", num_prompts: int = 3,
                 max_new_tokens: int = 32, diagnose: str = "auto",
                 prompts: Sequence[Sequence[int]] | None = None) -> TargetCheck:
    """Check a described folder against a loaded TargetModel: structure, then a greedy decode.

    diagnose: "auto" tries the variants when the drafter accepts fewer than
    `diagnosis_threshold(γ)` drafts per round, "always" / "never" as named.
    prompts: token ids to decode from (default: `default_prompts`).
    """
    if diagnose not in ("auto", "always", "never"):
        raise ValueError(f"diagnose={diagnose!r}; use 'auto', 'always' or 'never'")
    if num_prompts < 1 or max_new_tokens < 1:
        raise ValueError(f"num_prompts={num_prompts} and max_new_tokens={max_new_tokens} must both be >= 1")
    facts = target_facts(target, name)
    findings = check_structure(desc, facts)
    if any(f.level == "error" for f in findings):
        return TargetCheck(facts, findings, [], "no decode: fix the errors above first")
    source = f"{len(prompts)} given prompts" if prompts is not None else ""
    if prompts is None:
        prompts, source = default_prompts(target.tokenizer, num_prompts, facts.vocab_size)
    try:
        stored = run_acceptance(desc.path, target, prompts, max_new_tokens)
    except (ValueError, FileNotFoundError) as err:
        findings.append(Finding("error", "load", f"no decode check: dspark.modeling.load_drafter cannot read "
                                                 f"this {desc.format} folder: {err}"))
        return TargetCheck(facts, findings, [], "no decode")
    runs = [stored]
    verdict = f"greedy acceptance {stored.mean_accepted:.2f} accepted per round (τ = {stored.tau:.2f}, {stored.rounds} rounds)"
    low = stored.mean_accepted < diagnosis_threshold(desc.gamma or 1)
    trivial = stored.mean_accepted < TRIVIAL_ACCEPTANCE
    if low and not trivial:
        verdict += f"; low for γ = {desc.gamma} (below {diagnosis_threshold(desc.gamma or 1):.1f})"
    findings.append(Finding("warning" if trivial else "ok", "acceptance", verdict))
    if diagnose == "always" or (diagnose == "auto" and low):
        variant_runs, diagnosis = diagnose_acceptance(desc.path, desc, target, facts, prompts, max_new_tokens, stored)
        runs += variant_runs
        findings += diagnosis
    return TargetCheck(facts, findings, runs, f"{source}, {max_new_tokens} new tokens each, greedy")


def inspect_drafter(path: str | os.PathLike, target: Any = None, *, dtype: str = "auto", device: str = "auto",
                    **check_options: Any) -> Inspection:
    """Describe a drafter folder and, given a target (a name, a folder or a TargetModel), check it.
    `check_options` go to `check_target` (num_prompts, max_new_tokens, diagnose, prompts)."""
    desc = describe_folder(path)
    if target is None:
        return Inspection(desc)
    name = target if isinstance(target, (str, os.PathLike)) else ""
    model = load_target_for(str(target), dtype, device) if name else target
    return Inspection(desc, check_target(desc, model, name=str(name), **check_options))


def problems(inspection: Inspection) -> list[Finding]:
    """The warnings and errors of the check (empty without a target or when all is well)."""
    return [] if inspection.check is None else [f for f in inspection.check.findings if f.level != "ok"]
