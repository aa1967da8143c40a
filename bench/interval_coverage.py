"""Coverage of the 95 % intervals over requests, at the designs evaluations use.

An evaluation's intervals rest on few requests per benchmark (2 to 8) and, for the
conditional acceptance at late draft positions, on few rounds: at the demo's design
(9 benchmarks × 4 requests × 24 new tokens, a drafter accepted about 1.3 tokens a round)
only 0.20 / 0.08 / 0.03 of the rounds reach positions 2 / 3 / 4. This script simulates
round logs with a known truth at such designs and measures, for every interval the
reports print, how often it covers the truth, how often there is none, how often it
leaves [0, 1] (proportions) and how wide it is.

The simulated requests (``simulate_rounds``): benchmark g has a fixed effect b_g (nine
values spread over [−0.6, 0.6] on the logit scale: the benchmarks of an evaluation are
fixed, only their requests are drawn); request i draws u_i ~ N(0, σ_u²); its draft at
position k is accepted with probability σ(logit q_k + b_g + u_i) given the earlier ones
were, so a request that drafts well does so at every position. It decodes rounds of
m + 1 tokens (m = accepted drafts before the first rejection, at most γ) until it has
``tokens`` new tokens. A second drafter B of the same requests (``paired``) shares u_i
plus its own noise. The truth of each statistic is its value over 20,000 requests per
benchmark (the ratio of expected sums at the design's equal request counts).

Statistics and their intervals (``dspark.bootstrap``):

- τ pooled over rounds: the stratified jackknife on the log scale, Student's t at the design
  degrees of freedom, clipped at τ >= 1 (``jackknife_ci``);
- τ_A / τ_B of two drafters on the same requests (paired, ``dspark.evaluation.paired``):
  the same on the log scale, each request deleted from both drafters' sums;
- conditional acceptance at k = 2..4: Wilson on effective counts (``proportion_ci``),
  none below its minimum of reaching rounds and requests.

    python bench/interval_coverage.py                      # every design, 1000 simulated evaluations each
    python bench/interval_coverage.py --reps 200 --method rescaled-sums   # the reference method

``--method rescaled-sums`` computes every interval, proportions included, with the common
alternative the library's correction is measured against: each group's resampled sums stretched
about its observed sums by sqrt(n/(n − 1)) before the statistic is taken, and the percentile
interval widened by t_ν / z with Satterthwaite's ν from each group's share of the variance.
Stretched sums can turn negative where few rounds reach a position, which is how its proportions
leave [0, 1].
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark.bootstrap import jackknife_ci, proportion_ci, student_t_quantile  # noqa: E402

GAMMA = 4
BENCHMARK_EFFECTS = np.linspace(-0.6, 0.6, 9)  # b_g, logit scale
SIGMA_REQUEST = 0.6  # σ_u, logit scale
PAIRED_NOISE = 0.3  # drafter B's own per-position noise around the shared u_i
# Per-position acceptance q_k (before the benchmark and request effects) of drafter A and B.
PROFILES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # the demo's design: 0.20 / 0.08 / 0.03 of the rounds reach positions 2 / 3 / 4
    "sparse": ((0.20, 0.33, 0.28, 0.25), (0.20, 0.25, 0.20, 0.15)),
    # a drafter accepted about 2.3 tokens a round: every position is reached often
    "dense": ((0.60, 0.65, 0.65, 0.65), (0.60, 0.50, 0.40, 0.30)),
}


@dataclass(frozen=True)
class Design:
    """An evaluation's design: an acceptance profile, requests per benchmark, new tokens per request."""

    profile: str
    per_benchmark: int
    tokens: int = 24

    @property
    def name(self) -> str:
        return f"{self.profile} 9×{self.per_benchmark}×{self.tokens}"


DESIGNS = (Design("sparse", 4), Design("sparse", 2), Design("sparse", 8),
           Design("dense", 2), Design("dense", 4), Design("dense", 8))


