"""A killed evaluation loses nothing: request-level journals, resume, refusal, validation, `dspark report`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dspark.evaluation.evaluate import report_from_folder
from dspark.evaluation.journal import SettingsMismatch
from dspark.io.jsonl import read_jsonl
from dspark.io.jsonsafe import to_jsonable
from helpers.paths import REPO

# A child process that evaluates scripted decoders (4 requests over 3 benchmarks) into OUT and
# SIGKILLs itself right after request KILL_AT is decoded (before its rows are appended), or never.
CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import dspark.evaluation.eval_plain as plain
    import dspark.evaluation.evaluate as ev
    import dspark.evaluation.journal as journal
    from helpers.evaluation import FakeClock, fake_models, scripted_decoders
    from helpers.benchmarks import write_benchmarks
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    clock = FakeClock()
    plain.time, ev.time, ev.WARMUP_TOKENS = clock, clock, 0
    decode, baseline = scripted_decoders(clock)
    done = []
    def killing(*args, **kwargs):
        if len(done) == kill_at:
            os.kill(os.getpid(), 9)
        done.append(1)
        return decode(*args, **kwargs)
    plain.speculative_generate, plain.target_generate = killing, baseline
    target, drafter = fake_models()
    ev.evaluate(target, drafter, write_benchmarks(out.parent / "data"), out_dir=out, progress=False,
                decoding=ev.DecodeSettings(max_new_tokens=8, temperature=1.0))
""")


def run_child(tmp_path, out, kill_at: int) -> int:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(REPO / "tests")))
    return subprocess.run([sys.executable, str(script), str(out), str(kill_at)], cwd=REPO,
                          capture_output=True, text=True).returncode


def without_timings(report):
    report = to_jsonable(report)  # as report.json holds it (NaN as null)
    report.pop("timings", None)
    return report


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    assert run_child(tmp, tmp / "out", -1) == 0
    return tmp / "out"


def test_a_killed_evaluation_resumes_to_the_rows_and_report_of_an_uninterrupted_one(tmp_path, uninterrupted):
    out = tmp_path / "out"
    assert run_child(tmp_path, out, 2) == -9
    assert len(read_jsonl(out / "requests.jsonl")[0]) == 2  # the two requests finished before the kill
    assert (out / "settings.json").is_file() and not (out / "report.json").exists()
    assert run_child(tmp_path, out, 99) == 0
    assert (out / "rounds.jsonl").read_text() == (uninterrupted / "rounds.jsonl").read_text()
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, uninterrupted))
    assert a["all"]["tau"] == b["all"]["tau"] and a["macro"]["tau"] == b["macro"]["tau"]


def test_a_torn_last_line_is_dropped_and_its_request_redone(tmp_path, uninterrupted):
    out = tmp_path / "out"
    assert run_child(tmp_path, out, 3) == -9
    with (out / "requests.jsonl").open("a") as f:
        f.write('{"benchmark": "alpaca", "request": 0, "tok')  # a write cut short by the kill
    rows, torn = read_jsonl(out / "requests.jsonl")
    assert torn and len(rows) == 3
    assert run_child(tmp_path, out, 99) == 0
    assert (out / "rounds.jsonl").read_text() == (uninterrupted / "rounds.jsonl").read_text()
    assert len(read_jsonl(out / "requests.jsonl")[0]) == 4


def test_a_folder_of_other_settings_is_refused_naming_the_fields(tmp_path, uninterrupted):
    import dspark.evaluation.evaluate as ev
    from helpers.evaluation import fake_models
    from helpers.benchmarks import write_benchmarks

    target, drafter = fake_models()
    with pytest.raises(SettingsMismatch, match=r"config.max_new_tokens: 8 -> 9.*--overwrite"):
        ev.evaluate(target, drafter, write_benchmarks(tmp_path / "data"), out_dir=uninterrupted, progress=False,
                    decoding=ev.DecodeSettings(max_new_tokens=9, temperature=1.0))


def test_dspark_report_rebuilds_the_report_from_the_files(uninterrupted):
    report, records, rounds = report_from_folder(uninterrupted)
    written = json.loads((uninterrupted / "report.json").read_text())
    assert without_timings(report) == without_timings(written)
    assert len(records) == 4 and len(rounds) == len(read_jsonl(uninterrupted / "rounds.jsonl")[0])


