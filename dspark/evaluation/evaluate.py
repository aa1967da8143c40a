"""The evaluation recipe: accepted length, acceptance and confidence quality on the nine benchmarks.

``evaluate`` runs speculative decoding on a seeded subset of every benchmark
file, or of its dev or test part (``split``: ``dspark.data.benchmarks.split_prompts``;
first user turn, chat template with thinking off), optionally the
target alone on the same prompts for the wall-clock speedup, and returns a
report (``dspark.evaluation.report.build_report``); with ``out_dir`` it also writes
rounds.jsonl (one line per draft/verify round: the log that STS and the
policies are fitted on offline), requests.jsonl, report.json, report.md and
plots (``dspark.evaluation.report.write_outputs`` describes them).
``dspark.evaluation.report.compare_reports`` puts several reports side by side as Table 1.

Two settings objects, shared with the serving simulator, say how:
``DecodeSettings`` (max_new_tokens, temperature, seed, EOS ids) and
``ServeSettings`` (policy, SPS table, concurrency, STS temperatures).

Without a policy (``ServeSettings.policy`` None, the default) every round
verifies all γ drafts: the offline protocol of the paper's Table 1 (Section 4.2),
one request at a time or, with ``batch_size`` R > 1, R requests per drafter and
target forward (``dspark.decoding.batched``), each decoding the tokens it decodes
alone, against target-only decoding at the same R. With a policy (``dspark eval --policy``) the
requests of each benchmark run through the serving simulator's stepping loop
(``dspark.scheduling.simulator.run_requests``): ``concurrency`` requests in
lockstep, the policy choosing ℓ for all of them from their confidences
(calibrated with the STS temperatures), so rounds.jsonl and τ come out of the
same code path as ``dspark simulate``; rounds.jsonl then records the chosen ℓ
as ``proposed`` (plus step, batch_tokens and ``drafted``: false for the rounds
that did not draft under ``algorithm1+skip``), ``report["scheduled"]``
(``dspark.evaluation.report.scheduled_summary``) holds tokens/s against
target-only decoding, the mean verified length and the measured drafting cost
per round in target steps, and ``report["serving"]`` the simulated throughput
on the SPS table. Requests keep their per-request seeds on both paths.

Under ``torchrun`` every rank decodes prompts ``rank::world`` of each
benchmark; the records are gathered with ``all_gather_object``, every rank
returns the same report, and rank 0 writes the files.

With ``out_dir`` a killed evaluation loses nothing: settings.json is written
before decoding, each request's rows are appended (fsynced) as it finishes,
and a rerun on the folder decodes only the requests not yet done, to the same
files and report (``dspark.evaluation.journal``; ``resume`` says when).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.data.benchmarks import load_prompts, resolve_benchmarks, samples_per_benchmark
from dspark.data.prompts import Conversation
from dspark.data.render import render_prompt
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.evaluation.journal import SETTINGS, Done, EvalJournal
from dspark.evaluation.metrics import round_tau
from dspark.evaluation.report import build_report, scheduled_summary, write_outputs
from dspark.io.atomic import atomic_write_text
from dspark.scheduling.calibration import as_temperatures
from dspark.scheduling.simulator import (
    DecodeSettings,
    Job,
    ServeSettings,
    SimResult,
    make_policy,
    run_requests,
    sps_table,
)
from dspark.seeds import request_seed

PathLike = Union[str, os.PathLike]

# New tokens of the untimed warm-up decode before the first timed request (kernel selection,
# allocator, lazy imports); 0: no warm-up. Like the module's speculative_generate and
# target_generate, a seam that tests replace.
WARMUP_TOKENS = 8
_VARIANT_LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}


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


def _gamma_of(drafter: Any) -> int | None:
    gamma = getattr(getattr(drafter, "config", None), "block_size", None)
    return int(gamma) if gamma is not None else None


def _default_label(drafter: Any) -> str:
    variant = getattr(getattr(drafter, "config", None), "variant", None)
    return _VARIANT_LABELS.get(variant, str(variant)) if variant else "drafter"


def _generator(device: Any, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Evaluation:
    """What the benchmark loops of one ``evaluate`` call share: the models, the resolved
    settings and this process's place among the ranks."""

    target: Any
    drafter: Any
    tokenizer: Any
    decoding: DecodeSettings  # EOS ids resolved
    serving: ServeSettings  # SPS table loaded, STS temperatures read and checked against γ
    baseline: bool  # also decode every prompt with the target alone
    rank: int
    world: int
    progress: bool  # progress bars (rank 0 only)
    warm: bool  # the untimed warm-up decode ran (or none was asked for)
    batch_size: int = 1  # requests decoded together without a policy (dspark.decoding.batched)

    @property
    def device(self) -> Any:
        return getattr(self.target, "device", "cpu")

    @property
    def temps(self) -> np.ndarray | None:
        """The STS temperatures [γ], or None."""
        t = self.serving.sts_temperatures
        return None if t is None else np.asarray(t, dtype=np.float64)


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
    batch_size: int = 1,
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
    """
    state = _open_evaluation(target, drafter, tokenizer, decoding, serving, baseline, progress)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1 (requests decoded together), got {batch_size!r}")
    state.batch_size = batch_size if state.serving.policy is None else 1
    files, skipped = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    started = time.perf_counter()
    prompts = {name: load_prompts(source, counts[name], state.decoding.seed, split) for name, source in files.items()}
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


def _settings(state: _Evaluation, label: str, files: Mapping[str, Path | list[Conversation]],
              counts: Mapping[str, int | None], split: str, skipped: Sequence[str],
              run_config: Any) -> dict[str, Any]:
    """What settings.json holds: everything ``report_from_rows`` needs besides the rows."""
    s, gamma = state.serving, _gamma_of(state.drafter)
    return {"label": label, "gamma": gamma, "config": _run_settings(state, gamma, files, counts, split, run_config),
            "skipped": list(skipped), "temperatures": None if state.temps is None else state.temps.tolist(),
            "policy": None if s.policy is None else _policy_name(s.policy),
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
    gamma = settings["gamma"] or _infer_gamma(rounds)
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


def evaluate_from_config(target: Any, drafter: Any, config: Any, **overrides: Any) -> dict[str, Any]:
    """``evaluate`` as ``dspark eval`` runs it: every setting from a ``dspark.config.Config``.

    Reads ``config.eval`` (prompts, decoding, baseline, label, out) and ``config.serve``
    (policy, concurrency, STS, SPS), stores the whole config in the report and, next to
    it, as ``config.json``, so that ``dspark eval --config <out>/config.json`` runs the
    same evaluation again. Keyword arguments override any of ``evaluate``'s."""
    e, s = config.eval, config.serve
    policy = _one_policy(s.policy)
    if policy is None and s.concurrency != 1:
        raise ValueError("serve.concurrency needs serve.policy (--concurrency needs --policy POLICY, e.g. --policy "
                         "algorithm1); to decode requests together without a policy use eval.batch_size "
                         "(--batch-size R)")
    benchmarks: Any = e.data_dir
    names: list[str] | None = list(e.benchmarks)
    if e.builtin_prompts:
        from dspark.data.prompts import builtin_eval_sets

        benchmarks, names = builtin_eval_sets(), None
    options: dict[str, Any] = dict(
        names=names, num_samples=e.num_samples or None, split=e.split,
        decoding=DecodeSettings(max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=e.seed),
        # without a policy the SPS table only sets the automatic batch size
        serving=ServeSettings(policy=policy, sps=(s.sps or None) if policy else None, concurrency=s.concurrency,
                              sts_temperatures=s.sts or None, engine=s.engine),
        baseline=e.baseline, label=e.label or None, out_dir=config.path(e.out, "eval"), run_config=config,
        batch_size=resolve_batch_size(e.batch_size, s.sps or None, drafter, target),
    )
    options.update(overrides)
    if options["out_dir"] is not None and _dist_info()[0] == 0 and options.get("resume") is not False:
        check_config_folder(options["out_dir"], config, resume=options.get("resume"))
    report = evaluate(target, drafter, options.pop("benchmarks", benchmarks), **options)
    return report


