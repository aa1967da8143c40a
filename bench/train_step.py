"""Training-step cost, in sections (one function each, `--sections`):

- ``steps``: one DSpark step at S2/S3/S4 with the fused loss (what the trainer runs),
  the chunked loss (`dspark_loss`) and the naive one (`naive_dspark_loss`, full
  [N, γ, V] logits: the in-process stand-in for DeepSpec's loss); time ratios to the
  naive step and peak memory.
- ``precision``: the fused step in bf16 (autocast, bf16 LM head) against fp32, and
  whether this CPU has native bf16 (`dspark.build.cpu_has_native_bf16`).
- ``demo``: anchor positions per CPU-second of the real trainer (`dspark.training.trainer.Trainer`)
  on the SmolLM2 demo data (`--demo-data`, copied to a temporary folder first), DSpark
  and DFlash, length bucketing off and on, cache and online features.
- ``eagle3``: the Eagle3 TTT step at each size (draft vocabulary V/3) with the closed-form loss
  (`dspark.training.eagle3_loss.eagle3_loss`: one teacher distribution per position for all steps) against
  the checkpointed autograd one (`checkpointed_eagle3_loss`).
- ``optimizer``: the AdamW step over the drafter's trainable parameters, the fused kernel the
  trainer uses against torch's foreach path (time ratio, and the parameter difference after one step).
- ``vocab``: the fused step with a draft vocabulary of k ids (dspark.modeling.vocab; k = 8,192
  and 32,768 where k < V) against the full-vocabulary fused step of the same drafter and batch:
  its draft side is k-sized, its target side still projects onto all V ids once (argmax and
  mass for EAGLE-3's restriction). "SQ" is a size with Qwen3's V (`--vocab-sizes`).

The step is what `dspark.training.step.DraftLossModule` does for one micro-batch of
one sequence in offline mode (target features and final hidden states come
from the cache, here random): block labels, drafter forward over all anchor
blocks, confidence logits, the loss, and `loss.backward()`. The optimizer
step is EXCLUDED (it is the same for all losses and small next to the
step); gradients are reset to None before every step.

Time is CPU time of this process (`time.process_time`) on a CPU and wall time
on a GPU: on a shared CPU, wall time counts the time other processes hold the
cores, CPU time does not. Run with `--threads 1`
(the default) so that CPU time is the step's work, not OpenMP spinning.

Peak memory is the peak of live bytes allocated *by the step* (activations,
logits, gradients; not the weights or inputs that exist before it). On CUDA:
torch.cuda.max_memory_allocated above the pre-step level. On CPU: a
TorchDispatchMode that records every tensor storage an op creates and drops
it when its last reference dies (kernel-internal scratch space is not seen).
The tracked step is the warm-up step, so its overhead does not enter the
timings. Timings are interleaved (variants alternate, in rotating order) and
only medians and paired ratios are reported.

Page faults: on a CPU, PyTorch returns a freed tensor's memory to the OS (glibc maps every block
over a few MB on its own), so a step that allocates fresh [N, γ, V] tensors (the naive loss) pays
for faulting their pages in again every step, in system time, which process_time counts. CUDA's
caching allocator has no such cost. ``--allocator retain`` reruns the script with glibc keeping
freed memory, so that the ratios show what is left without it (bench/README.md).

Run:  .venv/bin/python bench/train_step.py [--sections steps precision demo vocab] [--sizes S2 S3 S4] [--quick]
      .venv/bin/python bench/train_step.py --sections steps --sizes S2 S3 S4 --allocator retain
      .venv/bin/python bench/train_step.py --sections vocab [--vocab-sizes S3 S4 SQ]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config

from dspark.data.anchors import block_labels, sample_anchors, target_positions
from dspark.training.fused_loss import LogitFactors, fused_dspark_loss
from dspark.training.loss import LossWeights, dspark_loss, naive_dspark_loss
from dspark.modeling import Drafter, DrafterConfig
from dspark.modeling.vocab import DraftVocab

TARGET_LAYER_IDS = [1, 9, 17, 25, 33]  # Qwen3-4B/8B defaults (DeepSpec's); the target has 36 layers
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
    # SmolLM2-135M-sized (the demo's target): d 576, V 49,152, 9/3 heads of 64, 2 draft layers.
    "S4": TrainSize("S4", 576, 2, 9, 3, 49152, 768, 64, 64, repeats=3),
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
        latent, w2 = head.fused_factors(prev_flat, h_flat)
        factors = LogitFactors(
            h_flat, drafter.shared_weights()["lm_head.weight"], t_hidden, latent=latent, w2=w2,
            target_rows=(torch.arange(B)[:, None, None] * S + tpos).reshape(-1, GAMMA),
        )
        out = fused_dspark_loss(factors, labels, valid, conf, weights, chunk_rows=CHUNK_ROWS)
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


def clock(device: torch.device) -> float:
    """Seconds: this process's CPU time on a CPU (immune to other processes on a shared
    machine), wall time on a GPU (synchronised by the caller)."""
    return time.perf_counter() if device.type == "cuda" else time.process_time()


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


def interleaved_times(steps: dict[str, object], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds of each zero-argument callable over ``repeats`` rounds, the order rotating per round."""
    names = list(steps)
    times: dict[str, list[float]] = {v: [] for v in names}
    for rep in range(repeats):
        k = rep % len(names)
        for v in names[k:] + names[:k]:
            sync(device)
            start = clock(device)
            steps[v]()
            sync(device)
            times[v].append(clock(device) - start)
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def bench_size(size: TrainSize, repeats: int, device: torch.device) -> dict[str, float]:
    drafter, batch = build(size, device)
    weights = LossWeights()
    # Warm-up = the memory-tracked step of each variant (its tracking overhead is not timed).
    variants = ("fused", "chunked", "naive")
    peak, loss = {}, {}
    for v in variants:
        peak[v], loss[v] = peak_step_bytes(drafter, batch, v, weights, device)
    times = interleaved_times({v: (lambda v=v: train_step(drafter, batch, v, weights)) for v in variants}, repeats, device)
    med = {v: statistics.median(times[v]) for v in variants}
    positions = size.anchors * GAMMA
    return {
        "fused_s": med["fused"],
        "chunked_s": med["chunked"],
        "naive_s": med["naive"],
        "time_ratio": paired_ratio(times, "chunked", "naive"),
        "fused_time_ratio": paired_ratio(times, "fused", "naive"),
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


# ------------------------------------------------------------------ sections
def chosen_sizes(args: argparse.Namespace) -> list[TrainSize]:
    """The sizes a section runs: the tiny one with --quick, else those of --sizes."""
    return [QUICK] if args.quick else [SIZES[name] for name in args.sizes]


def print_header(header: str, title: str = "", section: str = "") -> None:
    """A table's column header and its rule, after the section's title line when given."""
    if title:
        print(f"\n== {section}: {title}")
    print(header)
    print("-" * len(header))


def section_steps(args: argparse.Namespace, device: torch.device) -> None:
    """The full-vocabulary step (fused, chunked) against the naive one, per size."""
    sizes = chosen_sizes(args)
    memory = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "live tensor bytes (dispatch mode)"
    print(f"== steps: DSpark train step (forward + backward, optimizer excluded), batch 1 sequence, γ={GAMMA}, "
          f"chunk_rows={CHUNK_ROWS}, {device.type}, threads {args.threads}; peak memory: {memory}")
    for size in sizes:
        print(f"   {size.describe()}")
    header = (f"{'size':<6}{'fused s':>10}{'chunked s':>11}{'naive s':>10}{'time f/n':>10}{'time c/n':>10}"
              f"{'fused MB':>10}{'chunked MB':>12}{'naive MB':>11}{'mem f/n':>9}{'mem c/n':>9}"
              f"{'fused pos/s':>13}{'chunked pos/s':>15}{'naive pos/s':>13}{'|Δloss|/loss':>14}")
    print_header(header)
    for size in sizes:
        res = bench_size(size, args.repeats or size.repeats, device)
        print(f"{size.name:<6}{res['fused_s']:>10.3f}{res['chunked_s']:>11.3f}{res['naive_s']:>10.3f}"
              f"{res['fused_time_ratio']:>10.3f}{res['time_ratio']:>10.3f}"
              f"{res['fused_mb']:>10.1f}{res['chunked_mb']:>12.1f}{res['naive_mb']:>11.1f}"
              f"{res['fused_mem_ratio']:>9.3f}{res['mem_ratio']:>9.3f}"
              f"{res['fused_pos_s']:>13,.0f}{res['chunked_pos_s']:>15,.0f}{res['naive_pos_s']:>13,.0f}"
              f"{res['loss_rel_diff']:>14.1e}")
    print("fused = fused_dspark_loss (what the trainer runs), chunked = dspark_loss, naive = naive_dspark_loss "
          "(DeepSpec's loss). time x/n: paired median ratio to the naive step time; mem x/n: ratio of peak bytes "
          "allocated by the step; pos/s: anchors × γ / median step time.")


def section_precision(args: argparse.Namespace, device: torch.device) -> None:
    """The fused step under bf16 autocast with a bf16 LM head (train.mixed_precision=bf16,
    target.dtype=bfloat16) against the fp32 step, per size."""
    from dspark.build import cpu_has_native_bf16, resolve_mixed_precision

    sizes = chosen_sizes(args)
    native = cpu_has_native_bf16() if device.type == "cpu" else None
    print(f"\n== precision: fused step, bf16 (autocast + bf16 LM head) vs fp32, {device.type}, threads {args.threads}; "
          f"native bf16 CPU: {native}; train.mixed_precision=auto resolves to {resolve_mixed_precision('auto', device)!r}")
    header = f"{'size':<6}{'fp32 s':>10}{'bf16 s':>10}{'time bf16/fp32':>16}{'|Δloss|/loss':>14}"
    print_header(header)
    weights = LossWeights()
    for size in sizes:
        drafter, batch = build(size, device)
        shared = drafter.shared_weights()
        bf16 = build(size, device)[0]
        bf16.load_state_dict(drafter.state_dict())
        bf16.attach_shared(shared["embed_tokens.weight"].bfloat16(), shared["lm_head.weight"].bfloat16()).train()

        def step_bf16() -> Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return train_step(bf16, batch, "fused", weights)

        steps = {"fp32": lambda: train_step(drafter, batch, "fused", weights), "bf16": step_bf16}
        loss = {k: float(f()) for k, f in steps.items()}  # warm-up
        times = interleaved_times(steps, args.repeats or size.repeats, device)
        print(f"{size.name:<6}{statistics.median(times['fp32']):>10.3f}{statistics.median(times['bf16']):>10.3f}"
              f"{paired_ratio(times, 'bf16', 'fp32'):>16.3f}{abs(loss['bf16'] - loss['fp32']) / abs(loss['fp32']):>14.1e}")
    print("time bf16/fp32: paired median ratio of step times (below 1: bf16 is faster).")


# --------------------------------------------------------------- demo section
REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = {v: REPO / "config" / v / f"{v}_smollm2_135m.py" for v in ("dspark", "dflash")}


def _demo_copy(src: Path, dst: Path, modes: list[str]) -> Path:
    """The demo data the section reads, copied (the original is never opened for writing)."""
    names = ["rendered.jsonl", "split.json"] + (["cache-fp8"] if "cache" in modes else [])
    dst.mkdir(parents=True)
    for name in names:
        if not (src / name).exists():
            raise FileNotFoundError(f"{src / name} not found: point --demo-data at a `dspark prepare` folder of the SmolLM2 demo")
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dst / name)
    return dst


