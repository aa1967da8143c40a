"""Serving simulator: R concurrent requests, a verification-length policy and a profiled clock (paper Fig. 8).

``simulate`` serves a prompt list at concurrency R under one policy through the serving loop
(``dspark.scheduling.serving_loop.run_requests``; ``dspark.scheduling.batched_serving`` with the batched
engine): every draft, confidence and acceptance is real, and each lockstep step is charged
1 / SPS(B), B = Σ_r (1 + ℓ_r), on the SPS clock (``dspark.scheduling.sps_clock``); Θ = tokens emitted
per simulated second. ``simulate_grid`` runs every (policy, R) cell on the same requests and seeds.

Settings (``DecodeSettings``, ``ServeSettings``), results (``SimResult``), policies (``make_policy``,
``POLICY_HELP``) and the loop (``run_requests``) are importable from here. What is real and what is
modelled, the clock's charges, slots and seeding: docs/scheduling.md. Tables and files of a run:
``dspark.evaluation.report`` (``results_markdown``, ``write_results``); figures: ``dspark.evaluation.plots``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dspark.scheduling.policies import POLICY_HELP, Policy, PolicySpec, make_policy
from dspark.scheduling.results import Job, SimResult
from dspark.scheduling.serving_loop import run_requests
from dspark.scheduling.settings import DecodeSettings, ServeSettings
from dspark.scheduling.sps_clock import sps_table
from dspark.seeds import derive_seed, request_seed

__all__ = [
    "DecodeSettings", "Job", "Policy", "POLICY_HELP", "ServeSettings", "SimResult", "job_seed", "make_policy",
    "run_requests", "serve_together", "simulate", "simulate_grid", "sps_table",
]


def job_seed(seed: int, index: int) -> int:
    """The generator seed of request ``index`` of a run seeded with ``seed``."""
    return derive_seed(seed, index, 1)


def simulate(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    decoding: DecodeSettings,
    serving: ServeSettings,
    cycle: bool = True,
    num_requests: int | None = None,
    keys: Sequence[tuple[str, int]] | None = None,
    on_step: Callable[[SimResult], None] | None = None,
    target_only: bool = True,
) -> SimResult:
    """Simulate serving ``prompts`` (token-id lists) at concurrency R = ``serving.concurrency``
    under ``serving.policy``, on the clock of ``serving.sps`` (required).

    ``cycle=True``: request i uses prompt i mod N and exactly R requests are
    live at every step; the run stops once ``num_requests`` requests have
    finished (default max(N, R)). ``cycle=False``: every prompt is served once
    (``num_requests`` must be None) and the last steps run with fewer live
    requests. ``keys``: one (benchmark, index in that benchmark) per prompt; request i then
    draws from a generator seeded with ``request_seed(decoding.seed, *keys[i mod N], cycle=i // N)``
    (the seed ``dspark eval`` gives that request at cycle 0) and is tagged ``keys[i mod N]``; without
    them it draws from ``job_seed(decoding.seed, i)`` and is tagged i mod N.
    See ``run_requests`` for one step and docs/scheduling.md for the model. With the batched engine
    (``serving.engine``) and ``target_only``, target-only decoding of the same requests at the same R
    is timed too, step by step in turn with the cell (``serve_together``; ``SimResult.target_only_wall``).
    """
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt (a list of token ids)")
    sps = _required_table(serving.sps)
    serving = dataclasses.replace(serving, sps=sps, price_sps=sps_table(serving.price_sps))
    prompts = [list(p) for p in prompts]
    make_jobs, stop = _jobs(prompts, keys, decoding.seed, cycle, num_requests, serving.concurrency)
    if serving.engine == "batched":
        [result] = serve_together(target, drafter, make_jobs, [serving], decoding=decoding, stop=stop,
                                  target_only=target_only, on_step=on_step)
        return result
    return run_requests(target, drafter, make_jobs(), decoding=decoding, serving=serving, stop_after_finished=stop,
                        on_step=on_step)


def _required_table(sps: Any) -> Any:
    """The SPS table of ``ServeSettings.sps``, which the simulator needs to price its steps."""
    table = sps_table(sps)
    if table is None:
        raise ValueError("ServeSettings.sps is None; simulate charges every step 1 / SPS(B): give the table of "
                         "`dspark profile-sps` (its JSON path or SPSTable.from_json('sps.json'))")
    return table


def _jobs(prompts: list[list[int]], keys: Sequence[tuple[str, int]] | None, seed: int, cycle: bool,
          num_requests: int | None, concurrency: int) -> tuple[Callable[[], Iterable[Job]], int | None]:
    """(a maker of ``simulate``'s job stream, each call a fresh one from request 0; the stop rule:
    requests finished, or None for every prompt once)."""
    job = _job_maker(prompts, keys, seed)
    if not cycle:
        if num_requests is not None:
            raise ValueError("num_requests applies to cycle=True only; without cycling every prompt runs once")
        return (lambda: [job(i) for i in range(len(prompts))]), None
    stop = max(len(prompts), concurrency) if num_requests is None else num_requests
    if isinstance(stop, bool) or not isinstance(stop, int) or stop < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    return (lambda: (job(i) for i in itertools.count())), stop


def serve_together(target: Any, drafter: Any, make_jobs: Callable[[], Iterable[Job]], cells: Sequence[ServeSettings],
                   *, decoding: DecodeSettings, stop: int | None, target_only: bool = True,
                   on_step: Callable[[SimResult], None] | None = None) -> list[SimResult]:
    """Serve the same jobs under every cell of ``cells`` (one R, batched engine) and, with ``target_only``,
    decode them with the target alone at that R, all step by step in turn
    (``dspark.scheduling.batched_serving.interleaved``): every cell's wall clock and the target-only
    decode it is compared with (``SimResult.target_only_wall``, ``target_only_requests``) meet the
    machine's speed of the same minutes. Each decode keeps its own rows, generators and clocks, so a
    cell decodes the rounds it decodes alone; a prompt is prefilled once for all of them
    (``PrefillStore``: the first decode to admit it runs the forward, the others start from its
    cache and draw x_0 from its logits with their own generators; neither clock counts prefills).
    ``make_jobs()`` gives each decode its own job stream."""
    from dspark.decoding.prefill_store import PrefillStore
    from dspark.scheduling.batched_serving import BatchedRun, TargetOnlyRun, interleaved

    rows = {int(c.concurrency) for c in cells}
    if len(rows) != 1 or any(c.engine != "batched" for c in cells):
        raise ValueError(f"serve_together serves cells of one R on the batched engine, got R = {sorted(rows)} and "
                         f"engines {sorted({c.engine for c in cells})}")
    store = PrefillStore()
    runs = [BatchedRun(target, drafter, make_jobs(), decoding=decoding, serving=cell, stop_after_finished=stop,
                       on_step=on_step, prefills=store) for cell in cells]
    base = TargetOnlyRun(target, make_jobs(), decoding=decoding, rows=rows.pop(), stop_after_finished=stop,
                         prefills=store) if target_only else None
    interleaved([*runs, *([base] if base is not None else [])])
    results = [run.finish() for run in runs]
    if base is not None:
        wall = base.finish()
        for result in results:
            set_target_only(result, wall)
    return results


def set_target_only(result: SimResult, wall: dict[str, Any]) -> None:
    """Record target-only decoding of the run's requests (``target_only_wall``'s dict) in ``result``:
    its tokens/s and each request's tokens, share of the steps and of their forwards, timings and whether
    it ended at EOS, paired with the run's by index."""
    result.target_only_wall = float(wall["throughput"])
    keep = ("index", "tag", "tokens", "step_tokens", "step_s", "step_forwards", "timings", "finished_by_eos")
    result.target_only_requests = [{k: r[k] for k in keep if k in r} for r in wall["requests"]]


