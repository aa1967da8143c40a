"""The wall clock and the SPS clock of the same requests, compared as a paired difference with its interval.

A scheduled evaluation at R = 1 (``dspark eval --policy P --concurrency 1 --sps sps.json``) decodes every
request once, through the serving loop (``dspark.scheduling.simulator.run_requests``), and times it twice
over: the wall clock (the seconds its own phases took, against the target-only decode of the same
prompt: ``wall_ratio``) and the SPS clock (paper Section 3.2.2: each verification forward priced by the
profiled table, every other phase charged as measured: ``sps_ratio``). Their difference measures how well
the table prices this run's forwards relative to the target-only step. It is paired: both clocks time
the same requests and the same decode, so the request-to-request variation (a long prompt, a hard one)
moves both together and cancels in the difference; what is left is the disagreement of the clocks.

- ``clock_difference``          sps − wall at R = 1, its interval over requests and the table's timing noise
- ``serving_clock_difference``  the two clocks' ratios to target-only decoding of a batched serving run, at any R
- ``request_clock_aggregates``  the per-request sums both clocks are functions of
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from dspark.bootstrap import DEFAULT_LEVEL, DEFAULT_RESAMPLES, check_settings, design_df, jackknife_ci, \
    student_t_quantile
from dspark.evaluation.paired import benchmark_groups, load_evaluation
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.sps_profile import SPSProfile, bootstrap_tables, load_profile, profile_path

PathLike = Union[str, os.PathLike]
Rows = tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]

__all__ = ["CLOCK_COLUMNS", "ClockDifference", "clock_difference", "serving_clock_difference", "serving_wall_ratio",
           "throughput_ratio_ci", "clock_verdict", "forward_size", "forward_sizes", "load_scheduled_evaluation",
           "request_clock_aggregates", "sps_ratio", "wall_ratio"]

# The per-request sums, in this order, then one count of verification forwards per size B.
CLOCK_COLUMNS = ("tokens", "wall_s", "baseline_tokens", "baseline_s", "other_s", "verify_s")
_UNCHARGED = frozenset({"verify", "prefill", "total"})  # not in O: modelled, not charged, or the sum


# ------------------------------------------------------------------ per-request sums
def forward_size(round_row: Mapping[str, Any]) -> int:
    """B of a round's verification forward at R = 1: its step's ``batch_tokens`` (1 + ℓ), else
    1 + ``proposed``. A round that accepted an EOS records proposed = m (the drafts up to the EOS),
    while its forward verified 1 + ℓ tokens: only ``batch_tokens`` prices it as the simulator does."""
    if round_row.get("batch_tokens") is not None:
        return int(round_row["batch_tokens"])
    return 1 + int(round_row["proposed"])


def forward_sizes(rounds: Sequence[Mapping[str, Any]]) -> list[int]:
    """The sizes B of the verification forwards of ``rounds``, increasing, each once."""
    return sorted({forward_size(r) for r in rounds})


def request_clock_aggregates(
    records: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]], sizes: Sequence[int]
) -> dict[str, np.ndarray]:
    """Per benchmark, the per-request sums both clocks are functions of: float64 [n_b, 6 + len(sizes)].

    Columns (``CLOCK_COLUMNS``): decode tokens (tokens − 1), decode wall seconds (wall_s − prefill),
    baseline decode tokens and seconds (the same of the target-only decode), O (measured seconds of
    every phase but verify and prefill), V (measured verify seconds); then, per B of ``sizes``, the
    request's verification forwards over B tokens (``forward_size``). Requests in the records'
    order, grouped by benchmark in order of first appearance. A record without baseline fields
    has NaN baseline columns; one without timings (or without their prefill) NaN wall, O and V.

    ValueError when a round has no record, a round's size is not in ``sizes``, or two rounds of
    one benchmark share a step (R > 1: a request's phases are then not a step's)."""
    index = {i: s for s, i in enumerate(int(b) for b in sizes)}
    keys = [(str(r["benchmark"]), r["request"]) for r in records]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"two request rows for {duplicate}: give one evaluation's requests.jsonl")
    row_of = {k: i for i, k in enumerate(keys)}
    values = np.array([_request_sums(r) for r in records], dtype=np.float64).reshape(len(records), -1)
    counts = np.zeros((len(records), len(index)))
    steps: set[tuple[str, Any, int]] = set()
    for r in rounds:
        key = (str(r["benchmark"]), r["request"])
        if key not in row_of:
            raise ValueError(f"rounds.jsonl has a round of request {key} but requests.jsonl has no row for it: "
                             "give the two files of one evaluation")
        size = forward_size(r)
        if size not in index:
            raise ValueError(f"a round of request {key} verified B = {size} tokens but sizes = {list(sizes)}; "
                             "pass forward_sizes(rounds)")
        counts[row_of[key], index[size]] += 1
        if r.get("step") is not None:
            step = (key[0], records[row_of[key]].get("rank", 0), int(r["step"]))
            if step in steps:
                raise ValueError(f"two rounds of benchmark {key[0]!r} share step {step[2]}: the run served "
                                 "R > 1 requests at a time, whose phases are not a step's; compare the clocks "
                                 "on an evaluation at --concurrency 1")
            steps.add(step)
    table = np.concatenate([values, counts], axis=1)
    out: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(k[0] for k in keys):
        out[name] = table[[i for i, k in enumerate(keys) if k[0] == name]]
    return out


def _request_sums(record: Mapping[str, Any]) -> list[float]:
    """(decode tokens, decode wall s, baseline decode tokens, baseline decode s, O, V) of one record."""
    nan = math.nan
    tokens = max(0, int(record["tokens"]) - 1)
    timings = record.get("timings")
    if isinstance(timings, Mapping) and "prefill" in timings and "wall_s" in record:
        wall = float(record["wall_s"]) - float(timings["prefill"])
        other = sum(float(v) for k, v in timings.items() if k not in _UNCHARGED)
        verify = float(timings.get("verify", 0.0))  # none when x_0 ended the request: no round
    else:
        wall = other = verify = nan
    base_timings = record.get("baseline_timings")
    if "baseline_wall_s" in record and isinstance(base_timings, Mapping) and "prefill" in base_timings:
        base_tokens = float(max(0, int(record["baseline_tokens"]) - 1))
        base_s = float(record["baseline_wall_s"]) - float(base_timings["prefill"])
    else:
        base_tokens = base_s = nan
    return [float(tokens), wall, base_tokens, base_s, other, verify]


# ------------------------------------------------------------------ the two clocks
def wall_ratio(sums: np.ndarray) -> np.ndarray:
    """The wall clock's decode-only speedup of request sums [..., d] (columns ``CLOCK_COLUMNS``): the
    request's own phases (prefill, draft, verify, accept, bookkeeping, schedule) against the target-only
    decode of the same prompt, pooled over the requests (``decode_speed`` of ``dspark.evaluation.intervals``):

        wall = [Σ (tokens − 1) / Σ (wall_s − prefill)]
               / [Σ (baseline_tokens − 1) / Σ (baseline_wall_s − baseline prefill)]"""
    s = np.asarray(sums, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def sps_ratio(sums: np.ndarray, speeds: np.ndarray, speed_1: Any) -> np.ndarray:
    """The SPS clock's ratio to target-only decoding, Σ (tokens − 1) / (t(1) · A · (1 + O / V)).

    The SPS clock (``draft_overhead="measured"``, the simulator's module docstring) charges a round's
    verification forward over 1 + ℓ tokens 1 / SPS(1 + ℓ) from the profiled table (a plain target step
    of ``algorithm1+skip``, ℓ = 0: 1 / SPS(1)), and every other measured phase but verify and prefill
    (draft, accept, bookkeeping, schedule, ...) as measured, put on the table's time scale by
    time_scale = Σ_rounds 1 / SPS(1 + ℓ) / Σ measured verify seconds. Its ratio to target-only decoding
    is Θ / SPS(1), Θ = decode tokens (tokens − 1 per request: x_0 comes from the prefill) over simulated
    seconds. With A(t) = Σ_rounds 1 / t(1 + ℓ), O = Σ measured non-verify, non-prefill seconds and
    V = Σ measured verify seconds over a set of requests priced by a table t (steps/s at B batch tokens;
    between its samples it interpolates, beyond ``max_batch_tokens`` it has no price, as ``SPSTable``
    and the simulator do), the simulated seconds are A(t) + O · A(t) / V, hence the ratio above. On one
    serving run and its own table this is ``SimResult.summary()["vs_target_only"]``; over several runs
    (one per benchmark) it pools their time scales into one, Σ A / Σ V.

    sums: request sums [..., d] (``request_clock_aggregates``' columns); speeds: t(B) of each size
    of ``sizes``, [k] or [K, k] for K tables (then sums broadcast against [K]); speed_1: t(1),
    scalar or [K]. NaN where V is 0, a size has no price (t(B) = 0) or nothing was decoded."""
    s = np.asarray(sums, dtype=np.float64)
    speeds = np.asarray(speeds, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        priced = np.where(speeds > 0, 1.0 / speeds, np.nan)  # [..., k]
        forwards = (s[..., len(CLOCK_COLUMNS):] * priced).sum(axis=-1)  # A
        tokens, other, verify = s[..., 0], s[..., 4], s[..., 5]
        ratio = tokens / (np.asarray(speed_1, dtype=np.float64) * forwards * (1.0 + other / verify))
    ok = (verify > 0) & (forwards > 0) & np.isfinite(ratio)
    return np.where(ok, ratio, np.nan)


def _prices(table: SPSTable, sizes: Sequence[int]) -> tuple[np.ndarray, float]:
    """(t(B) for each size [k], t(1)) of one table; 0 beyond ``max_batch_tokens`` (no price)."""
    return np.asarray(table(np.asarray(sizes, dtype=np.float64)), dtype=np.float64).reshape(-1), float(table(1))


# ------------------------------------------------------------------ the difference and its interval
@dataclass(frozen=True)
class ClockDifference:
    """The SPS clock against the wall clock on the same requests (``clock_difference``).

    sps: the SPS clock's ratio to target-only decoding on the profile's measured medians
    (``SPSProfile.measured_table``); wall: the wall clock's decode-only speedup; difference =
    sps − wall; lo, hi: its ``level`` interval over requests and the table's timing noise
    (NaN without one); request_lo, request_hi: the interval over requests alone (the stratified
    jackknife); v_requests, v_table: the two variances; df: ν = Σ_b (n_b − 1) (NaN when no
    benchmark has two requests); requests: the requests compared; verdict: ``clock_verdict``."""

    sps: float
    wall: float
    difference: float
    lo: float
    hi: float
    request_lo: float
    request_hi: float
    v_requests: float
    v_table: float
    df: float
    requests: int
    level: float
    verdict: str


def clock_verdict(lo: float, hi: float) -> str:
    """"agree" when [lo, hi] holds 0, "SPS clock above" / "SPS clock below" when it lies above / below
    0, "–" when there is no interval (NaN bounds)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "–"
    if lo > 0.0:
        return "SPS clock above"
    if hi < 0.0:
        return "SPS clock below"
    return "agree"


def load_scheduled_evaluation(folder: PathLike) -> Rows:
    """(request rows, round rows) of a scheduled evaluation at R = 1 (``dspark eval --policy P
    --concurrency 1``): its report.json, requests.jsonl and rounds.jsonl. ValueError when
    report.json's config.concurrency is not 1."""
    report, records, rounds = load_evaluation(folder)
    concurrency = (report.get("config") or {}).get("concurrency")
    if concurrency != 1:
        what = "a plain evaluation: no serving loop" if concurrency is None else f"R = {concurrency}"
        raise ValueError(f"{folder}: report.json's config.concurrency is {concurrency!r} ({what}); the clocks are "
                         "compared on requests served one at a time: run `dspark eval --policy P --concurrency 1 "
                         "--sps sps.json` (at R > 1 a request's phases are not a step's)")
    return records, rounds


def _profile(profile: SPSProfile | PathLike) -> SPSProfile:
    if isinstance(profile, SPSProfile):
        return profile
    path = Path(profile)
    return load_profile(path if path.name.endswith(".profile.json") else profile_path(path))


def _rows(folder_or_rows: PathLike | Rows) -> Rows:
    if isinstance(folder_or_rows, (str, os.PathLike)):
        return load_scheduled_evaluation(folder_or_rows)
    records, rounds = folder_or_rows
    return list(records), list(rounds)


def clock_difference(
    folder_or_rows: PathLike | Rows,
    profile: SPSProfile | PathLike,
    *,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> ClockDifference:
    """sps − wall over the requests of a scheduled evaluation at R = 1, with its interval.

    The difference is a smooth function of per-request sums (``request_clock_aggregates``: decode tokens
    and seconds, baseline decode tokens and seconds, the verification forwards of each size, O and V),
    so its variance over requests is the stratified delete-one jackknife's (``dspark.bootstrap.jackknife_ci``;
    benchmarks are the strata, as for every interval over requests), v_requests. The table's own timing
    noise enters too: the observed sums are priced by each of ``dspark.scheduling.sps_profile.bootstrap_tables``
    (the profile's sweeps resampled jointly across B), and v_table is the variance of the difference
    over those tables. The two sources are independent (the profile was timed apart from the evaluation),
    so the interval is difference ± t_ν · sqrt(v_requests + v_table), ν = Σ_b (n_b − 1), with Student's t
    at the design degrees of freedom; ``clock_verdict`` reads it. At R > 1 on the per-request engine a
    request's phases are not a step's (the SPS clock charges the step's batch B = Σ (1 + ℓ_r)), so only
    R = 1 runs are compared this way (``serving_clock_difference`` compares the batched engine's steps).

    folder_or_rows: the evaluation's output folder (``load_scheduled_evaluation``) or its (request
    rows, round rows); profile: the ``SPSProfile`` of the table (or the path of its .profile.json,
    or of the table JSON it sits next to). ``resamples`` tables of ``bootstrap_tables(profile,
    resamples, seed)`` carry the table's timing noise."""
    check_settings(resamples, level)
    records, rounds = _rows(folder_or_rows)
    if not records:
        raise ValueError("no request rows: the clocks are compared over the requests of an evaluation")
    profile = _profile(profile)
    sizes = forward_sizes(rounds)
    groups = list(request_clock_aggregates(records, rounds, sizes).values())
    speeds, speed_1 = _prices(profile.measured_table, sizes)

    def difference(sums: np.ndarray) -> np.ndarray:  # group sums [..., G, d] -> [...]
        total = sums.sum(axis=-2)
        return sps_ratio(total, speeds, speed_1) - wall_ratio(total)

    total = np.concatenate(groups, axis=0).sum(axis=0)  # [d]
    sps, wall = float(sps_ratio(total, speeds, speed_1)), float(wall_ratio(total))
    estimate, request_lo, request_hi = jackknife_ci(groups, difference, level=level, scale="identity")
    nu = design_df([len(g) for g in groups])
    t = student_t_quantile((1.0 + float(level)) / 2, nu) if np.isfinite(nu) else math.nan
    v_requests = ((request_hi - request_lo) / (2.0 * t)) ** 2 if np.isfinite(t) else math.nan
    v_table = _table_variance(total, sizes, bootstrap_tables(profile, resamples, seed))
    half = t * math.sqrt(v_requests + v_table) if np.isfinite(v_requests + v_table) else math.nan
    lo, hi = float(estimate) - half, float(estimate) + half
    return ClockDifference(sps=sps, wall=wall, difference=float(estimate), lo=lo, hi=hi,
                           request_lo=float(request_lo), request_hi=float(request_hi), v_requests=float(v_requests),
                           v_table=v_table, df=float(nu), requests=len(records), level=float(level),
                           verdict=clock_verdict(lo, hi))


def _table_variance(total: np.ndarray, sizes: Sequence[int], tables: Iterable[SPSTable]) -> float:
    """The variance of the difference over ``tables`` (the observed sums ``total`` [d] priced by each):
    the wall clock does not depend on the table, so it is the variance of the SPS ratio. NaN when
    a table leaves it undefined."""
    priced = [_prices(table, sizes) for table in tables]
    speeds = np.stack([p[0] for p in priced]).reshape(len(priced), len(sizes))  # [K, k]
    ratios = sps_ratio(total, speeds, np.array([p[1] for p in priced]))  # [K]
    if not np.all(np.isfinite(ratios)):
        return math.nan
    # about the first ratio: the same ratio from every table (a profile without noise) gives exactly 0
    return float(np.var(ratios - ratios[0], ddof=1)) if ratios.size > 1 else 0.0


# ------------------------------------------------------------------ the batched serving loop, any R
def _request_step_sums(result: Any) -> tuple[dict[int, np.ndarray], list[int]]:
    """Request index -> its shares of the run's steps, float64 [4 + k] = (tokens, W, O, V, counts per
    forward size: each step's seconds and count over its rows); and the forward sizes."""
    steps = {int(row["step"]): row for row in result.step_log}
    sizes = sorted({int(row["priced_tokens"]) for row in result.step_log})
    col = {b: 4 + i for i, b in enumerate(sizes)}
    sums: dict[int, np.ndarray] = {}
    for r in result.rounds:
        step = steps[int(r["step"])]
        rows = float(r["rows"])
        row = sums.setdefault(int(r["request"]), np.zeros(4 + len(sizes)))
        row[0] += float(r["emitted"])
        row[1] += float(step["wall_s"]) / rows
        row[2] += float(step["overhead_s"]) / rows
        row[3] += float(step["verify_s"]) / rows
        row[col[int(step["priced_tokens"])]] += 1.0 / rows
    return sums, sizes


def _paired_step_sums(result: Any) -> tuple[list[np.ndarray], list[int], list[int]]:
    """Per benchmark, each request's shares of the cell's steps and of the target-only decode's:
    float64 [n_b, 8 + k + k'] = (tokens, W, O, V, counts per cell forward size [k], target-only tokens,
    target-only W, O', V', counts per target-only forward size [k']), O' and V' the target-only
    steps' seconds outside and inside the target forward (sampling and bookkeeping; the forward
    with its LM head); and the two size lists. A request one decode did not serve (the stop rule cut
    it) has zeros there."""
    if not result.target_only_requests or any("step_forwards" not in r or "decode" not in r.get("timings", {})
                                              for r in result.target_only_requests):
        raise ValueError("serving_clock_difference needs the run's target-only decode with its forwards and "
                         "phases (SimResult.target_only_requests with step_forwards and timings: "
                         "simulate(..., target_only=True) or serve_together on the batched engine)")
    shares, sizes = _request_step_sums(result)
    base_sizes = sorted({int(b) for r in result.target_only_requests for b in r["step_forwards"]})
    col = {b: 8 + len(sizes) + i for i, b in enumerate(base_sizes)}
    width = 8 + len(sizes) + len(base_sizes)
    rows: dict[int, np.ndarray] = {}
    for index, share in shares.items():
        rows[index] = np.zeros(width)
        rows[index][:4 + len(sizes)] = share
    for r in result.target_only_requests:
        row = rows.setdefault(int(r["index"]), np.zeros(width))
        row[4 + len(sizes)] += float(r["step_tokens"])
        row[5 + len(sizes)] += float(r["step_s"])
        row[6 + len(sizes)] += float(r["step_s"]) - float(r["timings"]["decode"])
        row[7 + len(sizes)] += float(r["timings"]["decode"])
        for b, count in r["step_forwards"].items():
            row[col[int(b)]] += float(count)
    tags = {int(r["index"]): r.get("tag") for r in [*result.requests, *result.target_only_requests]}
    return benchmark_groups(dict(sorted(rows.items())), tags), sizes, base_sizes


def _paired_clocks(sums: np.ndarray, k: int, speeds: np.ndarray, base_speeds: np.ndarray) -> np.ndarray:
    """[..., 3] = (SPS clock's ratio to target-only, wall clock's ratio, sps / wall − 1) of summed
    shares [..., 8 + k + k'] (``_paired_step_sums``) priced at t(B) = 1 / speeds [k] and [k'] (or [K, k])."""
    s = np.asarray(sums, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        price = np.where(speeds > 0, 1.0 / np.asarray(speeds, dtype=np.float64), np.nan)
        base_price = np.where(base_speeds > 0, 1.0 / np.asarray(base_speeds, dtype=np.float64), np.nan)
        sps_time = (s[..., 4:4 + k] * price).sum(axis=-1) * (1.0 + s[..., 2] / s[..., 3])
        base_sps_time = (s[..., 8 + k:] * base_price).sum(axis=-1) * (1.0 + s[..., 6 + k] / s[..., 7 + k])
        tokens, wall, base_tokens, base_wall = s[..., 0], s[..., 1], s[..., 4 + k], s[..., 5 + k]
        sps = (tokens / sps_time) / (base_tokens / base_sps_time)
        wall_ratio = (tokens / wall) / (base_tokens / base_wall)
        return np.stack([sps, wall_ratio, sps / wall_ratio - 1.0], axis=-1)


def serving_clock_difference(result: Any, profile: SPSProfile | PathLike, *, level: float = DEFAULT_LEVEL,
                             resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> ClockDifference:
    """The SPS clock against the wall clock on one batched serving run and its target-only decode:
    ``sps`` and ``wall`` are the two clocks' throughput ratios to target-only decoding of the same
    requests at R, ``difference`` = sps / wall − 1, with its interval over the requests and the
    table's timing noise.

    On the batched engine (``dspark.scheduling.batched_serving``) every step is one drafter and one
    target forward for all live rows, timed on the wall clock. Each request takes its share of every
    step it was live in (the step's seconds over its rows), so per request

        tokens,  W = Σ wall / rows,  O = Σ (measured non-verify seconds) / rows,  V = Σ verify / rows,
        and, per forward size B_fwd = rows · (1 + max ℓ), the count Σ 1 / rows;

    and of the target-only decode of the same jobs (``SimResult.target_only_requests``) its tokens,
    seconds W' (O' outside the target forward: sampling and bookkeeping; V' the forward) and forwards
    per size (rows · 1 token). Both decodes' phases outside the forward are charged as measured, on the
    table's time scale of their own forwards (what ``draft_overhead="measured"`` charges a cell). The
    clocks' ratios over the same steps are

        wall = (Σ tokens / Σ W) / (Σ tokens' / Σ W'),
        sps  = (Σ tokens / (A(t) · (1 + O / V))) / (Σ tokens' / (A'(t) · (1 + O' / V'))),  A(t) = Σ counts / t(B),

    so difference + 1 = (Σ W / (A(t) · (1 + O / V))) / (Σ W' / (A'(t) · (1 + O' / V'))): how the table
    prices the cell's forwards relative to the target-only forwards. Served step by step in turn
    (``serve_together``), both decodes meet the machine's speed of the same minutes, and a machine that
    runs faster or slower than when the table was profiled moves both factors alike. The interval is
    ``clock_difference``'s: the stratified jackknife over the requests (each deleted from both decodes)
    plus the table's timing noise."""
    check_settings(resamples, level)
    if getattr(result, "engine", "per-request") != "batched" or not result.step_log:
        raise ValueError("serving_clock_difference needs a run of the batched engine with its step log "
                         "(ServeSettings.engine='batched'); for R = 1 evaluations use clock_difference")
    profile = _profile(profile)
    groups, sizes, base_sizes = _paired_step_sums(result)
    k = len(sizes)

    def speeds_of(table: Any) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.asarray(table(np.asarray(b, dtype=np.float64)), dtype=np.float64).reshape(-1)
                     for b in (sizes, base_sizes))

    speeds, base_speeds = speeds_of(profile.measured_table)

    def difference(sums: np.ndarray) -> np.ndarray:
        return _paired_clocks(sums.sum(axis=-2), k, speeds, base_speeds)[..., 2]

    total = np.concatenate(groups, axis=0).sum(axis=0)
    estimate, request_lo, request_hi = jackknife_ci(groups, difference, level=level, scale="identity")
    nu = design_df([len(g) for g in groups])
    t = student_t_quantile((1.0 + float(level)) / 2, nu) if np.isfinite(nu) else math.nan
    v_requests = ((request_hi - request_lo) / (2.0 * t)) ** 2 if np.isfinite(t) else math.nan
    values = np.asarray([_paired_clocks(total, k, *speeds_of(tb))[2]
                         for tb in bootstrap_tables(profile, resamples, seed)], dtype=np.float64)
    v_table = float(np.var(values - values[0], ddof=1)) if values.size > 1 and np.all(np.isfinite(values)) else \
        (0.0 if values.size <= 1 else math.nan)
    half = t * math.sqrt(v_requests + v_table) if np.isfinite(v_requests + v_table) else math.nan
    lo, hi = float(estimate) - half, float(estimate) + half
    sps, wall, _ = (float(x) for x in _paired_clocks(total, k, speeds, base_speeds))
    return ClockDifference(sps=sps, wall=wall, difference=float(estimate), lo=lo, hi=hi,
                           request_lo=float(request_lo), request_hi=float(request_hi), v_requests=float(v_requests),
                           v_table=v_table, df=float(nu), requests=int(sum(len(g) for g in groups)),
                           level=float(level), verdict=clock_verdict(lo, hi))


def serving_wall_ratio(result: Any, *, level: float = DEFAULT_LEVEL) -> tuple[float, float, float, int]:
    """(estimate, lo, hi, requests): the batched serving run's wall-clock throughput over target-only
    decoding of the same requests at the same R (``SimResult.wall_vs_target_only``), with its ``level``
    interval over the requests.

    Both decodes served the same jobs (same prompts, seeds and stop rule) and each request took its
    share of every step it was live in (the step's seconds over its rows), so per request i

        a_i = (tokens, W) of the speculative steps,  b_i = (tokens, W) of the target-only steps,

    paired by the request's index, and the ratio is (Σ a_tokens / Σ a_W) / (Σ b_tokens / Σ b_W). Its
    interval is the stratified delete-one jackknife over the requests (strata: the tag's benchmark), on
    the log scale (a ratio of positive throughputs): deleting a request removes it from both decodes.
    A request served by one decode only (the stop rule cut the other) counts zeros in the other.
    Errors name what is missing: a run of another engine, or one without its target-only requests."""
    if getattr(result, "engine", "per-request") != "batched" or not result.step_log:
        raise ValueError("serving_wall_ratio needs a run of the batched engine with its step log "
                         "(ServeSettings.engine='batched')")
    if not result.target_only_requests:
        raise ValueError("serving_wall_ratio needs the run's target-only requests (simulate(..., target_only=True) "
                         "on the batched engine records them in SimResult.target_only_requests)")
    shares, _ = _request_step_sums(result)
    rows = {index: np.array([s[0], s[1], 0.0, 0.0]) for index, s in shares.items()}
    for r in result.target_only_requests:
        row = rows.setdefault(int(r["index"]), np.zeros(4))
        row[2] += float(r["step_tokens"])
        row[3] += float(r["step_s"])
    tags = {int(r["index"]): r.get("tag") for r in [*result.requests, *result.target_only_requests]}
    estimate, lo, hi = throughput_ratio_ci(benchmark_groups(dict(sorted(rows.items())), tags), level=level)
    return estimate, lo, hi, len(rows)


def throughput_ratio_ci(groups: Sequence[np.ndarray], *, level: float = DEFAULT_LEVEL) -> tuple[float, float, float]:
    """(estimate, lo, hi) of (Σ a_tokens / Σ a_s) / (Σ b_tokens / Σ b_s) over per-request rows
    [n_g, 4] = (a_tokens, a_s, b_tokens, b_s) of G strata (``wall_ratio``'s first four columns): the
    stratified jackknife on the log scale (``dspark.bootstrap.jackknife_ci``), each request deleted
    from both decodes at once."""
    estimate, lo, hi = jackknife_ci(list(groups), lambda sums: wall_ratio(sums.sum(axis=-2)), level=level,
                                    scale="log")
    return float(estimate), float(lo), float(hi)
