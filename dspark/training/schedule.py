"""What each training step trains on and how fast: the data schedule, the anchors of a sample,
AdamW and its learning-rate schedule (dspark.training.trainer runs them).

The global batch of step s is a fixed list of sample indices (a per-epoch permutation seeded by
config.seed, length-bucketed by micro-batch unless train.bucketing is off: `Schedule`); rank r
takes its contiguous slice and walks it in micro-batches. Anchors of a sample are drawn from a
generator seeded by (seed, epoch, sample index) (`anchors_for`), so they do not depend on how the
batch is split over ranks or micro-batches. The optimizer step alone thus fixes the data position
of a resumed run (dspark.training.checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from dspark.data.anchors import sample_anchors
from dspark.data.dataset import bucketed_order
from dspark.seeds import derive_seed


@dataclass
class Schedule:
    """Which samples each step trains on: epoch e is a permutation of the N samples seeded by
    (seed, e), read as one endless stream cut into global batches of ``global_batch``.

    With ``lengths`` (bucketing), each epoch's permutation is reordered by
    ``dspark.data.dataset.bucketed_order`` so that every micro-batch of ``micro_batch``
    samples holds similar lengths: the samples of an epoch, their anchors and their losses
    are unchanged, only which samples share a micro-batch (and a step) changes. The order is
    a function of (seed, epoch, lengths, micro_batch, bucket_window) alone: resume stays exact
    and ranks agree on it without communicating.
    """

    num_samples: int
    global_batch: int
    world: int
    rank: int
    seed: int
    total_steps: int
    micro_batch: int = 1
    lengths: Tensor | None = None  # Long [N]; None = no bucketing
    bucket_window: int = 64  # micro-batches per length-sorting window

    def __post_init__(self) -> None:
        self._perms: dict[int, Tensor] = {}

    def epoch_perm(self, epoch: int) -> Tensor:
        if epoch in self._perms:
            return self._perms[epoch]
        g = torch.Generator().manual_seed(derive_seed(self.seed, 0, epoch))
        perm = torch.randperm(self.num_samples, generator=g)
        if self.lengths is not None:
            # The first micro-batch boundary inside epoch e (the stream does not restart at one).
            head = (-epoch * self.num_samples) % self.micro_batch
            perm = bucketed_order(perm, self.lengths, self.micro_batch, self.bucket_window * self.micro_batch, head, g)
        self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # keep the current two
        self._perms[epoch] = perm
        return perm

    def step_samples(self, step: int) -> list[tuple[int, int]]:
        """(epoch, sample index) of this rank's share of the global batch of `step`."""
        per_rank = self.global_batch // self.world
        start = step * self.global_batch + self.rank * per_rank
        out = []
        for g in range(start, start + per_rank):
            epoch, pos = divmod(g, self.num_samples)
            out.append((epoch, int(self.epoch_perm(epoch)[pos])))
        return out


def anchors_for(loss_mask: Tensor, num_anchors: int, seed: int, epoch: int, index: int) -> tuple[Tensor, Tensor]:
    """Anchors of one sample, independent of batching and ranks. loss_mask [S] -> ([A], [A])."""
    g = torch.Generator().manual_seed(derive_seed(derive_seed(0, seed, epoch), 0, index))
    anchors, keep = sample_anchors(loss_mask.unsqueeze(0).cpu(), num_anchors, generator=g)
    return anchors[0], keep[0]


def make_adamw(params: Any, lr: float, weight_decay: float, device: torch.device, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with the fused kernel where torch has one for the device: one
    pass over each parameter instead of a dozen foreach passes over all of them, the same update
    to rounding (bench/train_step.py ``optimizer`` times both on drafters up to SmolLM2's size). FSDP's
    sharded parameters on a CPU keep the foreach path."""
    fused = device.type == "cuda" or (device.type == "cpu" and not sharded)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=fused or None)
    except RuntimeError:  # a torch without the fused kernel for this device
        if not fused:
            raise
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    warmup = max(1, int(round(warmup_ratio * total_steps)))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f
