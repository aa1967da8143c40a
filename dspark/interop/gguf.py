"""Write a drafter as a GGUF file that llama.cpp loads as a speculative-decoding draft model.

`export_gguf(drafter, path, target=...)` writes the file llama.cpp's own converter
(`convert_hf_to_gguf.py <vllm folder> --target-model-dir <target>`) writes for the same drafter:
the same architecture, metadata keys (names, values, value types), tensor names, shapes, dtypes and
data. It needs only the `gguf` package; the target's tokenizer and config come from its HF folder.
DSpark and DFlash are architecture `dflash`, EAGLE-3 is `eagle3` (:func:`spec_type`: the
`--spec-type` that serves each); :func:`tokenizer_fields` carries the target's tokenizer. What
llama.cpp cannot run is refused (GGUFRefused, a ValueError naming the field and the fix).

docs/interop.md ("The GGUF file") lists the keys, tensors, dtypes, tokenizer fields and refusals,
and the llama.cpp code they follow (`src/models/dflash.cpp`, `src/models/eagle3.cpp`,
`common/speculative.cpp`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.interop.layouts import (
    ExportRefused,
    check_eagle3_servable,
    deepspec_config,
    drafter_tensors,
    eagle3_serving_config,
    eagle3_serving_tensors,
    with_draft_head,
    zlab_config,
    zlab_tensors,
)
from dspark.io.atomic import temp_name

OUTTYPES = ("f16", "bf16", "f32")
DEFAULT_OUTTYPE = "f16"
DFLASH_ARCH = "dflash"
EAGLE3_ARCH = "eagle3"
# llama.cpp's file-type codes (general.file_type): all F32, mostly F16, mostly BF16.
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32}
QUANTIZATION_VERSION = 2
# Pre-tokenizer names llama.cpp knows, for tokenizers recognised here by their tokenizer.json
# pre_tokenizer section and the target's model_type. Others: pass tokenizer_pre explicitly.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
KNOWN_PRE_TOKENIZERS: list[tuple[str, dict, int, str]] = [
    # (target model_type, pre_tokenizer section, vocabulary size, llama.cpp name)
    ("llama", _BYTE_LEVEL, 49152, "smollm"),  # SmolLM / SmolLM2
]
# gguf.SpecialVocab's token types -> gguf.Keys.Tokenizer attribute names where they differ.
_ID_KEYS = {"unk": "UNK_ID", "pad": "PAD_ID", "sep": "SEP_ID"}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "hidden_norm.weight": "attn_norm_2.weight",  # Eagle3's midlayer norm of the fused features
}
_DFLASH_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
_EAGLE3_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


class GGUFRefused(ExportRefused):
    """llama.cpp cannot run this drafter; the message names the field and the fix (an ExportRefused)."""


def _refuse(reason: str) -> None:
    raise GGUFRefused(f"cannot export to llama.cpp: {reason}")


# ------------------------------------------------------------------ target
def _target_folder(target: Any) -> Path:
    """The target's HF folder: a path, a name dspark resolves (the default SmolLM2), or a
    TargetModel whose model was loaded from a folder."""
    from dspark.hub import resolve_target_path

    if target is None:
        _refuse("the draft GGUF carries the target's tokenizer: give the target (a HF folder or 'smollm2-135m')")
    if not isinstance(target, (str, os.PathLike)):
        path = getattr(getattr(getattr(target, "model", target), "config", None), "_name_or_path", "")
        if not path:
            _refuse("the target object has no folder to read its tokenizer from: give the target as a HF folder")
        target = path
    folder = Path(resolve_target_path(str(target)))
    if not (folder / "config.json").is_file():
        _refuse(f"target {target!r} is not a local HF folder with config.json (download it first)")
    return folder


def _target_config(folder: Path) -> dict[str, Any]:
    cfg = json.loads((folder / "config.json").read_text())
    return {**cfg, **cfg.get("text_config", {})}


# ------------------------------------------------------------------ tokenizer
def _pre_tokenizer_name(folder: Path, model_type: str, vocab_size: int) -> str | None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text()).get("pre_tokenizer")
    for mt, section, size, name in KNOWN_PRE_TOKENIZERS:
        if mt == model_type and pre == section and size == vocab_size:
            return name
    return None


def tokenizer_fields(folder: Path, vocab_size: int, *, model_type: str, tokenizer_pre: str | None = None,
                     llama_rules: bool | None = None) -> list:
    """The target's tokenizer as (key, value, kind) triples, kind in {"str", "u32", "bool",
    "str_array", "i32_array"}: a byte-level BPE tokenizer read with transformers, V = vocab_size
    entries (docs/interop.md, "The GGUF file"). `llama_rules` (default: a Llama/Mistral target): the two
    tokenizer settings llama.cpp's Llama converter adds (`add_space_prefix` from
    tokenizer_config.json's add_prefix_space; no BOS for a 49152-token vocabulary); an EAGLE-3
    draft always gets them, its converter being the Llama one."""
    import gguf
    from transformers import AutoTokenizer

    tok_json = folder / "tokenizer.json"
    model = json.loads(tok_json.read_text()).get("model", {}).get("type") if tok_json.is_file() else None
    if model != "BPE" or (folder / "tokenizer.model").is_file():
        _refuse(f"the target's tokenizer in {folder} is not a byte-level BPE tokenizer.json (it is {model!r}); "
                "only those are written here")
    pre = tokenizer_pre or _pre_tokenizer_name(folder, model_type, vocab_size)
    if pre is None:
        _refuse(f"the target's pre-tokenizer ({tok_json}) is not one this exporter recognises; give llama.cpp's "
                "name for it (tokenizer_pre=..., --tokenizer-pre, e.g. 'qwen2', 'llama-bpe'; it is "
                "tokenizer.ggml.pre in a GGUF of the target)")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        _refuse(f"the target's tokenizer has ids up to {max(vocab.values())}, beyond vocab_size {vocab_size}")
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        token = by_id[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp expects added tokens in their normalised form
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            types.append(TOKEN_CONTROL if decoder[i].special else TOKEN_USER_DEFINED)
        else:
            types.append(TOKEN_NORMAL)
        tokens.append(token)
    out: list = [("tokenizer.ggml.model", "gpt2", "str"), ("tokenizer.ggml.pre", pre, "str"),
                 ("tokenizer.ggml.tokens", tokens, "str_array"), ("tokenizer.ggml.token_type", types, "i32_array")]
    special = gguf.SpecialVocab(folder, load_merges=True)
    if special.merges:
        out.append(("tokenizer.ggml.merges", list(special.merges), "str_array"))
    for typ, tid in special.special_token_ids.items():
        key = getattr(gguf.Keys.Tokenizer, _ID_KEYS.get(typ, f"{typ.upper()}_ID"), None)
        if key is None:
            _refuse(f"the target's special token type {typ!r} has no GGUF key")
        out.append((key, int(tid), "u32"))
    adds = dict(special.add_special_token)
    if llama_rules is None:
        llama_rules = model_type in ("llama", "mistral")
    if llama_rules:
        cfg_path = folder / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        if tcfg.get("add_prefix_space") is not None:
            out.append(("tokenizer.ggml.add_space_prefix", bool(tcfg["add_prefix_space"]), "bool"))
        if vocab_size == 49152:  # SmolLM / Granite vocabulary: no BOS added (llama.cpp's converter rule)
            adds["bos"] = False
    for typ, value in adds.items():
        out.append((f"tokenizer.ggml.add_{typ}_token", bool(value), "bool"))
    if special.chat_template is not None:
        if not isinstance(special.chat_template, str):
            _refuse("the target has several named chat templates; only a single template is written here")
        out.append(("tokenizer.chat_template", special.chat_template, "str"))
    return out


# ------------------------------------------------------------------ checks
def _check_feature_layers(ids: list[int], num_target_layers: int) -> None:
    if num_target_layers - 1 in ids:
        _refuse(f"target_layer_ids {ids} include {num_target_layers - 1}, the target's last layer: llama.cpp "
                "captures the input of target layer id+1 and the target has no layer "
                f"{num_target_layers} (train with target_layer_ids below {num_target_layers - 1})")


def _check_base(base: dict[str, Any], what: str) -> None:
    act = base.get("hidden_activation") or base.get("hidden_act") or "silu"
    if act != "silu":
        _refuse(f"{what}: hidden_act={act!r}; llama.cpp's draft layers use SiLU here")
    for key in ("attention_bias", "mlp_bias"):
        if base.get(key):
            _refuse(f"{what}: {key}=True; llama.cpp's draft layers have no biases")
    rope = base.get("rope_scaling") or base.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        _refuse(f"{what}: rope_scaling type {rope_type!r}; only unscaled RoPE is written here")
    if base.get("use_sliding_window"):
        _refuse(f"{what}: use_sliding_window=True; train full-attention draft layers")


def check_dflash(config) -> None:
    """Refuse what llama.cpp's `dflash` architecture cannot run (docs/interop.md, "The GGUF file")."""
    if config.family != "qwen3":
        fix = ("train it with drafter.layer_family=qwen3" if config.family == "llama"
               else "llama.cpp's Gemma-4 DSpark is not written by dspark")
        _refuse(f"llama.cpp's DFlash/DSpark layers are Qwen3's (with q/k norms); this drafter's layers are "
                f"{config.family} ({fix})")
    if config.variant == "dspark" and config.block_layout != "anchor_first":
        _refuse("a DSpark drafter is written anchor-first (block_layout 'anchor_first'); this one is "
                f"{config.block_layout!r}")
    if config.has_sequential_head and config.markov_head_type != "vanilla":
        _refuse(f"markov_head_type={config.markov_head_type!r}: llama.cpp runs only the vanilla Markov head "
                "(train with drafter.markov_head_type=vanilla, or serve with SGLang: --to sglang)")
    if config.has_confidence_head and not (config.has_sequential_head and config.confidence_head_with_markov):
        _refuse("the confidence head reads [hidden; markov_w1[prev]] in llama.cpp; this drafter's reads the hidden "
                "state only (train with confidence_head_with_markov=True, or enable_confidence_head=False)")
    if not 0 <= config.mask_token_id < config.vocab_size:
        _refuse(f"mask_token_id {config.mask_token_id} is outside the vocabulary (0..{config.vocab_size - 1})")
    _check_base(config.to_hf_dict(), "the draft layers")
    _check_feature_layers(list(config.target_layer_ids), config.num_target_layers)


