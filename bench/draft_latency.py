"""Latency of one drafting round, `Drafter.propose()`: DSpark (Markov + confidence heads) vs DFlash.

What is timed, per size (batch 1, temperature 1.0, a context of --context
positions already in the `DraftContext`, γ = 7):

- ``propose``      the whole round: backbone over the γ block slots against
                   the cached context K/V, one LM-head matmul, then the
                   left-to-right sampling loop (`sample_block`).
- ``lm_head``      `compute_logits` on the γ hidden states alone.
- ``sample_block`` the sequential stage alone, on fixed hidden states and
                   base logits: for DSpark γ steps of Markov bias
                   (W1[x_{k-1}] W2, a [r] x [r, V] product) + fp32 softmax +
                   multinomial + confidence head; for DFlash the same loop
                   without the heads (softmax + multinomial only).

Both drafters of a size share the backbone weights (DSpark's are loaded into
DFlash), the target's embedding/LM head and the context, so the only
difference is the two heads. Printed:

- ``DSpark/DFlash``  median over repetitions of the paired ratio of propose times;
- ``loop share``     DSpark sample_block / DSpark propose (the part that is
                     sequential in the block position and cannot be batched
                     over γ);
- ``head cost``      (DSpark sample_block − DFlash sample_block) / DFlash
                     propose: what the heads add, relative to a DFlash round;
- ``LM head share``  the one γ-row LM-head matmul / DSpark propose.

The machine is shared and noisy: every measurement is repeated, the
measurements of one repetition are interleaved (DSpark and DFlash
alternate, in a rotating order), and only medians and paired ratios are
reported. Absolute milliseconds are for orientation only.

Markov rank: r = d/4 by default (as in bench/train_step.py); --rank overrides.
What decides the head's cost is γ·r/d, printed per size: the Markov step is a
[r] x [r, V] product per block position, so a round reads W2 (r·V) γ times
while the LM head reads its d·V weights once. By default γ·r/d = 1.75; with the
paper's r = 256 it is 0.70 for Qwen3-4B (d = 2560) and 0.44 for Qwen3-8B
(d = 4096), so the head costs relatively less at real sizes than here.

Run:  .venv/bin/python bench/draft_latency.py [--quick] [--threads 1] [--repeats 15] [--rank R] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import Qwen3Config

from dspark.modeling import Drafter, DrafterConfig

TARGET_LAYER_IDS = [1, 9, 17, 25, 33]  # Qwen3-4B/8B defaults (DeepSpec's); the target has 36 layers
GAMMA = 7
MASK_TOKEN_ID = 3


@dataclass(frozen=True)
class Size:
    d: int
    layers: int
    vocab: int

    @property
    def name(self) -> str:
        return f"d={self.d} L={self.layers} V={self.vocab // 1024}k"


# Six representative sizes: every d with 2 and 5 draft layers, V growing with d.
FULL_SIZES = [
    Size(128, 2, 4096), Size(128, 5, 4096),
    Size(256, 2, 16384), Size(256, 5, 16384),
    Size(512, 2, 32768), Size(512, 5, 32768),
]
QUICK_SIZES = [Size(64, 1, 1024), Size(128, 2, 4096)]


def target_config(size: Size) -> Qwen3Config:
    """A synthetic Qwen3-style target: head_dim 32, 2:1 GQA, SwiGLU of 3d."""
    heads = max(2, size.d // 32)
    return Qwen3Config(
        vocab_size=size.vocab,
        hidden_size=size.d,
        intermediate_size=3 * size.d,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=size.d // heads,
        num_hidden_layers=36,
    )


def build_pair(size: Size, rank: int | None, device: torch.device, seed: int = 0) -> tuple[Drafter, Drafter, int]:
    """(DSpark drafter, DFlash drafter with the same backbone, Markov rank), eval mode, shared weights."""
    torch.manual_seed(seed)
    hf = target_config(size)
    r = rank if rank is not None else size.d // 4
    common = dict(target_layer_ids=TARGET_LAYER_IDS, mask_token_id=MASK_TOKEN_ID,
                  num_draft_layers=size.layers, block_size=GAMMA)
    dspark = Drafter(DrafterConfig.from_target_config(
        hf, variant="dspark", markov_rank=r, enable_confidence_head=True,
        confidence_head_with_markov=True, **common))
    dflash = Drafter(DrafterConfig.from_target_config(hf, variant="dflash", markov_rank=0, **common))
    missing, unexpected = dflash.load_state_dict(dspark.state_dict(), strict=False)
    if missing or any(not k.startswith(("markov_head.", "confidence_head.")) for k in unexpected):
        raise RuntimeError(f"backbone weights did not transfer: missing={missing} unexpected={unexpected}")
    with torch.no_grad():  # an untrained Markov head has W2 = 0; give it realistic values
        dspark.markov_head.markov_w2.weight.normal_(std=0.02)
    embed = (torch.randn(size.vocab, size.d) * 0.02).to(device)
    lm_head = (torch.randn(size.vocab, size.d) * 0.02).to(device)
    for drafter in (dspark, dflash):
        drafter.to(device).attach_shared(embed, lm_head).eval()
    return dspark, dflash, r


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], inner: int, device: torch.device) -> float:
    """Mean seconds of one call over `inner` back-to-back calls."""
    sync(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - start) / inner


def measure(fns: dict[str, Callable[[], object]], repeats: int, inner: int, warmup: int,
            device: torch.device) -> dict[str, list[float]]:
    """Interleaved repetitions: each repetition times every fn once, in a rotating order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_call(fns[name], inner, device))
    return samples


