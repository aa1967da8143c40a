"""llama.cpp's speculative settings chosen from a drafter's confidences and the engine's own costs.

- :func:`first_below`: llama.cpp's draft-dspark rule, ℓ = the leading positions (≤ n-max) whose
  confidence is ≥ p-min.
- :class:`EngineCosts` / :func:`measure_costs`: target-alone decode steps per round, measured through
  llama-server: ``idle[n]`` (p = 1, nothing verified) and ``forced[n]`` (p = 0, n verified); a round
  drafting n and verifying ℓ costs ``idle[n] + forced[ℓ] − idle[ℓ]``.
- :func:`predict`: S(n, p) = Σ_r (min(a_r, ℓ_r) + 1) / Σ_r cost(n, ℓ_r) over greedy rounds logged at
  block γ (:func:`load_rounds`), with a 95 % interval (requests, and the cost table's errors).
- :func:`choose` / :func:`recommend`: the best (n, p); one shared STS temperature is folded into the
  exported head (:func:`fold_threshold` gives p on its scale), per-position ones cannot be
  (:func:`per_position_gain` says what they would add).

docs/interop.md ("Choosing --spec-draft-n-max and --spec-draft-p-min") has the method.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark.bootstrap import jackknife_ci

__all__ = [
    "Cost",
    "EngineCosts",
    "LoggedRounds",
    "Prediction",
    "Recommendation",
    "Setting",
    "choose",
    "first_below",
    "fold_threshold",
    "load_rounds",
    "measure_costs",
    "per_position_gain",
    "predict",
    "recommend",
    "setting_grid",
]

Z95 = 1.959963984540054
IDLE_P = 1.0  # p_min that no confidence reaches: the drafter runs, nothing is verified
DEFAULT_P_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass(frozen=True)
class Setting:
    """One llama-server setting: ``--spec-draft-n-max n_max --spec-draft-p-min p_min``."""

    n_max: int
    p_min: float = 0.0

    def flags(self) -> list[str]:
        return ["--spec-draft-n-max", str(int(self.n_max)), "--spec-draft-p-min", f"{float(self.p_min):g}"]

    def label(self) -> str:
        return f"n-max {self.n_max}, p-min {self.p_min:g}"


def first_below(confidences: Sequence[float], n_max: int, p_min: float, n_min: int = 0) -> int:
    """Drafts llama.cpp keeps from one block: the leading positions (at most ``n_max``) whose
    confidence is ≥ ``p_min``; 0 when that is fewer than ``n_min`` (common/speculative.cpp,
    draft-dspark: ``if (conf < p_min) break`` then ``if (size < n_min) clear``)."""
    ell = 0
    for c in list(confidences)[: int(n_max)]:
        if p_min > 0.0 and float(c) < p_min:
            break
        ell += 1
    return 0 if ell < int(n_min) else ell


def fold_threshold(p_raw: float, temperature: float) -> float:
    """The p-min on a head with temperature T folded in (σ(z/T)) that cuts where ``p_raw`` cuts the
    raw head: σ(logit(p_raw)/T). 0 and 1 stay."""
    if p_raw <= 0.0 or p_raw >= 1.0:
        return float(p_raw)
    return float(1.0 / (1.0 + math.exp(-math.log(p_raw / (1.0 - p_raw)) / float(temperature))))


# ---------------------------------------------------------------------------------------------
# The cost table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One entry in target-alone decode steps: estimate, 95 % interval, standard error."""

    estimate: float
    lo: float
    hi: float
    se: float


