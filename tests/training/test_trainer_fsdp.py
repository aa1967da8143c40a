"""The trainer under FSDP2 (train.distributed = "fsdp"): 2 ranks (torchrun, gloo) == one process,
exact resume, plain drafter checkpoints. One torchrun launch (tests/helpers/fsdp_worker.py) serves all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.targets import make_tiny_target
from helpers.training import run_torchrun, synthetic_samples, tiny_trainer

from dspark.data.dataset import RenderedSource
from dspark.modeling import load_drafter
from helpers.paths import REPO


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Output root of the 2-rank FSDP worker (see its docstring for what is inside)."""
    root = tmp_path_factory.mktemp("fsdp")
    worker = REPO / "tests" / "helpers" / "fsdp_worker.py"
    run_torchrun(worker, [root])
    return root


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same global batch (4) in one process: the reference the FSDP run must match."""
    target = make_tiny_target("qwen3")
    start = {k: v.clone() for k, v in tiny_trainer(target, str(tmp_path_factory.mktemp("start"))).drafter.state_dict().items()}
    trainer = tiny_trainer(target, str(tmp_path_factory.mktemp("one")), distributed="fsdp")
    trainer.fit()
    trainer.eval_data = RenderedSource(synthetic_samples(target.vocab_size, n=3, seed=5))
    return trainer, start, trainer.evaluate()


def test_fsdp_two_ranks_equal_one_process(runs, one_process):
    trainer, start, _ = one_process
    fsdp = torch.load(runs / "full.pt", weights_only=True)
    assert fsdp["sharded"]  # the drafter's parameters really were DTensor shards
    ref = trainer.drafter.state_dict()
    assert fsdp["params"].keys() == ref.keys()
    moved = 0.0
    for k, v in fsdp["params"].items():
        # Reduction order differs: equal up to rounding (as in test_train's DDP check); a real
        # mismatch moves parameters by ~lr = 3e-3.
        torch.testing.assert_close(v, ref[k], rtol=1e-4, atol=2e-5)
        moved = max(moved, float((v - start[k]).abs().max()))
    assert moved > 1e-3  # the runs trained: not a comparison of two untouched models


def test_fsdp_gradient_scale_matches_one_process(runs, one_process):
    """Adam hides a constant gradient factor from the parameters; the logged pre-clip norm and
    the loss do not: FSDP's rank averaging times world/D gives the 1-process gradient."""
    trainer, _, _ = one_process
    fsdp = torch.load(runs / "full.pt", weights_only=True)["history"]
    assert len(fsdp) == len(trainer.history) == 6
    for got, ref in zip(fsdp, trainer.history):
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert max(r["grad_norm"] for r in fsdp) > trainer.config.train.grad_clip  # clipping was exercised


def test_fsdp_final_drafter_folder_is_plain_and_full(runs):
    params = torch.load(runs / "full.pt", weights_only=True)["params"]
    drafter = load_drafter(runs / "full" / "drafter", make_tiny_target("qwen3"))
    saved = drafter.state_dict()
    assert saved.keys() == params.keys()
    for k in params:
        assert torch.equal(saved[k], params[k]), k


def test_fsdp_trainer_state_loads_weights_only(runs):
    state = torch.load(runs / "full" / "checkpoints" / "step-0000006" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 6 and state["world_size"] == 2
    exp_avg = state["optimizer"]["state"]["drafter.fc.weight"]["exp_avg"]
    assert type(exp_avg) is torch.Tensor and exp_avg.shape == (64, 192)  # full, not a shard


def test_fsdp_resume_reproduces_uninterrupted_run(runs):
    full = torch.load(runs / "full.pt", weights_only=True)["params"]
    resumed = torch.load(runs / "resumed.pt", weights_only=True)
    assert resumed["step"] == 6
    for k in full:  # same ranks, same reduction order: bitwise equal
        assert torch.equal(resumed["params"][k], full[k]), k


def test_fsdp_accumulation_adds_no_gradient_communication(runs):
    """Two micro-batches per rank reduce-scatter gradients as often as one: no sync until the last."""
    comm = torch.load(runs / "comm.pt", weights_only=True)
    assert comm[2] > 0
    assert comm[1] == comm[2]


def test_fsdp_evaluation_with_uneven_split_matches_one_process(runs, one_process):
    """3 held-out samples over 2 ranks: the rank with fewer runs a padding forward, nothing hangs,
    and the metrics are the 1-process ones (up to the rounding of the trained parameters)."""
    _, _, ref = one_process
    got = torch.load(runs / "full.pt", weights_only=True)["eval"]
    for k in ("eval_ce", "eval_tv", "eval_conf", "eval_tau_prob"):
        assert got[k] == pytest.approx(ref[k], rel=1e-3), k
