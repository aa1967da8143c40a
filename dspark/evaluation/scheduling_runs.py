"""The recipes of the scheduling commands: a `dspark.config.Config` in, files out.

- `profile_sps`   `dspark profile-sps`: the target's verification steps/s at B batch
                  tokens (SPS(B) of Algorithm 1), written as SGLang's SPS table (`config.profile`).
- `simulate`      `dspark simulate`: the serving simulator over policies × concurrencies
                  on the benchmark prompts (paper Fig. 8; `config.serve`, `config.eval`).
- `calibrate`     `dspark calibrate`: STS fitted on round logs, split by request
                  (paper Section 3.2.1; `config.calibrate`).

Each writes the config it ran next to its outputs where they are a folder
(config.json) or inside them, so a run can be repeated from its files. Printing
is the caller's: the functions take `announce` (a line of text) and `progress`
callbacks. The training and evaluation recipes are `dspark.training.trainer` and
`dspark.evaluation.evaluate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dspark.config import Config
from dspark.io.atomic import atomic_write_text

Announce = Callable[[str], None]


def _silent(_: str) -> None:
    return None


def profile_sps(config: Config, *, progress: Callable[[int, int], None] | None = None,
                announce: Announce = _silent) -> dict[str, Path]:
    """Profile the target of `config` (capturing the layers of `eval.draft` when given, as
    verification does) at `profile.batch_tokens`; write the table at `profile.out` (default
    <run_dir>/sps.json) with its timings and plot next to it; returns the three paths.
    ``progress(done, repeats)`` after each timed sweep; one announced line per B at the end."""
    from dspark.modeling.checkpoint import read_config
    from dspark.evaluation.report import write_profile
    from dspark.build import dtype_name, load_target
    from dspark.scheduling.sps_profile import DEFAULT_BATCH_TOKENS, profile_sps_runs

    p = config.profile
    layer_ids = list(read_config(config.eval.draft).target_layer_ids) if config.eval.draft else [-1]
    target = load_target(config, layer_ids)
    sizes = list(p.batch_tokens) or list(DEFAULT_BATCH_TOKENS)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    announce(f"profiling {config.target.name_or_path} on {target.device} ({dtype_name(target.dtype)}, "
             f"{torch.get_num_threads()} threads, load average {'/'.join(f'{x:.2f}' for x in load) if load else 'n/a'}), "
             f"context {p.context_len}, B = {sizes}")
    profile = profile_sps_runs(target, sizes, context_len=p.context_len, warmup=p.warmup, repeats=p.repeats,
                               tokens_per_request=p.tokens_per_request or None, progress=progress)
    table = profile.table
    for b, median, (lo, hi), kept in zip(profile.batch_tokens, profile.median_s, profile.steps_per_sec_interval,
                                         table.sample_steps_per_sec):
        announce(f"  B = {b:>5}: {median * 1e3:9.2f} ms  {1 / median:9.2f} steps/s [{lo:.2f}, {hi:.2f}]"
                 f"{'' if kept == 1 / median else f' (table {kept:.2f}: within the noise)'}  "
                 f"{b / median:10.1f} tokens/s")
    meta = {"target": config.target.name_or_path, "torch": torch.__version__,
            "load_average_before": list(load) if load else None, "config": config.to_dict()}
    return write_profile(profile, config.path(p.out, "sps.json"), meta)


def interleave(sets: Sequence[Sequence[Any]]) -> list[Any]:
    """Round-robin over the benchmarks' prompt lists, so that any R requests mix domains."""
    queues = [list(v) for v in sets]
    pooled = []
    while any(queues):
        for q in queues:
            if q:
                pooled.append(q.pop(0))
    return pooled


