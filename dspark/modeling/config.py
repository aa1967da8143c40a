"""The drafter's architecture description and its config.json layout.

A drafter's `config.json` is the target's (text) config with `num_hidden_layers`
set to the number of draft layers, plus the DSpark fields
`block_size, mask_token_id, target_layer_ids, num_target_layers, num_anchors,
markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov`. This is DeepSpec's layout, so their released
checkpoints load by name. Our own additions (`dspark_variant`, `block_layout`)
have defaults that reproduce DeepSpec's behaviour when absent.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dspark.choices import ATTENTION_KERNELS, BLOCK_LAYOUTS, EAGLE3_PRESETS, VARIANTS
from dspark.config import DrafterSpec
from dspark.registry import FAMILIES, HEADS, Family

_SPEC = DrafterSpec()  # the defaults both DrafterSpec and DrafterConfig carry live in DrafterSpec
# Fields only dspark writes (DeepSpec has none of them; each has a default reproducing DeepSpec).
OWN_FIELDS = ("dspark_variant", "block_layout", "target_num_hidden_layers", "rnn_bias", "eagle3_preset",
              "markov_head_options", "markov_head_source")
# Fields DeepSpec writes for its Eagle3 (Qwen3Eagle3Model) on top of the target config.
EAGLE3_FIELDS = ("ttt_length", "step_loss_decay", "draft_num_hidden_layers", "target_model_name_or_path")

# Fields DeepSpec writes on top of the target config.
_DSPARK_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "num_anchors",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def qwen3_layers_for(base: dict[str, Any], layer_family: str) -> dict[str, Any]:
    """The config of Qwen3 draft layers for a Llama-family target: the same sizes, norm eps
    and RoPE (Qwen3 and Llama compute RoPE alike from the same fields), plus the q/k
    RMSNorm of Qwen3 attention. Only Llama -> Qwen3 is exact enough to offer: a Gemma4
    target's scaled embeddings and soft-capped logits have no Qwen3 form."""
    source = family_of(str(base.get("model_type", "")))
    if layer_family != "qwen3" or source != "llama":
        raise ValueError(
            f"drafter.layer_family={layer_family!r} for a {source} target: the one conversion offered is "
            "'qwen3' layers for a Llama-family target ('' keeps the target's family)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if base.get(key):
            raise ValueError(f"the target has {key}=True, which Qwen3 draft layers do not have; "
                             "keep drafter.layer_family=''")
    out = {k: v for k, v in base.items() if k not in ("pretraining_tp", "mlp_bias")}
    out.update(model_type="qwen3", attention_bias=False)
    return out


def family_of(model_type: str) -> str:
    """The drafter family of a transformers `model_type` (dspark.registry.FAMILIES; it must have
    draft layers)."""
    return FAMILIES.of_model_type(model_type, drafter=True).name


@dataclass
class DrafterConfig:
    """Everything needed to build a drafter: the resolved architecture that config.json stores.

    `base_config` is the target's text config as a plain dict (it drives the
    per-family details: RoPE parameters, norm eps, activation, head sizes);
    `num_hidden_layers` there is overwritten by `num_draft_layers` on export.
    An experiment states its choices in `dspark.config.DrafterSpec`, which
    `dspark.build.drafter_config` maps here; the fields both carry have the same
    defaults (the paper's Qwen3-4B recipe), kept equal by a test.
    """

    base_config: dict[str, Any]
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    num_draft_layers: int = _SPEC.num_draft_layers
    block_size: int = _SPEC.block_size
    num_anchors: int = 512
    variant: str = _SPEC.variant  # dspark.choices.VARIANTS
    block_layout: str = _SPEC.block_layout  # DSpark layout | original DFlash "anchor_plus_masks"
    markov_rank: int = _SPEC.markov_rank
    markov_head_type: str = _SPEC.markov_head_type  # a dspark.registry.HEADS name
    # The RNN head's joint_proj has a bias by default: DeepSpec trains and SGLang serves that form,
    # so a drafter trained here serves there; False is the paper's Eq. 6 exactly.
    rnn_bias: bool = _SPEC.rnn_bias
    # keyword arguments of a registered head's constructor (config.json: markov_head_options)
    head_options: dict[str, Any] = field(default_factory=dict)
    enable_confidence_head: bool = _SPEC.enable_confidence_head
    confidence_head_with_markov: bool = _SPEC.confidence_head_with_markov
    intermediate_size: int | None = None  # None: the target's
    attn_implementation: str = "sdpa"  # dspark.choices.ATTENTION_KERNELS
    # Eagle3 only (variant "eagle3"): the preset, the training-time-test horizon and its step decay.
    eagle3_preset: str = _SPEC.eagle3_preset
    ttt_length: int = _SPEC.ttt_length
    step_loss_decay: float = _SPEC.step_loss_decay
    # k > 0: the drafter predicts over k target ids (dspark.modeling.vocab); 0: the full vocabulary.
    draft_vocab_size: int = _SPEC.draft_vocab_size
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def model_type(self) -> str:
        return str(self.base_config.get("model_type", ""))

    @property
    def family(self) -> str:
        return family_of(self.model_type)

    @property
    def family_facts(self) -> Family:
        """Everything dspark knows about the target's family (dspark.registry.FAMILIES)."""
        return FAMILIES.of_model_type(self.model_type, drafter=True)

    @property
    def hidden_size(self) -> int:
        return int(self.base_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.base_config["vocab_size"])

    @property
    def output_vocab_size(self) -> int:
        """Rows of the drafter's LM head and of the Markov head's W2: k, or V without a draft vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def has_sequential_head(self) -> bool:
        return self.variant == "dspark" and self.markov_rank > 0

    @property
    def has_confidence_head(self) -> bool:
        return self.variant == "dspark" and self.enable_confidence_head

    @property
    def block_len(self) -> int:
        """Number of input slots of one block (γ for DSpark's layout, γ+1 for DFlash's)."""
        return self.block_size + (1 if self.block_layout == "anchor_plus_masks" else 0)

    @property
    def first_prediction_slot(self) -> int:
        """Slot whose output predicts x_1: the anchor slot (0) or the first mask slot (1)."""
        return 1 if self.block_layout == "anchor_plus_masks" else 0

    @property
    def embed_scale(self) -> float:
        """Gemma scales input embeddings by sqrt(d); the drafter reuses the same lookup."""
        return math.sqrt(self.hidden_size) if self.family_facts.scaled_embeddings else 1.0

    @property
    def final_logit_softcapping(self) -> float | None:
        value = self.base_config.get("final_logit_softcapping")
        return None if value in (None, 0, 0.0) else float(value)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        self.family  # raises on unsupported model types
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} is not one of {VARIANTS}")
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ValueError(f"block_layout={self.block_layout!r} is not one of {BLOCK_LAYOUTS}")
        if self.markov_head_type not in HEADS:
            raise ValueError(
                f"markov_head_type={self.markov_head_type!r} is not a registered sequential head "
                f"{list(HEADS.names())}: import the module that registers it (dspark.registry.HEADS; "
                "dspark never imports code a config.json names)"
            )
        if not isinstance(self.head_options, dict) or not all(isinstance(k, str) for k in self.head_options):
            raise ValueError(f"head_options must be a dict of keyword arguments, got {self.head_options!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must lie in [0, {self.vocab_size}] (0 = the full vocabulary)"
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.variant == "eagle3":
            if self.eagle3_preset not in EAGLE3_PRESETS:
                raise ValueError(f"eagle3_preset={self.eagle3_preset!r} is not one of {EAGLE3_PRESETS}")
            if self.ttt_length < 1:
                raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
            if not 0 < self.step_loss_decay <= 1:
                raise ValueError(f"step_loss_decay must lie in (0, 1], got {self.step_loss_decay}")
        if self.attn_implementation not in ATTENTION_KERNELS:
            raise ValueError(
                f"attn_implementation={self.attn_implementation!r}; use one of {ATTENTION_KERNELS}"
            )
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < -1 or ids[-1] > self.num_target_layers - 1:
            raise ValueError(
                f"target_layer_ids={ids} out of range: each id must be -1 (embeddings) or in "
                f"[0, {self.num_target_layers - 1}] for a target with {self.num_target_layers} layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        if self.variant == "dspark" and self.enable_confidence_head and self.confidence_head_with_markov:
            if self.markov_rank == 0:
                raise ValueError(
                    "confidence_head_with_markov=True needs markov_rank > 0; set "
                    "confidence_head_with_markov=False or give the drafter a sequential head"
                )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_target_config(cls, target_config: Any, *, layer_family: str = "", **fields: Any) -> "DrafterConfig":
        """Build from a transformers config of the target (its text config is used).

        `layer_family` "" gives draft layers of the target's family; "qwen3" gives Qwen3
        layers (q/k RMSNorm) to a Llama-family target, since the DSpark models that
        DeepSpec, vLLM and SGLang load are Qwen3 (or Gemma4) models: a drafter for a
        Llama target is servable only with them (see `qwen3_layers_for`)."""
        text = getattr(target_config, "get_text_config", lambda: target_config)()
        base = text.to_dict()
        base["model_type"] = getattr(text, "model_type", base.get("model_type"))
        fields.setdefault("num_target_layers", int(text.num_hidden_layers))
        if layer_family and layer_family != family_of(base["model_type"]):
            base = qwen3_layers_for(base, layer_family)
        return cls(base_config=base, **fields)

    # ------------------------------------------------------------ config.json
    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents: the target config + DeepSpec's DSpark fields + ours."""
        out = copy.deepcopy(self.base_config)
        for key in ("architectures", "auto_map", "quantization_config", "transformers_version"):
            out.pop(key, None)
        heads, kv_heads, head_dim = resolve_attention_dims(self.base_config)
        out["num_hidden_layers"] = self.num_draft_layers
        draft_config = self.family_facts.hook("draft_config")
        if draft_config is not None:
            draft_config(out, head_dim, kv_heads, self.num_draft_layers)
        elif isinstance(out.get("layer_types"), list):
            out["layer_types"] = ["full_attention"] * self.num_draft_layers
        if self.intermediate_size is not None:
            out["intermediate_size"] = self.intermediate_size
        arch_prefix = self.family_facts.architecture_prefix
        if self.variant == "eagle3":
            return self._eagle3_hf_dict(out, arch_prefix)
        out["architectures"] = [f"{arch_prefix}{'DSpark' if self.variant == 'dspark' else 'DFlash'}Model"]
        is_dspark = self.variant == "dspark"
        out.update(
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=self.num_target_layers,
            num_anchors=self.num_anchors,
            markov_rank=self.markov_rank if is_dspark else 0,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=bool(self.enable_confidence_head and is_dspark),
            confidence_head_with_markov=bool(self.confidence_head_with_markov and is_dspark),
            dspark_variant=self.variant,
            block_layout=self.block_layout,
            target_num_hidden_layers=self.num_target_layers,
            rnn_bias=self.rnn_bias,
        )
        if self.head_options:
            out["markov_head_options"] = dict(self.head_options)
        if is_dspark and self.markov_rank and not HEADS.is_builtin(self.markov_head_type):
            cls = HEADS.get(self.markov_head_type)  # where the head is defined, for the loader's message
            out["markov_head_source"] = f"{cls.__module__}:{cls.__qualname__}"
        if self.draft_vocab_size:  # vLLM's field; absent = the full vocabulary, as before
            out["draft_vocab_size"] = self.draft_vocab_size
        out.update(self.extra)
        return out

    def _eagle3_hf_dict(self, out: dict[str, Any], arch_prefix: str) -> dict[str, Any]:
        """DeepSpec's Qwen3Eagle3Model fields (so a Qwen3 "eagle3_deepspec" folder is DeepSpec's
        layout) plus ours: the preset and γ (`block_size`, the drafts per round)."""
        out["architectures"] = [f"{arch_prefix}Eagle3Model"]
        out.update(
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=self.num_target_layers,
            ttt_length=self.ttt_length,
            step_loss_decay=self.step_loss_decay,
            draft_num_hidden_layers=self.num_draft_layers,
            block_size=self.block_size,
            dspark_variant="eagle3",
            eagle3_preset=self.eagle3_preset,
            target_num_hidden_layers=self.num_target_layers,
        )
        if self.draft_vocab_size:  # vLLM's field, as for DSpark/DFlash
            out["draft_vocab_size"] = self.draft_vocab_size
        out.update(self.extra)
        return out

    @classmethod
    def from_eagle3_hf_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """Parse an Eagle3 config.json written by us or by DeepSpec (`Qwen3Eagle3Model`, which has
        no `eagle3_preset`: it is DeepSpec's variant)."""
        missing = [k for k in ("model_type", "hidden_size", "vocab_size", "target_layer_ids") if k not in d]
        if missing:
            raise ValueError(f"Eagle3 config.json lacks the fields {missing}")
        drop = (*_DSPARK_FIELDS, *EAGLE3_FIELDS, *OWN_FIELDS, "draft_vocab_size")
        base = {k: v for k, v in d.items() if k not in drop}
        ids = list(d["target_layer_ids"])
        draft_vocab_size = int(d.get("draft_vocab_size", 0) or 0)
        if draft_vocab_size == int(d["vocab_size"]):  # vLLM's "no reduction" spelling
            draft_vocab_size = 0
        return cls(
            base_config=base,
            target_layer_ids=ids,
            num_target_layers=int(d.get("num_target_layers", d.get("target_num_hidden_layers", max(ids) + 1))),
            mask_token_id=0,  # unused: an Eagle3 draft step feeds real tokens, never a mask
            num_draft_layers=int(d.get("draft_num_hidden_layers", d.get("num_hidden_layers", 1))),
            block_size=int(d.get("block_size", d.get("ttt_length", 7))),
            variant="eagle3",
            markov_rank=0,
            enable_confidence_head=False,
            confidence_head_with_markov=False,
            eagle3_preset=str(d.get("eagle3_preset", "eagle3_deepspec")),
            ttt_length=int(d.get("ttt_length", 7)),
            step_loss_decay=float(d.get("step_loss_decay", 0.8)),
            draft_vocab_size=draft_vocab_size,
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """Parse a config.json written by us or by DeepSpec."""
        missing = [k for k in ("model_type", "hidden_size", "vocab_size", "target_layer_ids", "mask_token_id") if k not in d]
        if missing:
            raise ValueError(f"drafter config.json lacks the fields {missing}")
        head = str(d.get("markov_head_type", "vanilla"))
        if int(d.get("markov_rank", 0)) > 0 and head not in HEADS:
            source = d.get("markov_head_source")
            where = f" (defined in {source})" if source else ""
            raise ValueError(
                f"config.json names markov_head_type={head!r}{where}, which is not registered in this process: "
                f"import the module that registers it (dspark.registry.HEADS) before loading; dspark never "
                f"imports code that a config.json names. Registered: {list(HEADS.names())}"
            )
        base = {k: v for k, v in d.items() if k not in _DSPARK_FIELDS}
        archs = d.get("architectures") or []
        variant = d.get("dspark_variant")
        if variant is None:
            if any("DFlash" in a for a in archs):
                variant = "dflash"
            elif int(d.get("markov_rank", 0)) > 0 or d.get("enable_confidence_head", False):
                variant = "dspark"
            else:
                variant = "dflash"
        num_draft_layers = int(d["num_hidden_layers"])
        num_target_layers = int(d.get("num_target_layers", d.get("target_num_hidden_layers", max(d["target_layer_ids"]) + 1)))
        for key in OWN_FIELDS:
            base.pop(key, None)
        draft_vocab_size = int(base.pop("draft_vocab_size", 0) or 0)
        if draft_vocab_size == int(d["vocab_size"]):  # vLLM's "no reduction" spelling
            draft_vocab_size = 0
        return cls(
            base_config=base,
            target_layer_ids=list(d["target_layer_ids"]),
            num_target_layers=num_target_layers,
            mask_token_id=int(d["mask_token_id"]),
            num_draft_layers=num_draft_layers,
            block_size=int(d.get("block_size", 7)),
            num_anchors=int(d.get("num_anchors", 512)),
            variant=variant,
            block_layout=d.get("block_layout", "anchor_first"),
            markov_rank=int(d.get("markov_rank", 0)),
            markov_head_type=str(d.get("markov_head_type", "vanilla")),
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", False)),
            rnn_bias=bool(d.get("rnn_bias", True)),
            head_options=dict(d.get("markov_head_options") or {}),
            draft_vocab_size=draft_vocab_size,
        )

    def rope_config(self):
        """A transformers config from which the family's rotary-embedding class computes RoPE
        for the draft layers (all full attention)."""
        from transformers import AutoConfig

        d = self.to_hf_dict()
        model_type = d.pop("model_type")
        for key in ("architectures", "draft_vocab_size", *_DSPARK_FIELDS, *OWN_FIELDS, *EAGLE3_FIELDS):
            d.pop(key, None)
        facts = self.family_facts
        if facts.rope_model_type:
            model_type = facts.rope_model_type
        if facts.rotary_layer_type:
            _, _, head_dim = resolve_attention_dims(self.base_config)
            d.update(num_hidden_layers=1, layer_types=["full_attention"], head_dim=head_dim, global_head_dim=head_dim)
        return AutoConfig.for_model(model_type, **d)

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


def resolve_attention_dims(base: dict[str, Any]) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of a draft attention layer: the generic config fields,
    or the family's own rule (Family.attention_dims) where they do not say it."""
    heads = int(base["num_attention_heads"])
    head_dim = base.get("head_dim") or int(base["hidden_size"]) // heads
    kv_heads = int(base.get("num_key_value_heads") or heads)
    rule = FAMILIES.of_model_type(str(base.get("model_type", ""))).hook("attention_dims")
    if rule is not None:
        return rule(base)
    return heads, kv_heads, int(head_dim)


def gemma4_attention_dims(base: dict[str, Any]) -> tuple[int, int, int]:
    """Gemma4: draft layers attend globally, so they take the target's full-attention ("global")
    sizes, which transformers stores either as `global_head_dim`/`num_global_key_value_heads` or in
    a per-layer table."""
    heads = int(base["num_attention_heads"])
    head_dim = base.get("head_dim") or int(base["hidden_size"]) // heads
    kv_heads = int(base.get("num_key_value_heads") or heads)
    full = {}
    table = base.get("per_layer_config") or {}
    for idx, kind in enumerate(base.get("layer_types") or []):
        if kind == "full_attention" and str(idx) in table:
            full = table[str(idx)]
            break
    head_dim = base.get("global_head_dim") or full.get("head_dim") or head_dim
    if base.get("attention_k_eq_v"):
        kv_heads = int(base.get("num_global_key_value_heads") or full.get("num_key_value_heads") or kv_heads)
    return heads, kv_heads, int(head_dim)


def gemma4_draft_config(out: dict[str, Any], head_dim: int, kv_heads: int, num_draft_layers: int) -> None:
    """Gemma4 config.json fields of the draft layers: every one a full-attention layer, its sizes
    stated explicitly instead of the target's per-layer table (indexed by target layer)."""
    out.pop("per_layer_config", None)
    out["layer_types"] = ["full_attention"] * num_draft_layers
    out["global_head_dim"] = head_dim
    out["num_global_key_value_heads"] = kv_heads
    out["num_kv_shared_layers"] = 0
    out["hidden_size_per_layer_input"] = 0
    out["enable_moe_block"] = False
