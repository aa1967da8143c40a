"""The evaluation recipe: accepted length, acceptance and confidence quality on the nine benchmarks.

``evaluate`` decodes a seeded subset of every benchmark file, or of its dev or test part (``split``:
``dspark.data.benchmarks.split_prompts``; first user turn, chat template with thinking off), optionally
also with the target alone for the wall-clock speedup, and returns the report
(``dspark.evaluation.report.build_report``); with ``out_dir`` it also writes rounds.jsonl (the log STS and
the policies are fitted on offline), requests.jsonl, report.json, report.md and plots
(``dspark.evaluation.report.write_outputs``). ``DecodeSettings`` and ``ServeSettings``, shared with the
serving simulator, say how. Without a policy every round verifies all γ drafts
(``dspark.evaluation.eval_plain``); with one the requests run through the serving loop
(``dspark.evaluation.eval_scheduled``); ``dspark eval`` runs it from a config (``dspark.evaluation.eval_config``).

Under ``torchrun`` every rank decodes prompts ``rank::world`` of each benchmark and returns the same
report; rank 0 writes the files. A killed evaluation loses nothing: a rerun on its folder decodes only
the requests not yet done (``dspark.evaluation.journal``; ``resume`` says when).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from dspark.choices import VARIANT_NAMES
from dspark.data.benchmarks import load_prompts, resolve_benchmarks, samples_per_benchmark
from dspark.data.prompts import Conversation
from dspark.evaluation.eval_plain import EvalState, batched_benchmarks, plain_benchmark
from dspark.evaluation.eval_scheduled import scheduled_benchmark, scheduled_benchmarks
from dspark.evaluation.journal import SETTINGS, Done, EvalJournal
from dspark.evaluation.report import build_report, write_outputs
from dspark.evaluation.run_settings import infer_gamma, policy_label, run_settings
from dspark.evaluation.scheduled_report import scheduled_summary
from dspark.scheduling.calibration import as_temperatures
from dspark.scheduling.simulator import DecodeSettings, ServeSettings, make_policy, sps_table

PathLike = Union[str, os.PathLike]

# New tokens of the untimed warm-up decode before the first timed request (kernel selection,
# allocator, lazy imports); 0: no warm-up. Read when an evaluation starts: a seam that tests replace.
WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------
# Inputs (the benchmark prompts: dspark.data.benchmarks)
# ---------------------------------------------------------------------------


def default_eos_ids(target: Any, tokenizer: Any) -> list[int]:
    """The ids that end a request by default: the chat template's end-of-turn token,
    the tokenizer's and the model's EOS ids."""
    from dspark.data.generate import end_of_turn_token_ids

    ids = set(end_of_turn_token_ids(tokenizer))
    model_eos = getattr(getattr(getattr(target, "model", None), "generation_config", None), "eos_token_id", None)
    if model_eos is not None:
        ids.update(model_eos if isinstance(model_eos, list) else [model_eos])
    return sorted(int(i) for i in ids)


def drafter_gamma(drafter: Any) -> int | None:
    """γ, the drafter's block size (draft tokens per round), or None when its config does not say."""
    gamma = getattr(getattr(drafter, "config", None), "block_size", None)
    return int(gamma) if gamma is not None else None


def _default_label(drafter: Any) -> str:
    variant = getattr(getattr(drafter, "config", None), "variant", None)
    return VARIANT_NAMES.get(variant, str(variant)) if variant else "drafter"


def dist_info() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside ``torchrun``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------


