"""How many requests a batched evaluation decodes together (``dspark eval --batch-size auto``).

The rule (both functions): the largest R in 1, 2, 4, ... ≤ ``max_rows`` such that each doubling up to it
raises the throughput of full rounds, R / (seconds of one verification forward of R rows, each
verifying x_0 and γ drafts), by at least ``MIN_GAIN`` (10 %): past that point more rows only make each
round slower. Never more than the requests there are.

Two ways to price the forward of R rows:

- ``measured_batch_size`` times the batched engine's own forward on the device (``dspark eval``'s
  default): R rows × (1 + γ) tokens on the batch's column cache, every row as wide as the expected
  longest of R prompts plus half the new tokens (a batch's rows are as wide as its longest one), so the
  attention over R caches is paid as the engine pays it (``profile_sps_runs(rows=R)``).
- ``auto_batch_size`` reads an SPS table (one sequence of B tokens, paper Section 3.2.2) at
  B = R (1 + γ). A single-sequence table leaves out the attention over R caches, so it overrates
  large R where the context is long; it serves where the target cannot be run (a table profiled on
  another machine), and without a table gives ``DEFAULT_ROWS`` of the device type.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_ROWS", "MIN_GAIN", "auto_batch_size", "measured_batch_size", "pick_rows"]

DEFAULT_ROWS = {"cpu": 8, "cuda": 64}  # auto_batch_size without an SPS table
MIN_GAIN = 1.1  # a doubling of R must raise the round throughput by at least this factor
MEASURE_WARMUP, MEASURE_REPEATS = 1, 3  # forwards per R: untimed, then timed (the median counts)


def pick_rows(throughput: Callable[[int], float], max_rows: int = 128) -> int:
    """The rule of the module docstring on ``throughput(R)`` (NaN: R cannot be priced, the search ends)."""
    rows = 1
    now = throughput(1)
    while rows * 2 <= max_rows:
        doubled = throughput(rows * 2)
        if not (math.isfinite(doubled) and doubled >= MIN_GAIN * now):
            break
        rows, now = rows * 2, doubled
    return rows


def auto_batch_size(sps: Any, gamma: int, device: torch.device | str = "cpu", *, max_rows: int = 128,
                    requests: int | None = None) -> int:
    """The rule on the SPS table ``sps``: round throughput R · SPS(R · (1 + γ)). A table that stops
    before R · (1 + γ) ends the search there. Without a table: ``DEFAULT_ROWS`` of the device type.
    Never more than ``requests`` (when given)."""
    if sps is None:
        rows = DEFAULT_ROWS.get(torch.device(device).type, 8)
    else:
        def throughput(r: int) -> float:
            tokens = r * (1 + gamma)
            return math.nan if tokens > sps.max_batch_tokens else r * float(sps(tokens))

        rows = pick_rows(throughput, max_rows)
    return rows if requests is None else max(1, min(rows, requests))


def measured_batch_size(target: Any, prompt_lengths: Sequence[int], gamma: int, max_new_tokens: int, *,
                        max_rows: int = 128, seed: int = 0) -> tuple[int, dict[int, float]]:
    """The rule on the engine's own forward, timed here: returns (R, {R: round throughput measured}).

    For each R the search reaches: ``profile_sps_runs(rows=R)`` times R rows × (1 + γ) tokens after
    ``expected_longest(prompt_lengths, R) + max_new_tokens / 2`` cached per row (``MEASURE_WARMUP``
    untimed forwards, the median of ``MEASURE_REPEATS``); throughput = R / that median. R never
    exceeds the number of prompts. Running out of accelerator memory at some R ends the search there."""
    from dspark.scheduling.sps_profile import expected_longest, profile_sps_runs

    lengths = [int(n) for n in prompt_lengths]
    if not lengths:
        raise ValueError("measured_batch_size needs the prompt lengths of the requests to decode")
    measured: dict[int, float] = {}

    def width(rows: int) -> int:
        return int(round(expected_longest(lengths, rows) + max_new_tokens / 2))

    shared = _shared_context(target, width(min(max_rows, len(lengths))), seed)

    def throughput(rows: int) -> float:
        if rows > len(lengths):
            return math.nan
        try:
            profile = profile_sps_runs(target, [rows * (1 + gamma)], context_len=width(rows), warmup=MEASURE_WARMUP,
                                       repeats=MEASURE_REPEATS, rows=rows, seed=seed, context=shared)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return math.nan
        measured[rows] = rows / float(profile.median_s[0])
        return measured[rows]

    return pick_rows(throughput, max_rows), measured


def _shared_context(target: Any, length: int, seed: int) -> Any:
    """One batch-1 cache of ``length`` random tokens that every R's profile crops and copies (one
    prefill for the whole search), or None where a cache cannot be cropped back to its first positions
    (sliding-window layers): each R then prefills its own."""
    if not hasattr(target, "new_cache") or length < 1:
        return None
    cache = target.new_cache()
    ids = torch.randint(0, int(target.vocab_size), (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # not inference tensors: the profile's caches are written outside inference mode
        target(ids.to(target.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        return None  # a sliding window's positions are not the first ``length`` ones
    try:
        target.crop_cache(copy.deepcopy(cache), 1)
    except (ValueError, RuntimeError):
        return None
    return cache
