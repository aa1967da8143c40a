"""The settings of a serving run, shared by ``dspark.scheduling.simulator`` and ``dspark.evaluation.evaluate``.

``DecodeSettings``: how every request is decoded (max_new_tokens, temperature, seed, EOS ids).
``ServeSettings``: how verification lengths are chosen and steps are charged (policy, SPS table,
concurrency R, STS temperatures, draft overhead, engine; paper Section 3.2).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from dspark.data.prompts import DEEPSPEC_EVAL_SEED
from dspark.scheduling.algorithm1 import SPSTable
from dspark.scheduling.calibration import as_temperatures
from dspark.scheduling.policies import POLICY_HELP, PolicySpec
from dspark.scheduling.sps_clock import draft_clock

__all__ = ["DecodeSettings", "ENGINES", "ServeSettings"]

ENGINES = ("per-request", "batched")  # ServeSettings.engine
PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class DecodeSettings:
    """How every request is decoded. The defaults are ``dspark eval``'s protocol: T = 1, at
    most 2048 new tokens, and DeepSpec's evaluation seed (so both tools draw the same prompts).

    max_new_tokens: the most tokens generated per request (the last round is truncated).
    temperature: T > 0 samples from softmax(logits / T), verified by rejection sampling
        (lossless); T = 0 is greedy.
    seed: the run's seed. Each request's generator seed is derived from it
        (``dspark.seeds.request_seed``), and so is an evaluation's prompt subset;
        ``run_requests`` does not read it (every ``Job`` carries its own seed).
    eos_token_ids: the ids that end a request; None: ``evaluate`` takes the chat template's
        end-of-turn and the model's EOS ids, the simulator none.
    """

    max_new_tokens: int = 2048
    temperature: float = 1.0
    seed: int = DEEPSPEC_EVAL_SEED
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"DecodeSettings.max_new_tokens must be an int >= 1, got {n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"DecodeSettings.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"DecodeSettings.seed must be an int, got {self.seed!r}")
        if self.eos_token_ids is not None:
            ids = self.eos_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"DecodeSettings.eos_token_ids must be a list of token ids or None, got {ids!r}")
            ids = tuple(ids)
            if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0 for i in ids):
                raise ValueError(f"DecodeSettings.eos_token_ids must hold token ids (ints >= 0), got {list(ids)!r}")
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in ids))


@dataclass(frozen=True)
class ServeSettings:
    """How verification lengths are chosen and how steps are charged (paper Section 3.2).

    policy: the verification-length policy: a ``make_policy`` spec (``POLICY_HELP``), a
        ``Policy`` or a callable ``(request_ids, confidences [R, γ]) -> lengths [R]``.
        None (``evaluate`` only): every round verifies all γ drafts, one request at a
        time, the protocol of the paper's Table 1.
    sps: the SPS table (or the path of its JSON, ``dspark profile-sps``): for the policies
        that need one (algorithm1, algorithm1+skip, async) and for the simulated clock.
    price_sps: the table the simulated clock charges, when it is not ``sps`` (None: ``sps``).
        The policies decide on the noise-aware table (``SPSTable.noise_aware``: rises of
        SPS in B within the timing noise flattened, so Algorithm 1 buys nothing with
        jitter); the clock prices on the measured medians (``SPSProfile.measured_table``),
        because a flattened entry charges more than the machine was measured to pay where
        a rise is real, and the clock's interval already carries the timing noise.
    concurrency: R, the requests decoded in lockstep (more than 1 needs a policy).
    sts_temperatures: the γ STS temperatures (or the path of an STS JSON, ``dspark
        calibrate``): the policy sees calibrated confidences, and ``evaluate`` also
        reports the calibrated confidence quality. None: raw confidences.
    draft_overhead: drafting on the SPS clock: a fraction f >= 0 of the verification
        step, or "measured": every measured per-round phase but the verification forward
        (draft, accept, bookkeeping, schedule; ``dspark.scheduling.sps_clock``).
    engine: "per-request" (each live request drafts and verifies on its own, batch 1; the SPS
        clock prices a step at B = Σ (1 + ℓ_r)) or "batched" (``dspark.scheduling.batched_serving``:
        one drafter and one target forward for every live request, timed on the wall clock too;
        the SPS clock prices the padded forward).
    """

    policy: PolicySpec | None = None
    sps: SPSTable | PathLike | None = None
    price_sps: SPSTable | PathLike | None = None
    concurrency: int = 1
    sts_temperatures: Sequence[float] | PathLike | None = None
    draft_overhead: float | str = 0.0
    engine: str = "per-request"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"ServeSettings.engine={self.engine!r} must be one of {ENGINES}: 'batched' verifies "
                             "every live request in one target forward, 'per-request' one forward each")
        p = self.policy
        if p is not None and not callable(p) and not (isinstance(p, str) and p.strip()):
            raise ValueError(f"ServeSettings.policy must be None, a non-empty spec ({POLICY_HELP}), a Policy "
                             f"or a callable, got {p!r}")
        for name in ("sps", "price_sps"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (SPSTable, str, os.PathLike)):
                raise ValueError(f"ServeSettings.{name} must be an SPSTable or the path of its JSON "
                                 f"(dspark profile-sps), got {type(value).__name__}")
        if self.price_sps is not None and self.sps is None:
            raise ValueError("ServeSettings.price_sps needs sps: the clock's table replaces the policy's "
                             "table for pricing only")
        r = self.concurrency
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"ServeSettings.concurrency must be an int >= 1, got {r!r}")
        if r > 1 and p is None:
            raise ValueError(f"ServeSettings.concurrency={r} needs a policy: requests decode in lockstep only "
                             "in the serving loop (policy='static' verifies all γ drafts there)")
        draft_clock(self.draft_overhead)
        temps = self.sts_temperatures
        if temps is not None and not isinstance(temps, (str, os.PathLike)):
            checked = as_temperatures(temps, None, "ServeSettings.sts_temperatures")
            object.__setattr__(self, "sts_temperatures", tuple(float(t) for t in checked))
