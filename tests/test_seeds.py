"""dspark.seeds: the one seed-mixing rule and the request seed built on it, by hand."""

from __future__ import annotations

import zlib

import pytest

from dspark.seeds import derive_seed, request_seed


def test_derive_seed_by_hand():
    assert derive_seed(0) == 0
    assert derive_seed(1) == 1_000_003
    assert derive_seed(2, 3, 4) == 2 * 1_000_003 + 3 * 7_919 + 4


def test_derive_seed_wraps_into_a_nonnegative_int63():
    s = derive_seed(2**62, 2**40, 5)
    assert 0 <= s < 2**63
    assert s == (2**62 * 1_000_003 + 2**40 * 7_919 + 5) % 2**63


def test_units_get_distinct_seeds():
    seeds = {derive_seed(7, key, index) for key in range(20) for index in range(200)}
    assert len(seeds) == 20 * 200


def test_a_reused_prompt_draws_from_its_first_seed_mixed_with_the_cycle_by_hand():
    for seed, benchmark, request, cycle in ((0, "gsm8k", 0, 1), (980406, "mt-bench", 17, 3), (2**40, "aime25", 5, 2)):
        first = (seed * 1_000_003 + zlib.crc32(benchmark.encode("utf-8")) * 7_919 + request) % 2**63
        assert request_seed(seed, benchmark, request) == first
        assert request_seed(seed, benchmark, request, cycle) == (first * 1_000_003 + cycle) % 2**63


def test_request_seeds_are_distinct_across_benchmarks_requests_and_cycles():
    seeds = {request_seed(980406, b, i, c) for b in ("gsm8k", "mbpp", "alpaca") for i in range(100) for c in range(5)}
    assert len(seeds) == 3 * 100 * 5


def test_a_negative_cycle_is_refused():
    with pytest.raises(ValueError, match="cycle must be an int >= 0"):
        request_seed(0, "gsm8k", 0, -1)
