"""The drafter folder layouts dspark reads, and how each maps onto `DrafterConfig`.

- `locate_drafter` / `resolve_folder`: the drafter folder of a path (of a training run folder: its
  final drafter, else its latest checkpoint).
- `detect_format`: the layout of a config.json, read from `architectures`, never guessed (an
  unknown architecture is an error naming it).
- `parse_config`: a `DrafterConfig` from any layout it reads; `serving_eagle3_as_ours` and
  `serving_eagle3_weight_name` map the serving engines' EAGLE-3 folder onto ours.

The layouts (dspark, DeepSpec, z-lab DFlash, Eagle3, serving EAGLE-3, training run folders) and
the facts relied on, each checked against folders the other tools wrote: docs/interop.md, "What
each folder dspark reads holds".
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from dspark.modeling.config import DrafterConfig

CONFIG_NAME = "config.json"
# A training run folder: the drafter a run ends with, and its checkpoints (dspark.training.trainer).
FINAL_DRAFTER = "drafter"
CHECKPOINTS = "checkpoints"
LATEST_POINTER = "latest"  # checkpoints/latest holds the name of the newest checkpoint
log = logging.getLogger(__name__)

# architecture -> (layout family, block layout). dspark's own names cover Llama and the DFlash variant.
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")
OWN_ARCHITECTURES = ("LlamaDSparkModel", "Qwen3DFlashModel", "Gemma4DFlashModel", "LlamaDFlashModel")
EAGLE3_ARCHITECTURES = ("Qwen3Eagle3Model", "LlamaEagle3Model", "Gemma4Eagle3Model")  # the first is DeepSpec's
SERVING_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
ZLAB_ARCHITECTURE = "DFlashDraftModel"
ZLAB_DFLASH_CONFIG_FIELDS = ("mask_token_id", "target_layer_ids")
# Fields that only the serving EAGLE-3 layout has: refused by name in any other layout.
REFUSED_FIELDS = {
    "eagle_config": f"a serving engine's EAGLE-3 drafter, whose architecture is {SERVING_EAGLE3_ARCHITECTURE}",
    "eagle_aux_hidden_state_layer_ids": f"a serving engine's EAGLE-3 drafter, whose architecture is {SERVING_EAGLE3_ARCHITECTURE}",
}


def locate_drafter(path: str | os.PathLike) -> tuple[Path, str]:
    """The folder holding a drafter's config.json, and a sentence naming which one was read when
    `path` is a training run folder ("" when `path` is itself a drafter folder).

    The rule for a run folder: the final drafter when training finished, else the latest checkpoint.
    dspark's trainer writes `drafter/` when a run ends and `checkpoints/<name>/drafter/` along the
    way, `checkpoints/latest` naming the newest; DeepSpec writes `step_<N>/` and a `step_latest`
    link (read, else the highest N). When none is there, `path` itself is returned: reading its
    config.json then says what is missing."""
    folder = Path(path)
    if (folder / CONFIG_NAME).is_file() or not folder.is_dir():
        return folder, ""
    if (folder / FINAL_DRAFTER / CONFIG_NAME).is_file():
        return folder / FINAL_DRAFTER, f"read the final drafter of the training run {folder}"
    pointer = folder / CHECKPOINTS / LATEST_POINTER
    if pointer.is_file():
        latest = folder / CHECKPOINTS / pointer.read_text().strip()
        if (latest / FINAL_DRAFTER / CONFIG_NAME).is_file():
            return latest / FINAL_DRAFTER, (f"read the latest checkpoint {latest.name} of the training run {folder} "
                                            f"(no final {FINAL_DRAFTER}/: training has not finished)")
    if (folder / "step_latest" / CONFIG_NAME).is_file():
        real = (folder / "step_latest").resolve()
        return real, f"read {real.name} (step_latest) inside {folder}"
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))]
    steps = sorted((n, p) for n, p in steps if (p / CONFIG_NAME).is_file())
    if steps:
        return steps[-1][1], f"read the last checkpoint {steps[-1][1].name} of {len(steps)} inside {folder}"
    return folder, ""


def resolve_folder(path: str | os.PathLike) -> Path:
    """`locate_drafter`'s folder; which checkpoint of a run folder was read is logged as a warning,
    so that the command line shows it."""
    folder, note = locate_drafter(path)
    if note:
        log.warning("%s", note)
    return folder


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path` (a config.json, a safetensors index), with errors naming the file
    and what is wrong with it."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a drafter folder holds config.json and model.safetensors (a training run "
            f"folder: {FINAL_DRAFTER}/, {CHECKPOINTS}/, step_latest/ or step_<N>/)"
        )
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not text (corrupted?): {e}") from None
    if not text.strip():
        raise ValueError(f"{path} is empty (truncated?): rewrite it from the drafter's checkpoint")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupted?): {e}; re-export the drafter "
                         "or repair the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields")
    return data


def detect_format(d: dict[str, Any]) -> str | None:
    """The layout of a config.json, read from its `architectures` (never guessed from other fields):
    "dspark" (ours, DSpark/DFlash), "deepspec" (DeepSpec's DSpark/DFlash), "zlab" (z-lab DFlash),
    "dspark-eagle3" and "deepspec-eagle3" (an `…Eagle3Model` with or without `eagle3_preset`),
    "eagle3" (the serving engines' LlamaForCausalLMEagle3); None for any other."""
    archs = d.get("architectures") or []
    if archs == [SERVING_EAGLE3_ARCHITECTURE]:
        return "eagle3"
    if len(archs) != 1:
        return None
    arch = archs[0]
    if arch in EAGLE3_ARCHITECTURES:
        return "dspark-eagle3" if "eagle3_preset" in d else "deepspec-eagle3"
    if arch == ZLAB_ARCHITECTURE:
        return "zlab"
    if arch in OWN_ARCHITECTURES or (arch in DEEPSPEC_ARCHITECTURES and ("dspark_variant" in d or "block_layout" in d)):
        return "dspark"
    if arch in DEEPSPEC_ARCHITECTURES:
        return "deepspec"
    return None


def parse_config(d: dict[str, Any], where: str = CONFIG_NAME) -> DrafterConfig:
    """A `DrafterConfig` from any accepted config.json (`detect_format`); errors name the file and the field."""
    archs = d.get("architectures") or []
    fmt = detect_format(d)
    if fmt == "eagle3":
        return _parse_eagle3(serving_eagle3_as_ours(d, where), where)
    for field, what in REFUSED_FIELDS.items():
        if field in d:
            raise ValueError(f"{where}: field {field!r} describes {what}, not {archs!r}; it cannot be loaded")
    if fmt in ("dspark-eagle3", "deepspec-eagle3"):
        return _parse_eagle3(d, where)
    if "ttt_length" in d:
        raise ValueError(f"{where}: field 'ttt_length' describes an Eagle3 drafter, but architectures={archs!r} is not "
                         f"one of {list(EAGLE3_ARCHITECTURES)}")
    if len(archs) != 1:
        raise ValueError(
            f"{where}: architectures={archs!r}; expected one of {[*DEEPSPEC_ARCHITECTURES, *OWN_ARCHITECTURES, ZLAB_ARCHITECTURE]} "
            "(the block layout is read from it, never guessed)"
        )
    # dspark and DeepSpec-named folders carry a draft vocabulary as `draft_vocab_size` + `d2t`
    # (dspark.modeling.vocab); the z-lab layout has no LM head of its own, so none there.
    if fmt == "zlab" and d.get("draft_vocab_size") not in (None, d.get("vocab_size")):
        raise ValueError(
            f"{where}: draft_vocab_size={d['draft_vocab_size']} differs from vocab_size={d.get('vocab_size')}: "
            "a reduced draft vocabulary is not supported in the z-lab DFlash layout"
        )
    try:
        if fmt == "zlab":
            return _parse_zlab(d)
        if fmt in ("dspark", "deepspec"):
            # DeepSpec never writes block_layout (anchor-first); dspark writes it always.
            return DrafterConfig.from_hf_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: malformed field {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    raise ValueError(
        f"{where}: unknown drafter architecture {archs[0]!r}; dspark reads {list(DEEPSPEC_ARCHITECTURES)} (DeepSpec), "
        f"{ZLAB_ARCHITECTURE!r} (z-lab DFlash) and its own {list(OWN_ARCHITECTURES)}"
    )


def _parse_eagle3(d: dict[str, Any], where: str) -> DrafterConfig:
    """DeepSpec's Qwen3Eagle3Model or dspark's own Eagle3 folder (`DrafterConfig.from_eagle3_hf_dict`)."""
    try:
        return DrafterConfig.from_eagle3_hf_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: malformed field {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def serving_eagle3_as_ours(d: dict[str, Any], where: str = CONFIG_NAME) -> dict[str, Any]:
    """A LlamaForCausalLMEagle3 config.json rewritten as our Eagle3 fields (preset "eagle3")."""
    eagle = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) for i in eagle["eagle_aux_hidden_state_layer_ids"]]  # output-of-layer (SGLang's)
    elif d.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) - 1 for i in d["eagle_aux_hidden_state_layer_ids"]]  # input-of-layer (vLLM's)
    elif "num_target_layers" in d:
        n = int(d["num_target_layers"])
        ids = [1, n // 2 - 1, n - 4]  # EAGLE-3's default choice
    else:
        raise ValueError(f"{where}: a {SERVING_EAGLE3_ARCHITECTURE} config without eagle_config."
                         "eagle_aux_hidden_state_layer_ids or num_target_layers: which target layers it fuses is unknown")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{where}: num_hidden_layers={d['num_hidden_layers']}: dspark's Eagle3 drafter has exactly one layer")
    dropped = ("architectures", "eagle_config", "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "num_hidden_layers")
    out = {k: v for k, v in d.items() if k not in dropped}
    out.update(architectures=["LlamaEagle3Model"], target_layer_ids=ids, eagle3_preset="eagle3",
               num_target_layers=int(d.get("num_target_layers", max(ids) + 4)), draft_num_hidden_layers=1)
    return out


def serving_eagle3_weight_name(name: str) -> str:
    """`midlayer.X` (the serving layout's one layer) -> our `layers.0.X`; other names are ours."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _parse_zlab(d: dict[str, Any]) -> DrafterConfig:
    """z-lab DFlash: anchor + γ masks, `block_size` = γ + 1, ids and mask token under `dflash_config`."""
    dflash = d.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError("a DFlashDraftModel config needs a dflash_config object {target_layer_ids, mask_token_id}")
    unknown = sorted(set(dflash) - set(ZLAB_DFLASH_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"dflash_config has fields dspark does not map: {unknown} (known: {list(ZLAB_DFLASH_CONFIG_FIELDS)})")
    missing = [k for k in ("block_size", "num_target_layers", "num_hidden_layers", "model_type") if k not in d]
    missing += [f"dflash_config.{k}" for k in ZLAB_DFLASH_CONFIG_FIELDS if k not in dflash]
    if missing:
        raise ValueError(f"a DFlashDraftModel config lacks the fields {missing}")
    if int(d["block_size"]) < 2:
        raise ValueError(f"block_size={d['block_size']}: z-lab's block is the anchor + γ ≥ 1 masks, so it must be ≥ 2")
    dropped = ("architectures", "auto_map", "dflash_config", "block_size", "num_target_layers", "transformers_version")
    base = {k: v for k, v in d.items() if k not in dropped}
    return DrafterConfig(
        base_config=base,
        target_layer_ids=list(dflash["target_layer_ids"]),
        num_target_layers=int(d["num_target_layers"]),
        mask_token_id=int(dflash["mask_token_id"]),
        num_draft_layers=int(d["num_hidden_layers"]),
        block_size=int(d["block_size"]) - 1,
        variant="dflash",
        block_layout="anchor_plus_masks",
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    )
