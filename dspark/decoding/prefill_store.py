"""Prompt prefills kept for reuse by later decodes of the same prompt on the same target.

An evaluation decodes every prompt twice (speculatively, then with the target alone), and a serving
run decodes the same prompts under every policy and R. Each decode starts with the same forward: the
target over the prompt, from an empty cache (``_prefill`` of ``dspark.decoding.batched`` and of
``dspark.decoding.loop``). A ``PrefillStore`` keeps what that forward returned (the batch-1 cache,
the last position's logits and the captured features) with the seconds it took, so that a later
decode of the same prompt starts from it instead of running it again. The reused decode draws x_0
from the kept logits with its own generator (the same draw as from a fresh forward) and is charged
the kept seconds as its prefill: the time of that very forward, measured when it ran. Nothing a
decode does writes into a kept prefill (``BatchKVCache.write_row`` copies it into the batch, a
batch-1 decode extends a copy of its own; the drafter reads the features).

The store holds at most ``max_bytes`` of tensors (caches, features, logits) on the target's device;
a prefill that does not fit is not kept, and its prompt is prefilled again when it comes back. A
store lives as long as the decodes that share it (an evaluation's request at batch 1 or wave at R > 1,
a serving run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEFAULT_MAX_BYTES", "KeptPrefill", "PrefillStore"]

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of kept prefills per store


@dataclass(frozen=True)
class KeptPrefill:
    """One prompt's prefill: the batch-1 cache, the forward's output (last-position logits [1, 1, V],
    features) and the seconds the forward (with its x_0 draw) took."""

    cache: Any
    out: Any
    seconds: float
    nbytes: int


class PrefillStore:
    """Prefills by (target, prompt ids), up to ``max_bytes`` (module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0 (bytes of kept prefills), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = 0
        self._kept: dict[tuple[int, tuple[int, ...]], KeptPrefill] = {}

    def __len__(self) -> int:
        return len(self._kept)

    @staticmethod
    def _key(target: Any, prompt_ids: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        return id(target), tuple(int(t) for t in prompt_ids)

    def get(self, target: Any, prompt_ids: Sequence[int]) -> KeptPrefill | None:
        """The kept prefill of ``prompt_ids`` on ``target`` (kept for later calls), or None."""
        kept = self._kept.get(self._key(target, prompt_ids))
        self._count(kept)
        return kept

    def put(self, target: Any, prompt_ids: Sequence[int], cache: Any, out: Any, seconds: float) -> bool:
        """Keep a prefill if it fits in what is left of ``max_bytes``; returns whether it was kept."""
        key = self._key(target, prompt_ids)
        if key in self._kept:
            return True
        nbytes = _nbytes(cache, out)
        if self.nbytes + nbytes > self.max_bytes:
            return False
        self._kept[key] = KeptPrefill(cache, out, float(seconds), nbytes)
        self.nbytes += nbytes
        return True

    def _count(self, kept: KeptPrefill | None) -> None:
        if kept is None:
            self.misses += 1
        else:
            self.hits += 1


def _nbytes(cache: Any, out: Any) -> int:
    """Bytes of the cache's keys and values and of the output's tensors."""
    tensors = []
    for layer in getattr(cache, "layers", ()):
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    for name in ("logits", "features", "last_hidden"):
        value = getattr(out, name, None)
        tensors += list(value) if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