def simulate(config: Config, *, progress: Callable[[Any], None] | None = None,
             announce: Announce = _silent, resume: bool | None = None) -> tuple[list[Any], Path]:
    """Serve `serve.num_prompts` prompts per benchmark under every policy of `serve.policy`
    (`SIMULATE_POLICIES` when empty) at every R of `serve.concurrencies` (the drafter of
    `eval.draft`, or a fresh one); write
    results.json/.md, rounds.jsonl, the plots and config.json to `serve.out` (default
    <run_dir>/simulate). Returns the results and the folder.

    Cells are served R by R. On the batched engine the cells of one R still to serve are served
    together with one target-only decode at that R, step by step in turn
    (``dspark.scheduling.simulator.serve_together``): each cell's wall clock is compared with
    target-only decoding of the same minutes, so the machine's drift moves both alike. Each batched
    cell gets its τ interval (``add_tau_intervals``).
    Resumes cell by cell: config.json is written before any model is loaded, each finished
    (policy, R) cell appends its rounds to rounds.jsonl and then its result to cells.jsonl
    (fsynced; the cells line commits the cell), and a rerun on the folder serves only the
    cells not yet committed (every cell starts from the same seeds, so the result is that of
    an uninterrupted run; on the batched engine the cells of one R are committed when all of them
    are served, and a rerun serves the uncommitted ones with a new target-only decode). ``resume``
    as in ``dspark.evaluation.evaluate.evaluate``: None continues a folder of the same config,
    True requires one, False starts over."""
    from dspark.evaluation.report import write_results

    sps, policies = _simulation_policies(config)
    out = config.path(config.serve.out, "simulate")
    done = _open_cells(out, config, resume)
    run = _open_simulation(config, sps, announce)
    cells: dict[tuple[str, int], Any] = {}
    for concurrency in config.serve.concurrencies:
        pending = [spec for spec in policies if (spec, int(concurrency)) not in done]
        served = dict(zip(pending, _simulate_cells(config, run, pending, concurrency, announce))) if pending else {}
        for spec in policies:
            key = (spec, int(concurrency))
            if key in done:
                cells[key] = done[key]
            else:
                cells[key] = served[spec]
                _append_cell(out, spec, cells[key])
            if progress is not None:
                progress(cells[key])
    results = [cells[(spec, int(r))] for spec in policies for r in config.serve.concurrencies]
    add_tau_intervals(results)
    out = write_results(out, results, _simulation_summary(config, run, policies))
    return results, out


def add_tau_intervals(results: Sequence[Any]) -> None:
    """Give every batched serving cell of a grid its τ with the 95 % interval over its requests
    (``SimResult.tau_ci``, ``dspark.evaluation.paired.serving_tau``). Cells of the per-request engine,
    or without rounds, keep None."""
    from dspark.evaluation.paired import serving_tau

    for result in results:
        if result.engine == "batched" and result.rounds:
            tau = serving_tau(result)
            result.tau_ci = [tau.lo, tau.hi]


@dataclasses.dataclass
class _Simulation:
    """What every (policy, R) cell of one ``simulate`` run shares."""

    target: Any
    drafter: Any
    origin: str  # where the drafter came from (``dspark.build.load_models``)
    temps: Any  # the STS temperatures [γ], or None (raw confidences)
    sets: dict[str, list[Any]]  # benchmark -> its prompts
    prompts: list[Any]  # rendered, benchmarks interleaved
    keys: list[tuple[str, int]]  # (benchmark, index) of each prompt: its request seed
    eos: list[int]
    sps: Any  # the table the policies decide on
    profile: Any  # the profile behind it, or None
    price: Any  # the table the SPS clock prices on
    # R -> the batched loop's own forwards, R rows of 1..γ+1 tokens, profiled here
    layouts: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def gamma(self) -> int:
        return self.drafter.config.block_size


def _simulation_policies(config: Config) -> tuple[Any, list[str]]:
    """The SPS table of `serve.sps` and the policies to serve, each made once so that a bad spec
    fails before any model is loaded."""
    from dspark.config import SIMULATE_POLICIES
    from dspark.scheduling.algorithm1 import SPSTable
    from dspark.scheduling.simulator import make_policy

    s = config.serve
    if not s.sps:
        raise ValueError("serve.sps is empty: give the SPS table of `dspark profile-sps` (--sps FILE)")
    sps = SPSTable.from_json(s.sps)
    policies = list(s.policy) or list(SIMULATE_POLICIES)
    for spec in policies:  # fail on a bad spec before loading any model
        make_policy(spec, sps)
    return sps, policies


def _open_simulation(config: Config, sps: Any, announce: Announce) -> _Simulation:
    """The models, the STS temperatures, the prompts and EOS ids of a run, and the table its SPS clock
    prices on; announces what was loaded."""
    from dspark.build import load_models
    from dspark.evaluation.evaluate import default_eos_ids
    from dspark.scheduling.calibration import load_sts_json
    from dspark.scheduling.sps_profile import profile_path

    s = config.serve
    target, drafter, origin = load_models(config)
    gamma = drafter.config.block_size
    temps = load_sts_json(s.sts, gamma) if s.sts else None
    sets, prompts, keys = _simulation_prompts(config, target.tokenizer)
    eos = default_eos_ids(target, target.tokenizer)
    announce(f"target {config.target.name_or_path} on {target.device}; drafter {origin}; γ = {gamma}; "
             f"{len(prompts)} prompts from {', '.join(f'{n} ({len(v)})' for n, v in sets.items())}; "
             f"STS {'from ' + s.sts if temps is not None else 'off (raw confidences)'}")
    profile = _table_profile(s.sps, sps)
    # The policies decide on the noise-aware table; the clock prices on the measured medians when
    # the profile behind the table is there (ServeSettings.price_sps), else on the table itself.
    price = profile.measured_table if profile is not None else sps
    announce("SPS clock: " + (f"the measured medians and their intervals from {profile_path(s.sps)}" if profile
                              else "the table, no interval"))
    return _Simulation(target, drafter, origin, temps, sets, prompts, keys, eos, sps, profile, price)