# ------------------------------------------------------------------ tensors
def _absolute_d2t(offsets: torch.Tensor, vocab_size: int) -> np.ndarray:
    ids = offsets.to(torch.int64).reshape(-1).numpy() + np.arange(offsets.numel(), dtype=np.int64)
    if ((ids < 0) | (ids >= vocab_size)).any() or np.unique(ids).size != ids.size:
        _refuse("d2t does not map the draft vocabulary to distinct target ids below vocab_size")
    return ids


def _rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF q/k rows (per head: the first half then the second half of each rotated pair) to GGML's
    interleaved order (per head: row j of the first half, then row j of the second half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rename(name: str, table: dict[str, str], layer_prefix: str) -> str:
    if name in table:
        return table[name]
    if name.startswith(layer_prefix):
        rest = name[len(layer_prefix):]
        bid, _, sub = rest.partition(".") if layer_prefix == "layers." else ("0", "", rest)
        if sub in _LAYER_NAMES:
            return f"blk.{bid}.{_LAYER_NAMES[sub]}"
    raise ValueError(f"no GGUF name for drafter tensor {name!r}")


def _tensor_type(name: str, ndim: int, outtype: str) -> str:
    if ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "f32"
    return outtype


# ------------------------------------------------------------------ writing
def _common_keys(w, arch: str, base: dict[str, Any], n_layers: int, outtype: str, name: str) -> None:
    heads = int(base["num_attention_heads"])
    head_dim = base.get("head_dim") or int(base["hidden_size"]) // heads
    w.add_string("general.type", "model")
    w.add_string("general.name", name)  # the converter names it after the folder (or not at all)
    w.add_uint32(f"{arch}.block_count", n_layers)
    if base.get("max_position_embeddings") is not None:
        w.add_uint32(f"{arch}.context_length", int(base["max_position_embeddings"]))
    w.add_uint32(f"{arch}.embedding_length", int(base["hidden_size"]))
    w.add_uint32(f"{arch}.feed_forward_length", int(base["intermediate_size"]))
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", int(base.get("num_key_value_heads") or heads))
    rope = base.get("rope_theta") or (base.get("rope_parameters") or {}).get("rope_theta")
    if rope is not None:
        w.add_float32(f"{arch}.rope.freq_base", float(rope))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(base["rms_norm_eps"]))
    if base.get("head_dim") is not None:
        w.add_uint32(f"{arch}.attention.key_length", int(head_dim))
        w.add_uint32(f"{arch}.attention.value_length", int(head_dim))
    w.add_uint32("general.file_type", FILE_TYPE[outtype])
    w.add_uint32("general.quantization_version", QUANTIZATION_VERSION)


