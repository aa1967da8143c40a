"""τ per CPU-minute: training recipes for one target compared at the same wall-clock budget.

Each variant is a set of `--set` overrides on one drafter config, trained on the same prepared data
(a `dspark prepare` folder: answers and feature cache) under the same `train.max_wall_minutes`
cap, then evaluated on the benchmarks with every draft verified. The table gives, per variant:
optimizer steps and training minutes, held-out τ_prob at the end (from the run's train_log.jsonl,
the training-time estimate of Eq. 8 on held-out answers), benchmark τ with its 95 % bootstrap
interval over requests (greedy and, with --temperatures 0 1, at T = 1), and the conditional
acceptance at positions 1-3 of the block with the rounds each rests on. The figure is held-out
τ_prob against training minutes for every variant (`dspark curves`), the curves behind the table.

A variant wins where its benchmark τ beats the baseline's (``--baseline``, default "base") beyond
the noise: the column "τ / baseline" is the paired ratio on the same requests (the stratified
bootstrap of dspark.evaluation.paired, one draw of requests weighing both runs), tighter than
comparing the two separate intervals; a ratio interval above 1 is a win. The held-out column moves
first and is the cheaper signal, the benchmark columns are the ones that count (out of the training
distribution).

The study ranks variants on the dev prompts of each benchmark only: every evaluation runs with
`--split dev` (dspark.data.benchmarks.split_prompts). Dev and test never share a prompt, so the recipe
chosen here is reported with `dspark eval --split test` on prompts the choice never saw; `--split`
refuses any other part.

Run (after `bash scripts/demo.sh` has prepared runs/demo/data, or any `dspark prepare` folder):

    python bench/recipe_study.py --data runs/demo/data --out runs/study --minutes 4.5
    python bench/recipe_study.py --only base init_spread --variant mine=train.lr=2e-3

A variant may train on other data: `--variant more=data.data_dir=FOLDER,train.epochs=28` (a folder
written by `dspark prepare --set data.train_prompts=builtin+self:400 ...`) compares a data lever on
the same benchmark requests.

Runs resume: a trained variant (drafter/config.json present) is not trained again, an evaluated
one (report.json present) not evaluated again; delete a variant's folder to redo it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark.io.atomic import atomic_write_text  # noqa: E402  (after the path above)

# The study's starting recipe, pinned so that the table does not move with the demo config: the
# config's drafter (2 layers, MLP 1024) at γ = 7 and k = 16,384, trained 3 epochs at batch 8 with 64
# anchors per sequence, held-out τ_prob every 8 steps. Each variant changes one lever of it (its
# overrides come after these and win).
STUDY_RECIPE: list[str] = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.num_anchors=64",
                           "drafter.block_size=7",
                           "train.eval_every=8"]  # held-out τ every 8 steps: the curves; ~1.3 s each, inside the cap
# The demo's recipe (config/dspark/dspark_smollm2_135m.py) is "g4v8"; the last three variants look at
# held-out τ every 32 steps, as the demo does.
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "lr3e-3": ["train.lr=3e-3"],
    "init_last": ["drafter.intermediate_size=None", "drafter.init_from_target=last"],  # the target's MLP width (1536)
    "init_spread": ["drafter.intermediate_size=None", "drafter.init_from_target=spread"],
    "wide": ["drafter.intermediate_size=None"],  # the control of the two above: that width, random init
    "gamma4": ["drafter.block_size=4"],
    "vocab8k": ["drafter.draft_vocab_size=8192"],
    "one_layer": ["drafter.num_draft_layers=1", "train.epochs=5"],  # ~ the minutes of two layers x 3 epochs
    "anchors32": ["data.num_anchors=32", "train.epochs=5"],  # half the blocks per sequence, more steps
    "epochs5": ["train.epochs=5"],  # the cap stops it: more epochs in the same minutes, a higher LR at the end
    "batch4": ["train.global_batch_size=4"],  # twice the optimizer steps over the same 3 epochs
    "batch2": ["train.global_batch_size=2", "train.micro_batch_size=2"],  # four times the steps
    "batch1": ["train.global_batch_size=1", "train.micro_batch_size=1"],  # eight times the steps
    "b2a32": ["train.global_batch_size=2", "train.micro_batch_size=2", "data.num_anchors=32",
              "train.epochs=5"],  # the two step-buying levers together
    "e8": ["train.global_batch_size=2", "train.micro_batch_size=2", "data.num_anchors=32",
           "train.epochs=8"],  # b2a32 over more epochs, for a 6-minute cap (--minutes 6)
    "e12a16": ["train.global_batch_size=2", "train.micro_batch_size=2", "data.num_anchors=16",
               "train.epochs=12", "train.eval_every=32"],  # half the anchors: cheaper steps, more epochs
    "g4": ["train.global_batch_size=2", "train.micro_batch_size=2", "data.num_anchors=16", "drafter.block_size=4",
           "train.epochs=16", "train.eval_every=32"],  # γ = 4: cheaper steps again
    "g4v8": ["train.global_batch_size=2", "train.micro_batch_size=2", "data.num_anchors=16", "drafter.block_size=4",
             "drafter.draft_vocab_size=8192", "train.epochs=20", "train.eval_every=32"],  # and k = 8,192: the demo's
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="config/dspark/dspark_smollm2_135m.py")
    p.add_argument("--data", default="runs/demo/data", help="a `dspark prepare` folder (data.data_dir)")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--minutes", type=float, default=4.5, help="train.max_wall_minutes of every variant")
    p.add_argument("--epochs", type=float, default=3.0, help="train.epochs unless a variant sets it")
    p.add_argument("--vocab", type=int, default=16384, help="drafter.draft_vocab_size unless a variant sets it")
    p.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="an extra variant; its overrides separated by commas")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--eval-data", default=os.environ.get("DSPARK_EVAL_DATA", ""),
                   help="benchmark folder (default $DSPARK_EVAL_DATA; empty: the built-in prompts)")
    p.add_argument("--num-samples", type=int, default=4, help="prompts per benchmark, drawn from its dev part")
    p.add_argument("--split", default="dev", help="the benchmark prompts evaluated: dev, the only one a study reads")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0])
    p.add_argument("--baseline", default="base",
                   help="the variant every other one is paired against (its run must be in --out)")
    p.add_argument("--figure", default="", help="PNG of held-out τ_prob against minutes (default OUT/curves.png)")
    args = p.parse_args(argv)
    if args.split != "dev":
        raise SystemExit(f"--split {args.split}: a study chooses recipes on the dev prompts and results are "
                         "reported on test, so a study reads dev only; drop --split (evaluate the chosen recipe "
                         "with `dspark eval --split test`)")
    return args


def variants_of(args: argparse.Namespace) -> dict[str, list[str]]:
    variants = dict(VARIANTS)
    for spec in args.variant:
        name, sep, sets = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant {spec!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
        variants[name] = [s for s in sets.split(",") if s]
        for s in variants[name]:
            if "=" not in s:
                raise SystemExit(f"--variant {spec!r}: override {s!r} is not KEY=VALUE")
    if args.only is not None:
        unknown = sorted(set(args.only) - set(variants))
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; known: {sorted(variants)}")
        variants = {k: variants[k] for k in args.only}
    return variants


def _dspark(*cli: str) -> None:
    subprocess.run([sys.executable, "-m", "dspark.cli", *cli], check=True, cwd=ROOT)


def train(args, name: str, sets: list[str]) -> Path:
    out = Path(args.out) / name
    if (out / "drafter" / "config.json").exists():
        return out
    keys = {s.split("=", 1)[0] for s in sets}
    base = [f"data.data_dir={args.data}", f"out_dir={out}", f"train.max_wall_minutes={args.minutes}", *STUDY_RECIPE]
    if "train.epochs" not in keys:
        base.append(f"train.epochs={args.epochs}")
    if "drafter.draft_vocab_size" not in keys:
        base.append(f"drafter.draft_vocab_size={args.vocab}")
    _dspark("train", "--config", args.config, "--resume", "--set", *base, *sets)
    return out


def evaluate(args, run: Path, temperature: float) -> dict:
    out = run / f"eval-T{temperature}"
    if not (out / "report.json").exists():
        data = ["--data-dir", args.eval_data] if args.eval_data else ["--builtin-eval"]
        _dspark("eval", "--target", args.target, *data, "--split", args.split, "--num-samples", str(args.num_samples),
                "--max-new-tokens", str(args.max_new_tokens), "--draft", str(run / "drafter"),
                "--temperature", str(temperature), "--no-baseline", "--label", run.name, "--out", str(out))
    report = json.loads((out / "report.json").read_text())
    split = report.get("config", {}).get("split", "all")
    if split != args.split:
        raise SystemExit(f"{out} holds an evaluation of the {split!r} prompts, not {args.split!r}; delete that "
                         "folder to evaluate the variant on dev (its trained drafter is kept)")
    return report


def training_summary(run: Path) -> dict:
    """Steps, minutes and the held-out τ_prob at the start and the end of a run's train_log.jsonl."""
    from dspark.evaluation.curves import curve, read_log

    rows = read_log(run)
    evals = curve(rows, "eval_tau_prob")  # (minutes, value, step)
    return {"steps": rows[-1]["step"], "minutes": rows[-1].get("wall_min", 0.0),
            "heldout_tau_prob": evals[-1][1] if evals else None,
            "heldout_tau_prob_start": evals[0][1] if evals else None}


