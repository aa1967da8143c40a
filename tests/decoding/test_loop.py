"""The speculative decoding loop (paper Section 2.1): exactness at T = 0, losslessness at T > 0,
the cache/context bookkeeping, and the verification-length hook.

Oracles: greedy target-only decoding (`target_generate` at T = 0), the target's exact
joint distribution of the first tokens (enumerated from its logits on a tiny
vocabulary), and an "oracle drafter" that drafts from the target's own conditional
distributions, so that every draft must be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from helpers.targets import make_tiny_target
from dspark.scheduling.calibration_metrics import prefix_labels
from dspark.kernels import cpu_linear
from dspark.build import prepare_for_decoding
from dspark.decoding.loop import DecodeResult, RoundRecord, speculative_generate, target_generate
from dspark.evaluation.metrics import summarize_rounds
from dspark.modeling import Proposal
from dspark.sampling import logits_to_probs
from helpers.decoding import chi_square_pvalue, exact_joint, random_drafter
from helpers.paths import REPO

PROMPTS = ([3, 17, 42, 5, 99], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])
SMOLLM2_CONFIG = REPO / "config" / "dspark" / "dspark_smollm2_135m.py"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@dataclass
class OracleContext:
    tokens: list[int] = field(default_factory=list)  # the ids of context positions 0..len-1
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))


class OracleDrafter:
    """A test double of the Drafter protocol whose drafts come from the target itself.

    propose() runs the target on context + anchor + drafts so far and samples x_k from
    softmax(logits / T) (mixed with the uniform distribution at `mistake_rate`, and the
    returned probabilities are that mixture); at T = 0 it takes the argmax, replaced by a
    wrong token with probability `mistake_rate`. The ids of context positions are
    inferred from the protocol: the first extend holds the prompt, each later one the
    last anchor and the accepted prefix of the last drafts.
    """

    def __init__(self, target, prompt_ids: list[int], gamma: int, mistake_rate: float = 0.0) -> None:
        self.target, self.prompt, self.gamma, self.mistake_rate = target, list(prompt_ids), gamma, mistake_rate
        self.last_block: list[int] = []

    def new_context(self, batch_size: int, device=None, capacity: int = 256) -> OracleContext:
        assert batch_size == 1
        return OracleContext()

    def extend_context(self, ctx: OracleContext, features: torch.Tensor, num_valid=None) -> None:
        n = features.shape[1]
        ctx.tokens += self.prompt[:n] if not ctx.tokens else self.last_block[:n]
        ctx.lengths = ctx.lengths + n

    def propose(self, ctx: OracleContext, anchor_tokens: torch.Tensor, *, temperature=1.0, generator=None):
        V = self.target.vocab_size
        seq = ctx.tokens + [int(anchor_tokens[0])]
        tokens, probs, logits_out = [], [], []
        for _ in range(self.gamma):
            logits = self.target(torch.tensor([seq])).logits[:, -1].float()  # [1, V]
            if temperature > 0:
                p = (1 - self.mistake_rate) * logits_to_probs(logits, temperature) + self.mistake_rate / V
                token = int(torch.multinomial(p, 1, generator=generator))
            else:
                p = torch.softmax(logits, dim=-1)
                token = int(logits.argmax())
                if float(torch.rand((), generator=generator)) < self.mistake_rate:
                    token = (token + 1) % V
            seq.append(token)
            tokens.append(token)
            probs.append(p)
            logits_out.append(logits)
        self.last_block = seq[len(ctx.tokens) :]  # [x_0, x_1..x_γ]
        return Proposal(
            tokens=torch.tensor([tokens]),
            probs=torch.stack(probs, 1),
            logits=torch.stack(logits_out, 1),
            confidences=None,
        )


class Spy:
    """Delegates to a target or drafter and records what the loop hands it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.forwards: list[tuple[int, int]] = []  # target: (cached length before, tokens fed)
        self.proposals_at: list[int] = []  # drafter: context length at each propose
        self.extended: list[torch.Tensor] = []  # drafter: the features of each extend

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, input_ids, **kwargs):
        self.forwards.append((kwargs["past_key_values"].get_seq_length(), input_ids.shape[1]))
        return self.inner(input_ids, **kwargs)

    def propose(self, ctx, anchor_tokens, **kwargs):
        self.proposals_at.append(int(ctx.lengths[0]))
        return self.inner.propose(ctx, anchor_tokens, **kwargs)

    def extend_context(self, ctx, features, num_valid=None):
        self.extended.append(features.clone())
        return self.inner.extend_context(ctx, features, num_valid)


