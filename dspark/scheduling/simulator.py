"""Serving simulator: R concurrent requests, a verification-length policy and a profiled clock.

What it computes (paper Section 3.2.2, Section 5.2 and Figure 8):
R requests decode in lockstep. At every step each live request drafts a
block (real drafter, ``SpeculativeRequest.draft``), a *policy* picks the
verification lengths ℓ_r of all live requests at once from their
(STS-calibrated) confidences, and every request verifies its ℓ_r drafts
(real target forward, real rejection sampling, ``SpeculativeRequest.verify``).
The target's batch at that step holds B = Σ_r (1 + ℓ_r) tokens, and the step
is charged 1 / SPS(B) simulated seconds from a profiled ``SPSTable``
(``dspark.scheduling.sps_profile.profile_sps``). Token throughput Θ = tokens emitted /
simulated seconds.

A run takes two settings objects, shared with ``dspark.evaluation.evaluate``:
``DecodeSettings`` (max_new_tokens, temperature, seed, EOS ids) and
``ServeSettings`` (policy, SPS table, concurrency R, STS temperatures, draft overhead).

What is real and what is modelled:

- real: every draft token, every confidence, every acceptance decision, so τ
  and the lengths the policy picks are those of the actual models; every
  draft is timed (``SimResult.draft_s``), so the drafting cost per round in
  target steps, t_d · SPS(1), is reported whatever the clock charges;
- modelled: time. Verification costs 1 / SPS(B), on the clock's table
  (``ServeSettings.price_sps``, else ``sps``: the policy's). Drafting costs, by
  ``draft_overhead``: a number f ≥ 0 charges a step in which some request
  drafted (1 + f) / SPS(B), i.e. drafting as a fraction of the step (0, the
  default, ignores it); ``"measured"`` charges 1 / SPS(B) plus every other
  per-round phase the wall clock pays, as measured at that step: the drafting,
  the acceptance step ("accept": rejection sampling, the host sync), the
  bookkeeping (target cache crop, the drafter's context update: DSpark's
  K/V projection for every draft layer) of every live request, summed over
  them, and the policy's decision ("schedule") once. Only the target's
  verification forward is modelled (by the SPS table); every phase the
  request's ``PhaseClock`` records except "verify" and "prefill" is charged,
  on the table's time scale: the measured seconds times ``SimResult.time_scale``,
  the table's price of this run's own verification forwards (Σ 1 / SPS(1 + ℓ_r)
  over every request's forward) over their measured seconds. A table profiled
  while the machine ran faster or slower, or at other context lengths, then
  prices the drafting on the same scale as the verification, and the ratio to
  target-only decoding does not depend on it (it assumes the other phases and
  the verification forwards run on the same device and slow down together).
  This process runs the requests one at a time at batch 1, so at R > 1 this
  is the cost of unbatched drafting and bookkeeping, an upper bound for a
  batched engine; at R = 1 it is what a round costs on the wall clock, the
  verification forward priced by SPS(1 + ℓ). A step in which no request
  drafted (every one skipped, ``algorithm1+skip``, or ``async`` at K = 0) is
  a plain target step: 1 / SPS(B), plus, with ``"measured"``, its measured
  accept and bookkeeping phases (the target-only reference R · SPS(R) is not
  charged those). Prefills are not charged (as in decode-throughput
  measurements), and the tokens they emit (x_0) are not counted in Θ.
  With ``engine="per-request"`` verification runs per request (batch 1), so at R > 1
  the wall clock of the simulation says nothing about serving speed; only the SPS clock
  does. ``engine="batched"`` (``dspark.scheduling.batched_serving``) runs the live
  requests in one drafter and one target forward per step, timed on the wall clock too.

Concurrency: R slots. A request that finishes frees its slot and the next
request takes it at the next step. ``simulate`` either cycles the prompt
list (``cycle=True``, the default: request i uses prompt i mod N, so exactly
R requests are live at every step, and the run stops once ``num_requests``
requests have finished; requests still running then count with the tokens
they produced) or runs every prompt once (``cycle=False``: the slots drain at
the end, so the last steps have fewer than R live requests). Every request
draws from its own generator, so its tokens do not depend on the order in
which requests are stepped. Prompts given with their keys (benchmark, index in
that benchmark's prompt list; ``dspark simulate`` passes them) seed request i
(prompt i mod N, its cycle i // N) with ``dspark.seeds.request_seed(seed,
benchmark, index, cycle)``: at cycle 0 the seed ``dspark eval`` decodes the
same request with, so at R = 1 the SPS clock and the wall clock decode the same
tokens, and every reuse of a prompt draws a stream of its own. Bare prompt
lists seed request i with ``job_seed(seed, i)``.

Policies: ``dspark.scheduling.policies.make_policy`` (re-exported here) makes one from a
spec string (algorithm1, algorithm1+skip, async, static1, static, threshold,
first-below) or a callable ``(request_ids, confidences [R, γ]) -> lengths [R]``.
A policy with a ``plan`` (``algorithm1+skip``; ``async``, at K = 0) first says which requests draft
at this step; the others take a plain target step (``dspark.scheduling.skipping.target_step``:
ℓ = 0, one token, no draft time) and add 1 token to B.

The budget reported per request-step is mean ℓ_r (draft tokens sent to the
target) and mean (1 + ℓ_r) (target tokens per request, the quantity of the
paper's Fig. 8 c-d, where MTP-1 sits at a static 2).

The table and files of a run are written by ``dspark.evaluation.report`` (``results_markdown``,
``write_results``), its figures drawn by ``dspark.evaluation.plots`` (``plot_figure8``, ``plot_frontier``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from dspark.data.prompts import DEEPSPEC_EVAL_SEED
from dspark.decoding.loop import PhaseClock, SpeculativeRequest
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.calibration import apply_temperatures, as_temperatures
from dspark.scheduling.policies import POLICY_HELP, Policy, PolicySpec, make_policy
from dspark.scheduling.skipping import target_step
from dspark.seeds import derive_seed, request_seed

__all__ = [
    "DecodeSettings", "Job", "Policy", "POLICY_HELP", "ServeSettings", "SimResult", "make_policy", "run_requests",
    "simulate", "simulate_grid", "sps_table",
]

ENGINES = ("per-request", "batched")  # ServeSettings.engine
MEASURED = "measured"  # draft_overhead: charge each step its measured non-verify phases (draft, accept, ...)
UNCHARGED_PHASES = frozenset({"verify", "prefill"})  # the phases "measured" does not charge
PathLike = Union[str, os.PathLike]

# ---------------------------------------------------------------------------
# Settings (shared with dspark.evaluation.evaluate)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSettings:
    """How every request is decoded. The defaults are ``dspark eval``'s protocol: T = 1, at
    most 2048 new tokens, and DeepSpec's evaluation seed (so both tools draw the same prompts).

    max_new_tokens: the most tokens generated per request (the last round is truncated).
    temperature: T > 0 samples from softmax(logits / T), verified by rejection sampling
        (lossless); T = 0 is greedy.
    seed: the run's seed. Each request's generator seed is derived from it
        (``dspark.seeds.request_seed``), and so is an evaluation's prompt subset;
        ``run_requests`` does not read it (every ``Job`` carries its own seed).
    eos_token_ids: the ids that end a request; None: ``evaluate`` takes the chat template's
        end-of-turn and the model's EOS ids, the simulator none.
    """

    max_new_tokens: int = 2048
    temperature: float = 1.0
    seed: int = DEEPSPEC_EVAL_SEED
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"DecodeSettings.max_new_tokens must be an int >= 1, got {n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"DecodeSettings.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"DecodeSettings.seed must be an int, got {self.seed!r}")
        if self.eos_token_ids is not None:
            ids = self.eos_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"DecodeSettings.eos_token_ids must be a list of token ids or None, got {ids!r}")
            ids = tuple(ids)
            if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids):
                raise ValueError(f"DecodeSettings.eos_token_ids must hold token ids (ints >= 0), got {list(ids)!r}")
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in ids))


@dataclass(frozen=True)
class ServeSettings:
    """How verification lengths are chosen and how steps are charged (paper Section 3.2).

    policy: the verification-length policy: a ``make_policy`` spec (``POLICY_HELP``), a
        ``Policy`` or a callable ``(request_ids, confidences [R, γ]) -> lengths [R]``.
        None (``evaluate`` only): every round verifies all γ drafts, one request at a
        time, the protocol of the paper's Table 1.
    sps: the SPS table (or the path of its JSON, ``dspark profile-sps``): for the policies
        that need one (algorithm1, algorithm1+skip, async) and for the simulated clock.
    price_sps: the table the simulated clock charges, when it is not ``sps`` (None: ``sps``).
        The policies decide on the noise-aware table (``SPSTable.noise_aware``: rises of
        SPS in B within the timing noise flattened, so Algorithm 1 buys nothing with
        jitter); the clock prices on the measured medians (``SPSProfile.measured_table``),
        because a flattened entry charges more than the machine was measured to pay where
        a rise is real, and the clock's interval already carries the timing noise.
    concurrency: R, the requests decoded in lockstep (more than 1 needs a policy).
    sts_temperatures: the γ STS temperatures (or the path of an STS JSON, ``dspark
        calibrate``): the policy sees calibrated confidences, and ``evaluate`` also
        reports the calibrated confidence quality. None: raw confidences.
    draft_overhead: drafting on the SPS clock: a fraction f >= 0 of the verification
        step, or "measured": every measured per-round phase but the verification forward
        (draft, accept, bookkeeping, schedule; module docstring).
    engine: "per-request" (each live request drafts and verifies on its own, batch 1; the SPS
        clock prices a step at B = Σ (1 + ℓ_r)) or "batched" (``dspark.scheduling.batched_serving``:
        one drafter and one target forward for every live request, timed on the wall clock too;
        the SPS clock prices the padded forward).
    """

    policy: PolicySpec | None = None
    sps: SPSTable | PathLike | None = None
    price_sps: SPSTable | PathLike | None = None
    concurrency: int = 1
    sts_temperatures: Sequence[float] | PathLike | None = None
    draft_overhead: float | str = 0.0
    engine: str = "per-request"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"ServeSettings.engine={self.engine!r} must be one of {ENGINES}: 'batched' verifies "
                             "every live request in one target forward, 'per-request' one forward each")
        p = self.policy
        if p is not None and not callable(p) and not (isinstance(p, str) and p.strip()):
            raise ValueError(f"ServeSettings.policy must be None, a non-empty spec ({POLICY_HELP}), a Policy "
                             f"or a callable, got {p!r}")
        for name in ("sps", "price_sps"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (SPSTable, str, os.PathLike)):
                raise ValueError(f"ServeSettings.{name} must be an SPSTable or the path of its JSON "
                                 f"(dspark profile-sps), got {type(value).__name__}")
        if self.price_sps is not None and self.sps is None:
            raise ValueError("ServeSettings.price_sps needs sps: the clock's table replaces the policy's "
                             "table for pricing only")
        r = self.concurrency
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"ServeSettings.concurrency must be an int >= 1, got {r!r}")
        if r > 1 and p is None:
            raise ValueError(f"ServeSettings.concurrency={r} needs a policy: requests decode in lockstep only "
                             "in the serving loop (policy='static' verifies all γ drafts there)")
        _draft_clock(self.draft_overhead)
        temps = self.sts_temperatures
        if temps is not None and not isinstance(temps, (str, os.PathLike)):
            checked = as_temperatures(temps, None, "ServeSettings.sts_temperatures")
            object.__setattr__(self, "sts_temperatures", tuple(float(t) for t in checked))


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class Job:
    """One request to serve: its prompt ids, the seed of its generator, and a tag
    (any JSON-able value, e.g. (benchmark, index)) copied into its log lines."""

    prompt_ids: Sequence[int]
    seed: int
    tag: Any = None


@dataclass
class SimResult:
    """What one serving run returns.

    Counts over the steps of the run (a step = every live request drafts and verifies once):
      steps; sim_time_s = Σ_steps (1 + f) / SPS(B) with a fraction f, or Σ_steps 1 / SPS(B) +
      overhead_s with "measured" (NaN without a table);
      tokens = tokens emitted by verification (x_0 of each prefill excluded);
      request_steps = Σ_steps live requests (= rounds); accepted = Σ m; proposed = Σ ℓ;
      eos_rounds = rounds that accepted an EOS draft (no token after it: τ = m);
      batch_tokens = Σ_steps B; live_time_s = Σ_steps live · step time (for per-user speed);
      drafted / skipped = request-steps that drafted / took a plain target step (``plan``);
      draft_s = Σ measured seconds of the drafts; overhead_s = Σ measured seconds of every
      per-round phase but verify (draft, accept, bookkeeping of every request, the policy's
      schedule once per step), what "measured" charges; draft_clock = how the clock charged them
      ("none", "fraction <f>" or "measured"); target_step_s = 1 / SPS(1) and target_only_throughput
      = R · SPS(R), what R requests decoding with the target alone reach (NaN without a table);
      verify_s = Σ measured seconds of the verification forwards (one per request-step) and
      verify_table_s = Σ their price in the table, 1 / SPS(1 + ℓ_r); time_scale = verify_table_s /
      verify_s, what "measured" multiplies overhead_s by (1 otherwise, and when nothing was verified).
    engine: "per-request" or "batched" (``ServeSettings.engine``); step_wall_s: the wall clock of the steps
      (prefills excluded; batched engine); target_only_wall: tokens/s of target-only decoding of the same
      requests at the same R on the wall clock (batched engine, when measured; NaN otherwise); clocks: the
      SPS clock against the wall clock on this run's steps (``dspark.evaluation.clocks.serving_clock_difference``
      as a dict), when a profile was given.
    table_ci: the 95 % interval of vs_target_only over the SPS table's own timing noise
      (``dspark.scheduling.sps_profile.table_interval``: this run's steps priced by tables of the
      profile's timings resampled), or None when no profile was given.
    requests: one dict per request admitted, in admission order: index, tag, prompt_tokens,
      tokens (count), rounds (count), finished; once finished also finished_by_eos,
      timings (its own phases) and result (its DecodeResult).
    rounds: one dict per round (step, request, tag, round, proposed, verified (ℓ, the drafts the target's
      forward took: ``proposed`` is cut to m where an accepted EOS ended the round), accepted, eos_accepted, emitted,
      confidences (raw c_1..c_γ or None), expected_accepted (Σ_{j≤ℓ} a_j of the
      confidences the policy saw, None without), batch_tokens).
    step_log: one dict per step (step, live, drafted, batch_tokens, draft_s, overhead_s, verify_s,
      verify_table_s, verify_step_s = 1 / SPS(B), step_time_s, tokens).
    """

    policy: str
    concurrency: int
    steps: int = 0
    sim_time_s: float = 0.0
    tokens: int = 0
    request_steps: int = 0
    accepted: int = 0
    proposed: int = 0
    eos_rounds: int = 0
    batch_tokens: int = 0
    live_time_s: float = 0.0
    drafted: int = 0
    skipped: int = 0
    draft_s: float = 0.0
    overhead_s: float = 0.0
    draft_clock: str = "none"
    target_step_s: float = math.nan
    target_only_throughput: float = math.nan
    verify_s: float = 0.0
    verify_table_s: float = 0.0
    time_scale: float = 1.0
    wall_s: float = 0.0
    engine: str = "per-request"
    step_wall_s: float = 0.0
    target_only_wall: float = math.nan
    clocks: dict[str, Any] | None = None
    table_ci: list[float] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    step_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Θ: tokens per simulated second."""
        return self.tokens / self.sim_time_s if self.sim_time_s > 0 else math.nan

    @property
    def tau(self) -> float:
        """Mean τ per request-step (pooled over rounds): m + 1, or m after an accepted EOS."""
        return 1 + (self.accepted - self.eos_rounds) / self.request_steps if self.request_steps else math.nan

    @property
    def mean_ell(self) -> float:
        """Mean verification length ℓ_r per request-step (draft tokens verified)."""
        return self.proposed / self.request_steps if self.request_steps else math.nan

    @property
    def budget_tokens(self) -> float:
        """Mean 1 + ℓ_r: target tokens per request per step (paper Fig. 8 c-d)."""
        return 1 + self.mean_ell

    @property
    def mean_batch_tokens(self) -> float:
        """Mean B per step."""
        return self.batch_tokens / self.steps if self.steps else math.nan

    @property
    def tokens_per_s_per_user(self) -> float:
        """Tokens per simulated second of a live request (Θ / R when R requests are always live)."""
        return self.tokens / self.live_time_s if self.live_time_s > 0 else math.nan

    @property
    def draft_s_per_round(self) -> float:
        """Measured seconds of one draft (mean over the rounds that drafted)."""
        return self.draft_s / self.drafted if self.drafted else math.nan

    @property
    def draft_cost_steps(self) -> float:
        """The drafting cost of a round in target steps: measured draft seconds · time_scale · SPS(1)."""
        return self.draft_s_per_round * self.time_scale / self.target_step_s

    @property
    def skip_rate(self) -> float:
        """Share of request-steps that did not draft (a plain target step)."""
        return self.skipped / self.request_steps if self.request_steps else math.nan

    @property
    def requests_finished(self) -> int:
        return sum(1 for r in self.requests if r["finished"])

    def priced_by(self, sps: SPSTable) -> float:
        """vs_target_only of this run's steps priced by another SPS table, every decision kept:
        Θ' / (R · SPS'(R)). Each step costs 1 / SPS'(B) plus its charge as the run made it: with
        "measured" its overhead_s times the time scale of SPS' (Σ_r 1 / SPS'(1 + ℓ_r) over verify_s),
        otherwise its charge scaled with its verification price ((1 + f) / SPS'(B)). Pricing by the
        run's own table gives vs_target_only. Needs step_log (a cell read back from cells.jsonl has none)."""
        return self.pricing()(sps)

    def pricing(self) -> Callable[[SPSTable], float]:
        """``priced_by`` as a function of the table, with the run's steps grouped by B once (what
        pricing by many tables needs: ``dspark.scheduling.sps_profile.table_interval``)."""
        if not self.step_log:
            raise ValueError("SimResult.priced_by needs the run's step_log; a result read back from "
                             "cells.jsonl keeps none: run the cell again")
        measured = self.draft_clock == MEASURED
        steps: dict[int, float] = {}  # B -> what 1 / SPS'(B) is multiplied by, summed over the steps
        for row in self.step_log:
            b = int(row.get("priced_tokens", row["batch_tokens"]))  # the batched engine prices its padded forward
            steps[b] = steps.get(b, 0.0) + (1.0 if measured else row["step_time_s"] / row["verify_step_s"])
        overhead = sum(row["overhead_s"] for row in self.step_log) if measured else 0.0
        forwards: dict[int, int] = {}  # size -> verification forwards of that size
        if measured and self.verify_s > 0 and self.engine == "batched":
            for row in self.step_log:  # one forward per step
                forwards[int(row["priced_tokens"])] = forwards.get(int(row["priced_tokens"]), 0) + 1
        elif measured and self.verify_s > 0:
            for row in self.rounds:
                size = 1 + int(row.get("verified", row["proposed"]))
                forwards[size] = forwards.get(size, 0) + 1
        tokens, r, verify_s = self.tokens, self.concurrency, self.verify_s

        def price(sps: SPSTable) -> float:
            total = sum(w / _speed(sps, b) for b, w in steps.items())
            if forwards:
                total += overhead * sum(n / _speed(sps, b) for b, n in forwards.items()) / verify_s
            else:
                total += overhead
            return tokens / total / (r * _speed(sps, r))

        return price

    def summary(self) -> dict[str, Any]:
        """The scalar results as a dict (what results.json and the tables hold)."""
        return {
            "policy": self.policy,
            "concurrency": self.concurrency,
            "throughput": self.throughput,
            "tau": self.tau,
            "mean_ell": self.mean_ell,
            "budget_tokens": self.budget_tokens,
            "tokens_per_s_per_user": self.tokens_per_s_per_user,
            "mean_batch_tokens": self.mean_batch_tokens,
            "steps": self.steps,
            "sim_time_s": self.sim_time_s,
            "tokens": self.tokens,
            "request_steps": self.request_steps,
            "accepted": self.accepted,
            "proposed": self.proposed,
            "drafted_rounds": self.drafted,
            "skipped_rounds": self.skipped,
            "skip_rate": self.skip_rate,
            "draft_s": self.draft_s,
            "draft_s_per_round": self.draft_s_per_round,
            "overhead_s": self.overhead_s,
            "verify_s": self.verify_s,
            "verify_table_s": self.verify_table_s,
            "time_scale": self.time_scale,
            "target_step_s": self.target_step_s,
            "draft_cost_steps": self.draft_cost_steps,
            "draft_clock": self.draft_clock,
            "target_only_throughput": self.target_only_throughput,
            "vs_target_only": self.throughput / self.target_only_throughput,
            "vs_target_only_table_ci": self.table_ci,
            "requests_admitted": len(self.requests),
            "requests_finished": self.requests_finished,
            "wall_s": self.wall_s,
            "engine": self.engine,
            "step_wall_s": self.step_wall_s,
            "wall_throughput": self.tokens / self.step_wall_s if self.step_wall_s > 0 else math.nan,
            "target_only_wall": self.target_only_wall,
            "wall_vs_target_only": (self.tokens / self.step_wall_s / self.target_only_wall
                                    if self.step_wall_s > 0 else math.nan),
            "clocks": self.clocks,
        }


# ---------------------------------------------------------------------------
# The stepping loop
# ---------------------------------------------------------------------------


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
) -> SimResult:
    """Serve ``jobs`` with ``serving.concurrency`` slots under ``serving.policy``: the stepping loop.

    Requests are admitted in the order of ``jobs`` whenever a slot is free
    (prefill on admission), each decoding with ``decoding`` from a generator
    seeded with its ``Job.seed``. Each step: the requests the policy's ``plan``
    picks (all, without one) draft, the policy picks ℓ_r for all of them from
    the confidences (calibrated with ``serving.sts_temperatures`` when given), every
    request verifies ℓ_r drafts (the others take a plain target step), the
    step is charged by the SPS clock with B = Σ_r (1 + ℓ_r) and
    ``serving.draft_overhead`` (module docstring; no charge and a NaN clock
    without ``serving.sps``), finished requests leave.
    Stops when ``jobs`` is exhausted and every request has finished, or as
    soon as ``stop_after_finished`` requests have finished (for an endless
    ``jobs`` iterator). ``on_step`` is called with the result after each step.
    """
    if serving.engine == "batched":
        from dspark.scheduling.batched_serving import run_batched

        return run_batched(target, drafter, jobs, decoding=decoding, serving=serving,
                           stop_after_finished=stop_after_finished, on_step=on_step)
    policy, sps, temps = _resolve(serving)
    if serving.price_sps is not None:
        sps = sps_table(serving.price_sps)  # the clock's table; the policy keeps its own
    if policy.on_start is not None:
        policy.on_start()
    clock, overhead = _draft_clock(serving.draft_overhead)
    concurrency = serving.concurrency
    eos = list(decoding.eos_token_ids or ())
    device = torch.device(getattr(target, "device", "cpu"))

    def start(job: Job) -> SpeculativeRequest:  # the prefill; every request has its own generator and clock
        generator = torch.Generator(device=device).manual_seed(int(job.seed))
        return SpeculativeRequest(target, drafter, job.prompt_ids, max_new_tokens=decoding.max_new_tokens,
                                  temperature=decoding.temperature, eos_token_ids=eos, generator=generator,
                                  clock=PhaseClock(device))

    result = SimResult(policy=policy.name, concurrency=concurrency, draft_clock=clock,
                       target_step_s=math.nan if sps is None else 1.0 / _speed(sps, 1),
                       target_only_throughput=math.nan if sps is None else concurrency * _speed(sps, concurrency))
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
        _on_table_scale(result)
    return result


