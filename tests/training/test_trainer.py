"""The trainer: exact resume, split-invariant gradients, torchrun (gloo) == one process."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.targets import make_tiny_target
from helpers.training import fit_killed_after, run_torchrun, synthetic_samples, tiny_trainer

from dspark.training.checkpoints import latest_checkpoint
from dspark.training.schedule import lr_lambda, make_adamw
from dspark.training.loss import LossWeights, reduce_terms
from dspark.training.step import ratio_metrics, tau_from_acceptance_rates
from helpers.paths import REPO


def _params(trainer):
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_resume_reproduces_uninterrupted_run(tiny_qwen3, tmp_path):
    full = tiny_trainer(tiny_qwen3, str(tmp_path / "full"))
    full.fit()
    # A job killed after step 3: the last checkpoint is step 2, work of step 3 is lost.
    killed = tiny_trainer(tiny_qwen3, str(tmp_path / "killed"))
    fit_killed_after(killed, 3)
    assert latest_checkpoint(tmp_path / "killed").name == "step-0000002"
    resumed = tiny_trainer(tiny_qwen3, str(tmp_path / "killed"))
    resumed.fit(resume=True)
    assert resumed.step == full.step == 6
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (tmp_path / "full" / "drafter" / "model.safetensors").is_file()


def test_the_resume_comparison_sees_a_run_that_differs(tiny_qwen3, tmp_path):
    """Power check for the resume test: its parameter comparison tells apart two runs that differ
    (here in the learning rate) after the same steps."""
    a = tiny_trainer(tiny_qwen3, str(tmp_path / "a"))
    fit_killed_after(a, 2)
    b = tiny_trainer(tiny_qwen3, str(tmp_path / "b"), lr=2e-3)
    fit_killed_after(b, 2)
    assert any(not torch.equal(x, y) for x, y in zip(_params(a).values(), _params(b).values()))


def test_micro_batch_split_does_not_change_the_gradient(tiny_qwen3, tmp_path):
    """Gradient = gradient of the weighted mean over the global batch, however it is split
    (compared before the optimizer: Adam's first step amplifies rounding in near-zero entries).
    Bucketing off: bucketed groups follow the micro-batch size, so the global batch would differ."""
    grads = []
    for micro in (1, 2, 4):
        t = tiny_trainer(tiny_qwen3, str(tmp_path / f"m{micro}"), micro_batch_size=micro, max_steps=1, grad_clip=1e9,
                         bucketing=False)
        t.train_step()
        grads.append({n: p.grad.clone() for n, p in t.drafter.named_parameters() if p.requires_grad})
    for other in grads[1:]:
        for k in grads[0]:
            torch.testing.assert_close(grads[0][k], other[k], rtol=1e-4, atol=1e-7)


def test_gradient_is_the_weighted_mean_over_the_global_batch(tiny_qwen3, tmp_path):
    """The step's gradient equals autograd of (Σ micro-batch sums) / (Σ weights), computed directly."""
    t = tiny_trainer(tiny_qwen3, str(tmp_path / "ref"), micro_batch_size=2, max_steps=1, grad_clip=1e9)
    total, weight = 0.0, 0.0
    for batch, anchors, keep in t._micro_batches(0):
        loss, metrics = t.module(batch, anchors, keep)
        total = total + loss
        weight += float(metrics["weight"])
    ref = torch.autograd.grad(total / weight, [p for p in t.drafter.parameters() if p.requires_grad])
    t.train_step()
    got = [p.grad for p in t.drafter.parameters() if p.requires_grad]
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-8)


def test_logged_metrics_are_consistent(tiny_qwen3, tmp_path):
    t = tiny_trainer(tiny_qwen3, str(tmp_path / "log"), max_steps=2)
    t.fit()
    rec = t.history[-1]
    assert len(rec["accept"]) == 3 and all(0 <= a <= 1 for a in rec["accept"])
    assert rec["tau_prob_pooled"] == pytest.approx(tau_from_acceptance_rates(torch.tensor(rec["accept"])), abs=1e-3)
    assert 1.0 <= rec["tau_prob"] <= 1.0 + 3
    assert rec["loss"] == pytest.approx(0.1 * rec["ce"] + 0.9 * rec["tv"] + 1.0 * rec["conf"], rel=1e-6)
    lines = (tmp_path / "log" / "train_log.jsonl").read_text().strip().splitlines()
    assert len(lines) == 2


def test_tau_from_acceptance_rates_by_hand():
    acc = torch.tensor([0.8, 0.5, 0.25])
    assert tau_from_acceptance_rates(acc) == pytest.approx(1 + 0.8 + 0.4 + 0.1)


