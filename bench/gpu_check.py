"""The GPU paths in one prepared run: bf16 training with sdpa vs flex attention (eager and
compiled), bf16 decoding cost, losslessness on the device, SPS profile, NCCL.

Nothing is downloaded: the target is a randomly initialised Qwen3 of a chosen size
(default: Qwen3-0.6B geometry, 28 layers, d = 1024, V = 151,936) and the drafter is
the reference recipe's (5 layers, γ = 7, Markov rank 256, confidence head). Every
section runs on its own: a failure prints FAIL with its traceback and the run goes
on. Timings are medians after warm-up with CUDA synchronisation. The summary is
also written as JSON to $OUT/gpu_check.json (or --json).

    python3 bench/gpu_check.py                    # on the GPU machine, about 3-5 minutes
    python3 bench/gpu_check.py --quick            # tiny sizes on CPU: the smoke test

Sections:
  train    one DraftLossModule step (cached target features, fused loss, bf16 autocast,
           fp32 master weights) with sdpa masks, flex attention, and flex compiled
           (eager masks instead of flex on CPU): losses and gradients must agree;
           ms/step, anchor positions/s, peak memory
  decode   bf16 target-only steps vs speculative rounds (random drafter, every round
           verifies γ drafts): the round/step ratio; greedy speculative == greedy
           target-only in fp32
  batched  batched speculative decoding (dspark.decoding.batched) at R = 1, 8, 64 rows: tokens/s
           against target-only decoding at the same R, and what a round costs in target steps at R;
           every request's tokens against R = 1's
  lossless rejection_sample on the device against the exact output distribution
  sps      the target's steps/s at B = 1..512 batch tokens (paper Section 3.2.2)
  nccl     a one-rank NCCL process group and an all_reduce
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.data.anchors import sample_anchors  # noqa: E402
from dspark.decoding.loop import speculative_generate, target_generate  # noqa: E402
from dspark.training.loss import LossWeights  # noqa: E402
from dspark.modeling import Drafter, DrafterConfig  # noqa: E402
from dspark.target import TargetModel  # noqa: E402
from dspark.training.step import DraftLossModule  # noqa: E402
from dspark.decoding.verify import rejection_sample  # noqa: E402

SIZES = {
    # name: target geometry, drafter layers, Markov rank, batch, sequence length, anchors
    "qwen3-0.6b": dict(d=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072, vocab=151_936,
                       draft_layers=5, rank=256, batch=4, seq=2048, anchors=512, layer_ids=[1, 7, 13, 19, 25]),
    "quick": dict(d=64, layers=4, heads=4, kv=2, head_dim=16, inter=128, vocab=512,
                  draft_layers=2, rank=16, batch=2, seq=96, anchors=16, layer_ids=[0, 1, 3]),
}
RESULTS: dict[str, Any] = {}


def section(name: str) -> Callable:
    """Run a section, record PASS/FAIL and its numbers; never stop the run."""

    def wrap(fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> None:
            print(f"\n== {name}", flush=True)
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs) or {}
                ok = bool(out.pop("ok", True))
                RESULTS[name] = {"status": "PASS" if ok else "FAIL", **out}
            except Exception as err:  # report and go on
                traceback.print_exc()
                RESULTS[name] = {"status": "FAIL", "error": f"{type(err).__name__}: {err}"}
            RESULTS[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(f"-- {name}: {RESULTS[name]['status']} ({RESULTS[name]['seconds']} s)", flush=True)

        return run

    return wrap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_target(size: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> TargetModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=size["vocab"], hidden_size=size["d"], intermediate_size=size["inter"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv"],
        head_dim=size["head_dim"], max_position_embeddings=32_768, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return TargetModel(model, size["layer_ids"])


def build_drafter(size: dict, target: TargetModel, attn: str, seed: int = 0) -> Drafter:
    config = DrafterConfig.from_target_config(
        target.text_config, target_layer_ids=size["layer_ids"], mask_token_id=size["vocab"] - 1,
        num_draft_layers=size["draft_layers"], block_size=7, markov_rank=size["rank"],
        num_anchors=size["anchors"], attn_implementation=attn,
    )
    torch.manual_seed(seed)
    drafter = Drafter(config).to(target.device)
    with torch.no_grad():  # a non-zero Markov head, so the sequential path does real work
        drafter.markov_head.markov_w2.weight.normal_(0, 0.02)
    return drafter.attach_target(target)


# ----------------------------------------------------------------------------- train
@section("train")
def check_train(size: dict, device: torch.device, repeats: int, compile_flex: bool) -> dict:
    target = build_target(size, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    gen = torch.Generator().manual_seed(0)
    B, S = size["batch"], size["seq"]
    input_ids = torch.randint(0, size["vocab"] - 1, (B, S), generator=gen).to(device)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    loss_mask[:, S // 4 :] = 1  # a prompt, then the answer
    anchors, keep = sample_anchors(loss_mask, size["anchors"], generator=gen)
    # Offline mode, as with the feature cache: the target's features are computed once, and
    # the compiled variant compiles exactly what the trainer compiles (the loss module).
    features = target(input_ids, return_logits=False)
    target_s = timed(lambda: target(input_ids, return_logits=False), device, repeats, warmup=1)
    batch = {"input_ids": input_ids, "loss_mask": loss_mask.to(device),
             "features": features.features, "final_hidden": features.last_hidden}
    anchors, keep = anchors.to(device), keep.to(device)
    print(f"  target forward over the batch (online mode would add this per step): {1e3 * target_s:.2f} ms")
    weights = LossWeights(ce=0.1, tv=0.9, conf=1.0, decay_gamma=4.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else None

    # flex attention has no CPU backward: the CPU smoke run compares sdpa with the eager masks.
    second = "flex" if device.type == "cuda" else "eager"
    variants = [("sdpa", False), (second, False)] + ([(second, True)] if compile_flex else [])
    reference = build_drafter(size, target, "sdpa")
    out: dict[str, Any] = {"target_forward_ms": 1e3 * target_s}
    losses, grads = {}, {}
    for attn, compiled in variants:
        name = f"{attn}{'+compile' if compiled else ''}"
        drafter = build_drafter(size, target, attn)
        drafter.load_state_dict(reference.state_dict())
        module = DraftLossModule(drafter, target, weights, chunk_rows=256)
        step_fn = torch.compile(module) if compiled else module
        params = drafter.trainable_parameters()

        def step() -> torch.Tensor:
            for p in params:
                p.grad = None
            if autocast is not None:
                with autocast:
                    loss, _ = step_fn(batch, anchors, keep)
            else:
                loss, _ = step_fn(batch, anchors, keep)
            loss.backward()
            return loss

        t0 = time.perf_counter()
        loss = step()  # first call: compilation for the compiled variant
        sync(device)
        first = time.perf_counter() - t0
        losses[name] = float(loss.detach())
        grads[name] = torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed(step, device, repeats, warmup=1)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        positions = int(keep.sum()) * 7
        out[name] = {"loss": losses[name], "first_call_s": round(first, 2), "ms_per_step": round(1e3 * seconds, 2),
                     "anchor_positions_per_s": round(positions / seconds), "peak_GiB": round(peak, 2)}
        print(f"  {name:14s} loss {losses[name]:.5f}  first call {first:7.2f} s  {1e3 * seconds:9.2f} ms/step  "
              f"{positions / seconds:12,.0f} anchor positions/s  peak {peak:.2f} GiB", flush=True)

    ok = True
    base = grads["sdpa"]
    for name in losses:
        rel = abs(losses[name] - losses["sdpa"]) / max(abs(losses["sdpa"]), 1e-12)
        cos = float(torch.nn.functional.cosine_similarity(grads[name], base, dim=0))
        out[name].update(loss_rel_diff_vs_sdpa=rel, grad_cosine_vs_sdpa=cos)
        print(f"  {name:14s} |Δloss|/loss vs sdpa {rel:.2e}   grad cosine vs sdpa {cos:.6f}")
        ok &= rel < 2e-2 and cos > 0.99
    out["ok"] = ok
    return out


# ---------------------------------------------------------------------------- decode
@section("decode")
def check_decode(size: dict, device: torch.device, new_tokens: int) -> dict:
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, size["vocab"] - 1, (512 if device.type == "cuda" else 32,), generator=gen).tolist()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(size, device, dtype)
    drafter = build_drafter(size, target, "sdpa").to(dtype)
    drafter.eval()

    def per_step(result) -> float:
        return result.timings["decode"] / max(1, len(result.tokens) - 1)

    def per_round(result) -> float:
        return (result.timings["total"] - result.timings["prefill"]) / max(1, len(result.rounds))

    for _ in range(2):  # warm-up (kernels, allocator)
        target_generate(target, prompt, max_new_tokens=8, generator=torch.Generator(device=device).manual_seed(0))
        speculative_generate(target, drafter, prompt, max_new_tokens=8,
                             generator=torch.Generator(device=device).manual_seed(0))
    steps, rounds, verify, draft = [], [], [], []
    for seed in range(3):
        base = target_generate(target, prompt, max_new_tokens=new_tokens,
                               generator=torch.Generator(device=device).manual_seed(seed))
        spec = speculative_generate(target, drafter, prompt, max_new_tokens=new_tokens,
                                    generator=torch.Generator(device=device).manual_seed(seed))
        steps.append(per_step(base))
        rounds.append(per_round(spec))
        verify.append(spec.timings["verify"] / len(spec.rounds))
        draft.append(spec.timings["draft"] / len(spec.rounds))
    step, rnd = statistics.median(steps), statistics.median(rounds)
    out.update(dtype=str(dtype).removeprefix("torch."), prompt_tokens=len(prompt), step_ms=1e3 * step,
               round_ms=1e3 * rnd, verify_per_step=statistics.median(verify) / step,
               draft_per_step=statistics.median(draft) / step, round_per_step=rnd / step)
    print(f"  {out['dtype']}: target step {1e3 * step:.2f} ms, round {1e3 * rnd:.2f} ms, round/step {rnd / step:.2f} "
          f"(verify {out['verify_per_step']:.2f}, draft {out['draft_per_step']:.2f} steps)")

    # Greedy exactness in fp32 (bf16 rounding differs between 1- and 8-token forwards).
    target32 = build_target(size, device, torch.float32)
    drafter32 = build_drafter(size, target32, "sdpa")
    a = target_generate(target32, prompt, max_new_tokens=48, temperature=0.0).tokens
    b = speculative_generate(target32, drafter32, prompt, max_new_tokens=48, temperature=0.0).tokens
    out["greedy_fp32_identical"] = a == b
    print(f"  fp32 greedy speculative == greedy target-only: {a == b}")
    out["ok"] = a == b and math.isfinite(rnd / step)
    return out


# --------------------------------------------------------------------------- batched
@section("batched")
def check_batched(size: dict, device: torch.device, rows: list[int], new_tokens: int) -> dict:
    """Evaluation throughput of the batched decoder: 2R requests (at least 8) at each R, every round
    verifying γ drafts, against target-only decoding of the same requests at R."""
    from dspark.decoding.batch_jobs import BatchJob, speculative_batch_generate, target_batch_generate

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(size, device, dtype)
    drafter = build_drafter(size, target, "sdpa").to(dtype)
    drafter.eval()
    gen = torch.Generator().manual_seed(2)
    longest = max(rows)
    count = max(8, 2 * longest)
    plen = 512 if device.type == "cuda" else 24
    prompts = [torch.randint(0, size["vocab"] - 1, (plen - 4 * (i % 4),), generator=gen).tolist() for i in range(count)]
    kw = dict(max_new_tokens=new_tokens, temperature=1.0)
    speculative_batch_generate(target, drafter, [BatchJob(p, i) for i, p in enumerate(prompts[:4])], batch_size=4,
                               **{**kw, "max_new_tokens": 8})  # warm-up
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "requests_per_R": {}, "rows": {}}
    reference: dict[int, list[int]] = {}
    for r in rows:
        jobs = [BatchJob(p, 1000 + i, i) for i, p in enumerate(prompts[: max(8, 2 * r)])]
        sync(device)
        start = time.perf_counter()
        spec = speculative_batch_generate(target, drafter, jobs, batch_size=r, **kw)
        sync(device)
        spec_s = time.perf_counter() - start
        start = time.perf_counter()
        base = target_batch_generate(target, jobs, batch_size=r, **kw)
        sync(device)
        base_s = time.perf_counter() - start
        tokens, base_tokens = sum(len(x.tokens) for x in spec), sum(len(x.tokens) for x in base)
        rounds = sum(len(x.rounds) for x in spec)
        # seconds per round and per target-only step, prefills out (each request's share summed)
        decode_s = lambda rows: sum(sum(v for k, v in x.timings.items() if k != "prefill") for x in rows)  # noqa: E731
        round_s = decode_s(spec) / max(1, rounds) * r
        step_s = decode_s(base) / max(1, base_tokens - len(base)) * r
        for x in spec:
            reference.setdefault(x.tag, x.tokens)
        same = sum(reference[x.tag] == x.tokens for x in spec)
        out["rows"][str(r)] = dict(requests=len(jobs), spec_tokens_per_s=tokens / spec_s,
                                   target_tokens_per_s=base_tokens / base_s, speedup=(tokens / spec_s) / (base_tokens / base_s),
                                   tau=sum(y.tau for x in spec for y in x.rounds) / max(1, rounds),
                                   round_ms=1e3 * round_s, target_step_ms=1e3 * step_s,
                                   round_per_step=round_s / step_s if step_s > 0 else math.nan,
                                   same_tokens_as_first_R=f"{same}/{len(spec)}")
        row = out["rows"][str(r)]
        print(f"  R = {r:>3}: {row['spec_tokens_per_s']:9.1f} tok/s speculative, {row['target_tokens_per_s']:9.1f} "
              f"target-only ({row['speedup']:.2f}x), round {row['round_ms']:.2f} ms = {row['round_per_step']:.2f} "
              f"target steps at R, same tokens as R = {rows[0]}: {row['same_tokens_as_first_R']}", flush=True)
    first = out["rows"][str(rows[0])]["spec_tokens_per_s"]
    for r in rows:
        out["rows"][str(r)]["vs_first_R"] = out["rows"][str(r)]["spec_tokens_per_s"] / first
    out["ok"] = all(math.isfinite(v["spec_tokens_per_s"]) for v in out["rows"].values())
    return out


# -------------------------------------------------------------------------- lossless
@section("lossless")
def check_lossless(device: torch.device, samples: int) -> dict:
    """One draft position, V = 6: P(next emitted token) must be the target's distribution."""
    gen = torch.Generator(device=device).manual_seed(3)
    p_t = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], device=device)
    p_d = torch.tensor([0.05, 0.10, 0.40, 0.30, 0.10, 0.05], device=device)
    draft = torch.multinomial(p_d.expand(samples, -1), 1, generator=gen)  # [N, 1]
    n_acc, nxt = rejection_sample(draft, p_d.expand(samples, 1, -1), p_t.expand(samples, 2, -1), generator=gen)
    first = torch.where(n_acc > 0, draft[:, 0], nxt)  # the first emitted token
    counts = torch.bincount(first, minlength=6).double().cpu()
    expected = samples * p_t.double().cpu()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # df = 5: P(chi2 > 20.5) ≈ 0.001
    print(f"  {samples:,} samples: counts {counts.long().tolist()}, chi-square {chi2:.2f} (df 5, 0.1 % cut 20.5)")
    return {"chi2": chi2, "samples": samples, "ok": chi2 < 20.5}


