"""The evaluation recipe: accepted length, acceptance and confidence quality on the SPEC 6 benchmarks.

``evaluate`` runs speculative decoding on a seeded subset of every benchmark
file (first user turn, chat template with thinking off), optionally the
target alone on the same prompts for the wall-clock speedup, and returns a
report (``dspark.evaluation.report.build_report``); with ``out_dir`` it also writes
rounds.jsonl (one line per draft/verify round: the log that STS and the
scheduler are fitted on offline), requests.jsonl, report.json, report.md and
plots (``dspark.evaluation.report.write_outputs`` describes them).
``dspark.evaluation.report.compare_reports`` puts several reports side by side as Table 1.

With ``scheduler=...`` (``dspark eval --scheduler``) the requests of each
benchmark run through the serving simulator's stepping loop
(``dspark.scheduling.simulator.run_requests``): ``concurrency`` requests in lockstep, a
verification-length policy choosing ℓ for all of them from their confidences,
so rounds.jsonl and τ come out of the same code path as ``dspark simulate``;
``report["scheduled"]`` (``dspark.evaluation.report.scheduled_summary``) then holds tokens/s
against target-only decoding, the mean verified length and the measured drafting
cost per round in target steps, and rounds.jsonl marks the rounds that did not
draft (``drafted``: false, under ``algorithm1+skip``).
The policy is a ``dspark.scheduling.simulator.make_policy`` spec such as "algorithm1",
"async", "static1", "threshold:0.5", or a Policy; it sees every live request's
confidences (calibrated with ``sts_temperatures``), and rounds.jsonl records
the ℓ it chose as ``proposed`` (plus step and batch_tokens). Requests keep
their per-request seeds; ``decode_fn`` is then used for the warm-up only, and
``choose_length`` must be None. ``sps`` (an SPS table or its JSON path) serves
the policies that need one and the simulated throughput in ``report["serving"]``.

Under ``torchrun`` every rank decodes prompts ``rank::world`` of each
benchmark; the records are gathered with ``all_gather_object``, every rank
returns the same report, and rank 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.scheduling.calibration import as_temperatures
from dspark.data.benchmarks import load_prompts, resolve_benchmarks, samples_per_benchmark
from dspark.data.prompts import DEEPSPEC_EVAL_SEED, Conversation
from dspark.data.render import render_prompt
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.io.atomic import atomic_write_text
from dspark.evaluation.metrics import round_tau
from dspark.evaluation.report import build_report, scheduled_summary, write_outputs
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.simulator import Job, SimResult, make_policy, run_requests

PathLike = Union[str, os.PathLike]
DecodeFn = Callable[..., Any]

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


def _request_seed(seed: int, benchmark: str, request: int) -> int:
    """A stable per-request seed: the same request draws the same numbers on any rank or run."""
    return (seed * 1_000_003 + zlib.crc32(benchmark.encode("utf-8")) * 7_919 + request) % (2**63)


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
class _Run:
    """The resolved settings of one ``evaluate`` call, shared by its benchmark loops."""

    target: Any
    drafter: Any
    tokenizer: Any
    files: dict[str, Path | list[Conversation]]  # benchmark -> file or in-memory prompts
    counts: dict[str, int | None]  # benchmark -> requests to draw (None: all)
    skipped: list[str]
    decode_kwargs: dict[str, Any]  # temperature, eos_token_ids, max_new_tokens
    seed: int
    decode_fn: DecodeFn
    baseline: bool
    baseline_fn: DecodeFn
    choose_length: Any
    scheduler: Any
    sps: SPSTable | None
    concurrency: int
    temps: np.ndarray | None  # STS temperatures [γ]
    rank: int
    world: int
    device: Any
    progress: bool  # progress bars (rank 0 only)
    warmed: bool  # the untimed warm-up decode ran (or was not asked for)
    started: float  # time.perf_counter() once the inputs were resolved

    @property
    def baseline_decode(self) -> DecodeFn | None:
        return self.baseline_fn if self.baseline else None


def evaluate(
    target: Any,
    drafter: Any,
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    *,
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    max_new_tokens: int = 2048,
    temperature: float = 1.0,
    seed: int = DEEPSPEC_EVAL_SEED,
    out_dir: PathLike | None = None,
    baseline: bool = True,
    choose_length: Callable[[list[float] | None, int], int] | None = None,
    sts_temperatures: Sequence[float] | PathLike | None = None,
    label: str | None = None,
    tokenizer: Any = None,
    eos_token_ids: Sequence[int] | None = None,
    warmup: bool = True,
    progress: bool = True,
    run_config: Any = None,
    decode_fn: DecodeFn = speculative_generate,
    baseline_fn: DecodeFn = target_generate,
    scheduler: Any = None,
    sps: SPSTable | PathLike | None = None,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Evaluate a drafter on the SPEC 6 benchmarks; returns the report (see the module docstring).

    Args:
        target, drafter: the models, handed to ``decode_fn`` / ``baseline_fn`` unchanged.
        benchmarks: ``{name: path}`` or a folder of ``<name>.jsonl`` files (``names``
            selects; default the nine). Missing files are skipped with a warning.
            A value may also be a list of conversations (e.g. the built-in prompts).
        num_samples: requests per benchmark (see ``samples_per_benchmark``);
            each is a seeded subset (``load_eval_benchmark(path, n, seed)``).
        max_new_tokens, temperature: decoding settings (SPEC 6 protocol: T = 1.0).
        seed: subset selection and every random draw (per-request generators).
        out_dir: where to write the files (rank 0 only); None writes nothing.
        baseline: also decode every prompt with the target alone, for the speedup.
        choose_length: the verification-length hook of ``speculative_generate``
            (a scheduler); None verifies all γ drafts (SPEC 6 protocol).
        sts_temperatures: γ STS temperatures (or the path of an STS JSON): the
            report then also holds the calibrated confidence quality.
        label: the row name in Table 1 (default from the drafter's variant).
        tokenizer: chat template and tokenizer (default ``target.tokenizer``).
        eos_token_ids: ids that end a request (default: end-of-turn and EOS ids).
        warmup: one short untimed decode first, so lazy initialisation is not timed.
        run_config: extra settings to store under ``report["config"]["run"]`` (a
            mapping or a dataclass such as ``dspark.config.Config``).
        decode_fn: ``(target, drafter, prompt_ids, *, max_new_tokens, temperature,
            eos_token_ids, choose_length, generator) -> DecodeResult``.
        baseline_fn: ``(target, prompt_ids, *, max_new_tokens, temperature,
            eos_token_ids, generator) -> DecodeResult``.
        scheduler, sps, concurrency: scheduled verification (module docstring): a
            verification-length policy, the SPS table (or its JSON path) and the
            requests decoded in lockstep (default 1).
    """
    _check_decoding(max_new_tokens, temperature)
    tokenizer = _tokenizer_of(target, tokenizer)
    _check_scheduling(scheduler, choose_length, concurrency)
    sps_table = SPSTable.from_json(sps) if isinstance(sps, (str, os.PathLike)) else sps
    files, skipped = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    eos = sorted(int(i) for i in eos_token_ids) if eos_token_ids is not None else default_eos_ids(target, tokenizer)
    rank, world = _dist_info()
    temps = None if sts_temperatures is None else as_temperatures(sts_temperatures, _gamma_of(drafter), "sts_temperatures")
    run = _Run(
        target, drafter, tokenizer, files, counts, skipped,
        decode_kwargs=dict(temperature=temperature, eos_token_ids=eos, max_new_tokens=max_new_tokens),
        seed=seed, decode_fn=decode_fn, baseline=baseline, baseline_fn=baseline_fn, choose_length=choose_length,
        scheduler=scheduler, sps=sps_table, concurrency=concurrency,
        temps=temps, rank=rank, world=world,
        device=getattr(target, "device", "cpu"), progress=progress and rank == 0, warmed=not warmup,
        started=time.perf_counter(),
    )
    records, rounds, serving = _decode_benchmarks(run)
    return _finish_report(run, records, rounds, serving, label, run_config, out_dir)


