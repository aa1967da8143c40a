"""Reading a `scripts/demo.sh` run folder: what `dspark summary` (``dspark.evaluation.demo_page``) shows.

The layout (the names are the contract with scripts/demo.sh; every file is optional):

    demo.json, timings.json            the demo's mode and budgets; {stage: wall-clock seconds}, in run order
    <run>/train_log.jsonl              a training run (any subfolder holding one), drafter/ next to it
    eval-T<temp>/<name>/report.json    `dspark eval` reports (+ report.md, rounds.jsonl, plots)
    sps.json, sts.json                 `dspark profile-sps`; `dspark calibrate` (fitted on a dev-split evaluation)
    sched/<policy>-R<r>/report.json    `dspark eval --policy <policy> --concurrency <r>`
    simulate/results.json              `dspark simulate` (figure8.png, frontier.png)
    llamacpp/results.json              `bench/llamacpp.py` (optional: the drafters in llama.cpp)

A metric ``x`` of a report may carry ``x_ci: [lo, hi]``, its 95 % interval over requests (for macro
averages a dict of the same keys); ``metric`` reads both, and an empty pair is an interval withheld.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TAU_KEYS = ("tau_pooled", "tau")  # τ pooled over rounds; a report without intervals names it "tau"


def _read_json(path: Path) -> Any:
    """The JSON at ``path``, or None when the file is missing or damaged (a stage still running)."""
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a killed run
    except OSError:
        return []
    return rows


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Everything the summary shows, read from ``run_dir`` (layout: module docstring).

    Keys: dir, demo, timings, training {name: {...}}, evals {(temp, name): report},
    sps (the table dict), sts, sched {(policy, R): report}, simulate (results.json)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run folder (the folder scripts/demo.sh writes, e.g. runs/demo)")
    evals = {}
    for path in sorted(root.glob("eval-T*/*/report.json")):
        report = _read_json(path)
        if report is not None:
            evals[(path.parent.parent.name.removeprefix("eval-T"), path.parent.name)] = report
    sched = {}
    for path in sorted(root.glob("sched/*/report.json")):
        report = _read_json(path)
        policy, _, r = path.parent.name.rpartition("-R")
        if report is not None and policy and r.isdigit():
            sched[(policy, int(r))] = report
    return {
        "dir": root,
        "demo": _read_json(root / "demo.json") or {},
        "timings": _read_json(root / "timings.json") or {},
        "training": {p.parent.name: _training(p.parent) for p in sorted(root.glob("*/train_log.jsonl"))},
        "evals": evals,
        "sps": _read_json(root / "sps.json"),
        "sts": _read_json(root / "sts.json"),
        "sched": sched,
        "simulate": _read_json(root / "simulate" / "results.json"),
        "llamacpp": _read_json(root / "llamacpp" / "results.json"),
    }


def _training(run: Path) -> dict[str, Any]:
    """Steps, minutes and held-out τ_prob (first and last logged) of one training run."""
    log = _read_jsonl(run / "train_log.jsonl")
    evals = [r for r in log if "eval_tau_prob" in r]
    drafter = _read_json(run / "drafter" / "config.json") or {}
    return {
        "steps": max((int(r.get("step", 0)) for r in log), default=None),
        "minutes": max((float(r.get("wall_min", 0.0)) for r in log), default=None),
        "tau_prob_first": evals[0]["eval_tau_prob"] if evals else None,
        "tau_prob_last": evals[-1]["eval_tau_prob"] if evals else None,
        "variant": drafter.get("dspark_variant"),
        "block_size": drafter.get("block_size"),
        "layers": drafter.get("num_hidden_layers"),
        "finished": (run / "drafter" / "config.json").is_file(),
    }


# ---------------------------------------------------------------------------
# Values with intervals
# ---------------------------------------------------------------------------


def _interval(ci: Any) -> tuple[float, float] | None:
    """[lo, hi] as floats, or None when ``ci`` is not two finite numbers."""
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        return None
    try:
        lo, hi = float(ci[0]), float(ci[1])
    except (TypeError, ValueError):
        return None
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def withheld_or_interval(ci: Any) -> tuple[float, float] | None:
    """``_interval``, or (NaN, NaN) for a pair the report left empty: an interval withheld because it
    would rest on too few requests or rounds (shown as "(no interval)")."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and _interval(ci) is None:
        return (math.nan, math.nan)
    return _interval(ci)


def metric(container: Mapping[str, Any] | None, keys: str | Sequence[str], sub: str | None = None
           ) -> tuple[float | None, tuple[float, float] | None]:
    """(value, interval) of the first of ``keys`` present in ``container``; with ``sub`` the
    value is ``container[key][sub]`` (a macro dict) and the interval ``container[key + "_ci"][sub]``
    ((NaN, NaN) where the report withheld it, None where it has none)."""
    if not isinstance(container, Mapping):
        return None, None
    for key in (keys,) if isinstance(keys, str) else keys:
        if key not in container:
            continue
        value, ci = container[key], container.get(f"{key}_ci")
        if sub is not None:
            value = value.get(sub) if isinstance(value, Mapping) else None
            ci = ci.get(sub) if isinstance(ci, Mapping) else None
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        return number, withheld_or_interval(ci)
    return None, None


# ---------------------------------------------------------------------------
# Order and places
# ---------------------------------------------------------------------------


def eval_columns(run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(temperature, name) of the evaluations, T = 1 first."""
    return sorted(run["evals"], key=lambda k: (-float(k[0]) if is_float(k[0]) else 0.0, drafter_order(k[1])))


def drafter_order(name: str) -> tuple[int, str]:
    """DSpark first, then DFlash, then the rest by name."""
    return (0 if name.startswith("dspark") else 1 if name.startswith("dflash") else 2, name)


def is_float(text: str) -> bool:
    """Whether ``text`` reads as a number (an eval folder's temperature, "eval-T<temp>")."""
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_of(report: Mapping[str, Any] | None) -> str:
    """The split an evaluation decoded ("all", "dev" or "test"), from its report's config."""
    return str(((report or {}).get("config") or {}).get("split", "all"))


def policy_order(run: Mapping[str, Any]) -> Any:
    """Sort key of (policy, R): the demo's policy order, then the name, then R."""
    order = {p: i for i, p in enumerate((run["demo"].get("schedule") or {}).get("policies", []))}
    return lambda k: (order.get(k[0], len(order)), k[0], k[1])


def simulated_results(run: Mapping[str, Any]) -> dict[tuple[str, int], Mapping[str, Any]]:
    """The simulator's results by (policy, R)."""
    sim = run["simulate"] if isinstance(run["simulate"], Mapping) else {}
    return {(str(r["policy"]), int(r["concurrency"])): r for r in sim.get("results", [])
            if isinstance(r, Mapping) and "policy" in r and "concurrency" in r}


def link(run: Mapping[str, Any], rel: str, text: str | None = None) -> str:
    """A markdown link to ``rel`` in the run folder, or "``rel`` (missing)" where it is not there (yet)."""
    return f"[{text or rel}]({rel})" if (run["dir"] / rel).exists() else f"{text or rel} (missing)"
