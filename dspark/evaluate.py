"""The evaluation recipe: accepted length, acceptance and confidence quality on the SPEC 6 benchmarks.

``evaluate`` runs speculative decoding on a seeded subset of every benchmark
file (first user turn, chat template with thinking off), optionally the
target alone on the same prompts for the wall-clock speedup, and returns a
report; with ``out_dir`` it also writes

- ``rounds.jsonl``    one line per draft/verify round: benchmark, request, round,
                      proposed (ℓ), accepted (m), confidences (c_1..c_γ or null).
                      The log that STS (``dspark.calibration.fit_sts``) and the
                      scheduler are fitted on offline.
- ``requests.jsonl``  one line per request: tokens, rounds, τ, wall time of the
                      speculative and the baseline decode.
- ``report.json``     everything below, plus the run's settings and timings.
- ``report.md``       Table 1 (τ), per-benchmark details, conditional acceptance
                      per position (Fig. 2), confidence quality per position.
- ``acceptance.png``  conditional acceptance per position, one line per domain.
- ``reliability.png`` reliability diagrams of a_k per position (drafters with a
                      confidence head only).

``compare_reports`` puts several reports side by side as Table 1.

With ``scheduler=...`` (``dspark eval --scheduler``) the requests of each
benchmark run through the serving simulator's stepping loop
(``dspark.serving.run_requests``): ``concurrency`` requests in lockstep, a
verification-length policy choosing ℓ for all of them from their confidences,
so rounds.jsonl and τ come out of the same code path as ``dspark simulate``.

Under ``torchrun`` every rank decodes prompts ``rank::world`` of each
benchmark; the records are gathered with ``all_gather_object``, every rank
returns the same report, and rank 0 writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.calibration import (
    apply_temperatures,
    ece,
    load_sts_json,
    prefix_labels,
    reliability_bins,
    reliability_grid,
)
from dspark.data.prompts import Conversation, load_eval_benchmark
from dspark.data.render import render_prompt
from dspark.decoding import speculative_generate, target_generate
from dspark.metrics import (
    BENCHMARKS,
    DEFAULT_NUM_SAMPLES,
    DISPLAY_NAMES,
    DOMAINS,
    TABLE1_ORDER,
    domain_of,
    macro_average,
    summarize_rounds,
)
from dspark.scheduler import SPSTable
from dspark.jsonutil import to_jsonable
from dspark.serving import Job, SimResult, make_policy, run_requests

PathLike = Union[str, os.PathLike]
DecodeFn = Callable[..., Any]

BUILD_HINT = "python eval_datasets/make_benchmarks.py --out {dir}"
WARMUP_TOKENS = 8
_VARIANT_LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def resolve_benchmarks(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike, names: Sequence[str] | None = None
) -> tuple[dict[str, Path | list[Conversation]], list[str]]:
    """The benchmarks to evaluate (name -> file, or -> prompts given in memory) and the names skipped.

    ``benchmarks`` is either ``{name: path or list of conversations}`` or a
    folder holding ``<name>.jsonl`` files (``names`` picks which; default the
    nine of SPEC 6). A missing file is skipped with a warning; if none
    exists, ValueError says how to build them.
    """
    in_memory: dict[str, list[Conversation]] = {}
    if isinstance(benchmarks, Mapping):
        if names is not None:
            unknown = [n for n in names if n not in benchmarks]
            if unknown:
                raise ValueError(f"names {unknown} are not keys of benchmarks ({sorted(benchmarks)})")
            benchmarks = {n: benchmarks[n] for n in names}
        in_memory = {str(n): list(v) for n, v in benchmarks.items() if isinstance(v, (list, tuple))}
        wanted = {str(n): Path(p) for n, p in benchmarks.items() if str(n) not in in_memory}
        where = "the given paths"
        hint = f"build the files with `{BUILD_HINT.format(dir='<folder>')}`"
    else:
        folder = Path(benchmarks)
        chosen = list(BENCHMARKS) if names is None else [str(n) for n in names]
        wanted = {n: folder / f"{n}.jsonl" for n in chosen}
        where = f"data folder {str(folder)!r}"
        hint = (
            f"build them with `{BUILD_HINT.format(dir=folder)}` (needs the hub), "
            "or point the data folder at a copy such as ../shared/eval_datasets"
        )
    if not wanted and not in_memory:
        raise ValueError("no benchmark given: pass {name: path} or a data folder with <name>.jsonl files")
    present = {n: p for n, p in wanted.items() if p.is_file()}
    missing = [n for n in wanted if n not in present]
    order = list(benchmarks) if isinstance(benchmarks, Mapping) else list(wanted)
    found = {str(n): in_memory[str(n)] if str(n) in in_memory else present[str(n)]
             for n in order if str(n) in in_memory or str(n) in present}
    if not found:
        raise ValueError(
            f"none of the benchmark files {[str(p) for p in wanted.values()]} exists ({where}); {hint}"
        )
    if missing:
        warnings.warn(
            f"skipping benchmark(s) {missing}: no file {[str(wanted[n]) for n in missing]}; {hint}",
            UserWarning,
            stacklevel=3,
        )
    return found, missing


def samples_per_benchmark(
    names: Sequence[str], num_samples: int | Mapping[str, int] | None
) -> dict[str, int | None]:
    """Requests to draw from each benchmark.

    None or 0: the SPEC 6 protocol counts (all prompts for names outside the
    nine); an int: that many from every benchmark; a mapping: per name, the
    protocol count for names it omits. A count above a file's size takes the
    whole file."""
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_samples{where} must be an int >= 0 (0 = SPEC 6 default), got {value!r}")
        return value

    out: dict[str, int | None] = {}
    for name in names:
        if isinstance(num_samples, Mapping):
            value = check(num_samples[name], f"[{name!r}]") if name in num_samples else 0
        else:
            value = 0 if num_samples is None else check(num_samples, "")
        out[name] = value if value > 0 else DEFAULT_NUM_SAMPLES.get(name)
    return out


def _load_prompts(source: Path | list[Conversation], num_samples: int | None, seed: int) -> list[Conversation]:
    """First-user-turn prompts of a benchmark file or an in-memory list, as a seeded subset.

    In-memory lists follow ``load_eval_benchmark``'s rule (a ``random.Random(seed)``
    sample kept in list order), so a list and a file of the same prompts give
    the same subset."""
    if isinstance(source, Path):
        return load_eval_benchmark(source, num_samples, seed)
    prompts = []
    for index, conversation in enumerate(source):
        first = next((m for m in conversation if m.get("role") == "user"), None)
        if first is None:
            raise ValueError(f"in-memory prompt {index} has no user message: {conversation!r:.120}")
        prompts.append([{"role": "user", "content": first["content"]}])
    if num_samples is None or num_samples >= len(prompts):
        return prompts
    chosen = sorted(random.Random(seed).sample(range(len(prompts)), num_samples))
    return [prompts[i] for i in chosen]


def load_benchmark_prompts(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    seed: int = 0,
) -> dict[str, list[Conversation]]:
    """The first-user-turn prompts ``evaluate`` would decode: name -> seeded subset
    (``resolve_benchmarks``, ``samples_per_benchmark``; missing files are skipped with a warning)."""
    files, _ = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    return {name: _load_prompts(source, counts[name], seed) for name, source in files.items()}


def default_eos_ids(target: Any, tokenizer: Any) -> list[int]:
    """The ids that end a request by default: end-of-turn, tokenizer EOS and model EOS ids."""
    return _default_eos_ids(target, tokenizer)


def _default_eos_ids(target: Any, tokenizer: Any) -> list[int]:
    """The chat template's end-of-turn token, the tokenizer's and the model's EOS ids."""
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


