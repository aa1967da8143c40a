"""Typed experiment configs, the config-file loader and `key.path=value` overrides.

Every command that runs a model reads one `Config`. Its defaults are the Qwen3-4B DSpark recipe of
paper Section 3.3 (config/dspark/dspark_qwen3_4b.py spells every field out, to copy from); a config
file is plain Python that binds one `Config` to the name `config` and states only what differs.
`load_config(path, overrides=["train.lr=3e-4", "drafter.block_size=8"])` also reads the config.json
a run writes next to its outputs (`Config.to_dict()`), so a run is reproduced from that file.
Overrides are type-checked against the dataclass fields; an unknown key or a value of the wrong
type is a ValueError naming the key. `dflash_of` and `eagle3_of` derive the baselines' configs
from a DSpark one.

docs/configs.md: an example config file, the sections, the settings worth knowing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import runpy
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.choices import EAGLE3_PRESETS
from dspark.config_checks import validate
from dspark.config_fields import build_dataclass, coerce, field_types, from_text, get_key, keys_of, replace_path



@dataclass
class TargetConfig:
    name_or_path: str = "Qwen/Qwen3-4B"  # hub name, local folder, or "smollm2-135m" (the embedded default)
    dtype: str = "auto"  # "auto" (bf16 on GPUs and on CPUs with native bf16, else fp32) | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" (this rank's GPU if there is one, else cpu) | "cpu" | "cuda" | "cuda:N"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    # Few-row decoding products (1-128 rows) through oneDNN-packed weights (dspark.kernels.cpu_linear):
    # "auto" (on a CPU in float32, and in bfloat16 where the CPU has native bf16)
    # | "onednn" (on a CPU, float32 or bfloat16) | "torch" (never)
    cpu_linear: str = "auto"


@dataclass
class DrafterSpec:
    """What an experiment chooses about its drafter (paper Section 3); the defaults are the
    paper's Qwen3-4B DSpark recipe (Sections 3.3 and 4.1).

    `dspark.build.drafter_config` resolves it against the target into a
    `dspark.modeling.DrafterConfig`, the architecture written to config.json, whose
    sizes (hidden size, vocabulary, heads) are the target's. The fields both carry
    have the same defaults, kept equal by a test; `attn_implementation` "auto" is
    resolved on the device. A "dflash" drafter has no sequential or confidence head
    whatever the head fields say (`dflash_of` writes them out as DeepSpec trains
    DFlash). An "eagle3" drafter is one autoregressive layer trained by
    training-time test (EAGLE-3, the paper's baseline); `eagle3_of` derives it
    from a DSpark config."""

    target_layer_ids: list[int] = field(default_factory=lambda: [1, 9, 17, 25, 33])  # i = output of decoder layer i
    mask_token_id: int = 151669
    variant: str = "dspark"  # "dspark" | "dflash" | "eagle3"
    block_size: int = 7  # γ (Eagle3: drafts per round, one forward each)
    num_draft_layers: int = 5
    block_layout: str = "anchor_first"  # "anchor_first" (DSpark) | "anchor_plus_masks" (original DFlash)
    markov_rank: int = 256  # Eq. 5, r
    # a dspark.registry.HEADS name: "vanilla" (Eq. 5) | "gated" (DeepSpec, SGLang) | "rnn" (Eq. 6) | a registered one
    markov_head_type: str = "vanilla"
    # The RNN head's joint bias: True is DeepSpec's form (SGLang serves it), False the paper's Eq. 6 exactly
    rnn_bias: bool = True
    head_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of a registered head
    enable_confidence_head: bool = True  # Eq. 7
    confidence_head_with_markov: bool = True
    intermediate_size: int | None = None  # None: the target's
    attn_implementation: str = "auto"  # "auto" (flex on GPU, sdpa on CPU) | "sdpa" | "eager" | "flex"
    layer_family: str = ""  # "": the target's; "qwen3": Qwen3 layers for a Llama target (what serving engines load)
    dtype: str = "float32"  # parameter dtype of the drafter (master weights stay fp32 when training)
    eagle3_preset: str = "eagle3"  # "eagle3" (standard: Llama layer, vLLM / SGLang) | "eagle3_deepspec" (q/k norms)
    ttt_length: int = 7  # Eagle3 training-time-test steps
    step_loss_decay: float = 0.8  # Eagle3: step s of the TTT loss weighs decay^s
    # Draft vocabulary (dspark.modeling.vocab): the drafter predicts over the k most frequent target ids
    # of the training data (`dspark vocab` writes them); 0 = the full target vocabulary.
    draft_vocab_size: int = 0
    draft_vocab: str = ""  # the vocabulary file ("" = <data_dir>/draft_vocab_<k>.safetensors)
    # Start the draft layers from target decoder layers (dspark.modeling.init): "" (random init), "last"
    # (its last num_draft_layers layers), "spread" (evenly spaced, first and last included) or ids "10,20".
    init_from_target: str = ""


@dataclass
class DataConfig:
    # "builtin", a .jsonl path, or "hub:<dataset name>"; any of them + "+self:N" adds N prompts the target
    # writes itself (dspark.data.self_prompts), "self:N" uses only those (split_train_prompts)
    train_prompts: str = "hub:mlabonne/open-perfectblend"
    holdout_fraction: float = 0.05
    max_samples: int = 0  # 0 = all; caps the prompts of the source, not the self-written ones
    max_length: int = 4096
    min_loss_tokens: int = 14
    num_anchors: int = 512
    data_dir: str = ""  # where regenerated answers and the cache live ("" = <out_dir>/data)
    feature_mode: str = "cache"  # "cache" (dspark cache) | "online" (target runs in the step)
    cache_precision: str = "bf16"  # "bf16" (DeepSpec's) | "fp8" (0.47x the bytes, docs/configs.md) | "fp32"
    # How `dspark vocab` counts tokens for the draft vocabulary: "hard" (the supervised tokens, EAGLE-3's),
    # "soft" (the target's probabilities summed over supervised positions), "hard+soft" (hard counts
    # first, topped up from soft ones).
    vocab_counts: str = "hard+soft"
    # "+self:N" checks the self-written prompts against every benchmark of eval.benchmarks and refuses to
    # start when a benchmark file is missing; benchmarks named here may be missing (their prompts unchecked)
    self_prompts_unchecked: list[str] = field(default_factory=list)


@dataclass
class GenerationConfig:
    """The target's recommended sampling for regenerating answers (non-thinking)."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 4096
    batch_size: int = 32
    backend: str = "openai"  # "transformers" (in-process) | "openai" (a vLLM / SGLang server at server_url)
    server_url: str = ""
    request_timeout_s: float = 300.0
    max_retries: int = 3


@dataclass
class LossConfig:
    ce_weight: float = 0.1  # Eq. 12
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    loss_decay_gamma: float = 4.0  # Eq. 8
    chunk_rows: int = 64
    fused: bool = True  # LM-head gradients in the forward pass (no recomputation); False: generic chunked loss
    # Eagle3: DeepSpec's conventions (loss mask read two positions before the predicted token, every
    # step divided by B·S) instead of ours (the predicted token's own mask, a weighted mean).
    eagle3_parity: bool = False


@dataclass
class TrainConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04  # then cosine to min_lr_ratio · lr
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    global_batch_size: int = 512  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 1  # sequences per forward on one rank
    epochs: float = 10.0
    max_steps: int = 0  # 0 = from epochs
    # "auto" (bf16 on GPUs and on CPUs with native bf16, else "no") | "bf16" (autocast over fp32
    # master weights) | "no"; dspark.build.resolve_mixed_precision
    mixed_precision: str = "auto"
    # Length-bucketed micro-batches: each holds samples of similar length (less padding for the
    # target and the drafter); the samples of an epoch and each sample's loss are unchanged.
    bucketing: bool = True
    bucket_window: int = 64  # micro-batches per length-sorting window (larger: less padding, less mixing)
    compile: bool = True  # torch.compile the drafter (GPU recipes; CPU runs set False)
    distributed: str = "ddp"  # "ddp" | "fsdp"
    save_every: int = 3000
    eval_every: int = 100
    log_every: int = 10
    max_wall_minutes: float = 0.0  # 0 = no limit
    tensorboard: bool = False
    resume: bool = False  # continue from the latest checkpoint in out_dir


@dataclass
class EvalConfig:
    """`dspark eval` (the protocol of paper Section 4.1); `propose` and `simulate` take their drafter and prompts from here too."""

    draft: str = ""  # a trained drafter folder (ours or DeepSpec's); "" = a fresh one from `drafter` (untrained)
    out: str = ""  # "" = <out_dir>/eval
    data_dir: str = "eval_datasets"  # folder with the nine <benchmark>.jsonl files ($DSPARK_EVAL_DATA when left at the default)
    builtin_prompts: bool = False  # the built-in evaluation prompts (held out of training) instead of files
    # the nine of dspark.data.benchmarks, in evaluation order (spelled out: config.py imports no library module)
    benchmarks: list[str] = field(default_factory=lambda: [
        "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2"])
    num_samples: int = 0  # prompts per benchmark; 0 = the protocol counts (dspark.data.benchmarks)
    # which prompts of each benchmark: "all" (the whole file, DeepSpec's subsets), "dev" (tuning and
    # studies) or "test" (reported results); dev and test never share a prompt (dspark.data.benchmarks)
    split: str = "all"
    max_new_tokens: int = 2048
    temperature: float = 1.0  # 0 = greedy
    seed: int = 980406  # prompt subset and random draws; DeepSpec's default, so both tools pick the same prompts
    bootstrap_resamples: int = 1000  # resamples of the requests behind every 95 % interval (seeded with eval.seed)
    block_size: int = 0  # 0 = the drafter's γ
    baseline: bool = True  # also decode with the target alone (speedups)
    label: str = ""  # row label in the report tables ("" = from the drafter's variant)
    # requests decoded together, one drafter and one target forward per round for all of them
    # (dspark.decoding.batched; every request decodes the tokens it would alone). "auto": the largest
    # R in 1, 2, 4, ... whose every doubling raised the throughput of full rounds by 10 %, timed on the
    # device before decoding (dspark.scheduling.batch_size.measured_batch_size). 1 = one at a time.
    batch_size: int | str = "auto"


# The policies `dspark simulate` compares when serve.policy is empty.
SIMULATE_POLICIES = ["algorithm1", "async", "static1", "static", "threshold:0.5"]


@dataclass
class ServeConfig:
    """Verification scheduling (paper Section 3.2): `dspark eval` with a policy, and `dspark simulate`."""

    # The verification-length policies (algorithm1, algorithm1+skip[:M], async[:K0], static1, static[:ℓ],
    # threshold:<a>, first-below:<t>): eval decodes under each on the same requests ([] = verify all γ
    # drafts; several: one folder each), simulate compares them all ([] = SIMULATE_POLICIES). One string
    # is read as a list of one.
    policy: list[str] = field(default_factory=list)
    concurrency: int = 1  # eval with a policy: requests decoded in lockstep
    sts: str = ""  # STS JSON (dspark calibrate); "" = raw confidences
    sps: str = ""  # SPS table JSON (dspark profile-sps), for algorithm1 / async and the simulated clock
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # simulate: R values
    num_prompts: int = 8  # simulate: prompts per benchmark (seeded subset)
    num_requests: int = 0  # simulate: stop after this many finished requests (0 = max(prompts, R))
    cycle: bool = True  # simulate: cycle the prompts so every slot stays busy
    max_new_tokens: int = 128  # simulate
    # simulate: drafting on the SPS clock: a fraction of a verification step (0 = ignored), or
    # "measured" (each step also pays every phase measured in it but the verification; see dspark.scheduling.simulator)
    draft_overhead: float | str = 0.0
    # eval with a policy and simulate: "batched" (one drafter and one target forward per step for every
    # live request, timed on the wall clock too) or "per-request" (each request verified on its own;
    # only the SPS clock speaks for R > 1); dspark.scheduling.batched_serving
    engine: str = "batched"
    out: str = ""  # simulate: "" = <out_dir>/simulate
    # Deprecated spelling of serve.policy (simulate's list), still read with a warning.
    policies: dataclasses.InitVar[list[str] | None] = None

    def __post_init__(self, policies: list[str] | None) -> None:
        if isinstance(self.policy, str):
            self.policy = _list_of_one(self.policy)
        if policies is not None:
            self.policy = _upgraded_policy(self.policy, list(policies), "ServeConfig")


@dataclass
class ProfileConfig:
    """`dspark profile-sps`: the target's verification steps/s at B batch tokens (paper Section 3.2.2)."""

    out: str = ""  # the table JSON ("" = <out_dir>/sps.json); .profile.json and .png go next to it
    batch_tokens: list[int] = field(default_factory=list)  # [] = 1..512, powers of 2
    context_len: int = 512  # tokens already in the KV cache
    tokens_per_request: int = 0  # > 0: B/q rows of q tokens with their own caches
    warmup: int = 2
    repeats: int = 5  # timed forwards per B (the median is kept)


@dataclass
class CalibrateConfig:
    """`dspark calibrate`: Sequential Temperature Scaling fitted on round logs (paper Section 3.2.1)."""

    rounds: list[str] = field(default_factory=list)  # rounds.jsonl files of dspark eval / simulate
    out: str = ""  # the STS JSON ("" = <out_dir>/sts.json); <stem>_reliability.png goes next to it
    fit_fraction: float = 0.5  # share of requests to fit on (the rest is the test part)
    seed: int = 0  # seed of the request split
    bins: int = 20  # ECE bins
    # T_k leaves 1 only with >= min_events accepted and >= min_events rejected prefixes at k, and
    # (folds = K >= 2) when cross-fitted out-of-fold predictions (T fitted without each of K request
    # folds) beat T = 1's in ECE and in Brier score, each beyond its 95 % bootstrap interval
    # (dspark/scheduling/sts.py). 0, 0: the paper's argmin.
    min_events: int = 10
    folds: int = 5


@dataclass
class ProposeConfig:
    """`dspark propose`: a drafter's blocks along the target's greedy continuation of one prompt."""

    prompt: str = "Natalie has 3 boxes with 12 pencils each. She gives away 9 pencils. How many are left?"
    max_new_tokens: int = 48
    num_blocks: int = 3
    temperature: float = 0.0


@dataclass
class Config:
    """One experiment. The defaults are the Qwen3-4B DSpark recipe of paper Section 3.3
    (config/dspark/dspark_qwen3_4b.py spells every field out); other config
    files state only what differs."""

    name: str = "dspark_qwen3_4b_block7"
    out_dir: str = ""  # "" = runs/<name>
    seed: int = 42
    threads: int = 0  # torch CPU threads (0 = torch's choice)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    propose: ProposeConfig = field(default_factory=ProposeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> Path:
        """Where this run writes: `out_dir`, or runs/<name> when it is empty."""
        return Path(self.out_dir or f"runs/{self.name}")

    def path(self, value: str, default: str) -> Path:
        """`value`, or `<run_dir>/<default>` when it is empty (the outputs of a run live together)."""
        return Path(value) if value else self.run_dir / default


def dflash_of(config: Config) -> Config:
    """The DFlash baseline of a DSpark config, as DeepSpec trains it: the same backbone,
    target, data and optimiser; no sequential or confidence head; CE only (paper Section 4.1)."""
    drafter = dataclasses.replace(config.drafter, variant="dflash", markov_rank=0,
                                  enable_confidence_head=False, confidence_head_with_markov=False)
    loss = dataclasses.replace(config.loss, ce_weight=1.0, tv_weight=0.0, conf_weight=0.0)
    name = config.name.replace("dspark", "dflash") if "dspark" in config.name else f"dflash_{config.name}"
    return dataclasses.replace(config, name=name, out_dir=config.out_dir.replace("dspark", "dflash"),
                               drafter=drafter, loss=loss)



def standard_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """The 3 layers standard EAGLE-3 fuses, [1, N/2 − 1, N − 4] in our output-of-layer convention
    (as SpecForge and EAGLE train it)."""
    n = num_target_layers
    if n < 6:
        raise ValueError(f"num_target_layers={n}: standard EAGLE-3 layer ids [1, N/2-1, N-4] need N >= 6")
    return [1, n // 2 - 1, n - 4]


def eagle3_of(config: Config, preset: str = "eagle3_deepspec", num_target_layers: int | None = None) -> Config:
    """The Eagle3 baseline of a DSpark config (paper Section 4.1): the same target, data and optimiser, one
    autoregressive draft layer trained by training-time test over the γ steps it drafts (the paper's
    γ = 7: 7 steps) with step decay 0.8, CE only.

    preset "eagle3_deepspec" keeps the DSpark config's target layers (DeepSpec's variant, the
    paper's baseline); "eagle3" is the standard EAGLE-3 and fuses [1, N/2 − 1, N − 4], for which
    `num_target_layers` (N) is required."""
    if preset not in EAGLE3_PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {EAGLE3_PRESETS}")
    ids = list(config.drafter.target_layer_ids)
    if preset == "eagle3":
        if num_target_layers is None:
            raise ValueError("eagle3_of(config, 'eagle3') needs num_target_layers: the standard preset fuses "
                             "layers [1, N/2-1, N-4] of an N-layer target")
        ids = standard_eagle3_layer_ids(num_target_layers)
    drafter = dataclasses.replace(
        config.drafter, variant="eagle3", eagle3_preset=preset, target_layer_ids=ids, num_draft_layers=1,
        ttt_length=config.drafter.block_size, step_loss_decay=0.8, markov_rank=0, enable_confidence_head=False,
        confidence_head_with_markov=False, layer_family="",
    )
    loss = dataclasses.replace(config.loss, ce_weight=1.0, tv_weight=0.0, conf_weight=0.0)
    name = config.name.replace("dspark", "eagle3") if "dspark" in config.name else f"eagle3_{config.name}"
    return dataclasses.replace(config, name=name, out_dir=config.out_dir.replace("dspark", "eagle3"),
                               drafter=drafter, loss=loss)


# ------------------------------------------------------------------ overrides
def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Apply `key.path=value` strings; returns a new validated Config.

    The value is a Python literal (`[1, 2]`, `3e-4`, `true`, `None`); a string field
    takes the text as it is unless it is quoted."""
    values = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, text = (s.strip() for s in item.split("=", 1))
        values[key] = text
    return set_values(config, values, parse=True)


def set_values(config: Config, values: Mapping[str, Any], *, parse: bool = False) -> Config:
    """A new validated Config with `{key.path: value}` set, each type-checked against its field
    (with `parse`, values are override texts: see `apply_overrides`)."""
    valid = keys_of(config)
    for key, raw in values.items():
        key = _current_key(key)
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(valid)}"
            raise ValueError(f"unknown config key {key!r}{hint}")
        *path, leaf = key.split(".")
        annotation = field_types(get_key(config, ".".join(path)) if path else config)[leaf]
        if parse:
            raw = from_text(raw, annotation)
        if key in _ONE_OR_MORE and isinstance(raw, str):
            raw = _list_of_one(raw)
        config = replace_path(config, key.split("."), coerce(key, raw, annotation))
    validate(config)
    return config


def check_types(config: Config) -> None:
    """Every field of every section holds a value of its annotated type."""
    for key in keys_of(config):
        *path, leaf = key.split(".")
        obj = config
        for part in path:
            obj = getattr(obj, part)
        coerce(key, getattr(obj, leaf), field_types(obj)[leaf])


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """The Config of a Python config file (its `config` object) or of a config.json that a
    run wrote (`Config.to_dict()`), with `key.path=value` overrides; None: the defaults."""
    if path is None:
        config = Config()
    else:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} not found")
        config = config_from_dict(_read_json(path), str(path)) if path.suffix == ".json" else _run_config_file(path)
    check_types(config)
    return apply_overrides(config, list(overrides or []))


def _run_config_file(path: Path) -> Config:
    """Run a Python config file in its own namespace and take its `config` object."""
    config = runpy.run_path(str(path)).get("config")
    if not isinstance(config, Config):
        raise ValueError(
            f"{path} must bind a dspark.config.Config to the name `config` "
            f"(found {type(config).__name__})"
        )
    return config


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON config ({e}); write it with Config.to_dict()") from None


def config_from_dict(data: Any, where: str = "config") -> Config:
    """The inverse of `Config.to_dict()`: every key must be a field (errors name it).

    Deprecated keys (`DEPRECATED_KEYS`) are still read, with a FutureWarning naming the new one."""
    return build_dataclass(Config, data, where, "", upgrades={ServeConfig: _upgraded_serve})


# ------------------------------------------------------------- deprecated keys
# old key -> the key that replaced it (read with a FutureWarning)
DEPRECATED_KEYS = {"serve.policies": "serve.policy"}
_ONE_OR_MORE = {"serve.policy"}  # list fields that also take one string (a list of one)


def _list_of_one(value: str) -> list[str]:
    """One string as a list of one ("" as an empty list)."""
    return [value] if value.strip() else []


def _upgraded_policy(policy: list[str], policies: list[str], where: str) -> list[str]:
    """serve.policy of a config that still holds serve.policies (simulate's list).

    An eval policy that is set wins; else the list, which at its old default is SIMULATE_POLICIES,
    what an empty serve.policy means to simulate."""
    dropped = f"; serve.policies={policies} is dropped for serve.policy={policy}" if policy and \
        policies != SIMULATE_POLICIES else ""
    warnings.warn(f"{where}: serve.policies is deprecated; serve.policy holds the policies now "
                  f"(a list: --policy A B, serve.policy=['A', 'B']){dropped}", FutureWarning, stacklevel=3)
    if policy:
        return list(policy)
    return [] if policies == SIMULATE_POLICIES else list(policies)


def _upgraded_serve(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The `serve` section of a config.json with its deprecated keys in their new form."""
    data = dict(data)
    if isinstance(data.get("policy"), str):
        data["policy"] = _list_of_one(data["policy"])
    if "policies" in data:
        policies = data.pop("policies")
        if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
            raise ValueError(f"{where}: serve.policies (now serve.policy) expects a list of strings, got {policies!r}")
        current = data.get("policy", [])
        merged = _upgraded_policy(current if isinstance(current, list) else [], policies, where)
        data["policy"] = merged if isinstance(current, list) else current  # a bad policy: _build names it
    return data


def _current_key(key: str) -> str:
    """`key`, or the key that replaced a deprecated one (with a FutureWarning naming it)."""
    new = DEPRECATED_KEYS.get(key)
    if new is None:
        return key
    warnings.warn(f"config key {key} is deprecated; use {new}", FutureWarning, stacklevel=3)
    return new
