"""The config.json and tensors of each export layout, and the refusal they share: what both the
folder exporter (dspark.interop.export) and the GGUF writer (dspark.interop.gguf) build on.

DeepSpec's config is the target config plus flat DSpark fields; z-lab's is a DFlashDraftModel
(block_size = γ + 1); the standard EAGLE-3 layout is a one-layer LlamaForCausalLMEagle3. A drafter's
own tensors keep DeepSpec's names (ours are the same); z-lab's layout drops the DSpark heads; a
draft vocabulary adds the LM head's k rows next to `d2t`; the EAGLE-3 layout renames `layers.0.*`
to `midlayer.*`. What a destination cannot serve raises ExportRefused with the reason and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark.modeling.config import OWN_FIELDS, DrafterConfig
from dspark.modeling.drafter import SHARED_PARAMS, Drafter
from dspark.modeling.eagle3 import Eagle3Drafter

DEEPSPEC_ARCH = {"qwen3": "Qwen3DSparkModel", "gemma4": "Gemma4DSparkModel"}
DSPARK_HEAD_FIELDS = ("markov_head_type", "confidence_head_with_markov")
EAGLE3_SERVING_ARCH = "LlamaForCausalLMEagle3"
# Our Eagle3 config.json fields that the serving layout does not carry (DeepSpec's and our own).
EAGLE3_OWN_FIELDS = ("target_layer_ids", "ttt_length", "step_loss_decay", "draft_num_hidden_layers", "block_size",
                     "dspark_variant", "eagle3_preset", "target_num_hidden_layers", "mask_token_id", "num_anchors",
                     "layer_types", "auto_map")
EAGLE3_FUSED_LAYERS = 3  # vLLM and SGLang build fc with 3·H inputs


class ExportRefused(ValueError):
    """A destination cannot serve this drafter; the message says why."""


def refuse(destination: str, reason: str) -> None:
    raise ExportRefused(f"cannot export to {destination}: {reason}")


def drafter_tensors(drafter: Drafter, *, include_shared: bool) -> dict[str, torch.Tensor]:
    """The drafter's tensors under DeepSpec's names (ours are the same), copied to CPU."""
    state = {name: t.detach().cpu().contiguous().clone() for name, t in drafter.state_dict().items()}
    head = drafter.markov_head
    if head is not None and drafter.config.markov_head_type == "rnn" and head.joint_proj.bias is None:
        state["markov_head.joint_proj.bias"] = torch.zeros(head.joint_proj.out_features, dtype=head.joint_proj.weight.dtype)
    if include_shared:
        try:
            shared = drafter.shared_weights()
        except RuntimeError:
            raise ValueError(
                "this destination needs the embedding and LM head in the folder, and the drafter has none: "
                "load it with its target (dspark export --target T)"
            ) from None
        state.update({name: shared[name].detach().cpu().clone() for name in SHARED_PARAMS})
    return state


def zlab_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {k: v for k, v in drafter_tensors(drafter, include_shared=False).items() if not k.startswith(("markov_head", "confidence_head"))}


def with_draft_head(drafter: Drafter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM with a draft vocabulary: the LM head's k rows next to `d2t` (from the state)."""
    if drafter.vocab is None:
        return tensors
    try:
        head = drafter.shared_weights()["lm_head.weight"]
    except RuntimeError:
        raise ValueError("a draft vocabulary's LM head rows go into the folder, and the drafter has no LM head: "
                         "load it with its target (dspark export --target T)") from None
    return {**tensors, "lm_head.weight": head.detach().cpu().contiguous().clone()}


