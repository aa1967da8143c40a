"""Algorithm 1 (paper Section 3.2.2), the SPS table it prices with, and the baseline cuts.

- ``SPSTable``: the profiled cost curve SPS(B), steps per second at B batch tokens (SGLang JSON).
- ``schedule_prefix``: Algorithm 1. ``early_stop=True`` is the lossless algorithm; ``early_stop=False``
  the unconstrained search of Section 5.2, lossy on the current draft's confidences (Appendix A); its
  use on stale confidences is ``dspark.scheduling.async_scheduler``.
- ``static_lengths``, ``threshold_lengths``, ``first_below_lengths``: baseline cuts (on the cumulative
  a_{r,j}, and DeepSpec's cut at the first c_{r,j} below a threshold).

``confidences``: [R, γ] conditional c_{r,j} in [0, 1] (numpy, torch or lists), not cumulative;
a_{r,j} = Π_{i≤j} c_{r,i}, j 1-based. Lengths: int64 [R] in 0..γ, so the target's batch holds
B = R + Σ_r ℓ_r tokens. Candidates are admitted by a_{r,j} descending, ties to the smaller j, then
the smaller r: every prefix of that order is prefix-closed per request (docs/scheduling.md).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

__all__ = [
    "SPSTable",
    "SPSLike",
    "prefix_survival",
    "admission_order",
    "schedule_prefix",
    "static_lengths",
    "threshold_lengths",
    "first_below_lengths",
]


# ----------------------------------------------------------------------------
# SPS(B): the profiled cost table (paper Section 3.2.2)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SPSTable:
    """Target forward steps per second as a function of batch tokens B.

    ``sample_batch_tokens`` are the measured batch sizes (strictly increasing
    positive ints), ``sample_steps_per_sec`` the measured speeds (> 0), and
    ``max_batch_tokens`` the largest batch the engine can run.

    ``table(B)`` (B a scalar or an array):
      - B below the first sample: the first measured speed;
      - between samples: linear interpolation;
      - between the last sample and ``max_batch_tokens``: the last speed;
      - B > ``max_batch_tokens``: 0.0, i.e. infeasible (Θ = τ·0 never wins).
    A scalar B gives a Python float, an array gives a float64 array.

    JSON interop with SGLang: ``{"sample_batch_tokens": [...],
    "sample_steps_per_sec": [...], "max_batch_tokens": int}``.

    ``sample_spread`` (optional, one value >= 0 per sample): the measurement noise of
    each speed, in steps/s (``SPSProfile.table`` gives the range, max − min, of the
    speeds of the repeated timings). It is what ``noise_aware`` flattens within; it is
    not part of the JSON (SGLang's fields only) nor of equality.
    """

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    sample_spread: tuple[float, ...] | None = field(default=None, compare=False)
    _xs: np.ndarray = field(init=False, repr=False, compare=False)
    _ys: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        xs = _int_list(self.sample_batch_tokens, "sample_batch_tokens")
        ys = _float_list(self.sample_steps_per_sec, "sample_steps_per_sec")
        max_b = _int_value(self.max_batch_tokens, "max_batch_tokens")
        if len(xs) == 0:
            raise ValueError("sample_batch_tokens is empty; profile at least one batch size")
        if len(xs) != len(ys):
            raise ValueError(
                f"sample_batch_tokens has {len(xs)} entries but sample_steps_per_sec has "
                f"{len(ys)}; they must be measured pairwise"
            )
        if xs[0] < 1:
            raise ValueError(f"sample_batch_tokens must be >= 1, got {xs[0]}")
        for i in range(1, len(xs)):
            if xs[i] <= xs[i - 1]:
                raise ValueError(
                    f"sample_batch_tokens must be strictly increasing, got {xs[i - 1]} then "
                    f"{xs[i]} at index {i}; sort the samples and merge duplicates"
                )
        for i, y in enumerate(ys):
            if not (math.isfinite(y) and y > 0):
                raise ValueError(
                    f"sample_steps_per_sec must be finite and > 0, got {y} at index {i}"
                )
        if max_b < xs[-1]:
            raise ValueError(
                f"max_batch_tokens={max_b} is below the largest sample_batch_tokens={xs[-1]}; "
                "raise max_batch_tokens or drop the samples beyond it"
            )
        object.__setattr__(self, "sample_batch_tokens", tuple(xs))
        object.__setattr__(self, "sample_steps_per_sec", tuple(ys))
        object.__setattr__(self, "max_batch_tokens", max_b)
        if self.sample_spread is not None:
            spread = _float_list(self.sample_spread, "sample_spread")
            if len(spread) != len(xs) or not all(math.isfinite(v) and v >= 0 for v in spread):
                raise ValueError(f"sample_spread must hold one finite value >= 0 per sample ({len(xs)}), "
                                 f"got {self.sample_spread!r}")
            object.__setattr__(self, "sample_spread", tuple(spread))
        object.__setattr__(self, "_xs", np.asarray(xs, dtype=np.float64))
        object.__setattr__(self, "_ys", np.asarray(ys, dtype=np.float64))

    def __call__(self, batch_tokens: Union[float, np.ndarray]) -> Union[float, np.ndarray]:
        b = np.asarray(batch_tokens, dtype=np.float64)
        out = np.interp(b, self._xs, self._ys)
        out = np.where(b > self.max_batch_tokens, 0.0, out)
        if out.ndim == 0:
            return float(out)
        return out

    def noise_aware(self) -> "SPSTable":
        """This table with every rise of SPS in B that lies within the noise flattened away.

        A noise-aware lower envelope, walking B upward: the envelope starts at the
        first speed; a later speed above the envelope is lowered to it when the rise
        is at most the larger spread of the two samples (the later one and the one
        that set the envelope), and otherwise kept, starting a new envelope level.
        Speeds at or below the envelope are kept. Where the differences are noise
        the result is non-increasing in B, so Algorithm 1 never sees a few verified
        tokens as cheaper than none (SPS(B) > SPS(1)) because of timing jitter, and
        never buys longer verification with it; a rise larger than the noise is real
        (e.g. a kernel that is faster at a tile-aligned B) and stays. Without
        ``sample_spread`` the spread is 0: only exact ties are within the noise.
        Applying it twice changes nothing."""
        ys = list(self.sample_steps_per_sec)
        spread = list(self.sample_spread) if self.sample_spread is not None else [0.0] * len(ys)
        level, level_spread = ys[0], spread[0]
        for i in range(1, len(ys)):
            if level < ys[i] <= level + max(spread[i], level_spread):
                ys[i] = level  # a rise within the noise: flattened
            else:
                level, level_spread = ys[i], spread[i]
        return SPSTable(self.sample_batch_tokens, ys, self.max_batch_tokens, self.sample_spread)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_batch_tokens": list(self.sample_batch_tokens),
            "sample_steps_per_sec": list(self.sample_steps_per_sec),
            "max_batch_tokens": self.max_batch_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SPSTable":
        if not isinstance(data, Mapping):
            raise ValueError(
                f"an SPS table must be a JSON object with sample_batch_tokens, "
                f"sample_steps_per_sec and max_batch_tokens, got {type(data).__name__}"
            )
        for key in ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"):
            if key not in data:
                raise ValueError(f"SPS table is missing the field {key!r}")
        return cls(
            sample_batch_tokens=data["sample_batch_tokens"],
            sample_steps_per_sec=data["sample_steps_per_sec"],
            max_batch_tokens=data["max_batch_tokens"],
        )

    @classmethod
    def from_json(cls, path: Union[str, os.PathLike]) -> "SPSTable":
        with open(path, "r", encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def to_json(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _int_value(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if isinstance(v, numbers.Integral):
        return int(v)
    if math.isfinite(float(v)) and float(v).is_integer():
        return int(v)
    raise ValueError(f"{name} must be an integer, got {v!r}")


def _int_list(values: Any, name: str) -> list[int]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list of integers, got {type(values).__name__}")
    return [_int_value(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _float_list(values: Any, name: str) -> list[float]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{name}[{i}] must be a number, got {v!r}")
        out.append(float(v))
    return out


SPSLike = Union[SPSTable, Callable[[Any], Any]]


def _eval_sps(sps: SPSLike, batch_tokens: np.ndarray) -> np.ndarray:
    """SPS at every entry of the int array ``batch_tokens``, as float64.

    Calls ``sps`` once on the whole array when it accepts arrays (SPSTable and
    any numpy-style function do); falls back to one call per entry for scalar
    Python callables (e.g. ones using ``if`` or dict lookups).
    """
    if isinstance(sps, SPSTable):
        return sps(batch_tokens)
    try:
        out = np.asarray(sps(batch_tokens), dtype=np.float64)
        if out.shape == batch_tokens.shape:
            return out
    except Exception:
        pass
    return np.fromiter((float(sps(int(b))) for b in batch_tokens), np.float64, len(batch_tokens))


# ----------------------------------------------------------------------------
# Shared pieces: a_{r,j} and the admission order
# ----------------------------------------------------------------------------


def _as_confidences(confidences: Any, name: str = "confidences") -> np.ndarray:
    """[R, γ] float64 numpy array in [0, 1] from numpy / torch / lists."""
    if hasattr(confidences, "detach"):  # torch tensor, without importing torch here
        confidences = confidences.detach().cpu().double().numpy()
    c = np.asarray(confidences, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"{name} must have shape [R, gamma], got shape {c.shape}")
    if c.size and not (np.isfinite(c).all() and c.min() >= 0.0 and c.max() <= 1.0):
        bad = c[~(np.isfinite(c) & (c >= 0.0) & (c <= 1.0))][0]
        raise ValueError(
            f"{name} must be per-position probabilities in [0, 1], found {bad}; "
            "pass conditional confidences c (not logits, not cumulative products)"
        )
    return c


def prefix_survival(confidences: Any) -> np.ndarray:
    """a_{r,j} = Π_{i≤j} c_{r,i}, shape [R, γ] (Algorithm 1, line 2)."""
    return np.cumprod(_as_confidences(confidences), axis=1)


def admission_order(a: np.ndarray) -> np.ndarray:
    """Flat indices (into a.ravel(), row-major [R, γ]) of the candidates a > 0,
    sorted by a descending, ties by smaller j, then by smaller r (Algorithm 1,
    line 4)."""
    R, gamma = a.shape
    # Flatten position-major (index = j*R + r): a stable sort on -a then breaks
    # ties by j first and r second, with no lexsort over three keys.
    a_jr = a.T.ravel()  # [γ*R]
    cand = np.flatnonzero(a_jr > 0.0)
    order = cand[np.argsort(-a_jr[cand], kind="stable")]
    j, r = np.divmod(order, R)
    return r * gamma + j


def _lengths_from_admitted(flat_idx: np.ndarray, R: int, gamma: int) -> np.ndarray:
    # Admitted sets are prefix-closed per row, so the count per row is the
    # largest admitted j.
    return np.bincount(flat_idx // gamma, minlength=R).astype(np.int64)


# ----------------------------------------------------------------------------
# Algorithm 1 (paper Section 3.2.2)
# ----------------------------------------------------------------------------


def _throughput_path(a: np.ndarray, sps: SPSLike) -> tuple[np.ndarray, np.ndarray]:
    """Admission order and Θ along it: theta[k] is the throughput with the first
    k candidates admitted (theta[0] = R·SPS(R)), shape [n+1]."""
    R = a.shape[0]
    order = admission_order(a)
    n = order.shape[0]
    tau = np.empty(n + 1, dtype=np.float64)  # τ* after k admissions
    tau[0] = R
    np.cumsum(a.ravel()[order], out=tau[1:])
    tau[1:] += R
    batch = R + np.arange(n + 1, dtype=np.int64)  # B after k admissions
    theta = tau * _eval_sps(sps, batch)
    return order, theta


def schedule_prefix(confidences: Any, sps: SPSLike, early_stop: bool = True) -> np.ndarray:
    """Algorithm 1: per-request verification lengths ℓ*, int64 [R].

    Walks the candidates (r, j) with a_{r,j} > 0 in admission order, keeping
    B = R + #admitted and τ* = R + Σ admitted a_{r,j}, and scores
    Θ = τ*·SPS(B) (expected tokens per second).

    ``early_stop=True``: the paper's Algorithm 1. Stops at the first admission
    with Θ ≤ Θ_best and returns the lengths before it. Lossless: whether
    (r, k) is admitted depends only on candidates ranked before it, and those
    never include a_{r,k+1}, the only quantity that sees the draft token
    x_{r,k}. With a unimodal Θ along the path this is also the global optimum.

    ``early_stop=False``: the unconstrained global search (Section 5.2),
    returning the lengths at the first argmax of Θ over all prefixes of the
    admission path. Looking past a non-improving step lets a_{r,k+1}, hence
    x_{r,k}, decide whether x_{r,k} is verified: NOT lossless on the current
    draft's confidences (Appendix A). Use it on stale confidences only, as in
    ``capacity_from_stale``.

    ``sps`` is an ``SPSTable`` or any callable B -> steps/s; it is evaluated
    once on the int array of all B along the path when it accepts arrays.
    """
    a = prefix_survival(confidences)
    R, gamma = a.shape
    order, theta = _throughput_path(a, sps)
    if early_stop:
        # Every step before the first non-improving one improved, so Θ_best at
        # step k is just Θ_{k-1}.
        worse = np.flatnonzero(theta[1:] <= theta[:-1])
        n_admit = int(worse[0]) if worse.size else order.shape[0]
    else:
        n_admit = int(np.argmax(theta))  # first maximum: ties keep the shorter prefix
    return _lengths_from_admitted(order[:n_admit], R, gamma)


# ----------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------


def static_lengths(num_requests: int, ell: int) -> np.ndarray:
    """Every request verifies ``ell`` draft tokens: int64 [R] filled with ell."""
    num_requests = _int_value(num_requests, "num_requests")
    ell = _int_value(ell, "ell")
    if num_requests < 0 or ell < 0:
        raise ValueError(f"num_requests and ell must be >= 0, got {num_requests}, {ell}")
    return np.full(num_requests, ell, dtype=np.int64)


def threshold_lengths(confidences: Any, threshold: float) -> np.ndarray:
    """Per-request static threshold on the prefix survival probability:
    ℓ_r = #{j : a_{r,j} ≥ threshold}, int64 [R].

    Thresholding the cumulative a (not each c) makes ℓ_r the longest prefix
    whose estimated probability of being fully accepted is at least
    ``threshold``; since a is non-increasing in j this is a prefix.
    """
    threshold = float(threshold)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    a = prefix_survival(confidences)
    return (a >= threshold).sum(axis=1).astype(np.int64)


def first_below_lengths(confidences: Any, threshold: float) -> np.ndarray:
    """DeepSpec's confidence threshold (its evaluator's ``--confidence-threshold``):
    ℓ_r = (the first j with c_{r,j} < threshold) − 1, or γ when no c_{r,j} is below it;
    int64 [R]. A threshold of 0 verifies every draft.

    Unlike ``threshold_lengths`` this looks at each conditional c_{r,j} on its own,
    not at the cumulative a_{r,j}: (0.9, 0.9, 0.9) passes a threshold of 0.8 at every
    position here, while a_3 = 0.729 stops the cumulative rule at ℓ = 2.
    """
    threshold = float(threshold)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    c = _as_confidences(confidences)
    below = c < threshold  # [R, γ]
    return np.where(below.any(axis=1), below.argmax(axis=1), c.shape[1]).astype(np.int64)
