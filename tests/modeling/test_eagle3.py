"""Eagle3 (the paper's baseline, Section 4.1): DeepSpec's golden numbers, the TTT unroll, the loss, propose(), checkpoints,
training through the real trainer and decoding.

Oracles: DeepSpec's stored tensors (deepspec/eagle3 of tests/golden, or of $DSPARK_GOLDEN; its README gives the
tolerance), the drafter's own step-by-step inference (the TTT unroll must equal it), a float64
re-derivation of the loss from its definition, and target-only greedy decoding (lossless).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.targets import make_tiny_target
from helpers.training import synthetic_samples, tiny_config

from dspark.config import Config, eagle3_of, load_config, set_values, standard_eagle3_layer_ids
from dspark.data.dataset import RenderedSource
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.training.eagle3_loss import Eagle3LossModule, checkpointed_eagle3_loss, eagle3_loss, supervision_mask
from dspark.modeling import Eagle3Drafter, load_drafter, save_drafter
from dspark.modeling.eagle3 import Eagle3Layer
from dspark.build import build_drafter
from helpers.eagle3 import tiny_eagle3
from helpers.paths import GOLDEN, REPO

ROOT = REPO
EAGLE3 = GOLDEN / "deepspec" / "eagle3"
# tiny models are dispatch-bound: one thread (see conftest.one_thread) is many times faster on a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread")
needs_golden = pytest.mark.skipif(
    not (EAGLE3 / "cases.json").is_file(),
    reason=f"needs the golden fixture {EAGLE3} (tests/golden, or the folder $DSPARK_GOLDEN names)")


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """The golden README's tolerance: max|got - ref| <= 1e-5 * max(1, max|ref|)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got.double() - ref.double()).abs().max().item()
    bound = 1e-5 * max(1.0, ref.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def golden():
    from safetensors.torch import load_file

    from dspark.target import TargetModel

    meta = json.loads((EAGLE3 / "cases.json").read_text())
    cases = load_file(str(EAGLE3 / "cases.safetensors"))
    target = TargetModel.from_pretrained(str(GOLDEN / "deepspec" / "target"), [0, 1, 2, 3, 4])
    return load_drafter(EAGLE3 / "checkpoint", target), target, meta, cases


# ---------------------------------------------------------------------------- golden (DeepSpec)
@needs_golden
def test_deepspec_checkpoint_loads_as_the_deepspec_preset(golden):
    drafter, _, meta, _ = golden
    c = drafter.config
    assert isinstance(drafter, Eagle3Drafter) and c.variant == "eagle3" and c.eagle3_preset == "eagle3_deepspec"
    assert (c.target_layer_ids, c.ttt_length, c.step_loss_decay, c.num_draft_layers) == ([0, 1, 2, 3, 4], 7, 0.8, 1)
    assert drafter.layers[0].self_attn.q_norm is not None and drafter.fc.weight.shape == (64, 320)


@needs_golden
def test_ttt_steps_reproduce_deepspecs_hidden_states_and_logits(golden):
    drafter, _, _, cases = golden
    with torch.no_grad():
        hidden = drafter(cases["train.features"], cases["train.input_ids"])
    valid = cases["train.query_valid"]
    positions = cases["train.logit_positions"]
    for s, h in enumerate(hidden):
        assert_close(h * valid[s].unsqueeze(-1), cases["train.hidden"][s], f"hidden step {s}")
        sup = cases["train.draft_logits_at_supervised"][s]
        logits = drafter.compute_logits(h[:, positions])
        assert_close(logits[sup], cases["train.draft_logits_at"][s][sup], f"logits step {s}")


@needs_golden
def test_parity_loss_equals_deepspecs_total_steps_and_metrics(golden):
    drafter, target, meta, cases = golden
    ref = meta["training"]["loss"]
    assert torch.equal(supervision_mask(cases["train.loss_mask"], 7, parity=True), cases["train.position_mask"])
    with torch.no_grad():
        final = target(cases["train.input_ids"]).last_hidden
        out = eagle3_loss(drafter, drafter(cases["train.features"], cases["train.input_ids"]), final,
                          cases["train.loss_mask"], parity=True)
    assert float(out.loss / out.denominator) == pytest.approx(ref["total"], rel=1e-5)
    assert_close(out.ce_sum / 64, cases["train.step_loss"], "step_loss")
    assert out.count.tolist() == [p["num_supervised"] for p in ref["per_step"]]
    logged = ref["metrics_logged_by_deepspec"]
    for s in range(7):
        assert float(out.accept_sum[s]) == pytest.approx(logged[f"accept_rate@{s}"]["num"], rel=1e-5)
        assert float(out.correct[s]) == logged[f"accuracy@{s}"]["num"]
    tau = logged["tau_probabilistic"]
    assert float(out.prefix_sum) + float(out.chains) == pytest.approx(tau["num"], rel=1e-5)
    assert float(out.chains) == tau["den"]


@needs_golden
def test_greedy_rounds_reproduce_deepspecs_chain(golden):
    drafter, _, _, cases = golden
    ids, feats = cases["infer.context_ids"], cases["infer.features"]
    seen: list[torch.Tensor] = []
    compute = drafter.compute_logits
    drafter.compute_logits = lambda h: (seen.append(h.detach().clone()), compute(h))[1]
    try:
        ctx = drafter.new_context(1)
        for r in range(3):
            a, b = int(cases["infer.context_start"][r]), int(cases["infer.start"][r])
            drafter.extend_context(ctx, feats[:, a:b], input_ids=ids[:, a:b])
            seen.clear()
            prop = drafter.propose(ctx, ids[:, b], temperature=0.0)
            assert prop.tokens[0].tolist() == cases["infer.tokens"][r].tolist(), f"round {r}"
            assert_close(prop.logits[0], cases["infer.draft_logits"][r], f"logits round {r}")
            assert_close(torch.cat(seen), cases["infer.step_hidden"][r], f"step hidden round {r}")
    finally:
        del drafter.compute_logits


@needs_golden
def test_default_convention_reads_the_predicted_tokens_mask_and_is_a_weighted_mean(golden):
    drafter, target, _, cases = golden
    mask = cases["train.loss_mask"]
    parity, ours = supervision_mask(mask, 7, parity=True), supervision_mask(mask, 7)
    # The README's row-0 hole at 14..15: position 10 under DeepSpec reads 10+s (off at s = 4, 5);
    # ours reads the predicted token 12+s (off at s = 2, 3).
    assert parity[:, 0, 10].tolist() == [True, True, True, True, False, False, True]
    assert ours[:, 0, 10].tolist() == [True, True, False, False, True, True, True]
    with torch.no_grad():
        final = target(cases["train.input_ids"]).last_hidden
        hidden = drafter(cases["train.features"], cases["train.input_ids"])
        out = eagle3_loss(drafter, hidden, final, mask)
    w = 0.8 ** torch.arange(7.0)
    assert out.count.tolist() == ours.sum((1, 2)).float().tolist()
    assert float(out.denominator) == pytest.approx(float((w * out.count).sum()))


# ------------------------------------------------------------------------------- float64 loss
def reference_loss(drafter, hidden, final, loss_mask, parity: bool) -> float:
    """The TTT loss from its definition, entry by entry, in float64."""
    W = drafter.shared_weights()["lm_head.weight"].double()
    nw, eps = drafter.norm.weight.double(), drafter.norm.eps
    B, S = loss_mask.shape
    total, denom = 0.0, 0.0
    for s, h in enumerate(hidden):
        for b in range(B):
            last = int(loss_mask[b].nonzero().max()) if parity else None
            for i in range(S):
                if parity:
                    on = i + s < S and loss_mask[b, i + s] == 1 and i + s != last
                else:
                    on = i + s + 2 < S and loss_mask[b, i + s + 2] == 1
                if not on:
                    continue
                x = h[b, i].double()
                z = (x / torch.sqrt(x.pow(2).mean() + eps) * nw) @ W.T
                p = torch.softmax(final[b, i + s + 1].double() @ W.T, -1)
                total += 0.8**s * float(-(p * torch.log_softmax(z, -1)).sum().detach())
                denom += 0.8**s
    return total / (B * S if parity else denom)


@pytest.mark.parametrize("parity", [False, True])
def test_loss_equals_a_float64_reference(parity):
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, target.vocab_size, (2, 14), generator=g)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :3], mask[0, 7:9], mask[1, :5], mask[1, 12:] = 0, 0, 0, 0
    with torch.no_grad():
        out_t = target(ids)
        hidden = drafter(out_t.features, ids)
        out = eagle3_loss(drafter, hidden, out_t.last_hidden, mask, parity=parity, chunk_rows=5,
                          lengths=torch.tensor([14, 12]) if parity else None)
    got = float(out.loss / out.denominator)
    assert got == pytest.approx(reference_loss(drafter, hidden, out_t.last_hidden, mask, parity), rel=1e-5)