def _add_fields(w, fields: list) -> None:
    for key, value, kind in fields:
        if kind == "str":
            w.add_string(key, value)
        elif kind == "u32":
            w.add_uint32(key, value)
        elif kind == "bool":
            w.add_bool(key, value)
        elif kind in ("str_array", "i32_array"):
            w.add_array(key, value)  # gguf writes a list of Python ints as INT32
        else:
            raise ValueError(kind)


def _add_tensor(w, name: str, t: torch.Tensor, outtype: str) -> None:
    import gguf

    kind = _tensor_type(name, t.dim(), outtype)
    data = t.detach().to(torch.float32).cpu().contiguous().numpy()
    if kind == "f32":
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    elif kind == "f16":
        w.add_tensor(name, data.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    else:
        packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16)
        w.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.BF16)  # uint8 bytes: shape from the dtype


def spec_type(drafter) -> str:
    """The llama-server --spec-type that runs this drafter's GGUF."""
    config = drafter.config
    if config.variant == "eagle3":
        return "draft-eagle3"
    return "draft-dflash" if config.block_layout == "anchor_plus_masks" else "draft-dspark"


def draft_n_max(drafter) -> int:
    """--spec-draft-n-max: γ, the drafts one block yields."""
    return int(drafter.config.block_size)


