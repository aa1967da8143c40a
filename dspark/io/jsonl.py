"""Append-only JSON-lines logs that survive a kill: each append is flushed and fsynced, and
reading back drops a torn last line (a write the kill cut short).

A line is complete once it ends with a newline and parses; a writer killed mid-line leaves
a last line without its newline (or with bytes that do not parse), which ``read_jsonl``
drops; a reader that appends again rewrites the file first (``write_jsonl``) so that the
next append starts on a fresh line. A bad line anywhere else is corruption, not a torn write,
and raises ValueError naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dspark.io.atomic import atomic_file, fsync_dir
from dspark.io.jsonsafe import to_jsonable


def append_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append ``rows`` to ``path`` (one JSON line each) and fsync: on disk once this returns."""
    path = Path(path)
    text = "".join(json.dumps(to_jsonable(row), ensure_ascii=False, allow_nan=False) + "\n" for row in rows)
    new = not path.exists()
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(path.parent)


def read_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], bool]:
    """The rows of ``path`` (none when it does not exist) and whether a torn last line was dropped."""
    path = Path(path)
    if not path.exists():
        return [], False
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows: list[dict[str, Any]] = []
    torn = bool(tail)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if lineno == len(lines) and not tail:
                torn = True  # the last line ends with a newline but its bytes are cut short
                break
            raise ValueError(f"{path}:{lineno}: not a JSON line ({e}); the file is damaged beyond a torn last "
                             "line: delete the folder or rerun with --overwrite") from None
    return rows, torn


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """Replace ``path`` with ``rows``, atomically (``dspark.io.atomic.atomic_file``)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(to_jsonable(row), ensure_ascii=False, allow_nan=False) + "\n")