def _simulate_cells(config: Config, run: _Simulation, specs: list[str], concurrency: int,
                    announce: Announce) -> list[Any]:
    """The (policy, R) cells of ``specs`` at one R, served (on the batched engine together, with one
    target-only decode: ``serve_together``), each with the SPS clock's interval (and, on the batched
    engine, the difference of its two clocks) where a profile is there."""
    from dspark.evaluation.clocks import serving_clock_difference, serving_wall_ratio
    from dspark.scheduling.simulator import DecodeSettings, ServeSettings, simulate_grid
    from dspark.scheduling.sps_profile import table_interval

    s, e = config.serve, config.eval
    # The batched engine's clock prices each forward from a profile of that forward's own shape.
    cell_profile = _layout(config, run, int(concurrency), announce) if s.engine == "batched" else run.profile
    cell_price = cell_profile.measured_table if cell_profile is not None else run.price
    if s.engine == "batched":
        announce(f"R = {concurrency}: {', '.join(specs)} and target-only decoding, step by step in turn")
    per_cell = (s.num_requests or max(len(run.prompts), int(concurrency))) if s.cycle else len(run.prompts)
    bar = tqdm(total=per_cell * len(specs), desc=f"simulate R = {concurrency}", unit="req", dynamic_ncols=True)
    finished: dict[int, int] = {}

    def on_step(result: Any) -> None:  # requests finished over the cells of this R
        done = sum(1 for r in result.requests if r["finished"])
        bar.update(done - finished.get(id(result), 0))
        finished[id(result)] = done

    results = simulate_grid(
        run.target, run.drafter, run.prompts, policies=specs, concurrencies=[concurrency],
        decoding=DecodeSettings(max_new_tokens=s.max_new_tokens, temperature=e.temperature, seed=e.seed,
                                eos_token_ids=run.eos),
        serving=ServeSettings(sps=run.sps, price_sps=cell_price, sts_temperatures=run.temps,
                              draft_overhead=s.draft_overhead, engine=s.engine),
        cycle=s.cycle, num_requests=s.num_requests or None, keys=run.keys, on_step=on_step)
    bar.close()
    for result in results:
        if result.engine == "batched" and result.target_only_requests and result.step_log:
            result.wall_ci = list(serving_wall_ratio(result)[1:3])
        if cell_profile is not None:
            result.table_ci = list(table_interval(result, cell_profile, seed=e.seed))
            if result.engine == "batched":
                result.clocks = dataclasses.asdict(serving_clock_difference(result, cell_profile, seed=e.seed))
    return results


def _layout(config: Config, run: _Simulation, rows: int, announce: Announce) -> Any:
    """The batched loop's profile at R = ``rows`` (``_layout_profile``), profiled once per run."""
    if rows not in run.layouts:
        run.layouts[rows] = _layout_profile(run.target, run.prompts, rows, run.gamma, config.serve.max_new_tokens,
                                            config.eval.seed, announce)
    return run.layouts[rows]


def _simulation_summary(config: Config, run: _Simulation, policies: list[str]) -> dict[str, Any]:
    """results.json's config: what was served, and how."""
    s, e = config.serve, config.eval
    return {
        "target": config.target.name_or_path, "drafter": run.origin, "gamma": run.gamma, "sps": run.sps.to_dict(),
        "price_sps": run.price.to_dict(),
        "sts_temperatures": None if run.temps is None else [float(t) for t in run.temps], "policies": policies,
        "concurrencies": list(s.concurrencies), "benchmarks": {n: len(v) for n, v in run.sets.items()},
        "num_prompts": len(run.prompts), "split": e.split, "max_new_tokens": s.max_new_tokens,
        "temperature": e.temperature,
        "seed": e.seed, "cycle": s.cycle, "num_requests": s.num_requests or None,
        "draft_overhead": s.draft_overhead, "eos_token_ids": run.eos, "engine": s.engine,
        # the batched engine's clock: R -> the table of its own forwards (R rows × 1..γ+1 tokens)
        "layout_sps": {str(r): {**p.measured_table.to_dict(), "context_len": p.context_len, "rows": p.rows,
                                "row_lengths": p.row_lengths}
                       for r, p in sorted(run.layouts.items())},
    }

