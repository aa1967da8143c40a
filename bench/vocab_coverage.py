"""Coverage of a draft vocabulary on unseen text: hard vs soft vs top-up counts, k = 1k..32k.

Reads the counts `dspark vocab` stored next to its vocabulary file (<vocab>.counts.safetensors:
hard and soft counts of the training split, hard counts of its held-out split) and, with
--generate N, samples N answers per benchmark of $DSPARK_EVAL_DATA (else eval_datasets/) from the target
(SmolLM2 by default, T = 0.7) as a second held-out set of another distribution. Prints the
share of each set's tokens that lies inside the vocabulary chosen by each (mode, k).

Run:  PYTHONPATH=. .venv/bin/python bench/vocab_coverage.py --counts DATA/draft_vocab_8192.counts.safetensors \
          [--generate 2] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from dspark.data.vocab_counts import COUNT_MODES, coverage_table

KS = (1024, 2048, 4096, 8192, 16384, 32768)
EVAL_DIR = "eval_datasets"  # the default folder: $DSPARK_EVAL_DATA when set (dspark.data.benchmarks)


def generated_counts(target_name: str, per_benchmark: int, max_new_tokens: int, seed: int = 0) -> torch.Tensor:
    """Hard counts [V] of the target's own answers to benchmark prompts (sampled at T = 0.7)."""
    from dspark.data.benchmarks import load_benchmark_prompts
    from dspark.data.render import render_prompt
    from dspark.decoding.loop import target_generate
    from dspark.target import TargetModel

    target = TargetModel.from_pretrained(target_name, [0])
    prompts = load_benchmark_prompts(EVAL_DIR, num_samples=per_benchmark, seed=seed)
    counts = torch.zeros(target.vocab_size, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    eos = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
    todo = [c for convs in prompts.values() for c in convs]
    for conv in tqdm(todo, desc="generating"):
        ids = render_prompt(target.tokenizer, conv)
        out = target_generate(target, ids, max_new_tokens=max_new_tokens, temperature=0.7, eos_token_ids=eos, generator=gen)
        counts += torch.bincount(torch.tensor(out.tokens), minlength=target.vocab_size).double()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", required=True, help="<vocab>.counts.safetensors written by `dspark vocab`")
    p.add_argument("--generate", type=int, default=0, help="answers per benchmark for a second held-out set (0: none)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default="smollm2-135m")
    args = p.parse_args()
    counts = load_file(args.counts)
    evals = {"held-out": counts["held-out"]}
    if args.generate:
        evals["generated"] = generated_counts(args.target, args.generate, args.max_new_tokens)
    train = counts["train"]
    sizes = {name: int(c.sum()) for name, c in {"train": train, **evals}.items()}
    print(f"supervised tokens: {sizes}; distinct training ids: {int((train > 0).sum())}")
    rows = coverage_table(COUNT_MODES, KS, train, counts.get("train_soft"), evals)
    names = ["train", *evals]
    print("\n| counts | k | " + " | ".join(names) + " |\n|---|---:|" + "---:|" * len(names))
    for row in rows:
        print(f"| {row['mode']} | {row['k']} | " + " | ".join(f"{row[n]:.2%}" for n in names) + " |")


if __name__ == "__main__":
    main()
