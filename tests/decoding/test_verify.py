"""Verification primitives of speculative sampling (paper Section 2.1): lossless rejection sampling and greedy verification.

The distribution tests simulate many rounds in one batched call and compare
empirical frequencies with probabilities enumerated exactly in float64, using a
chi-square test at a fixed seed. Each such test has a negative control: a
deliberately wrong sampler must fail the same check.

The toy model: a vocabulary of V = 4 tokens and fixed random logit tables for a
target and a (different) drafter, conditional on every prefix of up to three
tokens, so that the distribution at draft position k depends on the tokens
sampled before it.
"""

from __future__ import annotations

import pytest
import torch

from dspark.sampling import logits_to_probs
from dspark.decoding.verify import greedy_verify, rejection_sample

V = 4
MAX_ELL = 3
N_ROUNDS = 100_000
P_MIN = 1e-3  # a correct sampler passes the chi-square test at this level


def _prefix_logits(seed: int) -> list[torch.Tensor]:
    """Logit tables, entry k: [V**k, V], the next-token logits after every prefix of k tokens (base-V code)."""
    g = torch.Generator().manual_seed(seed)
    return [2.0 * torch.randn(V**k, V, generator=g, dtype=torch.float64) for k in range(MAX_ELL + 1)]


TARGET_LOGITS = _prefix_logits(seed=0)
DRAFT_LOGITS = _prefix_logits(seed=1)


