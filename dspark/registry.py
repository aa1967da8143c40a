"""Extension points: the named registries a researcher adds to (torch-free).

Three things vary between experiments, and each has one table here:

- ``HEADS``: sequential heads (paper Eq. 5-6), the ``SequentialHead`` contract in
  ``dspark.modeling.heads``; ``drafter.markov_head_type`` names one.
- ``POLICIES``: verification-length policies (Section 3.2.2), ``dspark.scheduling.policies``;
  ``--policy`` and ``serve.policy`` name one (or ``module:function``).
- ``FAMILIES``: target families by ``model_type`` (``Family``: every fact dspark needs about one).

Entries of the built-ins are ``"module:attribute"`` strings, resolved on first use, so this
module (and ``dspark.config``, which validates names against it) never imports torch.
``docs/extending.md`` walks through adding one of each.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["FAMILIES", "Family", "HEADS", "POLICIES", "Registry", "family_of", "load_object", "policy_help"]


def load_object(path: str, what: str = "object") -> Any:
    """``"package.module:attribute"`` -> the attribute (the module is imported)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must be written 'module:attribute' (e.g. 'mypkg.policies:my_policy')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({exc}); "
                         "is it on PYTHONPATH?") from exc
    value = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return value


class Registry(Generic[T]):
    """Names -> entries, with a one-line help per name and an error that lists the choices.

    kind: what an entry is, for messages ("sequential head").
    where: the field or flag that names an entry, for messages ("drafter.markov_head_type").
    Built-in entries may be ``"module:attribute"`` strings; ``get`` resolves them once.
    """

    def __init__(self, kind: str, where: str) -> None:
        self.kind = kind
        self.where = where
        self._entries: dict[str, Any] = {}
        self._help: dict[str, str] = {}
        self._builtin: set[str] = set()

    def register(self, name: str, entry: Any = None, *, help: str = "", replace: bool = False,
                 builtin: bool = False) -> Any:
        """Add ``entry`` under ``name``; without ``entry``, a decorator that registers what it wraps.

        A second registration of a name is an error unless ``replace=True`` (built-ins are never replaced)."""
        if not isinstance(name, str) or not name or name != name.strip() or ":" in name:
            raise ValueError(f"a {self.kind} name must be a non-empty string without ':' or surrounding "
                             f"spaces, got {name!r}")
        if entry is None:
            def decorate(obj: Any) -> Any:
                self.register(name, obj, help=help, replace=replace, builtin=builtin)
                return obj
            return decorate
        if name in self._entries and (name in self._builtin or not replace):
            raise ValueError(f"{self.kind} {name!r} is already registered"
                             + ("" if name in self._builtin else " (pass replace=True to replace it)"))
        self._entries[name] = entry
        self._help[name] = help
        if builtin:
            self._builtin.add(name)
        return entry

    def unregister(self, name: str) -> None:
        """Remove a registered (non-built-in) name, e.g. at the end of a test."""
        if name in self._builtin:
            raise ValueError(f"{self.kind} {name!r} is built in and stays")
        self._entries.pop(name, None)
        self._help.pop(name, None)

    def get(self, name: str) -> T:
        """The entry of ``name``; an unknown name is an error naming ``where`` and the choices."""
        if name not in self._entries:
            raise ValueError(f"{self.where}={name!r} is not a registered {self.kind}; choose from "
                             f"{list(self.names())} or register one (dspark.registry; docs/extending.md)")
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = load_object(entry, self.kind)
            self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def is_builtin(self, name: str) -> bool:
        return name in self._builtin

    def help(self, name: str | None = None) -> str:
        """One name's help, or every name with its help, comma-separated (CLI help text)."""
        if name is not None:
            return self._help.get(name, "")
        return ", ".join(f"{n} ({h})" if h else n for n, h in self._help.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)


