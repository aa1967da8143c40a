"""SPS profiling: the target's verification speed SPS(B) at B batch tokens (paper Section 3.2.2).

One verification forward of the target (what ``SpeculativeRequest.verify`` runs) over B new tokens
continuing a KV cache of ``context_len`` tokens, as one sequence or as B / q rows of q tokens
(``tokens_per_request``), timed in interleaved sweeps over every B so that a drifting machine slows
every B alike. SPS(B) = 1 / median seconds, each with its 95 % interval (``median_interval``); the
noise-aware table (``SPSProfile.table``) flattens rises within those intervals and is what a policy
decides with, the measured medians (``SPSProfile.measured_table``) are what the clock prices with.
``bootstrap_tables`` and ``table_interval`` carry the table's timing noise into a simulator run's ratio
to target-only decoding. ``profile_sps`` returns the ``SPSTable``; ``profile_sps_runs`` also keeps
every timing. The method and why: docs/scheduling.md, "SPS profiling".
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.scheduling.algorithm1 import SPSTable

__all__ = ["DEFAULT_BATCH_TOKENS", "SPSProfile", "bootstrap_tables", "expected_longest", "expected_order_statistics",
           "load_profile", "median_interval", "profile_path", "profile_sps", "profile_sps_runs", "table_interval"]

DEFAULT_BATCH_TOKENS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class SPSProfile:
    """A profiling run: the table plus what it was measured from.

    batch_tokens: the B measured (increasing); seconds: per B, the timed forwards (s), in
    the order of the sweeps (sweep i is repeat i of every B); median_s: per B, their median;
    steps_per_sec = 1 / median_s; steps_per_sec_interval: per B, the 95 % interval of that
    speed (``median_interval`` of the seconds, inverted); steps_per_sec_spread: its width.
    ``table``: the noise-aware SPS table (``SPSTable.noise_aware``): steps_per_sec with
    every rise in B that lies within the interval widths flattened away, the widths carried.
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
    rows: int | None = None  # B as `rows` rows of B / rows tokens (the batched serving loop's layout at R = rows)
    row_lengths: list[int] | None = None  # with rows: row r's cached tokens (None: context_len in every row)

    @property
    def steps_per_sec(self) -> list[float]:
        return [1.0 / s for s in self.median_s]

    @property
    def steps_per_sec_interval(self) -> list[tuple[float, float]]:
        out = []
        for s in self.seconds:
            lo, hi = median_interval(s)
            out.append((1.0 / hi, 1.0 / lo))
        return out

    @property
    def steps_per_sec_spread(self) -> list[float]:
        return [hi - lo for lo, hi in self.steps_per_sec_interval]

    @property
    def measured_table(self) -> SPSTable:
        """The measured medians as a table, no rise flattened: what the simulated clock charges."""
        return SPSTable(self.batch_tokens, self.steps_per_sec, max(self.batch_tokens),
                        sample_spread=self.steps_per_sec_spread)

    @property
    def table(self) -> SPSTable:
        """The measured table with rises within the timing noise flattened: what a policy decides with."""
        return self.measured_table.noise_aware()


def profile_path(table_path: str | os.PathLike) -> Path:
    """The ``.profile.json`` written next to a table JSON (``<stem>.profile.json``)."""
    table_path = Path(table_path)
    return table_path.with_name(table_path.stem + ".profile.json")


