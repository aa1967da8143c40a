"""One DSpark training step with the chunked loss (`dspark_loss`) vs the naive one (`naive_dspark_loss`).

The step is what `dspark.train_step.DraftLossModule` does for one micro-batch of
one sequence in offline mode (target features and final hidden states come
from the cache, here random): block labels, drafter forward over all anchor
blocks, confidence logits, the loss, and `loss.backward()`. The optimizer
step is EXCLUDED (it is the same for both losses and small next to the
step); gradients are reset to None before every step.

Both variants share everything but the loss call:

- chunked: `dspark_loss(draft_logits_fn, target_logits_fn, ..., chunk_rows)`,
  the logits are produced chunk by chunk and recomputed in backward;
- naive:   the full [N, γ, V] draft logits (with grad) and target logits
  (no grad) are materialised, then `naive_dspark_loss` (two softmaxes, c*
  with its own graph).

Printed per size: median step time of each, the paired median ratio
chunked/naive (time), the peak-memory ratio chunked/naive, and throughput in
anchor positions per second (anchors × γ / step time).

Peak memory is the peak of live bytes allocated *by the step* (activations,
logits, gradients; not the weights or inputs that exist before it). On CUDA:
torch.cuda.max_memory_allocated above the pre-step level. On CPU: a
TorchDispatchMode that records every tensor storage an op creates and drops
it when its last reference dies (kernel-internal scratch space is not seen).
The tracked step is the warm-up step, so its overhead does not enter the
timings.

The machine is shared and noisy: timings are interleaved (chunked and naive
alternate, in alternating order) and only medians and paired ratios are
reported.

A second section (``--draft-vocab``) times the fused step with a draft vocabulary of k ids
(dspark.modeling.vocab; k = 8,192 and 32,768 where k < V) against the full-vocabulary fused step
of the same drafter and batch: its draft side is k-sized, its target side still projects onto
all V ids once (argmax and mass for EAGLE-3's restriction). "SQ" is a size with Qwen3's V.

Run:  .venv/bin/python bench/train_step.py [--sizes S2 S3 S4] [--quick] [--threads 1]
      .venv/bin/python bench/train_step.py --draft-vocab [--vocab-sizes S3 SQ]
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config

from dspark.data.anchors import block_labels, sample_anchors, target_positions
from dspark.fused_loss import fused_dspark_loss
from dspark.loss import LossWeights, dspark_loss, naive_dspark_loss
from dspark.modeling import Drafter, DrafterConfig
from dspark.modeling.vocab import DraftVocab

TARGET_LAYER_IDS = [1, 9, 17, 25, 33]  # Qwen3-4B/8B defaults (SPEC 2); the target has 36 layers
GAMMA = 7
MASK_TOKEN_ID = 3
CHUNK_ROWS = 64  # dspark.config.LossConfig default


@dataclass(frozen=True)
class TrainSize:
    name: str
    d: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tokens: int
    anchors: int
    rank: int
    repeats: int  # default number of timed steps per variant

    def describe(self) -> str:
        return (f"{self.name}: d={self.d}, {self.layers} layers, {self.heads}/{self.kv_heads} heads, "
                f"V={self.vocab:,}, {self.tokens} tokens, {self.anchors} anchors, r={self.rank}")


SIZES = {
    "S2": TrainSize("S2", 128, 2, 4, 2, 4096, 512, 64, 32, repeats=7),
    "S3": TrainSize("S3", 256, 5, 8, 4, 16384, 1024, 128, 64, repeats=5),
    "S4": TrainSize("S4", 512, 5, 8, 4, 32000, 2048, 256, 128, repeats=2),
}
QUICK = TrainSize("S0", 64, 1, 2, 1, 1024, 128, 16, 16, repeats=2)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created by ops run under the mode (forward and backward).

    A storage counts from the op that creates it until its last reference dies;
    outputs that share an input's storage (views, in-place ops) are not new.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() > 0 and storage.data_ptr() not in inputs:
                    self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def build(size: TrainSize, device: torch.device, seed: int = 0) -> tuple[Drafter, dict[str, Tensor]]:
    """A DSpark drafter on a synthetic Qwen3-style target and one random offline batch of one sequence."""
    torch.manual_seed(seed)
    hf = Qwen3Config(vocab_size=size.vocab, hidden_size=size.d, intermediate_size=3 * size.d,
                     num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                     head_dim=size.d // size.heads, num_hidden_layers=36)
    config = DrafterConfig.from_target_config(
        hf, target_layer_ids=TARGET_LAYER_IDS, mask_token_id=MASK_TOKEN_ID, num_draft_layers=size.layers,
        block_size=GAMMA, num_anchors=size.anchors, variant="dspark", markov_rank=size.rank,
        enable_confidence_head=True, confidence_head_with_markov=True)
    drafter = Drafter(config).to(device)
    with torch.no_grad():  # an untrained Markov head has W2 = 0; give it realistic values
        drafter.markov_head.markov_w2.weight.normal_(std=0.02)
    gen = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(size.vocab, size.d, generator=gen) * 0.02
    lm_head = torch.randn(size.vocab, size.d, generator=gen) * 0.02
    drafter.attach_shared(embed.to(device), lm_head.to(device)).train()
    S, m = size.tokens, len(TARGET_LAYER_IDS)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    loss_mask[:, : S // 8] = False  # a prompt prefix outside the loss mask
    anchors, keep = sample_anchors(loss_mask, size.anchors, generator=gen)
    batch = {
        "input_ids": torch.randint(0, size.vocab, (1, S), generator=gen),
        "loss_mask": loss_mask,
        "features": torch.randn(1, S, m * size.d, generator=gen),
        "final_hidden": torch.randn(1, S, size.d, generator=gen),
        "anchors": anchors,
        "keep": keep,
    }
    return drafter, {k: v.to(device) for k, v in batch.items()}


def train_step(drafter: Drafter, batch: dict[str, Tensor], variant: str, weights: LossWeights) -> Tensor:
    """Forward + backward of drafter and loss (no optimizer); mirrors DraftLossModule.forward."""
    drafter.zero_grad(set_to_none=True)
    input_ids, anchors, keep = batch["input_ids"], batch["anchors"], batch["keep"]
    final_hidden = batch["final_hidden"]
    B, S = input_ids.shape
    labels, valid, prev = block_labels(input_ids, batch["loss_mask"], anchors, keep, GAMMA)  # [B, A, γ]
    hidden = drafter(batch["features"], input_ids, anchors, keep)  # [B, A, γ, d]
    tpos = target_positions(anchors, GAMMA, S)  # [B, A, γ]
    t_hidden = final_hidden.gather(1, tpos.reshape(B, -1, 1).expand(-1, -1, final_hidden.shape[-1]))
    t_hidden = t_hidden.reshape(-1, GAMMA, final_hidden.shape[-1])  # [N, γ, d]
    h_flat = hidden.reshape(-1, GAMMA, hidden.shape[-1])  # [N, γ, d]
    prev_flat = prev.reshape(-1, GAMMA)  # [N, γ]
    labels, valid = labels.reshape(-1, GAMMA), valid.reshape(-1, GAMMA)
    conf = drafter.confidence_logits(h_flat, prev_flat)  # [N, γ]
    if variant == "naive":
        draft = drafter.draft_logits(h_flat, prev_flat)  # [N, γ, V]
        with torch.no_grad():
            target = drafter.compute_logits(t_hidden)  # [N, γ, V]
        out = naive_dspark_loss(draft, target, labels, valid, conf, weights)
    elif variant == "fused":  # what the trainer runs (train.loss.fused = True)
        head = drafter.markov_head
        out = fused_dspark_loss(
            h_flat, drafter.shared_weights()["lm_head.weight"], t_hidden, labels, valid, conf, weights,
            latent=head.block_latent(prev_flat, h_flat), w2=head.markov_w2.weight, chunk_rows=CHUNK_ROWS,
        )
    else:
        out = dspark_loss(
            lambda r0, r1: drafter.draft_logits(h_flat[r0:r1], prev_flat[r0:r1]),
            lambda r0, r1: drafter.compute_logits(t_hidden[r0:r1]),
            labels, valid, conf, weights, chunk_rows=CHUNK_ROWS,
        )
    out.loss.backward()
    return out.loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_step_bytes(drafter: Drafter, batch: dict[str, Tensor], variant: str, weights: LossWeights,
                    device: torch.device) -> tuple[int, Tensor]:
    """(peak bytes allocated by one step above what existed before it, the step's loss)."""
    drafter.zero_grad(set_to_none=True)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loss = train_step(drafter, batch, variant, weights)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before, loss
    mode = LiveBytes()
    with mode:
        loss = train_step(drafter, batch, variant, weights)
    return mode.peak, loss


def bench_size(size: TrainSize, repeats: int, device: torch.device) -> dict[str, float]:
    drafter, batch = build(size, device)
    weights = LossWeights()
    # Warm-up = the memory-tracked step of each variant (its tracking overhead is not timed).
    variants = ("fused", "chunked", "naive")
    peak, loss = {}, {}
    for v in variants:
        peak[v], loss[v] = peak_step_bytes(drafter, batch, v, weights, device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(repeats):
        for v in variants[rep % 3:] + variants[: rep % 3]:  # rotate the order: same load for all
            sync(device)
            start = time.perf_counter()
            train_step(drafter, batch, v, weights)
            sync(device)
            times[v].append(time.perf_counter() - start)
    med = {v: statistics.median(times[v]) for v in variants}
    positions = size.anchors * GAMMA
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    return {
        "fused_s": med["fused"],
        "chunked_s": med["chunked"],
        "naive_s": med["naive"],
        "time_ratio": ratio("chunked", "naive"),
        "fused_time_ratio": ratio("fused", "naive"),
        "fused_mb": peak["fused"] / 2**20,
        "chunked_mb": peak["chunked"] / 2**20,
        "naive_mb": peak["naive"] / 2**20,
        "mem_ratio": peak["chunked"] / peak["naive"],
        "fused_mem_ratio": peak["fused"] / peak["naive"],
        "fused_pos_s": positions / med["fused"],
        "chunked_pos_s": positions / med["chunked"],
        "naive_pos_s": positions / med["naive"],
        "loss_rel_diff": max(abs(float(loss[v]) - float(loss["naive"])) for v in variants) / max(abs(float(loss["naive"])), 1e-12),
    }


# ------------------------------------------------------------------ draft vocabulary section
VOCAB_KS = (8192, 32768)
VOCAB_SIZES = {**SIZES, "SQ": TrainSize("SQ", 256, 2, 4, 2, 151936, 512, 64, 64, repeats=2)}


def with_draft_vocab(drafter: Drafter, k: int, seed: int = 0) -> Drafter:
    """The same drafter with a draft vocabulary of k random ids (the Markov head's W2 rows for them)."""
    config = drafter.config.replace(draft_vocab_size=k)
    ids = torch.sort(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:k]).values
    vocab = DraftVocab(ids, config.vocab_size)
    small = Drafter(config).to(drafter.fc.weight.device)
    state = dict(drafter.state_dict())
    state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids.to(state["markov_head.markov_w2.weight"].device)]
    small.load_state_dict({**small.state_dict(), **state})
    shared = drafter.shared_weights()
    return small.attach_shared(shared["embed_tokens.weight"], shared["lm_head.weight"]).set_vocab(vocab).train()