# --------------------------------------------------------------------------- heads
# name -> a class following dspark.modeling.heads.SequentialHead
HEADS: Registry[Any] = Registry("sequential head", "drafter.markov_head_type")
for _name, _entry, _help in (
    ("vanilla", "dspark.modeling.heads:MarkovHead", "Markov head, Eq. 5: B_k = W2 W1[x_{k-1}]"),
    ("gated", "dspark.modeling.heads:GatedMarkovHead", "DeepSpec's gated Markov head"),
    ("rnn", "dspark.modeling.heads:RNNHead", "RNN head, Eq. 6 (drafter.rnn_bias: its joint bias)"),
):
    HEADS.register(_name, _entry, help=_help, builtin=True)

# --------------------------------------------------------------------------- policies
# name -> a factory (arg: str, sps: SPSTable | None, spec: str) -> dspark.scheduling.policies.Policy.
# ``make_policy("name:arg", sps)`` calls it with arg, the text after the first ':' ("" when there is
# none), the SPS table (None when none was given; a factory that needs one raises), and the whole spec,
# stripped (the Policy's name, for tables and logs). Each call makes a fresh Policy: one per run.
# help: one line; it starts with the argument's spelling (":<a>", "[:M]") when the policy takes one.
POLICIES: Registry[Callable[..., Any]] = Registry("verification policy", "policy")
for _name, _entry, _help in (
    ("algorithm1", "dspark.scheduling.policies:algorithm1_policy",
     "Algorithm 1 with its early-stopping break, lossless"),
    ("algorithm1+skip", "dspark.scheduling.policies:algorithm1_skip_policy",
     "[:M] algorithm1, and no drafting where a block will not pay; re-probes after at most M steps, "
     "16 by default"),
    ("async", "dspark.scheduling.policies:async_policy",
     "[:K0] Section 5.2: a capacity from two-step-old confidences, top-K by the current ones; K0 while "
     "none is two steps old, one per live request by default"),
    ("static1", "dspark.scheduling.policies:static1_policy",
     "ℓ = 1, MTP-1-like"),
    ("static", "dspark.scheduling.policies:static_policy",
     "[:ℓ] every draft, ℓ = γ, or a fixed ℓ"),
    ("threshold", "dspark.scheduling.policies:threshold_policy",
     ":<a> every draft with cumulative a_j >= a"),
    ("first-below", "dspark.scheduling.policies:first_below_policy",
     ":<t> stop before the first c_j < t, DeepSpec's rule on raw c"),
):
    POLICIES.register(_name, _entry, help=_help, builtin=True)

def policy_help() -> str:
    """Every registered policy with its argument and help, then ``module:function`` (the CLI's text)."""
    items = []
    for name in POLICIES.names():
        text = POLICIES.help(name)
        arg, _, rest = text.partition(" ") if text.startswith((":", "[:")) else ("", "", text)
        items.append(f"{name}{arg} ({rest})" if rest else f"{name}{arg}")
    return ", ".join(items) + ("; or module:function: a function (request_ids, confidences [R, γ]) -> lengths [R], "
                               "or a Policy")


