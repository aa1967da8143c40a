"""What a serving run returns (``SimResult``) and its re-pricing by other SPS tables; ``Job``, one request to serve.

``SimResult`` counts the steps, tokens, rounds and clock charges of a run of
``dspark.scheduling.serving_loop.run_requests`` (a ``dspark simulate`` cell), with one dict per request,
per round and per step. ``SimResult.priced_by`` / ``pricing`` re-price the run's steps, every decision
kept, on another table (``dspark.scheduling.sps_profile.table_interval``: the SPS clock's interval).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.sps_clock import MEASURED, speed_at

__all__ = ["Job", "SimResult"]


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
      requests at the same R on the wall clock (batched engine, when measured; NaN otherwise);
      target_only_requests: that decode's requests (index, tag, tokens, step_tokens, step_s, step_forwards,
      timings, finished_by_eos: its tokens, those its steps made, its share of their seconds and of their
      forwards by rows, its phases' seconds with its prefill, whether it ended at EOS), paired with
      ``requests`` by index; wall_ci: the 95 % interval
      of wall_vs_target_only over the requests (``dspark.evaluation.clocks.serving_wall_ratio``), when
      computed; clocks: the
      SPS clock's ratio to target-only decoding against the wall clock's
      (``dspark.evaluation.clocks.serving_clock_difference``
      as a dict), when a profile was given.
    tau_ci: the 95 % interval of τ over the requests (``dspark.evaluation.paired.serving_tau``), when computed.
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
    target_only_requests: list[dict[str, Any]] = field(default_factory=list)
    wall_ci: list[float] | None = None
    clocks: dict[str, Any] | None = None
    table_ci: list[float] | None = None
    tau_ci: list[float] | None = None
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
            total = sum(w / speed_at(sps, b) for b, w in steps.items())
            if forwards:
                total += overhead * sum(n / speed_at(sps, b) for b, n in forwards.items()) / verify_s
            else:
                total += overhead
            return tokens / total / (r * speed_at(sps, r))

        return price

    def summary(self) -> dict[str, Any]:
        """The scalar results as a dict (what results.json and the tables hold)."""
        return {
            "policy": self.policy,
            "concurrency": self.concurrency,
            "throughput": self.throughput,
            "tau": self.tau,
            "tau_ci": self.tau_ci,
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
            "wall_vs_target_only_ci": self.wall_ci,
            "clocks": self.clocks,
        }
