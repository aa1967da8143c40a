"""The decoding API's boundary (dspark.decoding.checks): a wrong prompt, a drafter built for another
target and wrong STS temperatures fail with an error naming the argument and the fix before any
forward runs; STS temperatures reach the choose_length hook calibrated; a hook written for a
drafter without a confidence head (confidences None) runs.

Oracles: a target and a drafter whose forwards raise (so an error from inside a model cannot pass
for the check), ``apply_temperatures`` on the raw confidences the round records keep, and greedy
target-only decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dspark
from dspark.decoding.batch_jobs import BatchJob, speculative_batch_generate
from dspark.decoding.batched import SpeculativeBatch, TargetBatch
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.scheduling.calibration import apply_temperatures, save_sts_json
from helpers.decoding import random_drafter
from helpers.eagle3 import tiny_eagle3
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPT = [3, 17, 42, 5, 99]


def _no_forward(monkeypatch, *modules):
    """Make every forward of ``modules`` (and every drafter proposal) fail the test."""

    def forward(*args, **kwargs):
        raise AssertionError("a forward ran before the arguments were checked")

    for module in modules:
        monkeypatch.setattr(module, "forward", forward)
        if hasattr(module, "propose"):
            monkeypatch.setattr(module, "propose", forward)


def _bad_prompts(V):
    """(prompt, error type, message pattern) of every kind of wrong prompt."""
    return [
        (torch.tensor([PROMPT]), ValueError,
         r"prompt_ids must be a 1-D sequence of token ids; got a 2-D tensor of shape \[1, 5\]: pass prompt_ids\[0\]"),
        ([PROMPT, PROMPT], ValueError, r"sequence of sequences .*pass prompt_ids\[0\]"),
        ("The capital of France is", TypeError, r"got a str: tokenize it first, e.g. tokenizer\(text\).input_ids"),
        ({"input_ids": PROMPT}, TypeError, r"pass prompt_ids\['input_ids'\]"),
        ([3, V, 5], ValueError, rf"prompt_ids\[1\]: token id {V} >= the target's vocabulary size {V}"),
        ([3, -100], ValueError, r"prompt_ids\[1\] = -100: token ids must lie in \[0, vocabulary size\)"),
        ([3.0, 17.0], TypeError, r"prompt_ids\[0\] is 3.0 \(a float\)"),
        (torch.tensor([3.0, 17.0]), TypeError, r"a tensor of dtype torch.float32"),
        (torch.tensor(3), ValueError, r"a 0-D tensor"),
        (7, TypeError, r"got 7 \(int\)"),
        ([], ValueError, r"prompt_ids is empty"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_a_wrong_prompt_is_refused_with_the_fix_before_any_forward(case, monkeypatch):
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    prompt, error, pattern = _bad_prompts(target.vocab_size)[case]
    _no_forward(monkeypatch, target, drafter)
    with pytest.raises(error, match=pattern):
        speculative_generate(target, drafter, prompt, max_new_tokens=4, temperature=0.0)
    with pytest.raises(error, match=pattern):
        target_generate(target, prompt, max_new_tokens=4, temperature=0.0)
    for batch in (SpeculativeBatch(target, drafter, max_new_tokens=4), TargetBatch(target, max_new_tokens=4)):
        with pytest.raises(error, match=pattern):
            batch.admit(prompt)


def test_the_fix_for_a_2d_prompt_names_the_batched_function():
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="or use speculative_batch_generate for many prompts"):
        speculative_generate(target, random_drafter(target), torch.tensor([PROMPT]), max_new_tokens=4)
    with pytest.raises(ValueError, match="or use target_batch_generate for many prompts"):
        target_generate(target, torch.tensor([PROMPT]), max_new_tokens=4)
    with pytest.raises(ValueError, match="or admit each prompt on its own"):
        TargetBatch(target, max_new_tokens=4).admit(torch.tensor([PROMPT]))


def test_a_wrong_job_is_refused_before_the_first_job_is_prefilled(monkeypatch):
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    _no_forward(monkeypatch, target, drafter)
    jobs = [BatchJob(PROMPT, 0, "a"), BatchJob(PROMPT, 1, "b"), BatchJob("What is 2 + 2?", 2, "c")]
    with pytest.raises(TypeError, match=r"jobs\[2\].prompt_ids must be a 1-D sequence of token ids; got a str"):
        speculative_batch_generate(target, drafter, jobs, batch_size=2, max_new_tokens=4)


def test_a_tensor_or_array_prompt_decodes_like_the_list():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    want = speculative_generate(target, drafter, PROMPT, max_new_tokens=8, temperature=0.0).tokens
    for prompt in (torch.tensor(PROMPT), np.array(PROMPT), tuple(PROMPT), [np.int64(t) for t in PROMPT]):
        assert speculative_generate(target, drafter, prompt, max_new_tokens=8, temperature=0.0).tokens == want
    assert target_generate(target, torch.tensor(PROMPT), max_new_tokens=8, temperature=0.0).tokens == \
        target_generate(target, PROMPT, max_new_tokens=8, temperature=0.0).tokens


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_drafter_reading_other_feature_layers_is_refused_before_any_forward(kind, monkeypatch):
    """The drafter was built for a target capturing layers (0, 2, 3); this one captures (-1, 1, 3)."""
    built_for = make_tiny_target("llama", target_layer_ids=(0, 2, 3))
    drafter = tiny_eagle3(built_for, "eagle3") if kind == "eagle3" else random_drafter(built_for)
    target = make_tiny_target("llama")
    _no_forward(monkeypatch, target, drafter)
    pattern = r"the drafter: the drafter reads the target's layers \[0, 2, 3\] \(target_layer_ids\), the target captures"
    with pytest.raises(ValueError, match=pattern):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match=pattern):
        SpeculativeBatch(target, drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match=pattern):
        speculative_batch_generate(target, drafter, [BatchJob(PROMPT, 0)], batch_size=1, max_new_tokens=4)


def test_a_drafter_of_another_target_is_refused_before_any_forward(monkeypatch):
    drafter = random_drafter(make_tiny_target("qwen3"))  # V = 160 against llama's 128
    target = make_tiny_target("llama")
    _no_forward(monkeypatch, target, drafter)
    with pytest.raises(ValueError, match="the drafter: its vocab_size is 160, the target's is 128"):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=4)


def test_sts_temperatures_reach_the_hook_calibrated_and_the_rounds_keep_the_raw_confidences(tmp_path):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    temps = [0.5, 1.0, 2.0, 4.0]
    seen = []

    def hook(confidences, round_index):
        seen.append(confidences)
        return round_index % 5  # 0..4

    out = speculative_generate(target, drafter, PROMPT, max_new_tokens=20, temperature=0.0, choose_length=hook,
                               sts_temperatures=temps)
    raw = np.array([r.confidences for r in out.rounds])  # [N, γ]
    assert len(seen) == len(out.rounds) >= 3
    np.testing.assert_array_equal(np.array(seen), apply_temperatures(raw, temps))
    assert not np.allclose(np.array(seen), raw)  # T ≠ 1 moved them
    assert out.tokens == target_generate(target, PROMPT, max_new_tokens=20, temperature=0.0).tokens

    path = tmp_path / "sts.json"  # the JSON dspark calibrate writes works the same
    save_sts_json(path, temps, [0.1] * 4, [0.05] * 4)
    again = []
    speculative_generate(target, drafter, PROMPT, max_new_tokens=20, temperature=0.0,
                         choose_length=lambda c, i: again.append(c) or i % 5, sts_temperatures=path)
    assert again == seen


def test_wrong_sts_temperatures_are_refused_before_any_forward(monkeypatch):
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    _no_forward(monkeypatch, target, drafter)
    with pytest.raises(ValueError, match="sts_temperatures has 3 values but the drafter's block size γ is 4"):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=4, sts_temperatures=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="sts_temperatures must be finite and > 0"):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=4, sts_temperatures=[1.0, 0.0, 1.0, 1.0])


@pytest.mark.parametrize("kind", ["no-head", "eagle3", "head"])
def test_the_readme_hook_runs_with_and_without_a_confidence_head(kind):
    """The README's Algorithm 1 hook: confidences are None without a confidence head (then all γ)."""
    target = make_tiny_target("llama")
    if kind == "eagle3":
        drafter = tiny_eagle3(target, "eagle3")
    else:
        drafter = random_drafter(target, gamma=4, enable_confidence_head=kind == "head")
    sps = dspark.SPSTable((1, 4, 8), (30.0, 28.0, 25.0), max_batch_tokens=64)
    seen = []

    def algorithm1(c, i):
        seen.append(c)
        return drafter.config.block_size if c is None else int(dspark.schedule_prefix([c], sps)[0])

    out = dspark.speculative_generate(target, drafter, PROMPT, max_new_tokens=16, temperature=0.0,
                                      choose_length=algorithm1, sts_temperatures=[2.0] * 4)
    assert out.tokens == target_generate(target, PROMPT, max_new_tokens=16, temperature=0.0).tokens
    assert seen and all((c is None) == (kind != "head") for c in seen)
    if kind != "head":
        assert all(r.proposed == 4 or r.eos_accepted for r in out.rounds[:-1])