def test_parity_averages_per_sequence_means_across_micro_batches_as_deepspec():
    """DeepSpec's normalisation: each sequence's Σ_s 0.8^s Σ CE over its length, then the mean over the
    sequences of the global batch, whatever the micro-batches; summed the trainer's way (Σ loss / Σ weight)."""
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    module = Eagle3LossModule(drafter, target, parity=True)
    g = torch.Generator().manual_seed(4)
    per_sequence, sums, loss_sum, weight = [], [], 0.0, 0.0
    for S, hole in ((8, slice(0, 2)), (16, slice(5, 9))):
        ids = torch.randint(2, target.vocab_size, (1, S), generator=g)
        mask = torch.ones_like(ids)
        mask[0, hole] = 0
        with torch.no_grad():
            loss, metrics = module({"input_ids": ids, "loss_mask": mask})
            out_t = target(ids)
            hidden = drafter(out_t.features, ids)
        per_sequence.append(reference_loss(drafter, hidden, out_t.last_hidden, mask, parity=True))  # Σ / S
        sums.append(per_sequence[-1] * S)
        loss_sum, weight = loss_sum + float(loss), weight + float(metrics["weight"])
        assert float(metrics["ce"]) == float(loss)
    assert weight == 2.0  # one per sequence
    assert loss_sum / weight == pytest.approx((per_sequence[0] + per_sequence[1]) / 2, rel=1e-5)
    assert abs(loss_sum / weight - sum(sums) / 24) > 1e-3  # not the token-weighted mean


