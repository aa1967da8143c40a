"""Training samples for the trainer: from a target cache, or rendered token ids for online mode.

Every source follows :class:`SampleSource` (the format, documented there): dicts with
`input_ids` Long[S] and `loss_mask` Long[S]; cached samples also carry `features` [S, m·d]
and `final_hidden` [S, d] (online mode computes those with the target inside the training
step). :func:`check_sample_source` names what a sample lacks before training starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from dspark.data.render import RenderedSample
from dspark.io.atomic import atomic_file


class SampleSource(Protocol):
    """What the trainer reads: ``len(source)`` samples; ``source[i]`` is a dict of tensors for one
    sequence of S tokens:

    - ``input_ids``: Long [S], the rendered token ids, prompt and answer (``dspark.render_conversation``);
    - ``loss_mask``: Long or Bool [S], 1 on the supervised (assistant) tokens, 0 elsewhere;
    - ``features`` [S, m·d] and ``final_hidden`` [S, d], optional and together: the target's hidden
      states at its m captured layers and its final hidden state, as a feature cache stores them;
      without them the trainer runs the target on ``input_ids`` inside the step.

    Any other key is right-padded and carried along (a cache's ``has_final``). A source may also
    have ``lengths()``: the S of every sample without reading them (length bucketing).
    """

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Tensor]: ...


# The keys every sample must have, and what each holds (SampleSource).
SAMPLE_KEYS = {
    "input_ids": "Long [S], the rendered token ids of the sequence (prompt and answer)",
    "loss_mask": "[S], 1 on the supervised (assistant) tokens and 0 elsewhere",
}


def check_sample_source(source: SampleSource, name: str = "the training data", *, feature_width: int | None = None,
                        hidden_size: int | None = None) -> None:
    """ValueError naming the key that sample 0 of ``source`` lacks (or the shape that is wrong) and
    what it should hold (:class:`SampleSource`); ``feature_width`` (m·d) and ``hidden_size`` (d)
    check cached features. Reads one sample; an empty source passes."""
    if len(source) == 0:
        return
    item = source[0]
    if not hasattr(item, "keys"):
        raise ValueError(f"{name}: sample 0 is a {type(item).__name__}, not a dict of tensors with "
                         f"{' and '.join(SAMPLE_KEYS)} (dspark.data.dataset.SampleSource)")
    for key, what in SAMPLE_KEYS.items():
        if key not in item:
            raise ValueError(f"{name}: sample 0 has no {key!r} (its keys: {sorted(item.keys())}); every sample "
                             f"needs {key!r}: {what} (dspark.data.dataset.SampleSource)")
    ids, mask = torch.as_tensor(item["input_ids"]), torch.as_tensor(item["loss_mask"])
    if ids.dim() != 1 or mask.shape != ids.shape:
        raise ValueError(f"{name}: sample 0 has input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)}; "
                         "both must be [S], one sequence per sample (the trainer batches them)")
    if ("features" in item) != ("final_hidden" in item):
        missing = "final_hidden" if "features" in item else "features"
        raise ValueError(f"{name}: sample 0 has no {missing!r}; cached samples carry both 'features' [S, m·d] "
                         "(the target's captured layers) and 'final_hidden' [S, d] (its final hidden state), "
                         "online ones neither")
    if "features" in item:
        S = ids.shape[0]
        for key, width in (("features", feature_width), ("final_hidden", hidden_size)):
            shape = tuple(torch.as_tensor(item[key]).shape)
            if width is not None and shape != (S, width):
                raise ValueError(f"{name}: sample 0 has {key} {shape}, the drafter reads [S, {width}] = "
                                 f"[{S}, {width}]: the cache was written for another target or other layers")


def sample_lengths(source: SampleSource) -> Tensor:
    """Long [N]: tokens per sample of ``source``, from its ``lengths()`` when it has one (no
    features read), else from each sample's ``input_ids``."""
    lengths = getattr(source, "lengths", None)
    if lengths is not None:  # a method (the sources here) or a property (TargetCache)
        return torch.as_tensor(lengths() if callable(lengths) else lengths, dtype=torch.long)
    return torch.tensor([int(source[i]["input_ids"].shape[0]) for i in range(len(source))], dtype=torch.long)


class RenderedSource:
    """Rendered (input_ids, loss_mask) samples; the target runs online in the training step."""

    def __init__(self, samples: Sequence[RenderedSample]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        s = self.samples[i]
        return {
            "input_ids": torch.tensor(s.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(s.loss_mask, dtype=torch.long),
        }


class CachedSource:
    """Samples of a `dspark.data.cache.TargetCache` (features precomputed, dequantized on read)."""

    def __init__(self, cache: Any, indices: Sequence[int] | None = None) -> None:
        self.cache = cache
        self.indices = list(range(len(cache))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> Tensor:
        return torch.as_tensor(self.cache.lengths, dtype=torch.long)[torch.as_tensor(self.indices, dtype=torch.long)]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        item = self.cache[self.indices[i]]
        return {k: torch.as_tensor(v) for k, v in item.items()}


def save_rendered(samples: Sequence[RenderedSample], path: str | os.PathLike) -> None:
    """Write rendered samples as jsonl atomically ({"input_ids": [...], "loss_mask": [...]} per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"input_ids": list(s.input_ids), "loss_mask": list(s.loss_mask)}) + "\n")


def load_rendered(path: str | os.PathLike) -> list[RenderedSample]:
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if len(row["input_ids"]) != len(row["loss_mask"]):
                raise ValueError(f"{path}:{line_no}: input_ids and loss_mask lengths differ")
            out.append(RenderedSample(input_ids=row["input_ids"], loss_mask=row["loss_mask"]))
    return out


def collate(items: list[dict[str, Tensor]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-pad a micro-batch to its longest sample (padding has loss_mask 0, features 0)."""
    S = max(int(it["input_ids"].shape[0]) for it in items)
    out: dict[str, Tensor] = {}
    for key in items[0]:
        rows = []
        for it in items:
            t = it[key]
            pad = S - t.shape[0]
            if pad:
                fill = pad_id if key == "input_ids" else 0
                t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)], dim=0)
            rows.append(t)
        out[key] = torch.stack(rows)
    return out


def bucketed_order(
    perm: Tensor, lengths: Tensor, unit: int, window: int, head: int, generator: torch.Generator
) -> Tensor:
    """A permutation of the same samples as ``perm`` whose consecutive groups of ``unit`` have
    similar lengths, so that a micro-batch of ``unit`` samples pads little.

    The first ``head`` samples of ``perm`` stay first (they complete the micro-batch that an
    epoch not starting on a micro-batch boundary shares with the previous epoch). The rest of
    ``perm`` (a random order) is cut into windows of ``window`` samples (a multiple of
    ``unit``); each window is sorted by length (stable) and cut into groups of ``unit``; the
    full groups are shuffled over the whole epoch with ``generator``. A micro-batch thus holds
    a random window's run of similar lengths, and a global batch a random set of such runs.
    Returns Long [N], a permutation of ``perm``.
    """
    n = perm.numel()
    if unit <= 1 or n <= 1:  # a micro-batch of one sample has no padding
        return perm.clone()
    head = min(head, n)
    first, rest = perm[:head], perm[head:]
    rlen = lengths[rest]
    win = torch.arange(rest.numel()) // max(unit, window - window % unit)
    # Stable sort on (window, length): each window's samples in ascending length.
    key = win * (int(rlen.max()) + 1 if rlen.numel() else 1) + rlen
    ordered = rest[torch.sort(key, stable=True).indices]
    n_full = ordered.numel() // unit
    groups = ordered[: n_full * unit].view(n_full, unit)
    shuffled = groups[torch.randperm(n_full, generator=generator)].reshape(-1)
    return torch.cat([first, shuffled, ordered[n_full * unit :]])


def padding_share(lengths: Sequence[int] | Tensor, unit: int) -> float:
    """Share of padding among the tokens of consecutive micro-batches of ``unit`` samples taken
    in the given order, each right-padded to its longest sample (what `collate` does)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    padded = sum(int(c.max()) * c.numel() for c in lengths.split(unit))
    return 1.0 - int(lengths.sum()) / max(1, padded)
