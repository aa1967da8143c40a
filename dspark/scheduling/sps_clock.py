"""The SPS clock of the serving loop: what a step costs in simulated seconds (paper Section 3.2.2).

A step's verification forward at B batch tokens costs 1 / SPS(B) on a profiled ``SPSTable``; the
drafting and the other per-round phases are charged by ``ServeSettings.draft_overhead``: a fraction f
of the step, or ``"measured"`` (every phase measured in the step but the verification forward, put on
the table's time scale at the end of the run, ``on_table_scale``). docs/scheduling.md, "The SPS clock",
has the model and what it assumes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Union

from dspark.scheduling.algorithm1 import SPSTable

__all__ = ["MEASURED", "UNCHARGED_PHASES", "draft_clock", "on_table_scale", "sps_table", "speed_at", "step_seconds"]

MEASURED = "measured"  # draft_overhead: charge each step its measured non-verify phases (draft, accept, ...)
UNCHARGED_PHASES = frozenset({"verify", "prefill"})  # the phases "measured" does not charge
PathLike = Union[str, os.PathLike]


def sps_table(sps: SPSTable | PathLike | None) -> SPSTable | None:
    """An SPS table given as itself or as the path of its JSON."""
    return SPSTable.from_json(sps) if isinstance(sps, (str, os.PathLike)) else sps


def draft_clock(draft_overhead: float | str) -> tuple[str, float | str]:
    """(label, value) of a ``draft_overhead``: a fraction f >= 0 or "measured"."""
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


def speed_at(sps: SPSTable, batch: int) -> float:
    """SPS(B) on ``sps``; a B beyond the table's max_batch_tokens is an error."""
    speed = float(sps(batch))
    if not speed > 0:
        raise ValueError(
            f"a step needs B = {batch} batch tokens but the SPS table stops at max_batch_tokens = "
            f"{sps.max_batch_tokens}; profile larger batches (dspark profile-sps --batch-tokens ...) "
            "or lower the concurrency"
        )
    return speed


def step_seconds(verify: float, draft_overhead: float | str, draft_times: Sequence[float], overhead_s: float) -> float:
    """Simulated seconds of one step: ``verify`` = 1 / SPS(B) (NaN without a table), plus what
    ``draft_overhead`` says: with "measured" the step's measured non-verify seconds ``overhead_s``
    (put on the table's time scale at the end of the run, ``on_table_scale``); with a fraction f,
    f / SPS(B) when some request drafted."""
    if math.isnan(verify):
        return math.nan
    if draft_overhead == MEASURED:
        return verify + overhead_s
    if not draft_times:
        return verify
    return (1.0 + float(draft_overhead)) * verify


def on_table_scale(result: Any) -> None:
    """Charge every step's measured overhead of a ``SimResult`` on the SPS table's time scale:
    time_scale = verify_table_s / verify_s, each step 1 / SPS(B) + overhead_s · time_scale."""
    if not result.verify_s > 0 or not math.isfinite(result.verify_table_s):
        return
    result.time_scale = result.verify_table_s / result.verify_s
    result.sim_time_s = result.live_time_s = 0.0
    for row in result.step_log:
        row["step_time_s"] = row["verify_step_s"] + row["overhead_s"] * result.time_scale
        result.sim_time_s += row["step_time_s"]
        result.live_time_s += row["step_time_s"] * row["live"]

