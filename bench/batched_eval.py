"""Evaluation throughput of batched speculative decoding against batch 1 (SmolLM2-135M on CPU).

The same requests (test prompts of the benchmarks, each with its own seed) are decoded

- one at a time by ``dspark.decoding.loop.speculative_generate`` (the batch-1 evaluation loop) and
  ``target_generate`` (its target-only baseline);
- by ``dspark.decoding.batch_jobs.speculative_batch_generate`` and ``target_batch_generate`` at every
  R of ``--rows`` (R requests per forward, rows refilled as requests finish, longest prompt first
  as ``dspark eval`` admits them).

It prints tokens/s of each, the ratio to the batch-1 loop of the same kind (measured in this
process), τ (which must not depend on R: every request decodes the same tokens), the speedup
over target-only decoding at the same R, and whether each request's tokens equal batch 1's.

    .venv/bin/python bench/batched_eval.py [--draft runs/demo/dspark_smollm2_135m/drafter] [--requests 32]
        [--max-new-tokens 128] [--rows 1 2 4 8 16] [--temperature 1.0] [--threads 2] [--device cpu]

Without ``--draft`` the drafter is freshly initialised (τ near 1: only the costs mean anything).
Benchmark prompts come from ``$DSPARK_EVAL_DATA`` (test split), else the built-in prompts.

``--whole N`` times whole evaluations instead (``dspark.evaluation.evaluate.evaluate``, what
``dspark eval`` runs: every request decoded speculatively and by the target alone for its speedup,
N test prompts per benchmark), at batch 1 and at every R of ``--rows``, in this process: the
evaluation's seconds, its ratio to batch 1, τ, and the seconds of the speculative decodes and of the
target-only ones (at every R the target-only decode starts from the speculative decode's prefills).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parents[1] / "config" / "dspark" / "dspark_smollm2_135m.py"


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    from dspark.data.benchmarks import BENCHMARKS, load_prompts
    from dspark.data.prompts import builtin_eval_sets
    from dspark.data.render import render_prompt

    folder = os.environ.get("DSPARK_EVAL_DATA")
    if folder and Path(folder).is_dir():
        sources = {n: Path(folder) / f"{n}.jsonl" for n in BENCHMARKS if (Path(folder) / f"{n}.jsonl").is_file()}
    else:
        sources = dict(builtin_eval_sets())
    per = -(-count // len(sources))
    convs = [c for source in sources.values() for c in load_prompts(source, per, seed, "test")]
    # interleave benchmarks (the batched runs admit them longest first, as dspark eval does)
    convs = [convs[i] for i in sorted(range(len(convs)), key=lambda i: (i % per, i))][:count]
    return [render_prompt(tokenizer, c, enable_thinking=False) for c in convs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="a trained drafter folder (default: a fresh one)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-baseline", action="store_true", help="skip the target-only decodes")
    ap.add_argument("--whole", type=int, default=0, metavar="N",
                    help="time whole evaluations (speculative + target-only) of N prompts per benchmark instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dspark.build import load_models
    from dspark.config import load_config
    from dspark.decoding.batch_jobs import BatchJob, longest_first, speculative_batch_generate, target_batch_generate
    from dspark.decoding.loop import speculative_generate, target_generate
    from dspark.evaluation.evaluate import default_eos_ids
    from dspark.seeds import derive_seed

    overrides = [f"target.device={args.device}"] + ([f"eval.draft={args.draft}"] if args.draft else [])
    config = load_config(str(CONFIG), overrides)
    target, drafter, origin = load_models(config)
    eos = default_eos_ids(target, target.tokenizer)
    ids = prompts(target.tokenizer, args.requests, config.eval.seed)
    seeds = [derive_seed(1234, 0, i) for i in range(len(ids))]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_token_ids=eos)
    dev = target.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"# batched evaluation, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, device {dev}, dtype {target.dtype}; drafter {origin}")
    print(f"# {len(ids)} requests, prompt tokens median {statistics.median(map(len, ids)):.0f}, "
          f"max_new_tokens {args.max_new_tokens}, T = {args.temperature}")

    if args.whole:
        whole_evaluations(target, drafter, config, args)
        return

    def gen(i):
        return torch.Generator(device=dev).manual_seed(seeds[i])

    # untimed warm-up of every path
    speculative_generate(target, drafter, ids[0], generator=gen(0), **{**kw, "max_new_tokens": 8})
    speculative_batch_generate(target, drafter, [BatchJob(p, seeds[i]) for i, p in enumerate(ids[:4])],
                               batch_size=4, **{**kw, "max_new_tokens": 8})
    target_batch_generate(target, [BatchJob(p, seeds[i]) for i, p in enumerate(ids[:4])], batch_size=4,
                          **{**kw, "max_new_tokens": 8})

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - start

    ref, spec1_s = timed(lambda: [speculative_generate(target, drafter, p, generator=gen(i), **kw)
                                  for i, p in enumerate(ids)])
    tokens = sum(len(r.tokens) for r in ref)
    rounds = [x for r in ref for x in r.rounds]
    tau1 = sum(x.tau for x in rounds) / len(rounds)
    base1_s = None
    if not args.no_baseline:
        base, base1_s = timed(lambda: [target_generate(target, p, generator=gen(i), **kw) for i, p in enumerate(ids)])
        base_tokens = sum(len(r.tokens) for r in base)
    print()
    print("| decoder | R | tokens/s | × batch 1 | τ | same tokens as batch 1 | target-only tokens/s | × target batch 1 "
          "| speedup over target-only at R |")
    print("|---|---|---|---|---|---|---|---|---|")
    base_cols = ("", "", "") if base1_s is None else (f"{base_tokens / base1_s:.1f}", "1.00",
                                                       f"{(tokens / spec1_s) / (base_tokens / base1_s):.2f}")
    print(f"| batch-1 loop | 1 | {tokens / spec1_s:.1f} | 1.00 | {tau1:.3f} | — | {' | '.join(base_cols)} |")
    for R in args.rows:
        jobs = longest_first([BatchJob(p, seeds[i], i) for i, p in enumerate(ids)])  # as dspark eval admits them
        out, spec_s = timed(lambda: speculative_batch_generate(target, drafter, jobs, batch_size=R, **kw))
        got = {r.tag: r for r in out}
        same = sum(got[i].tokens == ref[i].tokens for i in range(len(ids)))
        n = sum(len(r.tokens) for r in out)
        rr = [x for r in out for x in r.rounds]
        tau = sum(x.tau for x in rr) / len(rr)
        cols = ("", "", "")
        if base1_s is not None:
            bout, b_s = timed(lambda: target_batch_generate(target, jobs, batch_size=R, **kw))
            bn = sum(len(r.tokens) for r in bout)
            cols = (f"{bn / b_s:.1f}", f"{(bn / b_s) / (base_tokens / base1_s):.2f}", f"{(n / spec_s) / (bn / b_s):.2f}")
        print(f"| batched | {R} | {n / spec_s:.1f} | {(n / spec_s) / (tokens / spec1_s):.2f} | {tau:.3f} "
              f"| {same}/{len(ids)} | {' | '.join(cols)} |", flush=True)


def whole_evaluations(target, drafter, config, args) -> None:
    """``--whole``: ``evaluate`` at batch 1 and at each R of ``--rows`` on the same prompts, timed."""
    from dspark.data.benchmarks import BENCHMARKS
    from dspark.data.prompts import builtin_eval_sets
    from dspark.evaluation.evaluate import evaluate
    from dspark.scheduling.simulator import DecodeSettings

    folder = os.environ.get("DSPARK_EVAL_DATA")
    if folder and Path(folder).is_dir():
        benchmarks, names = folder, [n for n in BENCHMARKS if (Path(folder) / f"{n}.jsonl").is_file()]
    else:
        benchmarks, names = builtin_eval_sets(), None
    decoding = DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=config.eval.seed)

    def run(rows: int, samples: int):
        start = time.perf_counter()
        report = evaluate(target, drafter, benchmarks, names=names, num_samples=samples, split="test",
                          decoding=decoding, batch_size=rows, progress=False, resume=False)
        return report, time.perf_counter() - start

    run(1, 1)  # untimed warm-up of every path
    run(max(args.rows), 1)
    print(f"# whole evaluations: {args.whole} test prompts per benchmark, speculative + target-only decode each")
    print()
    print("| R | evaluation s | × batch 1 | τ | requests | speculative s | target-only s |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for rows in [1] + [r for r in args.rows if r != 1]:
        report, seconds = run(rows, args.whole)
        timings, every = report["timings"], report["all"]
        base = seconds if base is None else base
        target_only = seconds - timings["spec_s"]  # what the target-only decodes took of this wall clock
        print(f"| {rows} | {seconds:.1f} | {base / seconds:.2f} | {every['tau']:.3f} | {every['num_requests']} "
              f"| {timings['spec_s']:.1f} | {target_only:.1f} |", flush=True)


if __name__ == "__main__":
    main()
