"""Crash-safe writes: write aside, fsync, rename into place, fsync the parent folder.

A reader sees either the old file (folder) or the new one, never a partial
one, and after a power loss the new one is on disk once the call returned.
Folders are swapped with Linux's ``renameat2(RENAME_EXCHANGE)`` where the
file system supports it, so an existing folder is never absent for a moment;
elsewhere the old folder is renamed aside first (a short window without it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM}
_LEFTOVER = re.compile(r"^\..+\.tmp-\d+$")


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a folder's entries (new names, renames). A no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every folder (deepest first)."""
    folders = []
    for here, _, files in os.walk(root):
        folders.append(here)
        for name in files:
            with open(os.path.join(here, name), "rb") as f:
                os.fsync(f.fileno())
    for here in reversed(folders):
        fsync_dir(here)


def temp_name(path: Path) -> Path:
    """Where atomic_file writes ``path`` before the rename: ``.<name>.tmp-<pid>`` beside it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def is_leftover(name: str) -> bool:
    """True for a temp_name left behind by a killed writer (safe to delete once no writer runs)."""
    return bool(_LEFTOVER.match(name))


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """``with atomic_file(p) as f: f.write(...)``: ``p`` appears complete on success, untouched on error."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file mode={mode!r}; use 'w' or 'wb'")
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2). False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(code)}")


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the fully written folder ``tmp`` to ``final``, replacing any folder there.

    ``tmp`` must be on the same file system (create it next to ``final``). Its
    files are fsynced first; the replaced folder is deleted afterwards.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.exists():
        if _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        else:
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive POSIX advisory lock on ``path`` (created if missing) for the block, so that
    two processes filling the same cache entry take turns; where ``fcntl`` is missing (Windows) the
    block runs unlocked and the atomic rename of the result is the only guard."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
