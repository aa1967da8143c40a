"""Bytes per token of the target cache against DeepSpec's, and what fp8 costs in precision.

Bytes per token (d = hidden size, m = captured layers, f = fraction of tokens
that are anchor candidates, i.e. carry a final hidden state)::

    bytes/token = 4 + (m + f) * (d*b + s)  (+ per sample: 24 index bytes, <= 7 padding bytes)

    fp8   b = 1, s = 1 (one E8M0 exponent per row)  Qwen3-4B: 12,809 + 2,561 f
    bf16  b = 2, s = 0                              Qwen3-4B: 25,604 + 5,120 f
    fp32  b = 4, s = 0                              Qwen3-4B: 51,204 + 10,240 f
    DeepSpec: 30,726 at every token (DeepSpec's figure: int32 id, u8 mask, bf16 layers, bf16 final hidden
              everywhere; those parts add up to 4 + 1 + 2md + 2d = 30,725)

Half of DeepSpec is 15,363. fp8's worst case (f = 1) is 15,370, 7 bytes over;
it crosses the half at f = 2554/2561 = 0.9973. No real sample reaches that:
the prompt is outside the loss mask and a sample's last token is never a
candidate. Part 2 measures f on SmolLM2 answers to built-in prompts.

Part 3 measures fp8 and bf16 against the exact (fp32) cache on those real
SmolLM2 features: relative L2 error per captured layer, of the final hidden,
and the total-variation distance between p^t from the stored and the exact
final hidden (target LM head + softmax) at the candidate positions. As a
yardstick it also runs the target itself in bf16, which is what a GPU cache
build does and what DeepSpec's bf16 cache starts from.

Run:  .venv/bin/python bench/cache_size.py [--prompts 6] [--max-new-tokens 160] [--no-reference]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dspark.data.cache import PRECISIONS, TargetCache, build_cache, bytes_per_token, estimate_cache_size

QWEN3_4B = {"d": 2560, "m": 5}
# DeepSpec's figure. Its listed parts (int32 id, u8 mask, bf16 [m*d], bf16 [d]) add up to 30,725.
DEEPSPEC = 30_726
HALF = DEEPSPEC / 2
FORMULA = {"fp8": "4 + (m+f)(d+1)", "bf16": "4 + (m+f)(2d)", "fp32": "4 + (m+f)(4d)"}


def size_table(typical_f: float) -> None:
    d, m = QWEN3_4B["d"], QWEN3_4B["m"]
    print(f"== bytes/token at Qwen3-4B sizes (d={d}, m={m}); DeepSpec {DEEPSPEC:,}, half {HALF:,.1f}")
    print(f"{'precision':<10}{'formula':<18}{'f=0':>9}{f'f={typical_f:.3f}':>12}{'f=1 (worst)':>13}"
          f"{'typical/DS':>12}{'worst/DS':>10}")
    for p in PRECISIONS:
        row = [bytes_per_token(d, m, p, f) for f in (0.0, typical_f, 1.0)]
        print(f"{p:<10}{FORMULA[p]:<18}{row[0]:>9,.0f}{row[1]:>12,.0f}{row[2]:>13,.0f}"
              f"{row[1] / DEEPSPEC:>12.3f}{row[2] / DEEPSPEC:>10.3f}")
    worst = bytes_per_token(d, m, "fp8", 1.0)
    cross = (HALF - bytes_per_token(d, m, "fp8", 0.0)) / (d + 1)
    verdict = "EXCEEDS" if worst > HALF else "is within"
    print(f"fp8 worst case {worst:,.0f} B/token {verdict} half of DeepSpec ({HALF:,.1f}) by {worst - HALF:,.1f} B; "
          f"fp8 stays within half while f <= {cross:.4f}\n")


def regenerate(target, num_prompts: int, max_new_tokens: int) -> list:
    """Greedy SmolLM2 answers to built-in prompts, rendered with the chat template (the paper's Section 4.1 data, small)."""
    from dspark.data.prompts import load_builtin_prompts
    from dspark.data.render import render_conversation, render_prompt
    from dspark.evaluation.proposals import greedy_continuation

    tok = target.tokenizer
    domains = [load_builtin_prompts(d) for d in ("math", "code", "chat")]
    prompts = [domains[i % 3][i // 3] for i in range(num_prompts)]
    samples = []
    for conv in prompts:
        ids = render_prompt(tok, conv)
        answer = tok.decode(greedy_continuation(target, ids, max_new_tokens)[len(ids):], skip_special_tokens=True)
        samples.append(render_conversation(tok, conv + [{"role": "assistant", "content": answer}], max_length=4096))
    return samples


def tv_at_candidates(target, exact: TargetCache, other: TargetCache, hidden_of=None) -> tuple[torch.Tensor, float]:
    """TV distance of p^t per candidate position, and the top-1 agreement rate."""
    tvs, agree = [], []
    for i in range(len(exact)):
        a = exact[i]
        h = a["final_hidden"][a["has_final"]]
        g = hidden_of(i) if hidden_of else other[i]["final_hidden"][a["has_final"]]
        p = torch.softmax(target.compute_logits(h).float(), -1)
        q = torch.softmax(target.compute_logits(g.float()).float(), -1)
        tvs.append(0.5 * (p - q).abs().sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
    return torch.cat(tvs), float(torch.cat(agree).float().mean())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="built-in prompts to answer (math, code, chat in turn)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--no-reference", action="store_true", help="skip the bf16-target yardstick")
    parser.add_argument("--out", default="", help="keep the caches here (default: a temporary folder)")
    args = parser.parse_args()

    from dspark.target import TargetModel

    ids = (1, 8, 15, 22, 28)
    target = TargetModel.from_pretrained("smollm2-135m", ids)
    t0 = time.time()
    samples = regenerate(target, args.prompts, args.max_new_tokens)
    n_tok = sum(len(s.input_ids) for s in samples)
    print(f"regenerated {len(samples)} answers in {time.time() - t0:.0f} s: {n_tok} tokens, "
          f"{sum(s.num_loss_tokens for s in samples)} in the loss mask")

    out = Path(args.out or tempfile.mkdtemp(prefix="dspark-cache-bench-"))
    caches = {}
    print(f"== SmolLM2-135M cache (d={target.hidden_size}, m={len(ids)}) in {out}")
    for p in PRECISIONS:
        t0 = time.time()
        manifest = build_cache(target, samples, out / p, precision=p, batch_size=len(samples), progress=False,
                               resume=False, target_name="smollm2-135m")
        seconds = time.time() - t0
        estimate = estimate_cache_size(target, samples, p)
        f = manifest.candidate_fraction
        print(f"{p:<5} {manifest.data_bytes:>11,} B = {manifest.bytes_per_token:>8,.1f} B/token "
              f"(formula {bytes_per_token(target.hidden_size, len(ids), p, f):,.1f} + index/padding), "
              f"candidate fraction f = {f:.3f}, estimate {'==' if estimate == manifest.data_bytes else '!='} size, "
              f"{manifest.num_tokens / seconds:,.0f} tok/s")
        caches[p] = TargetCache(out / p, expected_target=target, verify="checksum")
    f = caches["fp8"].manifest.candidate_fraction
    print(f"at this f, Qwen3-4B fp8 would take {bytes_per_token(2560, 5, 'fp8', f):,.0f} B/token = "
          f"{bytes_per_token(2560, 5, 'fp8', f) / DEEPSPEC:.3f} of DeepSpec's\n")
    size_table(f)

    exact = caches["fp32"]
    m, d = len(ids), target.hidden_size
    print("== precision on real SmolLM2 features (against the exact fp32 cache)")
    for p in ("fp8", "bf16"):
        feats = torch.cat([caches[p][i]["features"] for i in range(len(exact))]).view(-1, m, d)
        ref = torch.cat([exact[i]["features"] for i in range(len(exact))]).view(-1, m, d)
        layers = ((feats - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2))).tolist()
        finals = [(caches[p][i]["final_hidden"], exact[i]["final_hidden"]) for i in range(len(exact))]
        tv, agree = tv_at_candidates(target, exact, caches[p])
        print(f"{p:<5} features rel. L2 per layer {[round(x, 4) for x in layers]} (all {rel(feats, ref):.4f}); "
              f"final hidden rel. L2 {rel(torch.cat([a for a, _ in finals]), torch.cat([b for _, b in finals])):.4f}; "
              f"TV(p^t) mean {float(tv.mean()):.4f} p99 {float(tv.quantile(0.99)):.4f} max {float(tv.max()):.4f}; "
              f"top-1 agreement {agree:.4f}")
    if not args.no_reference:
        bf16_target = TargetModel.from_pretrained("smollm2-135m", ids, dtype=torch.bfloat16)
        hidden = {}
        for i in range(len(exact)):
            x = exact[i]
            run = bf16_target(x["input_ids"][None], return_logits=False)
            hidden[i] = run.last_hidden[0][x["has_final"]].float()
        tv, agree = tv_at_candidates(target, exact, None, hidden_of=hidden.__getitem__)
        print(f"yardstick: the target run in bf16 (no cache) vs fp32: TV(p^t) mean {float(tv.mean()):.4f} "
              f"p99 {float(tv.quantile(0.99)):.4f}; top-1 agreement {agree:.4f}")


if __name__ == "__main__":
    main()
