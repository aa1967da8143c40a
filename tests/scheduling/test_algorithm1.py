"""Algorithm 1, its asynchronous variant and SPS tables (paper Section 3.2.2, Algorithm 1, Section 5.2)."""

import itertools
import json

import numpy as np
import pytest

from dspark.scheduling.algorithm1 import (
    SPSTable,
    first_below_lengths,
    schedule_prefix,
    static_lengths,
    threshold_lengths,
)
from dspark.scheduling.async_scheduler import AsyncPrefixScheduler, admit_top_k, capacity_from_stale

# Appendix A: R = 1, γ = 2.
APPENDIX_SPS = SPSTable([1, 2, 3], [1.0, 0.5, 0.45], max_batch_tokens=3)
CONF_AFTER_A = [[0.8, 0.9]]  # x1 = A gives c2 = 0.9
CONF_AFTER_B = [[0.8, 0.0]]  # x1 = B gives c2 = 0


# ----------------------------------------------------------------------------
# Oracles written independently of the implementation
# ----------------------------------------------------------------------------


def literal_algorithm_1(conf, sps, early_stop=True):
    """Line-by-line Python transcription of Algorithm 1 (paper Section 3.2.2)."""
    R, gamma = len(conf), len(conf[0])
    a = [[0.0] * gamma for _ in range(R)]
    for r in range(R):
        prod = 1.0
        for j in range(gamma):
            prod *= conf[r][j]
            a[r][j] = prod
    E = [(r, j + 1) for r in range(R) for j in range(gamma) if a[r][j] > 0]
    E.sort(key=lambda rj: (-a[rj[0]][rj[1] - 1], rj[1], rj[0]))
    ell = [0] * R
    B = R
    tau = float(R)
    theta_best = R * float(sps(R))
    best = list(ell)
    for r, j in E:
        ell[r] = j
        B += 1
        tau += a[r][j - 1]
        theta = tau * float(sps(B))
        if theta > theta_best:
            theta_best = theta
            best = list(ell)
        elif early_stop:
            break
    return best


def prefix_closed_vectors(R, gamma):
    return itertools.product(range(gamma + 1), repeat=R)


def expected_accepts(a, ell):
    return sum(a[r, :l].sum() for r, l in enumerate(ell))


def throughput(a, ell, sps):
    R = a.shape[0]
    return (R + expected_accepts(a, ell)) * float(sps(R + sum(ell)))


def emitted_first_token(x1, ell, rng, p_t, p_d):
    """First token emitted by one verification round per trial (paper Section 2.1), for a
    vocabulary of size 2. x1 [N] draft tokens, ell [N] verified lengths."""
    n = x1.shape[0]
    from_target = (rng.random(n) < p_t[1]).astype(np.int64)  # fresh token ~ p_t
    accept = rng.random(n) < np.minimum(1.0, p_t[x1] / p_d[x1])
    residual = np.maximum(0.0, p_t - p_d)
    residual = residual / residual.sum()
    from_residual = (rng.random(n) < residual[1]).astype(np.int64)
    verified = ell >= 1
    return np.where(verified, np.where(accept, x1, from_residual), from_target)


P_T = np.array([0.7, 0.3])  # token 0 = A, token 1 = B
P_D = np.array([0.5, 0.5])
N_TRIALS = 200_000


def draft_confidences(x1):
    """c1 = 0.8 always; c2 = 0.9 after A, 0 after B. [N, 2]."""
    return np.stack([np.full(x1.shape, 0.8), np.where(x1 == 0, 0.9, 0.0)], axis=1)


def schedule_per_trial(conf, fn):
    """Apply a deterministic per-request scheduler to each row of conf by
    calling it once per distinct row (the trials only have a few)."""
    rows, inverse = np.unique(conf, axis=0, return_inverse=True)
    lengths = np.array([int(fn(row[None, :])[0]) for row in rows])
    return lengths[inverse.ravel()]


# ----------------------------------------------------------------------------
# Appendix A and losslessness
# ----------------------------------------------------------------------------