@dataclass
class EngineCosts:
    """A drafter's round costs in llama-server, in target-alone decode steps (module docstring).

    idle / forced: n -> :class:`Cost`; ``idle`` is empty for a drafter without a confidence head
    (it cannot skip verification), which then runs at p = 0 only. ``target_tokens_per_s``: the
    target alone; the rest says how it was measured."""

    idle: dict[int, Cost]
    forced: dict[int, Cost]
    target_tokens_per_s: float
    machine: str = ""
    threads: int = 0
    requests: int = 0
    sweeps: int = 0
    max_new_tokens: int = 0
    raw: dict[str, Any] = field(default_factory=dict)

    def round_cost(self, n: int, ell: int) -> float:
        """Steps of a round that drafts a block of n and verifies ℓ of it."""
        if ell == n and n in self.forced:
            return self.forced[n].estimate
        if n not in self.idle:
            raise ValueError(f"the cost table has no idle[{n}] (a drafter without a confidence head verifies "
                             f"all n: only p-min 0 is predictable)")
        if ell == 0:
            return self.idle[n].estimate
        return self.idle[n].estimate + self.forced[ell].estimate - self.idle[ell].estimate

    def gradient(self, n: int, ell: int) -> dict[tuple[str, int], float]:
        """∂ round_cost(n, ℓ) / ∂ entry, for propagating the entries' standard errors."""
        if ell == n and n in self.forced:
            return {("forced", n): 1.0}
        if ell == 0:
            return {("idle", n): 1.0}
        return {("idle", n): 1.0, ("forced", ell): 1.0, ("idle", ell): -1.0}

    def entry(self, key: tuple[str, int]) -> Cost:
        return (self.idle if key[0] == "idle" else self.forced)[key[1]]

    def to_json(self) -> dict[str, Any]:
        return {"units": "target-alone decode steps per round",
                "idle": {str(k): asdict(v) for k, v in sorted(self.idle.items())},
                "forced": {str(k): asdict(v) for k, v in sorted(self.forced.items())},
                "target_tokens_per_s": self.target_tokens_per_s, "machine": self.machine, "threads": self.threads,
                "requests": self.requests, "sweeps": self.sweeps, "max_new_tokens": self.max_new_tokens,
                "raw": self.raw}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | os.PathLike) -> EngineCosts:
        if not isinstance(data, Mapping):
            path = Path(data)
            if not path.is_file():
                raise FileNotFoundError(f"cost table {path} not found (bench/llamacpp.py --costs measures one)")
            data = json.loads(path.read_text())
        try:
            def entries(name: str) -> dict[int, Cost]:
                return {int(k): Cost(**v) for k, v in dict(data.get(name) or {}).items()}

            costs = cls(idle=entries("idle"), forced=entries("forced"),
                        target_tokens_per_s=float(data["target_tokens_per_s"]), machine=str(data.get("machine", "")),
                        threads=int(data.get("threads", 0)), requests=int(data.get("requests", 0)),
                        sweeps=int(data.get("sweeps", 0)), max_new_tokens=int(data.get("max_new_tokens", 0)),
                        raw=dict(data.get("raw") or {}))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a llama.cpp cost table ({error}): expected idle / forced entries "
                             "{n: {estimate, lo, hi, se}} and target_tokens_per_s") from error
        if not costs.forced:
            raise ValueError("the cost table has no forced[n] entries")
        return costs


# ---------------------------------------------------------------------------------------------
# Logged rounds and the predictor
# ---------------------------------------------------------------------------------------------


@dataclass
class LoggedRounds:
    """Rounds of one drafter at block γ, per benchmark and request: confidences [R, γ] (NaN where
    the drafter has no confidence head) and accepted drafts [R]."""

    requests: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    gamma: int

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.requests.values())


