"""Learning curves from trainer logs: held-out τ_probabilistic against wall-clock minutes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """Records of <run_dir>/train_log.jsonl (the trainer's JSONL log)."""
    path = Path(run_dir) / "train_log.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} a `dspark train` output folder?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(records: list[dict], key: str = "eval_tau_prob") -> list[tuple[float, float, int]]:
    """(wall minutes, value, step) of every record that has `key`."""
    return [(float(r.get("wall_min", 0.0)), float(r[key]), int(r["step"])) for r in records if key in r]


def plot_learning_curves(runs: Mapping[str, str | os.PathLike], path: str | os.PathLike, key: str = "eval_tau_prob") -> None:
    """One line per run: `key` (default held-out τ_probabilistic) against wall-clock minutes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    for label, run_dir in runs.items():
        pts = curve(read_log(run_dir), key)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("wall-clock minutes of training")
    ax.set_ylabel("held-out τ (probabilistic)" if key == "eval_tau_prob" else key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))


def curves_table(runs: Mapping[str, str | os.PathLike], key: str = "eval_tau_prob") -> str:
    """Markdown: per run, the `key` values at each logged evaluation (minutes, step, value)."""
    lines = ["| run | minutes | step | " + key + " |", "|---|---|---|---|"]
    for label, run_dir in runs.items():
        for minutes, value, step in curve(read_log(run_dir), key):
            lines.append(f"| {label} | {minutes:.1f} | {step} | {value:.4f} |")
    return "\n".join(lines)
