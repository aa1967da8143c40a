"""What one speculative round costs, in target-only decoding steps (SmolLM2-135M on CPU).

A round (draft a block of γ = 7, verify γ+1 = 8 tokens in one target forward,
accept) must cost at most ~1.5 target-only steps for speculation to pay as soon
as τ > 1.5. This script measures both with the library's own loops
(`dspark.decoding.speculative_generate` / `target_generate`), timing each call
of the pieces they use, and prints the medians, their ratio and the breakdown
of a round:

    draft backbone   Drafter.propose minus its sequential stage
    sequential loop  Drafter.sample_block (Eq. 4 left-to-right sampling + confidences)
    verification     the target forward over x_0..x_γ (with the LM head on all 8 rows)
    acceptance       target probabilities + rejection sampling (mean per round)
    bookkeeping      target cache crop + drafter context extend

A random-init drafter is enough: only the cost matters, so every round verifies
all γ drafts (τ ≈ 1 and the rounds do not end early).

    .venv/bin/python bench/decode_round.py [--rounds 30] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from dspark.build import build_drafter, load_target
from dspark.config import load_config
from dspark.decoding import speculative_generate, target_generate

CONFIG = Path(__file__).resolve().parents[1] / "config" / "dspark" / "dspark_smollm2_135m.py"
PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of light scattering."


class CallTimes:
    """Wraps a callable and keeps the wall-clock duration and start time of every call."""

    def __init__(self, fn):
        self.fn, self.seconds, self.starts = fn, [], []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.starts.append(start)
            self.seconds.append(time.perf_counter() - start)


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


PARTS = ("draft backbone", "sequential loop", "verification", "acceptance", "bookkeeping")


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds (and target-only steps) to measure")
    parser.add_argument("--chunk", type=int, default=5, help="rounds / steps per alternating chunk")
    parser.add_argument("--warmup", type=int, default=1, help="chunks run before measuring")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    config = load_config(CONFIG)
    target = load_target(config)
    drafter = build_drafter(config, target)
    gamma = drafter.config.block_size
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    generator = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs, target SmolLM2-135M fp32, drafter {config.drafter.num_draft_layers} layers "
        f"γ={gamma}, prompt {len(prompt)} tokens, T={args.temperature}"
    )
    if os.getloadavg()[0] > os.cpu_count():
        print("warning: other processes share these CPUs; multi-threaded matmuls then stall and timings are unreliable")

    # Target-only steps and speculative rounds are measured in alternating chunks, so that
    # both see the same load on a shared machine. Every forward of target_generate after
    # its prefill is one step; a round runs from one propose() call to the next.
    steps, rounds = [], []
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    chunks = -(-args.rounds // args.chunk)
    for chunk in range(args.warmup + chunks):
        timed = TimedTarget(target)
        target_generate(timed, prompt, max_new_tokens=args.chunk + 1, temperature=args.temperature, generator=generator)
        timed_steps = timed.forward.seconds[1:]

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
        rounds += [b - a for a, b in zip(propose.starts, propose.starts[1:])]
        parts["draft backbone"] += [p - s for p, s in zip(propose.seconds[:n], sample_block.seconds)]
        parts["sequential loop"] += sample_block.seconds[:n]
        parts["verification"] += timed.forward.seconds[1 : n + 1]
        parts["acceptance"] += [result.timings["accept"] / len(result.rounds)] * n
        parts["bookkeeping"] += [e + c for e, c in zip(extend.seconds[1:], timed.crop_cache.seconds)]
        if any(r.accepted for r in result.rounds):
            print(f"note: {sum(r.accepted for r in result.rounds)} drafts accepted in chunk {chunk}")

    step, round_time = statistics.median(steps), statistics.median(rounds)
    print(f"target-only step (median of {len(steps)}): {ms(step)}")
    print(f"speculative round (median of {len(rounds)}): {ms(round_time)}")
    print(f"ratio round / step: {round_time / step:.2f}   (speculation pays once τ > {round_time / step:.2f})")
    print("breakdown of a round (medians; acceptance is a mean per run):")
    medians = {name: statistics.median(values) for name, values in parts.items()}
    for name, seconds in medians.items():
        print(f"  {name:16s} {ms(seconds)}  {100 * seconds / round_time:5.1f} %")
    rest = round_time - sum(medians.values())
    print(f"  {'rest':16s} {ms(rest)}  {100 * rest / round_time:5.1f} %  (python, hooks, rounding of medians)")


if __name__ == "__main__":
    main()