def _eagle3_keys_and_tensors(w, arch: str, drafter, base: dict[str, Any], outtype: str) -> dict[str, Any]:
    """Write an Eagle3 drafter's hyper-parameters to ``w``; return its tensors by GGUF name (q/k rows
    permuted as llama.cpp's Llama graph expects; ``d2t`` only with a draft vocabulary, ``t2d`` never)."""
    config = drafter.config
    w.add_array(f"{arch}.target_layers", [i + 1 for i in config.target_layer_ids])
    w.add_uint32(f"{arch}.target_hidden_size", int(config.hidden_size))
    w.add_bool(f"{arch}.norm_before_residual", False)
    w.add_bool(f"{arch}.norm_before_fc", False)
    _common_keys(w, arch, base, 1, outtype, "dspark EAGLE-3 drafter")
    w.add_uint32(f"{arch}.vocab_size", int(config.vocab_size))
    heads = int(base["num_attention_heads"])
    w.add_uint32(f"{arch}.rope.dimension_count", int(base.get("head_dim") or config.hidden_size // heads))
    kv_heads = int(base.get("num_key_value_heads") or heads)
    out = {}
    for name, t in eagle3_serving_tensors(drafter).items():
        if name == "t2d" or (name == "d2t" and not config.draft_vocab_size):
            continue
        if name == "d2t":
            out["d2t"] = t
            continue
        if name.endswith("self_attn.q_proj.weight"):
            t = _rope_permute(t, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            t = _rope_permute(t, kv_heads)
        out[_rename(name, _EAGLE3_NAMES, "midlayer.")] = t
    return out


def _dflash_keys_and_tensors(w, arch: str, drafter, base: dict[str, Any], outtype: str) -> dict[str, Any]:
    """Write a DSpark / DFlash drafter's hyper-parameters to ``w`` (block size γ with
    ``sample_from_anchor`` for anchor-first blocks, γ + 1 for z-lab's anchor + masks); return its
    tensors by GGUF name (``t2d`` dropped)."""
    config = drafter.config
    _common_keys(w, arch, base, config.num_draft_layers, outtype, f"dspark {config.variant} drafter")
    zlab = config.block_layout == "anchor_plus_masks"
    w.add_uint32(f"{arch}.block_size", int(config.block_size) + (1 if zlab else 0))
    w.add_array(f"{arch}.target_layers", [i + 1 for i in config.target_layer_ids])
    if not zlab:
        w.add_bool(f"{arch}.sample_from_anchor", True)
        w.add_bool(f"{arch}.has_confidence_head", bool(config.has_confidence_head))
    state = zlab_tensors(drafter) if zlab else drafter_tensors(drafter, include_shared=False)
    state = with_draft_head(drafter, state)
    return {("d2t" if name == "d2t" else _rename(name, _DFLASH_NAMES, "layers.")): t
            for name, t in state.items() if name != "t2d"}


def fold_confidence_temperature(tensors: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
    """``conf_proj`` weight and bias divided by T: the head's logit z becomes z/T, its output σ(z/T)."""
    t = float(temperature)
    if not (math.isfinite(t) and t > 0.0):
        raise ValueError(f"confidence temperature must be finite and > 0, got {temperature!r}")
    if "conf_proj.weight" not in tensors:
        _refuse("a confidence temperature needs a confidence head: this drafter has none")
    return {name: (tensor.float() / t if name in ("conf_proj.weight", "conf_proj.bias") else tensor)
            for name, tensor in tensors.items()}


def export_gguf(drafter, path: str | os.PathLike, *, target: Any, outtype: str = DEFAULT_OUTTYPE,
                tokenizer_pre: str | None = None, confidence_temperature: float = 1.0) -> Path:
    """Write `drafter` (a loaded dspark Drafter or Eagle3Drafter, with its target's LM head attached
    when it has a draft vocabulary or is an Eagle3) to `path` as a llama.cpp draft GGUF.

    `target`: the target's HF folder, a name dspark resolves ('smollm2-135m'), or a TargetModel
    loaded from a folder; its tokenizer and vocabulary go into the file. `outtype`: f16 (default),
    bf16 or f32 for the matrices. `tokenizer_pre`: llama.cpp's pre-tokenizer name, for tokenizers not
    recognised here. `confidence_temperature`: an STS temperature T folded into the confidence head
    (``conf_proj`` weight and bias divided by T, so llama.cpp computes σ(z/T)). Raises GGUFRefused
    naming what llama.cpp cannot run. Returns the path written.
    """
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: choose one of {list(OUTTYPES)}")
    config = drafter.config
    is_eagle3 = config.variant == "eagle3"
    if is_eagle3:
        check_eagle3_servable(drafter, "llama.cpp (EAGLE-3)")
        _check_base(config.to_hf_dict(), "the EAGLE-3 layer")
        _check_feature_layers(list(config.target_layer_ids), config.num_target_layers)
    else:
        check_dflash(config)
    folder = _target_folder(target)
    tcfg = _target_config(folder)
    vocab_size = int(config.vocab_size)
    if int(tcfg.get("vocab_size", vocab_size)) != vocab_size:
        _refuse(f"the target in {folder} has vocab_size {tcfg.get('vocab_size')}, the drafter {vocab_size}: "
                "give the drafter's own target")
    model_type = str(tcfg.get("model_type", ""))
    tok = tokenizer_fields(folder, vocab_size, model_type=model_type, tokenizer_pre=tokenizer_pre,
                           llama_rules=is_eagle3 or model_type in ("llama", "mistral"))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    arch = EAGLE3_ARCH if is_eagle3 else DFLASH_ARCH
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        # the hyper-parameters as the vLLM folder's config.json states them (what the converter reads)
        if is_eagle3:
            base = eagle3_serving_config(config)
        elif config.block_layout == "anchor_plus_masks":
            base = zlab_config(config)
        else:
            base = deepspec_config(config)
        if is_eagle3:
            out = _eagle3_keys_and_tensors(w, arch, drafter, base, outtype)
        else:
            out = _dflash_keys_and_tensors(w, arch, drafter, base, outtype)
        if confidence_temperature != 1.0:
            out = fold_confidence_temperature(out, confidence_temperature)
        _add_fields(w, tok)
        if not is_eagle3:
            w.add_uint32("tokenizer.ggml.mask_token_id", int(config.mask_token_id))
        for name, t in out.items():
            if name == "d2t":
                w.add_tensor("d2t", _absolute_d2t(t, vocab_size), raw_dtype=gguf.GGMLQuantizationType.I64)
            else:
                _add_tensor(w, name, t, outtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
