"""The benchmark prompts an evaluation decodes (SPEC 6): which files, how many, which subset.

A benchmark is a ``<name>.jsonl`` file of ``{"turns": [...]}`` lines (see
eval_datasets/README.md), or a list of conversations given in memory (the
built-in evaluation prompts). Each is reduced to its first user turn and to a
seeded subset of ``num_samples`` prompts (``seeded_subset``, DeepSpec's rule:
a ``random.Random(seed)`` shuffle, then the first N; for files and lists
alike), so that the same seed evaluates the same prompts here and in DeepSpec.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from dspark.data.prompts import Conversation, load_eval_benchmark, seeded_subset
from dspark.evaluation.metrics import BENCHMARKS, DEFAULT_NUM_SAMPLES

PathLike = Union[str, os.PathLike]
BUILD_HINT = "python eval_datasets/make_benchmarks.py --out {dir}"


def resolve_benchmarks(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike, names: Sequence[str] | None = None
) -> tuple[dict[str, Path | list[Conversation]], list[str]]:
    """The benchmarks to evaluate (name -> file, or -> prompts given in memory) and the names skipped.

    ``benchmarks`` is either ``{name: path or list of conversations}`` or a
    folder holding ``<name>.jsonl`` files (``names`` picks which; default the
    nine of SPEC 6). A missing file is skipped with a warning; if none
    exists, ValueError says how to build them.
    """
    in_memory: dict[str, list[Conversation]] = {}
    if isinstance(benchmarks, Mapping):
        if names is not None:
            unknown = [n for n in names if n not in benchmarks]
            if unknown:
                raise ValueError(f"names {unknown} are not keys of benchmarks ({sorted(benchmarks)})")
            benchmarks = {n: benchmarks[n] for n in names}
        in_memory = {str(n): list(v) for n, v in benchmarks.items() if isinstance(v, (list, tuple))}
        wanted = {str(n): Path(p) for n, p in benchmarks.items() if str(n) not in in_memory}
        where = "the given paths"
        hint = f"build the files with `{BUILD_HINT.format(dir='<folder>')}`"
    else:
        folder = Path(benchmarks)
        chosen = list(BENCHMARKS) if names is None else [str(n) for n in names]
        wanted = {n: folder / f"{n}.jsonl" for n in chosen}
        where = f"data folder {str(folder)!r}"
        hint = (
            f"build them with `{BUILD_HINT.format(dir=folder)}` (needs the hub), "
            "or point the data folder at a copy such as ../shared/eval_datasets"
        )
    if not wanted and not in_memory:
        raise ValueError("no benchmark given: pass {name: path} or a data folder with <name>.jsonl files")
    present = {n: p for n, p in wanted.items() if p.is_file()}
    missing = [n for n in wanted if n not in present]
    order = list(benchmarks) if isinstance(benchmarks, Mapping) else list(wanted)
    found = {str(n): in_memory[str(n)] if str(n) in in_memory else present[str(n)]
             for n in order if str(n) in in_memory or str(n) in present}
    if not found:
        raise ValueError(
            f"none of the benchmark files {[str(p) for p in wanted.values()]} exists ({where}); {hint}"
        )
    if missing:
        warnings.warn(
            f"skipping benchmark(s) {missing}: no file {[str(wanted[n]) for n in missing]}; {hint}",
            UserWarning,
            stacklevel=3,
        )
    return found, missing


def samples_per_benchmark(
    names: Sequence[str], num_samples: int | Mapping[str, int] | None
) -> dict[str, int | None]:
    """Requests to draw from each benchmark.

    None or 0: the SPEC 6 protocol counts (all prompts for names outside the
    nine); an int: that many from every benchmark; a mapping: per name, the
    protocol count for names it omits. A count above a file's size takes the
    whole file."""
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_samples{where} must be an int >= 0 (0 = SPEC 6 default), got {value!r}")
        return value

    out: dict[str, int | None] = {}
    for name in names:
        if isinstance(num_samples, Mapping):
            value = check(num_samples[name], f"[{name!r}]") if name in num_samples else 0
        else:
            value = 0 if num_samples is None else check(num_samples, "")
        out[name] = value if value > 0 else DEFAULT_NUM_SAMPLES.get(name)
    return out


def load_prompts(source: Path | list[Conversation], num_samples: int | None, seed: int) -> list[Conversation]:
    """First-user-turn prompts of a benchmark file or an in-memory list, as a seeded subset.

    In-memory lists follow ``load_eval_benchmark``'s rule (``seeded_subset``),
    so a list and a file of the same prompts give the same subset."""
    if isinstance(source, Path):
        return load_eval_benchmark(source, num_samples, seed)
    prompts = []
    for index, conversation in enumerate(source):
        first = next((m for m in conversation if m.get("role") == "user"), None)
        if first is None:
            raise ValueError(f"in-memory prompt {index} has no user message: {conversation!r:.120}")
        prompts.append([{"role": "user", "content": first["content"]}])
    return seeded_subset(prompts, num_samples, seed)


def load_benchmark_prompts(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    seed: int = 0,
) -> dict[str, list[Conversation]]:
    """The first-user-turn prompts ``evaluate`` would decode: name -> seeded subset
    (``resolve_benchmarks``, ``samples_per_benchmark``; missing files are skipped with a warning)."""
    files, _ = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    return {name: load_prompts(source, counts[name], seed) for name, source in files.items()}
