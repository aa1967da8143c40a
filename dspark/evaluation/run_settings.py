"""``report["config"]`` of an evaluation: what was evaluated, and how (``run_settings``), and the names
the report gives a policy (``policy_label``) and γ read back from round rows (``infer_gamma``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.data.prompts import Conversation
from dspark.evaluation.eval_plain import EvalState, decode_fn_name
from dspark.scheduling.policies import policy_name

__all__ = ["infer_gamma", "policy_label", "run_settings"]


def run_settings(state: EvalState, gamma: int, files: Mapping[str, Path | list[Conversation]],
                  counts: Mapping[str, int | None], split: str, run_config: Any) -> dict[str, Any]:
    """``report["config"]``: what was evaluated, and how."""
    d, s = state.decoding, state.serving
    return {
        "target": _target_name(state.target),
        "dtype": str(getattr(state.target, "dtype", "unknown")).removeprefix("torch."),
        "drafter": _drafter_summary(state.drafter),
        "benchmarks": {n: str(p) if isinstance(p, Path) else f"<{len(p)} prompts in memory>"
                       for n, p in files.items()},
        "num_samples": dict(counts),
        "split": split,  # which prompts of each benchmark: all, dev or test (dspark.data.benchmarks)
        "max_new_tokens": d.max_new_tokens,
        "temperature": float(d.temperature),
        "seed": d.seed,
        "gamma": gamma,
        "baseline": state.baseline,
        "batch_size": state.batch_size,  # requests per forward (speeds are those at this R; τ does not depend on it)
        # "auto": R -> round throughput (rows / s of R rows × (1 + γ) tokens) measured to choose it
        "batch_size_auto": state.batch_size_auto,
        # the report's name for the verification-length policy (report.md prints it as "scheduler = ...")
        "scheduler": None if s.policy is None else f"{policy_label(s.policy)} (serving loop, R = {s.concurrency})",
        "concurrency": s.concurrency if s.policy is not None else None,
        "engine": s.engine if s.policy is not None else None,  # the serving loop's (dspark.scheduling.batched_serving)
        "sps": None if s.sps is None else s.sps.to_dict(),
        "sts_temperatures": None if s.sts_temperatures is None else [float(t) for t in s.sts_temperatures],
        "eos_token_ids": list(d.eos_token_ids or ()),
        "world_size": state.world,
        "decode_fn": decode_fn_name(),
        "run": _plain_config(run_config),
    }


def policy_label(policy: Any) -> str:
    """A policy's name in the report: a spec as given, a Policy's ``name``, a function's ``__name__``
    (``dspark.scheduling.policies.policy_name``)."""
    if isinstance(policy, str):
        return policy
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else policy_name(policy)


def infer_gamma(rounds: list[dict[str, Any]]) -> int:
    widths = [len(r["confidences"]) for r in rounds if r["confidences"] is not None]
    widths += [r["proposed"] for r in rounds]
    return max(widths + [1])


def _plain_config(run_config: Any) -> dict[str, Any] | None:
    if run_config is None:
        return None
    if dataclasses.is_dataclass(run_config) and not isinstance(run_config, type):
        return dataclasses.asdict(run_config)
    return dict(run_config)


def _target_name(target: Any) -> str | None:
    config = getattr(getattr(target, "model", None), "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "model_type", None)
    return str(name) if name else None


def _drafter_summary(drafter: Any) -> dict[str, Any] | None:
    config = getattr(drafter, "config", None)
    if config is None:
        return None
    fields = ("variant", "block_size", "num_draft_layers", "markov_rank", "markov_head_type",
              "enable_confidence_head", "target_layer_ids", "mask_token_id")
    return {f: getattr(config, f) for f in fields if hasattr(config, f)}