def load_rounds(source: str | os.PathLike) -> LoggedRounds:
    """Rounds of a ``dspark eval`` folder (or its rounds.jsonl) decoded at block γ (no policy)."""
    path = Path(source)
    if path.is_dir():
        path = path / "rounds.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give a `dspark eval` folder or its rounds.jsonl")
    by_request: dict[tuple[str, int], list[tuple[list[float] | None, int]]] = {}
    short, rows = 0, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no rounds")
    gamma = max(int(row["proposed"]) for row in rows)
    for row in rows:
        short += int(row["proposed"]) < gamma and not row.get("eos_accepted")
        by_request.setdefault((str(row["benchmark"]), int(row["request"])), []).append(
            (row.get("confidences"), int(row["accepted"])))
    if short:
        raise ValueError(f"{path}: {short} rounds verified fewer than γ = {gamma} drafts (a verification policy "
                         "chose ℓ), so their acceptance is cut: give an evaluation without --policy")
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (bench, _), rounds in sorted(by_request.items()):
        conf = np.full((len(rounds), gamma), np.nan)
        for i, (c, _) in enumerate(rounds):
            if c is not None:
                conf[i, : len(c)] = c
        acc = np.asarray([a for _, a in rounds], dtype=np.int64)
        out.setdefault(bench, []).append((conf, acc))
    return LoggedRounds(out, gamma)


@dataclass
class Prediction:
    """Predicted llama.cpp speed over target alone at one setting, with its 95 % interval, and the
    rounds' mean drafts kept (ℓ) and τ (tokens per round)."""

    setting: Setting
    speed: float
    lo: float
    hi: float
    mean_drafts: float
    tau: float
    rounds: int
    requests: int

    def to_json(self) -> dict[str, Any]:
        return {"n_max": self.setting.n_max, "p_min": self.setting.p_min, "speed": self.speed, "lo": self.lo,
                "hi": self.hi, "mean_drafts": self.mean_drafts, "tau": self.tau, "rounds": self.rounds,
                "requests": self.requests}


def _request_rows(conf: np.ndarray, acc: np.ndarray, setting: Setting, rule: Callable[[np.ndarray], int]
                  ) -> np.ndarray:
    """[tokens, rounds verifying ℓ = 0..n] of one request."""
    row = np.zeros(setting.n_max + 2)
    for c, a in zip(conf, acc):
        ell = rule(c)
        row[0] += min(int(a), ell) + 1
        row[1 + ell] += 1
    return row


def predict(rounds: LoggedRounds, costs: EngineCosts, setting: Setting, *,
            thresholds: Sequence[float] | None = None) -> Prediction:
    """S(n, p) of the module docstring over ``rounds`` with ``costs``. ``thresholds``: one p per
    position instead of ``setting.p_min`` (what llama.cpp cannot do; :func:`per_position_gain`)."""
    n = int(setting.n_max)
    if not 1 <= n <= rounds.gamma:
        raise ValueError(f"n_max {n} must be in 1..γ = 1..{rounds.gamma} (the logged rounds' block)")
    if setting.p_min > 0.0 or thresholds is not None:
        if any(np.isnan(c).any() for reqs in rounds.requests.values() for c, _ in reqs):
            raise ValueError("p-min > 0 needs the rounds' confidences: this drafter logged none "
                             "(no confidence head); predict p-min 0 only")
    if thresholds is not None:
        limits = [float(t) for t in thresholds]

        def rule(c: np.ndarray) -> int:
            ell = 0
            while ell < n and c[ell] >= limits[ell]:
                ell += 1
            return ell
    else:
        def rule(c: np.ndarray) -> int:
            return first_below(c, n, setting.p_min)

    groups = [np.stack([_request_rows(c, a, setting, rule) for c, a in reqs]) for reqs in rounds.requests.values()]
    used = np.sum([g.sum(axis=0) for g in groups], axis=0)[1:] > 0  # only lengths that occur need a cost
    costs_of = np.array([costs.round_cost(n, ell) if used[ell] else 0.0 for ell in range(n + 1)])

    def statistic(sums: np.ndarray) -> np.ndarray:
        tokens = sums[..., 0].sum(axis=-1)
        cost = (sums[..., 1:] * costs_of).sum(axis=(-1, -2))
        return tokens / cost

    est, lo, hi = jackknife_ci(groups, statistic, scale="log")
    total = np.sum([g.sum(axis=0) for g in groups], axis=0)
    cost_sum = float((total[1:] * costs_of).sum())
    variance = 0.0  # log-scale variance from the cost table's entries
    grads: dict[tuple[str, int], float] = {}
    for ell in np.flatnonzero(used):
        for key, g in costs.gradient(n, int(ell)).items():
            grads[key] = grads.get(key, 0.0) + g * total[1 + ell]
    for key, g in grads.items():
        variance += (g / cost_sum * costs.entry(key).se) ** 2
    half_rounds = (math.log(hi) - math.log(lo)) / 2 if np.isfinite(lo) and lo > 0 else math.nan
    half = math.sqrt(half_rounds ** 2 + (Z95 ** 2) * variance)
    est = float(est)
    n_rounds = int(total[1:].sum())
    return Prediction(setting, est, est * math.exp(-half), est * math.exp(half),
                      float((total[1:] * np.arange(n + 1)).sum() / n_rounds), float(total[0] / n_rounds), n_rounds,
                      sum(g.shape[0] for g in groups))


