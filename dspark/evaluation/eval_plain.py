"""Decoding an evaluation's requests without a policy: every round verifies all γ drafts (the
offline protocol of the paper's Table 1, Section 4.2).

One request at a time (``plain_benchmark``) or, with ``batch_size`` R > 1, R requests per drafter and
target forward (``batched_benchmarks``, ``dspark.decoding.batched``), each decoding the tokens it
decodes alone, against target-only decoding at the same R. Every decode draws from a generator seeded
with its request's seed (``dspark.seeds.request_seed``). Both this path and the scheduled one
(``dspark.evaluation.eval_scheduled``) share the state of one ``evaluate`` call (``EvalState``) and log
the rows built here: ``request_record`` (requests.jsonl) and ``round_row`` (rounds.jsonl).

``speculative_generate``, ``target_generate`` and ``time`` are this module's names, looked up at call
time: tests replace them with scripted decoders and a fake clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.data.prompts import Conversation
from dspark.data.render import render_prompt
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.decoding.prefill_store import PrefillStore
from dspark.evaluation.journal import Done, EvalJournal
from dspark.evaluation.metrics import round_tau
from dspark.scheduling.simulator import DecodeSettings, ServeSettings
from dspark.seeds import request_seed

WAVE_ROWS = 4  # with a baseline, requests go in waves of WAVE_ROWS · R (speculative, then target-only)


@dataclasses.dataclass
class EvalState:
    """What the benchmark loops of one ``evaluate`` call share: the models, the resolved
    settings and this process's place among the ranks."""

    target: Any
    drafter: Any
    tokenizer: Any
    decoding: DecodeSettings  # EOS ids resolved
    serving: ServeSettings  # SPS table loaded, STS temperatures read and checked against γ
    baseline: bool  # also decode every prompt with the target alone
    rank: int
    world: int
    progress: bool  # progress bars (rank 0 only)
    warm: bool  # the untimed warm-up decode ran (or none was asked for)
    batch_size: int = 1  # requests decoded together without a policy (dspark.decoding.batched)
    batch_size_auto: dict[str, float] | None = None  # "auto": R -> round throughput measured to choose it
    warmup_tokens: int = 0  # new tokens of the untimed warm-up decode (dspark.evaluation.evaluate.WARMUP_TOKENS)

    @property
    def device(self) -> Any:
        return getattr(self.target, "device", "cpu")

    @property
    def temps(self) -> np.ndarray | None:
        """The STS temperatures [γ], or None."""
        t = self.serving.sts_temperatures
        return None if t is None else np.asarray(t, dtype=np.float64)


# ---------------------------------------------------------------------------
# Shared by both decode paths
# ---------------------------------------------------------------------------