def _softmax64(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of Pearson's chi-square goodness-of-fit test; cells with small expected counts are pooled."""
    counts = counts.double()
    expected = counts.sum() * probs.double()
    if bool(((expected == 0) & (counts > 0)).any()):
        return 0.0  # an outcome of probability zero occurred
    small = expected < min_expected
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_chi2_pvalue_matches_known_quantiles():
    # Table values: the chi-square quantile for df = 1 at p = 0.05 is 3.8415, for df = 3 at p = 0.01 is 11.345.
    d = (3.8415 * 250) ** 0.5  # two cells expecting 500 each: stat = 2·d²/500
    assert _chi2_pvalue(torch.tensor([500 + d, 500 - d]), torch.tensor([0.5, 0.5])) == pytest.approx(0.05, abs=1e-4)
    d = (11.345 * 250 / 4) ** 0.5  # four cells expecting 250 each: stat = 4·d²/250
    counts = torch.tensor([250 + d, 250 - d, 250 + d, 250 - d])
    assert _chi2_pvalue(counts, torch.full((4,), 0.25)) == pytest.approx(0.01, abs=1e-4)


# ---------------------------------------------------------------------------
# The toy model: drafting, verification, exact oracles
# ---------------------------------------------------------------------------


def _simulate_round(
    ell: int,
    temperature: float,
    seed: int,
    sampler=rejection_sample,
    lengths: torch.Tensor | None = None,
    n: int = N_ROUNDS,
    draft_sampled_at: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft ℓ tokens per row from the draft tables and verify them against the target tables.

    Both models' probabilities go through ``logits_to_probs`` at ``temperature``;
    ``draft_sampled_at`` samples the drafts at another temperature while still
    handing the ``temperature`` probabilities to the verifier (a pitfall of other implementations).
    Returns draft_tokens [n, ℓ], num_accepted [n], next_token [n].
    """
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.zeros(n, dtype=torch.long)  # base-V code of the drafted tokens so far
    draft_tokens = torch.zeros(n, ell, dtype=torch.long)
    draft_probs = torch.zeros(n, ell, V)
    target_probs = torch.zeros(n, ell + 1, V)
    for k in range(ell + 1):
        # probabilities of every prefix at depth k, then one row per round
        target_probs[:, k] = logits_to_probs(TARGET_LOGITS[k], temperature)[prefix]
        if k == ell:
            break
        q = logits_to_probs(DRAFT_LOGITS[k], temperature)[prefix]
        q_sample = q if draft_sampled_at is None else logits_to_probs(DRAFT_LOGITS[k], draft_sampled_at)[prefix]
        x = torch.multinomial(q_sample, 1, generator=gen).squeeze(1)
        draft_tokens[:, k] = x
        draft_probs[:, k] = q
        prefix = prefix * V + x
    kwargs = {} if lengths is None else {"lengths": lengths}
    num_accepted, next_token = sampler(draft_tokens, draft_probs, target_probs, generator=gen, **kwargs)
    return draft_tokens, num_accepted, next_token


def _complete_with_target(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor, temperature: float, seed: int
) -> torch.Tensor:
    """Emitted tokens (accepted drafts, then next_token) continued with exact target samples to ℓ+1 tokens.

    Returns the base-V code [n] of each completed sequence.
    """
    gen = torch.Generator().manual_seed(seed)
    n, ell = draft_tokens.shape
    seq = torch.zeros(n, ell + 1, dtype=torch.long)
    seq[:, :ell] = draft_tokens
    seq[torch.arange(n), num_accepted] = next_token
    code = torch.zeros(n, dtype=torch.long)
    for j in range(ell + 1):
        after_emitted = j > num_accepted
        if bool(after_emitted.any()):
            fresh = torch.multinomial(_softmax64(TARGET_LOGITS[j], temperature)[code], 1, generator=gen).squeeze(1)
            seq[:, j] = torch.where(after_emitted, fresh, seq[:, j])
        code = code * V + seq[:, j]
    return code


def _digits(codes: torch.Tensor, length: int) -> torch.Tensor:
    """Base-V digits [N, length] of codes [N], most significant first."""
    powers = V ** torch.arange(length - 1, -1, -1)
    return (codes.unsqueeze(-1) // powers) % V


def _target_joint(length: int, temperature: float) -> torch.Tensor:
    """Exact probability [V**length] of every token sequence under the target's own sampling (float64)."""
    codes = torch.arange(V**length)
    digits = _digits(codes, length)
    prob = torch.ones(len(codes), dtype=torch.float64)
    prefix = torch.zeros(len(codes), dtype=torch.long)
    for j in range(length):
        p = _softmax64(TARGET_LOGITS[j][prefix], temperature)
        prob = prob * p.gather(1, digits[:, j : j + 1]).squeeze(1)
        prefix = prefix * V + digits[:, j]
    return prob


def _outcome_code(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """Index of the emitted sequence (x_1..x_m, next) among all sequences of length 1..ℓ+1."""
    n, ell = draft_tokens.shape
    offset = torch.tensor([sum(V**i for i in range(1, m + 1)) for m in range(ell + 1)])
    code = torch.zeros(n, dtype=torch.long)
    for k in range(ell):
        code = torch.where(k < num_accepted, code * V + draft_tokens[:, k], code)
    return offset[num_accepted] + code * V + next_token


def _round_outcome_probs(ell: int, temperature: float) -> torch.Tensor:
    """Exact probability of each emitted sequence of a round verifying ℓ drafts, by enumeration (float64).

    Accepting draft a after prefix y has probability p_d(a)·min(1, p_t(a)/p_d(a)) = min(p_d, p_t)(a);
    rejecting and then emitting c has probability Σ_x (p_d − min(p_d, p_t))(x) · residual(c)
    = max(0, p_t(c) − p_d(c)); after ℓ acceptances the bonus c has probability p_t(c).
    Indexed like ``_outcome_code``.
    """
    parts = []
    for m in range(ell + 1):
        codes = torch.arange(V ** (m + 1))
        seqs = _digits(codes, m + 1)
        prob = torch.ones(len(codes), dtype=torch.float64)
        prefix = torch.zeros(len(codes), dtype=torch.long)
        for k in range(m + 1):
            p_t = _softmax64(TARGET_LOGITS[k][prefix], temperature)
            p_d = _softmax64(DRAFT_LOGITS[k][prefix], temperature)
            if k < m:
                step = torch.minimum(p_d, p_t)
            elif m < ell:
                step = (p_t - p_d).clamp(min=0)
            else:
                step = p_t
            prob = prob * step.gather(1, seqs[:, k : k + 1]).squeeze(1)
            prefix = prefix * V + seqs[:, k]
        parts.append(prob)
    return torch.cat(parts)


def _sample_rows(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _wrong_correction_sampler(draft_tokens, draft_probs, target_probs, generator=None):
    """Rejection sampling with a bug: the correction comes from p_t instead of norm(max(0, p_t − p_d))."""
    batch, ell = draft_tokens.shape
    num_accepted = torch.zeros(batch, dtype=torch.long)
    next_token = torch.zeros(batch, dtype=torch.long)
    alive = torch.ones(batch, dtype=torch.bool)
    for k in range(ell):
        x = draft_tokens[:, k : k + 1]
        ratio = target_probs[:, k].gather(1, x).squeeze(1) / draft_probs[:, k].gather(1, x).squeeze(1)
        accepted = torch.rand(batch, generator=generator) < ratio.clamp(max=1)
        rejected_here = alive & ~accepted
        next_token = torch.where(rejected_here, _sample_rows(target_probs[:, k], generator), next_token)
        num_accepted += (alive & accepted).long()
        alive &= accepted
    next_token = torch.where(alive, _sample_rows(target_probs[:, ell], generator), next_token)
    return num_accepted, next_token


def _completed_pvalue(ell: int, temperature: float, seed: int, **kwargs) -> float:
    draft_tokens, num_accepted, next_token = _simulate_round(ell, temperature, seed, **kwargs)
    codes = _complete_with_target(draft_tokens, num_accepted, next_token, temperature, seed + 1000)
    counts = torch.bincount(codes, minlength=V ** (ell + 1))
    return _chi2_pvalue(counts, _target_joint(ell + 1, temperature))


# ---------------------------------------------------------------------------
# Losslessness
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("ell", [0, 1, 2, 3])
def test_emitted_tokens_are_distributed_as_the_target(ell, temperature):
    """Paper Section 2.1: the emitted tokens are a prefix of a target sample.

    The round emits x_1..x_m, next_token (1 to ℓ+1 tokens); continuing that prefix with
    exact target samples must give the target's joint law of ℓ+1 tokens. This covers
    every emitted token, including "given x_1 accepted, the second token ~ p_t(· | x_1)".
    """
    assert _completed_pvalue(ell, temperature, seed=10 + ell) > P_MIN


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("ell", [1, 3])
def test_first_emitted_token_follows_the_target(ell, temperature):
    draft_tokens, num_accepted, next_token = _simulate_round(ell, temperature, seed=20 + ell)
    first = next_token.clone()
    if ell > 0:
        first = torch.where(num_accepted > 0, draft_tokens[:, 0], next_token)
    expected = _softmax64(TARGET_LOGITS[0][0], temperature)
    assert _chi2_pvalue(torch.bincount(first, minlength=V), expected) > P_MIN


@pytest.mark.parametrize("ell", [1, 3])
def test_losslessness_check_rejects_a_correction_drawn_from_the_target(ell):
    """Negative control: the same check has the power to catch a wrong correction distribution."""
    assert _completed_pvalue(ell, 1.0, seed=30 + ell, sampler=_wrong_correction_sampler) < P_MIN


def test_draft_probs_other_than_the_sampling_ones_break_losslessness():
    """A pitfall of other implementations: drafts sampled at T = 1 but verified with their T = 0.6 probabilities are not lossless."""
    assert _completed_pvalue(2, 0.6, seed=40, draft_sampled_at=1.0) < P_MIN


@pytest.mark.parametrize("ell", [0, 1, 2, 3])
def test_round_outcomes_match_their_enumerated_probabilities(ell):
    draft_tokens, num_accepted, next_token = _simulate_round(ell, 1.0, seed=50 + ell)
    expected = _round_outcome_probs(ell, 1.0)
    counts = torch.bincount(_outcome_code(draft_tokens, num_accepted, next_token), minlength=len(expected))
    assert _chi2_pvalue(counts, expected) > P_MIN


def test_one_position_outcomes_match_the_closed_form():
    """ℓ = 1 by hand: P(x=a, accept, bonus b) = min(p_d, p_t)(a)·p_bonus(b);
    P(x=a, reject, correction c) = (p_d − min(p_d, p_t))(a) · max(0, p_t − p_d)(c) / Σ max(0, p_t − p_d)."""
    p_t = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    p_d = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    p_bonus = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64).flip(0)
    accepted = torch.minimum(p_t, p_d)  # [0.1, 0.2, 0.2, 0.1]
    residual = (p_t - p_d).clamp(min=0) / (p_t - p_d).clamp(min=0).sum()  # [0.75, 0.25, 0, 0]
    # outcome index: x·2V + num_accepted·V + next_token
    closed_form = torch.zeros(V, 2, V, dtype=torch.float64)
    closed_form[:, 1, :] = accepted[:, None] * p_bonus[None, :]
    closed_form[:, 0, :] = (p_d - accepted)[:, None] * residual[None, :]
    assert closed_form.sum().item() == pytest.approx(1.0)
    assert closed_form[3, 0, 0].item() == pytest.approx(0.3 * 0.75)  # hand check of one cell

    n = N_ROUNDS
    gen = torch.Generator().manual_seed(60)
    draft_tokens = torch.multinomial(p_d.float().expand(n, V), 1, replacement=True, generator=gen)  # [n, 1]
    draft_probs = p_d.float().expand(n, 1, V)
    target_probs = torch.stack([p_t, p_bonus]).float().expand(n, 2, V)
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator=gen)
    outcome = draft_tokens[:, 0] * 2 * V + num_accepted * V + next_token
    counts = torch.bincount(outcome, minlength=2 * V * V)
    assert _chi2_pvalue(counts, closed_form.flatten()) > P_MIN
    # the (num_accepted, next_token) marginal, the pair the decoding loop sees
    pair_counts = counts.reshape(V, 2, V).sum(0).flatten()
    assert _chi2_pvalue(pair_counts, closed_form.sum(0).flatten()) > P_MIN


# ---------------------------------------------------------------------------
# Edge cases of the acceptance rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ell", [1, 4, 16])
def test_drafter_equal_to_target_accepts_every_position(ell):
    gen = torch.Generator().manual_seed(70)
    batch, vocab = 1024, 200
    target_probs = logits_to_probs(4.0 * torch.randn(batch, ell + 1, vocab, generator=gen), 1.0)
    draft_probs = target_probs[:, :ell].clone()
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, ell)
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator=gen)
    assert torch.equal(num_accepted, torch.full((batch,), ell))
    assert bool((target_probs[torch.arange(batch), ell, next_token] > 0).all())