def simulate_rounds(rng: np.random.Generator, reps: int, per_benchmark: int, q: tuple[float, ...], *,
                    tokens: int = 24, u: np.ndarray | None = None, noise: float = 0.0) -> dict[str, np.ndarray]:
    """``reps`` evaluations of 9 benchmarks × ``per_benchmark`` requests (module docstring).

    Returns per request: tau [reps, 9, n, 2] = (Σ (m + 1), rounds), cond [reps, 9, n, γ, 2] =
    (rounds with m >= k, rounds with m >= k − 1) per position k, and u [reps, 9, n]."""
    if u is None:
        u = rng.normal(0.0, SIGMA_REQUEST, (reps, len(BENCHMARK_EFFECTS), per_benchmark))
    base = np.log(np.asarray(q)) - np.log1p(-np.asarray(q))
    logits = base + BENCHMARK_EFFECTS[None, :, None, None] + u[..., None]  # [reps, 9, n, γ]
    if noise:
        logits = logits + rng.normal(0.0, noise, logits.shape)
    p = 1.0 / (1.0 + np.exp(-logits))
    accepted = rng.random(u.shape + (tokens, len(q))) < p[..., None, :]  # at most `tokens` rounds
    m = np.cumprod(accepted, axis=-1).sum(axis=-1)  # [reps, 9, n, rounds]
    emitted = m + 1
    valid = np.cumsum(emitted, axis=-1) - emitted < tokens  # rounds started before the request was done
    k = np.arange(1, len(q) + 1)
    passed = ((m[..., None] >= k) & valid[..., None]).sum(axis=-2)
    reached = ((m[..., None] >= k - 1) & valid[..., None]).sum(axis=-2)
    return {"tau": np.stack([(emitted * valid).sum(-1), valid.sum(-1)], axis=-1).astype(np.float64),
            "cond": np.stack([passed, reached], axis=-1).astype(np.float64), "u": u}


def truth(design: Design, requests: int = 20_000, seed: int = 12345) -> dict[str, np.ndarray]:
    """τ_A, τ_A / τ_B and the conditional acceptance per position at ``design``'s profile, from
    ``requests`` simulated requests per benchmark (the ratio of expected sums)."""
    q_a, q_b = PROFILES[design.profile]
    rng = np.random.default_rng(seed)
    tau_a = tau_b = cond = 0.0
    chunk = 2000
    for _ in range(max(1, requests // chunk)):
        a = simulate_rounds(rng, 1, chunk, q_a, tokens=design.tokens)
        b = simulate_rounds(rng, 1, chunk, q_b, tokens=design.tokens, u=a["u"], noise=PAIRED_NOISE)
        tau_a = tau_a + a["tau"].sum(axis=(0, 1, 2))
        tau_b = tau_b + b["tau"].sum(axis=(0, 1, 2))
        cond = cond + a["cond"].sum(axis=(0, 1, 2))
    return {"tau": np.float64(tau_a[0] / tau_a[1]), "paired": np.float64((tau_a[0] / tau_a[1]) / (tau_b[0] / tau_b[1])),
            "cond": cond[:, 0] / cond[:, 1]}


def _pooled(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)
    return s[..., 0] / s[..., 1]


def _paired(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-2)
    return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])


def _conditional(s: np.ndarray) -> np.ndarray:
    s = s.sum(axis=-3)
    return s[..., 0] / s[..., 1]


def rescaled_sums_ci(groups: list[np.ndarray], statistic, *, resamples: int, seed: int, level: float = 0.95):
    """The reference method: each group's resampled sums stretched about its observed sums by
    sqrt(n_g / (n_g − 1)), the percentile interval widened about the estimate by t_ν / z with
    Satterthwaite's ν from each group's share of the variance."""
    rng = np.random.default_rng(seed)
    observed = [g.sum(axis=0) for g in groups]
    counts = [rng.multinomial(len(g), np.full(len(g), 1 / len(g)), size=resamples).astype(np.float64)
              for g in groups]
    n = np.array([len(g) for g in groups], dtype=np.float64)
    f = np.sqrt(n / (n - 1))
    resampled = [o + fg * (np.tensordot(c, g, axes=1) - o) for o, fg, c, g in zip(observed, f, counts, groups)]
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        estimate = statistic(np.stack(observed))
        lo, hi = np.nanpercentile(statistic(np.stack(resampled, axis=1)), [2.5, 97.5], axis=0)
        base = np.stack(observed)
        shares = []
        for g, r in enumerate(resampled):
            sums = np.broadcast_to(base, (resamples,) + base.shape).copy()
            sums[:, g] = r
            shares.append(np.nanvar(statistic(sums), axis=0))
        v = np.stack(shares)
        shape = (-1,) + (1,) * (v.ndim - 1)
        spread = (v * v / (n - 1).reshape(shape)).sum(axis=0)
        nu = np.where(spread > 0, v.sum(axis=0) ** 2 / spread, (n - 1).sum())
    z = NormalDist().inv_cdf((1 + level) / 2)
    w = np.vectorize(lambda x: student_t_quantile((1 + level) / 2, float(x)) / z)(nu)
    return estimate, estimate - w * (estimate - lo), estimate + w * (hi - estimate)