def _on_table_scale(result: SimResult) -> None:
    """Charge every step's measured overhead on the SPS table's time scale (module docstring):
    time_scale = verify_table_s / verify_s, each step 1 / SPS(B) + overhead_s · time_scale."""
    if not result.verify_s > 0 or not math.isfinite(result.verify_table_s):
        return
    result.time_scale = result.verify_table_s / result.verify_s
    result.sim_time_s = result.live_time_s = 0.0
    for row in result.step_log:
        row["step_time_s"] = row["verify_step_s"] + row["overhead_s"] * result.time_scale
        result.sim_time_s += row["step_time_s"]
        result.live_time_s += row["step_time_s"] * row["live"]


def _resolve(serving: ServeSettings) -> tuple[Policy, SPSTable | None, np.ndarray | None]:
    """(a fresh policy, the SPS table, the STS temperatures [γ]) of ``serving``, files read."""
    if serving.policy is None:
        raise ValueError(f"ServeSettings.policy is None; the serving loop needs a verification-length policy "
                         f"({POLICY_HELP})")
    sps = sps_table(serving.sps)
    temps = None if serving.sts_temperatures is None else as_temperatures(
        serving.sts_temperatures, None, "ServeSettings.sts_temperatures")
    return make_policy(serving.policy, sps), sps, temps


