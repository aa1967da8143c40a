"""docs/library.md stays true: its training loop and its calibration run as written, on a tiny target.

The blocks name the SmolLM2 config; `dspark.load_config` still reads that file (the path and the
overrides must be valid), then hands the blocks a tiny config, and `dspark.load_target` a tiny
Llama target with a ChatML byte-level BPE tokenizer. Nothing else of the blocks is replaced."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import dspark
from dspark.config import load_config
from dspark.hub import CHATML_TEMPLATE
from dspark.target import TargetModel
from helpers.bpe import train_bpe
from helpers.paths import REPO
from helpers.targets import build_tiny_model
from helpers.training import tiny_config

DOC = REPO / "docs" / "library.md"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "system\nuser\nassistant\nYou are a helpful AI assistant.",
    "Name a colour. Blue, like the sky. Count to five. One, two, three, four, five.",
    "What is the capital of France? Write a haiku about rain. Explain recursion in one line.",
    "List three prime numbers. Why is the sky blue? Translate 'thank you' into Spanish.",
] * 10
DRAFT_VOCAB = 48  # the doc's `if k:` branch runs: the vocabulary is counted from the chats


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


@pytest.fixture
def tiny_world(tmp_path, monkeypatch, one_thread):
    """A tiny target with a chat tokenizer, a tiny config with a draft vocabulary, the loaders of
    the doc answering with them, the working directory a temporary one; yields the calls that
    ``dspark.speculative_generate`` received."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_bpe(CORPUS, 300, SPECIAL_TOKENS), eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    target = TargetModel(build_tiny_model("llama", vocab_size=len(tokenizer)), (-1, 1, 3), tokenizer=tokenizer)
    config = tiny_config(target, str(tmp_path / "run"))
    config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter, draft_vocab_size=DRAFT_VOCAB))

    def fake_load_config(path, overrides=()):
        load_config(REPO / path, list(overrides))  # the doc's config file and overrides are real
        return config

    calls = []
    real_generate = dspark.speculative_generate

    def recording_generate(*args, **kwargs):
        calls.append(kwargs)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(dspark, "load_config", fake_load_config)
    monkeypatch.setattr(dspark, "load_target", lambda config, target_layer_ids=None: target)
    monkeypatch.setattr(dspark, "speculative_generate", recording_generate)
    monkeypatch.chdir(tmp_path)
    yield calls


def test_the_doc_has_a_training_block_and_a_calibration_block():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "dspark.block_loss" in blocks[0] and "dspark.sts_inputs" in blocks[1]
    for block in blocks:
        assert not re.search(r"^\s*(from dspark|import dspark\.)", block, flags=re.M)  # public names only
        assert len(block.splitlines()) <= 36


@pytest.mark.filterwarnings("ignore:fit_sts kept T = 1")  # a tiny run: too few rounds to move T
def test_the_training_loop_and_the_calibration_run_as_written(tiny_world):
    train, calibrate = _python_blocks()
    trained: dict = {"__name__": "library_doc_training"}
    exec(compile(train, str(DOC), "exec"), trained)
    out, drafter = trained["out"], trained["drafter"]
    assert math.isfinite(out.loss.item()) and out.loss.requires_grad
    assert drafter.vocab is not None and bool(drafter.d2t.any())  # counted, not the placeholder ids
    assert (trained["folder"] / "config.json").is_file()

    calibrated: dict = {"__name__": "library_doc_calibration"}
    exec(compile(calibrate, str(DOC), "exec"), calibrated)
    gamma = calibrated["drafter"].config.block_size
    inputs, temperatures = calibrated["inputs"], calibrated["temperatures"]
    assert inputs["conf"].shape[1] == gamma and len(inputs["conf"]) == len(inputs["groups"]) > 0
    assert set(inputs["groups"].tolist()) == set(range(len(calibrated["questions"])))
    assert temperatures.shape == (gamma,) and calibrated["calibrated"].shape == inputs["conf"].shape
    assert calibrated["drafter"].vocab == drafter.vocab  # the loop's saved drafter, loaded back
    assert tiny_world[-1]["sts_temperatures"] is temperatures and calibrated["out"].rounds
    assert torch.equal(calibrated["drafter"].fc.weight, drafter.fc.weight.detach())