def load_profile(path: str | os.PathLike) -> SPSProfile:
    """The SPSProfile a ``.profile.json`` holds (``dspark.evaluation.report.write_profile``)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    names = [f.name for f in fields(SPSProfile)]
    optional = {f.name for f in fields(SPSProfile) if f.default is not MISSING}
    missing = [n for n in names if n not in data and n not in optional]
    if missing:
        raise ValueError(f"{path}: not an SPS profile (`dspark profile-sps` writes <table>.profile.json); "
                         f"missing {missing}")
    return SPSProfile(**{n: data[n] for n in names if n in data})


def bootstrap_tables(profile: SPSProfile, resamples: int = 1000, seed: int = 0,
                     noise_aware: bool = False) -> Iterator[SPSTable]:
    """``resamples`` tables drawn from the profile's timing noise: the ``repeats`` sweeps drawn with
    replacement, one draw per table shared by every B (sweep i timed repeat i of every B, so drift
    during the profile moves every B of a sweep together and the draw keeps that pairing), and per B
    the median of its timings in the drawn sweeps (as ``SPSProfile.measured_table``; with
    ``noise_aware``, then the noise-aware table with the profile's spreads, as ``SPSProfile.table``).
    Their spread is the table's uncertainty. Every B must hold ``profile.repeats`` timings."""
    uneven = [b for b, s in zip(profile.batch_tokens, profile.seconds) if len(s) != profile.repeats]
    if uneven:
        counts = {b: len(s) for b, s in zip(profile.batch_tokens, profile.seconds)}
        raise ValueError(f"SPSProfile.seconds: B = {uneven[0]} holds {counts[uneven[0]]} timings but repeats = "
                         f"{profile.repeats}; the sweeps are resampled jointly, so every B needs one timing per "
                         f"sweep (timings per B: {counts}): profile again with `dspark profile-sps`")
    rng = np.random.default_rng(seed)
    seconds = np.asarray(profile.seconds, dtype=float)  # [B, sweep]
    sweeps = rng.integers(0, profile.repeats, (resamples, profile.repeats))  # [resample, sweep drawn]
    speeds = 1.0 / np.median(seconds[:, sweeps], axis=2).T  # [B, resample, sweep] -> [resample, B]
    spread = profile.steps_per_sec_spread
    top = max(profile.batch_tokens)
    for row in speeds.tolist():
        table = SPSTable(profile.batch_tokens, row, top, sample_spread=spread)
        yield table.noise_aware() if noise_aware else table


def table_interval(result: Any, profile: SPSProfile, resamples: int = 1000, seed: int = 0,
                   level: float = 0.95, noise_aware: bool = False) -> tuple[float, float]:
    """The ``level`` percentile interval of a simulator run's ratio to target-only decoding over
    the SPS table's timing noise: ``result.priced_by(table)`` (every decision of the run kept) for
    each of ``bootstrap_tables(profile, resamples, seed, noise_aware)`` (``result.pricing()``: that
    price as a function). The default prices on measured tables, as the run priced on
    ``profile.measured_table``; ``noise_aware=True`` for a run priced on ``profile.table``."""
    price = result.pricing()
    ratios = np.array([price(table) for table in bootstrap_tables(profile, resamples, seed, noise_aware)])
    tail = (1.0 - level) / 2.0
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def median_interval(samples: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``samples``: (x_(k), x_(n+1−k)) of the
    sorted samples with the largest k whose coverage 1 − 2·P(Bin(n, ½) ≤ k − 1) is at
    least ``level`` (for any continuous distribution of independent repeats). With too
    few samples for that (n < 6 at 95 %) it is the whole range (min, max), whose coverage
    1 − 2^(1−n) is below ``level``."""
    xs = sorted(float(x) for x in samples)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one sample")
    k, tail = 0, 0.0  # tail = P(Bin(n, 1/2) <= k - 1)
    while k + 1 <= n // 2:
        next_tail = tail + math.comb(n, k) / 2.0 ** n
        if 1.0 - 2.0 * next_tail < level:
            break
        k, tail = k + 1, next_tail
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _sizes_to_measure(
    batch_tokens: Sequence[int], context_len: int, warmup: int, repeats: int, tokens_per_request: int | None,
    rows: int | None = None,
) -> list[int]:
    """Check the settings; the B to measure, increasing, without repeats (with
    ``tokens_per_request=q`` only the multiples of q, with ``rows=R`` only the multiples of R)."""
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
    if rows is not None:
        if tokens_per_request is not None:
            raise ValueError("give tokens_per_request (fixed tokens per row) or rows (fixed rows), not both")
        r = _check_int(rows, "rows", 1)
        sizes = [b for b in sizes if b % r == 0]
        if not sizes:
            raise ValueError(f"no batch size in {list(batch_tokens)} is a multiple of rows={r}; measure B = R, 2R, ...")
    return sizes


def _engine_rows(target: Any, single: Any, rows: int, extra: int, lengths: Sequence[int] | None = None) -> Any:
    """A ``BatchKVCache`` of ``rows`` rows, each holding the batch-1 cache ``single`` (row r only its
    first lengths[r] tokens), with room for forwards of ``extra`` tokens (the batched engine's own
    cache, as ``SpeculativeBatch`` fills it)."""
    from dspark.decoding.batch_state import BatchKVCache

    kv = BatchKVCache(target)
    for r in range(rows):
        kv.add_row()
        kv.write_row(r, single)
    if lengths is not None:
        kv.crop(torch.tensor(lengths, dtype=torch.long, device=kv.next_pos.device))
    kv.reserve(extra)
    return kv


def _timed_engine_forward(target: Any, kv: Any, x: torch.Tensor, sync: Callable[[], None]) -> float:
    """Seconds of one verification forward as the batched engine runs it (``SpeculativeBatch.verify``):
    ``BatchKVCache.forward`` of x [R, q] (its mask and per-row positions) and the LM head on each row's
    first min(q, ``HEAD_POSITIONS``) positions; the cache then forgets it (outside the timing)."""
    from dspark.decoding.batched import HEAD_POSITIONS

    counts = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    sync()
    start = time.perf_counter()
    out = kv.forward(x, counts, logits=False)
    target.compute_logits(out.last_hidden[:, : min(int(x.shape[1]), HEAD_POSITIONS)])
    sync()
    elapsed = time.perf_counter() - start
    kv.discard()
    return elapsed


def _timed_forward(target: Any, cache: Any, x: torch.Tensor, context_len: int,
                   sync: Callable[[], None]) -> float:
    """Seconds of one verification forward of ``x`` continuing ``cache``, cropped back to
    ``context_len`` afterwards (outside the timing)."""
    sync()
    start = time.perf_counter()
    target(x, past_key_values=cache, use_cache=True)  # logits at every new position, as verify
    sync()
    elapsed = time.perf_counter() - start
    target.crop_cache(cache, context_len)
    return elapsed


def profile_sps_runs(
    target: Any,
    batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS,
    *,
    context_len: int = 512,
    warmup: int = 2,
    repeats: int = 5,
    tokens_per_request: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    rows: int | None = None,
    context: Any = None,
    row_lengths: Sequence[int] | None = None,
) -> SPSProfile:
    """Time the verification forward at every B of ``batch_tokens`` (docs/scheduling.md, "SPS profiling").

    ``rows=R``: every B as R rows of B / R tokens, each continuing its own cache: the forwards of the
    batched serving loop at R live requests (``dspark.scheduling.batched_serving``), q = 1 + max ℓ per row.
    A target with the batched engine's interface (``compute_logits``; ``context_len`` ≥ 1) is timed
    as that engine runs the forward (``_timed_engine_forward``: its cache, mask, per-row positions and
    LM head on the first positions only), so that the table prices the very forwards a batched run
    makes; another is timed through its own forward on the engine's cache layout
    (``dspark.decoding.batch_state.ColumnLayer``: a forward writes its new columns in place). ``context`` (with
    ``rows``): a batch-1 cache of at least ``context_len`` positions; every row starts from a copy of its
    first ``context_len`` instead of a prefill of its own (a forward's time does not depend on what the
    cache holds), so that profiles at several R share one prefill.
    ``row_lengths`` (with ``rows`` = R and the engine): row r's cache holds its first row_lengths[r] ≤
    ``context_len`` tokens, rows of different lengths as a serving loop's are (its attention reads each
    row's own columns, ``dspark.kernels.attention.row_extents``, so a forward's cost depends on every
    row's length, not only the longest's).
    ``progress(done, repeats)`` is called after each timed sweep."""
    engine = rows is not None and context_len >= 1 and hasattr(target, "compute_logits")
    lengths = _checked_row_lengths(row_lengths, rows, context_len, engine)
    if engine:
        with torch.inference_mode():  # the engine's cache is written in inference mode
            return _profile_runs(target, batch_tokens, context_len, warmup, repeats, tokens_per_request, seed,
                                 progress, rows, context, engine=True, row_lengths=lengths)
    with torch.no_grad():
        return _profile_runs(target, batch_tokens, context_len, warmup, repeats, tokens_per_request, seed,
                             progress, rows, context, engine=False)


def _checked_row_lengths(row_lengths: Sequence[int] | None, rows: int | None, context_len: int,
                         engine: bool) -> list[int] | None:
    """``row_lengths`` checked against ``profile_sps_runs``'s other settings, as a list (None: none given)."""
    if row_lengths is None:
        return None
    lengths = [int(n) for n in row_lengths]
    if rows is None or len(lengths) != rows:
        raise ValueError(f"row_lengths holds {len(lengths)} lengths for rows = {rows}: give one per row (and rows)")
    if not engine:
        raise ValueError("row_lengths times rows of different lengths in the batched engine's cache: the target "
                         "needs its interface (compute_logits) and context_len >= 1")
    if min(lengths) < 1 or max(lengths) > context_len:
        raise ValueError(f"row_lengths {lengths}: every row holds 1 .. context_len = {context_len} tokens")
    return lengths


def _profile_runs(target: Any, batch_tokens: Sequence[int], context_len: int, warmup: int, repeats: int,
                  tokens_per_request: int | None, seed: int, progress: Callable[[int, int], None] | None,
                  rows: int | None, context: Any, *, engine: bool,
                  row_lengths: list[int] | None = None) -> SPSProfile:
    """``profile_sps_runs``; ``engine``: time the batched engine's own forward (``_timed_engine_forward``)."""
    sizes = _sizes_to_measure(batch_tokens, context_len, warmup, repeats, tokens_per_request, rows)
    fixed_rows = rows
    device = torch.device(target.device)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(target.vocab_size)

    def ids(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, length), generator=gen).to(device)  # [rows, length]

    layout = {b: (fixed_rows, b // fixed_rows) if fixed_rows is not None else (1, b) if tokens_per_request is None
              else (b // tokens_per_request, tokens_per_request) for b in sizes}  # B -> (rows, tokens per row)
    caches: dict[int, Any] = {}  # rows -> a cache holding context_len tokens per row
    if engine:  # one row's context (a prefill, or the shared one cropped), in every row of the engine's cache
        if context is not None:
            single = copy.deepcopy(context)
            target.crop_cache(single, context_len)
        else:
            single = target.new_cache()
            target(ids(1, context_len), past_key_values=single, use_cache=True, logits_to_keep=1)
        widest = max(b // fixed_rows for b in sizes)
        caches[fixed_rows] = _engine_rows(target, single, fixed_rows, widest, row_lengths)
    for rows in sorted({r for r, _ in layout.values()} - set(caches)):
        if context is not None and fixed_rows is not None:
            caches[rows] = copy.deepcopy(context)
            target.crop_cache(caches[rows], context_len)
            caches[rows].batch_repeat_interleave(rows)
        else:
            caches[rows] = target.new_cache()
        if context_len > 0 and (context is None or fixed_rows is None):
            # With fixed rows, one row is prefilled and copied to the others: a forward's time does not
            # depend on what the cache holds, and R prefills of the context would cost R times as much.
            fill = 1 if fixed_rows is not None and hasattr(caches[rows], "batch_repeat_interleave") else rows
            target(ids(fill, context_len), past_key_values=caches[rows], use_cache=True, logits_to_keep=1)
            if fill != rows:
                caches[rows].batch_repeat_interleave(rows)
        if fixed_rows is not None and hasattr(caches[rows], "layers"):  # the batched engine's own cache
            from dspark.decoding.batch_state import column_cache  # (a transformers Cache): columns written in place

            column_cache(caches[rows], context_len + max(b // fixed_rows for b in sizes))
    timed: dict[int, list[float]] = {b: [] for b in sizes}
    for sweep in range(warmup + repeats):
        for b in (sizes if sweep % 2 == 0 else sizes[::-1]):
            rows, width = layout[b]
            x = ids(rows, width)
            elapsed = (_timed_engine_forward(target, caches[rows], x, sync) if engine
                       else _timed_forward(target, caches[rows], x, context_len, sync))
            if sweep >= warmup:
                timed[b].append(elapsed)
        if progress is not None and sweep >= warmup:
            progress(sweep - warmup + 1, repeats)
    seconds = [timed[b] for b in sizes]
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
        rows=fixed_rows,
        row_lengths=row_lengths,
    )


def expected_longest(lengths: Sequence[int], rows: int) -> float:
    """E[max] of ``rows`` lengths drawn without replacement from ``lengths`` (all of them when there are
    fewer): Σ_k L_(k) · C(k − 1, R − 1) / C(N, R) over the sorted lengths L_(1) ≤ ... ≤ L_(N)."""
    return expected_order_statistics(lengths, rows)[-1]


def expected_order_statistics(lengths: Sequence[int], rows: int) -> list[float]:
    """E[X_(i)], i = 1..R: the expected i-th smallest of R = ``rows`` lengths drawn without replacement
    from ``lengths`` (all of them when there are fewer), Σ_k L_(k) · C(k − 1, i − 1) · C(N − k, R − i)
    / C(N, R) over the sorted lengths L_(1) ≤ ... ≤ L_(N): the row lengths of a batch of R requests
    taken at random, shortest first."""
    ordered = sorted(int(n) for n in lengths)
    n, r = len(ordered), min(int(rows), len(ordered))
    if n == 0 or r < 1:
        raise ValueError("expected_order_statistics needs at least one length and rows >= 1")
    total = math.comb(n, r)
    return [sum(ordered[k - 1] * math.comb(k - 1, i - 1) * math.comb(n - k, r - i) for k in range(i, n - r + i + 1))
            / total for i in range(1, r + 1)]


def profile_sps(target: Any, batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, **settings: Any) -> SPSTable:
    """SPS(B) table of ``target`` on its current device: steps/s = 1 / median seconds of one
    verification forward over B tokens after ``context_len`` cached tokens, timed in
    interleaved sweeps, rises within the medians' 95 % intervals flattened (docs/scheduling.md).

    ``settings``: the keyword arguments of :func:`profile_sps_runs` (context_len, warmup,
    repeats, tokens_per_request, seed)."""
    return profile_sps_runs(target, batch_tokens, **settings).table