def setting_grid(gamma: int, *, confidence: bool, p_values: Iterable[float] = DEFAULT_P_GRID,
                 n_values: Iterable[int] | None = None) -> list[Setting]:
    """(n, p) for n in 1..γ and p in ``p_values`` (p = 0 only without a confidence head)."""
    ns = list(n_values) if n_values is not None else list(range(1, gamma + 1))
    ps = sorted({float(p) for p in p_values} | {0.0}) if confidence else [0.0]
    return [Setting(n, p) for n in ns for p in ps]


def choose(rounds: LoggedRounds, costs: EngineCosts, grid: Sequence[Setting]) -> tuple[Prediction, list[Prediction]]:
    """The setting of ``grid`` with the highest predicted speed, and every prediction (grid order)."""
    if not grid:
        raise ValueError("the setting grid is empty")
    predictions = [predict(rounds, costs, s) for s in grid]
    return max(predictions, key=lambda p: p.speed), predictions


def per_position_gain(rounds: LoggedRounds, costs: EngineCosts, best: Prediction, temperatures: Sequence[float]
                      ) -> Prediction:
    """The speed with one calibrated threshold per position (σ(logit(c_k)/T_k) ≥ p, i.e. raw
    c_k ≥ σ(T_k·logit(p))) at the best p of a small grid: what per-position STS temperatures would add
    over one p-min, which llama.cpp cannot apply."""
    temps = [float(t) for t in temperatures]
    out = best
    for p in np.linspace(0.05, 0.95, 19):
        limits = [fold_threshold(float(p), 1.0 / t) for t in temps[: best.setting.n_max]]
        candidate = predict(rounds, costs, Setting(best.setting.n_max, float(p)), thresholds=limits)
        if candidate.speed > out.speed:
            out = candidate
    return out


# ---------------------------------------------------------------------------------------------
# Measuring the costs through llama-server
# ---------------------------------------------------------------------------------------------


def _cost_entries(per_request: Mapping[str, np.ndarray], target: np.ndarray) -> tuple[dict, dict]:
    """Entries from per-request sums: per_request[key] [N, 2] = (ms, rounds or steps), target [N, 2] =
    (ms, tokens); entry = (Σ ms / Σ rounds) / (Σ target ms / Σ target tokens), jackknife over requests."""
    idle: dict[int, Cost] = {}
    forced: dict[int, Cost] = {}
    for key, rows in per_request.items():
        kind, n = key.split(":")
        data = np.concatenate([rows, target], axis=1)  # [N, 4]

        def statistic(s: np.ndarray) -> np.ndarray:
            s = s.sum(axis=-2)
            return (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])

        est, lo, hi = jackknife_ci([data], statistic, scale="log")
        se = (math.log(hi) - math.log(lo)) / (2 * Z95) * float(est) if np.isfinite(lo) and lo > 0 else math.nan
        (idle if kind == "idle" else forced)[int(n)] = Cost(float(est), float(lo), float(hi), float(se))
    return idle, forced