def _generator(device: Any, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def _decode_kwargs(decoding: DecodeSettings) -> dict[str, Any]:
    """The keywords ``speculative_generate`` and ``target_generate`` take from the settings."""
    return dict(temperature=decoding.temperature, eos_token_ids=list(decoding.eos_token_ids or ()),
                max_new_tokens=decoding.max_new_tokens)


def warm_once(state: EvalState, prompt_ids: list[int]) -> None:
    """Before the first timed request: one short untimed decode of each function
    (kernel selection, allocator, lazy imports)."""
    if state.warm:
        return
    kwargs = {**_decode_kwargs(state.decoding),
              "max_new_tokens": min(state.warmup_tokens, state.decoding.max_new_tokens)}
    gen = _generator(state.device, 0)
    speculative_generate(state.target, state.drafter, prompt_ids, generator=gen, **kwargs)
    if state.baseline:
        target_generate(state.target, prompt_ids, generator=gen, **kwargs)
    state.warm = True


def decode_fn_name() -> str:
    """The name of the speculative decode function the requests run (``report["config"]["decode_fn"]``)."""
    return getattr(speculative_generate, "__qualname__", repr(speculative_generate))


def request_record(
    benchmark: str, request: int, prompt_ids: Sequence[int], result: Any, wall_s: float, timings: Mapping[str, float]
) -> dict[str, Any]:
    """The requests.jsonl row of one speculative decode (``DecodeResult``), before its baseline fields."""
    taus = [r.tau for r in result.rounds]
    return {"benchmark": benchmark, "request": request, "prompt_tokens": len(prompt_ids),
            "tokens": len(result.tokens), "rounds": len(taus),
            "tau": sum(taus) / len(taus) if taus else None,
            "finished_by_eos": bool(result.finished_by_eos), "wall_s": wall_s, "timings": dict(timings)}


def round_row(
    benchmark: str, request: int, index: int, proposed: int, accepted: int, confidences: Any, eos_accepted: bool
) -> dict:
    """The rounds.jsonl row of one draft/verify round (``dspark.evaluation.metrics`` reads it)."""
    return {"benchmark": benchmark, "request": request, "round": index, "proposed": proposed, "accepted": accepted,
            "confidences": None if confidences is None else [float(c) for c in confidences],
            "eos_accepted": bool(eos_accepted)}


def run_baseline(state: EvalState, prompt_ids: Sequence[int], request_seed: int,
                 prefills: PrefillStore | None = None) -> dict[str, Any]:
    """Target-only decode of one prompt with the request's seed: the baseline_* fields of its record.
    ``prefills``: the speculative decode's prefill of the prompt, taken instead of a forward of its own
    and charged the seconds that forward took (``dspark.decoding.loop._prefill``)."""
    base = target_generate(state.target, prompt_ids, generator=_generator(state.device, request_seed),
                           prefills=prefills, **_decode_kwargs(state.decoding))
    return dict(
        baseline_tokens=len(base.tokens),
        baseline_wall_s=base.timings["total"],
        baseline_timings=dict(base.timings),
        baseline_finished_by_eos=bool(base.finished_by_eos),
    )


# ---------------------------------------------------------------------------
# One request at a time
# ---------------------------------------------------------------------------


def plain_benchmark(
    state: EvalState, name: str, conversations: list[Conversation], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One benchmark's prompts ``rank::world``, one request at a time: their records and round records."""
    bar = tqdm(range(state.rank, len(conversations), state.world), desc=name, unit="req",
               disable=not state.progress, dynamic_ncols=True)
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    tau_sum = num_rounds = 0
    for request in bar:
        if (name, request) in done.records:
            record, request_rounds = done.records[(name, request)], done.rounds.get((name, request), [])
        else:
            prompt_ids = render_prompt(state.tokenizer, conversations[request], enable_thinking=False)
            warm_once(state, prompt_ids)
            record, request_rounds = _run_request(state, prompt_ids, name, request)
            record["rank"] = state.rank
            if journal is not None:
                journal.append_request(record, request_rounds)
        records.append(record)
        rounds += request_rounds
        tau_sum += sum(round_tau(r) for r in request_rounds)
        num_rounds += len(request_rounds)
        if num_rounds:
            bar.set_postfix(tau=f"{tau_sum / num_rounds:.2f}", refresh=False)
    bar.close()
    return records, rounds


def _run_request(
    state: EvalState, prompt_ids: list[int], benchmark: str, request: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Decode one prompt speculatively (and with the target alone): its record and round records.

    Both decodes draw from generators seeded with the request's seed; wall times
    are measured around each call. The target-only decode starts from the speculative decode's prompt
    prefill (the same forward), charged the seconds it took there, as at R > 1."""
    seed = request_seed(state.decoding.seed, benchmark, request)
    prefills = PrefillStore() if state.baseline else None
    start = time.perf_counter()
    result = speculative_generate(state.target, state.drafter, prompt_ids, generator=_generator(state.device, seed),
                                  prefills=prefills, **_decode_kwargs(state.decoding))
    record = request_record(benchmark, request, prompt_ids, result, time.perf_counter() - start, result.timings)
    if state.baseline:
        record.update(run_baseline(state, prompt_ids, seed, prefills))
    rounds = [round_row(benchmark, request, index, int(r.proposed), int(r.accepted), r.confidences, r.eos_accepted)
              for index, r in enumerate(result.rounds)]
    return record, rounds


# ---------------------------------------------------------------------------
# R requests per forward
# ---------------------------------------------------------------------------


def batched_benchmarks(
    state: EvalState, prompts: Mapping[str, list[Conversation]], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every benchmark's prompts ``rank::world`` through one batch of ``state.batch_size`` rows
    (``dspark.decoding.batched``): the rows are refilled across benchmarks as requests finish, the
    longest prompts first (``longest_first``).

    Without a baseline each request is committed to the journal as it finishes. With one, the
    pending requests go in waves of ``WAVE_ROWS`` · R: the wave decodes speculatively, then with the
    target alone at the same R, and its requests are committed; a kill loses at most the wave in
    flight. The target-only decode starts from the prompt prefills of the speculative one (the same
    forward; ``dspark.decoding.prefill_store``), charged the seconds they took there. Requests
    ``done`` holds are read back, not decoded."""
    from dspark.decoding.batch_jobs import BatchJob, longest_first, speculative_batch_generate, target_batch_generate

    keys = [(name, i) for name, convs in prompts.items() for i in range(state.rank, len(convs), state.world)]
    pending = [k for k in keys if k not in done.records]
    by_key: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {
        k: (done.records[k], done.rounds.get(k, [])) for k in keys if k in done.records}
    ids = {k: render_prompt(state.tokenizer, prompts[k[0]][k[1]], enable_thinking=False) for k in pending}
    pending = [job.tag for job in longest_first(BatchJob(ids[k], None, k) for k in pending)]
    if pending:
        warm_once(state, ids[pending[0]])
    bar = tqdm(total=len(keys), initial=len(keys) - len(pending), desc=f"eval (R = {state.batch_size})",
               unit="req", disable=not state.progress, dynamic_ncols=True)
    rows, kwargs = state.batch_size, _decode_kwargs(state.decoding)
    wave = len(pending) if not state.baseline else WAVE_ROWS * rows
    for start in range(0, len(pending), max(wave, 1)):
        part = pending[start : start + wave]
        jobs = [BatchJob(ids[k], request_seed(state.decoding.seed, *k), k) for k in part]
        finished: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {}

        def spec_done(request: Any) -> None:
            result = request.result()
            key = request.tag
            record = request_record(*key, ids[key], result, result.timings["total"], result.timings)
            record["rank"] = state.rank
            request_rounds = [round_row(*key, i, int(r.proposed), int(r.accepted), r.confidences, r.eos_accepted)
                              for i, r in enumerate(result.rounds)]
            finished[key] = (record, request_rounds)
            if not state.baseline:
                _commit(journal, record, request_rounds, bar)

        # the wave's prompt prefills, kept for its target-only decode (dspark.decoding.prefill_store)
        prefills = PrefillStore() if state.baseline else None
        speculative_batch_generate(state.target, state.drafter, jobs, batch_size=rows, on_finish=spec_done,
                                   prefills=prefills, **kwargs)
        if state.baseline:
            for request in target_batch_generate(state.target, jobs, batch_size=rows, prefills=prefills, **kwargs):
                base = request.result()
                finished[request.tag][0].update(
                    baseline_tokens=len(base.tokens), baseline_wall_s=base.timings["total"],
                    baseline_timings=dict(base.timings), baseline_finished_by_eos=bool(base.finished_by_eos))
            for key in part:
                _commit(journal, *finished[key], bar)
        by_key.update(finished)
    bar.close()
    records = [by_key[k][0] for k in keys]
    return records, [r for k in keys for r in by_key[k][1]]


def _commit(journal: EvalJournal | None, record: dict[str, Any], rounds: list[dict[str, Any]], bar: Any) -> None:
    if journal is not None:
        journal.append_request(record, rounds)
    bar.update(1)
