"""dspark.seeds.derive_seed: the one seed-mixing rule, by hand."""

from __future__ import annotations

from dspark.seeds import derive_seed


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