def machine_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else ``platform.processor()``."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return name or platform.processor() or "unknown CPU"


def measure_costs(target_gguf: str | os.PathLike, draft_gguf: str | os.PathLike, *, spec_type: str, gamma: int,
                  prompts: Sequence[Sequence[int]], max_new_tokens: int, confidence: bool, sweeps: int = 2,
                  threads: int = 2, server: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None,
                  seed: int = 0, machine: str = "", progress: bool = True) -> EngineCosts:
    """The cost table of one drafter, measured through llama-server (module docstring).

    Each sweep serves the target alone, ``forced[n]`` (p = 0) and, with a confidence head,
    ``idle[n]`` (p = 1) for n = 1..γ, in an order shuffled per sweep, each setting on its own
    server decoding every prompt greedily (``max_new_tokens`` each, one warm-up request first).
    Per-request times are summed over sweeps; an entry is the ratio of pooled per-round time to
    the pooled target step time, with a jackknife interval over requests."""
    from tqdm.auto import tqdm

    from dspark.interop.llamacpp import llama_server

    keys = ["target"] + [f"forced:{n}" for n in range(1, gamma + 1)]
    if confidence:
        keys += [f"idle:{n}" for n in range(1, gamma + 1)]
    rng = random.Random(seed)
    sums = {key: np.zeros((len(prompts), 2)) for key in keys}
    log_dir = Path(log_dir) if log_dir is not None else None
    bar = tqdm(total=sweeps * len(keys), desc="llama.cpp costs", unit="setting", disable=not progress)
    for sweep in range(sweeps):
        order = list(keys)
        rng.shuffle(order)
        for key in order:
            kwargs: dict[str, Any] = {}
            if key != "target":
                kind, n = key.split(":")
                kwargs = {"draft_gguf": draft_gguf, "spec_type": spec_type, "draft_n_max": int(n),
                          "extra_args": ["--spec-draft-p-min", str(IDLE_P if kind == "idle" else 0.0)]}
            log_path = None if log_dir is None else log_dir / f"costs-{key.replace(':', '')}.log"
            with llama_server(target_gguf, threads=threads, server=server, log_path=log_path, **kwargs) as srv:
                srv.client.complete(prompts[0], temperature=0.0, n_predict=8, seed=seed)  # warm-up
                for i, ids in enumerate(prompts):
                    done = srv.client.complete(ids, temperature=0.0, n_predict=max_new_tokens, seed=seed)
                    count = done.rounds if key.startswith("forced") else done.predicted_n
                    sums[key][i] += (done.predicted_ms, float(count or 0))
            bar.update(1)
    bar.close()
    target = sums.pop("target")
    if (target[:, 1] <= 0).any() or any((v[:, 1] <= 0).any() for v in sums.values()):
        raise RuntimeError("a request produced no rounds (forced) or tokens: raise max_new_tokens")
    idle, forced = _cost_entries(sums, target)
    return EngineCosts(idle, forced, float(target[:, 1].sum() / target[:, 0].sum() * 1000.0),
                       machine=machine or machine_name(), threads=threads, requests=len(prompts), sweeps=sweeps,
                       max_new_tokens=max_new_tokens, raw={k: v.tolist() for k, v in {"target": target, **sums}.items()})



# ---------------------------------------------------------------------------------------------
# The recommendation SERVE.md carries
# ---------------------------------------------------------------------------------------------