def benchmark_summary(report: dict) -> dict:
    macro, pooled = report["macro"], report["all"]
    return {"tau": macro["tau"]["avg"], "tau_ci": macro["tau_ci"]["avg"],
            "requests": pooled["num_requests"], "rounds": pooled["num_rounds"],
            "cond_accept": pooled["conditional_acceptance"][:3],
            "cond_accept_den": pooled["conditional_acceptance_den"][:3]}


def paired_summary(run: Path, baseline: Path, temperature: float) -> dict | None:
    """The paired τ ratio of ``run`` over ``baseline`` on their common requests at ``temperature``
    (estimate, 95 % interval, requests), None when the baseline was not evaluated there."""
    from dspark.evaluation.paired import paired_ratio

    a, b = run / f"eval-T{temperature}", baseline / f"eval-T{temperature}"
    if run == baseline or not (a / "report.json").exists() or not (b / "report.json").exists():
        return None
    paired = paired_ratio(a, b)
    if paired.tau is None:
        return None
    tau = paired.tau
    return {"ratio": float(tau.estimate), "ci": [float(tau.lo), float(tau.hi)], "requests": paired.common}


def table(results: dict[str, dict], temperatures: list[float], baseline: str = "base") -> str:
    head = ["variant", "overrides", "steps", "min", "held-out τ_prob"]
    for t in temperatures:
        head += [f"τ T={t:g} [95 %]", f"τ / {baseline} T={t:g} [95 %, paired]", f"cond. accept 1/2/3 T={t:g} (rounds)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        tr = r["train"]
        cells = [name, " ".join(r["sets"]) or "(the recipe)", str(tr["steps"]), f"{tr['minutes']:.1f}",
                 "n/a" if tr["heldout_tau_prob"] is None else f"{tr['heldout_tau_prob']:.3f}"]
        for t in temperatures:
            b = r["bench"][str(t)]
            lo, hi = b["tau_ci"]
            acc = "/".join("–" if a is None else f"{a:.2f}" for a in b["cond_accept"])
            dens = "/".join(str(d) for d in b["cond_accept_den"])
            p = b.get("paired")
            ratio = "–" if not p else f"{p['ratio']:.3f} [{p['ci'][0]:.3f}, {p['ci'][1]:.3f}]"
            cells += [f"{b['tau']:.3f} [{lo:.3f}, {hi:.3f}]", ratio, f"{acc} ({dens})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def design(args: argparse.Namespace) -> dict:
    """What makes two variants' rows comparable: the cap, the config, the data and the evaluation."""
    return {"minutes_cap": args.minutes, "config": args.config, "data": args.data, "split": args.split,
            "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens}


def previous_results(out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """The rows an earlier call wrote to ``out/study.json`` under the same design, with every
    temperature asked for now and their run folder still there ({} otherwise): a study run one
    variant at a time (``--only``) keeps one table."""
    path = out / "study.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if any(old.get(k) != v for k, v in design(args).items()):
        print(f"{path}: written under another design; its rows are not carried over", flush=True)
        return {}
    return {name: r for name, r in old.get("results", {}).items()
            if (out / name).is_dir() and all(str(t) in r.get("bench", {}) for t in args.temperatures)}


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = variants_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = previous_results(out, args)

    def save() -> None:
        for name, r in results.items():  # every row against the current baseline
            for t in args.temperatures:
                r["bench"][str(t)]["paired"] = paired_summary(out / name, out / args.baseline, t)
        atomic_write_text(out / "study.json", json.dumps(
            {**design(args), "baseline": args.baseline, "results": results}, indent=2))

    for name, sets in variants.items():
        print(f"== {name}: {' '.join(sets) or '(the recipe)'}", flush=True)
        run = train(args, name, sets)
        bench = {str(t): benchmark_summary(evaluate(args, run, t)) for t in args.temperatures}
        results[name] = {"sets": sets, "train": training_summary(run), "bench": bench}
        save()
    save()
    text = table(results, args.temperatures, args.baseline)
    atomic_write_text(out / "study.md", text + "\n")
    print(text)
    from dspark.evaluation.plots import plot_learning_curves

    figure = args.figure or str(out / "curves.png")
    plot_learning_curves({name: str(out / name) for name in results}, figure, "eval_tau_prob")
    print(f"table: {out / 'study.md'}  figure: {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
