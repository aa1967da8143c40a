"""Paired comparison of two evaluations of the same requests: the ratio of their speedups and
of their τ, with a 95 % interval over the common requests taken jointly.

Two policies (or two drafters) evaluated on the same prompts share the request-to-request
variation: a long, hard prompt is slow under both. The intervals of the two speedups
(``dspark.evaluation.intervals``) each carry that shared variation, so they can overlap while every
request is faster under one of them. Taking the common requests jointly (a request is left out of
both reports at once) cancels the shared part, and the interval of the ratio measures only the
difference (the jackknife of a statistic of paired samples deletes the pairs).

- ``paired_ratio``              the ratios of two evaluation folders (report.json, requests.jsonl,
                                rounds.jsonl as ``dspark eval`` writes them)
- ``paired_ratio_from_records`` the same from their request and round rows (tests, hand checks)
- ``serving_paired_ratio``      the same for two cells of ``dspark simulate`` at one R (the batched
                                serving loop's wall clock: each request's share of the steps it was live in;
                                the machine's drift between the two cells is not in its interval)
- ``serving_tau``               τ of one such cell with its interval over the requests
- ``benchmark_groups``          per-request rows stacked per benchmark: the strata of these intervals
- ``PairedRatio``               the result: speedup and τ ratios (``Interval``), request counts
- ``verdict``                   "above 1" / "below 1" / "includes 1" of an interval
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from dspark.bootstrap import DEFAULT_LEVEL, Interval, jackknife_ci
from dspark.evaluation.intervals import request_aggregates

PathLike = Union[str, os.PathLike]

__all__ = ["PairedRatio", "benchmark_groups", "load_evaluation", "paired_ratio", "paired_ratio_from_records",
           "serving_paired_ratio", "serving_tau", "verdict"]


@dataclass(frozen=True)
class PairedRatio:
    """Ratios of report A to report B over their common requests (the module docstring says why):

        speedup ratio = S_A / S_B,  S = (Σ tokens / Σ seconds) / (Σ baseline tokens / Σ baseline seconds)
        τ ratio       = τ_A / τ_B,  τ = Σ_rounds τ / rounds   (τ pooled over rounds, ``dspark.evaluation.metrics``)

    each sum over the common requests, i.e. the pooled numbers of ``report["all"]`` restricted to the
    requests both reports decoded (each speedup against its own target-only baseline). Requests are
    matched on (benchmark, request); the interval is ``dspark.bootstrap.jackknife_ci`` on the log scale,
    stratified by benchmark as ``dspark.evaluation.intervals`` is (Student's t at the design degrees of
    freedom, Σ_b (n_b − 1) over the common requests).

    speedup: None when a report has no target-only baseline; tau: None without rounds."""

    speedup: Interval | None
    tau: Interval | None
    common: int  # requests in both reports
    only_a: int  # requests of A that B lacks (left out)
    only_b: int
    level: float


def verdict(interval: Interval | None) -> str:
    """"above 1" / "below 1" when the interval excludes 1 (A faster / slower than B beyond the
    request-to-request noise), "includes 1" when it does not, "–" when there is no interval."""
    if interval is None or not (np.isfinite(interval.lo) and np.isfinite(interval.hi)):
        return "–"
    if interval.lo > 1.0:
        return "above 1"
    if interval.hi < 1.0:
        return "below 1"
    return "includes 1"


# ------------------------------------------------------------------ reading
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_evaluation(folder: PathLike) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """(report, request rows, round rows) of a ``dspark eval`` output folder (or its report.json)."""
    folder = Path(folder)
    if folder.name == "report.json":
        folder = folder.parent
    missing = [n for n in ("report.json", "requests.jsonl", "rounds.jsonl") if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: no {', '.join(missing)}; a paired comparison needs the folder "
                                "`dspark eval` wrote (report.json with requests.jsonl and rounds.jsonl)")
    with (folder / "report.json").open(encoding="utf-8") as f:
        report = json.load(f)
    return report, _read_jsonl(folder / "requests.jsonl"), _read_jsonl(folder / "rounds.jsonl")


# ------------------------------------------------------------------ pairing
def _keyed(records: Sequence[Mapping[str, Any]], label: str) -> dict[tuple[str, Any], Mapping[str, Any]]:
    out: dict[tuple[str, Any], Mapping[str, Any]] = {}
    for r in records:
        key = (str(r["benchmark"]), r["request"])
        if key in out:
            raise ValueError(f"report {label} has two request rows for {key}: give one evaluation's requests.jsonl")
        out[key] = r
    return out


def _common_keys(a: Mapping[tuple[str, Any], Mapping[str, Any]], b: Mapping[tuple[str, Any], Mapping[str, Any]]
                 ) -> list[tuple[str, Any]]:
    """Keys in both, in A's order; ValueError when a matched request has two prompt lengths
    (the two evaluations did not decode the same prompts: different data, seed or sample count)."""
    common = [k for k in a if k in b]
    for k in common:
        pa, pb = a[k].get("prompt_tokens"), b[k].get("prompt_tokens")
        if pa is not None and pb is not None and int(pa) != int(pb):
            raise ValueError(f"request {k} has {pa} prompt tokens in report A and {pb} in B: the two evaluations "
                             "did not decode the same prompts (use the same eval data, num_samples and seed)")
    return common


def _aggregates(records: list[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]], keys: list[tuple[str, Any]],
                gamma: int) -> dict[str, Any]:
    """``request_aggregates`` of the requests ``keys`` (records already in that order), by benchmark."""
    wanted = set(keys)
    mine = [r for r in rounds if (str(r["benchmark"]), r["request"]) in wanted]
    return request_aggregates(records, mine, gamma)


def _stacked(agg_a: Mapping[str, Any], agg_b: Mapping[str, Any], name: str, names: list[str]) -> list[np.ndarray] | None:
    """Per benchmark [n, 2d]: A's aggregate ``name`` next to B's, one row per common request."""
    if any(name not in agg_a[n].arrays or name not in agg_b[n].arrays for n in names):
        return None
    return [np.concatenate([agg_a[n].arrays[name], agg_b[n].arrays[name]], axis=1) for n in names]


def _speedup_ratio(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)  # [..., 8]: A's (tokens, s, baseline tokens, baseline s), then B's
    return ((s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])) / ((s[..., 4] / s[..., 5]) / (s[..., 6] / s[..., 7]))


def _tau_ratio(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)  # [..., 4]: A's (numerator, denominator), then B's: (Σ τ, rounds) or (tokens, seconds)
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def paired_ratio_from_records(
    records_a: Sequence[Mapping[str, Any]],
    rounds_a: Sequence[Mapping[str, Any]],
    records_b: Sequence[Mapping[str, Any]],
    rounds_b: Sequence[Mapping[str, Any]],
    *,
    gamma_a: int,
    gamma_b: int,
    level: float = DEFAULT_LEVEL,
) -> PairedRatio:
    """``PairedRatio`` of A over B from their requests.jsonl and rounds.jsonl rows."""
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95, got {level!r}")
    keyed_a, keyed_b = _keyed(records_a, "A"), _keyed(records_b, "B")
    keys = _common_keys(keyed_a, keyed_b)
    if not keys:
        raise ValueError("the two reports share no (benchmark, request): a paired comparison needs evaluations "
                         "of the same prompts")
    agg_a = _aggregates([keyed_a[k] for k in keys], rounds_a, keys, gamma_a)
    agg_b = _aggregates([keyed_b[k] for k in keys], rounds_b, keys, gamma_b)
    names = list(agg_a)

    def interval(name: str, statistic: Any) -> Interval | None:
        groups = _stacked(agg_a, agg_b, name, names)
        return None if groups is None else Interval(*jackknife_ci(groups, statistic, level=level, scale="log"))

    return PairedRatio(
        speedup=interval("speed", _speedup_ratio), tau=interval("tau", _tau_ratio), common=len(keys),
        only_a=len(keyed_a) - len(keys), only_b=len(keyed_b) - len(keys), level=float(level))


def paired_ratio(report_a_dir: PathLike, report_b_dir: PathLike, *, level: float = DEFAULT_LEVEL) -> PairedRatio:
    """``PairedRatio`` of evaluation A over evaluation B (two ``dspark eval`` output folders)."""
    report_a, records_a, rounds_a = load_evaluation(report_a_dir)
    report_b, records_b, rounds_b = load_evaluation(report_b_dir)
    return paired_ratio_from_records(records_a, rounds_a, records_b, rounds_b, gamma_a=int(report_a["gamma"]),
                                     gamma_b=int(report_b["gamma"]), level=level)


# ------------------------------------------------------------------ serving cells
def _step_shares(result: Any) -> dict[int, np.ndarray]:
    """Request index -> float64 [2] = (tokens, W) of a batched serving run: the tokens its steps emitted and
    its share of their wall seconds (the requests' ``step_tokens`` and ``step_s``, as
    ``dspark.scheduling.batched_serving`` records them)."""
    if any("step_s" not in r for r in result.requests):
        raise ValueError(f"{result.policy} at R = {result.concurrency}: a paired serving comparison needs each "
                         "request's share of the steps (step_tokens, step_s), which the batched engine records "
                         "(ServeSettings.engine='batched')")
    return {int(r["index"]): np.array([float(r["step_tokens"]), float(r["step_s"])]) for r in result.requests}


def _tau_sums(result: Any) -> dict[int, np.ndarray]:
    """Request index -> float64 [2] = (Σ τ, rounds) of a serving run's rounds (``round_tau``): the
    evaluation's "tau" aggregate (``dspark.evaluation.intervals``)."""
    from dspark.evaluation.metrics import round_tau

    rows = {int(r["index"]): np.zeros(2) for r in result.requests}
    for r in result.rounds:
        rows.setdefault(int(r["request"]), np.zeros(2))[:] += (round_tau(r), 1.0)
    return rows


