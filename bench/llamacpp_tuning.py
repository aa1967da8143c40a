"""llama.cpp's speculative settings from calibrated confidences: the engine's cost table, measured
against predicted speed over a grid of (n-max, p-min), and where a round's time goes.

Run (a llama-server from ``python bench/llamacpp.py --build``; the drafter of a demo run):

    .venv/bin/python bench/llamacpp_tuning.py --draft runs/demo/dspark_smollm2_135m/drafter \
        --rounds runs/demo/llamacpp/dev-T0.0/dspark_smollm2_135m --out runs/demo/llamacpp/tuning

Steps (``dspark.interop.llamacpp_tuning`` holds the model):

1. **Fit rounds**: ``--rounds``, a greedy ``dspark eval`` folder of the drafter on prompts apart
   from the measured ones (the dev split), or decoded here (``--fit-samples`` dev prompts per
   benchmark).
2. **Cost table** (``measure_costs``): target alone, ``forced[n]`` (p = 0) and ``idle[n]`` (p = 1)
   for n = 1..γ, ``--cost-sweeps`` interleaved sweeps over ``--cost-requests`` dev prompts; steps of
   the target alone, with jackknife intervals. Written to costs.json (``dspark export --to llamacpp
   --costs``).
3. **Grid**: every (n, p) of ``--grid-n`` × ``--grid-p`` served on the test prompts
   (``--num-samples`` per benchmark) in one shuffled sweep, the target alone twice in it; measured
   speed over target alone with a paired interval over requests (jackknife, stratified by benchmark,
   log scale), beside the predicted speed from the fit rounds and the cost table. The chosen
   setting (best predicted) against static n = γ, p = 0, paired on the same requests.
4. **Where the time goes** and the break-even: per-round costs split into the target's token,
   feature injection and drafting (idle[n] − 1) and verification (forced[ℓ] − idle[ℓ]); the τ at
   which the chosen setting's round cost is paid back.

Writes ``--out``: costs.json, grid.json, requests.jsonl, README.md (the tables), logs/. Timings are
on whatever else the machine does: run it alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp as llamacpp_bench  # noqa: E402  (the sibling bench: prompts, GGUF export, statistics)

from dspark.bootstrap import jackknife_ci  # noqa: E402
from dspark.evaluation.markdown import markdown_table  # noqa: E402
from dspark.interop.llamacpp import (  # noqa: E402
    find_llama_server,
    how_to_get_server,
    llama_server,
    parse_draft_stats,
)
from dspark.interop.llamacpp_tuning import (  # noqa: E402
    EngineCosts,
    Setting,
    load_rounds,
    measure_costs,
    predict,
    recommend,
)
from dspark.io.atomic import atomic_write_text  # noqa: E402
from dspark.seeds import request_seed  # noqa: E402


def serve_settings(server: Path, target_gguf: Path, draft: Mapping[str, Any], settings: Sequence[str],
                   prompts: Mapping[str, list[list[int]]], max_new_tokens: int, seed: int, threads: int,
                   logs: Path, order_seed: int = 0) -> list[dict[str, Any]]:
    """Serve every prompt greedily under each setting key ("target", "target#2", "n:p"), in a
    shuffled order, one server per setting; one row per request."""
    order = list(settings)
    random.Random(order_seed).shuffle(order)
    rows: list[dict[str, Any]] = []
    total = len(order) * sum(map(len, prompts.values()))
    bar = tqdm(total=total, desc="llama.cpp grid", unit="req", dynamic_ncols=True)
    for key in order:
        options: dict[str, Any] = {}
        if not key.startswith("target"):
            n, p = key.split(":")
            options = dict(draft_gguf=draft["gguf"], spec_type=draft["spec_type"], draft_n_max=int(n),
                           extra_args=["--spec-draft-p-min", p])
        with llama_server(target_gguf, server=server, threads=threads, log_path=logs / f"grid-{key.replace(':', '_')}.log",
                          **options) as srv:
            first = next(ids for batch in prompts.values() for ids in batch)
            srv.client.complete(first, temperature=0.0, n_predict=8, seed=0)  # untimed warm-up
            for benchmark, batch in prompts.items():
                for request, ids in enumerate(batch):
                    done = srv.client.complete(ids, temperature=0.0, n_predict=max_new_tokens,
                                               seed=request_seed(seed, benchmark, request))
                    rows.append({"setting": key, "benchmark": benchmark, "request": request, **done.to_json()})
                    bar.update(1)
    bar.close()
    return rows


def measured(rows: Sequence[Mapping[str, Any]], key: str, base_keys: Sequence[str]) -> list[float]:
    """[speed, lo, hi] of setting ``key`` over the target alone (the sum of ``base_keys`` runs),
    paired by request: pooled tokens/s ratio, jackknife over requests stratified by benchmark."""
    by = {}
    for r in rows:
        by.setdefault(r["setting"], {})[(r["benchmark"], r["request"])] = r
    groups: dict[str, list] = {}
    for k, mine in by[key].items():
        base = [by[b][k] for b in base_keys]
        groups.setdefault(k[0], []).append([*llamacpp_bench._steps(mine),
                                            sum(llamacpp_bench._steps(b)[0] for b in base),
                                            sum(llamacpp_bench._steps(b)[1] for b in base)])
    arrays = [np.asarray(v, dtype=np.float64) for v in groups.values()]
    est, lo, hi = jackknife_ci(arrays, lambda s: llamacpp_bench._ratio_of_rates(s.sum(axis=-2)), scale="log")
    return [float(est), float(lo), float(hi)]


def paired_ratio(rows: Sequence[Mapping[str, Any]], a: str, b: str) -> list[float]:
    """[ratio, lo, hi] of setting a's pooled tokens/s over setting b's, paired by request."""
    return measured(rows, a, [b])


def fmt3(v: Sequence[float] | None, digits: int = 2) -> str:
    return llamacpp_bench.fmt(list(v) if v else None, digits)


def time_split(costs: EngineCosts) -> list[list[str]]:
    """Per n: the round's parts in target steps: the target's token (1), drafting and features
    (idle[n] − 1), verifying n drafts (forced[n] − idle[n])."""
    rows = []
    for n in sorted(costs.forced):
        idle = costs.idle.get(n)
        forced = costs.forced[n]
        rows.append([str(n), f"{forced.estimate:.2f} [{forced.lo:.2f}, {forced.hi:.2f}]",
                     f"{idle.estimate - 1:.2f}" if idle else "–",
                     f"{forced.estimate - idle.estimate:.2f}" if idle else "–",
                     f"{forced.estimate:.2f}"])
    return rows


def llama_draft_ms(log_path: Path) -> tuple[int, float]:
    """(draft calls, ms in them) so far, from a llama-server log at trace verbosity."""
    found = parse_draft_stats(log_path.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"{log_path}: no speculative statistics line (llama-server -lv 4)")
    return found


def time_split_measured(server: Path, target_gguf: Path, draft: Mapping[str, Any], prompts: Sequence[Sequence[int]],
                        gamma: int, max_new_tokens: int, threads: int, logs: Path, confidence: bool) -> list[dict]:
    """Per n: a step of the idle setting (p = 1: nothing verified) split by llama.cpp's own timer of
    the draft call (common_speculative_draft: the drafter's block forward and its sampling) and the
    rest (the target's token, the target-layer features copied and injected into the drafter's
    cache, the server loop), against the target alone's step, in ms, measured back to back."""
    out = []
    with llama_server(target_gguf, server=server, threads=threads, log_path=logs / "split-target.log") as srv:
        srv.client.complete(prompts[0], temperature=0.0, n_predict=8, seed=0)
        done = [srv.client.complete(ids, temperature=0.0, n_predict=max_new_tokens, seed=0) for ids in prompts]
    target_ms = sum(d.predicted_ms for d in done) / sum(d.predicted_n for d in done)
    for n in range(1, gamma + 1):
        log = logs / f"split-idle{n}.log"
        log.unlink(missing_ok=True)
        p = "1" if confidence else "0"
        with llama_server(target_gguf, server=server, threads=threads, log_path=log, draft_gguf=draft["gguf"],
                          spec_type=draft["spec_type"], draft_n_max=n,
                          extra_args=["--spec-draft-p-min", p, "-lv", "4"]) as srv:
            srv.client.complete(prompts[0], temperature=0.0, n_predict=8, seed=0)
            time.sleep(0.5)  # the statistics line is written when the slot is released, after the response
            calls0, ms0 = llama_draft_ms(log)
            done = [srv.client.complete(ids, temperature=0.0, n_predict=max_new_tokens, seed=0) for ids in prompts]
        calls, ms = llama_draft_ms(log)
        steps = sum(d.rounds if (d.rounds and not confidence) else d.predicted_n for d in done)
        step_ms = sum(d.predicted_ms for d in done) / steps
        draft_ms = (ms - ms0) / max(1, calls - calls0)
        out.append({"n": n, "target_ms": target_ms, "step_ms": step_ms, "draft_call_ms": draft_ms,
                    "draft_calls_per_step": (calls - calls0) / steps, "rest_ms": step_ms - draft_ms * (calls - calls0) / steps})
    return out


def verify_costs(server: Path, target_gguf: Path, prompts: Sequence[Sequence[int]], gamma: int, threads: int,
                 logs: Path, repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """The target alone's cost of a batch of k = 1..γ+1 new tokens after a cached prompt (the tokens a
    verification of ℓ = k − 1 drafts sends), from the server's own prompt timing, in decode steps of
    the same context: each prompt is cached, then k fresh tokens are appended (``cache_prompt``; the
    server processes exactly k, checked), interleaved over k and repeated. Prompt processing computes
    logits for the last token only, a verification for all k: a lower bound on verification."""
    rng = random.Random(seed)
    per_k = {k: [0.0, 0] for k in range(1, gamma + 2)}
    step = [0.0, 0]
    with llama_server(target_gguf, server=server, threads=threads, log_path=logs / "verify-target.log") as srv:
        for ids in prompts:
            base = list(ids)
            srv.client.complete(base, temperature=0.0, n_predict=1, seed=seed, cache_prompt=True)
            done = srv.client.complete(base, temperature=0.0, n_predict=16, seed=seed, cache_prompt=True)
            step[0] += done.predicted_ms
            step[1] += done.predicted_n
            for _ in range(repeats):
                ks = list(per_k)
                rng.shuffle(ks)
                for k in ks:
                    extra = [rng.randrange(1000, 40000) for _ in range(k)]
                    done = srv.client.complete(base + extra, temperature=0.0, n_predict=1, seed=seed, cache_prompt=True)
                    if done.prompt_n != k:
                        raise RuntimeError(f"the server processed {done.prompt_n} prompt tokens, not {k}: "
                                           "its prompt cache did not hold the prefix")
                    per_k[k][0] += done.prompt_ms
                    per_k[k][1] += 1
    step_ms = step[0] / step[1]
    return {"decode_step_ms": step_ms,
            "batch_ms": {k: v[0] / v[1] for k, v in per_k.items()},
            "batch_steps": {k: v[0] / v[1] / step_ms for k, v in per_k.items()}}


def shape_costs(draft_dir: Path, target: Any, target_name: str, shapes: Sequence[tuple[int, int]], *,
                target_gguf: Path, server: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                sweeps: int, threads: int, out: Path) -> list[dict[str, Any]]:
    """idle[1] and forced[1] of drafters shaped like ``draft_dir``'s with (draft layers, draft
    vocabulary k; 0 = the full vocabulary) changed and random weights: what a round costs depends
    on the shape alone, so the cheapest shape is found without training one."""
    from dspark.interop.gguf import export_gguf, spec_type
    from dspark.modeling import load_drafter, make_drafter
    from dspark.modeling.checkpoint import read_config
    from dspark.modeling.vocab import DraftVocab

    target = target.with_layers(read_config(draft_dir).target_layer_ids)  # the drafter's own feature layers
    base = load_drafter(draft_dir, target).config
    rows = []
    for layers, k in shapes:
        config = base.replace(num_draft_layers=int(layers), draft_vocab_size=int(k))
        drafter = make_drafter(config).attach_target(target)
        if k:
            drafter.set_vocab(DraftVocab.from_target_ids(list(range(int(k))), int(config.vocab_size)))
        path = export_gguf(drafter, out / "shapes" / f"l{layers}-k{k}.gguf", target=target_name)
        costs = measure_costs(target_gguf, path, spec_type=spec_type(drafter), gamma=1, prompts=prompts,
                              max_new_tokens=max_new_tokens, confidence=True, sweeps=sweeps, threads=threads,
                              server=server, log_dir=out / "logs", progress=False)
        rows.append({"layers": layers, "k": k, "idle1": list(costs.idle[1].__dict__.values()),
                     "forced1": list(costs.forced[1].__dict__.values())})
    return rows


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", required=True, help="the drafter folder")
    parser.add_argument("--rounds", default="", help="greedy `dspark eval` folder of the drafter on dev prompts")
    parser.add_argument("--costs", default="", help="reuse this cost table instead of measuring one")
    parser.add_argument("--out", required=True)
    parser.add_argument("--server", default=None)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--target-gguf", default=None)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--num-samples", type=int, default=4, help="test prompts per benchmark for the grid")
    parser.add_argument("--fit-samples", type=int, default=4, help="dev prompts per benchmark for the fit rounds")
    parser.add_argument("--cost-requests", type=int, default=12, help="dev prompts the cost table is measured on")
    parser.add_argument("--cost-sweeps", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--grid-n", default="1,2,3,4")
    parser.add_argument("--grid-p", default="0,0.3,0.5,0.7,0.9")
    parser.add_argument("--no-grid", action="store_true", help="the cost table and the choice only")
    parser.add_argument("--reuse-grid", default="", help="the requests.jsonl of an earlier grid run: its measured "
                        "rows against this run's predictions, nothing served")
    parser.add_argument("--no-split", action="store_true", help="skip the draft-call timing (llama-server -lv 4)")
    parser.add_argument("--shapes", default="", help="also the round costs of other drafter shapes, random weights: "
                        "LAYERSxK,... (K = draft vocabulary, 0 = full), e.g. 1x2048,1x8192,2x2048,2x0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=llamacpp_bench.DEFAULT_SEED)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    server = find_llama_server(args.server)
    if server is None:
        raise SystemExit(f"no llama-server: {how_to_get_server()}")
    from transformers import AutoTokenizer

    from dspark.hub import find_smollm2_gguf, resolve_target_path
    from dspark.target import TargetModel

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    draft_dir = Path(args.draft)
    layer_ids = json.loads((draft_dir / "config.json").read_text()).get("target_layer_ids", [-1])
    target = TargetModel.from_pretrained(args.target, layer_ids)
    facts = llamacpp_bench.drafter_facts(draft_dir, target)
    gguf = llamacpp_bench.export_gguf_of(draft_dir, out / "draft.gguf", args.target, target)
    draft = {"gguf": str(gguf), **facts}
    gamma = int(facts["gamma"])
    target_gguf = Path(args.target_gguf) if args.target_gguf else find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(args.target))
    ns = argparse.Namespace(data_dir=args.data_dir, builtin_eval=False, benchmarks=None, target=args.target,
                            seed=args.seed, max_new_tokens=args.max_new_tokens)

    def prompts_of(split: str, samples: int) -> dict[str, list[list[int]]]:
        ns.split, ns.num_samples = split, samples
        return llamacpp_bench.load_prompt_ids(llamacpp_bench.prompt_settings(ns, None), tokenizer)

    rounds_dir = Path(args.rounds) if args.rounds else out / "dev-T0.0"
    if not (rounds_dir / "report.json").is_file():  # no finished evaluation there (a killed one resumes)
        settings = llamacpp_bench.prompt_settings(ns, None)
        settings.update(split="dev", num_samples=args.fit_samples)
        from dspark.evaluation.evaluate import evaluate
        from dspark.modeling import load_drafter
        from dspark.scheduling.simulator import DecodeSettings

        evaluate(target, load_drafter(draft_dir, target), settings["data_dir"], names=None, batch_size=8,
                 num_samples=args.fit_samples, split="dev",
                 decoding=DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=args.seed),
                 baseline=False, out_dir=rounds_dir)
    logged = load_rounds(rounds_dir)
    confidence = not np.isnan(next(iter(logged.requests.values()))[0][0]).all()

    if args.costs:
        costs = EngineCosts.from_json(args.costs)
    else:
        dev = [ids for batch in prompts_of("dev", max(1, -(-args.cost_requests // 9))).values() for ids in batch]
        costs = measure_costs(target_gguf, gguf, spec_type=facts["spec_type"], gamma=gamma,
                              prompts=dev[: args.cost_requests], max_new_tokens=args.max_new_tokens,
                              confidence=confidence, sweeps=args.cost_sweeps, threads=args.threads, server=server,
                              log_dir=out / "logs")
        atomic_write_text(out / "costs.json", json.dumps(costs.to_json(), indent=2) + "\n")
    choice = recommend(logged, costs, confidence=confidence)
    split: list[dict] = []
    if confidence and not args.no_split:
        dev = [ids for batch in prompts_of("dev", max(1, -(-args.cost_requests // 9))).values() for ids in batch]
        split = time_split_measured(server, target_gguf, draft, dev[: args.cost_requests], gamma,
                                    args.max_new_tokens, args.threads, out / "logs", confidence)

    lines = [f"# llama.cpp settings of {draft_dir}", "",
             f"{costs.machine}, {costs.threads} threads; {time.strftime('%Y-%m-%d')}. Fit rounds: {logged.count} dev requests "
             f"({rounds_dir}); cost table: {costs.requests} dev requests × {costs.sweeps} sweeps, "
             f"{costs.max_new_tokens} new tokens; target alone {costs.target_tokens_per_s:.0f} tokens/s.", "",
             "## Where a round's time goes (target steps)", "",
             markdown_table(["n", "round drafting and verifying n (forced[n])", "drafting + features (idle[n] − 1)",
                             "verifying n drafts (forced[n] − idle[n])", "break-even τ at p = 0"], time_split(costs)),
             ""]
    if split:
        lines += ["Inside a step of the idle setting (p = 1: the drafter runs, nothing is verified), in ms per "
                  "step: llama.cpp's own timer of the draft call (the drafter's block forward and its sampling) "
                  "and the rest (the target's token, its features copied and injected into the drafter's cache, "
                  "the server loop), beside the target alone's step, measured back to back:", "",
                  markdown_table(["n", "target alone", "idle step", "draft call", "rest", "rest − target alone"],
                                 [[str(r["n"]), f"{r['target_ms']:.2f}", f"{r['step_ms']:.2f}",
                                   f"{r['draft_call_ms'] * r['draft_calls_per_step']:.2f}", f"{r['rest_ms']:.2f}",
                                   f"{r['rest_ms'] - r['target_ms']:.2f}"] for r in split]), ""]
    if args.shapes:
        dev = [ids for batch in prompts_of("dev", max(1, -(-args.cost_requests // 9))).values() for ids in batch]
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
        shaped = shape_costs(draft_dir, target, args.target, shapes, target_gguf=target_gguf, server=server,
                             prompts=dev[: args.cost_requests], max_new_tokens=args.max_new_tokens,
                             sweeps=args.cost_sweeps, threads=args.threads, out=out)
        lines += ["Round costs by drafter shape (random weights; target steps; n-max 1): idle[1] is the price of "
                  "running the drafter at all, forced[1] of one verified draft; a round at n-max 1 pays when "
                  "P(draft kept and accepted) > its cost − 1.", "",
                  markdown_table(["draft layers", "draft vocabulary", "idle[1]", "forced[1]"],
                                 [[str(r["layers"]), str(r["k"] or "full"), fmt3(r["idle1"][:3]), fmt3(r["forced1"][:3])]
                                  for r in shaped]), ""]
        split_shapes = shaped
    else:
        split_shapes = []
    verify: dict[str, Any] = {}
    if not args.no_split:
        dev = [ids for batch in prompts_of("dev", max(1, -(-args.cost_requests // 9))).values() for ids in batch]
        verify = verify_costs(server, target_gguf, dev[: args.cost_requests], gamma, args.threads, out / "logs")
        lines += ["The target alone's cost of a batch of k new tokens after a cached prompt (what verifying "
                  "k − 1 drafts sends; prompt timing, last-token logits only, so a lower bound), in decode steps "
                  f"of the same context ({verify['decode_step_ms']:.2f} ms):", "",
                  markdown_table(["k", "ms", "decode steps"],
                                 [[str(k), f"{verify['batch_ms'][k]:.2f}", f"{verify['batch_steps'][k]:.2f}"]
                                  for k in verify["batch_ms"]]), ""]
    lines += ["## The choice", "", choice.markdown()]
    result: dict[str, Any] = {"costs": costs.to_json(), "recommendation": choice.to_json(), "fit_rounds": str(rounds_dir),
                              "time_split_ms": split, "shapes": split_shapes,
                              "verify_batch": verify}

    if not args.no_grid:
        grid = [Setting(int(n), float(p)) for n in args.grid_n.split(",") for p in args.grid_p.split(",")
                if confidence or float(p) == 0.0]
        for s in (choice.chosen.setting, Setting(gamma, 0.0)):
            if s not in grid:
                grid.append(s)
        keys = {f"{s.n_max}:{s.p_min:g}": s for s in grid}
        test = prompts_of("test", args.num_samples)
        if args.reuse_grid:  # the measured rows of an earlier grid run (same prompts), predictions made afresh
            rows = [json.loads(line) for line in Path(args.reuse_grid).read_text().splitlines() if line.strip()]
            measured_keys = {r["setting"] for r in rows}
            if not {"target", "target#2"} <= measured_keys:
                raise SystemExit(f"--reuse-grid {args.reuse_grid} has no target-alone rows")
            keys = {k: v for k, v in keys.items() if k in measured_keys}  # a setting never served is not compared
        else:
            rows = serve_settings(server, target_gguf, draft, ["target", "target#2", *keys], test,
                                  args.max_new_tokens, args.seed, args.threads, out / "logs")
        atomic_write_text(out / "requests.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        table, entries = [], []
        for key, s in keys.items():
            got = measured(rows, key, ["target", "target#2"])
            pred = predict(logged, costs, s)
            n_req = sum(1 for r in rows if r["setting"] == key)
            acc = sum(r["draft_accepted"] for r in rows if r["setting"] == key)
            drafted = sum(r["draft_n"] for r in rows if r["setting"] == key)
            entries.append({"n_max": s.n_max, "p_min": s.p_min, "measured": got, "predicted": pred.to_json(),
                            "accepted": acc, "drafted": drafted, "requests": n_req})
            error = pred.speed / got[0] - 1 if got else float("nan")
            table.append([str(s.n_max), f"{s.p_min:g}", f"{acc} / {drafted}", fmt3(got), fmt3([pred.speed, pred.lo, pred.hi]),
                          f"{100 * error:+.0f} %", "chosen" if s == choice.chosen.setting else
                          ("static" if s == Setting(gamma, 0.0) else "")])
        chosen_key = f"{choice.chosen.setting.n_max}:{choice.chosen.setting.p_min:g}"
        versus = paired_ratio(rows, chosen_key, f"{gamma}:0") if chosen_key in keys else []
        n_requests = sum(map(len, test.values()))
        lines += ["", f"## Measured against predicted ({n_requests} test requests, greedy)", "",
                  "Speed over the target alone (served twice in the same shuffled sweep), pooled tokens/s, paired "
                  "by request; 95 % intervals over requests (jackknife, stratified by benchmark).", "",
                  markdown_table(["n-max", "p-min", "drafts accepted / drafted", "measured", "predicted",
                                  "prediction error", ""], table), "",
                  f"Chosen ({chosen_key.replace(':', ', p-min ')}) over static (n-max {gamma}, p-min 0), paired: "
                  f"{fmt3(versus)}."]
        result.update(grid=entries, chosen_over_static=versus, requests=n_requests)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    atomic_write_text(out / "grid.json", json.dumps(result, indent=2) + "\n")
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "README.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
