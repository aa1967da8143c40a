"""The training recipe: one process or many (torchrun; gloo on CPU, NCCL on GPU), the
drafter replicated (train.distributed = "ddp") or sharded with FSDP2 ("fsdp").

Exactness is the design constraint: whatever the split over ranks and micro-batches, a step
takes the same gradient, and a resumed run reproduces an uninterrupted one. The samples and
anchors of a step are fixed by the step alone (dspark.training.schedule); checkpoints hold every
state a resume needs (dspark.training.checkpoints). Every micro-batch backpropagates raw
weighted sums (Σ w_k·term over its supervised positions); before the optimizer step the
gradients are scaled by 1/D with D = Σ w_k over all supervised positions of the global batch
(reduced across ranks). This is exactly the gradient of the weighted mean over the global batch
(Section 3.3), whatever the split. DDP and FSDP both average gradients over ranks, so the scale
applied is world/D.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dspark.config import Config
from dspark.data.dataset import SampleSource, check_sample_source, collate, sample_lengths
from dspark.data.vocab_counts import check_vocab_counted
from dspark.modeling.checkpoint import check_against_target
from dspark.modeling import Drafter, save_drafter
from dspark.build import resolve_mixed_precision
from dspark.training.checkpoints import TrainerCheckpoints, latest_checkpoint
from dspark.training.distributed import shard_fsdp
from dspark.training.schedule import Schedule, anchors_for, lr_lambda, make_adamw
from dspark.training.step import METRIC_SUMS, build_loss_module, ratio_metrics

log = logging.getLogger(__name__)


# --------------------------------------------------------------- the trainer
@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    history: list[dict[str, Any]]


class Trainer(TrainerCheckpoints):
    """One rank's training run: the loss module (wrapped by DDP / FSDP when distributed), AdamW
    with a warmup-cosine schedule, the data schedule and checkpoints; :meth:`fit` runs it.

    ``train_data`` / ``eval_data`` follow ``dspark.data.dataset.SampleSource``. The constructor
    checks its inputs before any heavy work (:func:`check_inputs`): a drafter built for another
    target, an uncounted draft vocabulary or samples without ``loss_mask`` are named errors."""

    def __init__(
        self,
        config: Config,
        target: Any,
        drafter: Drafter,
        train_data: SampleSource,
        eval_data: SampleSource | None = None,
        *,
        out_dir: str | os.PathLike | None = None,
        progress: bool = True,
    ) -> None:
        check_inputs(target, drafter, train_data, eval_data)
        self.config = config
        self.target = target
        self.drafter = drafter
        self.train_data = train_data
        self.eval_data = eval_data
        self.out_dir = Path(out_dir) if out_dir else config.run_dir
        self.progress = progress
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = next(drafter.parameters()).device
        tc = config.train
        self.precision = resolve_mixed_precision(tc.mixed_precision, self.device)  # "bf16" | "no"
        if tc.global_batch_size % (self.world * tc.micro_batch_size):
            raise ValueError(
                f"train.global_batch_size={tc.global_batch_size} must be divisible by "
                f"world size {self.world} × train.micro_batch_size={tc.micro_batch_size}"
            )
        if len(train_data) == 0:
            raise ValueError("the training set is empty")
        total = tc.max_steps or max(1, math.ceil(tc.epochs * len(train_data) / tc.global_batch_size))
        self.schedule = Schedule(len(train_data), tc.global_batch_size, self.world, self.rank, config.seed, total,
                                 micro_batch=tc.micro_batch_size, bucket_window=tc.bucket_window,
                                 lengths=sample_lengths(train_data) if tc.bucketing else None)
        self.module = build_loss_module(drafter, target, config.loss)  # Eagle3: the TTT loss
        self.model: nn.Module = self.module
        # Under FSDP the drafter's parameters are DTensor shards: use drafter_state_dict()
        # for whole tensors.
        self.fsdp = self.distributed and tc.distributed == "fsdp"
        if self.fsdp:
            shard_fsdp(self.module, self.device)
        elif self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=ids)
        if tc.compile:
            self.model = torch.compile(self.model)
        params = drafter.trainable_parameters()
        self.optimizer = make_adamw(params, tc.lr, tc.weight_decay, self.device, sharded=self.fsdp)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(total, tc.warmup_ratio, tc.min_lr_ratio))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.wall_offset = 0.0  # training seconds spent before a resume
        self._t0 = time.perf_counter()  # start of this process's training (fit resets it)
        self._tb = None
        # fit() returns after this many steps as a killed job would (no end-of-run drafter, no
        # checkpoint beyond the periodic ones); None: run to the end. Tests set it.
        self._stop_after: int | None = None

    # ------------------------------------------------------------ utilities
    def _autocast(self):
        """bf16 autocast over fp32 master weights when train.mixed_precision resolves to bf16
        (`resolve_mixed_precision`: "auto" on a GPU or a CPU with native bf16; with target.dtype
        bf16 the LM-head matmuls of the loss run in bf16 too)."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.distributed:
            dist.all_reduce(t)
        return t

    def _micro_batch(
        self, data: SampleSource, samples: Sequence[tuple[int, int]], seed: int
    ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """The (epoch, index) ``samples`` of ``data`` collated on the device, with their anchors
        and keep masks [b, A] (drawn from ``seed``, so independent of the batching)."""
        items = [data[idx] for _, idx in samples]
        anchors, keep = zip(
            *(anchors_for(it["loss_mask"], self.config.data.num_anchors, seed, ep, idx) for it, (ep, idx) in zip(items, samples))
        )
        batch = {k: v.to(self.device, non_blocking=True) for k, v in collate(items).items()}
        return batch, torch.stack(anchors).to(self.device), torch.stack(keep).to(self.device)

    def _micro_batches(self, step: int) -> list[tuple[dict[str, Tensor], Tensor, Tensor]]:
        """This rank's share of the global batch of ``step``, in micro-batches."""
        samples = self.schedule.step_samples(step)
        mb = self.config.train.micro_batch_size
        return [self._micro_batch(self.train_data, samples[i : i + mb], self.config.seed) for i in range(0, len(samples), mb)]

    def _global_sums(self, sums: dict[str, Tensor], keys: Sequence[str]) -> dict[str, Tensor]:
        """Σ over ranks of the metric sums named ``keys``, packed into one all_reduce. A rank
        that summed nothing (an FSDP rank out of held-out samples) contributes zeros."""
        gamma = self.drafter.config.block_size
        parts = [
            sums[k] if k in sums else torch.zeros(gamma if k in ("accept_sum", "count") else (), device=self.device)
            for k in keys
        ]
        packed = torch.cat([t.reshape(-1).float() for t in parts])
        self._all_reduce(packed)
        offset, reduced = 0, {}
        for k, t in zip(keys, parts):
            reduced[k] = packed[offset : offset + t.numel()].reshape(t.shape)
            offset += t.numel()
        return reduced

    # ----------------------------------------------------------------- step
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the global batch of ``self.step``: the micro-batches' raw
        weighted sums backpropagated, the gradient scaled to the weighted mean over the global
        batch, clipped and applied. Returns the step's log record."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, Tensor] = {}
        batches = self._micro_batches(self.step)
        for i, (batch, anchors, keep) in enumerate(batches):
            _add_sums(sums, self._micro_step(batch, anchors, keep, last=i == len(batches) - 1))
        reduced = self._global_sums(sums, sorted(sums))
        grad_norm = self._optimizer_step(reduced["weight"])
        return self._step_record(reduced, grad_norm)

    def _micro_step(self, batch: dict[str, Tensor], anchors: Tensor, keep: Tensor, last: bool) -> dict[str, Tensor]:
        """Forward and backward of one micro-batch (its loss is a raw weighted sum); returns its
        metric sums. Ranks reduce gradients only after the ``last`` micro-batch of the step."""
        if self.fsdp:  # accumulate unsharded gradients locally, reduce-scatter after the last
            self.module.set_requires_gradient_sync(last)
        sync = self.model.no_sync() if self.distributed and not last and hasattr(self.model, "no_sync") else nullcontext()
        with sync:
            with self._autocast():
                loss, metrics = self.model(batch, anchors, keep)
            loss.backward()
        return metrics

    def _optimizer_step(self, weight: Tensor) -> float:
        """Scale the accumulated gradients by world/D (D = ``weight``, Σ w_k over the global
        batch's supervised positions), clip, step optimizer and scheduler; returns the pre-clip
        gradient norm."""
        # DDP / FSDP averaged the gradients over ranks; we want Σ_ranks grad / D.
        scale = float(self.world) / float(weight.clamp_min(1e-12))
        for p in self.drafter.trainable_parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.trainable_parameters(), self.config.train.grad_clip)
        if self.fsdp:  # the norm of sharded gradients is a DTensor
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return float(grad_norm)

    def _step_record(self, reduced: dict[str, Tensor], grad_norm: float) -> dict[str, Any]:
        """The log record of the step just taken, from the metric sums reduced over the global batch."""
        m = ratio_metrics(reduced)
        lc = self.config.loss
        return {
            "step": self.step,
            "loss": lc.ce_weight * m["ce"] + lc.tv_weight * m["tv"] + lc.conf_weight * m["conf"],
            "ce": m["ce"],
            "tv": m["tv"],
            "conf": m["conf"],
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "accept": m["accept"],
            "tau_prob": m["tau_prob"],
            "tau_prob_pooled": m["tau_prob_pooled"],
            "anchors": float(reduced["anchors"]),
            "tokens": float(reduced["tokens"]),
        }

    @torch.no_grad()
    def evaluate(self, max_samples: int = 0) -> dict[str, float]:
        """Held-out loss terms, per-position acceptance (1 − TV), τ_prob (DeepSpec's) and τ_prob_pooled."""
        if self.eval_data is None or len(self.eval_data) == 0:
            return {}
        self.module.eval()
        n = len(self.eval_data) if not max_samples else min(max_samples, len(self.eval_data))
        mine = list(range(self.rank, n, self.world))
        if self.config.train.bucketing:  # similar lengths share a micro-batch; the sums do not depend on the order
            lengths = sample_lengths(self.eval_data)
            mine.sort(key=lambda j: int(lengths[j]))
        sums: dict[str, Tensor] = {}
        mb = self.config.train.micro_batch_size
        rounds = math.ceil(len(mine) / mb)
        if self.fsdp:  # every forward is a collective: all ranks run as many as the busiest one
            rounds_t = torch.tensor([rounds], device=self.device)
            dist.all_reduce(rounds_t, op=dist.ReduceOp.MAX)
            rounds = int(rounds_t)
        for i in range(rounds):
            idx = mine[i * mb : (i + 1) * mb]
            padding = not idx
            if padding:  # an FSDP rank out of samples: a forward whose metrics are dropped
                idx = [0]
            batch, anchors, keep = self._micro_batch(self.eval_data, [(0, j) for j in idx], self.config.seed + 1)
            with self._autocast():
                _, metrics = self.module(batch, anchors, keep)
            if not padding:
                _add_sums(sums, metrics)
        reduced = self._global_sums(sums, list(METRIC_SUMS))
        return {f"eval_{k}": v for k, v in ratio_metrics(reduced).items()}

    # ------------------------------------------------------------------ run
    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.config.train.tensorboard:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter  # optional dependency

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    def fit(self, resume: bool = False) -> TrainResult:
        """Train to the configured number of steps (train.max_steps, else train.epochs over the
        data), from the latest checkpoint of out_dir when ``resume``, and write the final drafter
        to out_dir/drafter. Every train.log_every steps a log record (with a held-out evaluation
        every train.eval_every), every train.save_every a checkpoint; a run that reaches
        train.max_wall_minutes logs, evaluates, checkpoints and ends at that step."""
        if resume:
            self._resume()
        self._t0 = time.perf_counter()
        total = self.schedule.total_steps
        end = total if self._stop_after is None else min(total, self.step + self._stop_after)
        bar = self._progress_bar(total)
        window = _Window()
        self._evaluate_untrained()
        out_of_time = False
        while self.step < end and not out_of_time:
            rec = self.train_step()
            window.add(rec)
            wall = self._wall_seconds()
            rec["wall_min"] = round(wall / 60, 4)
            out_of_time = self._out_of_time(wall)
            if self._closes_period(self.config.train.log_every, end, out_of_time):
                self._log_step(rec, window, out_of_time)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau_prob']:.2f}", lr=f"{rec['lr']:.1e}")
            bar.update(1)
            self._maybe_checkpoint(out_of_time)
        bar.close()
        if out_of_time and self.rank == 0:
            log.info("stopping at step %d: train.max_wall_minutes=%s reached", self.step, self.config.train.max_wall_minutes)
        if self.step >= total or out_of_time:  # the drafter a run ends with (not a killed job's)
            self._save_final_drafter()
        return TrainResult(self.out_dir, self.step, self.history)

    def _closes_period(self, every: int, last: int, out_of_time: bool) -> bool:
        """Whether the step just taken ends a period of ``every`` steps: a multiple of ``every``,
        the run's ``last`` step, or the step at which the time budget ran out."""
        return self.step % every == 0 or self.step == last or out_of_time

    def _resume(self) -> None:
        """Load the latest checkpoint of out_dir, if any: its step fixes the data position."""
        path = latest_checkpoint(self.out_dir)
        if path is None:
            return
        self.load_checkpoint(path)
        if self.rank == 0:
            log.info("resumed from %s at step %d", path, self.step)

    def _progress_bar(self, total: int) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=self.step, disable=not self.progress or self.rank != 0,
                    desc=f"train {self.config.name}", dynamic_ncols=True)

    def _wall_seconds(self) -> float:
        """Training seconds of the run, resumes included."""
        return self.wall_offset + time.perf_counter() - self._t0

    def _out_of_time(self, wall_seconds: float) -> bool:
        limit = self.config.train.max_wall_minutes
        return bool(limit) and wall_seconds / 60 >= limit

    def _evaluate_untrained(self) -> None:
        """A fresh run with held-out data and train.eval_every logs step 0: the untrained drafter."""
        if self.step == 0 and self.eval_data is not None and len(self.eval_data) and self.config.train.eval_every:
            self._log({"step": 0, "wall_min": 0.0, **self.evaluate()})

    def _log_step(self, rec: dict[str, Any], window: _Window, out_of_time: bool) -> None:
        """Log the record of the step just taken, with the throughput since the last logged step
        and, at the end of an evaluation period, the held-out metrics."""
        rec.update(window.rates(self.drafter.config.block_size))
        window.restart()
        self._maybe_evaluate(rec, out_of_time)
        self._log(rec)

    def _maybe_evaluate(self, rec: dict[str, Any], out_of_time: bool) -> None:
        """Add the held-out metrics to a logged record at the end of every train.eval_every period."""
        every = self.config.train.eval_every
        if every and self._closes_period(every, self.schedule.total_steps, out_of_time):
            rec.update(self.evaluate())

    def _maybe_checkpoint(self, out_of_time: bool) -> None:
        """Checkpoint at the end of every train.save_every period (collective)."""
        if self._closes_period(self.config.train.save_every, self.schedule.total_steps, out_of_time):
            self.save_checkpoint()

    def _save_final_drafter(self) -> None:
        """The drafter the run ends with, as a plain folder out_dir/drafter (FSDP gathers it: collective)."""
        drafter_state = self.drafter_state_dict() if self.fsdp else None
        if self.rank == 0:
            save_drafter(self.drafter, self.out_dir / "drafter", state_dict=drafter_state)