# --------------------------------------------------------------------------- helpers
def greedy(target, prompt, n: int, eos=()) -> DecodeResult:
    return target_generate(target, prompt, max_new_tokens=n, temperature=0.0, eos_token_ids=eos)


# --------------------------------------------------------------------------- T = 0
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_speculative_decoding_reproduces_greedy_target_decoding(family):
    target = make_tiny_target(family)
    drafter = random_drafter(target)
    for prompt in PROMPTS:
        expected = greedy(target, prompt, 40).tokens
        for d in (drafter, OracleDrafter(target, prompt, gamma=4, mistake_rate=0.3)):
            gen = torch.Generator().manual_seed(0)  # the oracle's mistakes
            out = speculative_generate(target, d, prompt, max_new_tokens=40, temperature=0.0, generator=gen)
            assert out.tokens == expected
            assert not out.finished_by_eos


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_speculative_decoding_stops_at_the_first_eos_like_the_target(family):
    target = make_tiny_target(family)
    prompt = PROMPTS[0]
    free_run = greedy(target, prompt, 40).tokens
    # EOS = the first token (no round at all), an early and a late token of the free run.
    for eos in (free_run[0], free_run[6], free_run[25]):
        expected = greedy(target, prompt, 40, eos=(eos,))
        assert expected.finished_by_eos and expected.tokens[-1] == eos
        for d in (random_drafter(target), OracleDrafter(target, prompt, gamma=4, mistake_rate=0.3)):
            gen = torch.Generator().manual_seed(0)
            out = speculative_generate(
                target, d, prompt, max_new_tokens=40, temperature=0.0, eos_token_ids=(eos, 10**6), generator=gen
            )
            assert out.tokens == expected.tokens
            assert out.finished_by_eos


def test_an_accepted_eos_ends_the_round_without_a_bonus():
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    free_run = greedy(target, prompt, 40).tokens
    eos = free_run[3]
    at = free_run.index(eos)  # x_0 = free_run[0] comes from the prefill; draft k is free_run[k]
    assert at >= 1
    out = speculative_generate(
        target, OracleDrafter(target, prompt, gamma=6), prompt, max_new_tokens=40, temperature=0.0, eos_token_ids=(eos,)
    )
    assert out.tokens == free_run[: at + 1] and out.finished_by_eos
    # One round: drafts x_1..x_6 all match the target; the EOS at draft `at` ends the sequence.
    # It is accepted (m = at), nothing follows it (τ = m: the round emitted x_1..x_at), and the
    # drafts after it were never verified, so the round's ℓ stops at the EOS (paper Section 2.1).
    assert out.rounds == [RoundRecord(proposed=at, accepted=at, confidences=None, eos_accepted=True)]
    assert out.rounds[0].tau == at == len(out.tokens) - 1


def test_an_accepted_eos_records_no_rejection_after_it():
    """The round's log line gives τ = accepted and no position past the EOS counts as verified,
    so conditional acceptance and the STS labels see no rejection there."""
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    free_run = greedy(target, prompt, 40).tokens
    eos = free_run[4]
    at = free_run.index(eos)
    assert 2 <= at < 6  # a rejection after the EOS would show at positions at+1..6
    out = speculative_generate(
        target, OracleDrafter(target, prompt, gamma=6), prompt, max_new_tokens=40, temperature=0.0, eos_token_ids=(eos,)
    )
    (record,) = out.rounds
    row = {"request": 0, "proposed": record.proposed, "accepted": record.accepted,
           "eos_accepted": record.eos_accepted, "confidences": [0.5] * 6}
    summary = summarize_rounds([row], gamma=6)
    assert summary["tau"] == summary["tau_per_request"] == at
    assert summary["conditional_acceptance_num"] == [1] * at + [0] * (6 - at)
    assert summary["conditional_acceptance_den"] == [1] * at + [0] * (6 - at)  # positions after the EOS: not reached
    label, valid = prefix_labels([record.accepted], [record.proposed], 6)
    assert valid[0].tolist() == [True] * at + [False] * (6 - at)
    assert label[0][valid[0]].tolist() == [1.0] * at