def vocab_step(drafter: Drafter, batch: dict[str, Tensor], weights: LossWeights) -> Tensor:
    """The fused step as DraftLossModule runs it, with or without the drafter's draft vocabulary."""
    drafter.zero_grad(set_to_none=True)
    input_ids, anchors, keep = batch["input_ids"], batch["anchors"], batch["keep"]
    final_hidden = batch["final_hidden"]
    B, S = input_ids.shape
    labels, valid, prev = block_labels(input_ids, batch["loss_mask"], anchors, keep, GAMMA)
    hidden = drafter(batch["features"], input_ids, anchors, keep)
    tpos = target_positions(anchors, GAMMA, S)
    t_hidden = final_hidden.gather(1, tpos.reshape(B, -1, 1).expand(-1, -1, final_hidden.shape[-1])).reshape(-1, GAMMA, final_hidden.shape[-1])
    h_flat, prev_flat = hidden.reshape(-1, GAMMA, hidden.shape[-1]), prev.reshape(-1, GAMMA)
    conf = drafter.confidence_logits(h_flat, prev_flat)
    head, vocab = drafter.markov_head, drafter.vocab
    out = fused_dspark_loss(
        h_flat, drafter.shared_weights()["lm_head.weight"], t_hidden, labels.reshape(-1, GAMMA), valid.reshape(-1, GAMMA),
        conf, weights, latent=head.block_latent(prev_flat, h_flat), w2=head.markov_w2.weight, chunk_rows=CHUNK_ROWS,
        vocab=vocab, target_lm_head_weight=None if vocab is None else drafter.target_lm_head_weight(),
    )
    out.loss.backward()
    return out.loss.detach()


