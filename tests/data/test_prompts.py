from helpers.paths import SHARED
"""Prompt loaders: jsonl formats, role mapping, hub split, built-in set, eval benchmarks."""

import json
import random
import re
from pathlib import Path

import pytest

from dspark.data import prompts
from dspark.data.benchmarks import load_prompts
from dspark.data.prompts import (
    DEEPSPEC_EVAL_SEED,
    builtin_prompt_records,
    load_builtin_prompts,
    load_eval_benchmark,
    load_hub_prompts,
    load_jsonl_prompts,
    prompt_only,
    seeded_subset,
)

EVAL_DIR = SHARED / "eval_datasets"  # ../shared beside the repo
EVAL_FILES = [
    "gsm8k", "math500", "aime25", "humaneval", "mbpp",
    "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
]
MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# ---- jsonl ----------------------------------------------------------------

def test_jsonl_reads_conversations_messages_and_turns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        "",
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "id": 7},
        {"turns": ["first question", "an answer", "second question"]},
    ])
    assert load_jsonl_prompts(path) == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
        ],
    ]


def test_sharegpt_roles_map_to_chat_roles(tmp_path):
    entries = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "u1"},
        {"from": "gpt", "value": "a1"},
        {"from": "human", "value": "u2"},
        {"from": "chatgpt", "value": "a2"},
        {"from": "human", "value": "u3"},
        {"from": "bing", "value": "a3"},
        {"from": "human", "value": "u4"},
        {"from": "bard", "value": "a4"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", [{"conversations": entries}])
    roles = [m["role"] for m in load_jsonl_prompts(path)[0]]
    assert roles == ["system"] + ["user", "assistant"] * 4


def test_unknown_role_names_the_role_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"turns": ["fine"]},
        {"conversations": [{"from": "narrator", "value": "once upon a time"}]},
    ])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'narrator'"):
        load_jsonl_prompts(path)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "hi"}', "'conversations', 'messages' or 'turns'"),
    ('{"turns": []}', "non-empty list"),
    ('{"turns": ["ok", 3]}', r"turns\[1\]"),
    ('{"conversations": [{"role": "user"}]}', "'role' and 'content'"),
    ('[1, 2]', "JSON object"),
])
def test_bad_line_error_names_file_and_line_number(tmp_path, line, message):
    path = write_jsonl(tmp_path / "data.jsonl", [{"turns": ["ok"]}, {"turns": ["ok"]}, line])
    with pytest.raises(ValueError, match=rf"data\.jsonl:3: .*{message}"):
        load_jsonl_prompts(path)


def test_prompt_only_stops_before_first_assistant_turn():
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert prompt_only(conv) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    assert prompt_only(conv[:2]) == conv[:2]


# ---- hub ------------------------------------------------------------------

