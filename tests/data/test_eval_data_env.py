"""Where the benchmark files are looked for: an explicit folder, else $DSPARK_EVAL_DATA, else eval_datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.data.benchmarks import EVAL_DATA_ENV, eval_data_folder, resolve_benchmarks


def write_benchmark(folder: Path, name: str = "gsm8k") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text(json.dumps({"turns": ["What is 2 + 3?"]}) + "\n")
    return path


def test_default_folder_is_eval_datasets_without_the_variable(monkeypatch):
    monkeypatch.delenv(EVAL_DATA_ENV, raising=False)
    assert eval_data_folder() == Path("eval_datasets")
    assert eval_data_folder("eval_datasets") == Path("eval_datasets")


def test_variable_replaces_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path))
    assert eval_data_folder() == tmp_path
    assert eval_data_folder("eval_datasets") == tmp_path


def test_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv(EVAL_DATA_ENV, "")
    assert eval_data_folder("eval_datasets") == Path("eval_datasets")


def test_explicit_folder_wins_over_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path / "from_env"))
    assert eval_data_folder(tmp_path / "explicit") == tmp_path / "explicit"


def test_resolve_benchmarks_reads_the_default_folder_from_the_variable(monkeypatch, tmp_path):
    path = write_benchmark(tmp_path)
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path))
    found, missing = resolve_benchmarks("eval_datasets", ["gsm8k"])
    assert found == {"gsm8k": path}
    assert missing == []


def test_missing_folder_error_says_how_to_build_or_point_at_the_files(monkeypatch, tmp_path):
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError) as err:
        resolve_benchmarks("eval_datasets", ["gsm8k"])
    message = str(err.value)
    assert "python eval_datasets/make_benchmarks.py" in message
    assert EVAL_DATA_ENV in message
    assert "../shared" not in message