def test_appendix_a_throughputs_by_hand():
    assert 1 * APPENDIX_SPS(1) == pytest.approx(1.0)  # Θ0
    assert (1 + 0.8) * APPENDIX_SPS(2) == pytest.approx(0.9)  # Θ1
    assert (1 + 0.8 + 0.72) * APPENDIX_SPS(3) == pytest.approx(1.134)  # Θ2 after A
    assert (1 + 0.8 + 0.0) * APPENDIX_SPS(3) == pytest.approx(0.81)  # Θ2 after B


def test_global_search_admits_x1_only_when_it_is_a():
    assert schedule_prefix(CONF_AFTER_A, APPENDIX_SPS, early_stop=False).tolist() == [2]
    assert schedule_prefix(CONF_AFTER_B, APPENDIX_SPS, early_stop=False).tolist() == [0]


def test_early_stop_never_admits_x1_in_appendix_a():
    assert schedule_prefix(CONF_AFTER_A, APPENDIX_SPS, early_stop=True).tolist() == [0]
    assert schedule_prefix(CONF_AFTER_B, APPENDIX_SPS, early_stop=True).tolist() == [0]


def _first_token_prob_a(schedule_fn, seed):
    rng = np.random.default_rng(seed)
    x1 = (rng.random(N_TRIALS) < P_D[1]).astype(np.int64)
    ell = schedule_fn(draft_confidences(x1), rng)
    y = emitted_first_token(x1, ell, rng, P_T, P_D)
    return float(np.mean(y == 0))


def test_global_search_on_current_draft_biases_output_to_0_85():
    p = _first_token_prob_a(
        lambda conf, rng: schedule_per_trial(
            conf, lambda c: schedule_prefix(c, APPENDIX_SPS, early_stop=False)
        ),
        seed=1,
    )
    assert abs(p - 0.85) < 0.01


def test_early_stop_keeps_output_distribution():
    p = _first_token_prob_a(
        lambda conf, rng: schedule_per_trial(
            conf, lambda c: schedule_prefix(c, APPENDIX_SPS, early_stop=True)
        ),
        seed=2,
    )
    assert abs(p - 0.70) < 0.01


def test_async_capacity_from_stale_draft_keeps_output_distribution():
    def schedule(conf, rng):
        # The stale draft (two steps earlier) is an independent sample of the
        # same process; K comes from it, the current draft only ranks tokens.
        stale = draft_confidences((rng.random(conf.shape[0]) < P_D[1]).astype(np.int64))
        k = schedule_per_trial(stale, lambda c: [capacity_from_stale(c, APPENDIX_SPS)])
        out = np.empty(conf.shape[0], dtype=np.int64)
        for kk in np.unique(k):
            sel = k == kk
            out[sel] = schedule_per_trial(conf[sel], lambda c: admit_top_k(c, int(kk)))
        return out

    p = _first_token_prob_a(schedule, seed=3)
    assert abs(p - 0.70) < 0.01


def test_async_scheduler_class_keeps_output_distribution():
    # One request decoded for many steps; each step's draft is fresh, the class
    # sees the draft of two steps before through its own history.
    steps = 20_000
    rng = np.random.default_rng(4)
    x1 = (rng.random(steps) < P_D[1]).astype(np.int64)
    conf = draft_confidences(x1)
    sched = AsyncPrefixScheduler(APPENDIX_SPS, default_capacity=0)
    ell = np.array([sched.step(["req"], conf[t : t + 1])[0] for t in range(steps)])
    assert set(ell[2:].tolist()) == {0, 1, 2}  # the scheduler does vary ℓ
    y = emitted_first_token(x1, ell, rng, P_T, P_D)
    # 20k trials: std 0.0032, the biased value 0.85 is far outside.
    assert abs(float(np.mean(y == 0)) - 0.70) < 0.015


# ----------------------------------------------------------------------------
# Optimality of the greedy path
# ----------------------------------------------------------------------------