def test_rejection_with_an_empty_residual_falls_back_to_the_target():
    """p_d = p_t leaves no residual mass; a draft token outside both supports (0/0) is rejected
    and the correction must come from p_t itself."""
    n = 20_000
    probs = torch.tensor([0.5, 0.5, 0.0])
    draft_tokens = torch.full((n, 1), 2)
    draft_probs = probs.expand(n, 1, 3)
    target_probs = probs.expand(n, 2, 3)
    gen = torch.Generator().manual_seed(80)
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator=gen)
    assert bool((num_accepted == 0).all())
    assert _chi2_pvalue(torch.bincount(next_token, minlength=3), probs.double()) > P_MIN


def test_draft_token_with_zero_draft_probability_is_accepted_when_the_target_allows_it():
    """p_d(x) = 0 < p_t(x): the ratio is +inf, so x is accepted (no NaN from 0/0 handling)."""
    n = 1000
    draft_tokens = torch.full((n, 1), 1)
    draft_probs = torch.tensor([1.0, 0.0]).expand(n, 1, 2)
    target_probs = torch.tensor([[0.5, 0.5], [0.0, 1.0]]).expand(n, 2, 2)
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs)
    assert bool((num_accepted == 1).all()) and bool((next_token == 1).all())


def test_same_generator_seed_reproduces_the_round():
    def run(seed):
        return _simulate_round(3, 1.0, seed=seed, n=5000)

    first, second, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[2], other[2])