@pytest.mark.slow
def test_greedy_speculative_decoding_reproduces_smollm2(smollm2_target):
    from dspark.build import build_drafter
    from dspark.config import load_config

    target = smollm2_target
    config = load_config(SMOLLM2_CONFIG, [f"drafter.target_layer_ids={list(target.target_layer_ids)}"])
    drafter = build_drafter(config, target)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    prompt = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    eos = (target.tokenizer.eos_token_id,)
    expected = target_generate(target, prompt, max_new_tokens=32, temperature=0.0, eos_token_ids=eos)
    out = speculative_generate(target, drafter, prompt, max_new_tokens=32, temperature=0.0, eos_token_ids=eos)
    assert out.tokens == expected.tokens
    assert all(r.proposed == drafter.config.block_size and len(r.confidences) == r.proposed for r in out.rounds)


# --------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_drafter_with_the_targets_own_distribution_is_always_fully_accepted(temperature):
    target = make_tiny_target("qwen3")
    gamma, n = 4, 27  # 1 + 5 rounds of γ+1 = 26 tokens, then a truncated round
    prompt = PROMPTS[0]
    out = speculative_generate(
        target,
        OracleDrafter(target, prompt, gamma),
        prompt,
        max_new_tokens=n,
        temperature=temperature,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(out.tokens) == n
    assert [r.accepted + 1 for r in out.rounds] == [gamma + 1] * 6
    if temperature == 0:
        assert out.tokens == greedy(target, prompt, n).tokens


# --------------------------------------------------------------------------- T > 0
@pytest.mark.parametrize(
    "temperature,dtype,packed",
    [(1.0, torch.float32, False), (0.7, torch.float32, False), (1.0, torch.bfloat16, False),
     (1.0, torch.float32, True)],
    ids=["T1", "T0.7", "T1-bf16", "T1-onednn"],
)
def test_output_distribution_is_the_targets_own(temperature, dtype, packed):
    """The first three tokens against their exact joint distribution under target-only
    sampling. With γ = 1, x_0 comes from the prefill, x_1 is an accepted draft or a
    correction, and x_2 is the bonus of the first round or comes from a second round
    (after the cache crop and context extend). In bf16 (what `--dtype auto` decodes in on a
    GPU) the target and drafter run in bf16 and the probabilities stay fp32. ``packed``: the
    target's and drafter's few-row products on oneDNN-packed weights (target.cpu_linear)."""
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter = random_drafter(target, gamma=1, seed=2)
    with torch.no_grad():  # flatter drafts: about 60 % accepted, so both branches are sampled often
        drafter.norm.weight.mul_(0.3)
    if dtype != torch.float32:
        target.model.to(dtype)
        drafter = drafter.to(dtype).attach_target(target)
    if packed:
        if not cpu_linear.available():
            pytest.skip("this torch build has no oneDNN")
        cpu_linear.pack_linears(target.model)
        drafter = prepare_for_decoding(target, drafter)
    prompt, V, samples = [1, 3, 2, 0], target.vocab_size, 1000
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V, V, V)
    rounds = accepted = 0
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, max_new_tokens=3, temperature=temperature, generator=gen)
        counts[tuple(out.tokens)] += 1
        rounds += len(out.rounds)
        accepted += sum(r.accepted for r in out.rounds)
    assert 0.2 < accepted / rounds < 0.8
    exact = exact_joint(target, prompt, 3, temperature)  # [V, V, V]
    # (x_0, x_1) on its own too: fewer cells, so more power against a wrong acceptance rule.
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


