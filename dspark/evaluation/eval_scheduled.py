"""Decoding an evaluation's requests under a verification-length policy (``dspark eval --policy``).

The requests of each benchmark run through the serving simulator's stepping loop
(``dspark.scheduling.simulator.serve_together`` on the batched engine, ``run_requests`` on the
per-request one): ``concurrency`` requests in lockstep, the policy
choosing ℓ for all of them from their confidences (calibrated with the STS temperatures), so
rounds.jsonl and τ come out of the same code path as ``dspark simulate``. rounds.jsonl then records the
chosen ℓ as ``proposed``, plus step, batch_tokens and ``drafted`` (false for the rounds that did not
draft under ``algorithm1+skip``). The report's ``scheduled`` (``dspark.evaluation.scheduled_report``)
holds tokens/s against target-only decoding, the mean verified length and the measured drafting cost
per round in target steps, and its ``serving`` the simulated throughput on the SPS table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from dspark.data.prompts import Conversation
from dspark.data.render import render_prompt
from dspark.decoding.prefill_store import PrefillStore
from dspark.evaluation.eval_plain import EvalState, request_record, round_row, run_baseline, warm_once
from dspark.evaluation.journal import Done, EvalJournal
from dspark.scheduling.policies import policy_name
from dspark.scheduling.simulator import Job, SimResult, run_requests
from dspark.seeds import request_seed


def scheduled_benchmark(
    state: EvalState, name: str, conversations: list[Conversation], journal: EvalJournal | None, done: Done
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One benchmark's prompts ``rank::world`` through the serving loop under the evaluation's policy:
    records, rounds (plus step and batch_tokens) and the run's summary (``SimResult.summary``).
    A benchmark ``done`` holds is read back; one it does not is served from its first request
    (the policy sets each request's ℓ from all the requests decoded in lockstep)."""
    return scheduled_benchmarks([state], name, conversations, [journal], [done])[0]


def scheduled_benchmarks(
    states: Sequence[EvalState], name: str, conversations: list[Conversation],
    journals: Sequence[EvalJournal | None], dones: Sequence[Done],
) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]]:
    """``scheduled_benchmark`` for several policies on the same requests (one ``EvalState`` each, the
    same models and decoding settings). On the batched engine every policy not yet done and one
    target-only decode of the same requests at the same R, the baseline of every policy's records, are
    served step by step in turn (``dspark.scheduling.simulator.serve_together``): each policy's decode
    meets the machine's speed of the same minutes as its baseline, and each prompt is prefilled once
    (every decode is charged that forward's seconds as its prefill). On the per-request engine the
    policies serve the requests one after the other, each prefilling every prompt itself, and then
    target-only decoding runs once from the last policy's prefills. Returns (records, rounds, summary)
    per state, in order."""
    first = states[0]
    mine = list(range(first.rank, len(conversations), first.world))
    keys = [(name, i) for i in mine]
    out: list[Any] = [None] * len(states)
    todo = []
    for k, (state, done) in enumerate(zip(states, dones)):
        if (name, state.rank) in done.served:
            out[k] = ([done.records[key] for key in keys], [r for key in keys for r in done.rounds.get(key, [])],
                      done.served[(name, state.rank)])
        else:
            todo.append(k)
    if not todo:
        return out
    prompts = [render_prompt(first.tokenizer, conversations[i], enable_thinking=False) for i in mine]
    if prompts:
        warm_once(states[todo[0]], prompts[0])
        for k in todo:
            states[k].warm = True
    jobs = [Job(p, request_seed(first.decoding.seed, name, i), (name, i)) for p, i in zip(prompts, mine)]
    if all(states[k].serving.engine == "batched" for k in todo):
        sims, baselines = _serve_together(states, todo, jobs, name)
    else:
        sims = {}
        for k in todo:
            # the policy's own prompt prefills, kept for target-only decoding, which starts from the last policy's
            prefills = PrefillStore()
            desc = name if len(states) == 1 else f"{name} [{policy_name(states[k].serving.policy)}]"
            sims[k] = _serve(states[k], jobs, desc=desc, prefills=prefills)
        baselines = _baselines(states[todo[0]], jobs, prefills)
    for k in todo:
        rounds = [{**round_row(*row["tag"], row["round"], row["proposed"], row["accepted"], row["confidences"],
                                row["eos_accepted"]),
                   "step": row["step"], "batch_tokens": row["batch_tokens"], "drafted": row["drafted"]}
                  for row in sims[k].rounds]
        rounds.sort(key=lambda r: (r["request"], r["round"]))
        records = _scheduled_records(states[k], sims[k], jobs, rounds, journals[k], baselines)
        summary = sims[k].summary()
        if journals[k] is not None:
            journals[k].append_served(name, summary)
        out[k] = (records, rounds, summary)
    return out


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