def test_tau_prob_is_deepspecs_mean_over_blocks_of_one_plus_the_masked_cumprod():
    """Three blocks, γ = 3: c* = (0.8, 0.5, 0.5) all supervised -> 1 + 0.8 + 0.4 + 0.2 = 2.4;
    c* = (0.5, 0.9, 0.9) with the last slot unsupervised -> 1 + 0.5 + 0.45 = 1.95; a dropped
    block (no supervised slot) does not count. τ_prob = (2.4 + 1.95) / 2 = 2.175. The pooled
    rates (0.65, 0.7, 0.5) give 1 + 0.65 + 0.455 + 0.2275 = 2.3325 instead."""
    c_star = torch.tensor([[0.8, 0.5, 0.5], [0.5, 0.9, 0.9], [0.3, 0.3, 0.3]])
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    zeros = torch.zeros(3, 3)
    out = reduce_terms(zeros, zeros, c_star, None, valid, LossWeights(), None)
    assert float(out.prefix_sum) == pytest.approx(1.4 + 0.95) and int(out.blocks) == 2
    sums = {"ce": out.ce, "tv": out.tv, "conf": out.conf, "weight": torch.tensor(1.0),
            "accept_sum": out.accept_sum, "count": out.count.float(),
            "prefix_sum": out.prefix_sum, "blocks": out.blocks.float()}
    m = ratio_metrics(sums)
    assert m["tau_prob"] == pytest.approx(2.175)
    assert m["tau_prob_pooled"] == pytest.approx(2.3325)