def benchmark_groups(rows: Mapping[int, np.ndarray], tags: Mapping[int, Any]) -> list[np.ndarray]:
    """Per-request rows stacked per benchmark (the tag's first field; "all" without a tag), in
    request order within each."""
    groups: dict[str, list[np.ndarray]] = {}
    for index, row in rows.items():
        tag = tags.get(index)
        groups.setdefault(str(tag[0]) if isinstance(tag, (list, tuple)) and tag else "all", []).append(row)
    return [np.stack(v) for v in groups.values()]


def _serving_tags(*results: Any) -> dict[int, Any]:
    return {int(r["index"]): r.get("tag") for result in results for r in result.requests}


def serving_tau(result: Any, *, level: float = DEFAULT_LEVEL) -> Interval:
    """τ of a serving run (``SimResult``: its requests and rounds) pooled over its rounds, with its
    ``level`` interval over the requests: the stratified jackknife on the log scale, strata the tags'
    benchmarks, clipped at 1 (``dspark.evaluation.intervals``' estimator for an evaluation's τ)."""
    from dspark.evaluation.intervals import TAU_SUPPORT, _ratio

    rows = {i: row for i, row in sorted(_tau_sums(result).items()) if row[1] > 0}
    if not rows:
        raise ValueError(f"{result.policy} at R = {result.concurrency} has no rounds: nothing to take τ of")
    groups = benchmark_groups(rows, _serving_tags(result))
    return Interval(*jackknife_ci(groups, _ratio, level=level, scale="log", support=TAU_SUPPORT))


