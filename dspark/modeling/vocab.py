"""The draft vocabulary: k target ids a drafter predicts over, shared by every drafter.

- `DraftVocab`: the k ids and their `d2t` / `t2d` tables (EAGLE-3's conventions), the restriction
  of the target distribution to them for the loss (`restrict`, `restrict_logits`), the way back to
  the full vocabulary for decoding (`to_target`), and a vocabulary file (`save`, `load`).
- `register_vocab_buffers`: the vocabulary as a drafter's `d2t` / `t2d` buffers.

A drafter (DSpark, DFlash, Eagle3) evaluates its LM head on the target's k rows only (frozen), so
every vocabulary-sized product costs k/V of the full one. The conventions, the training rule and
why decoding stays exactly lossless: docs/method.md, "The draft vocabulary".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

VOCAB_CONFIG_FIELD = "draft_vocab_size"


class DraftVocab:
    """k draft ids over a target vocabulary of V ids. ``draft_ids`` Long [k]: the target ids,
    strictly increasing; draft id i is target id draft_ids[i]."""

    def __init__(self, draft_ids: Tensor, vocab_size: int) -> None:
        ids = torch.as_tensor(draft_ids).detach().to("cpu", torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one id; drafter.draft_vocab_size=0 means the full vocabulary")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("draft ids must be strictly increasing target ids (sorted, no repeats)")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(f"draft ids must lie in [0, {vocab_size}) (the target vocabulary), got "
                             f"[{int(ids[0])}, {int(ids[-1])}]")
        self.vocab_size = int(vocab_size)
        self.draft_ids = ids  # [k]
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target_ids(cls, ids: Tensor | list[int], vocab_size: int) -> "DraftVocab":
        """The vocabulary of these target ids (any order, repeats allowed)."""
        return cls(torch.unique(torch.as_tensor(ids, dtype=torch.long)), vocab_size)

    @classmethod
    def from_counts(cls, counts: Tensor, k: int) -> "DraftVocab":
        """The k ids of largest count (counts [V], hard or soft), ties broken towards the lower id,
        sorted by id. k larger than V is an error; ids of count 0 fill up by id if needed."""
        counts = torch.as_tensor(counts).detach().to("cpu", torch.float64).reshape(-1)
        V = counts.numel()
        if not 1 <= k <= V:
            raise ValueError(f"draft_vocab_size={k} must lie in [1, {V}] (the target vocabulary)")
        # A stable sort by descending count keeps ascending ids among equal counts.
        order = torch.sort(-counts, stable=True).indices
        return cls(torch.sort(order[:k]).values, V)

    @classmethod
    def from_d2t(cls, d2t: Tensor, vocab_size: int) -> "DraftVocab":
        """Back from the stored offsets: draft_ids = arange(k) + d2t."""
        d2t = torch.as_tensor(d2t).detach().to("cpu", torch.long).reshape(-1)
        return cls(torch.arange(d2t.numel()) + d2t, vocab_size)

    # ------------------------------------------------------------------ views
    @property
    def size(self) -> int:
        """k, the number of draft ids."""
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> Tensor:
        """Long [k]: target id = draft id + d2t[draft id]."""
        return self.draft_ids - torch.arange(self.size)

    @property
    def t2d(self) -> Tensor:
        """Bool [V]: True at the target ids in the vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.draft_ids] = True
        return mask

    def _tables(self, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """(draft_ids [k], target -> draft index [V], −1 outside) on ``device``, kept per device."""
        device = torch.device(device)
        if device not in self._on:
            index = torch.full((self.vocab_size,), -1, dtype=torch.long)
            index[self.draft_ids] = torch.arange(self.size)
            self._on[device] = (self.draft_ids.to(device), index.to(device))
        return self._on[device]

    def to_target_ids(self, draft: Tensor) -> Tensor:
        """Draft ids (any shape) -> target ids."""
        return self._tables(draft.device)[0][draft]

    def to_draft_ids(self, target: Tensor) -> Tensor:
        """Target ids (any shape) -> draft ids, −1 where the id lies outside the vocabulary."""
        return self._tables(target.device)[1][target]

    def contains(self, target: Tensor) -> Tensor:
        """Bool, same shape as the target ids: in the vocabulary."""
        return self.to_draft_ids(target) >= 0

    # ------------------------------------------------------------------ distributions
    def _check_last(self, x: Tensor, size: int, name: str) -> None:
        if x.shape[-1] != size:
            raise ValueError(f"{name} must have {size} entries in its last dimension, got shape {tuple(x.shape)}")

    def restrict(self, target_probs: Tensor) -> tuple[Tensor, Tensor]:
        """EAGLE-3's restriction of target probabilities [..., V] to the vocabulary.

        Returns (probs [..., k] renormalised over the k ids, keep Bool [...]); keep is False
        where the target's argmax (over all V ids, lowest id on ties) lies outside the
        vocabulary: EAGLE-3 drops those positions from the loss. A row with no mass inside
        is returned as zeros (and is dropped, its argmax being outside)."""
        self._check_last(target_probs, self.vocab_size, "target_probs")
        ids, _ = self._tables(target_probs.device)
        inside = target_probs.index_select(-1, ids)  # [..., k]
        total = inside.sum(-1, keepdim=True)
        probs = torch.where(total > 0, inside / total.clamp_min(torch.finfo(inside.dtype).tiny), torch.zeros_like(inside))
        return probs, self.contains(target_probs.argmax(-1))

    def restrict_logits(self, target_logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`restrict` on logits [..., V], in log space: (log p^t restricted and renormalised
        [..., k], keep Bool [...], log of the target's mass inside the vocabulary [...])."""
        self._check_last(target_logits, self.vocab_size, "target_logits")
        ids, _ = self._tables(target_logits.device)
        inside = target_logits.index_select(-1, ids)  # [..., k]
        log_in = torch.logsumexp(inside, -1)
        log_mass_in = log_in - torch.logsumexp(target_logits, -1)
        return inside - log_in.unsqueeze(-1), self.contains(target_logits.argmax(-1)), log_mass_in

    def to_target(self, draft: Tensor, fill: float = 0.0) -> Tensor:
        """Draft probabilities (or logits) [..., k] -> [..., V] with ``fill`` outside the vocabulary
        (0 for probabilities, −inf for logits)."""
        self._check_last(draft, self.size, "draft")
        ids, _ = self._tables(draft.device)
        out = draft.new_full((*draft.shape[:-1], self.vocab_size), fill)
        # scatter_ along the last dim: cheaper than index assignment there on a CPU thread
        # ([7, k] -> [7, V]), and a drafting round does it twice
        return out.scatter_(-1, ids.expand(draft.shape), draft)

    def head_weight(self, target_lm_head_weight: Tensor) -> Tensor:
        """The target LM head's rows [k, d] for the draft ids (a frozen, detached gather)."""
        if target_lm_head_weight.shape[0] != self.vocab_size:
            raise ValueError(f"the LM head has {target_lm_head_weight.shape[0]} rows, the vocabulary is over {self.vocab_size}")
        ids, _ = self._tables(target_lm_head_weight.device)
        return target_lm_head_weight.detach().index_select(0, ids)

    def coverage(self, counts: Tensor) -> float:
        """Share of the mass of counts [V] (hard or soft) that lies on the vocabulary."""
        counts = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
        self._check_last(counts, self.vocab_size, "counts")
        total = float(counts.sum())
        return float(counts[self.draft_ids].sum()) / total if total > 0 else 0.0

    # ------------------------------------------------------------------ files
    def state(self) -> dict[str, Tensor]:
        """{"d2t": Long [k], "t2d": Bool [V]}: the tensors a checkpoint stores under these names."""
        return {"d2t": self.d2t, "t2d": self.t2d}

    @classmethod
    def from_state(cls, state: dict[str, Tensor], vocab_size: int | None = None) -> "DraftVocab":
        """From stored ``d2t`` (and ``t2d``, checked against it when present)."""
        if "d2t" not in state:
            raise ValueError("no d2t tensor: the file holds no draft vocabulary")
        V = int(state["t2d"].numel()) if "t2d" in state else vocab_size
        if V is None:
            raise ValueError("no t2d tensor and no vocab_size given: the target vocabulary size is unknown")
        vocab = cls.from_d2t(state["d2t"], V)
        if "t2d" in state and not torch.equal(state["t2d"].to("cpu", torch.bool), vocab.t2d):
            raise ValueError("t2d does not mark the ids d2t maps to: the draft vocabulary file is inconsistent")
        return vocab

    def save(self, path: str | os.PathLike, info: dict[str, Any] | None = None) -> Path:
        """Write ``path`` (safetensors: d2t, t2d) and ``path`` with suffix .json ({draft_vocab_size,
        vocab_size} + ``info``, e.g. the counting mode and coverage)."""
        from safetensors.torch import save_file

        from dspark.io.atomic import atomic_write_text

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(self.state(), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        meta = {VOCAB_CONFIG_FIELD: self.size, "vocab_size": self.vocab_size, **(info or {})}
        atomic_write_text(path.with_suffix(".json"), json.dumps(meta, indent=2))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DraftVocab":
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"draft vocabulary {path} not found: write it with `dspark vocab --config ...`")
        return cls.from_state(load_file(str(path)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftVocab) and other.vocab_size == self.vocab_size and torch.equal(other.draft_ids, self.draft_ids)

    def __repr__(self) -> str:
        return f"DraftVocab(k={self.size}, V={self.vocab_size})"


def register_vocab_buffers(module: torch.nn.Module, draft_vocab_size: int, vocab_size: int) -> None:
    """The draft vocabulary as a drafter's state: integer buffers ``d2t`` / ``t2d`` (saved as the
    top-level tensors vLLM reads; ``.to(dtype)`` leaves them alone and no optimizer sees them),
    holding the first k ids until ``set_vocab()`` gives the counted vocabulary. k = 0: none."""
    if draft_vocab_size:
        first = DraftVocab(torch.arange(draft_vocab_size), vocab_size)
        module.register_buffer("d2t", first.d2t)
        module.register_buffer("t2d", first.t2d)