def test_top_k_maximizes_expected_accepts_for_fixed_budget():
    rng = np.random.default_rng(5)
    for _ in range(200):
        R, gamma = rng.integers(2, 4), rng.integers(2, 4)
        conf = rng.uniform(0.01, 1.0, (R, gamma))
        a = np.cumprod(conf, axis=1)
        k = int(rng.integers(0, R * gamma + 1))
        best = max(
            expected_accepts(a, ell) for ell in prefix_closed_vectors(R, gamma) if sum(ell) == k
        )
        got = admit_top_k(conf, k)
        assert got.sum() == k
        assert expected_accepts(a, got) == pytest.approx(best, rel=1e-12, abs=1e-12)


def _log_concave_sps(rng):
    """SPS curves with log-concave shape, for which Θ = τ*·SPS is unimodal along
    the admission path (τ* is concave and increasing there)."""
    kind = rng.integers(3)
    if kind == 0:
        lam = rng.uniform(0.02, 0.6)
        return lambda b: np.exp(-lam * np.asarray(b, dtype=np.float64))
    if kind == 1:
        cap = rng.uniform(6.0, 40.0)
        return lambda b: np.maximum(0.0, 1.0 - np.asarray(b, dtype=np.float64) / cap)
    # Concave decreasing table: linear interpolation stays concave.
    cap = rng.uniform(13.0, 30.0)
    xs = np.arange(1, 13)
    return SPSTable(xs.tolist(), (1.0 - (xs / cap) ** 2).tolist(), max_batch_tokens=12)


def test_early_stop_is_globally_optimal_when_throughput_is_unimodal():
    rng = np.random.default_rng(6)
    lengths_seen = set()
    for _ in range(300):
        R, gamma = int(rng.integers(2, 4)), int(rng.integers(2, 4))
        conf = rng.uniform(0.0, 1.0, (R, gamma)) ** rng.uniform(0.2, 2.0)
        a = np.cumprod(conf, axis=1)
        sps = _log_concave_sps(rng)
        best = max(throughput(a, ell, sps) for ell in prefix_closed_vectors(R, gamma))
        got = schedule_prefix(conf, sps, early_stop=True)
        assert throughput(a, got, sps) == pytest.approx(best, rel=1e-12)
        lengths_seen.add(int(got.sum()))
    assert len(lengths_seen) > 4  # the draws exercise short and long schedules


# ----------------------------------------------------------------------------
# Agreement with the literal algorithm
# ----------------------------------------------------------------------------


def _step_sps(b):
    # Scalar-only Python callable (uses `if`), step-shaped like real hardware.
    if b <= 3:
        return 1.0
    if b <= 6:
        return 0.75
    return 0.5 if b <= 10 else 0.25


@pytest.mark.parametrize("early_stop", [True, False])
def test_vectorized_matches_literal_algorithm_with_ties_and_zeros(early_stop):
    rng = np.random.default_rng(7 + early_stop)
    levels = np.array([0.0, 0.25, 0.5, 0.75, 1.0])  # exact products: many ties
    for trial in range(400):
        R, gamma = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        conf = levels[rng.integers(0, levels.size, (R, gamma))]
        if trial % 2:
            conf = rng.uniform(0.0, 1.0, (R, gamma))
        if trial % 3 == 0:
            sps = _step_sps
        else:
            xs = np.sort(rng.choice(np.arange(1, 40), size=5, replace=False))
            ys = np.sort(rng.uniform(0.1, 1.0, 5))[::-1]
            sps = SPSTable(xs.tolist(), ys.tolist(), max_batch_tokens=int(rng.integers(xs[-1], 45)))
        expected = literal_algorithm_1(conf.tolist(), sps, early_stop=early_stop)
        assert schedule_prefix(conf, sps, early_stop=early_stop).tolist() == expected


def test_ties_admit_smaller_position_then_smaller_request_first():
    conf = np.ones((2, 2))  # every a = 1
    assert admit_top_k(conf, 1).tolist() == [1, 0]
    assert admit_top_k(conf, 2).tolist() == [1, 1]
    assert admit_top_k(conf, 3).tolist() == [2, 1]


