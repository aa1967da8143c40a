"""Distributed training set-up: torchrun's process group (gloo on CPU, NCCL on GPU) and FSDP2
sharding of the loss module (one shard group per draft layer, then the root)."""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from dspark.training.step import DraftLossModule


def shard_fsdp(module: DraftLossModule, device: torch.device) -> None:
    """FSDP2 in place: one shard group per draft layer, then the root (fc, norms, heads).

    Rank 0's initial parameters are copied to every rank first, as DDP does. The frozen
    target and the shared embedding / LM head are not parameters of `module`, so they
    stay whole and untouched on every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for t in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(t.data, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in module.drafter.layers:
        fully_shard(layer, mesh=mesh)
        # The drafter projects the context K/V through layer.context_kv(), outside the
        # layer's forward(): FSDP must gather the layer's parameters for that call too.
        if hasattr(layer, "context_kv"):  # an Eagle3 layer has no injected context
            register_fsdp_forward_method(layer, "context_kv")
    fully_shard(module, mesh=mesh)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Init torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, world, device