@pytest.fixture
def fake_hub(monkeypatch):
    import datasets

    rows = [
        [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]
        for i in range(40)
    ]
    calls = []

    def fake_load_dataset(name, split=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_dict({"conversations": rows, "source": ["x"] * len(rows)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return calls


def test_hub_prompts_split_5_percent_holdout_disjoint_and_deterministic(fake_hub):
    train = load_hub_prompts()
    holdout = load_hub_prompts(which="holdout")
    assert fake_hub[0] == ("mlabonne/open-perfectblend", "train")
    assert (len(train), len(holdout)) == (38, 2)
    questions = lambda convs: {c[0]["content"] for c in convs}  # noqa: E731
    assert questions(train) | questions(holdout) == {f"question {i}" for i in range(40)}
    assert not questions(train) & questions(holdout)
    assert load_hub_prompts(which="holdout") == holdout
    assert train[0][0]["role"] == "user" and train[0][1]["role"] == "assistant"


def test_hub_prompts_max_samples_and_argument_checks(fake_hub):
    assert len(load_hub_prompts(max_samples=5)) == 5
    assert load_hub_prompts(max_samples=5) == load_hub_prompts()[:5]
    with pytest.raises(ValueError, match="which"):
        load_hub_prompts(which="test")
    with pytest.raises(ValueError, match="holdout_fraction"):
        load_hub_prompts(holdout_fraction=1.5)


# ---- built-in prompt set -------------------------------------------------

def test_builtin_prompts_have_at_least_70_per_domain_and_unique_ids():
    records = builtin_prompt_records()
    ids = [r[0] for r in records]
    assert len(ids) == len(set(ids))
    for domain in prompts.builtin_domains():
        convs = load_builtin_prompts(domain)
        assert len(convs) >= 70, domain
        assert all(id_.startswith(domain + "-") for id_, d, _ in records if d == domain)
    assert len(load_builtin_prompts()) == len(records)


def test_builtin_prompts_are_single_user_turns_without_duplicates():
    texts = []
    for conv in load_builtin_prompts():
        assert len(conv) == 1 and conv[0]["role"] == "user" and conv[0]["content"].strip()
        texts.append(" ".join(conv[0]["content"].lower().split()))
    assert len(texts) == len(set(texts))


def test_builtin_math_prompts_end_with_the_boxed_suffix():
    for conv in load_builtin_prompts("math"):
        assert conv[0]["content"].endswith("\n" + MATH_SUFFIX)
    for conv in load_builtin_prompts("code") + load_builtin_prompts("chat"):
        assert MATH_SUFFIX not in conv[0]["content"]


def test_builtin_unknown_domain_is_rejected():
    with pytest.raises(ValueError, match="domain"):
        load_builtin_prompts("poetry")


def _words(text: str) -> list[str]:
    # The shared math suffix is itself 12 words; it is the benchmark's, not a prompt's.
    return re.findall(r"[a-z0-9]+", text.replace(MATH_SUFFIX, "").lower())


def test_builtin_prompts_do_not_overlap_the_eval_benchmarks():
    if not EVAL_DIR.is_dir():
        pytest.skip(f"{EVAL_DIR} not present")
    window = 12
    ours = {}
    for id_, _, conv in builtin_prompt_records():
        words = _words(conv[0]["content"])
        ours[" ".join(words)] = id_
        for i in range(len(words) - window + 1):
            ours[" ".join(words[i:i + window])] = id_
    hits = []
    for name in EVAL_FILES:
        path = EVAL_DIR / f"{name}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").split("\n"):
            if not line.strip():
                continue
            for turn in json.loads(line)["turns"]:
                words = _words(turn)
                keys = [" ".join(words)] + [
                    " ".join(words[i:i + window]) for i in range(len(words) - window + 1)
                ]
                hits += [(name, ours[k], k) for k in keys if k in ours]
    assert not hits, hits[:5]


# ---- eval benchmarks -----------------------------------------------------

def test_eval_benchmark_subset_is_seeded_and_sized():
    path = EVAL_DIR / "gsm8k.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    everything = load_eval_benchmark(path)
    assert len(everything) == 1319
    position = {conv[0]["content"]: i for i, conv in enumerate(everything)}
    subset = load_eval_benchmark(path, num_samples=500, seed=0)
    assert len(subset) == 500
    assert subset == load_eval_benchmark(path, num_samples=500, seed=0)
    assert subset != load_eval_benchmark(path, num_samples=500, seed=1)
    order = [position[conv[0]["content"]] for conv in subset]
    assert len(set(order)) == 500
    assert all(conv[0]["content"].endswith(MATH_SUFFIX) for conv in subset)


def _fisher_yates_prefix(n: int, k: int, seed: int) -> list[int]:
    """The first k of range(n) after CPython's documented random.shuffle, written out: for i
    from n−1 down to 1, swap x[i] with x[j], j uniform in 0..i drawn by rejection on
    getrandbits(i+1's bit length)."""
    rng, x = random.Random(seed), list(range(n))
    for i in range(n - 1, 0, -1):
        bits = (i + 1).bit_length()
        j = rng.getrandbits(bits)
        while j >= i + 1:
            j = rng.getrandbits(bits)
        x[i], x[j] = x[j], x[i]
    return x[:k]


def test_seeded_subset_is_deepspecs_shuffle_then_first_n(tmp_path):
    """DeepSpec's evaluator shuffles the rows with random.Random(seed) and keeps the first N,
    in shuffled order; with N >= the file size it keeps the file as it is."""
    # Seed 980406 (DeepSpec's default) on 10 lines, N = 4: lines 2, 0, 1, 5, in that order.
    assert _fisher_yates_prefix(10, 4, DEEPSPEC_EVAL_SEED) == [2, 0, 1, 5]
    assert seeded_subset(range(10), 4, DEEPSPEC_EVAL_SEED) == [2, 0, 1, 5]
    assert seeded_subset(range(10), 4, 0) == _fisher_yates_prefix(10, 4, 0) == [7, 8, 1, 5]
    assert seeded_subset(range(10), 10, 0) == list(range(10))  # not shuffled: DeepSpec shuffles only when len > N
    assert seeded_subset(range(10), None, 0) == list(range(10))
    path = write_jsonl(tmp_path / "bench.jsonl", [{"turns": [f"q{i}"]} for i in range(10)])
    picked = [conv[0]["content"] for conv in load_eval_benchmark(path, num_samples=4, seed=DEEPSPEC_EVAL_SEED)]
    assert picked == ["q2", "q0", "q1", "q5"]
    listed = load_prompts([[{"role": "user", "content": f"q{i}"}] for i in range(10)], 4, DEEPSPEC_EVAL_SEED)
    assert [conv[0]["content"] for conv in listed] == picked
    with pytest.raises(ValueError, match="num_samples must be an int >= 0"):
        seeded_subset(range(3), -1, 0)


def test_eval_benchmark_takes_first_user_turn_and_caps_at_file_size(tmp_path):
    path = write_jsonl(tmp_path / "bench.jsonl", [
        {"turns": ["one", "follow-up"]}, {"turns": ["two"]}, {"turns": ["three"]},
    ])
    assert load_eval_benchmark(path) == [
        [{"role": "user", "content": "one"}],
        [{"role": "user", "content": "two"}],
        [{"role": "user", "content": "three"}],
    ]
    assert len(load_eval_benchmark(path, num_samples=500)) == 3
    with pytest.raises(ValueError, match=r"bench\.jsonl:1"):
        load_eval_benchmark(write_jsonl(tmp_path / "bench.jsonl", [{"turns": []}]))
