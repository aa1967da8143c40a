"""Derived seeds: one rule that gives every request, epoch and block its own random stream.

A run has one seed; each unit of work that draws random numbers (an evaluation request, a
simulated request, an epoch's sample order, a sequence's training anchors) seeds its own
``torch.Generator`` from that seed and the unit's coordinates. The result then depends on
the unit alone, not on which process handles it or what ran before it, which is what makes
distributed runs rank-invariant and resumed runs identical to uninterrupted ones.
"""

from __future__ import annotations

import zlib

_MAJOR = 1_000_003  # primes that keep (seed, key, index) triples apart for realistic ranges
_MINOR = 7_919


def derive_seed(seed: int, key: int = 0, index: int = 0) -> int:
    """``(seed · 1000003 + key · 7919 + index) mod 2^63``: the seed of unit ``(key, index)``.

    ``key`` names a stream (a benchmark's CRC-32, an epoch), ``index`` a unit in it (a
    request, a sample). Nest it for a third coordinate."""
    return (int(seed) * _MAJOR + int(key) * _MINOR + int(index)) % (2**63)


def request_seed(seed: int, benchmark: str, request: int, cycle: int = 0) -> int:
    """The generator seed of request ``request`` (its index in ``benchmark``'s prompt list) of a
    run seeded with ``seed``, in pass ``cycle`` over the prompt list (0: the prompt's first use).

    Cycle 0, the prompt's first use: ``s_0 = derive_seed(seed, crc32(benchmark), request)``, what
    ``dspark eval`` decodes the request with. Cycle c >= 1 (the c-th reuse of the prompt when the
    serving simulator cycles its prompt list): ``derive_seed(s_0, 0, c) = (s_0 · 1000003 + c) mod
    2^63``, a stream of its own. Both clocks, ``dspark eval --policy`` and ``dspark simulate``, seed
    a request with it, so at R = 1 they decode the same tokens for the same prompt."""
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 0:
        raise ValueError(f"request_seed: cycle must be an int >= 0 (0: the prompt's first use), got {cycle!r}")
    first = derive_seed(seed, zlib.crc32(benchmark.encode("utf-8")), request)
    return first if cycle == 0 else derive_seed(first, 0, cycle)
