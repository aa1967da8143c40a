"""The statistical verdicts of a demo run, beside the comparisons they rest on (``compare``, ``paired``, ``clocks``).

- ``position_verdicts``  where one drafter's conditional acceptance lies above or below another's beyond
                         both 95 % intervals (the two do not overlap), per draft position.
- ``paired_rows``        each policy's speedup and τ over ``PAIRED_BASELINE``'s (static γ) on the same
                         requests at R = 1 (``dspark.evaluation.paired.paired_ratio``); ``paired_verdict``
                         says whether the interval separates them, ``fmt_ratio`` shows one.
- ``clock_rows``         the SPS clock against the wall clock on each policy's scheduled evaluation at R = 1
                         (``dspark.evaluation.clocks.clock_difference``); ``clock_cell`` shows one.

Separate intervals that do not overlap are a conservative test of a difference; a paired interval that
excludes 1 separates two policies even where their own intervals overlap (docs/evaluation.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dspark.evaluation.demo_runs import policy_order
from dspark.evaluation.markdown import fmt_ci

PAIRED_BASELINE = "static"  # the paper's fixed γ: every other policy is compared with it


def position_verdicts(row: Mapping[str, Any], other: Mapping[str, Any], first: int = 2) -> dict[str, list[int]]:
    """Positions k ≥ ``first`` at which ``row``'s conditional acceptance lies "above" or "below"
    ``other``'s beyond both 95 % intervals (they do not overlap), where the intervals "overlap",
    and where either has no interval ("unmeasured": no round reached k, or no interval was
    computed). Separate intervals that do not overlap are a conservative test of a difference."""
    out: dict[str, list[int]] = {"above": [], "below": [], "overlap": [], "unmeasured": []}
    for k in range(first, min(len(row["cis"]), len(other["cis"])) + 1):
        a, b = row["cis"][k - 1], other["cis"][k - 1]
        if a is None or b is None or not all(math.isfinite(x) for x in (*a, *b)):
            out["unmeasured"].append(k)
        elif a[0] > b[1]:
            out["above"].append(k)
        elif a[1] < b[0]:
            out["below"].append(k)
        else:
            out["overlap"].append(k)
    return out


# ---------------------------------------------------------------------------
# Paired against the baseline
# ---------------------------------------------------------------------------


def paired_rows(run: Mapping[str, Any], baseline: str = PAIRED_BASELINE) -> list[dict[str, Any]]:
    """For every other policy with a scheduled evaluation at R = 1: its speedup and τ over the
    baseline's on the same requests (``dspark.evaluation.paired.paired_ratio``, each speedup against its own
    target-only decodes), as {policy, paired: PairedRatio or None, error: why not or None}.
    Empty without the baseline's evaluation. Kept in ``run`` (a dict) once computed: the page
    shows them twice and each is a bootstrap."""
    cached = run.get("paired_rows", {}).get(baseline)
    if cached is not None:
        return cached
    rows = _paired_rows(run, baseline)
    if isinstance(run, dict):
        run.setdefault("paired_rows", {})[baseline] = rows
    return rows


def _paired_rows(run: Mapping[str, Any], baseline: str) -> list[dict[str, Any]]:
    from dspark.evaluation.paired import paired_ratio

    if (baseline, 1) not in run["sched"]:
        return []
    folder = run["dir"] / "sched"
    rows = []
    for policy, _ in sorted((k for k in run["sched"] if k[1] == 1 and k[0] != baseline), key=policy_order(run)):
        try:
            paired, error = paired_ratio(folder / f"{policy}-R1", folder / f"{baseline}-R1"), None
        except (OSError, ValueError, KeyError, TypeError) as e:  # a stage still running, a folder without round logs
            paired, error = None, str(e)
        rows.append({"policy": policy, "paired": paired, "error": error})
    return rows


def fmt_ratio(interval: Any) -> str:
    """"1.04 [1.01, 1.08]" of an Interval, "–" without one."""
    if interval is None:
        return "–"
    return fmt_ci(interval.estimate, [interval.lo, interval.hi])


def paired_verdict(interval: Any, baseline: str) -> str:
    from dspark.evaluation.paired import verdict

    words = {"above 1": f"above {baseline} beyond the interval", "below 1": f"below {baseline} beyond the interval",
             "includes 1": "not separated (the interval includes 1)"}
    return words.get(verdict(interval), "–")


# ---------------------------------------------------------------------------
# The two clocks
# ---------------------------------------------------------------------------


def clock_rows(run: Mapping[str, Any]) -> dict[str, Any]:
    """policy -> the paired difference of the SPS clock and the wall clock on its scheduled evaluation at
    R = 1 (``dspark.evaluation.clocks.clock_difference``, the profile behind sps.json), or None where it
    cannot be computed (no profile, a folder still being written). Kept in ``run`` once computed."""
    cached = run.get("clock_rows")
    if cached is not None:
        return cached
    from dspark.evaluation.clocks import clock_difference

    out: dict[str, Any] = {}
    profile = run["dir"] / "sps.json"
    for policy, r in run["sched"]:
        if r != 1:
            continue
        try:
            out[policy] = clock_difference(run["dir"] / "sched" / f"{policy}-R1", profile)
        except (OSError, ValueError, KeyError, TypeError):
            out[policy] = None
    if isinstance(run, dict):
        run["clock_rows"] = out
    return out


def clock_cell(diff: Any) -> str:
    """"−0.03 [−0.07, 0.01]: agree" for a ``ClockDifference`` (SPS clock minus wall clock, paired on
    the same requests: "agree" means its interval holds 0); "–" without one."""
    if diff is None or not math.isfinite(diff.difference):
        return "–"
    return f"{fmt_ci(diff.difference, [diff.lo, diff.hi])}: {diff.verdict}"