def bench_draft_vocab(size: TrainSize, repeats: int, device: torch.device) -> list[dict[str, float]]:
    """Per k < V: median step times and peak memory of the k-vocabulary step and the full one."""
    full, batch = build(size, device)
    weights = LossWeights()
    drafters = {"full": full, **{k: with_draft_vocab(full, k) for k in VOCAB_KS if k < size.vocab}}
    peak, times = {}, {name: [] for name in drafters}
    for name, drafter in drafters.items():  # warm-up = the memory-tracked step
        if device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            vocab_step(drafter, batch, weights)
            sync(device)
            peak[name] = torch.cuda.max_memory_allocated(device) - before
        else:
            mode = LiveBytes()
            with mode:
                vocab_step(drafter, batch, weights)
            peak[name] = mode.peak
    names = list(drafters)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            sync(device)
            start = time.perf_counter()
            vocab_step(drafters[name], batch, weights)
            sync(device)
            times[name].append(time.perf_counter() - start)
    rows = []
    for k in names[1:]:
        rows.append({
            "k": k, "full_s": statistics.median(times["full"]), "vocab_s": statistics.median(times[k]),
            "time_ratio": statistics.median(a / b for a, b in zip(times[k], times["full"])),
            "full_mb": peak["full"] / 2**20, "vocab_mb": peak[k] / 2**20, "mem_ratio": peak[k] / peak["full"],
        })
    return rows