def resolve_batch_size(value: int | str, sps: Any, drafter: Any, target: Any) -> int:
    """``eval.batch_size`` as a number: an int as given; "auto" by ``dspark.decoding.batched.auto_batch_size``
    (the SPS table of ``sps`` when given, else the device's default)."""
    if value != "auto":
        return int(value)
    from dspark.decoding.batched import auto_batch_size

    return auto_batch_size(sps_table(sps), _gamma_of(drafter) or 1, getattr(target, "device", "cpu"))


def check_eval_inputs(config: Any) -> None:
    """Before any model is loaded: every line of the benchmark files (JSON with "turns"; an error
    names the file and line), the policy, and the drafter folder of ``eval.draft`` (its
    config.json exists, parses and is a layout ``dspark.modeling.load_drafter`` reads)."""
    from dspark.data.benchmarks import load_benchmark_prompts
    from dspark.modeling.formats import detect_format, locate_drafter, read_json

    e = config.eval
    _one_policy(config.serve.policy)
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


def _one_policy(policies: Sequence[str]) -> str | None:
    """The policy of ``serve.policy`` for ``dspark eval`` (None: verify all γ drafts)."""
    if len(policies) > 1:
        raise ValueError(f"serve.policy={list(policies)} names {len(policies)} policies but dspark eval runs one; "
                         "pass one (--policy algorithm1) or compare several with dspark simulate")
    return policies[0] if policies else None