def evaluate(
    target: Any,
    drafter: Any,
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    *,
    decoding: DecodeSettings = DecodeSettings(),
    serving: ServeSettings = ServeSettings(),
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    split: str = "all",
    baseline: bool = True,
    tokenizer: Any = None,
    label: str | None = None,
    out_dir: PathLike | None = None,
    run_config: Any = None,
    progress: bool = True,
    resume: bool | None = None,
    batch_size: int | str = 1,
) -> dict[str, Any]:
    """Evaluate a drafter on the benchmarks; returns the report (see the module docstring).

    Args:
        target, drafter: the models (``speculative_generate`` / ``target_generate`` take them).
        benchmarks: ``{name: path}`` or a folder of ``<name>.jsonl`` files (``names``
            selects; default the nine). Missing files are skipped with a warning.
            A value may also be a list of conversations (e.g. the built-in prompts).
        decoding: max_new_tokens, temperature (the protocol: T = 1), the seed of the
            prompt subsets and of every request's generator, the EOS ids (default:
            end-of-turn and EOS ids of the tokenizer and model).
        serving: the verification-length policy (None: verify all γ drafts), its SPS
            table, the requests decoded in lockstep, and the STS temperatures (the
            report then also holds the calibrated confidence quality).
        num_samples: requests per benchmark (see ``samples_per_benchmark``);
            each is a seeded subset (``load_eval_benchmark(path, n, seed, split)``).
        split: which prompts of each benchmark: "all" (DeepSpec's subsets), "dev" (tuning)
            or "test" (reported results); ``dspark.data.benchmarks.split_prompts``.
        baseline: also decode every prompt with the target alone, for the speedup.
        tokenizer: chat template and tokenizer (default ``target.tokenizer``).
        label: the row name in Table 1 (default from the drafter's variant).
        out_dir: where to write the files (rank 0 only); None writes nothing.
        run_config: extra settings to store under ``report["config"]["run"]`` (a
            mapping or a dataclass such as ``dspark.config.Config``).
        progress: progress bars (rank 0).
        resume: with ``out_dir``: None (default) continues a folder that holds results of the
            same settings and starts an empty one; True requires results to continue; False
            starts over, deleting the folder's evaluation files. A folder of other settings is
            refused (``dspark.evaluation.journal.SettingsMismatch`` names the fields).
        batch_size: without a policy, the requests decoded together (R rows, one drafter and one
            target forward per round for all, rows refilled as requests finish; the target-only
            baseline at the same R). Every request decodes the tokens it decodes alone, so
            rounds.jsonl and τ do not depend on it; tokens/s and the speedup are those at R.
            "auto": measured on the device before decoding
            (``dspark.scheduling.batch_size.measured_batch_size``; report["config"]["batch_size_auto"]
            holds the round throughput measured at each R tried); a resumed folder keeps the R it
            started with.
    """
    state = _open_evaluation(target, drafter, tokenizer, decoding, serving, baseline, progress)
    _check_batch_size(batch_size)
    files, skipped = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    started = time.perf_counter()
    prompts = {name: load_prompts(source, counts[name], state.decoding.seed, split) for name, source in files.items()}
    _set_batch_size(state, batch_size, prompts, out_dir, resume)
    settings = _settings(state, label or _default_label(drafter), files, counts, split, skipped, run_config)
    journal, done = None, Done()
    if out_dir is not None:
        journal, done = EvalJournal.open(out_dir, settings, resume=resume, rank=state.rank, world=state.world,
                                         barrier=_barrier if state.world > 1 else None)
    records, rounds, served = _decode_benchmarks(state, prompts, journal, done)
    report = report_from_rows(settings, records, rounds, served, list(prompts))
    report["timings"]["wall_s"] = time.perf_counter() - started
    if journal is not None and state.rank == 0:
        write_outputs(out_dir, report, records, rounds, temperatures=state.temps)
        journal.finish(records, rounds, served)
    return report