# --------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """Every fact dspark needs about one target family.

    name: the family ("llama", "qwen3", ...); several model_types may share one.
    model_types: the transformers ``config.model_type`` values it covers.
    drafter: whether dspark builds draft layers for it (False: target-only decoding).
    qk_norm / v_norm / sandwich_norm / unit_score_scale / layer_scalar: the draft layer's
        adapter (q/k RMSNorm, weightless v RMSNorm, pre+post norms around attention and
        MLP, attention scores scaled by 1 instead of 1/sqrt(head_dim), a per-layer scalar).
    rotary: ``"module:Class"`` of the transformers RoPE class (same config as the target's);
        ``rotary_layer_type``: the layer type it is called with ("" = none).
    scaled_embeddings: input embeddings are multiplied by sqrt(d) (Gemma).
    architecture_prefix: the prefix of dspark's and DeepSpec's architecture names
        ("Qwen3" in "Qwen3DSparkModel"); "" when there is none.
    k_eq_v_field: the config field that makes values share the key projection ("" = none).
    attention_dims: ``"module:function"``, base config dict -> (heads, kv_heads, head_dim) of a
        draft (full-attention) layer, where the generic config fields do not say it ("" = generic).
    draft_config: ``"module:function"`` (config.json dict, head_dim, kv_heads, num_draft_layers) ->
        None, writing the fields a family's draft layers need in config.json ("" = none).
    rope_model_type: the transformers model_type whose config the rotary class reads ("" = the target's).
    """

    name: str
    model_types: tuple[str, ...]
    drafter: bool = True
    qk_norm: bool = False
    v_norm: bool = False
    sandwich_norm: bool = False
    unit_score_scale: bool = False
    layer_scalar: bool = False
    rotary: str = "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding"
    rotary_layer_type: str = ""
    scaled_embeddings: bool = False
    architecture_prefix: str = ""
    k_eq_v_field: str = ""
    attention_dims: str = ""
    draft_config: str = ""
    rope_model_type: str = ""

    def hook(self, name: str) -> Any:
        """The function a hook field names (None when the field is empty)."""
        path = getattr(self, name)
        return load_object(path, f"FAMILIES[{self.name!r}].{name}") if path else None


class _FamilyTable(Registry[Family]):
    """FAMILIES: keyed by family name; ``of_model_type`` looks one up by ``config.model_type``."""

    def add(self, family: Family, *, replace: bool = False, builtin: bool = False) -> Family:
        """Register ``family`` (its model_types must not belong to another family)."""
        for other in (self.get(n) for n in self.names() if n != family.name):
            clash = set(other.model_types) & set(family.model_types)
            if clash:
                raise ValueError(f"model_type {sorted(clash)} already belongs to family {other.name!r}")
        return self.register(family.name, family, replace=replace, builtin=builtin,
                             help=", ".join(family.model_types))

    def model_types(self) -> dict[str, str]:
        """model_type -> family name, over every registered family."""
        return {t: name for name in self.names() for t in self.get(name).model_types}

    def of_model_type(self, model_type: str, *, drafter: bool = False) -> Family:
        """The family of ``model_type``; ``drafter=True`` also requires draft layers for it."""
        table = self.model_types()
        if model_type not in table:
            raise ValueError(f"model_type={model_type!r} is not in dspark.registry.FAMILIES; supported: "
                             f"{sorted(table)}. A new family is one FAMILIES.add(Family(...)) entry "
                             "(docs/extending.md)")
        family = self.get(table[model_type])
        if drafter and not family.drafter:
            supported = sorted(t for t, n in table.items() if self.get(n).drafter)
            raise ValueError(f"model_type={model_type!r} (family {family.name!r}) has no draft layers in "
                             f"dspark.registry.FAMILIES (drafter=False: target-only decoding); drafters "
                             f"are built for {supported}")
        return family


FAMILIES = _FamilyTable("target family", "model_type")
FAMILIES.add(Family("llama", ("llama", "mistral"), architecture_prefix="Llama"), builtin=True)
FAMILIES.add(Family("qwen3", ("qwen3",), qk_norm=True, architecture_prefix="Qwen3",
                    rotary="transformers.models.qwen3.modeling_qwen3:Qwen3RotaryEmbedding"), builtin=True)
FAMILIES.add(Family("gemma4", ("gemma4", "gemma4_text"), qk_norm=True, v_norm=True, sandwich_norm=True,
                    unit_score_scale=True, layer_scalar=True, scaled_embeddings=True,
                    architecture_prefix="Gemma4", k_eq_v_field="attention_k_eq_v",
                    rotary="transformers.models.gemma4.modeling_gemma4:Gemma4TextRotaryEmbedding",
                    rotary_layer_type="full_attention", rope_model_type="gemma4_text",
                    attention_dims="dspark.modeling.config:gemma4_attention_dims",
                    draft_config="dspark.modeling.config:gemma4_draft_config"), builtin=True)
# Targets dspark decodes without a drafter of its own family (target-only baselines, feature capture).
FAMILIES.add(Family("qwen2", ("qwen2",), drafter=False), builtin=True)
FAMILIES.add(Family("gemma3", ("gemma3", "gemma3_text"), drafter=False, scaled_embeddings=True), builtin=True)


def family_of(model_type: str, *, drafter: bool = True) -> str:
    """The family name of a transformers ``model_type`` (``FAMILIES.of_model_type``)."""
    return FAMILIES.of_model_type(model_type, drafter=drafter).name
