"""The benchmarks in bench/ still run against the current library and print their ratio lines.

Each script runs once with --quick (tiny sizes, few repeats) in a subprocess;
they run concurrently. Timings are not checked (the machine is shared),
only that each script exits 0 and prints, for every size, a finite positive
value in every ratio column.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # each run takes ~5 s of CPU; the margin is for a loaded machine (120 s was exceeded under load)
SCRIPTS = ("draft_latency.py", "train_step.py", "gpu_check.py")


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen]]:
    """Start the scripts at once (each is single-threaded, mostly import time); tests wait on theirs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = {
        script: subprocess.Popen(
            [sys.executable, str(REPO / "bench" / script), "--quick", "--threads", "1"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for script in SCRIPTS
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _output(runs: dict[str, subprocess.Popen], script: str) -> list[str]:
    proc = runs[script]
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{script} --quick ran over {TIMEOUT_S} s:\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"{script} --quick failed:\n{stdout}\n{stderr}"
    return stdout.splitlines()


def _table(lines: list[str], header_word: str, row_prefix: str) -> tuple[list[str], list[list[str]]]:
    """(header columns, data rows) of the printed table; columns are split on runs of 2+ spaces."""
    header = next((line for line in lines if header_word in line), None)
    assert header is not None, f"no header with {header_word!r} in:\n" + "\n".join(lines)
    split = lambda line: [c.strip() for c in line.split("  ") if c.strip()]  # noqa: E731
    rows = [split(line) for line in lines if line.startswith(row_prefix)]
    return split(header), rows


def _positive_finite(text: str) -> bool:
    value = float(text.replace(",", ""))
    return math.isfinite(value) and value > 0


def test_draft_latency_quick_prints_dspark_over_dflash_ratio_per_size(runs):
    header, rows = _table(_output(runs, "draft_latency.py"), "DSpark/DFlash", "d=")
    assert len(rows) == 2, rows
    for column in ("DSpark/DFlash", "loop share", "LM head share"):
        idx = header.index(column)
        for row in rows:
            assert len(row) == len(header), (header, row)
            assert _positive_finite(row[idx]), (column, row)


def test_train_step_quick_prints_time_and_memory_ratios(runs):
    header, rows = _table(_output(runs, "train_step.py"), "time c/n", "S0")
    assert len(rows) == 1, rows
    (row,) = rows
    assert len(row) == len(header), (header, row)
    for column in ("time f/n", "time c/n", "mem f/n", "mem c/n", "fused pos/s", "chunked pos/s", "naive pos/s"):
        assert _positive_finite(row[header.index(column)]), (column, row)


def test_gpu_check_quick_passes_every_section_on_cpu(runs):
    """The prepared GPU run (bench/gpu_check.py) at tiny sizes on CPU: every section PASSes."""
    lines = _output(runs, "gpu_check.py")
    summary = lines[lines.index("== summary") + 1 :]
    statuses = {line.split()[0]: line.split()[1] for line in summary if line.startswith("  ")}
    assert statuses == dict.fromkeys(["train", "decode", "batched", "lossless", "sps", "nccl"], "PASS"), "\n".join(lines)