def evaluate_from_config(target: Any, drafter: Any, config: Any, **overrides: Any) -> dict[str, Any]:
    """``evaluate`` as ``dspark eval`` runs it: every setting from a ``dspark.config.Config``.

    Reads ``config.eval`` (prompts, decoding, baseline, label, out) and ``config.serve``
    (policy, concurrency, STS, SPS), stores the whole config in the report and, next to
    it, as ``config.json``, so that ``dspark eval --config <out>/config.json`` runs the
    same evaluation again. Keyword arguments override any of ``evaluate``'s."""
    e, s = config.eval, config.serve
    if not s.policy and (s.sps or s.concurrency != 1):
        raise ValueError("serve.sps and serve.concurrency need serve.policy "
                         "(--sps and --concurrency need --scheduler POLICY, e.g. --scheduler algorithm1)")
    benchmarks: Any = e.data_dir
    names: list[str] | None = list(e.benchmarks)
    if e.builtin_prompts:
        from dspark.data.prompts import builtin_eval_sets

        benchmarks, names = builtin_eval_sets(), None
    out_dir = config.path(e.out, "eval")
    options: dict[str, Any] = dict(
        names=names, num_samples=e.num_samples or None, max_new_tokens=e.max_new_tokens,
        temperature=e.temperature, seed=e.seed, out_dir=out_dir, baseline=e.baseline, label=e.label or None,
        sts_temperatures=s.sts or None, scheduler=s.policy or None, sps=s.sps or None, concurrency=s.concurrency,
        run_config=config,
    )
    options.update(overrides)
    report = evaluate(target, drafter, options.pop("benchmarks", benchmarks), **options)
    if options["out_dir"] is not None and _dist_info()[0] == 0:
        atomic_write_text(Path(options["out_dir"]) / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    return report


def _check_decoding(max_new_tokens: Any, temperature: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def _tokenizer_of(target: Any, tokenizer: Any) -> Any:
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "the target has no tokenizer (target.tokenizer is None) and none was passed; "
            "pass tokenizer=... or load the target from a folder with tokenizer files"
        )
    return tokenizer


def _check_scheduling(scheduler: Any, choose_length: Any, concurrency: Any) -> None:
    if scheduler is not None and choose_length is not None:
        raise ValueError("pass either scheduler (a serving policy) or choose_length (a per-request hook), not both")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")


def _decode_benchmarks(run: _Run) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Every benchmark's requests of this rank, gathered from all ranks and sorted by benchmark,
    request and round: (records, rounds, per benchmark the serving summary of this rank)."""
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    serving: dict[str, Any] = {}
    for name, source in run.files.items():
        conversations = load_prompts(source, run.counts[name], run.seed)
        if run.scheduler is not None:
            bench_records, bench_rounds, serving[name] = _scheduled_benchmark(run, name, conversations)
        else:
            bench_records, bench_rounds = _plain_benchmark(run, name, conversations)
        records += bench_records
        rounds += bench_rounds
    if run.world > 1:
        records, rounds = _gather(records, rounds, run.world)
    order = {name: i for i, name in enumerate(run.files)}
    records.sort(key=lambda r: (order[r["benchmark"]], r["request"]))
    rounds.sort(key=lambda r: (order[r["benchmark"]], r["request"], r["round"]))
    return records, rounds, serving


def _plain_benchmark(
    run: _Run, name: str, conversations: list[Conversation]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One benchmark's prompts ``rank::world``, one request at a time: their records and round records."""
    bar = tqdm(range(run.rank, len(conversations), run.world), desc=name, unit="req",
               disable=not run.progress, dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    tau_sum = num_rounds = 0
    for request in bar:
        prompt_ids = render_prompt(run.tokenizer, conversations[request], enable_thinking=False)
        _warm_once(run, prompt_ids, run.choose_length)
        record, request_rounds = _run_request(run, prompt_ids, name, request)
        record["rank"] = run.rank
        records.append(record)
        rounds += request_rounds
        tau_sum += sum(round_tau(r) for r in request_rounds)
        num_rounds += len(request_rounds)
        if num_rounds:
            bar.set_postfix(tau=f"{tau_sum / num_rounds:.2f}", refresh=False)
    bar.close()
    return records, rounds


def _warm_once(run: _Run, prompt_ids: list[int], choose_length: Any) -> None:
    """Before the first timed request: one short untimed decode of each function
    (kernel selection, allocator, lazy imports)."""
    if run.warmed:
        return
    kwargs = {**run.decode_kwargs, "max_new_tokens": min(WARMUP_TOKENS, run.decode_kwargs["max_new_tokens"])}
    gen = _generator(run.device, 0)
    run.decode_fn(run.target, run.drafter, prompt_ids, choose_length=choose_length, generator=gen, **kwargs)
    if run.baseline_decode is not None:
        run.baseline_decode(run.target, prompt_ids, generator=gen, **kwargs)
    run.warmed = True


def _run_request(
    run: _Run, prompt_ids: list[int], benchmark: str, request: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode one prompt speculatively (and with the target alone): its record and round records.

    Both decodes draw from generators seeded with the request's seed; wall times
    are measured around each call."""
    request_seed = _request_seed(run.seed, benchmark, request)
    start = time.perf_counter()
    result = run.decode_fn(run.target, run.drafter, prompt_ids, choose_length=run.choose_length,
                           generator=_generator(run.device, request_seed), **run.decode_kwargs)
    record = _record(benchmark, request, prompt_ids, result, time.perf_counter() - start, result.timings)
    if run.baseline_decode is not None:
        record.update(_run_baseline(run, prompt_ids, request_seed))
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


def _run_baseline(run: _Run, prompt_ids: Sequence[int], request_seed: int) -> dict[str, Any]:
    """Target-only decode of one prompt with the request's seed: the baseline_* fields of its record."""
    start = time.perf_counter()
    base = run.baseline_decode(run.target, prompt_ids, generator=_generator(run.device, request_seed),
                               **run.decode_kwargs)
    return dict(
        baseline_tokens=len(base.tokens),
        baseline_wall_s=time.perf_counter() - start,
        baseline_timings=dict(base.timings),
        baseline_finished_by_eos=bool(base.finished_by_eos),
    )


def _scheduled_benchmark(
    run: _Run, name: str, conversations: list[Conversation]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One benchmark's prompts ``rank::world`` through the serving loop under ``run.scheduler``:
    records, rounds (plus step and batch_tokens) and the run's summary (``SimResult.summary``)."""
    mine = list(range(run.rank, len(conversations), run.world))
    prompts = [render_prompt(run.tokenizer, conversations[i], enable_thinking=False) for i in mine]
    if prompts:
        _warm_once(run, prompts[0], None)
    jobs = [Job(p, _request_seed(run.seed, name, i), (name, i)) for p, i in zip(prompts, mine)]
    sim = _serve(run, jobs, desc=name)
    rounds = [{**_round_row(*row["tag"], row["round"], row["proposed"], row["accepted"], row["confidences"],
                            row["eos_accepted"]),
               "step": row["step"], "batch_tokens": row["batch_tokens"], "drafted": row["drafted"]}
              for row in sim.rounds]
    rounds.sort(key=lambda r: (r["request"], r["round"]))
    return _scheduled_records(run, sim, jobs), rounds, sim.summary()


def _serve(run: _Run, jobs: list[Job], desc: str) -> SimResult:
    """Every job to completion (the slots drain at the end), ``run.concurrency`` at a time."""
    bar = tqdm(total=len(jobs), desc=desc, unit="req", disable=not run.progress, dynamic_ncols=True)

    def on_step(result: SimResult) -> None:
        bar.update(result.requests_finished - bar.n)
        if result.request_steps:
            bar.set_postfix(tau=f"{result.tau:.2f}", refresh=False)

    sim = run_requests(run.target, run.drafter, jobs, concurrency=run.concurrency,
                       policy=make_policy(run.scheduler, run.sps), sps=run.sps, sts_temperatures=run.temps,
                       on_step=on_step, **run.decode_kwargs)
    bar.update(len(jobs) - bar.n)
    bar.close()
    return sim


def _scheduled_records(run: _Run, sim: SimResult, jobs: list[Job]) -> list[dict[str, Any]]:
    """One record per served job, then its baseline decode. A request's wall_s is the time
    of its own phases (prefill, draft, verify, ...), not the time it waited while the
    other live requests were stepped."""
    records = []
    for info, job in zip(sim.requests, jobs):
        record = _record(*job.tag, job.prompt_ids, info["result"], info["timings"]["total"], info["timings"])
        if run.baseline_decode is not None:
            record.update(_run_baseline(run, job.prompt_ids, job.seed))
        record["rank"] = run.rank
        records.append(record)
    return records


def _finish_report(
    run: _Run, records: list[dict], rounds: list[dict], serving: dict[str, Any], label: str | None, run_config: Any,
    out_dir: PathLike | None,
) -> dict[str, Any]:
    """The report of the gathered records (``dspark.evaluation.report.build_report``); rank 0 writes its files."""
    gamma = _gamma_of(run.drafter) or _infer_gamma(rounds)
    report = build_report(records, rounds, gamma=gamma, label=label or _default_label(run.drafter),
                          config=_run_settings(run, gamma, run_config), skipped=run.skipped, temperatures=run.temps)
    if run.scheduler is not None:
        report["serving"] = serving  # per benchmark on this rank: simulated Θ, τ, mean ℓ (dspark.scheduling.simulator)
        report["scheduled"] = scheduled_summary(  # speed vs target-only, mean ℓ, draft cost in target steps
            records, rounds, report["all"], policy=_policy_name(run.scheduler), concurrency=run.concurrency,
            sps_step_s=None if run.sps is None else 1.0 / float(run.sps(1)))
    report["timings"]["wall_s"] = time.perf_counter() - run.started
    if out_dir is not None and run.rank == 0:
        write_outputs(out_dir, report, records, rounds, temperatures=run.temps)
    return report


def _run_settings(run: _Run, gamma: int, run_config: Any) -> dict[str, Any]:
    """``report["config"]``: what was evaluated, and how."""
    return {
        "target": _target_name(run.target),
        "dtype": str(getattr(run.target, "dtype", "unknown")).removeprefix("torch."),
        "drafter": _drafter_summary(run.drafter),
        "benchmarks": {n: str(p) if isinstance(p, Path) else f"<{len(p)} prompts in memory>"
                       for n, p in run.files.items()},
        "num_samples": run.counts,
        "max_new_tokens": run.decode_kwargs["max_new_tokens"],
        "temperature": float(run.decode_kwargs["temperature"]),
        "seed": run.seed,
        "gamma": gamma,
        "baseline": run.baseline,
        "scheduler": _scheduler_name(run.scheduler, run.concurrency, run.choose_length),
        "concurrency": run.concurrency if run.scheduler is not None else None,
        "sps": None if run.sps is None else run.sps.to_dict(),
        "sts_temperatures": None if run.temps is None else [float(t) for t in run.temps],
        "eos_token_ids": run.decode_kwargs["eos_token_ids"],
        "world_size": run.world,
        "decode_fn": getattr(run.decode_fn, "__qualname__", repr(run.decode_fn)),
        "run": _plain_config(run_config),
    }


def _policy_name(scheduler: Any) -> str:
    return scheduler if isinstance(scheduler, str) else getattr(scheduler, "name", type(scheduler).__name__)


def _scheduler_name(scheduler: Any, concurrency: int, choose_length: Any) -> str | None:
    if scheduler is not None:
        return f"{_policy_name(scheduler)} (serving loop, R = {concurrency})"
    if choose_length is not None:
        return getattr(choose_length, "__name__", type(choose_length).__name__)
    return None


def _gather(records: list, rounds: list, world: int) -> tuple[list, list]:
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, (records, rounds))
    all_records = [r for part in gathered for r in part[0]]
    all_rounds = [r for part in gathered for r in part[1]]
    return all_records, all_rounds


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
    "default_eos_ids",
    "evaluate",
    "evaluate_from_config",
]
