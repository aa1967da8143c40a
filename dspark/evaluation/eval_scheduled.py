"""Decoding an evaluation's requests under a verification-length policy (``dspark eval --policy``).

The requests of each benchmark run through the serving simulator's stepping loop
(``dspark.scheduling.simulator.run_requests``): ``concurrency`` requests in lockstep, the policy
choosing ℓ for all of them from their confidences (calibrated with the STS temperatures), so
rounds.jsonl and τ come out of the same code path as ``dspark simulate``. rounds.jsonl then records the
chosen ℓ as ``proposed``, plus step, batch_tokens and ``drafted`` (false for the rounds that did not
draft under ``algorithm1+skip``). The report's ``scheduled`` (``dspark.evaluation.scheduled_report``)
holds tokens/s against target-only decoding, the mean verified length and the measured drafting cost
per round in target steps, and its ``serving`` the simulated throughput on the SPS table.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from dspark.data.prompts import Conversation
from dspark.data.render import render_prompt
from dspark.decoding.prefill_store import PrefillStore
from dspark.evaluation.eval_plain import EvalState, request_record, round_row, run_baseline, warm_once
from dspark.evaluation.journal import Done, EvalJournal
from dspark.scheduling.simulator import Job, SimResult, run_requests
from dspark.seeds import request_seed


def scheduled_benchmark(
    state: EvalState, name: str, conversations: list[Conversation], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One benchmark's prompts ``rank::world`` through the serving loop under the evaluation's policy:
    records, rounds (plus step and batch_tokens) and the run's summary (``SimResult.summary``).
    A benchmark ``done`` holds is read back; one it does not is served from its first request
    (the policy sets each request's ℓ from all the requests decoded in lockstep)."""
    mine = list(range(state.rank, len(conversations), state.world))
    if (name, state.rank) in done.served:
        keys = [(name, i) for i in mine]
        return ([done.records[k] for k in keys], [r for k in keys for r in done.rounds.get(k, [])],
                done.served[(name, state.rank)])
    prompts = [render_prompt(state.tokenizer, conversations[i], enable_thinking=False) for i in mine]
    if prompts:
        warm_once(state, prompts[0])
    jobs = [Job(p, request_seed(state.decoding.seed, name, i), (name, i)) for p, i in zip(prompts, mine)]
    prefills = PrefillStore()  # the prompts' prefills, shared by the policy's decode and target-only decoding
    sim = _serve(state, jobs, desc=name, prefills=prefills)
    rounds = [{**round_row(*row["tag"], row["round"], row["proposed"], row["accepted"], row["confidences"],
                            row["eos_accepted"]),
               "step": row["step"], "batch_tokens": row["batch_tokens"], "drafted": row["drafted"]}
              for row in sim.rounds]
    rounds.sort(key=lambda r: (r["request"], r["round"]))
    records = _scheduled_records(state, sim, jobs, rounds, journal, prefills)
    summary = sim.summary()
    if journal is not None:
        journal.append_served(name, summary)
    return records, rounds, summary


def _serve(state: EvalState, jobs: list[Job], desc: str, prefills: PrefillStore | None = None) -> SimResult:
    """Every job to completion (the slots drain at the end), ``concurrency`` at a time, with a fresh policy."""
    bar = tqdm(total=len(jobs), desc=desc, unit="req", disable=not state.progress, dynamic_ncols=True)

    def on_step(result: SimResult) -> None:
        bar.update(result.requests_finished - bar.n)
        if result.request_steps:
            bar.set_postfix(tau=f"{result.tau:.2f}", refresh=False)

    sim = run_requests(state.target, state.drafter, jobs, decoding=state.decoding, serving=state.serving,
                       on_step=on_step, prefills=prefills)
    bar.update(len(jobs) - bar.n)
    bar.close()
    return sim


def _scheduled_records(state: EvalState, sim: SimResult, jobs: list[Job], rounds: list[dict[str, Any]],
                       journal: EvalJournal | None, prefills: PrefillStore | None = None) -> list[dict[str, Any]]:
    """One record per served job, then its baseline decode; each appended to the journal with its
    rounds once its baseline is done. A request's wall_s is the time of its own phases (prefill,
    draft, verify, ...), not the time it waited while the other live requests were stepped; on the
    batched engine, its prefill and its share of every step it was live in, and its baseline is
    target-only decoding of the same jobs at the same R (shares likewise), which starts from the
    prompt prefills of the policy's decode (``prefills``: the same forwards, charged the seconds they
    took there)."""
    by_request: dict[int, list[dict[str, Any]]] = {}
    for row in rounds:
        by_request.setdefault(row["request"], []).append(row)
    batched = {}  # the batched engine's baseline: target-only decoding of the same jobs at the same R
    if state.baseline and state.serving.engine == "batched":
        from dspark.scheduling.batched_serving import target_only_wall

        base = target_only_wall(state.target, jobs, decoding=state.decoding, rows=state.serving.concurrency,
                                prefills=prefills)
        batched = {tuple(r["tag"]): r for r in base["requests"]}
    records = []
    for info, job in zip(sim.requests, jobs):
        record = request_record(*job.tag, job.prompt_ids, info["result"], info["timings"]["total"], info["timings"])
        if batched:
            row = batched[tuple(job.tag)]
            record.update(baseline_tokens=row["tokens"], baseline_wall_s=row["timings"]["total"],
                          baseline_timings=dict(row["timings"]),
                          baseline_finished_by_eos=bool(row["finished_by_eos"]))
        elif state.baseline:
            record.update(run_baseline(state, job.prompt_ids, job.seed))
        record["rank"] = state.rank
        if journal is not None:
            journal.append_request(record, by_request.get(job.tag[1], []))
        records.append(record)
    return records
