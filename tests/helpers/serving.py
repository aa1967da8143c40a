"""Builders shared by the serving-simulator tests: prompts, a scripted drafter, joint output counts."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from dspark.decoding.loop import target_generate
from dspark.modeling import Proposal


def joint_counts(sim, V: int, n: int = 3) -> torch.Tensor:
    """Counts [V]*n of the first n tokens of the simulation's finished requests."""
    counts = torch.zeros((V,) * n)
    for request in sim.requests:
        if request["finished"]:
            counts[tuple(request["result"].tokens[:n])] += 1
    return counts


PROMPTS = ([3, 17, 42, 5, 99], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])


class ScriptedDrafter:
    """Drafts the target's greedy continuation at positions 1..correct and a wrong token after,
    with fixed confidences, so that at T = 0 every round accepts exactly min(ℓ, correct).

    ``sequence`` is prompt + the target's greedy continuation (long enough for every draft);
    the anchor of a round sits at position ctx.lengths, so x_k = sequence[ctx.lengths + k]."""

    def __init__(self, sequence: list[int], vocab: int, gamma: int, correct: int, confidences: list[float]):
        self.sequence, self.vocab, self.gamma, self.correct = sequence, vocab, gamma, correct
        self.confidences = torch.tensor([confidences], dtype=torch.float32)

    def new_context(self, batch_size, device=None, capacity=256):
        return SimpleNamespace(lengths=torch.zeros(batch_size, dtype=torch.long))

    def extend_context(self, ctx, features, num_valid=None):
        ctx.lengths = ctx.lengths + features.shape[1]

    def propose(self, ctx, anchor_tokens, *, temperature=1.0, generator=None):
        at = int(ctx.lengths[0])
        assert self.sequence[at] == int(anchor_tokens[0])  # the loop hands over the right anchor
        tokens = [self.sequence[at + k] if k <= self.correct else (self.sequence[at + k] + 1) % self.vocab
                  for k in range(1, self.gamma + 1)]
        probs = torch.full((1, self.gamma, self.vocab), 1.0 / self.vocab)
        return Proposal(torch.tensor([tokens]), probs, probs.log(), self.confidences.clone())


def scripted(target, prompt, *, gamma=3, correct=2, confidences=(0.9, 0.8, 0.7), n=40) -> ScriptedDrafter:
    sequence = list(prompt) + greedy(target, prompt, n).tokens
    return ScriptedDrafter(sequence, target.vocab_size, gamma, correct, list(confidences))


def greedy(target, prompt, n: int):
    return target_generate(target, prompt, max_new_tokens=n, temperature=0.0)
