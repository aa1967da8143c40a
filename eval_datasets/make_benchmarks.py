"""Build the nine benchmark files (paper Section 4.1) from their public sources on the Hugging Face hub.

    python eval_datasets/make_benchmarks.py --out eval_datasets/
    python eval_datasets/make_benchmarks.py --out eval_datasets/ --only gsm8k mbpp

Each file is JSON lines, one ``{"turns": ["user message", ...]}`` per prompt,
in the source's row order (written with ``json.dumps(..., ensure_ascii=False)``).
The formatting functions below are pure (a hub row in, the turns out) so that
they can be checked offline against rows of the reference files; see
eval_datasets/README.md for the sources and the known differences. The list of
benchmarks is dspark's (``dspark.data.benchmarks.BENCHMARKS``): install dspark first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from dspark.data.benchmarks import BENCHMARKS
except ImportError:
    sys.exit("make_benchmarks.py reads the list of benchmarks from dspark: install it first "
             "(`pip install -e .` in the repository)")

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"
LCB_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all tests. "
    "You will NOT return anything except for the program"
)
LCB_ANSWER = "### Answer: (use the provided format with backticks)"
_LCB_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
_HUB = "https://huggingface.co/datasets"

Row = Mapping[str, Any]


# ---------------------------------------------------------------------------
# One hub row -> the turns of one prompt
# ---------------------------------------------------------------------------


def math_prompt(problem: str) -> list[str]:
    """The problem, a newline, then the step-by-step / \\boxed{} instruction."""
    return [f"{problem}\n{MATH_SUFFIX}"]


def format_gsm8k(row: Row) -> list[str]:
    return math_prompt(row["question"])


def format_math500(row: Row) -> list[str]:
    return math_prompt(row["problem"])


def format_aime25(row: Row) -> list[str]:
    return math_prompt(row["problem"])


def format_humaneval(row: Row) -> list[str]:
    """The function stub in a python code block (the stub keeps its own trailing newline)."""
    return [f"{HUMANEVAL_PREFIX}```python\n{row['prompt']}\n```"]


def format_mbpp(row: Row) -> list[str]:
    """The sanitized task description alone, without the tests."""
    return [row["prompt"]]


def format_livecodebench(row: Row) -> list[str]:
    """System line, question, then the code format: the starter code when there is one.

    The question text and the starter code are used verbatim (not stripped)."""
    starter = row.get("starter_code") or ""
    if starter:
        code_format = f"### Format: Use the following code structure:\n```python\n{starter}\n```"
    else:
        code_format = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return [f"{LCB_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{code_format}\n\n{LCB_ANSWER}"]


def format_mt_bench(row: Row) -> list[str]:
    """Both turns (evaluation uses the first)."""
    return [str(t) for t in row["prompt"]]


def format_alpaca(row: Row) -> list[str]:
    """The instruction alone; the ``input`` field is not appended (as in the reference file)."""
    return [row["instruction"]]


def format_arena_hard(row: Row) -> list[str]:
    """The prompt verbatim (v2.0 rows have ``prompt``; v0.1 rows ``turns[0].content``)."""
    if "prompt" in row and row["prompt"] is not None:
        return [row["prompt"]]
    return [row["turns"][0]["content"]]


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a benchmark comes from: ``datasets.load_dataset(*args, **kwargs)`` and a row formatter."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    format: Callable[[Row], list[str]] = format_mbpp

    def describe(self) -> str:
        return ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()])


# One source per name of BENCHMARKS, in its order.
SOURCES: dict[str, Source] = {
    "gsm8k": Source(("openai/gsm8k", "main"), {"split": "test"}, format_gsm8k),
    "math500": Source(("HuggingFaceH4/MATH-500",), {"split": "test"}, format_math500),
    "aime25": Source(("MathArena/aime_2025",), {"split": "train"}, format_aime25),
    "humaneval": Source(("openai/openai_humaneval",), {"split": "test"}, format_humaneval),
    "mbpp": Source(("google-research-datasets/mbpp", "sanitized"), {"split": "test"}, format_mbpp),
    # The hub's loading script is not supported by datasets >= 4; its release files are plain
    # JSON lines, test.jsonl..test6.jsonl = release_v6 (1,055 problems).
    "livecodebench": Source(
        ("json",),
        {"data_files": [f"{_HUB}/livecodebench/code_generation_lite/resolve/main/{f}" for f in _LCB_FILES],
         "split": "train"},
        format_livecodebench,
    ),
    "mt-bench": Source(("HuggingFaceH4/mt_bench_prompts",), {"split": "train"}, format_mt_bench),
    "alpaca": Source(("tatsu-lab/alpaca",), {"split": "train"}, format_alpaca),
    "arena-hard-v2": Source(
        ("json",),
        {"data_files": f"{_HUB}/lmarena-ai/arena-hard-auto/resolve/main/data/arena-hard-v2.0/question.jsonl",
         "split": "train"},
        format_arena_hard,
    ),
}


def jsonl_line(turns: Sequence[str]) -> str:
    """One line of a benchmark file (no newline)."""
    return json.dumps({"turns": list(turns)}, ensure_ascii=False)


def format_rows(name: str, rows: Iterable[Row]) -> list[str]:
    """The file lines of benchmark ``name`` from its hub rows, in row order."""
    formatter = SOURCES[name].format
    lines = []
    for index, row in enumerate(rows):
        try:
            turns = formatter(row)
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(
                f"{name}: row {index} does not have the fields the formatter reads ({e!r}); "
                f"row keys: {sorted(row) if isinstance(row, Mapping) else type(row).__name__}"
            ) from None
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{name}: row {index} gave empty or non-string turns {turns!r:.120}")
        lines.append(jsonl_line(turns))
    return lines


def build(
    names: Sequence[str],
    out_dir: str | os.PathLike,
    load: Callable[..., Iterable[Row]] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, int]:
    """Download, format and write ``<out_dir>/<name>.jsonl`` for each name; returns lines per file.

    ``load`` defaults to ``datasets.load_dataset``. Each file is written to a
    temporary name first and renamed, so a failed download leaves no partial file."""
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    if load is None:
        from datasets import load_dataset as load
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names:
        source = SOURCES[name]
        log(f"{name}: load_dataset({source.describe()})")
        lines = format_rows(name, load(*source.args, **source.kwargs))
        path = out / f"{name}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
        written[name] = len(lines)
        log(f"{name}: {len(lines)} prompts -> {path}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the nine benchmark files from the Hugging Face hub.")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent),
                        help="output folder (default: this folder)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        help=f"build only these benchmarks (of: {' '.join(BENCHMARKS)})")
    args = parser.parse_args(argv)
    try:
        build(args.only or list(BENCHMARKS), args.out)
    except ValueError as e:
        print(f"make_benchmarks.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