def evaluate(
    target: Any,
    drafter: Any,
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    *,
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    max_new_tokens: int = 2048,
    temperature: float = 1.0,
    seed: int = 0,
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
        scheduler: a verification-length policy (``dspark.serving.make_policy`` spec
            such as "algorithm1", "async", "static1", "threshold:0.5", or a Policy).
            The requests of each benchmark then run through the serving
            simulator's stepping loop (``dspark.serving.run_requests``) with
            ``concurrency`` slots, the policy seeing every live request's
            confidences (calibrated with ``sts_temperatures``); rounds.jsonl
            records the ℓ it chose as ``proposed`` (plus step and batch_tokens).
            Requests keep their per-request seeds. ``decode_fn`` is then used
            for the warm-up only, and ``choose_length`` must be None.
        sps: the SPS table (or its JSON path) for policies that need one and for
            the simulated throughput in ``report["serving"]``.
        concurrency: requests decoded in lockstep with a scheduler (default 1).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "the target has no tokenizer (target.tokenizer is None) and none was passed; "
            "pass tokenizer=... or load the target from a folder with tokenizer files"
        )
    if scheduler is not None and choose_length is not None:
        raise ValueError("pass either scheduler (a serving policy) or choose_length (a per-request hook), not both")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    sps_table = SPSTable.from_json(sps) if isinstance(sps, (str, os.PathLike)) else sps
    files, skipped = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    eos = sorted(int(i) for i in eos_token_ids) if eos_token_ids is not None else _default_eos_ids(target, tokenizer)
    temps = _as_temperatures(sts_temperatures, _gamma_of(drafter))
    rank, world = _dist_info()
    device = getattr(target, "device", "cpu")
    started = time.perf_counter()

    decode_kwargs = dict(temperature=temperature, eos_token_ids=eos, max_new_tokens=max_new_tokens)
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    serving: dict[str, Any] = {}
    warmed = not warmup
    for name, source in files.items():
        conversations = _load_prompts(source, counts[name], seed)
        if scheduler is not None:
            mine = list(range(rank, len(conversations), world))
            prompts = [render_prompt(tokenizer, conversations[i], enable_thinking=False) for i in mine]
            if prompts and not warmed:
                _warmup(target, drafter, prompts[0], decode_fn, baseline_fn if baseline else None,
                        {**decode_kwargs, "max_new_tokens": min(WARMUP_TOKENS, max_new_tokens)}, None, device)
                warmed = True
            jobs = [Job(p, _request_seed(seed, name, i), (name, i)) for p, i in zip(prompts, mine)]
            bench_records, bench_rounds, serving[name] = _run_scheduled(
                target, drafter, jobs, scheduler, sps_table, concurrency, temps, device,
                baseline_fn if baseline else None, decode_kwargs, progress=progress and rank == 0, desc=name,
            )
            for record in bench_records:
                record["rank"] = rank
            records += bench_records
            rounds += bench_rounds
            continue
        bar = tqdm(range(rank, len(conversations), world), desc=name, unit="req",
                   disable=not progress or rank != 0, dynamic_ncols=True)
        accepted_sum = num_rounds = 0
        for request in bar:
            prompt_ids = render_prompt(tokenizer, conversations[request], enable_thinking=False)
            if not warmed:
                _warmup(target, drafter, prompt_ids, decode_fn, baseline_fn if baseline else None,
                        {**decode_kwargs, "max_new_tokens": min(WARMUP_TOKENS, max_new_tokens)}, choose_length, device)
                warmed = True
            record, request_rounds = _run_request(
                target, drafter, prompt_ids, name, request, _request_seed(seed, name, request), device,
                decode_fn, baseline_fn if baseline else None, decode_kwargs, choose_length,
            )
            record["rank"] = rank
            records.append(record)
            rounds += request_rounds
            accepted_sum += sum(r["accepted"] for r in request_rounds)
            num_rounds += len(request_rounds)
            if num_rounds:
                bar.set_postfix(tau=f"{1 + accepted_sum / num_rounds:.2f}", refresh=False)
        bar.close()

    if world > 1:
        records, rounds = _gather(records, rounds, world)
    order = {name: i for i, name in enumerate(files)}
    records.sort(key=lambda r: (order[r["benchmark"]], r["request"]))
    rounds.sort(key=lambda r: (order[r["benchmark"]], r["request"], r["round"]))

    gamma = _gamma_of(drafter) or _infer_gamma(rounds)
    config = {
        "target": _target_name(target),
        "dtype": str(getattr(target, "dtype", "unknown")).removeprefix("torch."),
        "drafter": _drafter_summary(drafter),
        "benchmarks": {n: str(p) if isinstance(p, Path) else f"<{len(p)} prompts in memory>"
                       for n, p in files.items()},
        "num_samples": counts,
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "seed": seed,
        "gamma": gamma,
        "baseline": baseline,
        "scheduler": _scheduler_name(scheduler, concurrency, choose_length),
        "concurrency": concurrency if scheduler is not None else None,
        "sps": None if sps_table is None else sps_table.to_dict(),
        "sts_temperatures": None if temps is None else [float(t) for t in temps],
        "eos_token_ids": eos,
        "world_size": world,
        "decode_fn": getattr(decode_fn, "__qualname__", repr(decode_fn)),
        "run": _plain_config(run_config),
    }
    report = build_report(
        records,
        rounds,
        gamma=gamma,
        label=label or _default_label(drafter),
        config=config,
        skipped=skipped,
        temperatures=temps,
    )
    if scheduler is not None:
        report["serving"] = serving  # per benchmark on this rank: simulated Θ, τ, mean ℓ (dspark.serving)
    report["timings"]["wall_s"] = time.perf_counter() - started
    if out_dir is not None and rank == 0:
        write_outputs(out_dir, report, records, rounds, temperatures=temps)
    return report