def test_zero_survival_tokens_are_never_admitted():
    conf = [[0.9, 0.0, 1.0], [0.0, 1.0, 1.0]]
    assert admit_top_k(conf, 6).tolist() == [1, 0]
    flat_sps = lambda b: np.ones_like(np.asarray(b, dtype=float))  # noqa: E731
    assert schedule_prefix(conf, flat_sps, early_stop=False).tolist() == [1, 0]


def test_batch_above_max_batch_tokens_is_infeasible():
    sps = SPSTable([1, 4], [1.0, 1.0], max_batch_tokens=4)  # free up to B = 4
    conf = np.full((2, 3), 0.9)
    lengths = schedule_prefix(conf, sps, early_stop=False)
    assert lengths.sum() == 2  # B = R + Σℓ = 4


def test_array_callable_is_evaluated_once():
    calls = []

    def sps(b):
        calls.append(np.shape(b))
        return 1.0 / (1.0 + np.asarray(b, dtype=float) / 8.0)

    schedule_prefix(np.full((4, 3), 0.9), sps)
    assert len(calls) == 1 and calls[0] == (13,)


def test_torch_confidences_give_same_lengths():
    torch = pytest.importorskip("torch")
    conf = np.random.default_rng(8).uniform(0.2, 1.0, (16, 7))
    sps = SPSTable([1, 16, 64, 128], [1.0, 0.95, 0.6, 0.3], max_batch_tokens=128)
    expected = schedule_prefix(conf, sps)
    assert schedule_prefix(torch.tensor(conf, dtype=torch.float64), sps).tolist() == expected.tolist()


def test_invalid_confidences_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        schedule_prefix([0.5, 0.5], APPENDIX_SPS)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        schedule_prefix([[0.5, 1.5]], APPENDIX_SPS)


# ----------------------------------------------------------------------------
# The asynchronous scheduler
# ----------------------------------------------------------------------------


def test_async_capacity_uses_confidences_from_two_steps_before():
    sps = APPENDIX_SPS
    sched = AsyncPrefixScheduler(sps, default_capacity=1)
    high, low = np.array([[0.8, 0.9]]), np.array([[0.8, 0.0]])
    assert sched.step([7], high).tolist() == [1]  # no history: default capacity
    assert sched.step([7], low).tolist() == [1]  # still no draft from two steps ago
    # Step 3: K from step 1's draft (high -> global search admits 2), whatever
    # the current draft says; the current draft only has one a > 0 candidate.
    assert sched.capacity([7]) == 2
    assert sched.step([7], low).tolist() == [1]
    # Step 4: K from step 2's draft (low -> 0) even though the current one is high.
    assert sched.capacity([7]) == 0
    assert sched.step([7], high).tolist() == [0]


def test_async_new_requests_add_base_tokens_but_no_stale_candidates():
    sps = SPSTable([1, 2, 3, 4], [1.0, 0.5, 0.45, 0.3], max_batch_tokens=4)
    sched = AsyncPrefixScheduler(sps)
    sched.step(["a"], [[0.8, 0.9]])
    sched.step(["a"], [[0.8, 0.9]])
    # With "b" new, the stale matrix is [[0.8, 0.9], [0, 0]] and R = 2:
    # Θ(K=0) = 2·0.5 = 1.0, Θ(K=1) = (2 + 0.8)·0.45 = 1.26, Θ(K=2) = (2 + 1.52)·0.3 = 1.056.
    assert sched.capacity(["a", "b"]) == 1
    assert capacity_from_stale([[0.8, 0.9], [0.0, 0.0]], sps) == 1


def test_top_k_admission_does_not_depend_on_tokens_below_the_cut():
    # Changing the confidence after a token never changes whether that token
    # is admitted (the property that makes the async variant lossless).
    rng = np.random.default_rng(9)
    for _ in range(200):
        conf = rng.uniform(0.05, 1.0, (4, 5))
        k = int(rng.integers(0, 21))
        base = admit_top_k(conf, k)
        r, j = int(rng.integers(4)), int(rng.integers(1, 5))  # change c_{r, j+1}
        changed = conf.copy()
        changed[r, j] = rng.uniform(0.0, 1.0)
        out = admit_top_k(changed, k)
        assert (out[r] >= j) == (base[r] >= j)