def _layout_profile(target: Any, prompts: Sequence[Sequence[int]], rows: int, gamma: int, max_new_tokens: int,
                    seed: int, announce: Announce) -> Any:
    """The SPS profile of the batched serving loop's forwards at R = ``rows``: R rows of 1..γ+1 tokens,
    row i holding the expected i-th shortest of R prompts drawn at random (the loop admits its requests
    in the benchmarks' interleaved order) plus half the new tokens. A forward's attention reads each
    row's own columns (``dspark.kernels.attention.row_extents``), so its cost depends on every row's
    length: rows of one length, the longest, would price the forwards that read fewer columns as
    dearly as those that read the most."""
    from dspark.scheduling.sps_profile import expected_order_statistics, profile_sps_runs

    expected = expected_order_statistics([len(p) for p in prompts], rows)
    expected += [expected[-1]] * (rows - len(expected))  # fewer prompts than rows: the rest as the longest
    lengths = [max(1, int(round(e + max_new_tokens / 2))) for e in expected]
    profile = profile_sps_runs(target, [rows * q for q in range(1, gamma + 2)], context_len=max(lengths),
                               warmup=1, repeats=LAYOUT_REPEATS, rows=rows, seed=seed, row_lengths=lengths)
    announce(f"SPS clock at R = {rows} (batched engine): the forwards of {rows} rows × 1..{gamma + 1} "
             f"tokens after {min(lengths)}..{max(lengths)} cached, profiled here ({LAYOUT_REPEATS} sweeps)")
    return profile


def _simulation_prompts(config: Config,
                        tokenizer: Any) -> tuple[dict[str, list[Any]], list[Any], list[tuple[str, int]]]:
    """The benchmarks' prompts the simulation serves (`serve.num_prompts` per benchmark of
    `eval.data_dir`, or of the built-in sets), them rendered, benchmarks interleaved, and their
    keys in the same order: (benchmark, index in its prompt list), the request index `dspark eval`
    gives that prompt, so that both seed it alike (`dspark.seeds.request_seed`)."""
    from dspark.data.benchmarks import load_benchmark_prompts
    from dspark.data.render import render_prompt

    s, e = config.serve, config.eval
    if e.builtin_prompts:
        from dspark.data.prompts import builtin_eval_sets

        sets = load_benchmark_prompts(builtin_eval_sets(), None, s.num_prompts or None, e.seed, split=e.split)
    else:
        sets = load_benchmark_prompts(e.data_dir, list(e.benchmarks), s.num_prompts or None, e.seed, split=e.split)
    prompts = [render_prompt(tokenizer, conv, enable_thinking=False) for conv in interleave(list(sets.values()))]
    keys = interleave([[(name, i) for i in range(len(convs))] for name, convs in sets.items()])
    return sets, prompts, keys


def _table_profile(sps_path: str | os.PathLike, table: Any) -> Any:
    """The profile behind the table at ``sps_path`` when it is there and its table is this one
    (else None: no interval for the SPS clock)."""
    from dspark.scheduling.sps_profile import load_profile, profile_path

    path = profile_path(sps_path)
    if not path.exists():
        return None
    profile = load_profile(path)
    ours = profile.table
    if list(ours.sample_batch_tokens) != list(table.sample_batch_tokens) or not all(
            math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours.sample_steps_per_sec, table.sample_steps_per_sec)):
        return None
    return profile


LAYOUT_REPEATS = 20  # sweeps of the batched engine's per-R profile (dspark simulate; its noise enters the clock check)
_CELL_ROWS = ("rounds", "step_log")  # SimResult fields kept in rounds.jsonl, or not kept
_SIM_IGNORED = ("threads", "serve.out", "out_dir")  # config fields that do not change a cell