def test_lr_schedule_warmup_then_cosine_to_min():
    f = lr_lambda(total_steps=100, warmup_ratio=0.04, min_ratio=0.0)
    assert [round(f(s), 6) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(52) == pytest.approx(0.5, abs=1e-9)
    assert f(100) == pytest.approx(0.0, abs=1e-12)


def test_make_adamw_fuses_on_cpu_with_the_foreach_update_and_keeps_foreach_for_sharded_parameters():
    """The fused CPU AdamW is the same update as torch's foreach AdamW to rounding, over several steps
    with weight decay and the trainer's betas; FSDP's sharded CPU parameters keep foreach."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5, 3)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64).float() for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    fused_params = [torch.nn.Parameter(p.clone()) for p in start]
    ref_params = [torch.nn.Parameter(p.clone()) for p in start]
    fused = make_adamw(fused_params, 1e-2, 0.1, torch.device("cpu"))
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    assert fused.defaults["fused"] is True and fused.defaults["betas"] == (0.9, 0.95)
    for step in grads:
        for params, opt in ((fused_params, fused), (ref_params, ref)):
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
    moved = max(float((a.detach() - p).abs().max()) for a, p in zip(fused_params, start))
    assert moved > 1e-3  # four steps of lr 1e-2 moved the parameters
    for a, b in zip(fused_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    sharded = make_adamw([torch.nn.Parameter(p.clone()) for p in start], 1e-2, 0.1, torch.device("cpu"), sharded=True)
    assert not sharded.defaults["fused"]


def test_training_lowers_the_loss(tiny_qwen3, tmp_path):
    samples = synthetic_samples(tiny_qwen3.vocab_size, n=4, seed=3)
    t = tiny_trainer(tiny_qwen3, str(tmp_path / "fit"), samples=samples, max_steps=30, lr=1e-2, save_every=100)
    t.fit()
    first, last = t.history[0], t.history[-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["tau_prob"] > first["tau_prob"]


def test_target_and_shared_weights_get_no_gradient(tiny_qwen3, tmp_path):
    t = tiny_trainer(tiny_qwen3, str(tmp_path / "g"), max_steps=1)
    t.fit()
    assert all(p.grad is None and not p.requires_grad for p in tiny_qwen3.parameters())
    for w in t.drafter.shared_weights().values():
        assert w.grad is None and not w.requires_grad


def test_torchrun_two_ranks_equal_one_process(tmp_path):
    worker = REPO / "tests" / "helpers" / "ddp_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    two = tmp_path / "two"
    subprocess.run([sys.executable, str(worker), str(one), "2"], check=True, env=env, timeout=300)
    run_torchrun(worker, [two, 1])
    a = torch.load(one / "params.pt", weights_only=True)
    b = torch.load(two / "params.pt", weights_only=True)
    start = tiny_trainer(make_tiny_target("qwen3"), str(tmp_path / "start"))
    moved = 0.0
    for k in a:
        # Reduction order differs between ranks: equal up to rounding (Adam can amplify it on
        # near-zero gradient entries to ~1e-6); a real mismatch moves parameters by ~lr = 3e-3.
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5)
        moved = max(moved, float((a[k] - start.drafter.state_dict()[k]).abs().max()))
    assert moved > 1e-3  # the runs trained: the comparison is not between two untouched models


def test_fused_and_generic_loss_paths_give_the_same_step(tiny_qwen3, tmp_path):
    """The trainer's fused LM-head loss and the generic chunked loss are the same function."""
    grads = []
    for fused in (True, False):
        t = tiny_trainer(tiny_qwen3, str(tmp_path / f"f{fused}"), max_steps=1, grad_clip=1e9)
        t.module.fused = fused
        rec = t.train_step()
        grads.append((rec["loss"], {n: p.grad.clone() for n, p in t.drafter.named_parameters() if p.requires_grad}))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for k in grads[0][1]:
        torch.testing.assert_close(grads[0][1][k], grads[1][1][k], rtol=1e-4, atol=1e-7)


def test_a_run_stopped_by_its_time_budget_keeps_its_drafter(tiny_qwen3, tmp_path):
    t = tiny_trainer(tiny_qwen3, str(tmp_path / "cap"), max_wall_minutes=1e-9, save_every=100)
    t.fit()
    assert t.step == 1  # stopped after the first step
    assert (tmp_path / "cap" / "drafter" / "model.safetensors").is_file()
    assert latest_checkpoint(tmp_path / "cap").name == "step-0000001"


@pytest.mark.parametrize("fused", [True, False], ids=["fused-loss", "chunked-loss"])
@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_bf16_autocast_step_matches_the_fp32_step(tmp_path, family, fused):
    """mixed_precision="bf16" (the GPU recipe) runs the whole step under bf16 autocast; on CPU
    this exercises the same path: drafter, loss (softcap for Gemma4) and confidence loss."""
    target = make_tiny_target(family)
    runs = {}
    for precision in ("no", "bf16"):
        t = tiny_trainer(target, str(tmp_path / precision), max_steps=1, grad_clip=1e9, mixed_precision=precision)
        t.module.fused = fused
        rec = t.train_step()
        runs[precision] = (rec["loss"], torch.cat([p.grad.flatten() for p in t.drafter.trainable_parameters()]))
    (loss32, grad32), (loss16, grad16) = runs["no"], runs["bf16"]
    assert math.isfinite(loss16) and loss16 == pytest.approx(loss32, rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(grad16.float(), grad32, dim=0)) > 0.99
    assert all(p.dtype == torch.float32 for p in t.drafter.trainable_parameters())  # fp32 master weights


def test_compiled_step_equals_the_eager_step(tiny_qwen3, tmp_path, monkeypatch):
    """train.compile=True (the GPU recipes) wraps the loss module in torch.compile. The test
    compiles with the aot_eager backend: Dynamo and AOTAutograd trace the drafter and the fused
    loss's autograd Function as on a GPU, without needing a C++ compiler on the CI machine."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    runs = {}
    for compiled in (False, True):
        t = tiny_trainer(tiny_qwen3, str(tmp_path / str(compiled)), max_steps=2, grad_clip=1e9, compile=compiled)
        losses = [t.train_step()["loss"] for _ in range(2)]
        runs[compiled] = (losses, {n: p.detach().clone() for n, p in t.drafter.named_parameters()})
        assert (t.model is not t.module) == compiled
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-5)
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_sample_order_and_anchor_streams_are_seeded_by_hand_computed_seeds():
    """Epoch e's permutation draws from seed·1000003 + e; the anchors of sample i in epoch e
    from (seed·7919 + e)·1000003 + i (dspark.seeds.derive_seed, nested): a resumed run draws what
    the interrupted one would have, whichever version of the code wrote its checkpoint."""
    from dspark.data.anchors import sample_anchors
    from dspark.training.schedule import Schedule, anchors_for

    seed, epoch, index = 7, 3, 5
    schedule = Schedule(num_samples=10, global_batch=2, world=1, rank=0, seed=seed, total_steps=1)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    assert torch.equal(schedule.epoch_perm(epoch), expected)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1])
    anchors, keep = anchors_for(mask, 3, seed, epoch, index)
    g = torch.Generator().manual_seed((seed * 7_919 + epoch) * 1_000_003 + index)
    ref_anchors, ref_keep = sample_anchors(mask.unsqueeze(0), 3, generator=g)
    assert torch.equal(anchors, ref_anchors[0]) and torch.equal(keep, ref_keep[0])