def bench_size(size: Size, args: argparse.Namespace) -> dict[str, float]:
    device = torch.device(args.device)
    dspark, dflash, r = build_pair(size, args.rank, device)
    m = len(TARGET_LAYER_IDS)
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(1, args.context, m * size.d, generator=gen).to(device)
    anchor = torch.randint(0, size.vocab, (1,), generator=gen).to(device)
    ctxs = {}
    for name, drafter in (("dspark", dspark), ("dflash", dflash)):
        ctx = drafter.new_context(1, device, capacity=args.context + GAMMA + 1)
        drafter.extend_context(ctx, features)
        ctxs[name] = ctx
    hidden = torch.randn(1, GAMMA, size.d, generator=gen).to(device)
    with torch.no_grad():
        base = dspark.compute_logits(hidden).float()
    sample_gen = torch.Generator(device=device).manual_seed(2)

    def propose(drafter: Drafter, ctx) -> Callable[[], object]:
        return lambda: drafter.propose(ctx, anchor, temperature=1.0, generator=sample_gen)

    def sample(drafter: Drafter) -> Callable[[], object]:
        def run():
            with torch.no_grad():
                return drafter.sample_block(hidden, base, anchor, temperature=1.0, generator=sample_gen)
        return run

    def lm_head() -> object:
        with torch.no_grad():
            return dspark.compute_logits(hidden)

    fns = {
        "dspark_propose": propose(dspark, ctxs["dspark"]),
        "dflash_propose": propose(dflash, ctxs["dflash"]),
        "dspark_sample": sample(dspark),
        "dflash_sample": sample(dflash),
        "lm_head": lm_head,
    }
    s = measure(fns, args.repeats, args.inner, args.warmup, device)
    med = {k: statistics.median(v) for k, v in s.items()}
    paired = lambda a, b: statistics.median(x / y for x, y in zip(s[a], s[b]))  # noqa: E731
    return {
        "rank": r,
        "dspark_ms": med["dspark_propose"] * 1e3,
        "dflash_ms": med["dflash_propose"] * 1e3,
        "ratio": paired("dspark_propose", "dflash_propose"),
        "dspark_loop_ms": med["dspark_sample"] * 1e3,
        "dflash_loop_ms": med["dflash_sample"] * 1e3,
        "lm_head_ms": med["lm_head"] * 1e3,
        "loop_share": paired("dspark_sample", "dspark_propose"),
        "head_cost": statistics.median(
            (a - b) / c for a, b, c in zip(s["dspark_sample"], s["dflash_sample"], s["dflash_propose"])),
        "lm_head_share": paired("lm_head", "dspark_propose"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (the smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stabler on a shared box)")
    p.add_argument("--context", type=int, default=256, help="context positions already extended")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 15, quick 3)")
    p.add_argument("--inner", type=int, default=None, help="calls per timed sample (default 5, quick 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rank", type=int, default=None, help="Markov rank r (default d/4)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    if args.quick:
        args.context = min(args.context, 32)
    args.repeats = args.repeats or (3 if args.quick else 15)
    args.inner = args.inner or (2 if args.quick else 5)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    print(f"== propose() latency: batch 1, γ={GAMMA}, T=1.0, context {args.context}, "
          f"{len(TARGET_LAYER_IDS)} target layers, {args.device}, threads {args.threads}, "
          f"{args.repeats} interleaved repeats x {args.inner} calls, medians")
    header = (f"{'size':<20}{'r':>5}{'γr/d':>6}{'DSpark ms':>11}{'DFlash ms':>11}{'DSpark/DFlash':>15}"
              f"{'loop ms':>9}{'DFl loop':>10}{'loop share':>12}{'head cost':>11}{'LM head share':>15}")
    print(header)
    print("-" * len(header))
    for size in sizes:
        res = bench_size(size, args)
        print(f"{size.name:<20}{res['rank']:>5}{GAMMA * res['rank'] / size.d:>6.2f}"
              f"{res['dspark_ms']:>11.3f}{res['dflash_ms']:>11.3f}{res['ratio']:>15.3f}"
              f"{res['dspark_loop_ms']:>9.3f}{res['dflash_loop_ms']:>10.3f}{res['loop_share']:>12.3f}"
              f"{res['head_cost']:>+11.3f}{res['lm_head_share']:>15.3f}")
    print("DSpark/DFlash: paired median ratio of propose() times. loop ms / DFl loop: sample_block "
          "of DSpark / DFlash. loop share: DSpark sample_block / DSpark propose. head cost: "
          "(DSpark - DFlash sample_block) / DFlash propose. LM head share: the γ-row LM-head "
          "matmul / DSpark propose.")


if __name__ == "__main__":
    main()
