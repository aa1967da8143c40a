"""What one speculative round costs, in target-only decoding steps (SmolLM2-135M on CPU).

A round (draft a block of γ = 7, verify γ+1 = 8 tokens in one target forward,
accept) must cost few target-only steps for speculation to pay as soon as τ
passes that ratio. This script measures both with the library's own loops
(`dspark.decoding.loop.speculative_generate` / `target_generate`), timing each call
of the pieces they use, and prints the medians, their ratio and the breakdown
of a round. A third loop is the baseline both are held against: plain
transformers decoding on the same weights (`model(input_ids=..., past_key_values=...,
use_cache=True)` one token at a time, softmax + torch.multinomial or argmax), so
"our step / plain step" says whether the library's target-only loop costs
anything of its own, and "round / plain step" is the price of a round in the
steps a user of transformers would compare against.

    draft backbone   Drafter.propose minus its sequential stage
    sequential loop  Drafter.sample_block (Eq. 4 left-to-right sampling + confidences;
                     for DFlash (--config config/dflash/...) only the per-position sampling)
    verification     the target forward over x_0..x_γ (with the LM head on all 8 rows)
    acceptance       target probabilities + rejection sampling (mean per round; always wall clock,
                     from the loop's own PhaseClock)
    bookkeeping      target cache crop + drafter context extend

A last measurement isolates the kernels: the target's products alone (every linear of its
decoder layers in forward order, then the LM head, through `dspark.kernels.cpu_linear.linear` as the
forward calls them, on random inputs; no attention, norms or cache) for 1 row and for γ + 1
rows. Their difference, in target steps, is the kernels' part of what a verification forward
costs beyond a step (the code around the products cannot take it back); on a CPU whose 8-row
kernel is compute-bound it is most of that excess.

A random-init drafter is enough: only the cost matters, so every round verifies
all γ drafts (τ ≈ 1 and the rounds do not end early).

Both dtypes are measured by default, each against its own target-only steps:
float32 (the library default) and bfloat16 (what `--dtype auto` decodes in on a
CPU with native bf16, and on GPUs). bfloat16 is skipped with a note on a CPU
without native bf16, where oneDNN emulates it.

    .venv/bin/python bench/decode_round.py [--rounds 30] [--threads 2] [--clock wall|cpu] [--dtypes float32 bfloat16]
                                           [--temperature 1.0] [--isa native|avx2] [key=value config overrides ...]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.kernels import cpu_linear
from dspark.build import build_drafter, cpu_has_native_bf16, load_target, prepare_for_decoding
from dspark.config import load_config
from dspark.decoding.loop import speculative_generate, target_generate

# The libraries' own ISA switches: oneDNN (packed and bf16 products), MKL (float32 F.linear) and ATen's
# vectorised kernels all stop at AVX2, as on a CPU without AVX-512.
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
CONFIG = Path(__file__).resolve().parents[1] / "config" / "dspark" / "dspark_smollm2_135m.py"
PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of light scattering."


# The clock every duration is read from: wall clock by default; --clock cpu switches to this
# thread's CPU time, which time-slicing on a shared machine does not inflate (valid at --threads 1,
# where every matmul runs on the calling thread).
CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCK["wall"]


class CallTimes:
    """Wraps a callable and keeps the duration and start time of every call (on `clock`)."""

    def __init__(self, fn):
        self.fn, self.seconds, self.starts = fn, [], []

    def __call__(self, *args, **kwargs):
        start = clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.starts.append(start)
            self.seconds.append(clock() - start)


class TimedTarget:
    """The target with its forward calls timed (everything else passes through)."""

    def __init__(self, target):
        self.target = target
        self.forward = CallTimes(target)
        self.crop_cache = CallTimes(target.crop_cache)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.target, name)


def plain_transformers_steps(model, prompt: list[int], steps: int, temperature: float, generator) -> list[float]:
    """Decode with the bare transformers model, one token a forward; return the start-to-start
    seconds of the decoding iterations (sample the token, forward it), as a step is timed."""
    # transformers' own attention too (TargetModel loads "sdpa" on CPU as dspark.kernels.attention's sdpa_gqa,
    # which only differs for several query tokens: the same numbers for these one-token steps),
    # and F.linear for every product (no oneDNN-packed weights: target.cpu_linear).
    own = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with cpu_linear.suspended():
            return _plain_steps(model, prompt, steps, temperature, generator)
    finally:
        model.set_attn_implementation(own)


def _plain_steps(model, prompt: list[int], steps: int, temperature: float, generator) -> list[float]:
    from transformers import DynamicCache

    forward_params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"  # transformers 5.x renamed it
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
    starts = []
    for _ in range(steps):
        starts.append(clock())
        logits = out.logits[:, -1]
        if temperature == 0:
            token = logits.argmax(dim=-1)
        else:
            token = torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1, generator=generator)[:, 0]
        out = model(input_ids=token[:, None], use_cache=True, **{cache_kwarg: cache})
    starts.append(clock())
    return [b - a for a, b in zip(starts, starts[1:])]


def product_stack_ms(target, rows: tuple[int, ...], passes: int) -> dict[int, float]:
    """Median milliseconds of one pass of the target's products alone per row count: each linear of
    the decoder layers in module order (q, k, v, o, gate, up, down for Llama), then the LM head,
    through `cpu_linear.linear` (the packed weight where the forward would take it) on random
    [1, rows, in] inputs. Row counts alternate pass by pass, so both see the same machine."""
    weights = [(m.weight, m.bias) for m in target.layers.modules() if isinstance(m, torch.nn.Linear)]
    weights.append((target.lm_head_weight(), None))
    dtype = target.dtype
    inputs = {n: {w.shape[1]: torch.randn(1, n, w.shape[1], dtype=dtype) for w, _ in weights} for n in rows}
    times: dict[int, list[float]] = {n: [] for n in rows}
    with torch.inference_mode():
        for p in range(passes + 1):  # the first pass warms up (and packs) every weight
            for n in rows:
                start = clock()
                for w, b in weights:
                    cpu_linear.linear(inputs[n][w.shape[1]], w, b)
                if p:
                    times[n].append(clock() - start)
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}


PARTS = ("draft backbone", "sequential loop", "verification", "acceptance", "bookkeeping")


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:8.2f} ms"


def measure(config, args) -> dict[str, float]:
    """Time target-only steps and speculative rounds with the target and drafter of `config`."""
    target = load_target(config)
    drafter = prepare_for_decoding(target, build_drafter(config, target))
    gamma = drafter.config.block_size
    text = PROMPT
    while len(target.tokenizer(text)["input_ids"]) < args.prompt_tokens:  # a longer context, same question
        text = f"{text} {PROMPT}"
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    generator = torch.Generator().manual_seed(0)
    print(
        f"\n== target SmolLM2-135M {config.target.dtype}, {config.drafter.variant} drafter "
        f"{config.drafter.num_draft_layers} layers "
        f"{config.drafter.dtype}, γ={gamma}, prompt {len(prompt)} tokens, T={args.temperature}, "
        f"few-row products: {'oneDNN packed' if cpu_linear.is_registered(target.lm_head_weight()) else 'torch'} "
        f"(target.cpu_linear={config.target.cpu_linear})"
    )

    # Target-only steps and speculative rounds are measured in alternating chunks, so that
    # both see the same load on a shared machine. Both are measured start to start: a step
    # runs from one decoding forward of target_generate to the next (forward, sampling,
    # loop), a round from one propose() call to the next.
    steps, plain, rounds = [], [], []
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    chunks = -(-args.rounds // args.chunk)
    for chunk in range(args.warmup + chunks):
        timed = TimedTarget(target)
        target_generate(timed, prompt, max_new_tokens=args.chunk + 2, temperature=args.temperature, generator=generator)
        starts = timed.forward.starts[1:]  # decoding forwards (after the prefill)
        timed_steps = [b - a for a, b in zip(starts, starts[1:])]  # forward + sampling + loop, like a round
        with torch.inference_mode():
            plain_steps = plain_transformers_steps(target.model, prompt, args.chunk, args.temperature, generator)

        timed = TimedTarget(target)
        propose = CallTimes(drafter.propose)
        sample_block = CallTimes(drafter.sample_block)
        extend = CallTimes(drafter.extend_context)
        drafter.propose, drafter.sample_block, drafter.extend_context = propose, sample_block, extend
        try:  # τ ≈ 1 with a random drafter: chunk + 1 rounds, the last one without a successor
            result = speculative_generate(
                timed, drafter, prompt, max_new_tokens=args.chunk + 2, temperature=args.temperature, generator=generator
            )
        finally:
            del drafter.propose, drafter.sample_block, drafter.extend_context
        if chunk < args.warmup:
            continue
        n = len(result.rounds) - 1  # rounds with a successor
        steps += timed_steps
        plain += plain_steps
        rounds += [b - a for a, b in zip(propose.starts, propose.starts[1:])]
        parts["draft backbone"] += [p - s for p, s in zip(propose.seconds[:n], sample_block.seconds)]
        parts["sequential loop"] += sample_block.seconds[:n]
        parts["verification"] += timed.forward.seconds[1 : n + 1]
        parts["acceptance"] += [result.timings["accept"] / len(result.rounds)] * n
        parts["bookkeeping"] += [e + c for e, c in zip(extend.seconds[1:], timed.crop_cache.seconds)]
        if any(r.accepted for r in result.rounds):
            print(f"note: {sum(r.accepted for r in result.rounds)} drafts accepted in chunk {chunk}")
    summary = report(steps, plain, rounds, parts)
    products = product_stack_ms(target, (1, gamma + 1), passes=args.rounds)
    summary["products"] = (products[gamma + 1] - products[1]) / (1e3 * summary["step"])
    print(f"the target's products alone ({len(target.layers)} layers' linears + LM head, random inputs, median of "
          f"{args.rounds}): 1 row {products[1]:.2f} ms, {gamma + 1} rows {products[gamma + 1]:.2f} ms "
          f"({products[gamma + 1] / products[1]:.2f}x): {gamma + 1} rows cost {summary['products']:.2f} target steps "
          "more: the kernels' share of verify/step − 1")
    return summary


def report(steps: list[float], plain: list[float], rounds: list[float], parts: dict[str, list[float]]) -> dict:
    """Print the medians of one dtype's run and the breakdown of a round; return the summary row."""
    step, round_time, plain_step = statistics.median(steps), statistics.median(rounds), statistics.median(plain)
    print(f"plain transformers step (median of {len(plain)}): {ms(plain_step)}")
    print(f"target-only step (median of {len(steps)}): {ms(step)}   ({step / plain_step:.2f} plain steps)")
    print(f"speculative round (median of {len(rounds)}): {ms(round_time)}")
    print(f"ratio round / step: {round_time / step:.2f}   (speculation pays once τ > {round_time / step:.2f}); "
          f"round / plain step: {round_time / plain_step:.2f}")
    print("breakdown of a round (medians; acceptance is a mean per run):")
    medians = {name: statistics.median(values) for name, values in parts.items()}
    for name, seconds in medians.items():
        print(f"  {name:16s} {ms(seconds)}  {100 * seconds / round_time:5.1f} %")
    rest = round_time - sum(medians.values())
    print(f"  {'rest':16s} {ms(rest)}  {100 * rest / round_time:5.1f} %  (python, hooks, rounding of medians)")
    draft = medians["draft backbone"] + medians["sequential loop"]
    return {"plain": plain_step, "step": step, "round": round_time, "verify": medians["verification"], "draft": draft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds (and target-only steps) to measure")
    parser.add_argument("--chunk", type=int, default=5, help="rounds / steps per alternating chunk")
    parser.add_argument("--warmup", type=int, default=1, help="chunks run before measuring")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                        help="wall clock, or this thread's CPU time (robust on a shared machine; use with --threads 1)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="target and drafter dtypes to measure, one run each")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="repeat the prompt to at least this many tokens (default: one copy, ~50 tokens)")
    parser.add_argument("--config", default=str(CONFIG), help="drafter config (default: the DSpark SmolLM2 one)")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: rerun with oneDNN, MKL and ATen capped to AVX2 (a stand-in for a CPU without "
                             "AVX-512; bfloat16 is then skipped)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. drafter.num_draft_layers=1")
    args = parser.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], {**os.environ, **AVX2_ENV})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    global clock
    clock = CLOCK[args.clock]
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        print("warning: --clock cpu counts the calling thread only; with more threads it misses the workers' time")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, clock {args.clock}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs, native bf16: {cpu_has_native_bf16()}, ISA: {args.isa}"
    )
    if os.getloadavg()[0] > os.cpu_count():
        print("warning: other processes share these CPUs; multi-threaded matmuls then stall and timings are unreliable")

    results = {}
    for dtype in args.dtypes:
        if dtype == "bfloat16" and (not cpu_has_native_bf16() or args.isa == "avx2"):
            print("\n== bfloat16 skipped: no native bf16 (AVX512-BF16 / AMX) on this CPU or under --isa avx2, "
                  "oneDNN would emulate it")
            continue
        config = load_config(args.config, [*args.overrides, f"target.dtype={dtype}", f"drafter.dtype={dtype}"])
        results[dtype] = measure(config, args)

    print("\n== summary (ratios are what matter; the machine is shared)")
    print(
        f"{'dtype':10s} {'plain ms':>9s} {'step ms':>9s} {'round ms':>9s} {'step/plain':>11s} {'verify/step':>12s} "
        f"{'draft/step':>11s} {'round/step':>11s} {'round/plain':>12s} {'products +steps':>16s}"
    )
    for dtype, r in results.items():
        print(
            f"{dtype:10s} {1e3 * r['plain']:9.2f} {1e3 * r['step']:9.2f} {1e3 * r['round']:9.2f} "
            f"{r['step'] / r['plain']:11.2f} {r['verify'] / r['step']:12.2f} {r['draft'] / r['step']:11.2f} "
            f"{r['round'] / r['step']:11.2f} {r['round'] / r['plain']:12.2f} {r['products']:16.2f}"
        )


if __name__ == "__main__":
    main()
