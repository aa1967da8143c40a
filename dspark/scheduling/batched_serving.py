"""The serving loop on the batched decoder: R requests per drafter and target forward, on two clocks.

``dspark.scheduling.serving_loop.run_requests`` steps R live requests in lockstep under a policy; with
``ServeSettings.engine = "batched"`` it runs here, on ``dspark.decoding.batched.SpeculativeBatch``:
every step the policy's ``plan`` picks the rows that draft, one drafter forward drafts them all, the
policy picks ℓ_r for every row from the confidences of the whole batch (Algorithm 1's own setting,
paper Section 3.2.2), and one target forward verifies every row, padded to 1 + max ℓ_r.

The wall clock times each step (prefills excluded), set against target-only decoding of the same
requests at the same R (``target_only_wall``); the SPS clock prices the padded forward,
rows · (1 + max ℓ_r) tokens. docs/scheduling.md, "The batched engine", says what each clock charges.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from dspark.decoding.batch_jobs import job_generator
from dspark.decoding.batched import BatchRow, SpeculativeBatch, TargetBatch
from dspark.scheduling.results import SimResult
from dspark.scheduling.serving_loop import _account_step, _checked_lengths, _confidence_matrix, _start_run
from dspark.scheduling.sps_clock import MEASURED, on_table_scale, speed_at, step_seconds

__all__ = ["BatchedRun", "TargetOnlyRun", "interleaved", "run_batched", "target_only_wall"]


@torch.inference_mode()
def run_batched(target: Any, drafter: Any, jobs: Iterable[Any], *, decoding: Any, serving: Any,
                stop_after_finished: int | None = None, on_step: Callable[[Any], None] | None = None,
                prefills: Any = None) -> Any:
    """``run_requests`` on the batched decoder (module docstring); arguments and result as there.
    The result's ``engine`` is "batched"; ``step_wall_s`` holds the wall clock of the steps."""
    run = BatchedRun(target, drafter, jobs, decoding=decoding, serving=serving,
                     stop_after_finished=stop_after_finished, on_step=on_step, prefills=prefills)
    while run.advance():
        pass
    return run.finish()


