"""The checks of an experiment config (dspark.config.Config) that run before any heavy work:
choices (dspark.choices), ranges, and the few fields written as small languages
(`data.train_prompts`, `drafter.init_from_target`)."""

from __future__ import annotations

from typing import Any

from dspark.choices import CHOICES, NON_NEGATIVE, POSITIVE, choices_of
from dspark.config_fields import get_key


def split_train_prompts(spec: str) -> tuple[str, int]:
    """data.train_prompts as (source, number of self-written prompts): "builtin+self:N" ->
    ("builtin", N), "self:N" -> ("", N), a source without "+self:N" -> (source, 0)."""
    source, plus, last = spec.rpartition("+")
    if last != "self" and not last.startswith("self:"):
        return spec, 0
    count = last[len("self:"):]
    problem = ""
    if not count.isdigit() or int(count) < 1:
        problem = f"the number of self-written prompts must be an integer >= 1, got {count!r}"
    elif plus and not source or "+self" in source:
        problem = "'+self:N' must follow one source ('builtin', a .jsonl path or 'hub:<dataset>')"
    if problem:
        raise ValueError(
            f"data.train_prompts={spec!r}: {problem}; write '<source>+self:N' (e.g. 'builtin+self:2000', the "
            "built-in prompts plus N the target writes itself) or 'self:N' (only self-written ones)"
        )
    return source, int(count)


def init_from_target_choice(value: str) -> str | list[int]:
    """`drafter.init_from_target` read: "" (random init), "last", "spread", or the target decoder layer
    ids of "10,20" (or "[10, 20]"), one per draft layer in draft-layer order."""
    text = value.strip()
    if text in ("", "last", "spread"):
        return text
    parts = [p.strip() for p in text.strip("[]").split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"drafter.init_from_target={value!r}; use '' (random init), 'last', 'spread' or "
                         "target decoder layer ids such as '10,20' (one per draft layer)")
    return [int(p) for p in parts]


def validate(config: Any) -> None:
    """Every value of a Config within its allowed range; a ValueError names the key and the fix."""
    for key in CHOICES:
        value, choices = get_key(config, key), choices_of(key)
        if value not in choices:
            hint = " (or register one: dspark.registry, docs/extending.md)" if CHOICES[key] == "heads" else ""
            raise ValueError(f"{key}={value!r} is not one of {choices}{hint}")
    for key in POSITIVE:
        value = get_key(config, key)
        if value <= 0:
            raise ValueError(f"{key} must be > 0, got {value}")
    for key in NON_NEGATIVE:
        value = get_key(config, key)
        if value < 0:
            raise ValueError(f"{key} must be >= 0, got {value}")
    rows = config.eval.batch_size
    if rows != "auto" and (isinstance(rows, str) or rows < 1):
        raise ValueError(f"eval.batch_size={rows!r} must be an integer >= 1 (requests decoded together) or 'auto' "
                         "(the largest R that still pays, measured on the device)")
    overhead = config.serve.draft_overhead
    if isinstance(overhead, str) and overhead != "measured" or not isinstance(overhead, str) and overhead < 0:
        raise ValueError(f"serve.draft_overhead={overhead!r} must be a number >= 0 (a fraction of the step) "
                         "or 'measured' (the drafting time measured in each step)")
    if any(not p.strip() for p in config.serve.policy):
        raise ValueError(f"serve.policy={config.serve.policy} holds an empty policy name; "
                         "name each policy (e.g. algorithm1) or leave the list empty")
    for key in ("serve.concurrencies", "profile.batch_tokens"):
        if any(v < 1 for v in get_key(config, key)):
            raise ValueError(f"{key} must hold integers >= 1, got {get_key(config, key)}")
    if not config.target.device.startswith(("auto", "cpu", "cuda")):
        raise ValueError(f"target.device={config.target.device!r}; use auto, cpu, cuda or cuda:N")
    ids = config.drafter.target_layer_ids
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
        raise ValueError(
            f"drafter.target_layer_ids={ids} must be non-empty, strictly increasing, each >= -1 "
            "(-1 = embedding output, i = output of decoder layer i)"
        )
    if not 0 < config.drafter.step_loss_decay <= 1:
        raise ValueError(f"drafter.step_loss_decay must lie in (0, 1], got {config.drafter.step_loss_decay}")
    layers = init_from_target_choice(config.drafter.init_from_target)
    if isinstance(layers, list) and len(layers) != config.drafter.num_draft_layers:
        raise ValueError(f"drafter.init_from_target={config.drafter.init_from_target!r} names {len(layers)} "
                         f"target layers for drafter.num_draft_layers={config.drafter.num_draft_layers}: "
                         "give one per draft layer")
    if config.train.global_batch_size % config.train.micro_batch_size:
        raise ValueError(
            f"train.global_batch_size={config.train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={config.train.micro_batch_size}"
        )
    if config.calibrate.folds == 1:
        raise ValueError("calibrate.folds=1 has no held-out fold: use 0 (no check) or K >= 2")
    split_train_prompts(config.data.train_prompts)
    for key in ("data.holdout_fraction", "calibrate.fit_fraction"):
        if not 0 <= get_key(config, key) < 1:
            raise ValueError(f"{key} must be in [0, 1), got {get_key(config, key)}")