def serving_paired_ratio(result_a: Any, result_b: Any, *, level: float = DEFAULT_LEVEL) -> PairedRatio:
    """``PairedRatio`` of serving run A over run B: two cells of one ``dspark simulate`` grid at the same
    R (the same jobs: prompts, seeds and stop rule), paired by the request's admission index.

        speedup = (Σ_i tokens_A,i / Σ_i W_A,i) / (Σ_i tokens_B,i / Σ_i W_B,i),  τ = τ_A / τ_B

    W_i: request i's share of the wall seconds of the steps it was live in (prefills excluded). Both
    runs are measured against the same target-only decode of the grid at R, so the ratio of their
    speedups is the ratio of their wall throughputs. A request one run served and the other did not
    (the stop rule cut it) counts zeros in the other. Interval: the stratified jackknife over the
    requests (strata: benchmarks) on the log scale, each request deleted from both runs at once. It
    holds the request-to-request noise, not a change of the machine's speed between the two runs
    (one run after the other): on a shared machine compare policies through scheduled evaluations,
    each against its own target-only decode (``paired_ratio``), where that change cancels."""
    if int(result_a.concurrency) != int(result_b.concurrency):
        raise ValueError(f"{result_a.policy} ran at R = {result_a.concurrency} and {result_b.policy} at R = "
                         f"{result_b.concurrency}: pair two cells of the same R")
    a, b = _step_shares(result_a), _step_shares(result_b)
    tags_a, tags_b = _serving_tags(result_a), _serving_tags(result_b)
    clash = next((i for i in a if i in b and i in tags_a and i in tags_b
                  and _tag_key(tags_a[i]) != _tag_key(tags_b[i])), None)
    if clash is not None:
        raise ValueError(f"request {clash} is {tags_a[clash]} in {result_a.policy}'s run and {tags_b[clash]} in "
                         f"{result_b.policy}'s: the two runs did not serve the same jobs (same prompts and seed)")
    keys, tags = sorted(set(a) | set(b)), {**tags_b, **tags_a}

    def interval(x: Mapping[int, np.ndarray], y: Mapping[int, np.ndarray]) -> Interval:
        # per request [4] = A's (numerator, denominator), then B's: the ratio of the two pooled ratios
        rows = {i: np.concatenate([x.get(i, np.zeros(2)), y.get(i, np.zeros(2))]) for i in keys}
        return Interval(*jackknife_ci(benchmark_groups(rows, tags), _tau_ratio, level=level, scale="log"))

    return PairedRatio(speedup=interval(a, b), tau=interval(_tau_sums(result_a), _tau_sums(result_b)),
                       common=len(set(a) & set(b)), only_a=len(set(a) - set(b)), only_b=len(set(b) - set(a)),
                       level=float(level))


def _tag_key(tag: Any) -> Any:
    return tuple(tag) if isinstance(tag, (list, tuple)) else tag
