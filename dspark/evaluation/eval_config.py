"""``dspark eval`` from a ``dspark.config.Config``: the checks it makes before any model is loaded
and the ``evaluate`` call it makes.

- ``evaluate_from_config``  every setting of ``evaluate`` from ``config.eval`` and ``config.serve``; the
                            config is stored in the report and, as config.json, next to it.
- ``check_eval_inputs``     the benchmark files, the policy and the drafter folder, read before loading.
- ``check_config_folder``   refuses an output folder of another config, then writes config.json.
- ``resolve_batch_size``    ``eval.batch_size`` as ``evaluate`` takes it (an int, or "auto": measured).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark.evaluation.evaluate import DecodeSettings, PathLike, ServeSettings, dist_info, evaluate
from dspark.io.atomic import atomic_write_text


def evaluate_from_config(target: Any, drafter: Any, config: Any, **overrides: Any) -> dict[str, Any]:
    """``evaluate`` as ``dspark eval`` runs it: every setting from a ``dspark.config.Config``.

    Reads ``config.eval`` (prompts, decoding, baseline, label, out) and ``config.serve``
    (policy, concurrency, STS, SPS), stores the whole config in the report and, next to
    it, as ``config.json``, so that ``dspark eval --config <out>/config.json`` runs the
    same evaluation again. Keyword arguments override any of ``evaluate``'s."""
    e, s = config.eval, config.serve
    if len(s.policy) > 1:
        return _evaluate_policies(target, drafter, config, **overrides)
    policy = s.policy[0] if s.policy else None
    if policy is None and s.concurrency != 1:
        raise ValueError("serve.concurrency needs serve.policy (--concurrency needs --policy POLICY, e.g. --policy "
                         "algorithm1); to decode requests together without a policy use eval.batch_size "
                         "(--batch-size R)")
    options = _options(config, policy, out_dir=config.path(e.out, "eval"), run_config=config,
                       batch_size=resolve_batch_size(e.batch_size))
    options.update(overrides)
    if options["out_dir"] is not None and dist_info()[0] == 0 and options.get("resume") is not False:
        check_config_folder(options["out_dir"], config, resume=options.get("resume"))
    return evaluate(target, drafter, **options)


def _options(config: Any, policy: str | None, **more: Any) -> dict[str, Any]:
    """The keywords ``evaluate`` and ``evaluate_policies`` share, from ``config.eval`` and ``config.serve``
    (``policy``: the serving loop's, None: verify all γ drafts), plus ``more``: the benchmark files of
    eval.data_dir and eval.benchmarks, or the built-in evaluation prompts."""
    e, s = config.eval, config.serve
    benchmarks: Any = e.data_dir
    names: list[str] | None = list(e.benchmarks)
    if e.builtin_prompts:
        from dspark.data.prompts import builtin_eval_sets

        benchmarks, names = builtin_eval_sets(), None
    return dict(
        benchmarks=benchmarks, names=names, num_samples=e.num_samples or None, split=e.split,
        decoding=DecodeSettings(max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=e.seed),
        serving=ServeSettings(policy=policy, sps=(s.sps or None) if policy else None, concurrency=s.concurrency,
                              sts_temperatures=s.sts or None, engine=s.engine),
        baseline=e.baseline, label=e.label or None, **more)


def _evaluate_policies(target: Any, drafter: Any, config: Any, **overrides: Any) -> dict[str, dict[str, Any]]:
    """``dspark eval`` with several policies in serve.policy: ``evaluate_policies`` (every policy on the
    same requests, one target-only decode per benchmark), policy P in ``<eval.out>/<P>-R<R>``
    (``policy_folder``), whose config.json is this config with serve.policy = [P], eval.out that
    folder and eval.label the report's label, so that ``dspark eval --config <folder>/config.json``
    reruns that policy alone. Returns {policy: report}."""
    from dspark.config import set_values
    from dspark.evaluation.evaluate import evaluate_policies, policy_folder

    e, s = config.eval, config.serve
    out = config.path(e.out, "eval")
    resume = overrides.pop("resume", None)
    singles = [set_values(config, {"serve.policy": [p], "eval.out": str(out / policy_folder(p, s.concurrency)),
                                   "eval.label": p if not e.label else f"{e.label} {p}"}) for p in s.policy]
    if dist_info()[0] == 0:
        for single in singles:
            check_config_folder(single.path(single.eval.out, "eval"), single, resume=resume)
    options = _options(config, s.policy[0], out_dir=out, run_configs=singles, resume=resume)
    options.update(overrides)
    return evaluate_policies(target, drafter, options.pop("benchmarks"), list(s.policy), **options)


def resolve_batch_size(value: int | str) -> int | str:
    """``eval.batch_size`` as ``evaluate`` takes it: an int as given, "auto" as is (measured on the device
    once the prompts are known: ``dspark.scheduling.batch_size.measured_batch_size``)."""
    return value if value == "auto" else int(value)


def check_eval_inputs(config: Any) -> None:
    """Before any model is loaded: every line of the benchmark files (JSON with "turns"; an error
    names the file and line), the policy, and the drafter folder of ``eval.draft`` (its
    config.json exists, parses and is a layout ``dspark.modeling.load_drafter`` reads)."""
    from dspark.data.benchmarks import load_benchmark_prompts
    from dspark.modeling.formats import detect_format, locate_drafter, read_json

    e = config.eval
    _distinct_policies(config.serve.policy)
    if not e.builtin_prompts:
        load_benchmark_prompts(e.data_dir, list(e.benchmarks), e.num_samples or None, e.seed, e.split)
    if e.draft:
        folder, _ = locate_drafter(e.draft)
        d = read_json(folder / "config.json")
        if detect_format(d) is None:
            raise ValueError(f"eval.draft={e.draft!r}: {folder / 'config.json'} has architectures "
                             f"{d.get('architectures')!r}, no drafter layout dspark reads; pass a drafter folder "
                             "(ours, DeepSpec's or z-lab's) or a training run folder")


def check_config_folder(out_dir: PathLike, config: Any, resume: bool | None = None) -> None:
    """Before any model is loaded: refuse an output folder whose config.json holds another
    config (naming the fields), unless ``resume`` is False (start over); then write config.json,
    so that ``dspark eval --config <out>/config.json`` runs the same evaluation again."""
    from dspark.evaluation.journal import IGNORED, check_settings, clear_outputs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if resume is False:
        clear_outputs(out, extra=("config.json",))
    ignore = [key.removeprefix("run.") for key in IGNORED if key.startswith("run.")]
    if not check_settings(out, config.to_dict(), "config.json", ignore) and resume is True:
        raise FileNotFoundError(f"--resume: {out / 'config.json'} not found, so {out} holds no evaluation "
                                "to resume; drop --resume to start one")
    atomic_write_text(out / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")


def _distinct_policies(policies: Sequence[str]) -> None:
    """serve.policy for ``dspark eval``: none (verify all γ drafts), one, or several distinct policies
    (evaluated together on the same requests: ``evaluate_policies``)."""
    seen = [p.strip() for p in policies]
    twice = sorted({p for p in seen if seen.count(p) > 1})
    if twice:
        raise ValueError(f"serve.policy={list(policies)} names {twice} more than once; name each policy once")