def _demo_trainer(variant: str, mode: str, bucketing: bool, precision: str, data: Path, out: Path,
                  samples: int, targets: dict) -> object:
    """A Trainer of the shipped SmolLM2 config on the first ``samples`` training samples (one
    global batch: bucketing changes only which samples share a micro-batch)."""
    from dspark.config import load_config, set_values
    from dspark.data.dataset import CachedSource, RenderedSource
    from dspark.data.prepare import training_sources
    from dspark.build import build_drafter, load_target
    from dspark.training.trainer import Trainer

    values = {"data.data_dir": str(data), "out_dir": str(out), "data.feature_mode": mode,
              "train.bucketing": bucketing, "train.max_steps": 1, "train.eval_every": 0, "train.save_every": 10**6,
              "train.global_batch_size": samples, "train.mixed_precision": "no" if precision == "fp32" else "auto",
              "target.dtype": "float32" if precision == "fp32" else "auto"}
    config = set_values(load_config(DEMO_CONFIGS[variant]), values)
    key = config.target.dtype
    if key not in targets:
        targets[key] = load_target(config)
    target = targets[key]
    train, _ = training_sources(config, target)
    train = CachedSource(train.cache, train.indices[:samples]) if mode == "cache" else RenderedSource(train.samples[:samples])
    return Trainer(config, target, build_drafter(config, target), train, None, out_dir=out, progress=False)


