"""The benchmark table: the nine benchmarks of the paper's Table 1 and every view derived from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dspark.data.benchmarks import (
    BENCHMARK_TABLE,
    BENCHMARKS,
    DEFAULT_NUM_SAMPLES,
    DISPLAY_NAMES,
    DOMAINS,
    SPLIT_SEED,
    SPLITS,
    TABLE1_ORDER,
    domain_of,
    eval_data_folder,
    load_benchmark_prompts,
    samples_per_benchmark,
    split_prompts,
)
from dspark.data.prompts import DEEPSPEC_EVAL_SEED, builtin_domains, builtin_eval_sets, load_eval_benchmark, seeded_subset
from helpers.benchmarks import write_benchmarks

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


# ------------------------------------------------------------------ dev and test


def _text(item):
    return item[1]


def _parts(items, num_samples=None, seed=0):
    return {split: split_prompts(items, split, num_samples, seed, text=_text) for split in SPLITS}


def test_dev_is_the_first_half_of_a_fixed_shuffle_and_test_the_rest_in_file_order():
    # random.Random(980406) shuffles range(10) to [2, 0, 1, 5, 4, 8, 7, 6, 9, 3]; d = min(16, 10 // 2) = 5.
    items = [(i, f"q{i}") for i in range(10)]
    for seed in (0, 1, DEEPSPEC_EVAL_SEED):
        parts = _parts(items, seed=seed)
        assert [i for i, _ in parts["dev"]] == [0, 1, 2, 4, 5]
        assert [i for i, _ in parts["test"]] == [3, 6, 7, 8, 9]
        assert parts["all"] == items


def test_a_test_prompt_with_a_dev_prompts_text_is_dropped_from_test():
    # Item 9 repeats dev's q2 (up to whitespace): dropped; item 3 repeats test's q6: both stay in test.
    items = [(i, f"q{i}") for i in range(10)]
    items[9], items[3] = (9, " q2\n"), (3, "q6")
    parts = _parts(items)
    assert [i for i, _ in parts["dev"]] == [0, 1, 2, 4, 5]
    assert [i for i, _ in parts["test"]] == [3, 6, 7, 8]


def test_the_seed_and_the_count_draw_within_a_part():
    items = [(i, f"q{i}") for i in range(10)]
    dev = split_prompts(items, "dev", None, 0, text=_text)
    assert split_prompts(items, "dev", 3, 7, text=_text) == seeded_subset(dev, 3, 7)
    assert split_prompts(items, "dev", 5, 7, text=_text) == dev  # the whole part, in file order


def _synthetic(n):
    """n items whose texts repeat every 7 items, odd ones padded with whitespace."""
    return [(i, f" p{i % 7}\n" if i % 2 else f"p{i % 7}") for i in range(n)]


def test_dev_and_test_are_disjoint_for_every_size_count_and_seed():
    for n in range(1, 41):
        items = _synthetic(n)
        full = _parts(items)
        assert len(full["dev"]) == min(16, n // 2) and len(full["test"]) <= n - len(full["dev"])
        for num_samples in [None, *range(n + 3)]:
            for seed in (0, 3, DEEPSPEC_EVAL_SEED):
                parts = _parts(items, num_samples, seed)
                dev, test = parts["dev"], parts["test"]
                assert not {i for i, _ in dev} & {i for i, _ in test}
                assert not {t.strip() for _, t in dev} & {t.strip() for _, t in test}
                assert set(dev) <= set(full["dev"]) and set(test) <= set(full["test"])
                for part in ("dev", "test"):
                    size = len(full[part])
                    assert len(parts[part]) == (size if num_samples is None else min(num_samples, size))
                assert parts["all"] == seeded_subset(items, num_samples, seed)


def test_an_unknown_split_names_the_choices():
    with pytest.raises(ValueError, match=r"split must be one of \('all', 'dev', 'test'\).*eval.split.*got 'train'"):
        split_prompts([[{"role": "user", "content": "q"}]], "train", None, 0)


def test_the_cut_does_not_move_with_the_evaluation_seed():
    assert SPLIT_SEED == DEEPSPEC_EVAL_SEED
    items = [(i, f"q{i}") for i in range(40)]
    dev = {i for i, _ in split_prompts(items, "dev", None, 0, text=_text)}
    for seed in (0, 1, 12345):
        for num_samples in (1, 5, 16, 30):
            assert {i for i, _ in split_prompts(items, "dev", num_samples, seed, text=_text)} <= dev
            assert not {i for i, _ in split_prompts(items, "test", num_samples, seed, text=_text)} & dev


def _benchmark_files():
    folder = eval_data_folder()
    paths = [folder / f"{name}.jsonl" for name in BENCHMARKS if (folder / f"{name}.jsonl").is_file()]
    if not paths:
        pytest.skip(f"no benchmark files in {folder} (set DSPARK_EVAL_DATA to the folder that holds them)")
    return paths


def _first_turn(conversation):
    return conversation[0]["content"].strip()


def test_every_benchmark_file_splits_into_disjoint_dev_and_test():
    for path in _benchmark_files():
        items = load_eval_benchmark(path)
        d = min(16, len(items) // 2)
        assert len(items) >= 30 and d >= 15, path
        for num_samples in (None, 0, 1, 8, 100, len(items) + 2):
            for seed in (0, 1, DEEPSPEC_EVAL_SEED):
                dev = split_prompts(items, "dev", num_samples, seed)
                test = split_prompts(items, "test", num_samples, seed)
                assert not {_first_turn(c) for c in dev} & {_first_turn(c) for c in test}, (path, num_samples, seed)
                assert all(c in items for c in dev + test)
        assert len(load_eval_benchmark(path, None, 0, "dev")) == d
        assert load_eval_benchmark(path, 8, 1, "test") == split_prompts(items, "test", 8, 1)
        assert load_eval_benchmark(path, 8, DEEPSPEC_EVAL_SEED, "all") == seeded_subset(items, 8, DEEPSPEC_EVAL_SEED)


def test_dev_holds_the_prompts_of_the_default_draw_that_earlier_studies_used():
    for path in _benchmark_files():
        items = load_eval_benchmark(path)
        studied = {_first_turn(c) for c in seeded_subset(items, 8, DEEPSPEC_EVAL_SEED)}
        dev = {_first_turn(c) for c in load_eval_benchmark(path, None, 0, "dev")}
        test = {_first_turn(c) for c in load_eval_benchmark(path, None, 0, "test")}
        assert studied <= dev, path
        assert not studied & test, path


def test_the_builtin_evaluation_sets_split_in_halves():
    for name, conversations in builtin_eval_sets().items():
        prompts = load_benchmark_prompts({name: conversations}, split="dev")[name]
        held = load_benchmark_prompts({name: conversations}, split="test")[name]
        assert len(prompts) == len(conversations) // 2
        assert not {_first_turn(c) for c in prompts} & {_first_turn(c) for c in held}
        assert len(prompts) + len(held) <= len(conversations)


def test_a_file_and_the_same_prompts_in_memory_split_alike(tmp_path):
    texts = [f"prompt {i}" for i in range(12)]
    path = write_benchmarks(tmp_path, {"custom": texts})["custom"]
    in_memory = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": t}] for t in texts]
    for split in SPLITS:
        from_file = load_benchmark_prompts({"custom": path}, num_samples=4, seed=2, split=split)
        from_list = load_benchmark_prompts({"custom": in_memory}, num_samples=4, seed=2, split=split)
        assert from_file == from_list and len(from_file["custom"]) == 4