@pytest.mark.parametrize("family,vocab_k", [("qwen3", 0), ("qwen3", 40), ("gemma4", 40)],
                         ids=["qwen3", "qwen3-draft-vocab", "gemma4-softcap-draft-vocab"])
def test_loss_gradients_equal_autograd_through_a_float64_reference(family, vocab_k):
    """The closed-form gradients of the TTT loss (computed in its forward pass) against autograd through
    the loss written from its definition, in float64: w.r.t. every step's hidden states and the norm."""
    from dspark.modeling.vocab import DraftVocab

    target = make_tiny_target(family)
    V = target.vocab_size
    drafter = tiny_eagle3(target, "eagle3", **({"draft_vocab_size": vocab_k} if vocab_k else {}))
    if vocab_k:
        drafter.set_vocab(DraftVocab.from_target_ids(list(range(0, 2 * vocab_k, 2)), V))
    drafter = drafter.double()
    shared = drafter._shared
    drafter.attach_shared(shared["embed_tokens.weight"].double(), shared["lm_head.weight"].double())
    g = torch.Generator().manual_seed(3)
    B, S, d, T = 2, 11, target.hidden_size, 4
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2], mask[1, 8:] = 0, 0
    final = torch.randn(B, S, d, generator=g, dtype=torch.float64)
    hidden = [torch.randn(B, S, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(T)]
    out = eagle3_loss(drafter, hidden, final, mask, chunk_rows=7)  # several chunks of teacher positions
    grads = torch.autograd.grad(out.loss, [*hidden, drafter.norm.weight])

    W = drafter.target_lm_head_weight()
    ids = drafter.vocab.draft_ids if vocab_k else torch.arange(V)
    cap = drafter.config.final_logit_softcapping

    def softcap(x):
        return torch.tanh(x / cap) * cap if cap else x

    sup = supervision_mask(mask, T)
    total = torch.zeros((), dtype=torch.float64)
    for s, h in enumerate(hidden):
        b, i = sup[s].nonzero(as_tuple=True)
        p_full = torch.softmax(softcap(final[b, i + s + 1] @ W.T), -1)
        p_t = p_full[:, ids] / p_full[:, ids].sum(-1, keepdim=True)
        keep = torch.isin(p_full.argmax(-1), ids)
        logp = torch.log_softmax(softcap(drafter.norm(h[b, i]) @ W[ids].T), -1)
        total = total + 0.8**s * (-(p_t * logp).sum(-1) * keep).sum()
    ref_grads = torch.autograd.grad(total, [*hidden, drafter.norm.weight])
    assert float(out.loss.detach()) == pytest.approx(float(total.detach()), rel=1e-12)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    # the autograd path (fp32 logits, checkpointed chunks) is the same function with the same metrics
    general = checkpointed_eagle3_loss(drafter, hidden, final, mask, chunk_rows=7)
    general_grads = torch.autograd.grad(general.loss, [*hidden, drafter.norm.weight])
    for name in ("loss", "ce_sum", "count", "accept_sum", "correct", "prefix_sum", "chains"):
        torch.testing.assert_close(getattr(out, name).detach().float(), getattr(general, name).detach().float(),
                                   rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(grads, general_grads):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------- TTT unroll = inference
@pytest.mark.parametrize("family,preset", [("qwen3", "eagle3_deepspec"), ("llama", "eagle3"), ("gemma4", "eagle3")])
def test_ttt_step_k_equals_k_autoregressive_draft_forwards(family, preset):
    target = make_tiny_target(family)
    drafter = tiny_eagle3(target, preset)
    S, T = 16, drafter.config.ttt_length
    ids = torch.randint(2, target.vocab_size, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = target(ids).features
        hidden = drafter(feats, ids)
        drafter.config.block_size = T
        for i in (0, 3, S - T - 2):
            ctx = drafter.new_context(1)
            drafter.extend_context(ctx, feats[:, : i + 1], input_ids=ids[:, : i + 1])
            # draft k's token is the input of forward k + 1: teacher-force the sequence's tokens
            forced = lambda k, row: (torch.softmax(row, -1), ids[:, i + 2 + k])  # noqa: E731
            prop = drafter.draft_chain(ctx, ids[:, i + 1], forced)
            for k in range(T):
                ref = drafter.compute_logits(hidden[k][:, i])
                assert torch.allclose(prop.logits[:, k], ref, atol=2e-5, rtol=1e-5), f"position {i}, step {k}"


def test_batched_rows_of_different_lengths_draft_as_alone():
    target = make_tiny_target("llama")
    drafter = tiny_eagle3(target, "eagle3")
    ids = torch.randint(2, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = target(ids).features
        ctx = drafter.new_context(2, capacity=2)
        drafter.extend_context(ctx, feats[:, :5], num_valid=torch.tensor([5, 3]), input_ids=ids[:, :5])
        both = drafter.propose(ctx, torch.stack([ids[0, 5], ids[1, 3]]), temperature=0.0)
        for b, n in ((0, 5), (1, 3)):
            alone = drafter.propose_from_features(feats[b : b + 1, :n], ids[b : b + 1, n], input_ids=ids[b : b + 1, :n],
                                                  temperature=0.0)
            assert both.tokens[b].tolist() == alone.tokens[0].tolist()
            assert torch.allclose(both.logits[b], alone.logits[0], atol=2e-5)


# --------------------------------------------------------------------------------- propose()
def test_propose_costs_gamma_sequential_forwards(monkeypatch):
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    calls = []
    finish = Eagle3Layer.finish
    monkeypatch.setattr(Eagle3Layer, "finish", lambda self, h, o: (calls.append(h.shape[1]), finish(self, h, o))[1])
    ids = torch.randint(2, target.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        feats = target(ids).features
        ctx = drafter.new_context(1)
        drafter.extend_context(ctx, feats[:, :10], input_ids=ids[:, :10])
        drafter.propose(ctx, ids[:, 10])
        assert len(calls) == drafter.config.block_size == 4
        assert calls[1:] == [1, 1, 1]  # forwards 2..γ: one row each
        calls.clear()
        drafter.extend_context(ctx, feats[:, 10:13], input_ids=ids[:, 10:13])
        drafter.propose(ctx, ids[:, 13])
        assert len(calls) == 4 and calls[0] == 4  # the new rows 10..12 and the re-opened last row 9


def test_propose_returns_the_fp32_distributions_its_tokens_were_sampled_from():
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    ids = torch.randint(2, target.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = target(ids).features
        prop = drafter.propose_from_features(feats[:, :8], ids[:, 8], input_ids=ids[:, :8], temperature=0.7,
                                             generator=torch.Generator().manual_seed(0))
    assert prop.probs.dtype == torch.float32 and prop.probs.shape == (3, 4, target.vocab_size)
    assert torch.allclose(prop.probs, torch.softmax(prop.logits / 0.7, -1), atol=1e-6)
    assert bool((prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all()) and prop.confidences is None


def test_greedy_speculative_decoding_with_eagle3_equals_the_target_alone():
    target = make_tiny_target("llama")
    drafter = tiny_eagle3(target, "eagle3")
    prompt = torch.randint(2, target.vocab_size, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    spec = speculative_generate(target, drafter, prompt, max_new_tokens=24, temperature=0.0)
    alone = target_generate(target, prompt, max_new_tokens=24, temperature=0.0)
    assert spec.tokens == alone.tokens and len(spec.rounds) >= 2


def test_a_context_without_tokens_is_refused_by_name():
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    ctx = drafter.new_context(1)
    drafter.extend_context(ctx, target(torch.tensor([[3, 4, 5]])).features)
    with pytest.raises(ValueError, match="input_ids"):
        drafter.propose(ctx, torch.tensor([6]))


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("preset", ["eagle3_deepspec", "eagle3"])
def test_checkpoint_round_trip_keeps_config_weights_and_proposals(tmp_path, preset):
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target, preset)
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3Eagle3Model"] and raw["ttt_length"] == 7 and raw["eagle3_preset"] == preset
    loaded = load_drafter(tmp_path / "d", target)
    assert isinstance(loaded, Eagle3Drafter)
    assert loaded.config.to_hf_dict() == json.loads(json.dumps(drafter.config.to_hf_dict()))
    assert (loaded.layers[0].self_attn.q_norm is None) == (preset == "eagle3")
    for name, t in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = torch.randint(2, target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        feats = target(ids).features
        a, b = (d.propose_from_features(feats[:, :7], ids[:, 7], input_ids=ids[:, :7], temperature=0.0)
                for d in (drafter, loaded))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)


# ------------------------------------------------------------------------------ config, training
def test_eagle3_of_gives_the_reference_recipe_and_standard_layer_ids():
    dspark = load_config(ROOT / "config" / "dspark" / "dspark_qwen3_4b.py")
    deepspec = eagle3_of(dspark, "eagle3_deepspec")
    d = deepspec.drafter
    assert (d.variant, d.num_draft_layers, d.ttt_length, d.step_loss_decay) == ("eagle3", 1, 7, 0.8)
    assert d.target_layer_ids == [1, 9, 17, 25, 33] and deepspec.loss.ce_weight == 1.0 and deepspec.loss.tv_weight == 0
    assert eagle3_of(set_values(dspark, {"drafter.block_size": 4}), "eagle3_deepspec").drafter.ttt_length == 4  # = γ
    assert eagle3_of(dspark, "eagle3", num_target_layers=36).drafter.target_layer_ids == [1, 17, 32]
    assert standard_eagle3_layer_ids(30) == [1, 14, 26]
    with pytest.raises(ValueError, match="num_target_layers"):
        eagle3_of(dspark, "eagle3")
    smol = load_config(ROOT / "config" / "eagle3" / "eagle3_smollm2_135m.py")
    assert smol.drafter.eagle3_preset == "eagle3" and smol.drafter.target_layer_ids == [1, 14, 26]
    assert smol.drafter.draft_vocab_size == 8192  # the standard preset's reduced vocabulary
    assert smol.drafter.ttt_length == smol.drafter.block_size == 4  # it trains the steps it drafts
    for name in ("qwen3_4b", "qwen3_8b", "qwen3_14b", "gemma4_12b"):
        c = load_config(ROOT / "config" / "eagle3" / f"eagle3_{name}.py")
        assert c.drafter.variant == "eagle3" and c.drafter.eagle3_preset == "eagle3_deepspec"
    with pytest.raises(ValueError, match="drafter.eagle3_preset"):
        set_values(Config(), {"drafter.eagle3_preset": "medusa"})


def _eagle3_trainer(target, out_dir, samples, **train):
    from dspark.training.trainer import Trainer

    config = eagle3_of(tiny_config(target, str(out_dir), **train), "eagle3_deepspec")
    # drafts 3, trains a training-time test of 7 steps: the two lengths are independent
    config = dataclasses.replace(config, drafter=dataclasses.replace(config.drafter, block_size=3, ttt_length=7))
    drafter = build_drafter(config, target)
    return Trainer(config, target, drafter, RenderedSource(samples), progress=False)


def test_a_tiny_eagle3_trains_through_the_trainer_and_its_checkpoint_loads(tmp_path):
    target = make_tiny_target("qwen3")
    samples = synthetic_samples(target.vocab_size, n=4, seed=3)
    trainer = _eagle3_trainer(target, tmp_path / "run", samples, max_steps=12, lr=1e-2, save_every=100)
    assert isinstance(trainer.drafter, Eagle3Drafter) and isinstance(trainer.module, Eagle3LossModule)
    trainer.fit()
    first, last = trainer.history[0], trainer.history[-1]
    assert last["loss"] < 0.95 * first["loss"] and len(last["accept"]) == 7
    loaded = load_drafter(tmp_path / "run" / "drafter", target)
    assert isinstance(loaded, Eagle3Drafter)
    for name, t in trainer.drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t)


def test_cached_features_give_the_online_loss():
    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    module = Eagle3LossModule(drafter, target)
    ids = torch.randint(2, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(8))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    with torch.no_grad():
        out = target(ids)
        online, m1 = module(batch)
        cached, m2 = module({**batch, "features": out.features, "final_hidden": out.last_hidden})
    assert float(online) == pytest.approx(float(cached), rel=1e-6)
    assert torch.equal(m1["count"], m2["count"])


def test_eval_runs_an_eagle3_drafter_on_a_tiny_target(tmp_path, monkeypatch):
    import dspark.evaluation.evaluate as ev
    from dspark.evaluation.evaluate import DecodeSettings, evaluate

    monkeypatch.setattr(ev, "WARMUP_TOKENS", 0)

    target = make_tiny_target("llama")

    class CharTokenizer:
        eos_token_id = 0
        chat_template = "char"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, enable_thinking=True):
            return "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + "<a>"

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 120 + 2 for c in text]}

    target.tokenizer = CharTokenizer()
    drafter = tiny_eagle3(target, "eagle3")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k.jsonl").write_text(json.dumps({"turns": ["two plus two"]}) + "\n")
    report = evaluate(target, drafter, tmp_path / "data", names=["gsm8k"],
                      decoding=DecodeSettings(max_new_tokens=12, temperature=0.0), out_dir=tmp_path / "out",
                      progress=False)
    text = json.dumps(report)
    assert "Eagle3" in text and (tmp_path / "out" / "report.json").is_file()


def test_dspark_propose_shows_eagle3_blocks_along_a_sequence():
    from dspark.evaluation.proposals import proposals_along

    target = make_tiny_target("qwen3")
    drafter = tiny_eagle3(target)
    seq = torch.randint(2, target.vocab_size, (14,), generator=torch.Generator().manual_seed(9)).tolist()
    views = proposals_along(target, drafter, seq, [5, 9])
    with torch.no_grad():
        feats = target(torch.tensor([seq])).features
        ref = drafter.propose_from_features(feats[:, :5], torch.tensor([seq[5]]), input_ids=torch.tensor([seq[:5]]),
                                            temperature=0.0)
    assert views[0].draft_tokens == ref.tokens[0].tolist() and len(views[1].draft_tokens) == 4
