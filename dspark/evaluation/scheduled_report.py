"""What a scheduled evaluation (``dspark eval --policy``) reports besides τ: its speed against
target-only decoding and what a round costs, in target steps.

- ``scheduled_summary``   ``report["scheduled"]``: tokens/s and speedups, the mean verified length, the
                          share of skipped drafts, and the draft and round costs in target steps.
- ``scheduled_markdown``  report.md's "Scheduled verification" section; ``scheduling_table`` one row
                          per scheduled evaluation.
- ``sum_phases``          seconds per decode phase summed over requests (the report's timings too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dspark.evaluation.markdown import fmt_number, markdown_table


def sum_phases(timings: Any) -> dict[str, float]:
    """Phase -> seconds, summed over the requests' ``timings`` dicts."""
    total: dict[str, float] = {}
    for t in timings:
        for phase, seconds in t.items():
            total[phase] = total.get(phase, 0.0) + float(seconds)
    return total


def scheduled_summary(
    records: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]], pooled: Mapping[str, Any],
    *, policy: str, concurrency: int, sps_step_s: float | None = None,
) -> dict[str, Any]:
    """``report["scheduled"]`` of ``dspark eval --policy``: speed against target-only decoding
    and what a round costs, in target steps.

    pooled: ``report["all"]`` (tokens_per_s, speedup, decode_speedup, τ). The target step t is
    measured from the target-only decodes (decode seconds / forwards) when they ran, else
    1 / SPS(1) (``sps_step_s``); ``target_step_basis`` says which. Per round (rounds that drafted
    for the draft): draft_cost_steps = draft seconds / t, round_cost_steps = (draft + verify +
    accept + bookkeeping seconds) / t, so decode_speedup ≈ τ / round_cost_steps, and speculation
    with no draft cost would reach τ / (round_cost_steps − draft_cost_steps)."""
    phases = sum_phases(r.get("timings", {}) for r in records)
    n_rounds = len(rounds)
    drafted = sum(1 for r in rounds if r.get("drafted", True))
    step_s, basis = _target_step(records, sps_step_s)
    draft_s = phases.get("draft", 0.0)
    round_s = sum(s for k, s in phases.items() if k not in ("prefill", "total"))
    per = lambda seconds, n: seconds / n / step_s if n and step_s > 0 else math.nan  # noqa: E731
    return {
        "policy": policy, "concurrency": concurrency,
        "tokens_per_s": pooled.get("tokens_per_s"), "baseline_tokens_per_s": pooled.get("baseline_tokens_per_s"),
        "speedup": pooled.get("speedup"), "decode_speedup": pooled.get("decode_speedup"), "tau": pooled.get("tau"),
        "mean_verified": sum(int(r["proposed"]) for r in rounds) / n_rounds if n_rounds else math.nan,
        "rounds": n_rounds, "drafted_rounds": drafted, "skipped_rounds": n_rounds - drafted,
        "skip_rate": (n_rounds - drafted) / n_rounds if n_rounds else math.nan,
        "draft_s_per_round": draft_s / drafted if drafted else math.nan,
        "target_step_s": step_s, "target_step_basis": basis,
        "draft_cost_steps": per(draft_s, drafted), "round_cost_steps": per(round_s, n_rounds),
    }


def _target_step(records: Sequence[Mapping[str, Any]], sps_step_s: float | None) -> tuple[float, str]:
    """Seconds of one target step at B = 1: the target-only decodes' forward and sampling seconds
    per forward (tokens − 1 per decode), else 1 / SPS(1)."""
    forwards = sum(max(0, int(r.get("baseline_tokens", 0)) - 1) for r in records)
    seconds = sum(float(r.get("baseline_timings", {}).get(k, 0.0)) for r in records for k in ("decode", "sample"))
    if forwards and seconds > 0 and all("baseline_timings" in r for r in records):
        return seconds / forwards, "target-only decode"
    if sps_step_s is not None and sps_step_s > 0:
        return float(sps_step_s), "SPS(1)"
    return math.nan, "none"


_SCHEDULED_HEADER = ["policy", "R", "tok/s", "target-only tok/s", "speedup", "decode speedup", "τ",
                     "mean verified ℓ", "skipped", "draft ms/round", "draft cost (steps)", "round cost (steps)"]


def scheduling_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One markdown row per scheduled evaluation (``report["scheduled"]`` of each): speed against
    target-only decoding, τ, mean verified length, share of skipped drafts, draft and round costs."""
    rows = [[str(s["policy"]), str(s["concurrency"]), fmt_number(s["tokens_per_s"], 1),
             fmt_number(s["baseline_tokens_per_s"], 1), fmt_number(s["speedup"]), fmt_number(s["decode_speedup"]),
             fmt_number(s["tau"]), fmt_number(s["mean_verified"]), fmt_number(s["skip_rate"]),
             fmt_number(1e3 * s["draft_s_per_round"], 1), fmt_number(s["draft_cost_steps"]),
             fmt_number(s["round_cost_steps"])] for s in summaries]
    return markdown_table(_SCHEDULED_HEADER, rows)


def scheduled_markdown(scheduled: Mapping[str, Any]) -> list[str]:
    """The lines of report.md's "Scheduled verification" section (``scheduled_summary``)."""
    return ["", "## Scheduled verification", "",
            f"Costs in target steps at B = 1 (t = {fmt_number(1e3 * scheduled['target_step_s'], 2)} ms, from "
            f"{scheduled['target_step_basis']}); decode speedup ≈ τ / round cost, and a round with no draft would "
            "cost round − draft steps.", "", scheduling_table([scheduled])]
