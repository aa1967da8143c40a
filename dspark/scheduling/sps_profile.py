"""SPS profiling: the target's verification speed SPS(B) at B batch tokens (paper Section 3.2.2).

What is measured: one verification forward of the target (``TargetModel.forward``,
feature capture and the LM head over every new position included, exactly
what ``SpeculativeRequest.verify`` runs) over B new tokens that continue a KV
cache already holding ``context_len`` tokens, on the target's current device.
Two layouts of the B tokens:

- ``tokens_per_request=None`` (default): one sequence of B tokens continuing
  one cache (the cheapest to set up; attention reads one context);
- ``tokens_per_request=q``: B / q rows of q tokens (q = 1 + ℓ), each row
  continuing its own cache of ``context_len`` tokens, the way a serving batch
  of B / q requests looks (attention reads B / q contexts). B must then be a
  multiple of q; other sizes are skipped.

Each B gets ``warmup`` untimed forwards, then ``repeats`` timed ones (the
cache is cropped back to ``context_len`` after each, outside the timing; on
CUDA the device is synchronised around each timed forward). SPS(B) = 1 /
median seconds; the table made from them is noise-aware (``SPSProfile.table``):
a rise of SPS with B no larger than the spread of the repeats is flattened, so
noise never makes a larger verification batch look cheaper. Token ids are
random (speed does not depend on them).

``profile_sps`` returns the ``SPSTable`` (SGLang's ``{sample_batch_tokens,
sample_steps_per_sec, max_batch_tokens}``); ``profile_sps_runs`` also keeps
every timing; ``dspark.evaluation.report.write_profile`` writes the table JSON, a
``.profile.json`` with the timings and settings next to it, and a PNG of
steps/s and tokens/s against B (``dspark.evaluation.plots.plot_sps``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dspark.scheduling.algorithm1 import SPSTable

__all__ = ["DEFAULT_BATCH_TOKENS", "SPSProfile", "profile_sps", "profile_sps_runs"]

DEFAULT_BATCH_TOKENS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class SPSProfile:
    """A profiling run: the table plus what it was measured from.

    batch_tokens: the B measured (increasing); seconds: per B, the timed forwards (s);
    median_s: per B, their median; steps_per_sec = 1 / median_s; steps_per_sec_spread: per B,
    the range (max − min) of the speeds 1 / seconds of the repeats.
    ``table``: the noise-aware SPS table (``SPSTable.noise_aware``): steps_per_sec with
    every rise in B that lies within the repeats' spread flattened away, the spread carried.
    """

    batch_tokens: list[int]
    seconds: list[list[float]]
    median_s: list[float]
    context_len: int
    tokens_per_request: int | None
    warmup: int
    repeats: int
    device: str
    dtype: str
    threads: int

    @property
    def steps_per_sec(self) -> list[float]:
        return [1.0 / s for s in self.median_s]

    @property
    def steps_per_sec_spread(self) -> list[float]:
        return [1.0 / min(s) - 1.0 / max(s) for s in self.seconds]

    @property
    def table(self) -> SPSTable:
        return SPSTable(self.batch_tokens, self.steps_per_sec, max(self.batch_tokens),
                        sample_spread=self.steps_per_sec_spread).noise_aware()


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _sizes_to_measure(
    batch_tokens: Sequence[int], context_len: int, warmup: int, repeats: int, tokens_per_request: int | None
) -> list[int]:
    """Check the settings; the B to measure, increasing, without repeats (with
    ``tokens_per_request=q``, only the multiples of q)."""
    sizes = sorted({_check_int(b, "batch_tokens entries", 1) for b in batch_tokens})
    if not sizes:
        raise ValueError("batch_tokens is empty; give the batch token counts to measure, e.g. 1 2 4 8 16")
    _check_int(context_len, "context_len", 0)
    _check_int(warmup, "warmup", 0)
    _check_int(repeats, "repeats", 1)
    if tokens_per_request is not None:
        q = _check_int(tokens_per_request, "tokens_per_request", 1)
        kept = [b for b in sizes if b % q == 0]
        if not kept:
            raise ValueError(
                f"no batch size in {sizes} is a multiple of tokens_per_request={q}; "
                f"with q tokens per request measure B = q, 2q, 4q, ..."
            )
        sizes = kept
    return sizes


def _time_forwards(
    target: Any,
    cache: Any,
    new_tokens: Callable[[], torch.Tensor],
    context_len: int,
    warmup: int,
    repeats: int,
    sync: Callable[[], None],
) -> list[float]:
    """``warmup`` untimed, then ``repeats`` timed verification forwards of ``new_tokens()``
    continuing ``cache``, cropped back to ``context_len`` after each: the timed seconds."""
    samples = []
    for i in range(warmup + repeats):
        x = new_tokens()
        sync()
        start = time.perf_counter()
        target(x, past_key_values=cache, use_cache=True)  # logits at every new position, as verify
        sync()
        elapsed = time.perf_counter() - start
        target.crop_cache(cache, context_len)
        if i >= warmup:
            samples.append(elapsed)
    return samples


@torch.no_grad()
def profile_sps_runs(
    target: Any,
    batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS,
    *,
    context_len: int = 512,
    warmup: int = 2,
    repeats: int = 5,
    tokens_per_request: int | None = None,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> SPSProfile:
    """Time the verification forward at every B of ``batch_tokens`` (see the module docstring).

    ``progress(B, median_seconds)`` is called after each B."""
    sizes = _sizes_to_measure(batch_tokens, context_len, warmup, repeats, tokens_per_request)
    device = torch.device(target.device)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(target.vocab_size)

    def ids(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, length), generator=gen).to(device)  # [rows, length]

    seconds: list[list[float]] = []
    cache, cache_rows = None, 0
    for b in sizes:
        rows, width = (1, b) if tokens_per_request is None else (b // tokens_per_request, tokens_per_request)
        if cache is None or cache_rows != rows:
            cache, cache_rows = target.new_cache(), rows
            if context_len > 0:
                target(ids(rows, context_len), past_key_values=cache, use_cache=True, logits_to_keep=1)
        samples = _time_forwards(target, cache, partial(ids, rows, width), context_len, warmup, repeats, sync)
        seconds.append(samples)
        if progress is not None:
            progress(b, statistics.median(samples))
    return SPSProfile(
        batch_tokens=sizes,
        seconds=seconds,
        median_s=[statistics.median(s) for s in seconds],
        context_len=context_len,
        tokens_per_request=tokens_per_request,
        warmup=warmup,
        repeats=repeats,
        device=str(device),
        dtype=str(getattr(target, "dtype", "")).replace("torch.", ""),
        threads=torch.get_num_threads(),
    )


def profile_sps(target: Any, batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, **settings: Any) -> SPSTable:
    """SPS(B) table of ``target`` on its current device: steps/s = 1 / median seconds of one
    verification forward over B tokens after ``context_len`` cached tokens, rises within
    the repeats' spread flattened (module docstring).

    ``settings``: the keyword arguments of :func:`profile_sps_runs` (context_len, warmup,
    repeats, tokens_per_request, seed)."""
    return profile_sps_runs(target, batch_tokens, **settings).table