def evaluate_from_config(target: Any, drafter: Any, config: Any, **overrides: Any) -> dict[str, Any]:
    """``evaluate`` with the settings of a ``dspark.config.Config`` (its ``eval`` section).

    Uses eval.data_dir / eval.benchmarks / eval.num_samples (0 = SPEC 6
    defaults) / eval.max_new_tokens / eval.temperature / eval.seed and stores
    the whole config in the report; keyword arguments override any of
    ``evaluate``'s (e.g. ``out_dir=...``, ``label="DSpark"``)."""
    e = config.eval
    benchmarks = overrides.pop("benchmarks", e.data_dir)
    options: dict[str, Any] = dict(
        names=list(e.benchmarks),
        num_samples=e.num_samples or None,
        max_new_tokens=e.max_new_tokens,
        temperature=e.temperature,
        seed=e.seed,
        run_config=config,
    )
    options.update(overrides)
    return evaluate(target, drafter, benchmarks, **options)


def _warmup(target, drafter, prompt_ids, decode_fn, baseline_fn, decode_kwargs, choose_length, device) -> None:
    """One short untimed decode of each function (kernel selection, allocator, lazy imports)."""
    gen = _generator(device, 0)
    decode_fn(target, drafter, prompt_ids, choose_length=choose_length, generator=gen, **decode_kwargs)
    if baseline_fn is not None:
        baseline_fn(target, prompt_ids, generator=gen, **decode_kwargs)