def test_empty_batch_and_zero_length_rounds():
    m, x = rejection_sample(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, 5), torch.zeros(0, 3, 5))
    assert m.shape == (0,) and x.shape == (0,)
    target_probs = torch.tensor([[[0.0, 0.0, 1.0]], [[1.0, 0.0, 0.0]]])
    m, x = rejection_sample(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 3), target_probs)
    assert m.tolist() == [0, 0] and x.tolist() == [2, 0]
    assert m.dtype == torch.long and x.dtype == torch.long


# ---------------------------------------------------------------------------
# Per-row verification lengths
# ---------------------------------------------------------------------------


def _one_hot_rounds(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target row k is one-hot on token k and the drafter proposes 0, 1, 2 with the same
    one-hot rows: every draft would be accepted, so only ``lengths`` can stop a row early."""
    n = len(lengths)
    target_probs = torch.eye(V)[: MAX_ELL + 1].expand(n, MAX_ELL + 1, V)
    draft_probs = target_probs[:, :MAX_ELL]
    draft_tokens = torch.arange(MAX_ELL).expand(n, MAX_ELL)
    return draft_tokens, draft_probs, target_probs


def test_bonus_comes_from_the_row_at_each_rows_length():
    lengths = torch.tensor([0, 1, 2, 3, 1])
    draft_tokens, draft_probs, target_probs = _one_hot_rounds(lengths.tolist())
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, lengths=lengths)
    assert num_accepted.tolist() == lengths.tolist()
    assert next_token.tolist() == lengths.tolist()


def _lengths_pvalues(sampler, seed: int) -> list[float]:
    """Chi-square p-value, per verification length L, of the rows verifying L drafts against a round with ℓ = L."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, MAX_ELL + 1, (N_ROUNDS,), generator=gen)
    draft_tokens, num_accepted, next_token = _simulate_round(MAX_ELL, 1.0, seed, sampler=sampler, lengths=lengths)
    assert bool((num_accepted <= lengths).all())
    pvalues = []
    for length in range(MAX_ELL + 1):
        rows = lengths == length
        expected = _round_outcome_probs(length, 1.0)
        codes = _outcome_code(draft_tokens[rows, :length], num_accepted[rows], next_token[rows])
        pvalues.append(_chi2_pvalue(torch.bincount(codes, minlength=len(expected)), expected))
    return pvalues


def test_rows_with_lengths_behave_like_separate_truncated_rounds():
    """Each group of rows with verification length L has the outcome law of a round with ℓ = L."""
    assert min(_lengths_pvalues(rejection_sample, seed=90)) > P_MIN


def _bonus_from_the_last_row(draft_tokens, draft_probs, target_probs, lengths, generator):
    """A bug: rows that accept all ℓ_b drafts take the bonus from row ℓ instead of row ℓ_b."""
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, lengths, generator)
    wrong_bonus = _sample_rows(target_probs[:, -1], generator)
    return num_accepted, torch.where(num_accepted == lengths, wrong_bonus, next_token)