def _job_maker(prompts: list[list[int]], keys: Sequence[tuple[str, int]] | None, seed: int) -> Callable[[int], Job]:
    """The job of admitted request i: prompt i mod N, seeded and tagged by its key and cycle i // N
    (``request_seed``), or by i alone (``job_seed``) without keys."""
    n = len(prompts)
    if keys is None:
        return lambda i: Job(prompts[i % n], job_seed(seed, i), i % n)
    bad = [k for k in keys if not (isinstance(k, (tuple, list)) and len(k) == 2 and isinstance(k[0], str)
                                   and isinstance(k[1], (int, np.integer)) and not isinstance(k[1], bool))]
    if bad:
        raise ValueError(f"keys must be (benchmark, index) pairs, one per prompt, got {bad[0]!r}")
    keys = [(k[0], int(k[1])) for k in keys]
    if len(keys) != n:
        raise ValueError(f"keys has {len(keys)} entries but there are {n} prompts; give one (benchmark, index) "
                         "per prompt, in the prompts' order, or keys=None")
    return lambda i: Job(prompts[i % n], request_seed(seed, *keys[i % n], cycle=i // n), keys[i % n])


def simulate_grid(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    policies: Sequence[PolicySpec],
    concurrencies: Sequence[int],
    decoding: DecodeSettings,
    serving: ServeSettings,
    cycle: bool = True,
    num_requests: int | None = None,
    keys: Sequence[tuple[str, int]] | None = None,
    progress: Callable[[SimResult], None] | None = None,
    target_only: bool = True,
    on_step: Callable[[SimResult], None] | None = None,
) -> list[SimResult]:
    """``simulate`` for every (policy, concurrency) pair of the grid, ``serving`` giving the rest
    (SPS table, STS temperatures, draft overhead); results policy by policy, R by R. Each cell makes
    a fresh policy and uses the same seed, so every cell serves the same requests with the same random
    streams. ``keys``: the prompts' (benchmark, index) keys, as ``simulate`` takes them.
    ``progress`` is called with each finished result, ``on_step`` with a cell's result after each of its
    steps (as ``simulate`` calls it). On the batched engine the cells of one R are
    served together with one target-only decode at that R (``serve_together``: every cell's wall
    clock against target-only decoding of the same minutes)."""
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt (a list of token ids)")
    serving = dataclasses.replace(serving, sps=sps_table(serving.sps), price_sps=sps_table(serving.price_sps))
    cells: dict[tuple[int, int], SimResult] = {}
    for r in concurrencies:
        specs = [dataclasses.replace(serving, policy=spec, concurrency=r) for spec in policies]
        if serving.engine == "batched":
            _required_table(serving.sps)
            make_jobs, stop = _jobs([list(p) for p in prompts], keys, decoding.seed, cycle, num_requests, r)
            found = serve_together(target, drafter, make_jobs, specs, decoding=decoding, stop=stop,
                                   target_only=target_only, on_step=on_step)
        else:
            found = [simulate(target, drafter, prompts, decoding=decoding, serving=cell, cycle=cycle,
                              num_requests=num_requests, keys=keys, on_step=on_step) for cell in specs]
        for i, result in enumerate(found):
            cells[(i, r)] = result
            if progress is not None:
                progress(result)
    return [cells[(i, r)] for i in range(len(policies)) for r in concurrencies]
