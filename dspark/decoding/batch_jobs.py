"""Whole runs of the batched decoder over a list of jobs (``dspark.decoding.batched``).

``speculative_batch_generate`` and ``target_batch_generate`` decode ``BatchJob``s with at most
``batch_size`` rows, refilling rows from the jobs as requests finish (continuous admission); every
request decodes the tokens batch-1 decoding gives it with the same seed. ``longest_first`` is the
order an evaluation admits its jobs in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dspark.decoding.batched import BatchRow, SpeculativeBatch, TargetBatch
from dspark.decoding.prefill_store import PrefillStore

__all__ = ["BatchJob", "job_generator", "longest_first", "speculative_batch_generate", "target_batch_generate"]


@dataclass
class BatchJob:
    """One request to decode: prompt ids, the seed of its generator, a tag to key it by."""

    prompt_ids: Sequence[int]
    seed: int | None
    tag: Any = None


def longest_first(jobs: Iterable[BatchJob]) -> list[BatchJob]:
    """``jobs`` in the order an evaluation admits them: longest prompt first (stable among equals).

    A forward's attention reads about as many cache columns per row as the batch's longest row
    holds (``dspark.kernels.attention`` reads fewer where one row is far longer than the rest), so
    rows of similar lengths batched together waste the fewest reads; the batch starts at its widest
    and narrows as the shorter prompts come in. Each request
    decodes the same tokens in any order (it keeps its own generator), so only the speed changes."""
    return sorted(jobs, key=lambda job: -len(job.prompt_ids))


def job_generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    """A job's own generator on ``device``, seeded with ``seed`` (None: the global one)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(int(seed))


@torch.inference_mode()
def speculative_batch_generate(target: Any, drafter: Any, jobs: Iterable[BatchJob], *, batch_size: int,
                               max_new_tokens: int, temperature: float = 1.0, eos_token_ids: Iterable[int] = (),
                               on_finish: Any = None, prefills: PrefillStore | None = None) -> list[BatchRow]:
    """Speculative decoding of ``jobs`` with at most ``batch_size`` rows, every round verifying all
    γ drafts of every row; rows are refilled from ``jobs`` as requests finish. Returns the
    requests in the order they finished; ``on_finish(request)`` is called as each does. The
    drafter (against the target) and every job's prompt are checked before any forward.
    ``prefills``: prompt prefills to take and keep (``dspark.decoding.prefill_store``)."""
    batch = SpeculativeBatch(target, drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                             eos_token_ids=eos_token_ids, prefills=prefills)
    return _drive(batch, jobs, batch_size, on_finish, lambda: (batch.draft(), batch.verify())[1])


@torch.inference_mode()
def target_batch_generate(target: Any, jobs: Iterable[BatchJob], *, batch_size: int, max_new_tokens: int,
                          temperature: float = 1.0, eos_token_ids: Iterable[int] = (),
                          on_finish: Any = None, prefills: PrefillStore | None = None) -> list[BatchRow]:
    """Target-only decoding of ``jobs`` with at most ``batch_size`` rows (as ``speculative_batch_generate``)."""
    batch = TargetBatch(target, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids,
                        prefills=prefills)
    return _drive(batch, jobs, batch_size, on_finish, batch.step)


def _drive(batch: Any, jobs: Iterable[BatchJob], batch_size: int, on_finish: Any, step: Any) -> list[BatchRow]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    jobs = list(jobs)
    for i, job in enumerate(jobs):  # every prompt before the first prefill
        batch._checked_prompt(job.prompt_ids, f"jobs[{i}].prompt_ids", "give each prompt its own BatchJob")
    pending = iter(jobs)
    done: list[BatchRow] = []

    def finish(request: BatchRow) -> None:
        done.append(request)
        if on_finish is not None:
            on_finish(request)

    exhausted = False
    while True:
        while not exhausted and (batch.free_rows() or len(batch.rows) < batch_size):
            job = next(pending, None)
            if job is None:
                exhausted = True
                break
            request = batch.admit(job.prompt_ids, job_generator(batch.device, job.seed), job.tag)
            if request.done:
                finish(request)
        batch.shrink()
        if not batch.rows:
            return done
        for request in step():
            finish(request)
