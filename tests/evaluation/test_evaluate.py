"""The evaluation recipe: benchmark selection, the report and its files.

Most tests replace the decode functions of ``dspark.evaluation.eval_plain`` (``speculative_generate``,
``target_generate``) by scripted ones: every prompt has a fixed list of
rounds (accepted counts), and a fake clock advances 1 s per speculative decode
and 2 s per baseline decode that emits the same number of tokens, so every
number in the report is known by hand. The last test runs the real
``speculative_generate`` with SmolLM2 and a fresh drafter on all nine
benchmark files.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import dspark.evaluation.eval_config as eval_config
import dspark.evaluation.eval_plain as plain
import dspark.evaluation.evaluate as ev
from dspark.decoding.loop import DecodeResult, RoundRecord
from dspark.data.benchmarks import resolve_benchmarks, samples_per_benchmark
from dspark.evaluation.evaluate import DecodeSettings, ServeSettings, evaluate
from dspark.evaluation.report import compare_reports
from dspark.evaluation.metrics import BENCHMARKS
from helpers.benchmarks import CharTokenizer, write_benchmarks
from helpers.evaluation import GAMMA, FakeClock, fake_models, scripted_decoders
from helpers.paths import REPO, SHARED, load_script

ROOT = REPO
SHARED = SHARED / "eval_datasets"
SMOLLM2_CONFIG = ROOT / "config" / "dspark" / "dspark_smollm2_135m.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TABLE1_HEADER = (
    "| drafter | GSM8K | MATH | AIME25 | MBPP | HumanEval | LCB | MT-Bench | Alpaca | Arena-Hard | Math | Code | Chat | Avg |"
)


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(plain, "time", c)
    monkeypatch.setattr(ev, "time", c)
    return c


@pytest.fixture
def no_warmup(monkeypatch):
    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)


def use_decoders(monkeypatch, decode, baseline):
    """Make ``evaluate`` decode with ``decode`` (speculative) and ``baseline`` (target alone)."""
    monkeypatch.setattr(plain, "speculative_generate", decode)
    monkeypatch.setattr(plain, "target_generate", baseline)


def run(tmp_path, clock, monkeypatch, **kwargs):
    target, drafter = fake_models()
    use_decoders(monkeypatch, *scripted_decoders(clock))
    options = dict(decoding=DecodeSettings(max_new_tokens=32), out_dir=tmp_path / "out", progress=False)
    options.update(kwargs)
    return evaluate(target, drafter, write_benchmarks(tmp_path / "data"), **options)


# ------------------------------------------------------------------ the report


def test_report_holds_hand_computed_tau_per_benchmark_domain_and_macro(tmp_path, clock, monkeypatch):
    report = run(tmp_path, clock, monkeypatch)
    b = report["benchmarks"]
    assert list(b) == ["gsm8k", "mbpp", "alpaca"]
    assert b["gsm8k"]["tau"] == pytest.approx(7 / 3)
    assert b["gsm8k"]["tau_per_request"] == pytest.approx((3 + 1) / 2)
    assert b["gsm8k"]["num_requests"] == 2 and b["gsm8k"]["num_rounds"] == 3
    assert b["mbpp"]["tau"] == pytest.approx(3.0)
    assert b["alpaca"]["tau"] == pytest.approx(2.0)
    assert report["macro"]["tau"] == pytest.approx({"math": 7 / 3, "code": 3.0, "chat": 2.0, "avg": 22 / 9})
    assert report["domains"]["math"]["benchmarks"] == ["gsm8k"]
    assert report["all"]["tau"] == pytest.approx((4 + 2 + 1 + 3 + 3 + 2) / 6)
    # k=1: 6 rounds, 5 accepted; k=2: m≥1 -> 5 rounds, m≥2 -> 3 ((3) (2) (2)); k=3: m≥2 -> 3, m≥3 -> 1.
    assert report["all"]["conditional_acceptance"] == pytest.approx([5 / 6, 3 / 5, 1 / 3])
    assert report["gamma"] == GAMMA and report["label"] == "DSpark"


def test_speedup_is_the_throughput_ratio_against_the_target_alone(tmp_path, clock, monkeypatch):
    report = run(tmp_path, clock, monkeypatch)
    gsm8k = report["benchmarks"]["gsm8k"]
    assert gsm8k["tokens"] == 7 and gsm8k["wall_s"] == pytest.approx(2.0)
    assert gsm8k["baseline_tokens"] == 7 and gsm8k["baseline_wall_s"] == pytest.approx(4.0)
    assert gsm8k["speedup"] == pytest.approx(2.0)
    assert report["macro"]["speedup"]["avg"] == pytest.approx(2.0)
    # Without the prefills (0.5 s each; the first token of each request is theirs): 5 tokens
    # in 2 x 0.5 s against 5 tokens in 2 x 1.5 s.
    assert gsm8k["decode_speedup"] == pytest.approx((5 / 1.0) / (5 / 3.0))
    # mbpp: one request of 6 tokens, 5 after the prefill, in 0.5 s against 1.5 s.
    assert report["benchmarks"]["mbpp"]["decode_speedup"] == pytest.approx(3.0)
    assert report["timings"]["spec_phases_s"]["draft"] == pytest.approx(0.25 * 4)


def test_without_baseline_no_speedup_is_reported(tmp_path, clock, monkeypatch):
    report = run(tmp_path, clock, monkeypatch, baseline=False)
    assert "speedup" not in report["benchmarks"]["gsm8k"]
    assert math.isnan(report["macro"]["speedup"]["avg"])


def test_confidence_quality_uses_only_rounds_with_confidences(tmp_path, clock, monkeypatch):
    report = run(tmp_path, clock, monkeypatch, serving=ServeSettings(sts_temperatures=[1.0, 2.0, 0.5]))
    conf = report["all"]["confidence"]
    # Rounds with even m carry confidences: m = 0, 2, 2 -> position 1 labels 0, 1, 1.
    assert conf[0]["count"] == 3
    assert conf[0]["mean_label"] == pytest.approx(2 / 3)
    assert conf[0]["brier"] == pytest.approx(((0.9 - 0) ** 2 + 2 * (0.9 - 1) ** 2) / 3)
    assert report["all"]["confidence_calibrated"][0]["brier"] == pytest.approx(conf[0]["brier"])  # T_1 = 1
    assert report["config"]["sts_temperatures"] == [1.0, 2.0, 0.5]


# ------------------------------------------------------------------ the files


# GSM8K's two requests have τ sums (6 over 2 rounds) and (1 over 1): τ 7/3; leaving one out gives 3 or 1,
# so the jackknife's sd of log τ is |log 3 − log 1| / 2 and, with one degree of freedom (t_1 = 12.706), the
# interval is exp(log 7/3 ± 12.706 · 0.5493) = [0.0022, 2507.13], clipped at τ = 1. MBPP and Alpaca have one
# request each: no degree of freedom, no interval. The Avg (τ_GSM8K + 3 + 2) / 3 is 2 or 8/3 with one GSM8K
# request left out: exp(log 22/9 ± 12.706 · |log(4/3)| / 2) = [0.39, 15.20], clipped at 1.
DSPARK_ROW = ("| DSpark | 2.33 [1.00, 2507.13] | – | – | 3.00 (no interval) | – | – | – | 2.00 (no interval) | – "
              "| 2.33 [1.00, 2507.13] | 3.00 (no interval) | 2.00 (no interval) | 2.44 [1.00, 15.20] |")


def test_files_hold_rounds_requests_strict_json_markdown_and_plots(tmp_path, clock, monkeypatch, plain_bootstrap):
    run(tmp_path, clock, monkeypatch, serving=ServeSettings(sts_temperatures=[1.0, 1.0, 1.0]))
    out = tmp_path / "out"
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 6
    assert rounds[0] == {
        "benchmark": "gsm8k", "request": 0, "round": 0, "proposed": 3, "accepted": 3, "confidences": None,
        "eos_accepted": False,
    }
    assert rounds[2]["confidences"] == [0.9, 0.6, 0.3]
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["benchmark"], r["request"], r["tokens"], r["rounds"]) for r in requests] == [
        ("gsm8k", 0, 6, 2), ("gsm8k", 1, 1, 1), ("mbpp", 0, 6, 2), ("alpaca", 0, 2, 1)
    ]
    assert requests[0]["wall_s"] == pytest.approx(1.0) and requests[0]["baseline_wall_s"] == pytest.approx(2.0)

    def no_nan(token):
        raise AssertionError(f"report.json holds {token}")

    report = json.loads((out / "report.json").read_text(), parse_constant=no_nan)
    assert report["benchmarks"]["mbpp"]["tau"] == pytest.approx(3.0)
    md = (out / "report.md").read_text()
    assert TABLE1_HEADER in md
    assert DSPARK_ROW in md
    assert "Conditional acceptance per position" in md and "ECE after STS" in md
    for name in ("acceptance.png", "reliability.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_reliability_plot_is_skipped_without_confidences(tmp_path, clock, monkeypatch):
    monkeypatch.setattr("dspark.evaluation.report.plot_reliability", lambda *a, **k: pytest.fail("no confidences to plot"))
    target, drafter = fake_models()
    decode, baseline = scripted_decoders(clock)

    def no_confidence(*args, **kwargs):
        result = decode(*args, **kwargs)
        rounds = [RoundRecord(r.proposed, r.accepted, None) for r in result.rounds]
        return DecodeResult(result.prompt_len, result.tokens, rounds, False, {})

    use_decoders(monkeypatch, no_confidence, baseline)
    report = evaluate(target, drafter, write_benchmarks(tmp_path / "data"), out_dir=tmp_path / "out", progress=False,
                      decoding=DecodeSettings(max_new_tokens=8))
    assert report["all"]["confidence"] is None
    assert "no confidence head" in (tmp_path / "out" / "report.md").read_text()


# ------------------------------------------------------------------ prompts and selection


def test_prompts_are_the_first_user_turn_rendered_without_thinking(tmp_path, clock, monkeypatch, no_warmup):
    target, drafter = fake_models()
    calls = []
    use_decoders(monkeypatch, *scripted_decoders(clock, calls))
    evaluate(target, drafter, write_benchmarks(tmp_path / "data"), progress=False,
             decoding=DecodeSettings(max_new_tokens=8), baseline=False)
    assert calls == ["g0", "g1", "m0", "a0"]  # "second turn" never reaches the target


def test_a_data_folder_evaluates_the_files_it_has_and_warns_about_the_rest(tmp_path, clock, monkeypatch):
    write_benchmarks(tmp_path / "data", {"gsm8k": ["g0"]})
    target, drafter = fake_models()
    use_decoders(monkeypatch, *scripted_decoders(clock))
    with pytest.warns(UserWarning, match=r"skipping benchmark\(s\) \['math500', .*'arena-hard-v2'\]: no file .*math500.jsonl.*make_benchmarks.py"):
        report = evaluate(target, drafter, tmp_path / "data", progress=False, decoding=DecodeSettings(max_new_tokens=8))
    assert list(report["benchmarks"]) == ["gsm8k"]
    assert report["skipped"] == [n for n in BENCHMARKS if n != "gsm8k"]


def test_a_folder_without_benchmark_files_names_itself_and_the_build_script(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*eval_datasets/make_benchmarks.py --out .*empty"):
        resolve_benchmarks(tmp_path / "empty")


def test_a_subset_of_names_can_be_chosen_from_a_folder(tmp_path):
    write_benchmarks(tmp_path, {"gsm8k": ["g0"], "mbpp": ["m0"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found, missing = resolve_benchmarks(tmp_path, ["mbpp"])
    assert list(found) == ["mbpp"] and missing == []


def test_sample_counts_default_to_the_protocol_and_can_be_overridden():
    assert samples_per_benchmark(["gsm8k", "aime25", "custom"], None) == {"gsm8k": 500, "aime25": 30, "custom": None}
    assert samples_per_benchmark(["gsm8k", "custom"], 0) == {"gsm8k": 500, "custom": None}
    assert samples_per_benchmark(["gsm8k", "mbpp"], 2) == {"gsm8k": 2, "mbpp": 2}
    assert samples_per_benchmark(["gsm8k", "mbpp"], {"mbpp": 3}) == {"gsm8k": 500, "mbpp": 3}
    with pytest.raises(ValueError, match="num_samples must be an int >= 0"):
        samples_per_benchmark(["gsm8k"], -1)


def test_num_samples_draws_a_seeded_subset(tmp_path, clock, monkeypatch, no_warmup):
    files = {"gsm8k": ["g0", "g1"]}
    target, drafter = fake_models()
    seen = {}
    for seed in range(6):
        calls = []
        use_decoders(monkeypatch, *scripted_decoders(clock, calls))
        evaluate(target, drafter, write_benchmarks(tmp_path / "data", files), num_samples=1,
                 decoding=DecodeSettings(max_new_tokens=8, seed=seed), progress=False, baseline=False)
        seen[seed] = calls
    assert all(len(c) == 1 for c in seen.values())
    assert {c[0] for c in seen.values()} == {"g0", "g1"}  # different seeds pick different prompts


def test_the_split_picks_the_prompts_decoded_and_the_report_records_it(tmp_path, clock, monkeypatch, no_warmup):
    # 4 prompts: dev is 2 of them, items 2 and 3 of the file (random.Random(980406) shuffles
    # [0, 1, 2, 3] to [2, 3, 0, 1]); test is the other two, whatever eval.seed is.
    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "m0", "a0"]})
    target, drafter = fake_models()
    for split, seed, expected in (("dev", 0, ["m0", "a0"]), ("dev", 5, ["m0", "a0"]), ("test", 5, ["g0", "g1"])):
        calls = []
        use_decoders(monkeypatch, *scripted_decoders(clock, calls))
        report = evaluate(target, drafter, files, split=split, out_dir=tmp_path / f"out-{split}-{seed}", progress=False,
                          baseline=False, decoding=DecodeSettings(max_new_tokens=8, seed=seed))
        assert calls == expected
        assert report["config"]["split"] == split
        assert f"seed = {seed}, split = {split}," in (tmp_path / f"out-{split}-{seed}" / "report.md").read_text()


def test_a_folder_evaluated_on_another_split_is_refused(tmp_path, clock, monkeypatch, no_warmup):
    from dspark.evaluation.journal import SettingsMismatch

    files = write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1", "m0", "a0"]})
    target, drafter = fake_models()
    use_decoders(monkeypatch, *scripted_decoders(clock))
    options = dict(out_dir=tmp_path / "out", progress=False, baseline=False, decoding=DecodeSettings(max_new_tokens=8))
    evaluate(target, drafter, files, split="dev", **options)
    with pytest.raises(SettingsMismatch, match=r"config.split: 'dev' -> 'test'.*--overwrite"):
        evaluate(target, drafter, files, split="test", **options)
    assert evaluate(target, drafter, files, split="dev", resume=True, **options)["config"]["split"] == "dev"


def test_an_unknown_split_names_the_choices(tmp_path):
    target, drafter = fake_models()
    with pytest.raises(ValueError, match=r"split must be one of \('all', 'dev', 'test'\).*got 'train'"):
        evaluate(target, drafter, write_benchmarks(tmp_path / "data"), split="train", progress=False)


def every_draft(request_ids, confidences):
    """A policy as a plain function: verify all γ drafts of every request."""
    return np.full(len(request_ids), confidences.shape[1])


def test_a_policy_is_named_by_its_spec_its_policy_name_or_its_functions_name():
    from dspark.scheduling.policies import per_request_policy

    assert ev.policy_label("static:2") == "static:2"
    assert ev.policy_label(every_draft) == "every_draft"
    assert ev.policy_label(functools.partial(every_draft)) == "every_draft"
    assert ev.policy_label(per_request_policy(lambda c, i: 1, name="one at a time")) == "one at a time"


def test_a_scheduled_evaluation_under_a_plain_function_reports_the_functions_name(tmp_path, no_warmup):
    from helpers.decoding import random_drafter
    from helpers.targets import make_tiny_target

    target = make_tiny_target("llama")
    report = evaluate(target, random_drafter(target, gamma=3), write_benchmarks(tmp_path / "data", {"gsm8k": ["g0"]}),
                      decoding=DecodeSettings(max_new_tokens=4, seed=0, eos_token_ids=[0]), baseline=False,
                      serving=ServeSettings(policy=every_draft), tokenizer=CharTokenizer(), progress=False)
    assert report["config"]["scheduler"] == "every_draft (serving loop, R = 1)"
    assert report["scheduled"]["policy"] == "every_draft"


def test_ranks_take_every_world_th_prompt_and_only_rank_zero_writes_the_report(
        tmp_path, clock, monkeypatch, no_warmup):
    files = {"gsm8k": ["g0", "g1"], "mbpp": ["m0"]}
    target, drafter = fake_models()
    calls = []
    use_decoders(monkeypatch, *scripted_decoders(clock, calls))
    monkeypatch.setattr(ev, "dist_info", lambda: (1, 2))
    monkeypatch.setattr(ev, "_gather", lambda records, rounds, served, world: (records, rounds, served))
    monkeypatch.setattr(ev, "_barrier", lambda: None)
    report = evaluate(target, drafter, write_benchmarks(tmp_path / "data", files), out_dir=tmp_path / "out",
                      progress=False, decoding=DecodeSettings(max_new_tokens=8))
    assert calls == ["g1"]  # rank 1 of 2: request 1 of gsm8k, nothing of mbpp
    assert report["config"]["world_size"] == 2
    # rank 1 keeps its own journal of finished requests; rank 0 writes settings, the report and the merged files
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "requests.rank1.jsonl", "rounds.rank1.jsonl", "serving.rank1.jsonl"]
    assert [r["request"] for r in map(json.loads, (tmp_path / "out" / "requests.rank1.jsonl").open())] == [1]


def test_requests_draw_from_seeded_generators_independent_of_order(tmp_path, clock, monkeypatch, no_warmup):
    seeds = []
    target, drafter = fake_models()
    decode, baseline = scripted_decoders(clock)

    def recording(*args, generator, **kwargs):
        seeds.append(generator.initial_seed())
        return decode(*args, generator=generator, **kwargs)

    use_decoders(monkeypatch, recording, baseline)
    for _ in range(2):
        evaluate(target, drafter, write_benchmarks(tmp_path / "data"), progress=False,
                 decoding=DecodeSettings(max_new_tokens=8), baseline=False)
    assert seeds[:4] == seeds[4:] and len(set(seeds[:4])) == 4


def test_a_request_seed_is_derived_from_the_run_seed_the_benchmark_and_the_request():
    """The seed every evaluation has decoded its requests with (cycle 0 of ``request_seed``)."""
    import zlib

    from dspark.seeds import request_seed

    for seed, benchmark, request in ((0, "gsm8k", 0), (980406, "mt-bench", 17), (2**40 + 3, "aime25", 5)):
        by_hand = (seed * 1_000_003 + zlib.crc32(benchmark.encode("utf-8")) * 7_919 + request) % 2**63
        assert request_seed(seed, benchmark, request) == request_seed(seed, benchmark, request, cycle=0) == by_hand


def test_without_a_tokenizer_evaluate_says_how_to_fix_it(tmp_path):
    target = SimpleNamespace(tokenizer=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(target, None, write_benchmarks(tmp_path / "data"), progress=False)


# ------------------------------------------------------------------ comparing drafters


def test_compare_reports_puts_one_row_per_drafter_in_table_1_order(tmp_path, clock, monkeypatch, plain_bootstrap):
    dspark = run(tmp_path, clock, monkeypatch)
    dflash = {"benchmarks": {"gsm8k": {"tau": 2.0}, "humaneval": {"tau": 1.5}}}
    table = compare_reports({"DSpark": dspark, "DFlash": dflash}).splitlines()
    assert table[0] == TABLE1_HEADER
    assert table[2] == DSPARK_ROW
    assert table[3] == "| DFlash | 2.00 | – | – | – | 1.50 | – | – | – | – | 2.00 | 1.50 | – | 1.75 |"
    assert compare_reports({"DSpark": tmp_path / "out"}).splitlines()[2] == table[2]  # from report.json's folder


# ------------------------------------------------------------------ end to end


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/eval_datasets")
def test_smollm2_with_a_fresh_drafter_runs_all_nine_benchmarks(smollm2_target, tmp_path, no_warmup):
    from dspark.build import build_drafter
    from dspark.config import load_config

    config = load_config(str(SMOLLM2_CONFIG), [f"drafter.target_layer_ids={list(smollm2_target.target_layer_ids)}"])
    drafter = build_drafter(config, smollm2_target).eval()
    # Seed 294 draws the shortest one-prompt subsets (at most ~1,000 characters per prompt):
    # the test measures plumbing, not throughput, on a shared 2-core CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = evaluate(smollm2_target, drafter, SHARED, num_samples=1,
                          decoding=DecodeSettings(max_new_tokens=4, temperature=1.0, seed=294), out_dir=tmp_path,
                          progress=False, run_config=config)
    finally:
        torch.set_num_threads(threads)
    assert list(report["benchmarks"]) == list(BENCHMARKS)
    gamma = config.drafter.block_size
    for b in report["benchmarks"].values():
        assert b["num_requests"] == 1 and 1 <= b["tokens"] <= 4
        assert b["num_rounds"] == 0 or 1.0 <= b["tau"] <= gamma + 1
        assert b["speedup"] > 0
    rounds = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert len(rounds) == report["all"]["num_rounds"] > 0
    assert all(len(json.loads(r)["confidences"]) == gamma for r in rounds)  # DSpark has a confidence head
    assert report["config"]["run"]["name"] == config.name
    assert "| DSpark |" in compare_reports({"DSpark": report})


# ------------------------------------------------------------------ building the benchmark files


def load_builder():
    """eval_datasets/make_benchmarks.py is a script, not a package module: import it by path (once)."""
    return load_script("eval_datasets/make_benchmarks.py")


# Rows shaped like the hub's (field names and values of the public datasets), one or two per source.
HUB_ROWS = {
    "gsm8k": [{"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
               "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of fabric\n#### 3"}],
    "math500": [{"problem": "How many positive whole-number divisors does 196 have?", "solution": "...", "answer": "9",
                 "subject": "Number Theory", "level": 3, "unique_id": "test/number_theory/572.json"}],
    "aime25": [{"problem_idx": 1, "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$",
                "answer": 70, "problem_type": ["Number Theory"]}],
    "humaneval": [{"task_id": "HumanEval/53", "entry_point": "add", "canonical_solution": "    return x + y\n", "test": "...",
                   "prompt": '\n\ndef add(x: int, y: int):\n    """Add two numbers x and y\n    >>> add(2, 3)\n    5\n    >>> add(5, 7)\n    12\n    """\n'}],
    "mbpp": [{"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 11, "code": "...", "test_imports": [],
              "prompt": "Write a python function to remove first and last occurrence of a given character from the string.",
              "test_list": ['assert remove_Occ("hello","l") == "heo"']}],
    "livecodebench": [
        {"question_title": "9 Divisors", "platform": "atcoder", "starter_code": "", "difficulty": "hard",
         "question_content": "Find the number of positive integers not greater than N that have exactly 9 positive divisors.\n\n"
         "Input\n\nThe input is given from Standard Input in the following format:\nN\n\nOutput\n\nPrint the answer.\n\n"
         "Constraints\n\n\n- 1 \\leq N \\leq 4 \\times 10^{12}\n- All input values are integers.\n\nSample Input 1\n\n200\n\n"
         "Sample Output 1\n\n3\r\n\nThree positive integers 36,100,196 satisfy the condition.\n\nSample Input 2\n\n"
         "4000000000000\n\nSample Output 2\n\n407073"},
        {"question_title": "smallest-number-with-all-set-bits", "platform": "leetcode", "difficulty": "easy",
         "starter_code": "class Solution:\n    def smallestNumber(self, n: int) -> int:\n        ",
         "question_content": "You are given a positive number n.\nReturn the smallest number x greater than or equal to n, "
         "such that the binary representation of x contains only set bits\n \nExample 1:\n\nInput: n = 5\nOutput: 7\n"
         "Explanation:\nThe binary representation of 7 is \"111\".\n\nExample 2:\n\nInput: n = 10\nOutput: 15\n"
         "Explanation:\nThe binary representation of 15 is \"1111\".\n\nExample 3:\n\nInput: n = 3\nOutput: 3\n"
         "Explanation:\nThe binary representation of 3 is \"11\".\n\n \nConstraints:\n\n1 <= n <= 1000"},
    ],
    "mt-bench": [{"prompt_id": 81, "category": "writing", "reference": [], "prompt": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.",
        "Rewrite your previous response. Start every sentence with the letter A."]}],
    "alpaca": [{"instruction": "Convert the following binary code to ASCII characters.",
                "input": "01110101 01100001 01110010 01101001 01110100",
                "output": "The ASCII characters for the binary code is: wast.", "text": "..."}],
    "arena-hard-v2": [
        {"uid": "0001", "category": "hard_prompt", "subcategory": "coding",
         "prompt": "please write a python script that takes a .mp4 file and outputs screenshots taken 10s apart"},
        {"uid": "0002", "category": "creative_writing", "subcategory": "creative_writing", "prompt": "Thơ về biển "},
    ],
}


def test_the_builder_has_a_source_for_each_of_the_nine_benchmarks():
    assert list(load_builder().SOURCES) == list(BENCHMARKS)


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/eval_datasets")
@pytest.mark.parametrize("name", BENCHMARKS)
def test_formatting_hub_rows_reproduces_lines_of_the_reference_files(name):
    builder = load_builder()
    reference = set((SHARED / f"{name}.jsonl").read_text(encoding="utf-8").splitlines())
    for line in builder.format_rows(name, HUB_ROWS[name]):
        assert line in reference


def test_math_prompts_end_with_the_boxed_instruction_on_its_own_line():
    builder = load_builder()
    assert builder.format_gsm8k({"question": "1+1?"}) == [
        "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    ]


def test_alpaca_prompts_leave_out_the_input_field():
    builder = load_builder()
    assert builder.format_alpaca(HUB_ROWS["alpaca"][0]) == ["Convert the following binary code to ASCII characters."]


def test_build_writes_one_jsonl_file_per_benchmark_from_the_loader(tmp_path):
    builder = load_builder()
    calls = []

    def fake_load(*args, **kwargs):
        calls.append(args)
        name = {s.args: n for n, s in builder.SOURCES.items()}[args] if args != ("json",) else (
            "livecodebench" if "livecodebench" in str(kwargs["data_files"]) else "arena-hard-v2")
        return HUB_ROWS[name]

    written = builder.build(["mbpp", "livecodebench", "arena-hard-v2"], tmp_path, load=fake_load, log=lambda _: None)
    assert written == {"mbpp": 1, "livecodebench": 2, "arena-hard-v2": 2}
    assert calls[0] == ("google-research-datasets/mbpp", "sanitized")
    conversations = load_eval_benchmark_for_test(tmp_path / "arena-hard-v2.jsonl")
    assert conversations[1] == [{"role": "user", "content": "Thơ về biển "}]  # verbatim, not stripped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arena-hard-v2.jsonl", "livecodebench.jsonl", "mbpp.jsonl"]


def test_a_row_without_the_expected_field_names_the_benchmark_and_row(tmp_path):
    builder = load_builder()
    with pytest.raises(ValueError, match=r"gsm8k: row 1 .*'question'"):
        builder.format_rows("gsm8k", [{"question": "ok"}, {"problem": "wrong field"}])
    with pytest.raises(ValueError, match="unknown benchmark"):
        builder.build(["gsm8k8"], tmp_path, load=lambda *a, **k: [])


def load_eval_benchmark_for_test(path):
    from dspark.data.prompts import load_eval_benchmark

    return load_eval_benchmark(path)


def test_gather_collects_records_through_all_gather_object(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ev.dist_info() == (0, 1)
        records, rounds, served = ev._gather([{"request": 0}], [{"round": 0}, {"round": 1}], {("a", 0): {}}, 1)
    finally:
        dist.destroy_process_group()
    assert records == [{"request": 0}] and rounds == [{"round": 0}, {"round": 1}] and served == {("a", 0): {}}


def test_evaluate_from_config_reads_the_eval_section_and_writes_a_config_that_loads_back(tmp_path, clock, monkeypatch):
    from dspark.config import Config, EvalConfig, load_config

    write_benchmarks(tmp_path / "data")
    config = Config(out_dir=str(tmp_path / "run"),
                    eval=EvalConfig(benchmarks=["mbpp", "alpaca"], data_dir=str(tmp_path / "data"), num_samples=0,
                                    split="test", max_new_tokens=16, temperature=0.5, seed=3, label="mine",
                                    batch_size=1))  # the scripted decoders are batch-1 seams
    target, drafter = fake_models()
    use_decoders(monkeypatch, *scripted_decoders(clock))
    report = eval_config.evaluate_from_config(target, drafter, config, progress=False)
    assert list(report["benchmarks"]) == ["mbpp", "alpaca"]
    assert report["config"]["max_new_tokens"] == 16 and report["config"]["temperature"] == 0.5
    assert report["config"]["num_samples"] == {"mbpp": 256, "alpaca": 500}
    assert report["config"]["split"] == "test"  # one prompt each: dev holds min(16, 1 // 2) = 0, test the prompt
    assert report["config"]["run"]["eval"]["seed"] == 3 and report["label"] == "mine"
    assert (tmp_path / "run" / "eval" / "report.json").is_file()
    assert load_config(tmp_path / "run" / "eval" / "config.json") == config


def test_evaluate_from_config_wants_a_policy_for_concurrency_and_points_to_batch_size(tmp_path):
    from dspark.config import Config, ServeConfig

    target, drafter = fake_models()
    with pytest.raises(ValueError, match="serve.concurrency needs serve.policy.*--batch-size"):
        eval_config.evaluate_from_config(target, drafter, Config(serve=ServeConfig(concurrency=2)))


def test_eval_inputs_refuse_a_policy_named_twice():
    from dspark.config import Config, EvalConfig, ServeConfig

    config = Config(eval=EvalConfig(builtin_prompts=True), serve=ServeConfig(policy=["static", "static1", "static"]))
    with pytest.raises(ValueError, match=r"serve.policy=\['static', 'static1', 'static'\] names \['static'\] more"):
        eval_config.check_eval_inputs(config)


def test_prompts_given_in_memory_draw_the_same_seeded_subset_as_their_file(tmp_path, clock, monkeypatch, no_warmup):
    prompts = ["g0", "g1", "m0", "a0"]
    path = write_benchmarks(tmp_path / "data", {"gsm8k": prompts})["gsm8k"]
    in_memory = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": p},
                  {"role": "assistant", "content": "an answer"}] for p in prompts]
    target, drafter = fake_models()
    picked = []
    for source in (path, in_memory):
        calls = []
        use_decoders(monkeypatch, *scripted_decoders(clock, calls))
        evaluate(target, drafter, {"gsm8k": source}, num_samples=2, decoding=DecodeSettings(max_new_tokens=8, seed=5),
                 progress=False, baseline=False)
        picked.append(calls)
    assert picked[0] == picked[1] and len(picked[0]) == 2


def test_the_automatic_batch_size_is_the_last_doubling_that_raises_round_throughput_by_a_tenth():
    """auto_batch_size on hand-made tables: throughput of full rounds R · SPS(R (1 + γ)), γ = 3."""
    from dspark.scheduling.batch_size import auto_batch_size
    from dspark.scheduling.algorithm1 import SPSTable

    flat = SPSTable([1, 512], [20.0, 20.0], 512)  # verification free up to 512 tokens: every doubling pays
    assert auto_batch_size(flat, 3) == 128 and auto_batch_size(flat, 3, requests=20) == 20
    # R=1: 4·... SPS(4)=20 -> 20; R=2: 2·SPS(8)=2·19=38 (×1.9); R=4: 4·SPS(16)=4·11=44 (×1.16);
    # R=8: 8·SPS(32)=8·6=48 (×1.09 < 1.1): stop at 4
    table = SPSTable([1, 4, 8, 16, 32, 64], [20.0, 20.0, 19.0, 11.0, 6.0, 3.0], 64)
    assert auto_batch_size(table, 3) == 4
    assert auto_batch_size(SPSTable([1, 4], [20.0, 20.0], 4), 3) == 1  # R = 2 would leave the table
    assert auto_batch_size(None, 3, "cpu") == 8 and auto_batch_size(None, 3, "cuda") == 64
    assert eval_config.resolve_batch_size(5) == 5 and eval_config.resolve_batch_size("auto") == "auto"