def test_lengths_check_rejects_a_bonus_from_the_wrong_row():
    pvalues = _lengths_pvalues(_bonus_from_the_last_row, seed=91)
    assert max(pvalues[:MAX_ELL]) < P_MIN  # every truncated group is caught
    assert pvalues[MAX_ELL] > P_MIN  # rows verifying all ℓ are unaffected by this bug


# ---------------------------------------------------------------------------
# Greedy verification (temperature 0)
# ---------------------------------------------------------------------------


def _logits_with_argmax(argmax: list[list[int]], vocab: int = 5) -> torch.Tensor:
    """[B, ℓ+1, vocab] logits whose row argmaxes are the given token ids."""
    logits = torch.zeros(len(argmax), len(argmax[0]), vocab)
    logits.scatter_(-1, torch.tensor(argmax).unsqueeze(-1), 3.0)
    return logits


def test_greedy_accepts_the_matching_prefix_and_emits_the_target_argmax():
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3]])
    logits = _logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 0], [4, 2, 3, 1]])
    num_accepted, next_token = greedy_verify(draft, logits)
    assert num_accepted.tolist() == [3, 1, 0]  # all accepted / mismatch at 2 / mismatch at 1
    assert next_token.tolist() == [4, 2, 4]  # bonus / correction / correction
    # probabilities give the same answer as logits
    assert [t.tolist() for t in greedy_verify(draft, logits.softmax(-1))] == [[3, 1, 0], [4, 2, 4]]