class BatchedRun:
    """``run_batched`` one step at a time: ``advance`` admits requests into free rows and runs one step
    of every live row (False once the run has stopped), ``finish`` returns the ``SimResult``. Several
    runs advanced in turn (``interleaved``) share the machine's moments step by step; each run's
    clocks count its own steps and prefills only (``SimResult.wall_s``: the seconds of its own
    ``advance`` calls)."""

    def __init__(self, target: Any, drafter: Any, jobs: Iterable[Any], *, decoding: Any, serving: Any,
                 stop_after_finished: int | None = None, on_step: Callable[[Any], None] | None = None,
                 prefills: Any = None) -> None:
        self.policy, self.sps, self.temps, clock, self.overhead_mode, eos, self.device = _start_run(
            serving, decoding, target)
        self.concurrency = rows = serving.concurrency
        sps = self.sps
        self.result = SimResult(policy=self.policy.name, concurrency=rows, draft_clock=clock, engine="batched",
                                target_step_s=math.nan if sps is None else 1.0 / speed_at(sps, 1),
                                target_only_throughput=math.nan if sps is None else rows * speed_at(sps, rows))
        self.batch = SpeculativeBatch(target, drafter, max_new_tokens=decoding.max_new_tokens,
                                      temperature=decoding.temperature, eos_token_ids=eos, prefills=prefills)
        self.index_of: dict[int, int] = {}  # id(BatchRow) -> request index
        self.pending = iter(jobs)
        self.exhausted = False
        self.finished = 0
        self.stop_after_finished = stop_after_finished
        self.on_step = on_step
        self.running = True

    @property
    def emitted(self) -> int:
        """Tokens the run's steps have emitted so far (``interleaved`` advances the run that made fewest)."""
        return self.result.tokens

    def _close(self, request: BatchRow) -> None:
        self.finished += 1
        out = request.result()
        self.result.requests[self.index_of[id(request)]].update(
            tokens=len(out.tokens), rounds=len(out.rounds), finished=True, finished_by_eos=out.finished_by_eos,
            timings=dict(out.timings), result=out)

    def _stopped(self) -> bool:
        return self.stop_after_finished is not None and self.finished >= self.stop_after_finished

    @torch.inference_mode()
    def advance(self) -> bool:
        """Admit into free rows, then one step of every live row; False (and nothing run) once every job
        has finished or ``stop_after_finished`` of them have."""
        if not self.running:
            return False
        started = time.perf_counter()
        batch, result = self.batch, self.result
        while not self.exhausted and not self._stopped() and (batch.free_rows() or len(batch.rows) < self.concurrency):
            job = next(self.pending, None)
            if job is None:
                self.exhausted = True
                break
            request = batch.admit(job.prompt_ids, job_generator(self.device, job.seed), job.tag)
            self.index_of[id(request)] = len(result.requests)
            result.requests.append({"index": len(result.requests), "tag": job.tag,
                                    "prompt_tokens": len(job.prompt_ids), "tokens": len(request.tokens),
                                    "rounds": 0, "finished": False})
            if request.done:
                self._close(request)
        batch.shrink()
        if not batch.rows or self._stopped():
            self.running = False
        else:
            for request in _step(batch, self.policy, self.temps, self.sps, self.overhead_mode, result, self.index_of):
                self._close(request)
        result.wall_s += time.perf_counter() - started
        if self.running and self.on_step is not None:
            self.on_step(result)
        return self.running

    def finish(self) -> Any:
        """The run's ``SimResult`` (requests still running count the tokens they made)."""
        result = self.result
        for request in self.batch.rows:
            if request is not None:
                result.requests[self.index_of[id(request)]].update(
                    tokens=len(request.tokens), rounds=len(request.rounds), timings=dict(request.result().timings))
        _record_step_shares(result)
        if self.sps is not None and result.draft_clock == MEASURED:
            on_table_scale(result)
        return result


def interleaved(runs: Sequence[Any]) -> None:
    """Advance ``runs`` (``BatchedRun``, ``TargetOnlyRun``) in turn until each has stopped, always the one
    whose steps have emitted the fewest tokens: runs over the same requests then move through them
    together, so that every run meets the machine's speed of the same minutes (a machine that speeds
    up or slows down moves all of them alike). Each run keeps its own rows, generators and clocks."""
    live = list(runs)
    while live:
        run = min(live, key=lambda r: r.emitted)
        if not run.advance():
            live.remove(run)


def _record_step_shares(result: Any) -> None:
    """Every request's ``step_tokens`` (the tokens its rounds emitted) and ``step_s`` (its share of the wall
    seconds of the steps it was live in: each step's seconds over its rows), as ``target_only_wall`` records
    them: what pairs two runs of the same jobs request by request (``dspark.evaluation.paired``)."""
    wall = {int(step["step"]): float(step["wall_s"]) for step in result.step_log}
    for request in result.requests:
        request["step_tokens"], request["step_s"] = 0, 0.0
    for row in result.rounds:
        request = result.requests[int(row["request"])]
        request["step_tokens"] += int(row["emitted"])
        request["step_s"] += wall[int(row["step"])] / float(row["rows"])