# ----------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------


def test_static_lengths():
    assert static_lengths(3, 2).tolist() == [2, 2, 2]
    assert static_lengths(3, 2).dtype == np.int64


def test_threshold_lengths_threshold_the_prefix_survival():
    conf = [[0.9, 0.9, 0.9], [0.5, 1.0, 1.0], [0.95, 0.5, 1.0]]
    # a = [0.9, 0.81, 0.729], [0.5, 0.5, 0.5], [0.95, 0.475, 0.475]
    assert threshold_lengths(conf, 0.8).tolist() == [2, 0, 1]
    assert threshold_lengths(conf, 0.5).tolist() == [3, 3, 1]


def test_first_below_lengths_stop_before_the_first_confidence_under_the_threshold():
    """DeepSpec's rule looks at each c_j alone: ℓ = index of the first c_j < t (0-based), else γ."""
    conf = [[0.9, 0.9, 0.9], [0.5, 1.0, 1.0], [0.95, 0.5, 1.0], [0.8, 0.79, 0.99]]
    assert first_below_lengths(conf, 0.8).tolist() == [3, 0, 1, 1]  # 0.8 is not below 0.8; 0.79 is
    assert first_below_lengths(conf, 0.5).tolist() == [3, 3, 3, 3]
    assert first_below_lengths(conf, 0.0).tolist() == [3, 3, 3, 3]  # threshold 0: verify every draft
    assert first_below_lengths(conf, 1.0).tolist() == [0, 0, 0, 0]
    assert threshold_lengths(conf, 0.8).tolist() == [2, 0, 1, 1]  # the cumulative rule: a_3 = 0.729 stops row 0 at 2
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\]"):
        first_below_lengths(conf, 1.5)


# ----------------------------------------------------------------------------
# SPS tables
# ----------------------------------------------------------------------------

TABLE = SPSTable([4, 8, 16], [10.0, 6.0, 2.0], max_batch_tokens=20)


@pytest.mark.parametrize(
    "b, expected",
    [(1, 10.0), (4, 10.0), (6, 8.0), (12, 4.0), (16, 2.0), (18, 2.0), (20, 2.0), (21, 0.0)],
)
def test_sps_table_interpolates_by_hand(b, expected):
    got = TABLE(b)
    assert isinstance(got, float)
    assert got == pytest.approx(expected)


def test_sps_table_evaluates_arrays():
    b = np.array([1, 6, 12, 21])
    np.testing.assert_allclose(TABLE(b), [10.0, 8.0, 4.0, 0.0])


def test_sps_table_json_round_trip(tmp_path):
    path = tmp_path / "sps.json"
    TABLE.to_json(path)
    raw = json.loads(path.read_text())
    assert raw == {
        "sample_batch_tokens": [4, 8, 16],
        "sample_steps_per_sec": [10.0, 6.0, 2.0],
        "max_batch_tokens": 20,
    }
    assert SPSTable.from_json(path) == TABLE


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"sample_batch_tokens": None}, "sample_batch_tokens"),
        ({"sample_steps_per_sec": [1.0, 2.0]}, "sample_steps_per_sec"),
        ({"sample_batch_tokens": [4, 4, 16]}, "sample_batch_tokens"),
        ({"sample_batch_tokens": [4, 8.5, 16]}, "sample_batch_tokens"),
        ({"sample_steps_per_sec": [1.0, 0.0, 2.0]}, "sample_steps_per_sec"),
        ({"sample_steps_per_sec": [1.0, "fast", 2.0]}, "sample_steps_per_sec"),
        ({"max_batch_tokens": 8}, "max_batch_tokens"),
        ({"max_batch_tokens": "big"}, "max_batch_tokens"),
    ],
)
def test_malformed_sps_json_names_the_field(tmp_path, patch, field):
    data = TABLE.to_dict()
    for key, value in patch.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "sps.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        SPSTable.from_json(path)


def test_sps_json_that_does_not_parse_raises_value_error(tmp_path):
    path = tmp_path / "sps.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        SPSTable.from_json(path)

