"""Small numerical kernels shared by the target wrapper and the drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark.kernels import cpu_linear

# Up to this many rows, a float32 vocabulary projection on CPU is computed as W @ hᵀ.
_CPU_FP32_FEW_ROWS = 8


def vocab_logits(hidden: Tensor, weight: Tensor, *, contiguous: bool = True) -> Tensor:
    """hidden [..., d] @ weight[V, d]ᵀ -> logits [..., V] (an LM head, no bias).

    Same values as ``F.linear(hidden, weight)``, up to summation order. On CPU in
    float32 with 2-8 rows (a drafted block, a verification forward) it is computed
    as ``weight @ hiddenᵀ``: MKL's GEMM for a few rows against a 49k x 576 matrix
    is badly blocked in the ``hidden @ weightᵀ`` orientation (see `bench/decode_round.py`
    and bench/README.md). One row
    (a GEMV) and many rows (training) are as fast either way, and bfloat16
    (oneDNN) has no such cliff, so those keep ``F.linear``.

    ``contiguous=False`` lets the W·hᵀ form return its transposed view ([..., V] with
    the rows interleaved in memory) instead of copying it into row-major order: a
    caller that copies the logits anyway (the drafter's sampling loop makes its own
    fp32 copy to add the Markov biases to) saves one [rows, V] copy. Same values.

    A weight registered with :mod:`dspark.kernels.cpu_linear` (``target.cpu_linear``) takes its
    oneDNN-packed kernel for 1..``cpu_linear.FEW_ROWS`` rows instead (contiguous logits).
    """
    if cpu_linear.is_registered(weight) and cpu_linear.applies(hidden, weight):
        return cpu_linear.linear(hidden, weight)  # a oneDNN-packed weight (dspark.kernels.cpu_linear)
    rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
    if hidden.device.type != "cpu" or hidden.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(hidden, weight)
    # MKL's bits in this orientation change when the weight is not 16-byte aligned (they are
    # the same at every aligned address, which every allocator-owned tensor has). A misaligned
    # weight (a view into a memory-mapped file) keeps F.linear, whose bits do not depend on
    # the address, so a weight's logits never depend on where exactly its memory lies.
    if not 2 <= rows <= _CPU_FP32_FEW_ROWS or weight.data_ptr() % 16 or not weight.is_contiguous():
        return F.linear(hidden, weight)
    flat = hidden.reshape(rows, hidden.shape[-1])
    logits = torch.mm(weight, flat.t()).t()  # [rows, V], column-major
    if contiguous:
        logits = logits.contiguous()
    return logits.reshape(*hidden.shape[:-1], weight.shape[0])  # a view: only leading dims are split
