"""Crash-safe writes: files and folders appear whole or not at all, nothing is left behind."""

from __future__ import annotations

import pytest

from dspark.io import atomic


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_atomic_write_text_creates_and_replaces(tmp_path):
    path = tmp_path / "latest"
    atomic.atomic_write_text(path, "step-1")
    atomic.atomic_write_text(path, "step-2")
    assert path.read_text() == "step-2"
    assert _names(tmp_path) == ["latest"]


def test_atomic_file_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "rows.jsonl"
    atomic.atomic_write_bytes(path, b"old\n")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic.atomic_file(path, "wb") as f:
            f.write(b"half of the new con")
            raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old\n"
    assert _names(tmp_path) == ["rows.jsonl"]


def test_atomic_file_rejects_append_and_read_modes(tmp_path):
    with pytest.raises(ValueError, match="mode='a'"):
        with atomic.atomic_file(tmp_path / "x", "a"):
            pass


def _folder(root, name, files):
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    for rel, text in files.items():
        (folder / rel).write_text(text)
    return folder


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_replace_dir_installs_the_new_folder_and_removes_the_old(tmp_path, monkeypatch, exchange):
    used = []
    real = atomic._exchange
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: used.append(1) or (real(a, b) if exchange else False))
    final = tmp_path / "drafter"
    atomic.replace_dir(_folder(tmp_path, ".tmp-1", {"config.json": "v1", "sub/w": "a"}), final)
    assert not used  # nothing to swap with yet
    atomic.replace_dir(_folder(tmp_path, ".tmp-2", {"config.json": "v2", "sub/w": "b"}), final)
    assert used == [1]
    assert (final / "config.json").read_text() == "v2" and (final / "sub" / "w").read_text() == "b"
    assert _names(tmp_path) == ["drafter"]  # neither temporary nor old folders remain


def test_exchange_swaps_two_folders_where_supported(tmp_path):
    a = _folder(tmp_path, "a", {"f": "A"})
    b = _folder(tmp_path, "b", {"f": "B"})
    if not atomic._exchange(a, b):
        pytest.skip("this platform or file system has no renameat2(RENAME_EXCHANGE)")
    assert (a / "f").read_text() == "B" and (b / "f").read_text() == "A"


def test_a_killed_writers_file_is_recognised_as_a_leftover(tmp_path):
    path = tmp_path / "manifest.json"
    assert atomic.is_leftover(atomic.temp_name(path).name)
    assert not atomic.is_leftover("manifest.json") and not atomic.is_leftover("shard-00001.bin.tmp")
