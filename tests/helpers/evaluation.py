"""Scripted stand-ins for an evaluation's models and decoders, with every number known by hand.

Every prompt has a fixed list of rounds (accepted counts); a fake clock advances 1 s per
speculative decode and 2 s per baseline decode that emits the same number of tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dspark.decoding.loop import DecodeResult, RoundRecord
from helpers.benchmarks import CharTokenizer

GAMMA = 3

# prompt text -> accepted draft tokens of each round (γ = 3, every round verifies all 3).
SCRIPT = {
    "g0": [3, 1],  # τ 4, 2
    "g1": [0],  # τ 1
    "m0": [2, 2],  # τ 3, 3
    "a0": [1],  # τ 2
}


def prompt_text(prompt_ids) -> str:
    text = "".join(chr(i) for i in prompt_ids)
    return text[len("<u>") : text.index("</u>")]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def scripted_decoders(clock, calls=None):
    def decode(target, drafter, prompt_ids, *, max_new_tokens, temperature, eos_token_ids, generator, prefills=None):
        assert isinstance(generator, torch.Generator)
        if calls is not None:
            calls.append(prompt_text(prompt_ids))
        clock.now += 1.0
        accepted = SCRIPT[prompt_text(prompt_ids)]
        rounds = [RoundRecord(GAMMA, m, [0.9, 0.6, 0.3] if m % 2 == 0 else None) for m in accepted]
        tokens = [5] * sum(m + 1 for m in accepted)
        return DecodeResult(len(prompt_ids), tokens, rounds, False, {"prefill": 0.5, "draft": 0.25, "total": 1.0})

    def baseline(target, prompt_ids, *, max_new_tokens, temperature, eos_token_ids, generator, prefills=None):
        clock.now += 2.0
        n = sum(m + 1 for m in SCRIPT[prompt_text(prompt_ids)])
        return DecodeResult(len(prompt_ids), [5] * n, [], False, {"prefill": 0.5, "decode": 1.5, "total": 2.0})

    return decode, baseline


def fake_models():
    target = SimpleNamespace(tokenizer=CharTokenizer(), device=torch.device("cpu"))
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=GAMMA, variant="dspark"))
    return target, drafter