def section_demo(args: argparse.Namespace, device: torch.device) -> None:
    """Anchor positions per CPU-second of the trainer on the SmolLM2 demo data: DSpark and
    DFlash, bucketing off and on, cache and online features (and DSpark in fp32 vs auto)."""
    from dspark.data.dataset import padding_share, sample_lengths
    from dspark.build import resolve_mixed_precision

    src = Path(args.demo_data)
    print(f"\n== demo: trainer steps on the SmolLM2 demo data ({src}), first {args.demo_samples} training samples "
          f"= one global batch in micro-batches of 4; {device.type}, threads {args.threads}; precision 'auto' = "
          f"{resolve_mixed_precision('auto', device)}")
    combos = [(v, m, b, "auto") for m in args.demo_modes for v in ("dspark", "dflash") for b in (False, True)]
    combos.append(("dspark", args.demo_modes[0], True, "fp32"))
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        data = _demo_copy(src, Path(tmp) / "data", args.demo_modes)
        targets: dict = {}
        trainers = {c: _demo_trainer(*c, data, Path(tmp) / "-".join(map(str, c)), args.demo_samples, targets) for c in combos}
        positions: dict = {}

        def step(c) -> None:
            t = trainers[c]
            t.step = 0  # the same global batch every time
            rec = t.train_step()
            positions[c] = rec["anchors"] * t.drafter.config.block_size

        for c in combos:  # warm-up
            step(c)
        times = interleaved_times({c: (lambda c=c: step(c)) for c in combos}, args.demo_repeats, device)
    header = f"{'drafter':<8}{'features':<10}{'bucketing':<11}{'precision':<11}{'pos/s':>9}{'padding':>9}{'vs off':>8}"
    print_header(header)
    for c in combos:
        variant, mode, bucketing, precision = c
        t = trainers[c]
        order = [i for _, i in t.schedule.step_samples(0)]
        pad = padding_share(sample_lengths(t.train_data)[order], t.config.train.micro_batch_size)
        base = (variant, mode, False, "auto") if precision == "auto" else (variant, mode, True, "auto")
        rel = paired_ratio(times, base, c) if c != base else float("nan")
        print(f"{variant:<8}{mode:<10}{'on' if bucketing else 'off':<11}{precision:<11}"
              f"{positions[c] / statistics.median(times[c]):>9.1f}{pad:>9.3f}{rel:>8.3f}")
    print("pos/s: anchor positions (anchors × γ) per second of CPU time of one optimizer step (median); padding: "
          "share of padding among the tokens of the step's micro-batches; vs off: paired median speed-up over the "
          "same drafter and features with bucketing off; for the fp32 row (target.dtype=float32, "
          "train.mixed_precision=no) over the 'auto' run with bucketing on (below 1: fp32 is slower).")
    _epoch_padding(src, trainers[combos[0]].config)


