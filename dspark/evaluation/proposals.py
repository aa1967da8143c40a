"""Proposals of a drafter along the target's own continuation of a prompt (the Foundation demo).

The target continues a chat prompt greedily; at a few anchor positions of that
continuation the drafter proposes a block from the target's features of the
context before the anchor, and the block is set beside what the target actually
wrote next. With an untrained drafter the blocks are noise and the confidences
near σ(b); a trained drafter should match the target's prefix with confidences
that fall along the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.modeling import Drafter
from dspark.target import TargetModel


@dataclass
class BlockView:
    anchor_position: int
    anchor_token: int
    draft_tokens: list[int]
    confidences: list[float] | None
    target_tokens: list[int]  # what the target wrote at the same positions


@torch.no_grad()
def greedy_continuation(target: TargetModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with a KV cache; returns prompt + continuation ids."""
    device = target.device
    ids = torch.tensor([prompt_ids], device=device)
    out = target(ids, use_cache=True, logits_to_keep=1)
    seq = list(prompt_ids)
    eos = getattr(target.tokenizer, "eos_token_id", None) if target.tokenizer is not None else None
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
        out = target(torch.tensor([[nxt]], device=device), past_key_values=out.past_key_values, logits_to_keep=1)
    return seq


@torch.no_grad()
def proposals_along(
    target: TargetModel,
    drafter: Drafter,
    sequence: list[int],
    anchor_positions: list[int],
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[BlockView]:
    """One proposal per anchor position p (anchor token = sequence[p], context = positions < p)."""
    gamma = drafter.config.block_size
    ids = torch.tensor([sequence], device=target.device)
    features = target(ids, return_logits=False).features  # [1, S, m·d]
    generator = torch.Generator(device=target.device).manual_seed(seed)
    views = []
    for p in anchor_positions:
        if not 1 <= p < len(sequence):
            raise ValueError(f"anchor position {p} outside the sequence (1..{len(sequence) - 1})")
        tokens = {"input_ids": ids[:, :p]} if getattr(drafter, "reads_tokens", False) else {}  # Eagle3
        prop = drafter.propose_from_features(features[:, :p], ids[:, p], temperature=temperature, generator=generator,
                                             **tokens)
        views.append(
            BlockView(
                anchor_position=p,
                anchor_token=sequence[p],
                draft_tokens=prop.tokens[0].tolist(),
                confidences=None if prop.confidences is None else prop.confidences[0].tolist(),
                target_tokens=sequence[p + 1 : p + 1 + gamma],
            )
        )
    return views