def sps_table(sps: SPSTable | PathLike | None) -> SPSTable | None:
    """An SPS table given as itself or as the path of its JSON."""
    return SPSTable.from_json(sps) if isinstance(sps, (str, os.PathLike)) else sps


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
    verify_table_s = math.nan if sps is None else sum(1.0 / _speed(sps, 1 + ell) for ell in lengths.tolist())
    verify_step_s = math.nan if sps is None else 1.0 / _speed(sps, batch)
    step_time = _step_time(verify_step_s, draft_overhead, draft_times, overhead_s)
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


def _draft_clock(draft_overhead: float | str) -> tuple[str, float | str]:
    """(label, value) of a ``draft_overhead``: a fraction f >= 0 or "measured" (module docstring)."""
    if isinstance(draft_overhead, str):
        if draft_overhead.strip().lower() != MEASURED:
            raise ValueError(f"ServeSettings.draft_overhead must be a number >= 0 (a fraction of the step time) "
                             f"or {MEASURED!r} (the measured time of every phase but verify), "
                             f"got {draft_overhead!r}")
        return MEASURED, MEASURED
    if isinstance(draft_overhead, bool) or not isinstance(draft_overhead, (int, float)) \
            or not math.isfinite(draft_overhead) or draft_overhead < 0:
        raise ValueError(f"ServeSettings.draft_overhead must be a finite number >= 0 (a fraction of the step "
                         f"time) or {MEASURED!r}, got {draft_overhead!r}")
    return ("none" if draft_overhead == 0 else f"fraction {float(draft_overhead):g}"), float(draft_overhead)


