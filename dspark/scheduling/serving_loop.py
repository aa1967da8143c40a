"""The serving loop: R requests decoded in lockstep under a verification-length policy (paper Section 3.2.2).

``run_requests`` admits ``Job``s into R slots (prefill on admission) and steps the live requests: the
policy's ``plan`` picks who drafts, the policy picks every ℓ_r at once from the (STS-calibrated)
confidences, every request verifies its ℓ_r drafts (real target forward, real rejection sampling), and
the step is charged on the SPS clock (``dspark.scheduling.sps_clock``). This is the per-request engine
(each request drafts and verifies on its own, batch 1); ``ServeSettings.engine = "batched"`` runs
``dspark.scheduling.batched_serving`` instead. docs/scheduling.md has the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark.decoding.loop import PhaseClock, SpeculativeRequest
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.calibration import apply_temperatures, as_temperatures
from dspark.scheduling.policies import POLICY_HELP, Policy, make_policy
from dspark.scheduling.results import Job, SimResult
from dspark.scheduling.settings import DecodeSettings, ServeSettings
from dspark.scheduling.skipping import target_step
from dspark.scheduling.sps_clock import (
    MEASURED,
    UNCHARGED_PHASES,
    draft_clock,
    on_table_scale,
    sps_table,
    speed_at,
    step_seconds,
)

__all__ = ["run_requests"]


@dataclass
class _Live:
    index: int
    job: Job
    request: SpeculativeRequest


@torch.no_grad()
def run_requests(
    target: Any,
    drafter: Any,
    jobs: Iterable[Job],
    *,
    decoding: DecodeSettings,
    serving: ServeSettings,
    stop_after_finished: int | None = None,
    on_step: Callable[[SimResult], None] | None = None,
    prefills: Any = None,
) -> SimResult:
    """Serve ``jobs`` with ``serving.concurrency`` slots under ``serving.policy``: the stepping loop.

    Requests are admitted in the order of ``jobs`` whenever a slot is free
    (prefill on admission), each decoding with ``decoding`` from a generator
    seeded with its ``Job.seed``. Each step: the requests the policy's ``plan``
    picks (all, without one) draft, the policy picks ℓ_r for all of them from
    the confidences (calibrated with ``serving.sts_temperatures`` when given), every
    request verifies ℓ_r drafts (the others take a plain target step), the
    step is charged by the SPS clock with B = Σ_r (1 + ℓ_r) and
    ``serving.draft_overhead`` (``dspark.scheduling.sps_clock``; no charge and a NaN clock
    without ``serving.sps``), finished requests leave.
    Stops when ``jobs`` is exhausted and every request has finished, or as
    soon as ``stop_after_finished`` requests have finished (for an endless
    ``jobs`` iterator). ``on_step`` is called with the result after each step. ``prefills``: a
    ``dspark.decoding.prefill_store.PrefillStore`` the batched engine takes prompt prefills from and
    keeps them in (the per-request engine prefills every request).
    """
    if serving.engine == "batched":
        from dspark.scheduling.batched_serving import run_batched

        return run_batched(target, drafter, jobs, decoding=decoding, serving=serving,
                           stop_after_finished=stop_after_finished, on_step=on_step, prefills=prefills)
    policy, sps, temps, clock, overhead, eos, device = _start_run(serving, decoding, target)
    concurrency = serving.concurrency

    def start(job: Job) -> SpeculativeRequest:  # the prefill; every request has its own generator and clock
        generator = torch.Generator(device=device).manual_seed(int(job.seed))
        return SpeculativeRequest(target, drafter, job.prompt_ids, max_new_tokens=decoding.max_new_tokens,
                                  temperature=decoding.temperature, eos_token_ids=eos, generator=generator,
                                  clock=PhaseClock(device))

    result = SimResult(policy=policy.name, concurrency=concurrency, draft_clock=clock,
                       target_step_s=math.nan if sps is None else 1.0 / speed_at(sps, 1),
                       target_only_throughput=math.nan if sps is None else concurrency * speed_at(sps, concurrency))
    started = time.perf_counter()
    slots = _Slots(concurrency, iter(jobs), start, stop_after_finished, result)
    while True:
        slots.admit()
        if not slots.live or slots.stopped():
            break
        _step(slots.live, policy, temps, sps, overhead, result)
        slots.retire()
        if on_step is not None:
            on_step(result)
    result.wall_s = time.perf_counter() - started
    if sps is not None and clock == MEASURED:
        on_table_scale(result)
    return result


def _start_run(serving: ServeSettings, decoding: DecodeSettings, target: Any) -> tuple:
    """What a run of either engine starts from: (policy with its history cleared, the SPS table the
    clock prices steps with, STS temperatures, the draft clock and its overhead mode, EOS ids, device)."""
    policy, sps, temps = _resolve(serving)
    if serving.price_sps is not None:
        sps = sps_table(serving.price_sps)  # the clock's table; the policy keeps its own
    if policy.on_start is not None:
        policy.on_start()
    clock, overhead = draft_clock(serving.draft_overhead)
    eos = list(decoding.eos_token_ids or ())
    return policy, sps, temps, clock, overhead, eos, torch.device(getattr(target, "device", "cpu"))


def _resolve(serving: ServeSettings) -> tuple[Policy, SPSTable | None, np.ndarray | None]:
    """(a fresh policy, the SPS table, the STS temperatures [γ]) of ``serving``, files read."""
    if serving.policy is None:
        raise ValueError(f"ServeSettings.policy is None; the serving loop needs a verification-length policy "
                         f"({POLICY_HELP})")
    sps = sps_table(serving.sps)
    temps = None if serving.sts_temperatures is None else as_temperatures(
        serving.sts_temperatures, None, "ServeSettings.sts_temperatures")
    return make_policy(serving.policy, sps), sps, temps



@dataclass
class _Slots:
    """The R slots of a run: admits jobs in order into free slots, retires finished requests.

    Keeps ``result.requests`` (one dict per admitted request) up to date on admission and at the end."""

    concurrency: int
    jobs: Iterator[Job]
    start: Callable[[Job], SpeculativeRequest]  # the prefill of a job
    stop_after_finished: int | None
    result: SimResult
    live: list[_Live] = field(default_factory=list)
    exhausted: bool = False
    finished: int = 0

    def stopped(self) -> bool:
        """True once stop_after_finished requests have finished."""
        return self.stop_after_finished is not None and self.finished >= self.stop_after_finished

    def admit(self) -> None:
        """Start the next jobs (prefill) until every slot is live, the jobs run out or the run stops."""
        while len(self.live) < self.concurrency and not self.exhausted and not self.stopped():
            job = next(self.jobs, None)
            if job is None:
                self.exhausted = True
                break
            request = self.start(job)
            entry = _Live(len(self.result.requests), job, request)
            self.result.requests.append({"index": entry.index, "tag": job.tag, "prompt_tokens": len(job.prompt_ids),
                                         "tokens": len(request.tokens), "rounds": 0, "finished": False})
            if request.done:  # max_new_tokens <= 1, or x_0 is an EOS: no round at all
                self._finish(entry)
            else:
                self.live.append(entry)

    def retire(self) -> None:
        """Finished requests leave their slots."""
        for entry in self.live:
            if entry.request.done:
                self._finish(entry)
        self.live = [entry for entry in self.live if not entry.request.done]

    def _finish(self, entry: _Live) -> None:
        self.finished += 1
        out = entry.request.result()
        self.result.requests[entry.index].update(
            tokens=len(out.tokens), rounds=len(out.rounds), finished=True,
            finished_by_eos=out.finished_by_eos, timings=_phases(out.timings), result=out,
        )


def _step(
    live: list[_Live],
    policy: Policy,
    temps: np.ndarray | None,
    sps: SPSTable | None,
    draft_overhead: float | str,
    result: SimResult,
) -> None:
    """One lockstep step: the requests ``policy.plan`` picks (every one without a plan) draft,
    ``policy`` picks the lengths ℓ_r of all of them at once, every request verifies its ℓ_r
    drafts (the others take a plain target step); the step goes into ``result``.

    The policy's decision time (its ``plan`` and the lengths, confidences calibrated) is a
    "schedule" phase of every live request's clock: each of them waits for it, so it is part of
    the request's wall time as everything is part of a target-only request's.

    The step's measured overhead (``_overhead_s``) is taken from the live requests' clocks
    around the whole step, so every phase they record is counted, whoever records it."""
    ids = [entry.index for entry in live]
    before = [dict(entry.request.clock.totals) for entry in live]
    started = time.perf_counter()
    drafting = np.ones(len(live), dtype=bool) if policy.plan is None else np.asarray(policy.plan(ids), dtype=bool)
    schedule_s = time.perf_counter() - started
    if drafting.shape != (len(live),):
        raise ValueError(f"policy {policy.name!r}: plan must return {len(live)} booleans, got {drafting!r}")
    draft_times = [_timed_draft(entry.request, policy) for entry, d in zip(live, drafting) if d]
    started = time.perf_counter()
    lengths, a, raw = _lengths(live, drafting, policy, temps)
    schedule_s += time.perf_counter() - started
    for entry in live:
        totals = entry.request.clock.totals
        totals["schedule"] = totals.get("schedule", 0.0) + schedule_s
    batch = int(len(live) + lengths.sum())

    step_tokens = 0
    for row, (entry, ell) in enumerate(zip(live, lengths.tolist())):
        if not drafting[row]:
            step_tokens += _verify(entry, None, None, batch, result)
            continue
        expected = float(a[row, :ell].sum()) if raw[row] is not None else None
        step_tokens += _verify(entry, ell, expected, batch, result)
    overhead_s = _overhead_s(live, before, schedule_s)
    verify_s = sum(entry.request.clock.totals.get("verify", 0.0) - start.get("verify", 0.0)
                   for entry, start in zip(live, before))
    verify_table_s = math.nan if sps is None else sum(1.0 / speed_at(sps, 1 + ell) for ell in lengths.tolist())
    verify_step_s = math.nan if sps is None else 1.0 / speed_at(sps, batch)
    step_time = step_seconds(verify_step_s, draft_overhead, draft_times, overhead_s)
    _account_step(result, live=len(live), drafted=len(draft_times), proposed=int(lengths.sum()), batch=batch,
                  draft_s=sum(draft_times), overhead_s=overhead_s, step_time=step_time, tokens=step_tokens,
                  verify_s=verify_s, verify_table_s=verify_table_s, verify_step_s=verify_step_s)


def _overhead_s(live: list[_Live], before: Sequence[Mapping[str, float]], schedule_s: float) -> float:
    """Measured seconds of one step but the verification forwards: the growth of every phase
    outside ``UNCHARGED_PHASES`` on each live request's clock since ``before``, summed over the
    requests, with "schedule" counted once (every request's clock holds the same decision)."""
    total = schedule_s
    for entry, start in zip(live, before):
        for phase, seconds in entry.request.clock.totals.items():
            if phase not in UNCHARGED_PHASES and phase != "schedule":
                total += seconds - start.get(phase, 0.0)
    return total


def _timed_draft(request: SpeculativeRequest, policy: Policy) -> float:
    """Draft one request; returns the seconds its clock measured (handed to ``policy.on_draft_time``)."""
    totals = request.clock.totals
    before = totals.get("draft", 0.0)
    request.draft()
    seconds = totals.get("draft", 0.0) - before
    if policy.on_draft_time is not None:
        policy.on_draft_time(seconds)
    return seconds


def _lengths(
    live: list[_Live], drafting: np.ndarray, policy: Policy, temps: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, list[list[float] | None]]:
    """(ℓ int64 [R], a = cumprod of the confidences the policy saw [R, γ], raw c rows or None).

    Requests that did not draft show the policy a row of zeros and must get ℓ = 0."""
    rows = len(live)
    raw: list[list[float] | None] = [None] * rows
    if not drafting.any():  # a plain target step for everyone: nothing to schedule
        return np.zeros(rows, dtype=np.int64), np.zeros((rows, 1)), raw
    drafted = np.flatnonzero(drafting)
    for row in drafted:
        raw[row] = live[row].request.confidences
    gamma = live[drafted[0]].request.gamma
    conf = np.zeros((rows, gamma))  # [R, γ]
    conf[drafted] = _confidence_matrix([raw[row] for row in drafted], gamma, temps, policy)
    lengths = _checked_lengths(policy([e.index for e in live], conf), rows, gamma, policy.name)
    if lengths[~drafting].any():
        raise ValueError(f"policy {policy.name!r} gave ℓ > 0 to a request that did not draft at this step")
    return lengths, np.cumprod(conf, axis=1), raw


def _verify(entry: _Live, ell: int | None, expected: float | None, batch: int, result: SimResult) -> int:
    """Verify ℓ drafts of one live request (ℓ None: a plain target step, no draft) and log the round;
    returns the number of tokens emitted.

    ``expected``: Σ_{j≤ℓ} a_j of the confidences the policy saw (None without them)."""
    request = entry.request
    before = len(request.tokens)
    record = target_step(request) if ell is None else request.verify(ell)
    emitted = len(request.tokens) - before
    result.accepted += record.accepted
    result.eos_rounds += record.eos_accepted
    result.rounds.append({
        "step": result.steps, "request": entry.index, "tag": entry.job.tag,
        "round": len(request.rounds) - 1, "drafted": ell is not None, "proposed": record.proposed,
        "verified": 0 if ell is None else int(ell),
        "accepted": record.accepted, "eos_accepted": record.eos_accepted, "emitted": emitted,
        "confidences": record.confidences, "expected_accepted": expected, "batch_tokens": batch,
    })
    result.requests[entry.index].update(tokens=len(request.tokens), rounds=len(request.rounds))
    return emitted


def _account_step(result: SimResult, *, live: int, drafted: int, proposed: int, batch: int, draft_s: float,
                  overhead_s: float, step_time: float, tokens: int, verify_s: float = 0.0,
                  verify_table_s: float = math.nan, verify_step_s: float = math.nan) -> None:
    """Add one step to the run's counters, its SPS clock and its step log."""
    result.step_log.append({"step": result.steps, "live": live, "drafted": drafted, "batch_tokens": batch,
                            "draft_s": draft_s, "overhead_s": overhead_s, "verify_s": verify_s,
                            "verify_table_s": verify_table_s, "verify_step_s": verify_step_s,
                            "step_time_s": step_time, "tokens": tokens})
    result.verify_s += verify_s
    result.verify_table_s += verify_table_s
    result.steps += 1
    result.sim_time_s += step_time
    result.live_time_s += step_time * live
    result.tokens += tokens
    result.request_steps += live
    result.drafted += drafted
    result.skipped += live - drafted
    result.draft_s += draft_s
    result.overhead_s += overhead_s
    result.proposed += proposed
    result.batch_tokens += batch


def _phases(timings: Mapping[str, float]) -> dict[str, float]:
    """Per-phase seconds of one request; "total" becomes the sum of its own phases
    (its wall clock since admission would include the other requests' turns)."""
    phases = {k: float(v) for k, v in timings.items() if k != "total"}
    return {**phases, "total": sum(phases.values())}


def _confidence_matrix(
    raw: Sequence[list[float] | None], gamma: int, temps: np.ndarray | None, policy: Policy
) -> np.ndarray:
    """[R, γ] float64: the confidences the policy sees (STS-calibrated), NaN rows without a head."""
    if any(c is None for c in raw):
        if policy.needs_confidences:
            raise ValueError(
                f"policy {policy.name!r} schedules by confidence but the drafter returns none "
                "(no confidence head); use a static policy (static1, static, static:<ℓ>)"
            )
        return np.full((len(raw), gamma), np.nan)
    conf = np.asarray(raw, dtype=np.float64)  # [R, γ]
    if temps is not None:
        if temps.size != gamma:
            raise ValueError(f"sts_temperatures has {temps.size} values but the drafter's block size γ is {gamma}")
        conf = apply_temperatures(conf, temps)
    return conf


def _checked_lengths(lengths: Any, rows: int, gamma: int, name: str) -> np.ndarray:
    out = np.asarray(lengths)
    if out.shape != (rows,) or (out.size and not np.all(out == np.round(out))):
        raise ValueError(f"policy {name!r} must return {rows} integer lengths, got {lengths!r}")
    out = out.astype(np.int64)
    if out.size and (out.min() < 0 or out.max() > gamma):
        raise ValueError(f"policy {name!r} returned lengths {out.tolist()}; each must be in 0..γ = 0..{gamma}")
    return out