def _serve_together(states: Sequence[EvalState], todo: list[int], jobs: list[Job],
                    name: str) -> tuple[dict[int, SimResult], dict[tuple, dict[str, Any]]]:
    """The policies ``todo`` of ``states`` (batched engine, one R) and, with a baseline, target-only
    decoding of the same ``jobs``, served step by step in turn with shared prompt prefills: (each
    policy's result by its index in ``states``, the baseline fields of each job's record by tag)."""
    from dspark.scheduling.simulator import serve_together

    first = states[todo[0]]  # serve_together refuses policies of different R
    bar = tqdm(total=len(jobs) * len(todo), desc=name if len(todo) == 1 else f"{name} [{len(todo)} policies]",
               unit="req", disable=not first.progress, dynamic_ncols=True)
    finished: dict[int, int] = {}

    def on_step(result: SimResult) -> None:  # requests finished over the policies
        done = result.requests_finished
        bar.update(done - finished.get(id(result), 0))
        finished[id(result)] = done

    results = serve_together(first.target, first.drafter, lambda: list(jobs), [states[k].serving for k in todo],
                             decoding=first.decoding, stop=None, target_only=first.baseline, on_step=on_step)
    bar.update(bar.total - bar.n)
    bar.close()
    baselines = {}
    if first.baseline and results:
        baselines = {tuple(row["tag"]): _baseline_fields(row) for row in results[0].target_only_requests}
    return dict(zip(todo, results)), baselines


def _baseline_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline_* fields of a record from one request of a target-only decode
    (``dspark.scheduling.batched_serving.TargetOnlyRun.finish``'s rows)."""
    return dict(baseline_tokens=row["tokens"], baseline_wall_s=row["timings"]["total"],
                baseline_timings=dict(row["timings"]), baseline_finished_by_eos=bool(row["finished_by_eos"]))


def _baselines(state: EvalState, jobs: list[Job], prefills: PrefillStore | None) -> dict[tuple, dict[str, Any]]:
    """The baseline_* fields of each job's record, by tag ({} without a baseline). On the batched engine,
    target-only decoding of the same jobs at the same R (each request's prefill and its share of every
    step it was live in), starting from the prompt prefills of the policies' decodes (``prefills``: the
    same forwards, charged the seconds they took there); else each prompt alone, batch 1."""
    if not state.baseline:
        return {}
    if state.serving.engine != "batched":
        return {tuple(job.tag): run_baseline(state, job.prompt_ids, job.seed) for job in jobs}
    from dspark.scheduling.batched_serving import target_only_wall

    base = target_only_wall(state.target, jobs, decoding=state.decoding, rows=state.serving.concurrency,
                            prefills=prefills)
    return {tuple(row["tag"]): _baseline_fields(row) for row in base["requests"]}


def _scheduled_records(state: EvalState, sim: SimResult, jobs: list[Job], rounds: list[dict[str, Any]],
                       journal: EvalJournal | None, baselines: Mapping[tuple, Mapping[str, Any]]
                       ) -> list[dict[str, Any]]:
    """One record per served job with its baseline fields (``_baselines``), each appended to the journal
    with its rounds. A request's wall_s is the time of its own phases (prefill, draft, verify, ...), not
    the time it waited while the other live requests were stepped; on the batched engine, its prefill
    and its share of every step it was live in."""
    by_request: dict[int, list[dict[str, Any]]] = {}
    for row in rounds:
        by_request.setdefault(row["request"], []).append(row)
    records = []
    for info, job in zip(sim.requests, jobs):
        record = request_record(*job.tag, job.prompt_ids, info["result"], info["timings"]["total"], info["timings"])
        record.update(baselines.get(tuple(job.tag), {}))
        record["rank"] = state.rank
        if journal is not None:
            journal.append_request(record, by_request.get(job.tag[1], []))
        records.append(record)
    return records