def check_eagle3_servable(drafter: Eagle3Drafter, destination: str) -> None:
    """What LlamaForCausalLMEagle3 can express: one Llama layer over exactly 3 fused layers."""
    config = drafter.config
    ids = list(config.target_layer_ids)
    if len(ids) != EAGLE3_FUSED_LAYERS:
        refuse(destination, f"its EAGLE-3 model (LlamaForCausalLMEagle3) fuses exactly {EAGLE3_FUSED_LAYERS} target "
                             f"layers (fc input fixed at 3·H); this drafter fuses {len(ids)} ({ids}; the eagle3_deepspec "
                             "preset's 5 are DeepSpec's: train the 'eagle3' preset to serve it)")
    if drafter.layers[0].self_attn.q_norm is not None:
        refuse(destination, "its EAGLE-3 layer is Llama's, without q/k norms; this drafter has q/k norms (the "
                             "eagle3_deepspec preset: train the 'eagle3' preset to serve it)")
    base = config.base_config
    act = base.get("hidden_activation") or base.get("hidden_act") or "silu"
    reasons = [
        (act != "silu", f"its activation is {act!r}, Llama's is 'silu'"),
        (config.embed_scale != 1.0, f"its embeddings are scaled by {config.embed_scale:g} ({config.family})"),
        (bool(config.final_logit_softcapping), "its logits are soft-capped"),
        (bool(base.get("attention_bias") or base.get("mlp_bias")), "its layer has biases"),
    ]
    for bad, why in reasons:
        if bad:
            refuse(destination, f"its EAGLE-3 layer is a plain Llama layer and {why}")


def eagle3_serving_tensors(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """fc, midlayer.* (= layers.0.*), norm, lm_head (the k or V rows it drafts over), d2t / t2d."""
    try:
        head = drafter.shared_weights()["lm_head.weight"]
    except RuntimeError:
        raise ValueError("the EAGLE-3 layout holds the drafter's LM head rows, and the drafter has no LM head: load it "
                         "with its target (dspark export --target T)") from None
    state = {name: t.detach().cpu().contiguous().clone() for name, t in drafter.state_dict().items()}
    out = {("midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name): t for name, t in state.items()}
    out["lm_head.weight"] = head.detach().cpu().contiguous().clone()
    return out


def deepspec_config(config: DrafterConfig) -> dict[str, Any]:
    """DeepSpec's config.json: the target config + flat DSpark fields, written as its
    `build_draft_config` writes them (DFlash: `markov_rank` 0 and no head fields)."""
    out = config.to_hf_dict()
    for key in OWN_FIELDS:
        out.pop(key, None)
    out["architectures"] = [DEEPSPEC_ARCH[config.family]]
    out["tie_word_embeddings"] = False  # DeepSpec keeps its own frozen copies of both tables
    if not config.has_sequential_head:
        out.pop("markov_head_type", None)
    if not config.has_confidence_head:
        out.pop("confidence_head_with_markov", None)
    return out


def zlab_config(config: DrafterConfig) -> dict[str, Any]:
    """z-lab's DFlashDraftModel config.json (anchor + γ masks, block_size = γ + 1)."""
    out = config.to_hf_dict()
    for key in (*OWN_FIELDS, "mask_token_id", "target_layer_ids", "num_anchors", "markov_rank",
                *DSPARK_HEAD_FIELDS, "enable_confidence_head"):
        out.pop(key, None)
    out["architectures"] = ["DFlashDraftModel"]
    out["layer_types"] = ["full_attention"] * config.num_draft_layers
    out["block_size"] = config.block_size + 1
    out["num_target_layers"] = config.num_target_layers
    out["dflash_config"] = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    return out


def refuse_draft_vocab(config: DrafterConfig, destination: str, why: str) -> None:
    if config.draft_vocab_size:
        refuse(destination, f"this drafter has a draft vocabulary of {config.draft_vocab_size} ids and {why}; "
                             "vLLM serves it (--to vllm); for this destination train with drafter.draft_vocab_size=0 "
                             "(the full vocabulary)")


def eagle3_serving_config(config: DrafterConfig) -> dict[str, Any]:
    """The config.json vLLM and SGLang load as LlamaForCausalLMEagle3 (see the module docstring)."""
    out = config.to_hf_dict()
    for key in EAGLE3_OWN_FIELDS:
        out.pop(key, None)
    ids = list(config.target_layer_ids)
    out.update(
        architectures=[EAGLE3_SERVING_ARCH],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        target_hidden_size=config.hidden_size,
        draft_vocab_size=config.output_vocab_size,
        num_target_layers=config.num_target_layers,  # ours, for the way back (formats.py)
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in ids],  # vLLM: input-of-layer, read as written
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},  # SGLang adds 1
    )
    out.setdefault("head_dim", config.base_config.get("head_dim") or config.hidden_size // int(out["num_attention_heads"]))
    return out
