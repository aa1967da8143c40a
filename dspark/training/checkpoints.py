"""Training checkpoints and exact resume (:class:`TrainerCheckpoints`, a part of
dspark.training.trainer's :class:`Trainer`).

One integer, the optimizer step, is the source of truth for resume: it fixes the data position
(dspark.training.schedule); checkpoints also hold optimizer, scheduler and every rank's RNG state,
so a resumed run reproduces an uninterrupted one. Checkpoints are the same whatever the
parallelism: a plain drafter folder with full tensors plus trainer_state.pt (FSDP gathers full
tensors to rank 0 to write them and re-shards them on load), so an FSDP checkpoint loads with
load_drafter. out_dir/checkpoints/latest names the newest one; the two newest are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dspark.io.atomic import atomic_write_text, replace_dir
from dspark.modeling import load_drafter, save_drafter

log = logging.getLogger(__name__)

LATEST = "latest"


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    pointer = Path(out_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = Path(out_dir) / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _full_state_options(**kw: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


class TrainerCheckpoints:
    """Checkpoint writing and loading of a :class:`dspark.training.trainer.Trainer`, which sets the
    attributes read here (config, target, drafter, module, optimizer, scheduler, step, history,
    wall_offset, out_dir, rank, world, distributed, fsdp, device)."""

    def drafter_state_dict(self) -> dict[str, Tensor]:
        """The drafter's full tensors (state_dict names). Under FSDP this gathers the shards:
        every rank must call it, and only rank 0 gets the tensors (on CPU; others get {})."""
        if not self.fsdp:
            return self.drafter.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(self.module, options=_full_state_options(cpu_offload=True))
        prefix = "drafter."
        return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}

    def _optimizer_state_dict(self) -> dict[str, Any]:
        """Under FSDP: full optimizer state keyed by parameter name, on rank 0 only (collective)."""
        if not self.fsdp:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer, options=_full_state_options(cpu_offload=True))

    def save_checkpoint(self) -> Path:
        """Drafter folder + trainer state (optimizer, scheduler, step, every rank's RNG), atomically."""
        ckpt_root = self.out_dir / "checkpoints"
        name = f"step-{self.step:07d}"
        drafter_state = self.drafter_state_dict() if self.fsdp else None
        optimizer_state = self._optimizer_state_dict()
        rng = _rng_state()
        rngs = [None] * self.world
        if self.distributed:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        final = ckpt_root / name
        if self.rank == 0:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=ckpt_root))
            try:
                save_drafter(self.drafter, tmp / "drafter", state_dict=drafter_state)
                state = {
                    "step": self.step,
                    "optimizer": optimizer_state,
                    "scheduler": self.scheduler.state_dict(),
                    "rng": rngs,
                    "world_size": self.world,
                    "wall_seconds": self._wall_seconds(),
                    "history": self.history,
                    "config": self.config.to_dict(),
                }
                torch.save(state, tmp / "trainer_state.pt")
                replace_dir(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            atomic_write_text(ckpt_root / LATEST, name)
            self._prune(ckpt_root)
        if self.distributed:
            dist.barrier()
        return final

    def _prune(self, root: Path, keep: int = 2) -> None:
        ckpts = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in ckpts[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        if state["world_size"] != self.world:
            log.warning("resuming a %d-rank run on %d ranks: data order is kept, RNG streams are re-seeded", state["world_size"], self.world)
        if self.fsdp:  # every rank reads the full tensors and keeps its shard
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

            loaded = load_drafter(path / "drafter", self.target, dtype=self.drafter.fc.weight.dtype)
            full = {f"drafter.{k}": v for k, v in loaded.state_dict().items()}
            set_model_state_dict(self.module, full, options=_full_state_options())
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=_full_state_options())
        else:
            loaded = load_drafter(path / "drafter", self.target, device=self.device)
            with torch.no_grad():
                for name, p in self.drafter.state_dict().items():
                    p.copy_(loaded.state_dict()[name])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.wall_offset = float(state.get("wall_seconds", 0.0))
        self.history = list(state.get("history", []))
        if state["world_size"] == self.world:
            _set_rng_state(state["rng"][self.rank])