@dataclass
class Recommendation:
    """The chosen setting for one drafter, on the exported head's scale (``p_min`` after folding
    ``temperature``), with the predictions it was chosen from."""

    chosen: Prediction
    static: Prediction
    predictions: list[Prediction]
    temperature: float
    p_min: float
    per_position: Prediction | None
    costs: EngineCosts

    def flags(self) -> str:
        return f"--spec-draft-n-max {self.chosen.setting.n_max} --spec-draft-p-min {self.p_min:.4g}"

    def markdown(self) -> str:
        c, s = self.chosen, self.static
        lines = [
            "## The recommended setting",
            "",
            f"`{self.flags()}`: predicted speed over the target alone {c.speed:.2f} [{c.lo:.2f}, {c.hi:.2f}] "
            f"(τ {c.tau:.2f}, {c.mean_drafts:.2f} drafts verified per round), against {s.speed:.2f} "
            f"[{s.lo:.2f}, {s.hi:.2f}] at the static n-max {s.setting.n_max}, p-min 0.",
            "",
            f"From {c.rounds} logged rounds of {c.requests} requests (greedy, block γ = {s.setting.n_max}) and "
            f"this engine's cost table ({self.costs.machine or 'machine not named'}, {self.costs.threads} threads, "
            f"{self.costs.requests} requests × {self.costs.sweeps} sweeps; the target alone "
            f"{self.costs.target_tokens_per_s:.0f} tokens/s). 95 % intervals: requests (jackknife) and the "
            "cost table's errors.",
        ]
        if c.speed < 1.0:
            lines += ["", "Every setting is predicted slower than the target alone on this machine: serve the "
                      "target without the drafter here, or measure again where the target step is dearer."]
        if self.temperature != 1.0:
            lines += ["", f"The STS temperature T = {self.temperature:.4g} is folded into the exported confidence "
                      f"head (σ(z/T)); p-min {self.p_min:.4g} on it is p-min {c.setting.p_min:g} on the raw head."]
        if self.per_position is not None:
            lines += ["", f"STS fitted different temperatures per position; llama.cpp applies one p-min to every "
                      f"position, so none is folded. Per-position thresholds would predict "
                      f"{self.per_position.speed:.2f} [{self.per_position.lo:.2f}, {self.per_position.hi:.2f}] "
                      f"against {c.speed:.2f} with one p-min."]
        best_by_n: dict[int, Prediction] = {}
        for p in self.predictions:
            if p.setting.n_max not in best_by_n or p.speed > best_by_n[p.setting.n_max].speed:
                best_by_n[p.setting.n_max] = p
        lines += ["", "| n-max | best p-min (raw) | predicted speed | τ | drafts verified / round |", "|---|---|---|---|---|"]
        for n, p in sorted(best_by_n.items()):
            lines.append(f"| {n} | {p.setting.p_min:g} | {p.speed:.2f} [{p.lo:.2f}, {p.hi:.2f}] | {p.tau:.2f} | "
                         f"{p.mean_drafts:.2f} |")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_json(), "static": self.static.to_json(), "temperature": self.temperature,
                "p_min": self.p_min, "flags": self.flags(),
                "per_position": None if self.per_position is None else self.per_position.to_json(),
                "predictions": [p.to_json() for p in self.predictions]}


def recommend(rounds: LoggedRounds, costs: EngineCosts, *, confidence: bool,
              temperatures: Sequence[float] | None = None, p_values: Iterable[float] = DEFAULT_P_GRID) -> Recommendation:
    """Choose (n, p) over the grid of :func:`setting_grid`; fold one shared STS temperature into the
    threshold's scale, or report what per-position temperatures would add (module docstring)."""
    grid = setting_grid(rounds.gamma, confidence=confidence, p_values=p_values)
    chosen, predictions = choose(rounds, costs, grid)
    static = next(p for p in predictions if p.setting == Setting(rounds.gamma, 0.0))
    temperature, per_position = 1.0, None
    if temperatures is not None and confidence:
        temps = np.asarray(temperatures, dtype=np.float64)
        if np.allclose(temps, temps[0], rtol=1e-6, atol=0.0):
            temperature = float(temps[0])
        else:
            per_position = per_position_gain(rounds, costs, chosen, temps)
    return Recommendation(chosen, static, predictions, temperature, fold_threshold(chosen.setting.p_min, temperature),
                          per_position, costs)