def _epoch_padding(src: Path, config) -> None:
    """Padding share over one epoch of the demo's training split (the schedule alone, no step)."""
    import json

    from dspark.data.dataset import load_rendered, padding_share
    from dspark.training.schedule import Schedule

    rendered = load_rendered(src / "rendered.jsonl")
    train = json.loads((src / "split.json").read_text())["train"]
    lengths = torch.tensor([len(rendered[i].input_ids) for i in train])
    tc = config.train
    share = {}
    for on in (False, True):
        sched = Schedule(len(train), tc.global_batch_size, 1, 0, config.seed, 1, micro_batch=tc.micro_batch_size,
                         lengths=lengths if on else None, bucket_window=tc.bucket_window)
        share[on] = padding_share(lengths[sched.epoch_perm(0)], tc.micro_batch_size)
    print(f"padding share over one epoch of the {len(train)} training samples in micro-batches of "
          f"{tc.micro_batch_size}: {share[False]:.3f} without bucketing, {share[True]:.3f} with")


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
    latent, w2 = head.fused_factors(prev_flat, h_flat)
    factors = LogitFactors(
        h_flat, drafter.shared_weights()["lm_head.weight"], t_hidden, latent=latent, w2=w2,
        vocab=vocab, target_lm_head_weight=None if vocab is None else drafter.target_lm_head_weight(),
    )
    out = fused_dspark_loss(factors, labels.reshape(-1, GAMMA), valid.reshape(-1, GAMMA), conf, weights,
                            chunk_rows=CHUNK_ROWS)
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
            start = clock(device)
            vocab_step(drafters[name], batch, weights)
            sync(device)
            times[name].append(clock(device) - start)
    rows = []
    for k in names[1:]:
        rows.append({
            "k": k, "full_s": statistics.median(times["full"]), "vocab_s": statistics.median(times[k]),
            "time_ratio": statistics.median(a / b for a, b in zip(times[k], times["full"])),
            "full_mb": peak["full"] / 2**20, "vocab_mb": peak[k] / 2**20, "mem_ratio": peak[k] / peak["full"],
        })
    return rows