def evaluate_policies(
    target: Any,
    drafter: Any,
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    policies: Sequence[Any],
    *,
    decoding: DecodeSettings = DecodeSettings(),
    serving: ServeSettings = ServeSettings(),
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    split: str = "all",
    baseline: bool = True,
    tokenizer: Any = None,
    label: str | None = None,
    out_dir: PathLike | None = None,
    run_configs: Sequence[Any] | None = None,
    progress: bool = True,
    resume: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """Several verification-length policies evaluated on the same requests in one process; returns
    {policy name: report}, each the report ``evaluate`` gives with ``serving.policy`` set to it.

    Per benchmark, every policy serves the benchmark's requests in turn (each prefilling the prompts
    itself, as in its own evaluation), then target-only decoding of those requests runs once and is
    every policy's baseline (``dspark.evaluation.eval_scheduled.scheduled_benchmarks``). Each policy's
    speed is thus measured against target-only decoding of the same requests made within the same
    minute, as in its own evaluation, and the policies' decodes of one benchmark lie seconds apart, so
    comparisons between policies carry little of the machine's drift; the target-only decodes that
    separate evaluations would repeat run once. With ``out_dir``, policy P writes
    ``out_dir/policy_folder(P, serving.concurrency)``: the files of ``evaluate`` (journal, resume and
    settings per folder; a folder of a finished policy is read back). ``run_configs``: one per policy
    (``report["config"]["run"]``). ``label``: a prefix of each report's label (default: the policy's
    name alone). ``serving``: what every policy shares (R, SPS table, STS temperatures, engine); its own
    policy, if any, is replaced by each of ``policies``. Other arguments as ``evaluate``."""
    if not policies:
        raise ValueError("policies is empty: name at least one verification-length policy (e.g. ['algorithm1'])")
    labels = [policy_label(p).strip() for p in policies]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policies {labels} name a policy twice; give each once")
    if run_configs is not None and len(run_configs) != len(policies):
        raise ValueError(f"run_configs holds {len(run_configs)} configs for {len(policies)} policies; give one each")
    states = [_open_evaluation(target, drafter, tokenizer, decoding, dataclasses.replace(serving, policy=p),
                               baseline, progress) for p in policies]
    files, skipped = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    started = time.perf_counter()
    prompts = {name: load_prompts(source, counts[name], states[0].decoding.seed, split)
               for name, source in files.items()}
    folders = [None if out_dir is None else Path(out_dir) / policy_folder(p, serving.concurrency) for p in labels]
    journals, dones, settings = [], [], []
    for k, state in enumerate(states):
        state.batch_size = 1
        name = labels[k] if not label else f"{label} {labels[k]}"
        settings.append(_settings(state, name, files, counts, split, skipped,
                                  None if run_configs is None else run_configs[k]))
        journal, done = None, Done()
        if folders[k] is not None:
            journal, done = EvalJournal.open(folders[k], settings[k], resume=resume, rank=state.rank,
                                             world=state.world, barrier=_barrier if state.world > 1 else None)
        journals.append(journal)
        dones.append(done)
    rows: list[tuple[list, list, dict]] = [([], [], {}) for _ in states]
    for name, conversations in prompts.items():
        for k, (records, rounds, summary) in enumerate(
                scheduled_benchmarks(states, name, conversations, journals, dones)):
            rows[k][0].extend(records)
            rows[k][1].extend(rounds)
            rows[k][2][(name, states[k].rank)] = summary
    reports = {}
    for k, state in enumerate(states):
        records, rounds, served = rows[k]
        if state.world > 1:
            records, rounds, served = _gather(records, rounds, served, state.world)
        report = report_from_rows(settings[k], records, rounds, served, list(prompts))
        report["timings"]["wall_s"] = time.perf_counter() - started  # the whole run, every policy's decodes
        if journals[k] is not None and state.rank == 0:
            write_outputs(folders[k], report, records, rounds, temperatures=state.temps)
            journals[k].finish(records, rounds, served)
        reports[labels[k]] = report
    return reports


def policy_folder(policy: Any, concurrency: int) -> str:
    """The folder name of a policy's evaluation at R = ``concurrency`` among several
    (``evaluate_policies``): ``<policy>-R<R>``, characters other than letters, digits and ``._+-``
    replaced by ``_`` (a ``module:function`` spec)."""
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", policy_label(policy).strip()).strip(".") or "policy"
    return f"{name}-R{int(concurrency)}"


def _settings(state: EvalState, label: str, files: Mapping[str, Path | list[Conversation]],
              counts: Mapping[str, int | None], split: str, skipped: Sequence[str],
              run_config: Any) -> dict[str, Any]:
    """What settings.json holds: everything ``report_from_rows`` needs besides the rows."""
    s, gamma = state.serving, drafter_gamma(state.drafter)
    return {"label": label, "gamma": gamma, "config": run_settings(state, gamma, files, counts, split, run_config),
            "skipped": list(skipped), "temperatures": None if state.temps is None else state.temps.tolist(),
            "policy": None if s.policy is None else policy_label(s.policy),
            "sps_step_s": None if s.sps is None else 1.0 / float(s.sps(1))}


def report_from_rows(settings: Mapping[str, Any], records: Sequence[dict[str, Any]],
                     rounds: Sequence[dict[str, Any]], served: Mapping[tuple[str, int], Any],
                     order: Sequence[str]) -> dict[str, Any]:
    """The report of an evaluation from its settings (settings.json) and its rows, sorted in place
    into evaluation order (``order``: the benchmarks; then request, round). ``served``:
    (benchmark, rank) -> the serving summary of a scheduled evaluation."""
    rank_of = {name: i for i, name in enumerate(order)}
    records.sort(key=lambda r: (rank_of.get(r["benchmark"], len(rank_of)), r["benchmark"], r["request"]))
    rounds.sort(key=lambda r: (rank_of.get(r["benchmark"], len(rank_of)), r["benchmark"], r["request"], r["round"]))
    gamma = settings["gamma"] or infer_gamma(rounds)
    temps = None if settings["temperatures"] is None else np.asarray(settings["temperatures"], dtype=np.float64)
    config = {**settings["config"], "gamma": gamma}
    report = build_report(records, rounds, gamma=gamma, label=settings["label"], config=config,
                          skipped=settings["skipped"], temperatures=temps)
    if settings["policy"] is not None:
        # per benchmark on rank 0: simulated Θ, τ, mean ℓ (dspark.scheduling.simulator)
        report["serving"] = {b: served[(b, 0)] for b in sorted({b for b, _ in served}, key=rank_of.get)
                             if (b, 0) in served}
        report["scheduled"] = scheduled_summary(  # speed vs target-only, mean ℓ, draft cost in target steps
            records, rounds, report["all"], policy=settings["policy"], concurrency=config["concurrency"],
            sps_step_s=settings["sps_step_s"])
    return report


def report_from_folder(folder: str | os.PathLike) -> tuple[dict[str, Any], list, list]:
    """The report of an evaluation folder rebuilt from settings.json and the journals, without
    decoding; returns (report, records, rounds) in evaluation order (write them with
    ``dspark.evaluation.report.write_outputs``). Timings are those the records hold."""
    folder = Path(folder)
    path = folder / SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a `dspark eval` output folder "
                                "(it holds settings.json, requests.jsonl and rounds.jsonl)")
    settings = json.loads(path.read_text(encoding="utf-8"))
    scheduled = settings.get("config", {}).get("scheduler") is not None
    done = EvalJournal(folder, 0, 1, scheduled).read()
    order = list(settings.get("config", {}).get("benchmarks") or [])
    records, rounds = list(done.records.values()), [r for rows in done.rounds.values() for r in rows]
    return report_from_rows(settings, records, rounds, done.served, order), records, rounds