def _open_evaluation(target: Any, drafter: Any, tokenizer: Any, decoding: DecodeSettings, serving: ServeSettings,
                  baseline: bool, progress: bool) -> _Evaluation:
    """The settings resolved against the models: EOS ids, the SPS table, the STS temperatures
    (checked against γ), the policy spec (a bad one fails before any decoding)."""
    tokenizer = _tokenizer_of(target, tokenizer)
    eos = decoding.eos_token_ids
    eos = sorted(eos) if eos is not None else default_eos_ids(target, tokenizer)
    decoding = dataclasses.replace(decoding, eos_token_ids=tuple(eos))
    sps = sps_table(serving.sps)
    temps = serving.sts_temperatures
    if temps is not None:
        temps = as_temperatures(temps, _gamma_of(drafter), "ServeSettings.sts_temperatures")
    serving = dataclasses.replace(serving, sps=sps, sts_temperatures=temps)
    if serving.policy is not None:
        make_policy(serving.policy, sps)
    rank, world = _dist_info()
    return _Evaluation(target, drafter, tokenizer, decoding, serving, baseline, rank, world,
                    progress=progress and rank == 0, warm=WARMUP_TOKENS == 0)


def _tokenizer_of(target: Any, tokenizer: Any) -> Any:
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "the target has no tokenizer (target.tokenizer is None) and none was passed; "
            "pass tokenizer=... or load the target from a folder with tokenizer files"
        )
    return tokenizer


def _decode_kwargs(decoding: DecodeSettings) -> dict[str, Any]:
    """The keywords ``speculative_generate`` and ``target_generate`` take from the settings."""
    return dict(temperature=decoding.temperature, eos_token_ids=list(decoding.eos_token_ids or ()),
                max_new_tokens=decoding.max_new_tokens)


def _decode_benchmarks(
    state: _Evaluation, prompts: Mapping[str, list[Conversation]], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[tuple[str, int], Any]]:
    """Every benchmark's requests of this rank (those ``done`` holds are read, not decoded), gathered
    from all ranks: (records, rounds, (benchmark, rank) -> the serving summary of a scheduled one)."""
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    served: dict[tuple[str, int], Any] = {}
    if state.serving.policy is None and state.batch_size > 1:
        records, rounds = _batched_benchmarks(state, prompts, journal, done)
        if state.world > 1:
            records, rounds, served = _gather(records, rounds, served, state.world)
        return records, rounds, served
    for name, conversations in prompts.items():
        if state.serving.policy is not None:
            bench_records, bench_rounds, served[(name, state.rank)] = _scheduled_benchmark(
                state, name, conversations, journal, done)
        else:
            bench_records, bench_rounds = _plain_benchmark(state, name, conversations, journal, done)
        records += bench_records
        rounds += bench_rounds
    if state.world > 1:
        records, rounds, served = _gather(records, rounds, served, state.world)
    return records, rounds, served