def test_greedy_with_no_draft_emits_the_argmax_of_the_only_row():
    logits = _logits_with_argmax([[3], [0]])
    num_accepted, next_token = greedy_verify(torch.zeros(2, 0, dtype=torch.long), logits)
    assert num_accepted.tolist() == [0, 0] and next_token.tolist() == [3, 0]


def test_greedy_respects_lengths_and_takes_the_bonus_from_row_length():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    logits = _logits_with_argmax([[1, 2, 3, 4]] * 3)
    num_accepted, next_token = greedy_verify(draft, logits, lengths=torch.tensor([0, 2, 3]))
    assert num_accepted.tolist() == [0, 2, 3] and next_token.tolist() == [1, 3, 4]


def test_greedy_breaks_ties_towards_the_lowest_token_id():
    probs = torch.tensor([[[0.1, 0.45, 0.45]]])
    assert greedy_verify(torch.zeros(1, 0, dtype=torch.long), probs)[1].tolist() == [1]


# ---------------------------------------------------------------------------
# logits_to_probs and input validation
# ---------------------------------------------------------------------------


def test_logits_to_probs_is_an_fp32_softmax_at_the_temperature():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = logits_to_probs(logits, 0.5)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.double(), _softmax64(logits.double(), 0.5), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), None])
def test_logits_to_probs_rejects_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(2, 3), temperature)


def _valid_args(batch=2, ell=3, vocab=5):
    tokens = torch.zeros(batch, ell, dtype=torch.long)
    return tokens, torch.full((batch, ell, vocab), 1 / vocab), torch.full((batch, ell + 1, vocab), 1 / vocab)


_BAD_INPUTS = {
    "float draft tokens": (lambda t, d, p: (t.float(), d, p, None), "draft_tokens"),
    "1-D draft tokens": (lambda t, d, p: (t[0], d, p, None), "draft_tokens"),
    "token outside vocabulary": (lambda t, d, p: (t + 5, d, p, None), "draft_tokens"),
    "negative token": (lambda t, d, p: (t - 1, d, p, None), "draft_tokens"),
    "draft probs missing a position": (lambda t, d, p: (t, d[:, :2], p, None), "draft_probs"),
    "draft probs other vocabulary": (lambda t, d, p: (t, d[..., :4], p, None), "draft_probs"),
    "target without bonus row": (lambda t, d, p: (t, d, p[:, :3], None), "target_probs"),
    "target other batch": (lambda t, d, p: (t, d, p[:1], None), "target_probs"),
    "target 2-D": (lambda t, d, p: (t, d, p[0], None), "target_probs"),
    "lengths above ℓ": (lambda t, d, p: (t, d, p, torch.tensor([1, 4])), "lengths"),
    "negative lengths": (lambda t, d, p: (t, d, p, torch.tensor([-1, 0])), "lengths"),
    "lengths wrong shape": (lambda t, d, p: (t, d, p, torch.tensor([1])), "lengths"),
    "float lengths": (lambda t, d, p: (t, d, p, torch.tensor([1.0, 2.0])), "lengths"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_rejection_sample_rejects_bad_inputs_with_a_named_argument(case):
    build, name = _BAD_INPUTS[case]
    tokens, draft_probs, target_probs, lengths = build(*_valid_args())
    with pytest.raises(ValueError, match=name):
        rejection_sample(tokens, draft_probs, target_probs, lengths=lengths)


@pytest.mark.parametrize("case", [c for c in _BAD_INPUTS if _BAD_INPUTS[c][1] != "draft_probs"])
def test_greedy_verify_rejects_bad_inputs_with_a_named_argument(case):
    build, name = _BAD_INPUTS[case]
    tokens, _, target, lengths = build(*_valid_args())
    name = "target_logits_or_probs" if name == "target_probs" else name
    with pytest.raises(ValueError, match=name):
        greedy_verify(tokens, target, lengths=lengths)
