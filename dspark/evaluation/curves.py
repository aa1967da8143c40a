"""Learning curves from trainer logs: held-out τ_probabilistic against wall-clock minutes
(``dspark.evaluation.plots.plot_learning_curves`` draws them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from dspark.evaluation.markdown import fmt_number, markdown_table


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """Records of <run_dir>/train_log.jsonl (the trainer's JSONL log)."""
    path = Path(run_dir) / "train_log.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} a `dspark train` output folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(records: list[dict], key: str = "eval_tau_prob") -> list[tuple[float, float, int]]:
    """(wall minutes, value, step) of every record that has `key`."""
    return [(float(r.get("wall_min", 0.0)), float(r[key]), int(r["step"])) for r in records if key in r]


def curves_table(runs: Mapping[str, str | os.PathLike], key: str = "eval_tau_prob") -> str:
    """Markdown: per run, the `key` values at each logged evaluation (minutes, step, value)."""
    rows = [[label, fmt_number(minutes, 1), fmt_number(step), fmt_number(value, 4)]
            for label, run_dir in runs.items() for minutes, value, step in curve(read_log(run_dir), key)]
    return markdown_table(["run", "minutes", "step", key], rows)
