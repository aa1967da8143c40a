"""Tiny, deterministic training setups shared by the trainer tests and their torchrun worker."""

from __future__ import annotations

import torch

from dspark.build import build_drafter
from dspark.config import Config, DataConfig, DrafterSpec, LossConfig, TargetConfig, TrainConfig
from dspark.data.dataset import RenderedSource
from dspark.data.render import RenderedSample


def synthetic_samples(vocab: int, n: int = 12, seed: int = 0) -> list[RenderedSample]:
    """Prompt (loss 0) + response (loss 1) sequences of varying length, from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(4, 9, (1,), generator=g))
        r = int(torch.randint(10, 24, (1,), generator=g))
        ids = torch.randint(2, vocab, (p + r,), generator=g).tolist()
        out.append(RenderedSample(input_ids=ids, loss_mask=[0] * p + [1] * r))
    return out


def tiny_config(target, out_dir: str, **train_overrides) -> Config:
    train = dict(lr=3e-3, warmup_ratio=0.25, global_batch_size=4, micro_batch_size=2, max_steps=6,
                 save_every=2, eval_every=0, log_every=1, mixed_precision="no", compile=False,
                 # Off here: the trainer tests compare runs with different micro-batch sizes, and
                 # bucketing groups samples by micro-batch (tests/test_bucketing.py turns it on).
                 bucketing=False)
    train.update(train_overrides)
    return Config(
        name="tiny",
        out_dir=out_dir,
        seed=7,
        target=TargetConfig(name_or_path="tiny"),
        drafter=DrafterSpec(target_layer_ids=list(target.target_layer_ids), mask_token_id=1, block_size=3,
                            num_draft_layers=1, markov_rank=8),
        data=DataConfig(num_anchors=6, max_length=64, min_loss_tokens=2),
        loss=LossConfig(chunk_rows=5),
        train=TrainConfig(**train),
    )


def tiny_trainer(target, out_dir: str, samples=None, **train_overrides):
    from dspark.training.trainer import Trainer

    config = tiny_config(target, out_dir, **train_overrides)
    drafter = build_drafter(config, target)
    data = RenderedSource(samples if samples is not None else synthetic_samples(target.vocab_size))
    return Trainer(config, target, drafter, data, progress=False)


def fit_killed_after(trainer, steps: int):
    """``trainer.fit()`` ended after ``steps`` more steps as a killed job ends: the periodic
    checkpoints written up to there, no final checkpoint and no final drafter."""
    trainer._stop_after = steps
    return trainer.fit()


def run_torchrun(worker, args, timeout: float = 150.0, attempts: int = 2) -> None:
    """Run `worker args` on 2 local ranks (gloo). A launch that hangs (seen once on a loaded
    sandbox: one rank orphaned while the other waited) is killed as a process group and
    retried once; a worker that fails is an error at once."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in range(attempts):
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if attempt + 1 == attempts:
                raise
            continue
        if code != 0:
            raise subprocess.CalledProcessError(code, cmd)
        return
