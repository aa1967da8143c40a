"""Measuring the memory a loss keeps: bytes of tensor storages created under a dispatch mode."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorages(TorchDispatchMode):
    """Bytes of storages allocated by ops run under the mode (forward and backward): the peak,
    and what is still alive.

    A storage counts from the op that creates it until its last reference dies;
    views and in-place results share an input's storage and are not new.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = {}
        self.peak = 0

    def alive(self) -> int:
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        return sum(nbytes for _, nbytes in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes() > 0:
                    self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.peak = max(self.peak, self.alive())
        return out