def _run_request(
    target: Any,
    drafter: Any,
    prompt_ids: list[int],
    benchmark: str,
    request: int,
    request_seed: int,
    device: Any,
    decode_fn: DecodeFn,
    baseline_fn: DecodeFn | None,
    decode_kwargs: dict[str, Any],
    choose_length: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode one prompt speculatively (and with the target alone): its record and round records.

    Both decodes draw from generators seeded with ``request_seed``; wall times
    are measured around each call."""
    start = time.perf_counter()
    result = decode_fn(target, drafter, prompt_ids, choose_length=choose_length,
                       generator=_generator(device, request_seed), **decode_kwargs)
    wall = time.perf_counter() - start
    rounds = [
        {
            "benchmark": benchmark,
            "request": request,
            "round": index,
            "proposed": int(r.proposed),
            "accepted": int(r.accepted),
            "confidences": None if r.confidences is None else [float(c) for c in r.confidences],
        }
        for index, r in enumerate(result.rounds)
    ]
    record: dict[str, Any] = {
        "benchmark": benchmark,
        "request": request,
        "prompt_tokens": len(prompt_ids),
        "tokens": len(result.tokens),
        "rounds": len(rounds),
        "tau": 1 + sum(r["accepted"] for r in rounds) / len(rounds) if rounds else None,
        "finished_by_eos": bool(result.finished_by_eos),
        "wall_s": wall,
        "timings": dict(result.timings),
    }
    if baseline_fn is not None:
        record.update(_run_baseline(target, prompt_ids, request_seed, device, baseline_fn, decode_kwargs))
    return record, rounds


def _run_baseline(
    target: Any, prompt_ids: Sequence[int], request_seed: int, device: Any, baseline_fn: DecodeFn,
    decode_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Target-only decode of one prompt with the request's seed: the baseline_* fields of its record."""
    start = time.perf_counter()
    base = baseline_fn(target, prompt_ids, generator=_generator(device, request_seed), **decode_kwargs)
    return dict(
        baseline_tokens=len(base.tokens),
        baseline_wall_s=time.perf_counter() - start,
        baseline_timings=dict(base.timings),
        baseline_finished_by_eos=bool(base.finished_by_eos),
    )


def _run_scheduled(
    target: Any,
    drafter: Any,
    jobs: list[Job],
    scheduler: Any,
    sps_table: SPSTable | None,
    concurrency: int,
    temps: np.ndarray | None,
    device: Any,
    baseline_fn: DecodeFn | None,
    decode_kwargs: dict[str, Any],
    progress: bool,
    desc: str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One benchmark's requests through the serving loop under ``scheduler``: records, rounds, summary.

    Every job runs to completion (the slots drain at the end). A request's
    wall_s is the time of its own phases (prefill, draft, verify, ...), not
    the time it waited while the other live requests were stepped."""
    bar = tqdm(total=len(jobs), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)

    def on_step(result: SimResult) -> None:
        bar.update(result.requests_finished - bar.n)
        if result.request_steps:
            bar.set_postfix(tau=f"{result.tau:.2f}", refresh=False)

    sim = run_requests(target, drafter, jobs, concurrency=concurrency, policy=make_policy(scheduler, sps_table),
                       sps=sps_table, sts_temperatures=temps, on_step=on_step, **decode_kwargs)
    bar.update(len(jobs) - bar.n)
    bar.close()
    rounds = [
        {
            "benchmark": row["tag"][0],
            "request": row["tag"][1],
            "round": row["round"],
            "proposed": row["proposed"],
            "accepted": row["accepted"],
            "confidences": None if row["confidences"] is None else [float(c) for c in row["confidences"]],
            "step": row["step"],
            "batch_tokens": row["batch_tokens"],
        }
        for row in sim.rounds
    ]
    rounds.sort(key=lambda r: (r["request"], r["round"]))
    records = []
    for info, job in zip(sim.requests, jobs):
        out = info["result"]
        record: dict[str, Any] = {
            "benchmark": job.tag[0],
            "request": job.tag[1],
            "prompt_tokens": len(job.prompt_ids),
            "tokens": len(out.tokens),
            "rounds": len(out.rounds),
            "tau": 1 + sum(r.accepted for r in out.rounds) / len(out.rounds) if out.rounds else None,
            "finished_by_eos": bool(out.finished_by_eos),
            "wall_s": info["timings"]["total"],
            "timings": dict(info["timings"]),
        }
        if baseline_fn is not None:
            record.update(_run_baseline(target, job.prompt_ids, job.seed, device, baseline_fn, decode_kwargs))
        records.append(record)
    return records, rounds, sim.summary()


def _scheduler_name(scheduler: Any, concurrency: int, choose_length: Any) -> str | None:
    if scheduler is not None:
        name = scheduler if isinstance(scheduler, str) else getattr(scheduler, "name", type(scheduler).__name__)
        return f"{name} (serving loop, R = {concurrency})"
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


def _as_temperatures(value: Sequence[float] | PathLike | None, gamma: int | None) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return load_sts_json(value, gamma)
    temps = np.asarray(value, dtype=np.float64).ravel()
    if gamma is not None and temps.size != gamma:
        raise ValueError(f"sts_temperatures has {temps.size} values but the drafter's block size γ is {gamma}")
    if not (np.isfinite(temps).all() and np.all(temps > 0)):
        raise ValueError(f"sts_temperatures must be finite and > 0, got {temps.tolist()}")
    return temps


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


# ---------------------------------------------------------------------------
# The report (pure)
# ---------------------------------------------------------------------------


def build_report(
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    *,
    gamma: int,
    label: str,
    config: Mapping[str, Any] | None = None,
    skipped: Sequence[str] = (),
    temperatures: Any = None,
) -> dict[str, Any]:
    """The report dict from per-request records and per-round records.

    Keys: label, gamma, config, skipped, benchmarks (name -> metrics),
    domains (math/code/chat -> metrics pooled over the domain's rounds, plus
    its benchmarks and their macro τ), all (metrics pooled over every round),
    macro (Table 1's Math/Code/Chat/Avg of τ, τ per request and speedup),
    timings. Metric keys are those of ``dspark.metrics.summarize_rounds``;
    benchmarks also carry tokens, wall times, throughputs and the speedup.
    """
    names = list(dict.fromkeys(r["benchmark"] for r in records))
    by_name: dict[str, list[Mapping[str, Any]]] = {n: [] for n in names}
    for r in rounds:
        by_name.setdefault(r["benchmark"], []).append(r)

    benchmarks: dict[str, Any] = {}
    for name in names:
        mine = [r for r in records if r["benchmark"] == name]
        entry = {"domain": domain_of(name), **summarize_rounds(by_name[name], gamma, temperatures)}
        entry["num_requests"] = len(mine)
        entry.update(_speed(mine))
        benchmarks[name] = entry

    domains: dict[str, Any] = {}
    for domain, members in DOMAINS.items():
        present = [n for n in members if n in benchmarks]
        if not present:
            continue
        pooled = [r for n in present for r in by_name[n]]
        entry = {"benchmarks": present, **summarize_rounds(pooled, gamma, temperatures)}
        entry["num_requests"] = sum(benchmarks[n]["num_requests"] for n in present)
        entry["tau_macro"] = float(np.mean([benchmarks[n]["tau"] for n in present]))
        domains[domain] = entry

    everything = summarize_rounds(rounds, gamma, temperatures)
    everything["num_requests"] = len(records)
    everything.update(_speed(records))

    macro = {
        key: macro_average({n: b[key] for n, b in benchmarks.items() if b.get(key) is not None})
        for key in ("tau", "tau_per_request", "speedup", "decode_speedup")
    }
    timings = {
        "spec_s": float(sum(r["wall_s"] for r in records)),
        "spec_phases_s": _sum_phases(r.get("timings", {}) for r in records),
    }
    if any("baseline_wall_s" in r for r in records):
        timings["baseline_s"] = float(sum(r.get("baseline_wall_s", 0.0) for r in records))
        timings["baseline_phases_s"] = _sum_phases(r.get("baseline_timings", {}) for r in records)
    return {
        "label": label,
        "gamma": gamma,
        "config": dict(config or {}),
        "skipped": list(skipped),
        "benchmarks": benchmarks,
        "domains": domains,
        "all": everything,
        "macro": macro,
        "timings": timings,
    }


def _speed(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Tokens, wall time and throughput of the speculative and baseline decodes.

    speedup = (spec tokens / spec seconds) / (baseline tokens / baseline seconds):
    a throughput ratio, because the two decodes of a prompt sample different
    continuations and can stop at different lengths."""
    tokens = sum(int(r["tokens"]) for r in records)
    wall = sum(float(r["wall_s"]) for r in records)
    out: dict[str, Any] = {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else math.nan,
    }
    if records and all("baseline_wall_s" in r for r in records):
        base_tokens = sum(int(r["baseline_tokens"]) for r in records)
        base_wall = sum(float(r["baseline_wall_s"]) for r in records)
        out["baseline_tokens"] = base_tokens
        out["baseline_wall_s"] = base_wall
        out["baseline_tokens_per_s"] = base_tokens / base_wall if base_wall > 0 else math.nan
        ratio = out["tokens_per_s"] / out["baseline_tokens_per_s"] if out["baseline_tokens_per_s"] else math.nan
        out["speedup"] = ratio
        out.update(_decode_speed(records))
    return out


def _decode_speed(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The same throughput ratio without the prefills: tokens after the first (which both
    decodes take from their prefill) per second of decoding. What the round/step cost of
    `bench/decode_round.py` predicts; the wall-clock speedup tends to it for long outputs.
    Empty when a record lacks its prefill time."""
    if not all("prefill" in r.get("timings", {}) and "prefill" in r.get("baseline_timings", {}) for r in records):
        return {}
    spec_tokens = sum(max(0, int(r["tokens"]) - 1) for r in records)
    spec_s = sum(float(r["wall_s"]) - float(r["timings"]["prefill"]) for r in records)
    base_tokens = sum(max(0, int(r["baseline_tokens"]) - 1) for r in records)
    base_s = sum(float(r["baseline_wall_s"]) - float(r["baseline_timings"]["prefill"]) for r in records)
    if min(spec_tokens, spec_s, base_tokens, base_s) <= 0:
        return {}
    return {"decode_speedup": (spec_tokens / spec_s) / (base_tokens / base_s)}


def _sum_phases(timings: Any) -> dict[str, float]:
    total: dict[str, float] = {}
    for t in timings:
        for phase, seconds in t.items():
            total[phase] = total.get(phase, 0.0) + float(seconds)
    return total


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    return f"{float(x):.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def load_report(path: PathLike) -> dict[str, Any]:
    """A report from ``report.json`` or from the folder that holds it."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def compare_reports(reports: Mapping[str, Mapping[str, Any] | PathLike]) -> str:
    """Table 1 as markdown: one row per drafter (label -> report, report.json or its folder).

    Columns: the nine benchmarks in the paper's order (plus any other
    benchmark a report holds), then Math / Code / Chat / Avg (macro averages
    of τ). A benchmark a report lacks shows "–"."""
    loaded = {label: r if isinstance(r, Mapping) else load_report(r) for label, r in reports.items()}
    extra = [n for r in loaded.values() for n in r["benchmarks"] if n not in TABLE1_ORDER]
    columns = list(TABLE1_ORDER) + list(dict.fromkeys(extra))
    header = ["drafter"] + [DISPLAY_NAMES.get(n, n) for n in columns] + ["Math", "Code", "Chat", "Avg"]
    rows = []
    for label, report in loaded.items():
        taus = {n: b.get("tau") for n, b in report["benchmarks"].items()}
        macro = macro_average({n: t for n, t in taus.items() if t is not None})
        rows.append(
            [label]
            + [_fmt(taus.get(n)) for n in columns]
            + [_fmt(macro[k]) for k in ("math", "code", "chat", "avg")]
        )
    return "\n".join(_table(header, rows))


def report_markdown(report: Mapping[str, Any]) -> str:
    """``report.md``: Table 1 row, per-benchmark details, conditional acceptance, confidence quality."""
    gamma = int(report["gamma"])
    cfg = report.get("config", {})
    positions = [f"k={k}" for k in range(1, gamma + 1)]
    lines = [
        f"# Evaluation: {report['label']}",
        "",
        f"target `{cfg.get('target')}` ({cfg.get('dtype', 'dtype not recorded')}), γ = {gamma}, T = {cfg.get('temperature')}, "
        f"max_new_tokens = {cfg.get('max_new_tokens')}, seed = {cfg.get('seed')}, "
        f"scheduler = {cfg.get('scheduler') or 'off (ℓ = γ)'}, ranks = {cfg.get('world_size', 1)}.",
    ]
    if report.get("skipped"):
        lines += ["", f"Skipped (file missing): {', '.join(report['skipped'])}."]
    lines += [
        "",
        "## Accepted length τ per round, bonus token included (Table 1)",
        "",
        compare_reports({report["label"]: report}),
        "",
        "## Per benchmark",
        "",
    ]
    has_base = any("speedup" in b for b in report["benchmarks"].values())
    header = ["benchmark", "requests", "rounds", "tokens", "τ pooled", "τ per request",
              "verify rate", "accept rate", "tok/s"]
    if has_base:
        header += ["baseline tok/s", "speedup", "decode speedup"]
    rows = []
    for name, b in list(report["benchmarks"].items()) + [("all", report["all"])]:
        row = [DISPLAY_NAMES.get(name, name), _fmt(b["num_requests"]), _fmt(b["num_rounds"]), _fmt(b["tokens"]),
               _fmt(b["tau"]), _fmt(b["tau_per_request"]), _fmt(b["verify_rate"]), _fmt(b["acceptance_rate"]),
               _fmt(b["tokens_per_s"], 1)]
        if has_base:
            row += [_fmt(b.get("baseline_tokens_per_s"), 1), _fmt(b.get("speedup")), _fmt(b.get("decode_speedup"))]
        rows.append(row)
    lines += _table(header, rows)

    groups = [*report["benchmarks"].items(), *report["domains"].items(), ("all", report["all"])]
    lines += ["", "## Conditional acceptance per position (paper Fig. 2)", "",
              "P(k accepted | 1..k−1 accepted, k verified); domains pool their rounds.", ""]
    lines += _table(["", *positions], [[DISPLAY_NAMES.get(n, n.capitalize() if n in DOMAINS else n)]
                                       + [_fmt(x, 3) for x in e["conditional_acceptance"]] for n, e in groups])
    lines += ["", "## Prefix survival P(m ≥ k)", ""]
    lines += _table(["", *positions], [[DISPLAY_NAMES.get(n, n.capitalize() if n in DOMAINS else n)]
                                       + [_fmt(x, 3) for x in e["prefix_survival"]] for n, e in groups])

    conf = report["all"].get("confidence")
    lines += ["", "## Confidence quality per position (all rounds)", ""]
    if conf is None:
        lines.append("The drafter reported no confidences (no confidence head).")
    else:
        calibrated = report["all"].get("confidence_calibrated")
        header = ["k", "rounds", "mean a_k", "accept rate", "ECE", "AUROC", "Brier"]
        if calibrated:
            header += ["ECE after STS", "Brier after STS"]
        rows = []
        for k, c in enumerate(conf):
            row = [str(c["position"]), _fmt(c["count"]), _fmt(c["mean_pred"], 3), _fmt(c["mean_label"], 3),
                   _fmt(c["ece"], 4), _fmt(c["auroc"], 3), _fmt(c["brier"], 4)]
            if calibrated:
                row += [_fmt(calibrated[k]["ece"], 4), _fmt(calibrated[k]["brier"], 4)]
            rows.append(row)
        lines += [
            "a_k = Π_{i≤k} c_i against 1[first k accepted], over rounds that verified k; ECE with 20 bins.",
            "",
            *_table(header, rows),
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Files and plots
# ---------------------------------------------------------------------------




def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(to_jsonable(row), ensure_ascii=False) + "\n")


def write_outputs(
    out_dir: PathLike,
    report: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    temperatures: Any = None,
) -> None:
    """Write rounds.jsonl, requests.jsonl, report.json, report.md and the plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "rounds.jsonl", rounds)
    _write_jsonl(out / "requests.jsonl", records)
    with (out / "report.json").open("w", encoding="utf-8") as f:
        json.dump(to_jsonable(report), f, indent=2, ensure_ascii=False, allow_nan=False)
        f.write("\n")
    (out / "report.md").write_text(report_markdown(report), encoding="utf-8")
    plot_acceptance(report, out / "acceptance.png")
    if any(r["confidences"] is not None for r in rounds):
        plot_reliability(rounds, int(report["gamma"]), out / "reliability.png", temperatures)


def _new_figure(figsize: tuple[float, float]):
    # A Figure with its own Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def plot_acceptance(report: Mapping[str, Any], path: PathLike) -> None:
    """Conditional acceptance per position, one line per domain and one for all rounds (paper Fig. 2)."""
    gamma = int(report["gamma"])
    k = np.arange(1, gamma + 1)
    fig = _new_figure((5.0, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    curves = [(d.capitalize(), e) for d, e in report["domains"].items()]
    if not curves:  # benchmarks outside the three domains only
        curves = [(DISPLAY_NAMES.get(n, n), e) for n, e in report["benchmarks"].items()]
    for name, entry in curves:
        ys = np.array([np.nan if y is None else y for y in entry["conditional_acceptance"]], dtype=float)
        ax.plot(k, ys, marker="o", label=name)
    ys = np.array([np.nan if y is None else y for y in report["all"]["conditional_acceptance"]], dtype=float)
    ax.plot(k, ys, ls="--", color="gray", label="all")
    ax.set_xticks(k)
    ax.set_xlim(0.7, gamma + 0.3)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(k accepted | 1..k−1 accepted)")
    ax.set_title(f"Conditional acceptance: {report['label']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)


def plot_reliability(
    rounds: Sequence[Mapping[str, Any]], gamma: int, path: PathLike, temperatures: Any = None, n_bins: int = 20
) -> None:
    """Reliability diagrams of a_k = Π_{i≤k} c_i per position k.

    With STS temperatures: before/after curves over all rounds
    (``calibration.reliability_grid``). Without: one curve per domain."""
    with_conf = [r for r in rounds if r["confidences"] is not None]
    conf = np.asarray([r["confidences"] for r in with_conf], dtype=np.float64)  # [N, γ]
    accepted = np.asarray([r["accepted"] for r in with_conf])
    proposed = np.asarray([r["proposed"] for r in with_conf])
    if temperatures is not None:
        reliability_grid(conf, apply_temperatures(conf, temperatures), accepted, proposed, path, n_bins=n_bins,
                         title="Prefix survival calibration (before / after STS)")
        return
    label, valid = prefix_labels(accepted, proposed, gamma)
    a = np.cumprod(conf, axis=1)  # [N, γ]
    groups = {"all": np.ones(len(with_conf), dtype=bool)}
    for domain in DOMAINS:
        mask = np.array([domain_of(r["benchmark"]) == domain for r in with_conf], dtype=bool)
        if mask.any():
            groups[domain.capitalize()] = mask
    cols = min(gamma, 4)
    rows = -(-gamma // cols)
    fig = _new_figure((3.2 * cols, 3.2 * rows))
    for k in range(gamma):
        ax = fig.add_subplot(rows, cols, k + 1)
        for index, (name, mask) in enumerate(groups.items()):
            v = valid[:, k] & mask
            if not v.any():
                continue
            count, mean_pred, mean_label = reliability_bins(a[v, k], label[v, k], n_bins)
            nz = count > 0
            style = dict(color="gray", ls="--") if name == "all" else dict(color=f"C{index - 1}")
            ax.plot(mean_pred[nz], mean_label[nz], marker="o", ms=3,
                    label=f"{name} ECE={ece(a[v, k], label[v, k], n_bins):.3f}", **style)
        ax.plot([0, 1], [0, 1], ls=":", color="black", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1} (n={int(valid[:, k].sum())})", fontsize=9)
        ax.set_xlabel("predicted a_k")
        ax.set_ylabel("empirical acceptance")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    fig.suptitle("Prefix survival calibration")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)


__all__ = [
    "build_report",
    "compare_reports",
    "default_eos_ids",
    "evaluate",
    "evaluate_from_config",
    "load_benchmark_prompts",
    "load_report",
    "plot_acceptance",
    "plot_reliability",
    "report_markdown",
    "resolve_benchmarks",
    "samples_per_benchmark",
    "write_outputs",
]