def _step(batch: SpeculativeBatch, policy: Any, temps: np.ndarray | None, sps: Any, overhead_mode: Any,
          result: Any, index_of: dict[int, int]) -> list[BatchRow]:
    """One step of every row: plan, draft, schedule, verify; accounted into ``result``."""
    live = list(batch.rows)
    ids = [index_of[id(r)] for r in live]
    step_start = time.perf_counter()
    before = dict(batch.clock.totals)
    drafting = np.ones(len(live), dtype=bool) if policy.plan is None else np.asarray(policy.plan(ids), dtype=bool)
    schedule_s = time.perf_counter() - step_start
    if drafting.shape != (len(live),):
        raise ValueError(f"policy {policy.name!r}: plan must return {len(live)} booleans, got {drafting!r}")
    batch.draft(drafting.tolist())
    draft_s = batch.clock.totals.get("draft", 0.0) - before.get("draft", 0.0)
    if policy.on_draft_time is not None and drafting.any():
        policy.on_draft_time(draft_s)
    started = time.perf_counter()
    raw = batch.confidences()
    if drafting.any():
        gamma = batch.gamma
        conf = np.zeros((len(live), gamma))
        drafted = np.flatnonzero(drafting)
        conf[drafted] = _confidence_matrix([raw[r] for r in drafted], gamma, temps, policy)
        lengths = _checked_lengths(policy(ids, conf), len(live), gamma, policy.name)
        if lengths[~drafting].any():
            raise ValueError(f"policy {policy.name!r} gave ℓ > 0 to a request that did not draft at this step")
        a = np.cumprod(conf, axis=1)
    else:
        lengths, a = np.zeros(len(live), dtype=np.int64), np.zeros((len(live), 1))
    schedule_s += time.perf_counter() - started
    batch.clock.totals["schedule"] = batch.clock.totals.get("schedule", 0.0) + schedule_s
    counts = [len(r.tokens) for r in live]
    done = batch.verify(lengths.tolist())
    wall = time.perf_counter() - step_start
    spent = {k: v - before.get(k, 0.0) for k, v in batch.clock.totals.items()}
    for request in live:  # the policy's decision is part of every row's share, like the other phases
        request.timings["schedule"] = request.timings.get("schedule", 0.0) + schedule_s / len(live)

    forward_tokens = len(live) * (1 + int(lengths.max(initial=0)))
    batch_tokens = int(len(live) + lengths.sum())
    step_tokens = 0
    for row, request in enumerate(live):
        record = request.rounds[-1]
        emitted = len(request.tokens) - counts[row]
        step_tokens += emitted
        result.accepted += record.accepted
        result.eos_rounds += record.eos_accepted
        ell = int(lengths[row])
        expected = float(a[row, :ell].sum()) if drafting[row] and raw[row] is not None else None
        result.rounds.append({
            "step": result.steps, "request": ids[row], "tag": request.tag, "round": len(request.rounds) - 1,
            "drafted": bool(drafting[row]), "proposed": record.proposed, "verified": ell,
            "accepted": record.accepted, "eos_accepted": record.eos_accepted, "emitted": emitted,
            "confidences": record.confidences, "expected_accepted": expected, "batch_tokens": batch_tokens,
            "forward_tokens": forward_tokens, "rows": len(live),
        })
        result.requests[ids[row]].update(tokens=len(request.tokens), rounds=len(request.rounds))
    verify_s = spent.get("verify", 0.0)
    overhead_s = sum(v for k, v in spent.items() if k not in ("verify", "prefill"))
    verify_step_s = math.nan if sps is None else 1.0 / speed_at(sps, forward_tokens)
    step_time = step_seconds(verify_step_s, overhead_mode, [draft_s] if drafting.any() else [], overhead_s)
    _account_step(result, live=len(live), drafted=int(drafting.sum()), proposed=int(lengths.sum()),
                  batch=batch_tokens, draft_s=draft_s if drafting.any() else 0.0, overhead_s=overhead_s,
                  step_time=step_time, tokens=step_tokens, verify_s=verify_s, verify_table_s=verify_step_s,
                  verify_step_s=verify_step_s)
    result.step_log[-1].update(priced_tokens=forward_tokens, wall_s=wall)
    result.step_wall_s += wall
    return done


@torch.inference_mode()
def target_only_wall(target: Any, jobs: Iterable[Any], *, decoding: Any, rows: int,
                     stop_after_finished: int | None = None, prefills: Any = None) -> dict[str, Any]:
    """Target-only decoding of ``jobs`` (objects with prompt_ids, seed, tag) with ``rows`` rows on the
    wall clock: ``TargetOnlyRun.finish``'s dict. Stops as ``run_batched`` does (every job finished, or
    ``stop_after_finished`` of them). ``prefills``: a ``PrefillStore`` to take prompt prefills from and
    keep them in, as ``run_batched``."""
    run = TargetOnlyRun(target, jobs, decoding=decoding, rows=rows, stop_after_finished=stop_after_finished,
                        prefills=prefills)
    while run.advance():
        pass
    return run.finish()


