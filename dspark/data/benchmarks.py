"""The nine evaluation benchmarks (paper Section 4.1, Table 1) and the prompts an evaluation decodes.

``BENCHMARK_TABLE`` is the one list of them (file name, domain, Table 1 header, requests drawn);
``BENCHMARKS``, ``DOMAINS``, ``TABLE1_ORDER``, ``DISPLAY_NAMES`` and ``DEFAULT_NUM_SAMPLES`` are
views of it. ``resolve_benchmarks`` finds the files (``eval_data_folder``),
``samples_per_benchmark`` the requests per benchmark, and ``load_benchmark_prompts`` /
``load_prompts`` return the first-user-turn prompts an evaluation decodes: a seeded subset
(``seeded_subset``, DeepSpec's rule) of the dev part, the test part or all of a benchmark
(``split_prompts``, ``SPLITS``, ``SPLIT_SEED``, ``DEV_SIZE``). Dev and test are cut once, by a
rule no evaluation setting can move, and never share a prompt: studies and tuning read dev,
reported results read test.

The file format, the split rule and why dev holds the first prompts of the default draw:
docs/data.md, "Benchmark files and the dev/test split".
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from dspark.data.prompts import (
    BUILTIN_PREFIX,
    DEEPSPEC_EVAL_SEED,
    Conversation,
    load_eval_benchmark,
    seeded_subset,
)

PathLike = Union[str, os.PathLike]
BUILD_HINT = "python eval_datasets/make_benchmarks.py --out {dir}"
DEFAULT_EVAL_DATA = "eval_datasets"  # the default of EvalConfig.data_dir
EVAL_DATA_ENV = "DSPARK_EVAL_DATA"  # names the benchmark folder when data_dir is left at its default

T = TypeVar("T")

SPLITS: tuple[str, ...] = ("all", "dev", "test")  # the choices of eval.split (docs/data.md)
SPLIT_SEED = DEEPSPEC_EVAL_SEED  # the shuffle that cuts dev from test; fixed, not eval.seed
DEV_SIZE = 16  # the most prompts of one benchmark that dev holds (d = min(DEV_SIZE, N // 2))


def eval_data_folder(data_dir: PathLike = DEFAULT_EVAL_DATA) -> Path:
    """The folder of the benchmark files: an explicit ``data_dir`` other than the default wins,
    else ``$DSPARK_EVAL_DATA`` when set and non-empty, else ``eval_datasets``."""
    if Path(data_dir) != Path(DEFAULT_EVAL_DATA):
        return Path(data_dir)
    return Path(os.environ.get(EVAL_DATA_ENV) or DEFAULT_EVAL_DATA)


@dataclass(frozen=True)
class Benchmark:
    """One evaluation benchmark of the paper's protocol."""

    name: str  # the file stem in eval_datasets/ (<name>.jsonl) and the key in reports
    domain: str  # "math" | "code" | "chat": the macro-average column it counts in
    display_name: str  # its column header in Table 1
    table1_column: int  # its position among Table 1's nine columns (0-based)
    num_samples: int  # requests drawn from the file (a seeded subset; DeepSpec's evaluator counts)


# In evaluation order: the order benchmarks are decoded in, hence of rounds.jsonl and reports.
BENCHMARK_TABLE: tuple[Benchmark, ...] = (
    Benchmark("gsm8k", "math", "GSM8K", 0, 500),
    Benchmark("math500", "math", "MATH", 1, 500),
    Benchmark("aime25", "math", "AIME25", 2, 30),
    Benchmark("humaneval", "code", "HumanEval", 4, 164),
    Benchmark("mbpp", "code", "MBPP", 3, 256),
    Benchmark("livecodebench", "code", "LCB", 5, 500),
    Benchmark("mt-bench", "chat", "MT-Bench", 6, 80),
    Benchmark("alpaca", "chat", "Alpaca", 7, 500),
    Benchmark("arena-hard-v2", "chat", "Arena-Hard", 8, 500),
)

BENCHMARKS: tuple[str, ...] = tuple(b.name for b in BENCHMARK_TABLE)
DOMAINS: dict[str, tuple[str, ...]] = {
    domain: tuple(b.name for b in BENCHMARK_TABLE if b.domain == domain)
    for domain in dict.fromkeys(b.domain for b in BENCHMARK_TABLE)
}
TABLE1_ORDER: tuple[str, ...] = tuple(b.name for b in sorted(BENCHMARK_TABLE, key=lambda b: b.table1_column))
DISPLAY_NAMES: dict[str, str] = {b.name: b.display_name for b in BENCHMARK_TABLE}
DEFAULT_NUM_SAMPLES: dict[str, int] = {b.name: b.num_samples for b in BENCHMARK_TABLE}


def domain_of(benchmark: str) -> str | None:
    """"math", "code" or "chat" for the nine benchmarks and the built-in evaluation sets
    (``builtin-math``, ...: ``dspark.data.prompts.builtin_eval_sets``), None for any other name."""
    for domain, names in DOMAINS.items():
        if benchmark in names:
            return domain
    if benchmark.startswith(BUILTIN_PREFIX) and benchmark[len(BUILTIN_PREFIX):] in DOMAINS:
        return benchmark[len(BUILTIN_PREFIX):]
    return None