def _open_evaluation(target: Any, drafter: Any, tokenizer: Any, decoding: DecodeSettings, serving: ServeSettings,
                     baseline: bool, progress: bool) -> EvalState:
    """The settings resolved against the models: EOS ids, the SPS table, the STS temperatures
    (checked against γ), the policy spec (a bad one fails before any decoding)."""
    tokenizer = _tokenizer_of(target, tokenizer)
    eos = decoding.eos_token_ids
    eos = sorted(eos) if eos is not None else default_eos_ids(target, tokenizer)
    decoding = dataclasses.replace(decoding, eos_token_ids=tuple(eos))
    sps = sps_table(serving.sps)
    temps = serving.sts_temperatures
    if temps is not None:
        temps = as_temperatures(temps, drafter_gamma(drafter), "ServeSettings.sts_temperatures")
    serving = dataclasses.replace(serving, sps=sps, sts_temperatures=temps)
    if serving.policy is not None:
        make_policy(serving.policy, sps)
    rank, world = dist_info()
    return EvalState(target, drafter, tokenizer, decoding, serving, baseline, rank, world,
                     progress=progress and rank == 0, warm=WARMUP_TOKENS == 0, warmup_tokens=WARMUP_TOKENS)


def _tokenizer_of(target: Any, tokenizer: Any) -> Any:
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "the target has no tokenizer (target.tokenizer is None) and none was passed; "
            "pass tokenizer=... or load the target from a folder with tokenizer files"
        )
    return tokenizer