class TargetOnlyRun:
    """``target_only_wall`` one step at a time, as ``BatchedRun``: ``advance`` admits into free rows and
    runs one target-only step (one token per row), ``finish`` returns the dict."""

    def __init__(self, target: Any, jobs: Iterable[Any], *, decoding: Any, rows: int,
                 stop_after_finished: int | None = None, prefills: Any = None) -> None:
        self.device = torch.device(getattr(target, "device", "cpu"))
        self.batch = TargetBatch(target, max_new_tokens=decoding.max_new_tokens, temperature=decoding.temperature,
                                 eos_token_ids=list(decoding.eos_token_ids or ()), prefills=prefills)
        self.rows = rows
        self.pending = iter(jobs)
        self.admitted: list[BatchRow] = []
        self.forwards: dict[int, dict[int, float]] = {}  # id(BatchRow) -> {rows of a step: Σ 1 / rows}
        self.exhausted = False
        self.finished = self.tokens = self.steps = 0
        self.wall = 0.0
        self.stop_after_finished = stop_after_finished
        self.running = True

    @property
    def emitted(self) -> int:
        """Tokens the run's steps have emitted so far."""
        return self.tokens

    def _stopped(self) -> bool:
        return self.stop_after_finished is not None and self.finished >= self.stop_after_finished

    @torch.inference_mode()
    def advance(self) -> bool:
        """Admit into free rows, then one token for every live row; False once the run has stopped."""
        if not self.running:
            return False
        batch = self.batch
        while not self.exhausted and not self._stopped() and (batch.free_rows() or len(batch.rows) < self.rows):
            job = next(self.pending, None)
            if job is None:
                self.exhausted = True
                break
            request = batch.admit(job.prompt_ids, job_generator(self.device, job.seed), job.tag)
            self.admitted.append(request)
            self.finished += request.done
        batch.shrink()
        if not batch.rows or self._stopped():
            self.running = False
            return False
        start = time.perf_counter()
        live = list(batch.rows)
        done = batch.step()
        self.wall += time.perf_counter() - start
        for request in live:
            share = self.forwards.setdefault(id(request), {})
            share[len(live)] = share.get(len(live), 0.0) + 1.0 / len(live)
        self.tokens += len(live)
        self.steps += 1
        self.finished += len(done)
        return True

    def finish(self) -> dict[str, Any]:
        """{"tokens", "step_wall_s" (the steps, prefills excluded), "throughput", "steps", "requests": [{"index",
        "tag", "tokens", "step_tokens", "step_s", "step_forwards", "timings", "finished_by_eos"} per admitted
        request, in admission order: step_tokens the tokens its steps made (x_0 is drawn at its prefill),
        step_s its share of the steps' wall clock (each step's seconds over its rows), step_forwards its
        share of the steps' forwards by their rows ({rows: Σ 1 / rows}: what prices them on the SPS
        clock), the timings its prefill and those shares]}."""
        wall = self.wall
        requests = [_target_only_request(i, r, self.forwards.get(id(r), {})) for i, r in enumerate(self.admitted)]
        return {"tokens": self.tokens, "step_wall_s": wall, "throughput": self.tokens / wall if wall > 0 else math.nan,
                "steps": self.steps, "requests": requests}


def _target_only_request(index: int, request: BatchRow, forwards: dict[int, float]) -> dict[str, Any]:
    out = request.result()
    step_s = sum(v for k, v in out.timings.items() if k not in ("prefill", "total"))
    return {"index": index, "tag": request.tag, "tokens": len(out.tokens), "step_tokens": max(len(out.tokens) - 1, 0),
            "step_s": step_s, "step_forwards": {int(b): float(c) for b, c in sorted(forwards.items())},
            "timings": out.timings, "finished_by_eos": out.finished_by_eos}