def _open_cells(out: Path, config: Config, resume: bool | None) -> dict[tuple[str, int], Any]:
    """Check or write ``out/config.json`` and read back the committed cells ((spec, R) -> SimResult);
    rewrite rounds.jsonl and cells.jsonl without a torn or uncommitted tail."""
    from dspark.evaluation.journal import check_settings
    from dspark.io.jsonl import read_jsonl, write_jsonl
    from dspark.scheduling.simulator import SimResult

    out.mkdir(parents=True, exist_ok=True)
    files = ("cells.jsonl", "rounds.jsonl", "results.json", "results.md", "figure8.png", "frontier.png")
    if resume is False:
        for name in ("config.json", *files):
            (out / name).unlink(missing_ok=True)
    if not check_settings(out, config.to_dict(), "config.json", _SIM_IGNORED):
        if resume is True:
            raise FileNotFoundError(f"--resume: {out / 'config.json'} not found, so {out} holds no simulation "
                                    "to resume; drop --resume to start one")
        for name in files:
            (out / name).unlink(missing_ok=True)
        atomic_write_text(out / "config.json", json.dumps(config.to_dict(), indent=2) + "\n")
    cells, _ = read_jsonl(out / "cells.jsonl")
    rounds, _ = read_jsonl(out / "rounds.jsonl")
    done: dict[tuple[str, int], Any] = {}
    floats = {f.name for f in dataclasses.fields(SimResult) if isinstance(f.default, float)}
    for cell in cells:
        key = (cell.pop("spec"), int(cell["concurrency"]))
        cell = {k: math.nan if v is None and k in floats else v for k, v in cell.items()}  # JSON keeps NaN as null
        rows = [{k: v for k, v in r.items() if k not in ("policy", "concurrency")}
                for r in rounds if (r["policy"], r["concurrency"]) == (cell["policy"], key[1])]
        done[key] = SimResult(**cell, rounds=rows)
    kept = {(r.policy, r.concurrency) for r in done.values()}
    write_jsonl(out / "rounds.jsonl", [r for r in rounds if (r["policy"], r["concurrency"]) in kept])
    write_jsonl(out / "cells.jsonl", [{"spec": k[0], **_cell_fields(v)} for k, v in done.items()])
    return done


def _cell_fields(result: Any) -> dict[str, Any]:
    """A SimResult as cells.jsonl keeps it: every field but the rounds, the requests without their tokens."""
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name not in _CELL_ROWS}
    fields["requests"] = [{k: v for k, v in r.items() if k != "result"} for r in result.requests]
    return fields


def _append_cell(out: Path, spec: str, result: Any) -> None:
    """A finished cell: its rounds (with spec, policy and R), then its result, which commits it."""
    from dspark.io.jsonl import append_jsonl

    append_jsonl(out / "rounds.jsonl", [{"policy": result.policy, "concurrency": result.concurrency, **row}
                                        for row in result.rounds])
    append_jsonl(out / "cells.jsonl", [{"spec": spec, **_cell_fields(result)}])


def read_round_logs(paths: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """The rows of rounds.jsonl files; with several files each row records its file's index
    as "source" (so that request ids of different runs stay apart)."""
    rows = []
    for source, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
                rows.append({**row, "source": source} if len(paths) > 1 else row)
    return rows


def round_log_split(path: str | os.PathLike) -> str | None:
    """The split ("all", "dev" or "test") of the evaluation that wrote a rounds.jsonl, from the
    settings.json or report.json beside it; None when neither says (a log copied elsewhere)."""
    folder = Path(path).parent
    for name in ("settings.json", "report.json"):
        try:
            with (folder / name).open(encoding="utf-8") as f:
                config = json.load(f).get("config") or {}
        except (OSError, ValueError, AttributeError):
            continue
        return str(config.get("split", "all"))
    return None


def calibrate(config: Config) -> tuple[dict[str, Any], dict[str, str]]:
    """Fit STS on the round logs `calibrate.rounds` (fit / test split by request) and write
    the STS JSON at `calibrate.out` (default <run_dir>/sts.json) with its reliability
    diagrams; returns the calibration report and the written paths. The report's
    ``fitted_on`` names each round log and the split of the evaluation that wrote it."""
    from dspark.scheduling.calibration import calibrate_rounds
    from dspark.evaluation.report import write_sts_report

    c = config.calibrate
    if not c.rounds:
        raise ValueError("calibrate.rounds is empty: give the rounds.jsonl of `dspark eval` (--rounds FILE ...)")
    report, evaluated = calibrate_rounds(read_round_logs(c.rounds), fit_fraction=c.fit_fraction, seed=c.seed,
                                         n_bins=c.bins, min_events=c.min_events, folds=c.folds)
    # Which prompts the temperatures were fitted on: a policy scored on other prompts (the test split,
    # when these are dev) is scored on rounds the fit never saw.
    report["fitted_on"] = [{"rounds": os.fspath(path), "split": round_log_split(path)} for path in c.rounds]
    out = config.path(c.out, "sts.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    return report, write_sts_report(out, report, evaluated, n_bins=c.bins)