@dataclass
class Tally:
    runs: int = 0
    given: int = 0
    covered: int = 0
    outside: int = 0
    width: float = 0.0

    def add(self, lo: float, hi: float, true: float, proportion: bool) -> None:
        self.runs += 1
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return
        self.given += 1
        self.covered += lo <= true <= hi
        self.outside += proportion and (lo < 0 or hi > 1)
        self.width += hi - lo

    def row(self) -> dict[str, float]:
        given = max(self.given, 1)
        return {"coverage": self.covered / given, "given": self.given / max(self.runs, 1),
                "outside": self.outside / given, "width": self.width / given}


def coverage(design: Design, reps: int = 1000, resamples: int = 400, seed: int = 7,
             method: str = "library") -> dict[str, dict[str, float]]:
    """{statistic: {coverage, given, outside, width}} over ``reps`` simulated evaluations at ``design``:
    "tau", "paired", "cond k=2" .. "cond k=4"."""
    true = truth(design)
    q_a, q_b = PROFILES[design.profile]
    rng = np.random.default_rng(seed)
    a = simulate_rounds(rng, reps, design.per_benchmark, q_a, tokens=design.tokens)
    b = simulate_rounds(rng, reps, design.per_benchmark, q_b, tokens=design.tokens, u=a["u"], noise=PAIRED_NOISE)
    tallies = {name: Tally() for name in ("tau", "paired", *(f"cond k={k}" for k in range(2, GAMMA + 1)))}
    for rep in range(reps):
        tau = list(a["tau"][rep])
        paired = [np.concatenate([x, y], axis=-1) for x, y in zip(a["tau"][rep], b["tau"][rep])]
        cond = list(a["cond"][rep])
        if method == "library":
            _, lo, hi = jackknife_ci(tau, _pooled, scale="log", support=(1.0, math.inf))
            tallies["tau"].add(lo, hi, true["tau"], False)
            _, lo, hi = jackknife_ci(paired, _paired, scale="log")
            tallies["paired"].add(lo, hi, true["paired"], False)
            _, lo, hi = proportion_ci(cond)
        elif method == "rescaled-sums":
            _, lo, hi = rescaled_sums_ci(tau, _pooled, resamples=resamples, seed=rep)
            tallies["tau"].add(lo, hi, true["tau"], False)
            _, lo, hi = rescaled_sums_ci(paired, _paired, resamples=resamples, seed=rep)
            tallies["paired"].add(lo, hi, true["paired"], False)
            _, lo, hi = rescaled_sums_ci(cond, _conditional, resamples=resamples, seed=rep)
        else:
            raise ValueError(f"method must be 'library' or 'rescaled-sums', got {method!r}")
        for k in range(2, GAMMA + 1):
            tallies[f"cond k={k}"].add(float(lo[k - 1]), float(hi[k - 1]), float(true["cond"][k - 1]), True)
    return {name: t.row() for name, t in tallies.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=1000, help="simulated evaluations per design")
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples per interval")
    p.add_argument("--method", default="library", choices=("library", "rescaled-sums"))
    p.add_argument("--designs", nargs="*", default=None,
                   help="e.g. sparse:4 dense:2 (profile:requests per benchmark[:tokens]); default: all six")
    args = p.parse_args(argv)
    designs = DESIGNS
    if args.designs:
        designs = tuple(Design(d.split(":")[0], int(d.split(":")[1]), *(int(x) for x in d.split(":")[2:]))
                        for d in args.designs)
    print(f"method {args.method}, {args.reps} simulated evaluations per design, {args.resamples} resamples; "
          "cells: coverage (share with an interval; share outside [0, 1]; mean width)")
    names = ("tau", "paired", *(f"cond k={k}" for k in range(2, GAMMA + 1)))
    print("| design | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for design in designs:
        start = time.perf_counter()
        rows = coverage(design, args.reps, args.resamples, method=args.method)
        cells = []
        for name in names:
            r = rows[name]
            extra = f"; {r['outside']:.2f} out" if name.startswith("cond") else ""
            cells.append(f"{r['coverage']:.3f} ({r['given']:.2f}{extra}; w {r['width']:.3f})")
        print(f"| {design.name} | " + " | ".join(cells) + f" |  {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
