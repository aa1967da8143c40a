"""`dspark <command>`: argument parsing and printing only; the work is done by the library."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

# dspark.serving.POLICY_HELP, repeated so that `dspark --help` does not import torch.
POLICY_HELP = "algorithm1, async[:K0], static1, static[:ℓ], threshold:<a>"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = ("dtype of the target and the drafter (default auto: bfloat16 on a GPU or on a CPU with native bf16, "
              "else float32)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="a Python config file (config/dspark/*.py)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override config fields, e.g. --set train.lr=3e-4 drafter.block_size=8")


def cmd_propose(args: argparse.Namespace) -> int:
    import torch

    from dspark.runtime import build_drafter, load_target
    from dspark.config import load_config
    from dspark.data.render import render_prompt
    from dspark.modeling import load_drafter
    from dspark.proposals import greedy_continuation, proposals_along

    config = load_config(args.config, args.overrides)
    torch.manual_seed(config.seed)
    print(f"loading target {config.target.name_or_path} ...", flush=True)
    target = load_target(config)
    print(f"target: {target.extra_repr()}")
    if args.draft:
        drafter = load_drafter(args.draft, target, device=target.device)
        print(f"drafter: loaded from {args.draft}")
    else:
        drafter = build_drafter(config, target)
        print("drafter: freshly initialised (untrained: expect noise; train one with `dspark train`)")
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {drafter.config.variant}, {drafter.config.num_draft_layers} layers, block γ={drafter.config.block_size}, "
          f"{n_params / 1e6:.2f} M trainable parameters (+ the target's frozen embedding / LM head)")
    tok = target.tokenizer
    prompt_ids = render_prompt(tok, [{"role": "user", "content": args.prompt}])
    seq = greedy_continuation(target, prompt_ids, args.max_new_tokens)
    P = len(prompt_ids)
    print(f"\nprompt: {args.prompt!r}\ntarget (greedy): {tok.decode(seq[P:], skip_special_tokens=False)!r}\n")
    stride = max(1, (len(seq) - P - drafter.config.block_size) // max(1, args.num_blocks))
    anchors = [P + i * stride for i in range(args.num_blocks) if P + i * stride < len(seq) - 1]
    views = proposals_along(target, drafter, seq, anchors, temperature=args.temperature, seed=config.seed)
    for v in views:
        print(f"anchor @ {v.anchor_position}: {tok.decode([v.anchor_token])!r}")
        conf = v.confidences or [float("nan")] * len(v.draft_tokens)
        cum = 1.0
        for k, (d, c) in enumerate(zip(v.draft_tokens, conf), start=1):
            t = v.target_tokens[k - 1] if k - 1 < len(v.target_tokens) else None
            cum *= c
            mark = "=" if d == t else " "
            print(f"  x{k}: draft {tok.decode([d])!r:>16} {mark} target {tok.decode([t]) if t is not None else '-'!r:<16} "
                  f"c={c:.3f}  a={cum:.3f}")
    return 0


def _load(args: argparse.Namespace):
    from dspark.config import load_config

    return load_config(args.config, args.overrides)


def cmd_prepare(args: argparse.Namespace) -> int:
    from dspark.runtime import load_target
    from dspark.data.prepare import prepare

    config = _load(args)
    target = load_target(config)
    result = prepare(config, target, build_cache=False if args.no_cache else None)
    print(json.dumps(result.stats, indent=2, default=str))
    print(f"data in {result.data_dir}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from dspark.runtime import load_target
    from dspark.data.cache import CacheDims, bytes_per_token, estimate_cache_size
    from dspark.data.dataset import load_rendered
    from dspark.data.prepare import cache_dir, data_dir, prepare

    config = _load(args)
    if args.estimate:
        from transformers import AutoConfig

        from dspark.hub import resolve_target_path

        hf = AutoConfig.from_pretrained(resolve_target_path(config.target.name_or_path), trust_remote_code=config.target.trust_remote_code)
        dims = CacheDims.of(hf, config.drafter.target_layer_ids)
        rendered = data_dir(config) / "rendered.jsonl"
        prec = config.data.cache_precision
        if rendered.is_file():
            samples = load_rendered(rendered)
            size = estimate_cache_size(dims, samples, prec)
            n_tok = sum(len(s.input_ids) for s in samples)
            print(f"{len(samples)} samples, {n_tok} tokens: {size / 2**20:.1f} MiB at {prec} ({size / max(1, n_tok):.0f} B/token)")
        else:
            print(f"{rendered} not found (run `dspark prepare --no-cache` first); per token at {prec}: "
                  f"{bytes_per_token(dims.hidden_size, dims.num_captured, prec, 1.0):.0f} B worst case")
        return 0
    target = load_target(config)
    prepare(config, target, build_cache=True)
    print(f"cache in {cache_dir(config)}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from dspark.runtime import build_drafter, load_target
    from dspark.config import apply_overrides
    from dspark.data.prepare import training_sources
    from dspark.train import Trainer, setup_distributed

    config = _load(args)
    rank, world, device = setup_distributed()
    if device.type == "cuda":
        config = apply_overrides(config, [f"target.device={device}"])
    torch.manual_seed(config.seed)
    target = load_target(config)
    train_src, eval_src = training_sources(config, target)
    drafter = build_drafter(config, target)
    trainer = Trainer(config, target, drafter, train_src, eval_src)
    if rank == 0:
        print(f"training {config.name}: {len(train_src)} train / {len(eval_src)} held-out samples, "
              f"{trainer.schedule.total_steps} steps of {config.train.global_batch_size} sequences on {world} rank(s)")
    result = trainer.fit(resume=args.resume)
    if rank == 0:
        last = next((r for r in reversed(result.history) if "eval_tau_prob" in r), None)
        held_out = (f"held-out tau_prob {last['eval_tau_prob']:.3f} (step {last['step']})" if last else
                    "not evaluated on held-out data (train.eval_every=0 or no held-out samples)")
        print(f"done at step {result.steps}; drafter in {result.out_dir / 'drafter'}; {held_out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from dspark.runtime import resolve_dtype
    from dspark.evaluate import evaluate
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config
    from dspark.target import TargetModel
    from dspark.train import setup_distributed

    rank, world, device = setup_distributed()
    dcfg = read_config(args.draft)
    dtype = resolve_dtype(args.dtype, device)
    target = TargetModel.from_pretrained(args.target, dcfg.target_layer_ids, dtype=dtype, device=device,
                                         trust_remote_code=args.trust_remote_code)
    overrides = {"block_size": args.block_size} if args.block_size else {}
    drafter = load_drafter(args.draft, target, dtype=dtype, device=device, **overrides)
    drafter.eval()
    if args.builtin_eval:
        from dspark.data.prompts import builtin_eval_sets

        benchmarks, names = builtin_eval_sets(), None
        if rank == 0:
            print("no benchmark files: evaluating on the built-in evaluation prompts (held out of training)")
    else:
        benchmarks, names = args.data_dir, args.benchmarks or None
    if not args.scheduler and (args.sps or args.concurrency != 1):
        raise ValueError("--sps and --concurrency need --scheduler POLICY (e.g. --scheduler algorithm1)")
    report = evaluate(
        target, drafter, benchmarks, names=names, num_samples=args.num_samples or None,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, out_dir=args.out,
        baseline=not args.no_baseline, label=args.label or None, sts_temperatures=args.sts or None,
        scheduler=args.scheduler or None, sps=args.sps or None, concurrency=args.concurrency,
    )
    if rank == 0:
        from dspark.report import report_markdown

        print(report_markdown(report))
        print(f"report: {args.out}/report.md, report.json, rounds.jsonl, plots")
    return 0


def _split_list(values: list[str], kind: type, flag: str) -> list:
    """Items of a flag given as "1,4,16", "1 4 16" or a mix."""
    items = [v.strip() for value in values for v in value.split(",") if v.strip()]
    try:
        return [kind(v) for v in items]
    except ValueError:
        raise ValueError(f"{flag}: cannot read {items} as a list of {kind.__name__}") from None


def _device(name: str):
    import torch

    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _load_target_and_drafter(args: argparse.Namespace):
    """The target and the drafter of --draft DIR (trained) or --config FILE (freshly initialised)."""
    import torch

    from dspark.runtime import build_drafter, dtype_name, resolve_dtype
    from dspark.config import apply_overrides, load_config
    from dspark.modeling import load_drafter
    from dspark.modeling.checkpoint import read_config
    from dspark.target import TargetModel

    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.draft:
        dcfg = read_config(args.draft)
        target = TargetModel.from_pretrained(args.target, dcfg.target_layer_ids, dtype=dtype, device=device,
                                             trust_remote_code=args.trust_remote_code)
        overrides = {"block_size": args.block_size} if args.block_size else {}
        drafter = load_drafter(args.draft, target, dtype=dtype, device=device, **overrides)
        origin = f"loaded from {args.draft}"
    elif args.config:
        config = load_config(args.config, [f"target.name_or_path={args.target}", f"target.device={device}",
                                           f"target.dtype={dtype_name(dtype)}",
                                           f"drafter.dtype={'float32' if dtype == torch.float16 else dtype_name(dtype)}"])
        if args.block_size:
            config = apply_overrides(config, [f"drafter.block_size={args.block_size}"])
        target = TargetModel.from_pretrained(args.target, config.drafter.target_layer_ids, dtype=dtype, device=device,
                                             trust_remote_code=args.trust_remote_code)
        drafter = build_drafter(config, target)
        origin = f"freshly initialised from {args.config} (untrained: expect τ near 1)"
    else:
        raise ValueError("give the drafter: --draft DIR (a trained drafter) or --config FILE (a fresh one)")
    return target, drafter.eval(), origin


def cmd_profile_sps(args: argparse.Namespace) -> int:
    import os

    import torch

    from dspark.runtime import dtype_name, resolve_dtype
    from dspark.report import write_profile
    from dspark.sps import DEFAULT_BATCH_TOKENS, profile_sps_runs
    from dspark.target import TargetModel

    if args.threads:
        torch.set_num_threads(args.threads)
    layer_ids = [-1]
    if args.draft:
        from dspark.modeling.checkpoint import read_config

        layer_ids = list(read_config(args.draft).target_layer_ids)
    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target = TargetModel.from_pretrained(args.target, layer_ids, dtype=dtype, device=device,
                                         trust_remote_code=args.trust_remote_code)
    sizes = _split_list(args.batch_tokens, int, "--batch-tokens") if args.batch_tokens else list(DEFAULT_BATCH_TOKENS)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"profiling {args.target} on {device} ({dtype_name(dtype)}, {torch.get_num_threads()} threads, "
          f"load average {'/'.join(f'{x:.2f}' for x in load) if load else 'n/a'}), context {args.context_len}, "
          f"B = {sizes}", flush=True)

    def show(b: int, seconds: float) -> None:
        print(f"  B = {b:>5}: {seconds * 1e3:9.2f} ms  {1 / seconds:9.2f} steps/s  {b / seconds:10.1f} tokens/s",
              flush=True)

    profile = profile_sps_runs(target, sizes, context_len=args.context_len, warmup=args.warmup, repeats=args.repeats,
                               tokens_per_request=args.tokens_per_request or None, progress=show)
    meta = {"target": args.target, "torch": torch.__version__, "load_average_before": list(load) if load else None}
    paths = write_profile(profile, args.out, meta)
    print(f"SPS table: {paths['table']} (SGLang format); timings: {paths['details']}; plot: {paths['plot']}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import torch

    from dspark.calibration import load_sts_json
    from dspark.data.render import render_prompt
    from dspark.evaluate import default_eos_ids, load_benchmark_prompts
    from dspark.scheduler import SPSTable
    from dspark.report import results_markdown, write_results
    from dspark.serving import make_policy, simulate_grid

    if args.threads:
        torch.set_num_threads(args.threads)
    concurrencies = _split_list(args.concurrency, int, "--concurrency")
    policies = _split_list(args.policy, str, "--policy")
    sps = SPSTable.from_json(args.sps)
    for spec in policies:  # fail on a bad spec before loading any model
        make_policy(spec, sps)
    target, drafter, origin = _load_target_and_drafter(args)
    gamma = drafter.config.block_size
    temps = load_sts_json(args.sts, gamma) if args.sts else None
    if args.builtin_eval:
        from dspark.data.prompts import builtin_eval_sets

        sets = load_benchmark_prompts(builtin_eval_sets(), None, args.num_prompts or None, args.seed)
    else:
        sets = load_benchmark_prompts(args.data_dir, args.benchmarks or None, args.num_prompts or None, args.seed)
    tokenizer = target.tokenizer
    # Round-robin over the benchmarks, so that any R mixes domains.
    pooled = []
    queues = [list(v) for v in sets.values()]
    while any(queues):
        for q in queues:
            if q:
                pooled.append(q.pop(0))
    prompts = [render_prompt(tokenizer, conv, enable_thinking=False) for conv in pooled]
    eos = default_eos_ids(target, tokenizer)
    print(f"target {args.target} on {target.device}; drafter {origin}; γ = {gamma}; "
          f"{len(prompts)} prompts from {', '.join(f'{n} ({len(v)})' for n, v in sets.items())}; "
          f"STS {'from ' + args.sts if temps is not None else 'off (raw confidences)'}", flush=True)

    def show(r) -> None:
        print(f"  {r.policy:>14} R = {r.concurrency:>3}: Θ = {r.throughput:9.1f} tok/s  τ = {r.tau:.2f}  "
              f"mean ℓ = {r.mean_ell:.2f}  ({r.steps} steps, {r.tokens} tokens, {r.wall_s:.0f} s wall)", flush=True)

    results = simulate_grid(
        target, drafter, prompts, concurrencies=concurrencies, policies=policies, progress=show, sps=sps,
        sts_temperatures=temps, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        eos_token_ids=eos, cycle=not args.no_cycle, num_requests=args.num_requests or None,
        draft_overhead=args.draft_overhead,
    )
    config = {
        "target": args.target, "drafter": origin, "gamma": gamma, "sps": sps.to_dict(),
        "sts_temperatures": None if temps is None else [float(t) for t in temps], "policies": policies,
        "concurrencies": concurrencies, "benchmarks": {n: len(v) for n, v in sets.items()},
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "seed": args.seed, "cycle": not args.no_cycle, "num_requests": args.num_requests or None,
        "draft_overhead": args.draft_overhead, "eos_token_ids": eos,
    }
    out = write_results(args.out, results, config)
    print()
    print(results_markdown(results))
    print(f"results: {out}/results.json, results.md, rounds.jsonl, figure8.png, frontier.png")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from dspark.calibration import calibrate_rounds
    from dspark.report import calibration_markdown, write_sts_report

    rows = []
    for source, path in enumerate(args.rounds):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
                rows.append({**row, "source": source} if len(args.rounds) > 1 else row)
    report, evaluated = calibrate_rounds(rows, fit_fraction=args.fit_fraction, seed=args.seed, n_bins=args.bins)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    paths = write_sts_report(args.out, report, evaluated, n_bins=args.bins)
    split = report["split"]
    print(f"STS fitted on {split['fit_requests']} requests ({split['fit_rounds']} rounds), "
          f"measured on the {report['evaluated_on']} part ({split['test_requests']} requests, "
          f"{split['test_rounds']} rounds)")
    print(calibration_markdown(report))
    print(f"STS: {paths['json']}; reliability diagrams: {paths['plot']}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dspark.report import compare_reports, load_report

    reports = {}
    for path in args.reports:
        rep = load_report(path)
        reports[rep.get("label") or str(path)] = rep
    table = compare_reports(reports)
    print(table)
    for key, what in (("speedup", "wall-clock speedup"), ("decode_speedup", "decode-only speedup (no prefill)")):
        speed = []
        for label, rep in reports.items():
            macro = rep.get("macro", {})
            sp = macro.get(key, {}) if isinstance(macro, dict) else {}
            if isinstance(sp, dict) and sp.get("avg") is not None and math.isfinite(sp["avg"]):
                speed.append(f"{label}: {sp['avg']:.2f}x")
        if speed:
            print(f"{what} vs target-only decoding (avg): " + ", ".join(speed))
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(table + "\n")
    return 0


def cmd_curves(args: argparse.Namespace) -> int:
    from dspark.curves import curves_table
    from dspark.plots import plot_learning_curves

    runs = {}
    for item in args.runs:
        label, _, path = item.rpartition("=") if "=" in item else (item, "", item)
        runs[label or path] = path
    print(curves_table(runs, args.key))
    if args.out:
        plot_learning_curves(runs, args.out, args.key)
        print(f"plot: {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative-decoding drafters")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("propose", help="show a drafter's proposals along the target's own continuation of a prompt")
    _add_config_args(p)
    p.add_argument("--draft", default="", help="a drafter folder (config.json + model.safetensors); default: a fresh drafter")
    p.add_argument("--prompt", default="Natalie has 3 boxes with 12 pencils each. She gives away 9 pencils. How many are left?")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=cmd_propose)

    p = sub.add_parser("prepare", help="regenerate answers with the target, render them, build the feature cache")
    _add_config_args(p)
    p.add_argument("--no-cache", action="store_true", help="stop after rendering (online feature mode)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("cache", help="build the target feature cache (or --estimate its size)")
    _add_config_args(p)
    p.add_argument("--estimate", action="store_true", help="print the size the cache will take, write nothing")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("train", help="train a drafter (torchrun for several processes)")
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="accepted length τ on the nine benchmarks (torchrun shards prompts)")
    p.add_argument("--target", default="smollm2-135m", help="hub name, local folder, or smollm2-135m")
    p.add_argument("--draft", required=True, help="a drafter folder (ours or DeepSpec's layout)")
    p.add_argument("--data-dir", default="eval_datasets", help="folder with the nine *.jsonl files")
    p.add_argument("--benchmarks", nargs="*", default=[], help="subset of benchmark names (default: all nine)")
    p.add_argument("--builtin-eval", action="store_true", help="use the built-in evaluation prompts instead of files")
    p.add_argument("--num-samples", type=int, default=0, help="prompts per benchmark (default: SPEC 6 counts)")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--block-size", type=int, default=0, help="override the drafter's γ")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-baseline", action="store_true", help="skip target-only decoding (no speedup figures)")
    p.add_argument("--label", default="", help="row label in the report tables")
    p.add_argument("--scheduler", default="", metavar="POLICY",
                   help="decode through the serving loop under a verification-length policy: " + POLICY_HELP)
    p.add_argument("--sts", default="", help="STS JSON (dspark calibrate): calibrates the scheduler's confidences "
                   "and adds calibrated confidence quality to the report")
    p.add_argument("--sps", default="", help="SPS table JSON (dspark profile-sps), for algorithm1 / async")
    p.add_argument("--concurrency", type=int, default=1, help="requests decoded in lockstep with --scheduler")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("profile-sps", help="time the target's verification forward: the SPS(B) table of SPEC 7.4")
    p.add_argument("--target", default="smollm2-135m", help="hub name, local folder, or smollm2-135m")
    p.add_argument("--out", required=True, help="the table JSON to write (SGLang format); .profile.json and .png "
                   "are written next to it")
    p.add_argument("--batch-tokens", nargs="*", default=[], help="B values, e.g. 1,2,4,8 (default 1..512, powers of 2)")
    p.add_argument("--context-len", type=int, default=512, help="tokens already in the KV cache")
    p.add_argument("--tokens-per-request", type=int, default=0,
                   help="time B/q rows of q tokens with their own caches (default: one sequence of B tokens)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per B (the median is kept)")
    p.add_argument("--draft", default="", help="a drafter folder, to capture its target layers as verification does")
    p.add_argument("--device", default="", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=cmd_profile_sps)

    p = sub.add_parser("simulate", help="serving simulation: throughput and verification budget vs concurrency "
                       "per policy (paper Fig. 8)")
    p.add_argument("--target", default="smollm2-135m", help="hub name, local folder, or smollm2-135m")
    p.add_argument("--draft", default="", help="a drafter folder (ours or DeepSpec's layout)")
    p.add_argument("--config", default="", help="or a config file: a freshly initialised drafter")
    p.add_argument("--sps", required=True, help="SPS table JSON (dspark profile-sps)")
    p.add_argument("--sts", default="", help="STS JSON (dspark calibrate); default: raw confidences")
    p.add_argument("--concurrency", nargs="+", default=["1,4,16,64"], help="R values, e.g. 1,4,16,64")
    p.add_argument("--policy", nargs="+", default=["algorithm1,async,static1,static,threshold:0.5"],
                   help="policies, comma-separated: " + POLICY_HELP)
    p.add_argument("--data-dir", default="eval_datasets", help="folder with the benchmark *.jsonl files")
    p.add_argument("--benchmarks", nargs="*", default=[], help="subset of benchmark names (default: all nine)")
    p.add_argument("--builtin-eval", action="store_true", help="use the built-in evaluation prompts instead of files")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per benchmark (seeded subset)")
    p.add_argument("--num-requests", type=int, default=0,
                   help="stop after this many requests finished (default: max(prompts, R)); prompts are cycled")
    p.add_argument("--no-cycle", action="store_true", help="serve every prompt once; the slots drain at the end")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--draft-overhead", type=float, default=0.0,
                   help="drafter time as a fraction of the verification step (default 0: ignored)")
    p.add_argument("--block-size", type=int, default=0, help="override the drafter's γ")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("calibrate", help="fit STS on eval round logs (split by request) and report calibration")
    p.add_argument("--rounds", nargs="+", required=True, help="rounds.jsonl file(s) from dspark eval / simulate")
    p.add_argument("--out", required=True, help="the STS JSON to write; <stem>_reliability.png goes next to it")
    p.add_argument("--fit-fraction", type=float, default=0.5,
                   help="share of requests to fit on (the rest is the test part)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request split")
    p.add_argument("--bins", type=int, default=20, help="ECE bins")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("compare", help="Table-1-style comparison of several eval reports")
    p.add_argument("reports", nargs="+", help="eval output folders (or report.json files)")
    p.add_argument("--out", default="", help="also write the table here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("curves", help="learning curves (held-out τ vs wall-clock minutes) of training runs")
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (a dspark train out_dir) or RUN_DIR")
    p.add_argument("--key", default="eval_tau_prob", help="logged metric to plot")
    p.add_argument("--out", default="", help="PNG path")
    p.set_defaults(func=cmd_curves)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"dspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
