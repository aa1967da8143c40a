"""Derived seeds: one rule that gives every request, epoch and block its own random stream.

A run has one seed; each unit of work that draws random numbers (an evaluation request, a
simulated request, an epoch's sample order, a sequence's training anchors) seeds its own
``torch.Generator`` from that seed and the unit's coordinates. The result then depends on
the unit alone, not on which process handles it or what ran before it, which is what makes
distributed runs rank-invariant and resumed runs identical to uninterrupted ones.
"""

from __future__ import annotations

_MAJOR = 1_000_003  # primes that keep (seed, key, index) triples apart for realistic ranges
_MINOR = 7_919


def derive_seed(seed: int, key: int = 0, index: int = 0) -> int:
    """``(seed · 1000003 + key · 7919 + index) mod 2^63``: the seed of unit ``(key, index)``.

    ``key`` names a stream (a benchmark's CRC-32, an epoch), ``index`` a unit in it (a
    request, a sample). Nest it for a third coordinate."""
    return (int(seed) * _MAJOR + int(key) * _MINOR + int(index)) % (2**63)