def resolve_benchmarks(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike, names: Sequence[str] | None = None
) -> tuple[dict[str, Path | list[Conversation]], list[str]]:
    """The benchmarks to evaluate (name -> file, or -> prompts given in memory) and the names skipped.

    ``benchmarks`` is either ``{name: path or list of conversations}`` or a
    folder holding ``<name>.jsonl`` files (``names`` picks which; default the
    nine of ``BENCHMARKS``). A missing file is skipped with a warning; if none
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
        folder = eval_data_folder(benchmarks)
        chosen = list(BENCHMARKS) if names is None else [str(n) for n in names]
        wanted = {n: folder / f"{n}.jsonl" for n in chosen}
        where = f"data folder {str(folder)!r}"
        hint = (
            f"build them with `{BUILD_HINT.format(dir=folder)}` (needs the hub), "
            f"or set {EVAL_DATA_ENV} (or the data folder) to a folder that holds them"
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

    None or 0: the protocol counts of ``BENCHMARK_TABLE`` (all prompts for names
    outside the nine); an int: that many from every benchmark; a mapping: per name, the
    protocol count for names it omits. A count above the size of a file (or of its
    dev or test part) takes all of it."""
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"num_samples{where} must be an int >= 0 (0 = the benchmark's default count), got {value!r}")
        return value

    out: dict[str, int | None] = {}
    for name in names:
        if isinstance(num_samples, Mapping):
            value = check(num_samples[name], f"[{name!r}]") if name in num_samples else 0
        else:
            value = 0 if num_samples is None else check(num_samples, "")
        out[name] = value if value > 0 else DEFAULT_NUM_SAMPLES.get(name)
    return out


def first_user_text(conversation: Conversation) -> str:
    """The content of a conversation's first user message: what ``split_prompts`` compares."""
    first = next((m for m in conversation if m.get("role") == "user"), None)
    if first is None:
        raise ValueError(f"a prompt has no user message: {conversation!r:.120}")
    return first["content"]


def split_prompts(
    items: Sequence[T], split: str, num_samples: int | None, seed: int,
    text: Callable[[T], str] = first_user_text,
) -> list[T]:
    """``num_samples`` of the ``split`` part of a benchmark's ``items`` (the rule: docs/data.md).

    ``split``: "all" (``seeded_subset(items, num_samples, seed)``), "dev" (the first
    ``min(DEV_SIZE, N // 2)`` items of a ``random.Random(SPLIT_SEED)`` shuffle) or "test"
    (the rest, less the items whose ``text(item).strip()`` equals a dev item's). A part keeps
    file order and is drawn from with ``seeded_subset(part, num_samples, seed)``; None takes
    all of it. ``text`` maps an item to its prompt text (default: the first user turn)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (eval.split, --split), got {split!r}")
    if split == "all":
        return seeded_subset(items, num_samples, seed)
    order = list(range(len(items)))
    random.Random(SPLIT_SEED).shuffle(order)
    d = min(DEV_SIZE, len(items) // 2)
    if split == "dev":
        part = sorted(order[:d])
    else:
        dev_texts = {text(items[i]).strip() for i in order[:d]}
        part = sorted(i for i in order[d:] if text(items[i]).strip() not in dev_texts)
    return seeded_subset([items[i] for i in part], num_samples, seed)


def load_prompts(
    source: Path | list[Conversation], num_samples: int | None, seed: int, split: str = "all"
) -> list[Conversation]:
    """First-user-turn prompts of a benchmark file or an in-memory list: ``num_samples`` of
    its ``split`` part (``split_prompts``).

    In-memory lists follow ``load_eval_benchmark``'s rule, so a list and a file of the
    same prompts give the same subset."""
    if isinstance(source, Path):
        return load_eval_benchmark(source, num_samples, seed, split)
    prompts = []
    for index, conversation in enumerate(source):
        first = next((m for m in conversation if m.get("role") == "user"), None)
        if first is None:
            raise ValueError(f"in-memory prompt {index} has no user message: {conversation!r:.120}")
        prompts.append([{"role": "user", "content": first["content"]}])
    return split_prompts(prompts, split, num_samples, seed)


def load_benchmark_prompts(
    benchmarks: Mapping[str, PathLike | Sequence[Conversation]] | PathLike,
    names: Sequence[str] | None = None,
    num_samples: int | Mapping[str, int] | None = None,
    seed: int = 0,
    split: str = "all",
) -> dict[str, list[Conversation]]:
    """The first-user-turn prompts ``evaluate`` would decode: name -> seeded subset of the
    ``split`` part (``resolve_benchmarks``, ``samples_per_benchmark``, ``split_prompts``;
    missing files are skipped with a warning)."""
    files, _ = resolve_benchmarks(benchmarks, names)
    counts = samples_per_benchmark(list(files), num_samples)
    return {name: load_prompts(source, counts[name], seed, split) for name, source in files.items()}