# --------------------------------------------------------------------------- bookkeeping
def test_cache_and_context_hold_exactly_the_accepted_sequence_every_round():
    """Invariant: at the start of round r (n_r tokens generated), the target cache and the
    drafter context hold P + n_r − 1 positions, and the context features are the target's
    own features of prompt + tokens (no stale rejected positions)."""
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    P = len(prompt)
    spy_target = Spy(target)
    spy_drafter = Spy(OracleDrafter(target, prompt, gamma=4, mistake_rate=0.4))
    out = speculative_generate(
        spy_target, spy_drafter, prompt, max_new_tokens=40, temperature=1.0, generator=torch.Generator().manual_seed(3)
    )
    assert len(out.tokens) == 40
    assert len({r.accepted for r in out.rounds}) >= 3  # several acceptance lengths
    generated = 1  # x_0 from the prefill
    assert spy_target.forwards[0] == (0, P)
    for r, record in enumerate(out.rounds):
        assert spy_drafter.proposals_at[r] == P + generated - 1
        assert spy_target.forwards[r + 1] == (P + generated - 1, record.proposed + 1)
        generated += record.accepted + 1
    context = torch.cat(spy_drafter.extended, dim=1)  # [1, P + n_last − 1, m·d]
    sequence = torch.tensor([prompt + out.tokens])[:, : context.shape[1]]
    assert context.shape[1] == spy_drafter.proposals_at[-1]
    torch.testing.assert_close(context, target(sequence).features, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- ℓ < γ
def test_verification_length_hook_sets_the_verified_prefix_including_zero():
    target = make_tiny_target("llama")
    prompt = PROMPTS[2]
    gamma, plan = 4, [0, 2, 4, 1, 0, 3]
    seen = []

    def choose_length(confidences, round_index):
        seen.append((confidences, round_index))
        return plan[round_index % len(plan)]

    drafter = OracleDrafter(target, prompt, gamma)
    out = speculative_generate(
        target, drafter, prompt, max_new_tokens=30, temperature=0.0, choose_length=choose_length
    )
    assert out.tokens == greedy(target, prompt, 30).tokens
    assert [r.proposed for r in out.rounds] == [plan[i % len(plan)] for i in range(len(out.rounds))]
    assert [r.accepted for r in out.rounds[:-1]] == [r.proposed for r in out.rounds[:-1]]  # ℓ = 0: just the bonus
    assert [i for _, i in seen] == list(range(len(out.rounds)))


def test_verifying_no_draft_emits_one_target_token_per_round():
    target = make_tiny_target("llama")
    gamma, seen = 4, []

    def verify_nothing(confidences, round_index):
        seen.append(confidences)
        return 0

    drafter = random_drafter(target, gamma=gamma)  # has a confidence head: the hook sees c_1..c_γ
    out = speculative_generate(
        target, drafter, PROMPTS[0], max_new_tokens=12, temperature=1.0, choose_length=verify_nothing
    )
    assert len(out.tokens) == 12 and len(out.rounds) == 11
    assert all(r.proposed == 0 and r.accepted == 0 for r in out.rounds)
    assert all(len(c) == gamma and all(0 < x < 1 for x in c) for c in seen)


def test_a_verification_length_outside_the_block_is_rejected():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    with pytest.raises(ValueError, match="choose_length"):
        speculative_generate(target, drafter, [1, 2], max_new_tokens=5, temperature=0.0, choose_length=lambda c, i: 5)


def test_max_new_tokens_is_respected_exactly():
    target = make_tiny_target("llama")
    prompt = PROMPTS[0]
    for n in (0, 1, 2, 7, 8):
        drafter = OracleDrafter(target, prompt, gamma=4)
        out = speculative_generate(target, drafter, prompt, max_new_tokens=n, temperature=0.0)
        assert out.tokens == greedy(target, prompt, n).tokens and len(out.tokens) == n