# ------------------------------------------------------------------------------- sps
@section("sps")
def check_sps(size: dict, device: torch.device, sizes: list[int]) -> dict:
    from dspark.scheduling.sps_profile import profile_sps_runs

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(size, device, dtype)
    profile = profile_sps_runs(target, sizes, context_len=512 if device.type == "cuda" else 32, repeats=5)
    for b, sps in zip(profile.batch_tokens, profile.steps_per_sec):
        print(f"  B = {b:>4}: {1e3 / sps:8.3f} ms  {sps:9.1f} steps/s")
    return {"batch_tokens": profile.batch_tokens, "steps_per_sec": [round(x, 2) for x in profile.steps_per_sec]}


# ------------------------------------------------------------------------------ nccl
@section("nccl")
def check_nccl(device: torch.device) -> dict:
    import torch.distributed as dist

    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    # init_process_group wants an indexed device ("cuda:0"), not "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", index))
    try:
        x = torch.arange(4.0, device=device)
        dist.all_reduce(x)
        ok = x.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
    return {"ok": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, CPU unless --device says otherwise")
    parser.add_argument("--device", default="", help="default: cuda if available, else cpu")
    parser.add_argument("--size", default="", choices=["", *SIZES], help="default: qwen3-0.6b (quick: quick)")
    parser.add_argument("--sections", nargs="+", default=["train", "decode", "batched", "lossless", "sps", "nccl"])
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="the compiled training variant (auto: on a GPU only)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: up to 4)")
    parser.add_argument("--json", default="", help="where to write the summary (default: $OUT/gpu_check.json)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu"))
    size = SIZES[args.size or ("quick" if args.quick else "qwen3-0.6b")]
    quick = args.quick or device.type != "cuda"
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, min(4, os.cpu_count() or 1)))

    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "bf16": torch.cuda.is_bf16_supported() if device.type == "cuda" else None}
    RESULTS["env"] = env
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)

    if "train" in args.sections:
        compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
        check_train(size, device, repeats=2 if quick else 10, compile_flex=compiled)
    if "decode" in args.sections:
        check_decode(size, device, new_tokens=16 if quick else 128)
    if "batched" in args.sections:
        check_batched(size, device, [1, 4] if quick else [1, 8, 64], new_tokens=8 if quick else 128)
    if "lossless" in args.sections:
        check_lossless(device, samples=20_000 if quick else 2_000_000)
    if "sps" in args.sections:
        check_sps(size, device, [1, 2, 4, 8] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    if "nccl" in args.sections:
        check_nccl(device)

    print("\n== summary")
    for name, res in RESULTS.items():
        if name != "env":
            print(f"  {name:9s} {res['status']}  {res.get('error', '')}")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "")
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=2, default=str))
        print(f"summary written to {path}")
    if any(r.get("status") == "FAIL" for r in RESULTS.values() if isinstance(r, dict) and "status" in r):
        sys.exit(1)


if __name__ == "__main__":
    main()