def main_draft_vocab(names: list[str], repeats: int | None, device: torch.device, threads: int) -> None:
    print(f"== fused DSpark train step with a draft vocabulary of k ids vs the full vocabulary "
          f"(same drafter and batch), γ={GAMMA}, {device.type}, threads {threads}")
    header = f"{'size':<6}{'V':>9}{'k':>8}{'full s':>10}{'k s':>10}{'time k/full':>13}{'full MB':>10}{'k MB':>10}{'mem k/full':>12}"
    print(header)
    print("-" * len(header))
    for name in names:
        size = VOCAB_SIZES[name]
        rows = bench_draft_vocab(size, repeats or size.repeats, device)
        if not rows:
            print(f"{name:<6}{size.vocab:>9,}  (no k in {VOCAB_KS} below V)")
        for r in rows:
            print(f"{name:<6}{size.vocab:>9,}{r['k']:>8,}{r['full_s']:>10.3f}{r['vocab_s']:>10.3f}{r['time_ratio']:>13.3f}"
                  f"{r['full_mb']:>10.1f}{r['vocab_mb']:>10.1f}{r['mem_ratio']:>12.3f}")
    print("time k/full: paired median ratio of step times; mem: peak bytes allocated by the step.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["S2", "S3"],
                   help="sizes to run (default S2 S3; S4 takes minutes on CPU)")
    p.add_argument("--quick", action="store_true", help="one tiny size, 2 repeats (the smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default: per size)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stabler on a shared box)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--draft-vocab", action="store_true", help="run the draft-vocabulary section instead")
    p.add_argument("--vocab-sizes", nargs="+", choices=sorted(VOCAB_SIZES), default=["S3", "S4", "SQ"],
                   help="sizes of the draft-vocabulary section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.draft_vocab:
        main_draft_vocab(args.vocab_sizes, args.repeats, device, args.threads)
        return
    sizes = [QUICK] if args.quick else [SIZES[name] for name in args.sizes]
    memory = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "live tensor bytes (dispatch mode)"
    print(f"== DSpark train step (forward + backward, optimizer excluded), batch 1 sequence, γ={GAMMA}, "
          f"chunk_rows={CHUNK_ROWS}, {device.type}, threads {args.threads}; peak memory: {memory}")
    for size in sizes:
        print(f"   {size.describe()}")
    header = (f"{'size':<6}{'fused s':>10}{'chunked s':>11}{'naive s':>10}{'time f/n':>10}{'time c/n':>10}"
              f"{'fused MB':>10}{'chunked MB':>12}{'naive MB':>11}{'mem f/n':>9}{'mem c/n':>9}"
              f"{'fused pos/s':>13}{'chunked pos/s':>15}{'naive pos/s':>13}{'|Δloss|/loss':>14}")
    print(header)
    print("-" * len(header))
    for size in sizes:
        repeats = args.repeats or size.repeats
        res = bench_size(size, repeats, device)
        print(f"{size.name:<6}{res['fused_s']:>10.3f}{res['chunked_s']:>11.3f}{res['naive_s']:>10.3f}"
              f"{res['fused_time_ratio']:>10.3f}{res['time_ratio']:>10.3f}"
              f"{res['fused_mb']:>10.1f}{res['chunked_mb']:>12.1f}{res['naive_mb']:>11.1f}"
              f"{res['fused_mem_ratio']:>9.3f}{res['mem_ratio']:>9.3f}"
              f"{res['fused_pos_s']:>13,.0f}{res['chunked_pos_s']:>15,.0f}{res['naive_pos_s']:>13,.0f}"
              f"{res['loss_rel_diff']:>14.1e}")
    print("fused = fused_dspark_loss (what the trainer runs), chunked = dspark_loss, naive = naive_dspark_loss. "
          "time x/n: paired median ratio to the naive step time; mem x/n: ratio of peak bytes allocated by the "
          "step; pos/s: anchors × γ / median step time.")


if __name__ == "__main__":
    main()