def check_inputs(target: Any, drafter: Any, train_data: SampleSource, eval_data: SampleSource | None) -> None:
    """ValueError before any forward: the drafter does not fit the target (sizes, captured layers:
    dspark.modeling.checkpoint.check_against_target), its draft vocabulary was never counted
    (dspark.data.vocab_counts.check_vocab_counted), or a data source lacks a key
    (dspark.data.dataset.check_sample_source)."""
    config = drafter.config
    check_against_target(config, target, "the drafter")
    check_vocab_counted(drafter)
    width = len(config.target_layer_ids) * config.hidden_size
    for source, name in ((train_data, "the training data"), (eval_data, "the held-out data")):
        if source is not None:
            check_sample_source(source, name, feature_width=width, hidden_size=config.hidden_size)


def _add_sums(sums: dict[str, Tensor], metrics: dict[str, Tensor]) -> None:
    """sums[k] += metrics[k] in fp32, for every metric sum of a micro-batch."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0) + v.float()


@dataclass
class _Window:
    """Anchors and tokens trained since the last logged step, for its throughput fields."""

    start: float = field(default_factory=time.perf_counter)
    anchors: float = 0.0
    tokens: float = 0.0

    def restart(self) -> None:
        self.start, self.anchors, self.tokens = time.perf_counter(), 0.0, 0.0

    def add(self, rec: dict[str, Any]) -> None:
        self.anchors += rec["anchors"]
        self.tokens += rec["tokens"]

    def rates(self, block_size: int) -> dict[str, float]:
        """Anchors, anchor positions (anchors·γ) and tokens per second since ``start``."""
        dt = max(1e-9, time.perf_counter() - self.start)
        return {
            "anchors_per_s": round(self.anchors / dt, 2),
            "anchor_positions_per_s": round(self.anchors * block_size / dt, 2),
            "tokens_per_s": round(self.tokens / dt, 2),
        }
