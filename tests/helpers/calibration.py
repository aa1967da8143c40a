"""Synthetic round logs with known calibration, shared by the calibration and plot tests."""

from __future__ import annotations

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def synthetic_rounds(n, scale, rng, mu=(2.0, 1.2, 0.8)):
    """Rounds with true conditional acceptance p_{n,k} = σ(z), z ~ N(μ_k, 1),
    reported confidences σ(z·scale) (scale > 1 overconfident, < 1 under),
    and accepted lengths sampled from the true chain. Returns conf [n, γ],
    accepted [n], proposed [n] (= γ)."""
    gamma = len(mu)
    z = rng.normal(mu, 1.0, (n, gamma))
    accept = rng.random((n, gamma)) < sigmoid(z)
    accepted = np.argmin(np.c_[accept, np.zeros(n, bool)], axis=1)  # first rejection
    return sigmoid(z * scale), accepted, np.full(n, gamma)