def test_a_malformed_benchmark_line_is_reported_before_any_target_is_loaded(tmp_path, monkeypatch, capsys):
    import dspark.build
    from dspark.cli.main import main

    def never(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(dspark.build, "load_target", never)
    monkeypatch.setattr(dspark.build, "load_models", never)
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text('{"turns": ["ok"]}\n{"turns": [\n')
    code = main(["eval", "--data-dir", str(data), "--benchmarks", "gsm8k", "--out", str(tmp_path / "out")])
    assert code == 2
    assert f"{data / 'gsm8k.jsonl'}:2" in capsys.readouterr().err


# The same kill and resume with real speculative decoding: a tiny Llama target and a random drafter
# (seeded), sampled at T = 1 with each request's own generator, a character tokenizer.
TINY_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import dspark.evaluation.eval_plain as plain
    import dspark.evaluation.evaluate as ev
    from helpers.benchmarks import CharTokenizer, write_benchmarks
    from helpers.decoding import random_drafter
    from helpers.targets import make_tiny_target
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    ev.WARMUP_TOKENS = 0
    real, done = plain.speculative_generate, []
    def killing(*args, **kwargs):
        if len(done) == kill_at:
            os.kill(os.getpid(), 9)
        done.append(1)
        return real(*args, **kwargs)
    plain.speculative_generate = killing
    target = make_tiny_target("llama", vocab_size=256)
    drafter = random_drafter(target, gamma=3, seed=1)
    ev.evaluate(target, drafter, write_benchmarks(out.parent / "data"), out_dir=out, progress=False,
                tokenizer=CharTokenizer(), decoding=ev.DecodeSettings(max_new_tokens=6, temperature=1.0, seed=5))
""")


def run_tiny_child(tmp_path, out, kill_at: int) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "tiny_child.py"
    script.write_text(TINY_CHILD.format(tests=str(REPO / "tests")))
    return subprocess.run([sys.executable, str(script), str(out), str(kill_at)], cwd=REPO,
                          capture_output=True, text=True).returncode


def test_a_killed_evaluation_of_a_tiny_target_resumes_to_the_same_rounds(tmp_path):
    full, out = tmp_path / "full" / "out", tmp_path / "killed" / "out"
    assert run_tiny_child(tmp_path / "full", full, -1) == 0
    assert run_tiny_child(tmp_path / "killed", out, 2) == -9  # after 2 of the 4 requests
    assert len(read_jsonl(out / "requests.jsonl")[0]) == 2
    assert run_tiny_child(tmp_path / "killed", out, 99) == 0
    assert (out / "rounds.jsonl").read_text() == (full / "rounds.jsonl").read_text()
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, full))
    assert a["all"]["tau"] == b["all"]["tau"] and a["all"]["num_requests"] == b["all"]["num_requests"] == 4


# The tiny evaluation decoded in batches (eval.batch_size = R): killed by SIGKILL after `kill_at` requests
# were committed, while the other rows of its batch are still decoding.
TINY_BATCHED_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import dspark.evaluation.evaluate as ev
    import dspark.evaluation.journal as journal
    from helpers.benchmarks import CharTokenizer, write_benchmarks
    from helpers.decoding import random_drafter
    from helpers.targets import make_tiny_target
    out, kill_at, rows, baseline = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    ev.WARMUP_TOKENS = 0
    append, done = journal.EvalJournal.append_request, []
    def killing(self, record, rounds):
        append(self, record, rounds)
        done.append(record["request"])
        if len(done) == kill_at:
            os.kill(os.getpid(), 9)
    journal.EvalJournal.append_request = killing
    target = make_tiny_target("llama", vocab_size=256)
    drafter = random_drafter(target, gamma=3, seed=1)
    ev.evaluate(target, drafter, write_benchmarks(out.parent / "data"), out_dir=out, progress=False,
                tokenizer=CharTokenizer(), decoding=ev.DecodeSettings(max_new_tokens=6, temperature=1.0, seed=5),
                batch_size=rows, baseline=baseline)
""")


def same_rounds(a, b):
    """The same rounds.jsonl rows, confidences to float32 rounding (a batch's forwards sum in
    another order than batch 1's)."""
    rows_a, rows_b = read_jsonl(a / "rounds.jsonl")[0], read_jsonl(b / "rounds.jsonl")[0]
    assert len(rows_a) == len(rows_b)
    for x, y in zip(rows_a, rows_b):
        assert {**x, "confidences": None} == {**y, "confidences": None}
        assert x["confidences"] == pytest.approx(y["confidences"], abs=1e-5)


def run_batched_child(tmp_path, out, kill_at: int, rows: int, baseline: bool) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "batched_child.py"
    script.write_text(TINY_BATCHED_CHILD.format(tests=str(REPO / "tests")))
    return subprocess.run([sys.executable, str(script), str(out), str(kill_at), str(rows), str(int(baseline))],
                          cwd=REPO, capture_output=True, text=True).returncode


@pytest.mark.parametrize("baseline", [False, True], ids=["per-request", "waves-with-baseline"])
def test_a_batched_evaluation_killed_mid_batch_resumes_to_the_rounds_of_batch_1(tmp_path, baseline):
    """R = 3 rows over 4 requests: killed once 1 request is committed (the others mid-batch, or the
    wave mid-baseline), resumed, it leaves the rounds of an uninterrupted batched run, which are
    those of batch 1 (every request decodes its own tokens whatever its neighbours)."""
    one, full, out = tmp_path / "one" / "out", tmp_path / "full" / "out", tmp_path / "killed" / "out"
    assert run_batched_child(tmp_path / "one", one, -1, 1, baseline) == 0
    assert run_batched_child(tmp_path / "full", full, -1, 3, baseline) == 0
    assert run_batched_child(tmp_path / "killed", out, 1, 3, baseline) == -9
    assert len(read_jsonl(out / "requests.jsonl")[0]) == 1
    assert run_batched_child(tmp_path / "killed", out, 99, 3, baseline) == 0
    same_rounds(out, full)
    same_rounds(full, one)
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, full))
    assert a["all"]["tau"] == b["all"]["tau"] and a["all"]["num_requests"] == b["all"]["num_requests"] == 4
    assert a["config"]["batch_size"] == 3 and ("speedup" in a["all"]) == baseline