def _decode_benchmarks(
    state: EvalState, prompts: Mapping[str, list[Conversation]], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[tuple[str, int], Any]]:
    """Every benchmark's requests of this rank (those ``done`` holds are read, not decoded), gathered
    from all ranks: (records, rounds, (benchmark, rank) -> the serving summary of a scheduled one)."""
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    served: dict[tuple[str, int], Any] = {}
    if state.serving.policy is None and state.batch_size > 1:
        records, rounds = batched_benchmarks(state, prompts, journal, done)
        if state.world > 1:
            records, rounds, served = _gather(records, rounds, served, state.world)
        return records, rounds, served
    for name, conversations in prompts.items():
        if state.serving.policy is not None:
            bench_records, bench_rounds, served[(name, state.rank)] = scheduled_benchmark(
                state, name, conversations, journal, done)
        else:
            bench_records, bench_rounds = plain_benchmark(state, name, conversations, journal, done)
        records += bench_records
        rounds += bench_rounds
    if state.world > 1:
        records, rounds, served = _gather(records, rounds, served, state.world)
    return records, rounds, served


def _check_batch_size(batch_size: Any) -> None:
    if batch_size != "auto" and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 (requests decoded together) or 'auto', got {batch_size!r}")


def _set_batch_size(state: EvalState, batch_size: int | str, prompts: Mapping[str, list[Conversation]],
                    out_dir: PathLike | None, resume: bool | None) -> None:
    """``state.batch_size``: 1 under a policy (the serving loop sets its own R), else as given or "auto"."""
    if state.serving.policy is not None:
        state.batch_size = 1
    elif batch_size == "auto":
        state.batch_size, state.batch_size_auto = _auto_batch_size(state, prompts, out_dir, resume)
    else:
        state.batch_size = int(batch_size)


def _auto_batch_size(state: EvalState, prompts: Mapping[str, list[Conversation]], out_dir: PathLike | None,
                     resume: bool | None) -> tuple[int, dict[str, float]]:
    """``batch_size="auto"``: the R recorded in ``out_dir``'s settings when the run continues one, else
    ``measured_batch_size`` on every prompt's rendered length (rank 0 measures, the others take its R).
    Returns (R, {str(R): round throughput measured})."""
    if out_dir is not None and resume is not False:
        recorded = _recorded_batch_size(Path(out_dir))
        if recorded is not None:
            return recorded
    from dspark.data.render import render_prompt
    from dspark.scheduling.batch_size import measured_batch_size

    chosen: list[Any] = [None]
    if state.rank == 0:
        lengths = [len(render_prompt(state.tokenizer, c, enable_thinking=False)) for convs in prompts.values()
                   for c in convs]
        rows, measured = measured_batch_size(state.target, lengths, drafter_gamma(state.drafter) or 1,
                                             state.decoding.max_new_tokens, seed=state.decoding.seed)
        chosen[0] = (rows, {str(r): v for r, v in sorted(measured.items())})
    if state.world > 1:
        torch.distributed.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _recorded_batch_size(folder: Path) -> tuple[int, dict[str, float]] | None:
    """(R, its measurements) of an automatic batch size in ``folder/settings.json``, or None."""
    try:
        config = json.loads((folder / SETTINGS).read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rows, measured = config.get("batch_size"), config.get("batch_size_auto")
    if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1 and isinstance(measured, dict):
        return rows, measured
    return None


def _gather(records: list, rounds: list, served: dict, world: int) -> tuple[list, list, dict]:
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, (records, rounds, served))
    all_records = [r for part in gathered for r in part[0]]
    all_rounds = [r for part in gathered for r in part[1]]
    all_served = {k: v for part in gathered for k, v in part[2].items()}
    return all_records, all_rounds, all_served


def _barrier() -> None:
    torch.distributed.barrier()


__all__ = [
    "DecodeSettings",
    "ServeSettings",
    "default_eos_ids",
    "evaluate",
    "evaluate_policies",
    "policy_folder",
    "report_from_folder",
    "report_from_rows",
]
