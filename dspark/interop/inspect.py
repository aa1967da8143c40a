"""`dspark inspect`: whether a drafter folder fits a target, and the likely cause of a low acceptance.

``check_target(...)``: the folder (``dspark.interop.describe.describe_folder``) against a target:
layer ids exist, hidden and vocabulary sizes match, the mask token is inside the vocabulary; then a
short greedy speculative decode (``dspark.decoding.loop.speculative_generate`` at T = 0) on a few
prompts. When the acceptance is low, the decode is re-run with the layer ids shifted by ±1, the
block layout switched and other mask tokens, and the variant that recovers the acceptance names
the likely cause. The two conventions that fail silently: layer ids (ours: id i = output of
decoder layer i = HF hidden_states[i+1]; vLLM's EAGLE-3 field is input-of-layer, i.e. ours + 1)
and the block layout (anchor-first vs anchor + γ masks; renaming across them gives τ ≈ 1).
``inspect_drafter`` describes a folder and checks it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.interop.describe import FROZEN_TENSORS, OUR_CONVENTION, FolderDescription, describe_folder


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

    target = target.with_layers(overrides.get("target_layer_ids") or read_config(folder).target_layer_ids)
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