def section_vocab(args: argparse.Namespace, device: torch.device) -> None:
    """The fused step with a draft vocabulary of k ids against the full-vocabulary one, per size."""
    names, repeats, threads = args.vocab_sizes, args.repeats, args.threads
    print(f"== fused DSpark train step with a draft vocabulary of k ids vs the full vocabulary "
          f"(same drafter and batch), γ={GAMMA}, {device.type}, threads {threads}")
    header = f"{'size':<6}{'V':>9}{'k':>8}{'full s':>10}{'k s':>10}{'time k/full':>13}{'full MB':>10}{'k MB':>10}{'mem k/full':>12}"
    print_header(header)
    for name in names:
        size = VOCAB_SIZES[name]
        rows = bench_draft_vocab(size, repeats or size.repeats, device)
        if not rows:
            print(f"{name:<6}{size.vocab:>9,}  (no k in {VOCAB_KS} below V)")
        for r in rows:
            print(f"{name:<6}{size.vocab:>9,}{r['k']:>8,}{r['full_s']:>10.3f}{r['vocab_s']:>10.3f}{r['time_ratio']:>13.3f}"
                  f"{r['full_mb']:>10.1f}{r['vocab_mb']:>10.1f}{r['mem_ratio']:>12.3f}")
    print("time k/full: paired median ratio of step times; mem: peak bytes allocated by the step.")


def section_eagle3(args: argparse.Namespace, device: torch.device) -> None:
    """The Eagle3 TTT step (drafter forward over T steps + loss + backward) with the closed-form loss
    (`eagle3_loss`, what the trainer runs) against the checkpointed autograd one, per size."""
    from dspark.training.eagle3_loss import checkpointed_eagle3_loss, eagle3_loss
    from dspark.modeling import Eagle3Drafter

    sizes = chosen_sizes(args)
    print(f"\n== eagle3: TTT step (7 steps, forward + backward, optimizer excluded), batch 1 sequence of the size's "
          f"tokens, draft vocabulary k = V/3, {device.type}, threads {args.threads}")
    header = f"{'size':<6}{'fused s':>10}{'autograd s':>12}{'time f/a':>10}{'|Δloss|/loss':>14}"
    print_header(header)
    for size in sizes:
        torch.manual_seed(0)
        hf = Qwen3Config(vocab_size=size.vocab, hidden_size=size.d, intermediate_size=3 * size.d,
                         num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                         head_dim=size.d // size.heads, num_hidden_layers=36)
        k = size.vocab // 3
        config = DrafterConfig.from_target_config(
            hf, target_layer_ids=TARGET_LAYER_IDS[:3], mask_token_id=MASK_TOKEN_ID, num_draft_layers=1,
            block_size=GAMMA, variant="eagle3", markov_rank=0, enable_confidence_head=False,
            confidence_head_with_markov=False, draft_vocab_size=k)
        drafter = Eagle3Drafter(config).to(device)
        gen = torch.Generator().manual_seed(1)
        embed = torch.randn(size.vocab, size.d, generator=gen) * 0.02
        lm_head = torch.randn(size.vocab, size.d, generator=gen) * 0.02
        drafter.attach_shared(embed.to(device), lm_head.to(device))
        drafter.set_vocab(DraftVocab.from_target_ids(torch.randperm(size.vocab, generator=gen)[:k].sort().values,
                                                     size.vocab)).train()
        S = size.tokens
        ids = torch.randint(0, size.vocab, (1, S), generator=gen).to(device)
        feats = torch.randn(1, S, 3 * size.d, generator=gen).to(device)
        final = torch.randn(1, S, size.d, generator=gen).to(device)
        mask = torch.ones(1, S, dtype=torch.long, device=device)
        mask[:, : S // 8] = 0

        def step(loss_fn) -> float:
            drafter.zero_grad(set_to_none=True)
            out = loss_fn(drafter, drafter(feats, ids), final, mask)
            (out.loss / out.denominator).backward()
            return float(out.loss.detach())

        steps = {"fused": lambda: step(eagle3_loss), "autograd": lambda: step(checkpointed_eagle3_loss)}
        loss = {v: f() for v, f in steps.items()}  # warm-up
        times = interleaved_times(steps, args.repeats or size.repeats, device)
        print(f"{size.name:<6}{statistics.median(times['fused']):>10.3f}{statistics.median(times['autograd']):>12.3f}"
              f"{paired_ratio(times, 'fused', 'autograd'):>10.3f}"
              f"{abs(loss['fused'] - loss['autograd']) / abs(loss['autograd']):>14.1e}")
    print("time f/a: paired median ratio of step times.")


def section_optimizer(args: argparse.Namespace, device: torch.device) -> None:
    """The AdamW step over a drafter's trainable parameters: the fused kernel
    (dspark.training.schedule.make_adamw) against torch's foreach path, from the same state and
    gradients; and the largest parameter difference after one step of each (rounding only)."""
    from dspark.training.schedule import make_adamw

    print_header(f"{'size':<6}{'params':>12}{'foreach s':>11}{'fused s':>10}{'fused/foreach':>15}{'max |Δp|':>11}",
                 title=f"AdamW step over the drafter's trainable parameters, fused against foreach; {device.type}, "
                       f"threads {args.threads}", section="optimizer")
    for size in chosen_sizes(args):
        drafter, _ = build(size, device)
        base = [p.detach().clone() for p in drafter.trainable_parameters()]
        gen = torch.Generator().manual_seed(2)
        grads = [torch.randn(p.shape, generator=gen).to(device) * 1e-3 for p in base]
        params, opts = {}, {}
        for name, fused in (("foreach", False), ("fused", True)):
            params[name] = [torch.nn.Parameter(p.clone()) for p in base]
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            opts[name] = (make_adamw(params[name], 1e-3, 0.01, device) if fused else
                          torch.optim.AdamW(params[name], lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), foreach=True))
        for name in opts:  # the compared step: both from the same state and gradients
            opts[name].step()
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(params["foreach"], params["fused"]))
        times = interleaved_times({name: opts[name].step for name in opts}, args.repeats or max(size.repeats, 5), device)
        n = sum(p.numel() for p in base)
        print(f"{size.name:<6}{n:>12,}{statistics.median(times['foreach']):>11.4f}{statistics.median(times['fused']):>10.4f}"
              f"{paired_ratio(times, 'fused', 'foreach'):>15.3f}{diff:>11.1e}")
    print("fused/foreach: paired median ratio of step times (below 1: the fused kernel is faster); max |Δp|: after "
          "one step of each from the same parameters and gradients.")