def _plain_benchmark(
    state: _Evaluation, name: str, conversations: list[Conversation], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One benchmark's prompts ``rank::world``, one request at a time: their records and round records."""
    bar = tqdm(range(state.rank, len(conversations), state.world), desc=name, unit="req",
               disable=not state.progress, dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    tau_sum = num_rounds = 0
    for request in bar:
        if (name, request) in done.records:
            record, request_rounds = done.records[(name, request)], done.rounds.get((name, request), [])
        else:
            prompt_ids = render_prompt(state.tokenizer, conversations[request], enable_thinking=False)
            _warm_once(state, prompt_ids)
            record, request_rounds = _run_request(state, prompt_ids, name, request)
            record["rank"] = state.rank
            if journal is not None:
                journal.append_request(record, request_rounds)
        records.append(record)
        rounds += request_rounds
        tau_sum += sum(round_tau(r) for r in request_rounds)
        num_rounds += len(request_rounds)
        if num_rounds:
            bar.set_postfix(tau=f"{tau_sum / num_rounds:.2f}", refresh=False)
    bar.close()
    return records, rounds


WAVE_ROWS = 4  # with a baseline, requests go in waves of WAVE_ROWS · R (speculative, then target-only)


def _batched_benchmarks(
    state: _Evaluation, prompts: Mapping[str, list[Conversation]], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every benchmark's prompts ``rank::world`` through one batch of ``state.batch_size`` rows
    (``dspark.decoding.batched``): the rows are refilled across benchmarks as requests finish.

    Without a baseline each request is committed to the journal as it finishes. With one, the
    pending requests go in waves of ``WAVE_ROWS`` · R: the wave decodes speculatively, then with the
    target alone at the same R, and its requests are committed; a kill loses at most the wave in
    flight. Requests ``done`` holds are read back, not decoded."""
    from dspark.decoding.batched import BatchJob, speculative_batch_generate, target_batch_generate

    keys = [(name, i) for name, convs in prompts.items() for i in range(state.rank, len(convs), state.world)]
    pending = [k for k in keys if k not in done.records]
    by_key: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {
        k: (done.records[k], done.rounds.get(k, [])) for k in keys if k in done.records}
    ids = {k: render_prompt(state.tokenizer, prompts[k[0]][k[1]], enable_thinking=False) for k in pending}
    if pending:
        _warm_once(state, ids[pending[0]])
    bar = tqdm(total=len(keys), initial=len(keys) - len(pending), desc=f"eval (R = {state.batch_size})",
               unit="req", disable=not state.progress, dynamic_ncols=True)
    rows, kwargs = state.batch_size, _decode_kwargs(state.decoding)
    wave = len(pending) if not state.baseline else WAVE_ROWS * rows
    for start in range(0, len(pending), max(wave, 1)):
        part = pending[start : start + wave]
        jobs = [BatchJob(ids[k], request_seed(state.decoding.seed, *k), k) for k in part]
        finished: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {}

        def spec_done(request: Any) -> None:
            result = request.result()
            key = request.tag
            record = _record(*key, ids[key], result, result.timings["total"], result.timings)
            record["rank"] = state.rank
            request_rounds = [_round_row(*key, i, int(r.proposed), int(r.accepted), r.confidences, r.eos_accepted)
                              for i, r in enumerate(result.rounds)]
            finished[key] = (record, request_rounds)
            if not state.baseline:
                _commit(journal, record, request_rounds, bar)

        speculative_batch_generate(state.target, state.drafter, jobs, batch_size=rows, on_finish=spec_done, **kwargs)
        if state.baseline:
            for request in target_batch_generate(state.target, jobs, batch_size=rows, **kwargs):
                base = request.result()
                finished[request.tag][0].update(
                    baseline_tokens=len(base.tokens), baseline_wall_s=base.timings["total"],
                    baseline_timings=dict(base.timings), baseline_finished_by_eos=bool(base.finished_by_eos))
            for key in part:
                _commit(journal, *finished[key], bar)
        by_key.update(finished)
    bar.close()
    records = [by_key[k][0] for k in keys]
    return records, [r for k in keys for r in by_key[k][1]]


def _commit(journal: EvalJournal | None, record: dict[str, Any], rounds: list[dict[str, Any]], bar: Any) -> None:
    if journal is not None:
        journal.append_request(record, rounds)
    bar.update(1)


def _warm_once(state: _Evaluation, prompt_ids: list[int]) -> None:
    """Before the first timed request: one short untimed decode of each function
    (kernel selection, allocator, lazy imports)."""
    if state.warm:
        return
    kwargs = {**_decode_kwargs(state.decoding),
              "max_new_tokens": min(WARMUP_TOKENS, state.decoding.max_new_tokens)}
    gen = _generator(state.device, 0)
    speculative_generate(state.target, state.drafter, prompt_ids, generator=gen, **kwargs)
    if state.baseline:
        target_generate(state.target, prompt_ids, generator=gen, **kwargs)
    state.warm = True


def _run_request(
    state: _Evaluation, prompt_ids: list[int], benchmark: str, request: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode one prompt speculatively (and with the target alone): its record and round records.

    Both decodes draw from generators seeded with the request's seed; wall times
    are measured around each call."""
    seed = request_seed(state.decoding.seed, benchmark, request)
    start = time.perf_counter()
    result = speculative_generate(state.target, state.drafter, prompt_ids,
                                  generator=_generator(state.device, seed), **_decode_kwargs(state.decoding))
    record = _record(benchmark, request, prompt_ids, result, time.perf_counter() - start, result.timings)
    if state.baseline:
        record.update(_run_baseline(state, prompt_ids, seed))
    rounds = [_round_row(benchmark, request, index, int(r.proposed), int(r.accepted), r.confidences, r.eos_accepted)
              for index, r in enumerate(result.rounds)]
    return record, rounds


def _record(
    benchmark: str, request: int, prompt_ids: Sequence[int], result: Any, wall_s: float, timings: Mapping[str, float]
) -> dict[str, Any]:
    """The requests.jsonl row of one speculative decode (``DecodeResult``), before its baseline fields."""
    taus = [r.tau for r in result.rounds]
    return {"benchmark": benchmark, "request": request, "prompt_tokens": len(prompt_ids),
            "tokens": len(result.tokens), "rounds": len(taus),
            "tau": sum(taus) / len(taus) if taus else None,
            "finished_by_eos": bool(result.finished_by_eos), "wall_s": wall_s, "timings": dict(timings)}


def _round_row(
    benchmark: str, request: int, index: int, proposed: int, accepted: int, confidences: Any, eos_accepted: bool
) -> dict:
    """The rounds.jsonl row of one draft/verify round (``dspark.evaluation.metrics`` reads it)."""
    return {"benchmark": benchmark, "request": request, "round": index, "proposed": proposed, "accepted": accepted,
            "confidences": None if confidences is None else [float(c) for c in confidences],
            "eos_accepted": bool(eos_accepted)}


def _run_baseline(state: _Evaluation, prompt_ids: Sequence[int], request_seed: int) -> dict[str, Any]:
    """Target-only decode of one prompt with the request's seed: the baseline_* fields of its record."""
    start = time.perf_counter()
    base = target_generate(state.target, prompt_ids, generator=_generator(state.device, request_seed),
                           **_decode_kwargs(state.decoding))
    return dict(
        baseline_tokens=len(base.tokens),
        baseline_wall_s=time.perf_counter() - start,
        baseline_timings=dict(base.timings),
        baseline_finished_by_eos=bool(base.finished_by_eos),
    )


def _scheduled_benchmark(
    state: _Evaluation, name: str, conversations: list[Conversation], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One benchmark's prompts ``rank::world`` through the serving loop under the evaluation's policy:
    records, rounds (plus step and batch_tokens) and the run's summary (``SimResult.summary``).
    A benchmark ``done`` holds is read back; one it does not is served from its first request
    (the policy sets each request's ℓ from all the requests decoded in lockstep)."""
    mine = list(range(state.rank, len(conversations), state.world))
    if (name, state.rank) in done.served:
        keys = [(name, i) for i in mine]
        return ([done.records[k] for k in keys], [r for k in keys for r in done.rounds.get(k, [])],
                done.served[(name, state.rank)])
    prompts = [render_prompt(state.tokenizer, conversations[i], enable_thinking=False) for i in mine]
    if prompts:
        _warm_once(state, prompts[0])
    jobs = [Job(p, request_seed(state.decoding.seed, name, i), (name, i)) for p, i in zip(prompts, mine)]
    sim = _serve(state, jobs, desc=name)
    rounds = [{**_round_row(*row["tag"], row["round"], row["proposed"], row["accepted"], row["confidences"],
                            row["eos_accepted"]),
               "step": row["step"], "batch_tokens": row["batch_tokens"], "drafted": row["drafted"]}
              for row in sim.rounds]
    rounds.sort(key=lambda r: (r["request"], r["round"]))
    records = _scheduled_records(state, sim, jobs, rounds, journal)
    summary = sim.summary()
    if journal is not None:
        journal.append_served(name, summary)
    return records, rounds, summary


def _serve(state: _Evaluation, jobs: list[Job], desc: str) -> SimResult:
    """Every job to completion (the slots drain at the end), ``concurrency`` at a time, with a fresh policy."""
    bar = tqdm(total=len(jobs), desc=desc, unit="req", disable=not state.progress, dynamic_ncols=True)

    def on_step(result: SimResult) -> None:
        bar.update(result.requests_finished - bar.n)
        if result.request_steps:
            bar.set_postfix(tau=f"{result.tau:.2f}", refresh=False)

    sim = run_requests(state.target, state.drafter, jobs, decoding=state.decoding, serving=state.serving,
                       on_step=on_step)
    bar.update(len(jobs) - bar.n)
    bar.close()
    return sim


def _scheduled_records(state: _Evaluation, sim: SimResult, jobs: list[Job], rounds: list[dict[str, Any]],
                       journal: EvalJournal | None) -> list[dict[str, Any]]:
    """One record per served job, then its baseline decode; each appended to the journal with its
    rounds once its baseline is done. A request's wall_s is the time of its own phases (prefill,
    draft, verify, ...), not the time it waited while the other live requests were stepped; on the
    batched engine, its prefill and its share of every step it was live in, and its baseline is
    target-only decoding of the same jobs at the same R (shares likewise)."""
    by_request: dict[int, list[dict[str, Any]]] = {}
    for row in rounds:
        by_request.setdefault(row["request"], []).append(row)
    batched = {}  # the batched engine's baseline: target-only decoding of the same jobs at the same R
    if state.baseline and state.serving.engine == "batched":
        from dspark.scheduling.batched_serving import target_only_wall

        base = target_only_wall(state.target, jobs, decoding=state.decoding, rows=state.serving.concurrency)
        batched = {tuple(r["tag"]): r for r in base["requests"]}
    records = []
    for info, job in zip(sim.requests, jobs):
        record = _record(*job.tag, job.prompt_ids, info["result"], info["timings"]["total"], info["timings"])
        if batched:
            row = batched[tuple(job.tag)]
            record.update(baseline_tokens=row["tokens"], baseline_wall_s=row["timings"]["total"],
                          baseline_timings=dict(row["timings"]),
                          baseline_finished_by_eos=bool(row["finished_by_eos"]))
        elif state.baseline:
            record.update(_run_baseline(state, job.prompt_ids, job.seed))
        record["rank"] = state.rank
        if journal is not None:
            journal.append_request(record, by_request.get(job.tag[1], []))
        records.append(record)
    return records


def _run_settings(state: _Evaluation, gamma: int, files: Mapping[str, Path | list[Conversation]],
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
        # the report's name for the verification-length policy (report.md prints it as "scheduler = ...")
        "scheduler": None if s.policy is None else f"{_policy_name(s.policy)} (serving loop, R = {s.concurrency})",
        "concurrency": s.concurrency if s.policy is not None else None,
        "engine": s.engine if s.policy is not None else None,  # the serving loop's (dspark.scheduling.batched_serving)
        "sps": None if s.sps is None else s.sps.to_dict(),
        "sts_temperatures": None if s.sts_temperatures is None else [float(t) for t in s.sts_temperatures],
        "eos_token_ids": list(d.eos_token_ids or ()),
        "world_size": state.world,
        "decode_fn": getattr(speculative_generate, "__qualname__", repr(speculative_generate)),
        "run": _plain_config(run_config),
    }


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__)


def _gather(records: list, rounds: list, served: dict, world: int) -> tuple[list, list, dict]:
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, (records, rounds, served))
    all_records = [r for part in gathered for r in part[0]]
    all_rounds = [r for part in gathered for r in part[1]]
    all_served = {k: v for part in gathered for k, v in part[2].items()}
    return all_records, all_rounds, all_served


def _barrier() -> None:
    torch.distributed.barrier()


def _infer_gamma(rounds: list[dict[str, Any]]) -> int:
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


__all__ = [
    "DecodeSettings",
    "ServeSettings",
    "default_eos_ids",
    "evaluate",
    "check_config_folder",
    "check_eval_inputs",
    "evaluate_from_config",
    "report_from_folder",
    "report_from_rows",
]