def _speed(sps: SPSTable, batch: int) -> float:
    speed = float(sps(batch))
    if not speed > 0:
        raise ValueError(
            f"a step needs B = {batch} batch tokens but the SPS table stops at max_batch_tokens = "
            f"{sps.max_batch_tokens}; profile larger batches (dspark profile-sps --batch-tokens ...) "
            "or lower the concurrency"
        )
    return speed


def _step_time(verify: float, draft_overhead: float | str, draft_times: Sequence[float],
               overhead_s: float) -> float:
    """Simulated seconds of one step: ``verify`` = 1 / SPS(B) (NaN without a table), plus what
    ``draft_overhead`` says: with "measured" the step's measured non-verify seconds ``overhead_s``
    (put on the table's time scale at the end of the run, ``_on_table_scale``); with a fraction f,
    f / SPS(B) when some request drafted (module docstring)."""
    if math.isnan(verify):
        return math.nan
    if draft_overhead == MEASURED:
        return verify + overhead_s
    if not draft_times:
        return verify
    return (1.0 + float(draft_overhead)) * verify


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
    See ``run_requests`` for one step and the module docstring for the model. With the batched engine
    (``serving.engine``) and ``target_only``, target-only decoding of the same requests at the same R
    is timed too (``SimResult.target_only_wall``).
    """
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt (a list of token ids)")
    sps = sps_table(serving.sps)
    if sps is None:
        raise ValueError("ServeSettings.sps is None; simulate charges every step 1 / SPS(B): give the table of "
                         "`dspark profile-sps` (its JSON path or SPSTable.from_json('sps.json'))")
    serving = dataclasses.replace(serving, sps=sps, price_sps=sps_table(serving.price_sps))
    prompts = [list(p) for p in prompts]
    job = _job_maker(prompts, keys, decoding.seed)
    if cycle:
        stop = max(len(prompts), serving.concurrency) if num_requests is None else num_requests
        if isinstance(stop, bool) or not isinstance(stop, int) or stop < 1:
            raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")

        def endless() -> Iterator[Job]:
            i = 0
            while True:
                yield job(i)
                i += 1

        jobs: Iterable[Job] = endless()
    else:
        if num_requests is not None:
            raise ValueError("num_requests applies to cycle=True only; without cycling every prompt runs once")
        stop = None
        jobs = [job(i) for i in range(len(prompts))]
    result = run_requests(target, drafter, jobs, decoding=decoding, serving=serving, stop_after_finished=stop,
                          on_step=on_step)
    if serving.engine == "batched" and target_only:
        result.target_only_wall = target_only_wall_throughput(
            target, prompts, keys, decoding=decoding, rows=serving.concurrency, cycle=cycle, stop=stop)
    return result


def target_only_wall_throughput(target: Any, prompts: list[list[int]], keys: Sequence[tuple[str, int]] | None, *,
                                decoding: DecodeSettings, rows: int, cycle: bool, stop: int | None) -> float:
    """Tokens/s of target-only decoding of ``simulate``'s requests (the same jobs, seeds and stop rule)
    with ``rows`` rows on the wall clock (``dspark.scheduling.batched_serving.target_only_wall``)."""
    from dspark.scheduling.batched_serving import target_only_wall

    job = _job_maker(prompts, keys, decoding.seed)
    jobs: Iterable[Job] = (job(i) for i in itertools.count()) if cycle else [job(i) for i in range(len(prompts))]
    return float(target_only_wall(target, jobs, decoding=decoding, rows=rows, stop_after_finished=stop)["throughput"])


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
    walls: dict[int, float] | None = None,
) -> list[SimResult]:
    """``simulate`` for every (policy, concurrency) pair of the grid, ``serving`` giving the rest
    (SPS table, STS temperatures, draft overhead). Each cell makes a fresh policy and uses the
    same seed, so every cell serves the same requests with the same random streams.
    ``keys``: the prompts' (benchmark, index) keys, as ``simulate`` takes them.
    ``progress`` is called with each finished result. ``walls``: R -> target-only tokens/s on the wall
    clock (batched engine), filled as each R is timed and reused (pass one dict to share it across calls)."""
    serving = dataclasses.replace(serving, sps=sps_table(serving.sps), price_sps=sps_table(serving.price_sps))
    results = []
    walls = {} if walls is None else walls
    for spec in policies:
        for concurrency in concurrencies:
            cell = dataclasses.replace(serving, policy=spec, concurrency=concurrency)
            result = simulate(target, drafter, prompts, decoding=decoding, serving=cell, cycle=cycle,
                              num_requests=num_requests, keys=keys, target_only=concurrency not in walls)
            if serving.engine == "batched":
                walls.setdefault(concurrency, result.target_only_wall)
                result.target_only_wall = walls[concurrency]
            results.append(result)
            if progress is not None:
                progress(result)
    return results
