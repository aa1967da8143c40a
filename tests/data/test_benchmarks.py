"""The benchmark table: the nine benchmarks of the paper's Table 1 and every view derived from it."""

from __future__ import annotations

import subprocess
import sys

from dspark.data.benchmarks import (
    BENCHMARK_TABLE,
    BENCHMARKS,
    DEFAULT_NUM_SAMPLES,
    DISPLAY_NAMES,
    DOMAINS,
    TABLE1_ORDER,
    domain_of,
    samples_per_benchmark,
)
from dspark.data.prompts import builtin_domains, builtin_eval_sets

# The header row of the paper's Table 1, left to right.
PAPER_TABLE1_HEADER = ["GSM8K", "MATH", "AIME25", "MBPP", "HumanEval", "LCB", "MT-Bench", "Alpaca", "Arena-Hard"]


def test_domains_group_the_nine_benchmarks_three_by_three():
    assert DOMAINS == {
        "math": ("gsm8k", "math500", "aime25"),
        "code": ("humaneval", "mbpp", "livecodebench"),
        "chat": ("mt-bench", "alpaca", "arena-hard-v2"),
    }
    assert [domain_of(n) for n in ("aime25", "mbpp", "alpaca", "custom")] == ["math", "code", "chat", None]


def test_table1_order_reproduces_the_papers_column_headers():
    assert [DISPLAY_NAMES[n] for n in TABLE1_ORDER] == PAPER_TABLE1_HEADER
    assert sorted(TABLE1_ORDER) == sorted(BENCHMARKS)


def test_every_view_is_read_from_the_one_table():
    assert BENCHMARKS == tuple(b.name for b in BENCHMARK_TABLE)
    assert DEFAULT_NUM_SAMPLES == {b.name: b.num_samples for b in BENCHMARK_TABLE}
    assert DEFAULT_NUM_SAMPLES["aime25"] == 30 and DEFAULT_NUM_SAMPLES["mbpp"] == 256
    assert all(domain_of(b.name) == b.domain for b in BENCHMARK_TABLE)


def test_default_sample_counts_come_from_the_table_and_other_names_take_every_prompt():
    counts = samples_per_benchmark(["mt-bench", "custom"], None)
    assert counts == {"mt-bench": 80, "custom": None}


def test_builtin_evaluation_sets_belong_to_the_three_domains():
    assert builtin_domains() == tuple(DOMAINS)
    assert [domain_of(name) for name in builtin_eval_sets()] == list(DOMAINS)


def test_the_table_does_not_import_the_evaluation_package():
    code = "import sys, dspark.data.benchmarks; print(sorted(m for m in sys.modules if m.startswith('dspark.evaluation')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