SECTIONS = {"steps": section_steps, "precision": section_precision, "demo": section_demo, "vocab": section_vocab,
            "eagle3": section_eagle3, "optimizer": section_optimizer}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=["steps"],
                   help="what to measure (default: steps)")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["S2", "S3"],
                   help="sizes of the steps and precision sections (default S2 S3; S4 is SmolLM2-sized)")
    p.add_argument("--quick", action="store_true", help="one tiny size, 2 repeats (the smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default: per size)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPU time = the work)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--demo-data", default="/tmp/demo-runs/data", help="a `dspark prepare` folder of the SmolLM2 demo")
    p.add_argument("--demo-modes", nargs="+", choices=["cache", "online"], default=["cache", "online"])
    p.add_argument("--demo-samples", type=int, default=8, help="training samples in the timed global batch (multiple of 4)")
    p.add_argument("--demo-repeats", type=int, default=2, help="timed steps per demo run")
    p.add_argument("--vocab-sizes", nargs="+", choices=sorted(VOCAB_SIZES), default=["S3", "S4", "SQ"],
                   help="sizes of the vocab section")
    p.add_argument("--allocator", choices=["system", "retain"], default="system",
                   help="CPU memory: 'system' as every PyTorch CPU process gets it (freed [N, γ, V] tensors go back "
                        "to the OS, and the next step page-faults them in again); 'retain' reruns this script with "
                        "glibc keeping freed memory (MALLOC_MMAP_MAX_=0, no trimming), like CUDA's caching allocator")
    return p.parse_args(argv)


# glibc settings under which freed memory stays in the process: no mmap for large blocks, no trimming.
RETAIN_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**50), "MALLOC_TOP_PAD_": "0"}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.allocator == "retain" and any(os.environ.get(k) != v for k, v in RETAIN_ENV.items()):
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], {**os.environ, **RETAIN_ENV})
    if args.device.startswith("cpu"):
        print(f"CPU allocator: {args.allocator}" + (" (glibc keeps freed memory: no page faults on reuse)"
                                                    if args.allocator == "retain" else ""))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    for name in args.sections:
        SECTIONS[name](args, device)


if __name__ == "__main__":
    main()
