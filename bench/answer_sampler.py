"""Answer generation (`dspark prepare`'s transformers backend): transformers' sampling path against
`dspark.data.answer_sampling.TopKTopPSampler`, the same distribution drawn on the top-k survivors.

Both generate the same batch of built-in prompts with the default target (SmolLM2-135M-Instruct,
float32 on CPU) and the demo's generation settings (T = 0.7, top-k 20, top-p 0.8, batch 32), in
alternating order, several times; printed: the seconds of each repetition, the median of the paired
ratios (transformers / dspark, per new token position), and the tokens each made. The answers
differ (the draws use the random stream differently) but follow one distribution
(tests/data/test_answer_sampling.py).

Run:  .venv/bin/python bench/answer_sampler.py [--batch 32] [--new-tokens 64] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LogitsProcessorList

from dspark.data.answer_sampling import TopKTopPSampler
from dspark.data.prompts import load_builtin_prompts
from dspark.data.render import render_prompt
from dspark.target import TargetModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained("smollm2-135m", [-1])
    model, tokenizer = target.model, target.tokenizer
    prompts = [render_prompt(tokenizer, c, enable_thinking=False) for c in load_builtin_prompts()[:args.batch]]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ways = {
        "transformers": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
        "dspark": dict(do_sample=False, temperature=None, top_k=None, top_p=None,
                       logits_processor=LogitsProcessorList([TopKTopPSampler(0.7, 20, 0.8)])),
    }
    print(f"{len(prompts)} prompts (longest {width} tokens) x {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, min_new_tokens = max_new_tokens (no early stop)")
    seconds = {name: [] for name in ways}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):  # the first is a warm-up
            for name in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
                torch.manual_seed(rep)
                start = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, pad_token_id=pad, **ways[name])
                elapsed = time.perf_counter() - start
                if rep > 0:
                    seconds[name].append(elapsed)
                    print(f"  rep {rep} {name:>12}: {elapsed:7.2f} s, {elapsed / args.new_tokens * 1e3:6.1f} ms per "
                          f"step, {out.shape[1] - width} new tokens")
    ratios = [a / b for a, b in zip(seconds["transformers"], seconds["dspark"])]
    print(f"transformers / dspark: median paired ratio {statistics.median(ratios):.3f} "
          f"(each: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
