"""`dspark <command>`: argument parsing and printing only; the work is done by the library.

The flags are declared once, in `dspark.cli.flags`, as shorthands for config fields."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys


def _config(args: argparse.Namespace):
    """The command's Config: --config FILE (or the defaults), then the shorthand flags, then --set."""
    from dspark.cli.flags import flag_values
    from dspark.config import apply_overrides, load_config, set_values

    config = load_config(args.config)
    config = set_values(config, flag_values(args, args.command), parse=True)
    config = apply_overrides(config, args.overrides)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    return config


def cmd_propose(args: argparse.Namespace) -> int:
    from dspark.data.render import render_prompt
    from dspark.evaluation.proposals import greedy_continuation, proposals_along
    from dspark.build import load_models

    config = _config(args)
    print(f"loading target {config.target.name_or_path} ...", flush=True)
    target, drafter, origin = load_models(config)
    print(f"target: {target.extra_repr()}\ndrafter: {origin}")
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {drafter.config.variant}, {drafter.config.num_draft_layers} layers, block γ={drafter.config.block_size}, "
          f"{n_params / 1e6:.2f} M trainable parameters (+ the target's frozen embedding / LM head)")
    tok, pc = target.tokenizer, config.propose
    prompt_ids = render_prompt(tok, [{"role": "user", "content": pc.prompt}])
    seq = greedy_continuation(target, prompt_ids, pc.max_new_tokens)
    P = len(prompt_ids)
    print(f"\nprompt: {pc.prompt!r}\ntarget (greedy): {tok.decode(seq[P:], skip_special_tokens=False)!r}\n")
    stride = max(1, (len(seq) - P - drafter.config.block_size) // max(1, pc.num_blocks))
    anchors = [P + i * stride for i in range(pc.num_blocks) if P + i * stride < len(seq) - 1]
    views = proposals_along(target, drafter, seq, anchors, temperature=pc.temperature, seed=config.seed)
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


def cmd_prepare(args: argparse.Namespace) -> int:
    from dspark.data.prepare import check_prepare_inputs, prepare
    from dspark.build import load_target

    config = _config(args)
    check_prepare_inputs(config)  # before the minutes a target takes to load
    result = prepare(config, load_target(config))
    print(json.dumps(result.stats, indent=2, default=str))
    print(f"data in {result.data_dir}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from dspark.data.prepare import cache_dir, check_prepare_inputs, estimate_cache, prepare
    from dspark.build import load_target

    config = _config(args)
    if args.estimate:
        print(estimate_cache(config))
        return 0
    check_prepare_inputs(config)
    prepare(config, load_target(config), build_cache=True)
    print(f"cache in {cache_dir(config)}")
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from dspark.data.vocab_counts import write_draft_vocab
    from dspark.build import load_target

    config = _config(args)
    ks = sorted({1024, 2048, 4096, 8192, 16384, 32768, config.drafter.draft_vocab_size})
    path, info = write_draft_vocab(config, load_target(config), ks=ks)
    cov, n = info["coverage"], info["supervised_tokens"]
    print(f"draft vocabulary of {config.drafter.draft_vocab_size} ids ({info['mode']} counts) in {path}")
    print(f"coverage: {cov['train']:.2%} of {n['train']} training tokens ({info['distinct_train_ids']} distinct ids), "
          f"{cov['held-out']:.2%} of {n['held-out']} held-out tokens")
    print("\n| counts | k | train | held-out |\n|---|---:|---:|---:|")
    for row in info.get("table", []):
        print(f"| {row['mode']} | {row['k']} | {row['train']:.2%} | {row['held-out']:.2%} |")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from dspark.data.prepare import training_sources
    from dspark.build import build_drafter, init_layer_ids, load_target
    from dspark.training.distributed import setup_distributed
    from dspark.training.trainer import Trainer

    config = _config(args)
    rank, world, _ = setup_distributed()
    torch.manual_seed(config.seed)
    target = load_target(config)
    init_layer_ids(config, target)  # drafter.init_from_target fits the target: checked before the data work
    train_src, eval_src = training_sources(config, target)
    drafter = build_drafter(config, target)
    if config.drafter.draft_vocab_size:
        from dspark.modeling.vocab import DraftVocab

        drafter.set_vocab(DraftVocab.load(_draft_vocab_file(config, target, rank, world)))
    trainer = Trainer(config, target, drafter, train_src, eval_src)
    if rank == 0:
        print(f"training {config.name}: {len(train_src)} train / {len(eval_src)} held-out samples, "
              f"{trainer.schedule.total_steps} steps of {config.train.global_batch_size} sequences on {world} rank(s)")
    result = trainer.fit(resume=config.train.resume)
    if rank == 0:
        last = next((r for r in reversed(result.history) if "eval_tau_prob" in r), None)
        held_out = (f"held-out tau_prob {last['eval_tau_prob']:.3f} (step {last['step']})" if last else
                    "not evaluated on held-out data (train.eval_every=0 or no held-out samples)")
        print(f"done at step {result.steps}; drafter in {result.out_dir / 'drafter'}; {held_out}")
    return 0


def _draft_vocab_file(config, target, rank: int, world: int):
    """The draft vocabulary file of ``config``; at its default place (no ``drafter.draft_vocab``) a
    missing one is counted from the prepared data first, as `dspark vocab` does (rank 0 writes it)."""
    from dspark.data.vocab_counts import vocab_path, write_draft_vocab

    path = vocab_path(config)
    if not path.is_file() and not config.drafter.draft_vocab:
        if rank == 0:
            path, info = write_draft_vocab(config, target)
            print(f"draft vocabulary of {config.drafter.draft_vocab_size} ids written to {path} "
                  f"({info['coverage']['held-out']:.2%} of held-out tokens covered)")
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
    return path


def cmd_eval(args: argparse.Namespace) -> int:
    from dspark.evaluation.eval_config import check_config_folder, check_eval_inputs, evaluate_from_config
    from dspark.evaluation.report import report_markdown
    from dspark.build import load_models
    from dspark.training.distributed import setup_distributed

    config = _config(args)
    resume = _resume_mode(args)
    rank, _, _ = setup_distributed()
    check_eval_inputs(config)
    if rank == 0:
        check_config_folder(config.path(config.eval.out, "eval"), config, resume)
    target, drafter, origin = load_models(config)
    if rank == 0:
        print(f"target {config.target.name_or_path} on {target.device}; drafter {origin}", flush=True)
        if config.eval.builtin_prompts:
            print("evaluating on the built-in evaluation prompts (held out of training)")
    report = evaluate_from_config(target, drafter, config, resume=resume)
    out = config.path(config.eval.out, "eval")
    if rank == 0 and len(config.serve.policy) > 1:
        from dspark.evaluation.evaluate import policy_folder

        for one in report.values():
            print(report_markdown(one))
        folders = ", ".join(policy_folder(p, config.serve.concurrency) for p in report)
        print(f"reports: {out}/{{{folders}}}/report.md, report.json, rounds.jsonl, config.json, plots")
    elif rank == 0:
        print(report_markdown(report))
        print(f"report: {out}/report.md, report.json, rounds.jsonl, config.json, plots")
    return 0


def _resume_mode(args: argparse.Namespace) -> bool | None:
    """--resume: True, --overwrite: False, neither: None (continue a folder of the same config)."""
    if args.resume_run and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other: --resume continues the folder's "
                         "results, --overwrite deletes them; pass one")
    return True if args.resume_run else False if args.overwrite else None


def cmd_report(args: argparse.Namespace) -> int:
    import numpy as np

    from dspark.evaluation.evaluate import report_from_folder
    from dspark.evaluation.report import report_markdown, write_outputs

    report, records, rounds = report_from_folder(args.folder)
    temps = report["config"].get("sts_temperatures")
    write_outputs(args.folder, report, records, rounds, temperatures=None if temps is None else np.asarray(temps))
    print(report_markdown(report))
    print(f"report rebuilt from {len(records)} requests and {len(rounds)} rounds: {args.folder}/report.md, report.json")
    return 0


def cmd_profile_sps(args: argparse.Namespace) -> int:
    from dspark.evaluation.scheduling_runs import profile_sps

    config = _config(args)

    from tqdm import tqdm

    bar = None

    def show(done: int, repeats: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=repeats, desc="sweeps over B", unit="sweep")
        bar.update(done - bar.n)
        if done == repeats:
            bar.close()

    paths = profile_sps(config, progress=show, announce=lambda text: print(text, flush=True))
    print(f"SPS table: {paths['table']} (SGLang format); timings: {paths['details']}; plot: {paths['plot']}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dspark.evaluation.report import results_markdown
    from dspark.evaluation.scheduling_runs import simulate

    config = _config(args)

    def show(r) -> None:
        print(f"  {r.policy:>14} R = {r.concurrency:>3}: Θ = {r.throughput:9.1f} tok/s  τ = {r.tau:.2f}  "
              f"mean ℓ = {r.mean_ell:.2f}  ({r.steps} steps, {r.tokens} tokens, {r.wall_s:.0f} s wall)", flush=True)

    results, out = simulate(config, progress=show, announce=lambda text: print(text, flush=True),
                            resume=_resume_mode(args))
    print()
    print(results_markdown(results))
    print(f"results: {out}/results.json, results.md, rounds.jsonl, config.json, figure8.png, frontier.png")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dspark.evaluation.scheduling_runs import calibrate
    from dspark.evaluation.report import calibration_markdown

    config = _config(args)
    report, paths = calibrate(config)
    split = report["split"]
    print(f"STS fitted on {split['fit_requests']} requests ({split['fit_rounds']} rounds), "
          f"measured on the {report['evaluated_on']} part ({split['test_requests']} requests, "
          f"{split['test_rounds']} rounds)")
    print(calibration_markdown(report))
    fit = report["sts_fit"]
    kept = [(k + 1, why) for k, why in enumerate(report["kept"]) if why]
    print(f"T_k kept at 1 (min_events={fit['min_events']}, folds={fit['folds']}): "
          + ("; ".join(f"k={k}: {why}" for k, why in kept) if kept else "none"))
    print(f"STS: {paths['json']}; reliability diagrams: {paths['plot']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dspark.interop.export import SERVE_NAME, export_drafter
    from dspark.modeling import load_drafter

    drafter = load_drafter(args.drafter)
    try:
        has_tables = bool(drafter.shared_weights())
    except RuntimeError:
        has_tables = False
    # DeepSpec takes both tables; EAGLE-3 and draft-vocabulary layouts take the LM head (rows).
    config = drafter.config
    needs = {"deepspec": "DeepSpec needs them in the folder"}.get(args.to) or (
        "the EAGLE-3 layout holds the LM head" if config.variant == "eagle3" and args.to in ("vllm", "sglang") else
        "the EAGLE-3 GGUF holds the LM head" if config.variant == "eagle3" and args.to == "llamacpp" else
        "a draft vocabulary's LM head rows go into the folder" if config.draft_vocab_size and args.to in ("vllm", "llamacpp") else "")
    if needs and not has_tables:
        if not args.target:
            raise ValueError(f"{args.drafter} holds no embedding / LM head and {needs}: "
                             "pass --target (the drafter's target) to take them from it")
        from dspark.target import TargetModel

        target = TargetModel.from_pretrained(args.target, drafter.config.target_layer_ids)
        drafter = load_drafter(args.drafter, target)
    folder = export_drafter(drafter, args.out, args.to, target=args.target or None, sts=args.sts or None,
                            sps=args.sps or None, outtype=args.outtype or None, tokenizer_pre=args.tokenizer_pre or None,
                            rounds=args.rounds or None, costs=args.costs or None)
    print(f"exported {args.drafter} for {args.to} to {folder}\n")
    print((folder / SERVE_NAME).read_text())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dspark.evaluation.compare import compare_reports, load_report, write_comparison

    reports, folders = {}, {}
    for path in args.reports:
        rep = load_report(path)
        label = rep.get("label") or str(path)
        if label in reports:  # two reports of one label (e.g. the same drafter at two settings): keep both
            label = str(path)
        reports[label], folders[label] = rep, path
    table = compare_reports(reports, folders)
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
        out, figure = write_comparison(reports, args.out, folders)
        print(f"\nwrote {out} and its conditional-acceptance figure {figure}")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from dspark.evaluation.demo_page import write_summary

    path, short = write_summary(args.run_dir)
    print(short)
    print(f"summary with the plots linked: {path}")
    return 0


def cmd_curves(args: argparse.Namespace) -> int:
    from dspark.evaluation.curves import curves_table
    from dspark.evaluation.plots import plot_learning_curves

    runs = {}
    for item in args.runs:
        label, _, path = item.rpartition("=") if "=" in item else (item, "", item)
        runs[label or path] = path
    print(curves_table(runs, args.key))
    if args.out:
        plot_learning_curves(runs, args.out, args.key)
        print(f"plot: {args.out}")
    return 0


def _millions(n: int) -> str:
    return f"{n / 1e6:.3f} M" if n >= 1e5 else f"{n:,}"


def _describe_lines(desc) -> list[str]:
    """The description as `key: value` lines."""
    p = desc.params
    frozen = (f"{_millions(p.frozen)} in frozen copies of the target's {' and '.join(p.frozen_tensors)}"
              if p.frozen_tensors else "no embedding / LM head in the file (the target's are used)")
    gamma = "?" if desc.gamma is None else str(desc.gamma)
    layout = {"anchor_first": "anchor-first (slot k predicts anchor + k + 1; every slot is a draft)",
              "anchor_plus_masks": "anchor + γ masks (slot 0 is the anchor, slot k predicts anchor + k)"}
    lines = [
        f"folder: {desc.path}",
        f"format: {desc.format} ({desc.format_summary}); architectures {desc.architecture}",
        f"algorithm: {desc.algorithm}",
        f"block layout: {layout.get(desc.block_layout or '', desc.block_layout or 'n/a')}",
        f"γ (drafts per block): {gamma} (block_size in config.json: {desc.block_size})",
        f"target layer ids: {desc.target_layer_ids} of a {desc.num_target_layers or '?'}-layer target; "
        f"convention: {desc.layer_convention}",
        f"mask token id: {desc.mask_token_id}",
        *[f"head: {h}" for h in desc.heads],
        f"draft vocabulary: {desc.draft_vocab_size or 'the full target vocabulary'}",
        f"sizes: hidden {desc.hidden_size}, vocabulary {desc.vocab_size}",
        f"parameters: {_millions(p.trainable)} trainable; {frozen}",
        "stored dtypes: " + ", ".join(f"{k} ({_millions(n)} parameters)" for k, n in sorted(desc.dtypes.items())),
    ]
    return lines + [f"note: {n}" for n in desc.notes]


def render_inspection(inspection) -> str:
    """`dspark inspect`'s report (a dspark.interop.inspect.Inspection) as text: the description,
    then the target checks and the decode runs."""
    lines = _describe_lines(inspection.description)
    check = inspection.check
    if check is not None:
        f = check.facts
        lines += ["", f"target: {f.name} ({f.num_layers} layers, hidden {f.hidden_size}, vocabulary {f.vocab_size})"]
        marks = {"ok": "ok     ", "warning": "WARNING", "error": "ERROR  "}
        lines += [f"  {marks[x.level]} {x.message}" for x in check.findings]
        if check.runs:
            lines.append(f"decode check ({check.prompts}):")
            lines += [f"  {r.label:<32} {r.mean_accepted:5.2f} accepted per round  τ = {r.tau:.2f}  ({r.rounds} rounds)"
                      for r in check.runs]
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from dspark.interop.inspect import inspect_drafter, problems

    if args.target:
        print(f"loading target {args.target} ...", flush=True)
    inspection = inspect_drafter(args.path, args.target or None, dtype=args.dtype, num_prompts=args.num_prompts,
                                 max_new_tokens=args.max_new_tokens, diagnose=args.diagnose)
    print(render_inspection(inspection))
    return 1 if problems(inspection) else 0


def build_parser() -> argparse.ArgumentParser:
    from dspark.cli.flags import COMMANDS, add_config_flags

    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative-decoding drafters")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (help_text, _) in COMMANDS.items():
        p = sub.add_parser(command, help=help_text)
        add_config_flags(p, command)
        p.set_defaults(func=globals()["cmd_" + command.replace("-", "_")])
        if command in ("eval", "simulate"):
            p.add_argument("--resume", dest="resume_run", action="store_true",
                           help="continue the results in the output folder (the default when its config.json "
                                "matches; with --resume a folder without results is an error)")
            p.add_argument("--overwrite", action="store_true",
                           help="start over: delete the results in the output folder first")
        if command == "cache":
            p.add_argument("--estimate", action="store_true", help="print the size the cache will take, write nothing")

    p = sub.add_parser("export", help="write a drafter in the layout vLLM / SGLang / DeepSpec / z-lab / llama.cpp loads, with SERVE.md")
    p.add_argument("drafter", help="drafter folder (any layout load_drafter reads)")
    p.add_argument("--to", required=True, choices=["vllm", "sglang", "deepspec", "zlab", "llamacpp"], help="destination "
                   "(llamacpp: draft.gguf with the target's tokenizer, which --target gives)")
    p.add_argument("--out", required=True, help="output folder (replaced atomically)")
    p.add_argument("--target", default="", help="the target (name or path): named in SERVE.md; gives DeepSpec "
                   "exports the embedding / LM head when the drafter folder has none")
    p.add_argument("--sts", default="", help="STS JSON (dspark calibrate): SGLang DSpark copies it next to the weights; "
                   "llamacpp folds one shared temperature into the confidence head")
    p.add_argument("--sps", default="", help="SGLang DSpark: SPS table JSON (dspark profile-sps), copied next to the weights")
    p.add_argument("--outtype", default="", choices=["", "f16", "bf16", "f32"],
                   help="llamacpp: the GGUF's matrix type (default f16; norms, biases stay f32)")
    p.add_argument("--tokenizer-pre", default="", help="llamacpp: llama.cpp's pre-tokenizer name for a target "
                   "tokenizer dspark does not recognise (tokenizer.ggml.pre of a GGUF of the target)")
    p.add_argument("--rounds", default="", help="llamacpp: a greedy `dspark eval` folder of this drafter (or its "
                   "rounds.jsonl), on prompts apart from those you will measure; with --costs, SERVE.md gets the "
                   "chosen --spec-draft-n-max / --spec-draft-p-min and their predicted speed")
    p.add_argument("--costs", default="", help="llamacpp: the engine's cost table of this drafter "
                   "(bench/llamacpp.py --costs)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="rebuild report.json, report.md and the plots of a `dspark eval` folder "
                       "from its requests.jsonl, rounds.jsonl and settings.json, without decoding")
    p.add_argument("folder", help="a dspark eval output folder")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="Table-1-style comparison of several eval reports")
    p.add_argument("reports", nargs="+", help="eval output folders (or report.json files)")
    p.add_argument("--out", default="", help="also write the markdown here, and the drafters' conditional-acceptance "
                   "figure next to it (report.md -> report-acceptance.png, linked from it)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("summary", help="the summary of a scripts/demo.sh run folder: README.md in it, a short version printed")
    p.add_argument("run_dir", help="the run folder (e.g. runs/demo)")
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("curves", help="learning curves (held-out τ vs wall-clock minutes) of training runs")
    p.add_argument("runs", nargs="+", help="LABEL=RUN_DIR (a dspark train out_dir) or RUN_DIR")
    p.add_argument("--key", default="eval_tau_prob", help="logged metric to plot")
    p.add_argument("--out", default="", help="PNG path")
    p.set_defaults(func=cmd_curves)

    from dspark.build import DTYPE_CHOICES

    p = sub.add_parser("inspect", help="what a drafter folder is; with --target, whether it fits that target")
    p.add_argument("path", help="a drafter folder (ours, DeepSpec's, z-lab's) or a training run folder: its final drafter/, else its latest checkpoint (the folder `dspark eval --draft` reads)")
    p.add_argument("--target", default="", help="target name or folder: check sizes and decode a few prompts")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="dtype of the target for the decode check")
    p.add_argument("--num-prompts", type=int, default=3, help="built-in prompts decoded greedily")
    p.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per prompt in the decode check")
    p.add_argument("--diagnose", default="auto", choices=("auto", "always", "never"),
                   help="re-run the decode with shifted layer ids, the other block layout and other mask "
                        "tokens (auto: when the acceptance is low)")
    p.set_defaults(func=cmd_inspect)
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
