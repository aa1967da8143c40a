"""oneDNN pre-packed weights for the few-row products of CPU decoding (``target.cpu_linear``).

A decoding step multiplies 1 row (target-only), 7 (a drafted block), 8 (a verification forward) or
R · 8 (a batched one of R requests) against every weight matrix, and on a CPU oneDNN with each weight
packed once into its blocked layout multiplies them faster than ``F.linear`` (docs/configs.md, CPU
decoding kernels; bench/studies.md measures the row limit).
:func:`pack_linears` turns on that path for every ``nn.Linear`` of a module (they become
:class:`PackedLinear`, same parameters and state dict) and :func:`register` for a bare weight (an
LM head used through :func:`dspark.kernels.lm_head.vocab_logits`). :func:`linear` then takes it for
inputs of 1..``FEW_ROWS`` rows on CPU in float32 or bfloat16 without autograd, and ``F.linear`` for
everything else (prefill, training, GPUs), so only decoding changes. The values are those of
``F.linear`` up to the summation order (float32: ~1e-6 relative). :func:`resolve` reads the config
setting; :func:`suspended` turns the path off within a block.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FEW_ROWS", "PackedLinear", "applies", "available", "can_pack", "is_registered", "linear", "pack_linears",
           "register", "resolve", "suspended", "unpack_linears", "unregister"]

# Up to this many rows the packed kernel is used (a batched verification of up to 25 requests at
# γ = 4, a short prompt's prefill); above it (long prefills, training batches) F.linear. On a 2-core
# AVX2 CPU the packed kernel measured faster at every size up to 256 rows (bench/studies.md).
FEW_ROWS = 128
# The batch size oneDNN packs for: a verification forward's γ + 1 = 8 rows. The same
# packed weight serves 1..FEW_ROWS rows.
_PACK_ROWS = 8
_DTYPES = (torch.float32, torch.bfloat16)
CHOICES = ("auto", "onednn", "torch")


def available() -> bool:
    """True when this torch build has oneDNN (mkldnn) with its packed linear."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build can pack (and multiply) a ``dtype`` weight: oneDNN's bf16
    packing needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, float32 packing a plain x86-64 or Arm CPU."""
    if dtype not in _DTYPES or not available():
        return False
    if dtype not in _CAN_PACK:
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), _PACK_ROWS)
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4, dtype=dtype), w, None, "none", [], "")
            _CAN_PACK[dtype] = bool(torch.equal(y.float(), torch.full((1, 4), 4.0)))
        except RuntimeError:
            _CAN_PACK[dtype] = False
    return _CAN_PACK[dtype]


_CAN_PACK: dict[torch.dtype, bool] = {}


def native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decoding on ``device`` in ``dtype`` uses packed weights under ``choice``.

    ``"auto"``: on a CPU in float32, and in bfloat16 on a CPU that multiplies bf16 in hardware
    (AVX512-BF16 or AMX), where both are faster than a plain transformers step (bench/README.md);
    bfloat16 emulated on a CPU without those instructions stays on ``F.linear``, unmeasured. ``"onednn"``: on a CPU in float32
    or bfloat16 (an error if this CPU cannot pack that dtype); ``"torch"``: never.
    """
    if choice not in CHOICES:
        raise ValueError(f"target.cpu_linear must be one of {CHOICES}, got {choice!r}")
    if choice == "torch" or torch.device(device).type != "cpu":
        return False
    if choice == "auto":
        if dtype == torch.bfloat16 and not native_bf16():
            return False
        return dtype in _DTYPES and can_pack(dtype)
    if dtype not in _DTYPES or not can_pack(dtype):
        raise ValueError(f"target.cpu_linear='onednn' cannot pack {dtype} weights with this torch build and CPU "
                         "(oneDNN's bf16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT): use 'auto' or 'torch'")
    return True


@dataclass
class _Entry:
    ref: weakref.ref  # the registered weight
    version: int  # its version counter when packed
    packed: Tensor | None = None  # made on first use


# Keyed on what a weight *is* (storage address, shape, strides, dtype), not on the Python
# object: a drafter holds ``weight.detach()`` of the target's LM head, a view of the same
# memory with the same version counter, and finds its packed copy.
_REGISTRY: dict[tuple, _Entry] = {}
_LOCK = threading.Lock()
_STATE = threading.local()


def _key(weight: Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device.type


def _entry(weight: Tensor) -> _Entry | None:
    """The live entry of ``weight`` (or of a tensor with the same memory and layout)."""
    entry = _REGISTRY.get(_key(weight))
    if entry is None:
        return None
    owner = entry.ref()
    if owner is None or owner.data_ptr() != weight.data_ptr():  # died, or its storage moved
        return None
    return entry


def register(weight: Tensor) -> None:
    """Let :func:`linear` use a packed copy of ``weight`` [out, in].

    The copy is made on first use and costs the memory of the weight it packs (for SmolLM2-135M in
    float32, every weight matrix once more). It is rebuilt if the weight is changed in place or
    replaced (its version counter moved; a new storage is a new, unregistered weight), and freed
    with the weight."""
    if weight.dim() != 2:
        raise ValueError(f"register expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if _entry(weight) is not None:
        return
    key = _key(weight)
    with _LOCK:
        _REGISTRY[key] = _Entry(weakref.ref(weight), -1)
    weakref.finalize(weight, _forget, key)


def _forget(key: tuple) -> None:
    with _LOCK:
        entry = _REGISTRY.get(key)
        if entry is not None and entry.ref() is None:
            del _REGISTRY[key]


def unregister(weight: Tensor) -> None:
    """Drop ``weight``'s packed copy; :func:`linear` uses ``F.linear`` for it again."""
    with _LOCK:
        if _entry(weight) is not None:
            del _REGISTRY[_key(weight)]


def is_registered(weight: Tensor) -> bool:
    return _entry(weight) is not None


@contextmanager
def suspended() -> Iterator[None]:
    """Within the block (this thread), :func:`linear` is ``F.linear`` for every weight
    (a baseline loop on the same model, e.g. plain transformers decoding)."""
    before = getattr(_STATE, "suspended", False)
    _STATE.suspended = True
    try:
        yield
    finally:
        _STATE.suspended = before


def _packed(weight: Tensor) -> Tensor | None:
    """The packed copy of a registered ``weight``, (re)made if it changed; None if unregistered."""
    entry = _entry(weight)
    if entry is None:
        return None
    version = 0 if weight.is_inference() else weight._version  # inference tensors keep no counter
    if entry.packed is None or entry.version != version:
        with torch.no_grad():
            entry.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
        entry.version = version
    return entry.packed


def applies(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :func:`linear` would take the packed kernel for these operands (given ``weight`` is registered)."""
    if getattr(_STATE, "suspended", False) or x.device.type != "cpu" or x.dtype not in _DTYPES:
        return False
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype) or x.shape[-1] != weight.shape[1]:
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= FEW_ROWS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False  # the packed op has no autograd formula
    return can_pack(x.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when ``weight`` is registered
    and ``x`` is a few-row CPU input (1..``FEW_ROWS`` rows, float32 or bfloat16) without autograd
    (:func:`applies`); the same values up to the summation order."""
    if applies(x, weight, bias):
        packed = _packed(weight)
        if packed is not None:
            return _packed_product(x.contiguous(), packed, bias)
    return F.linear(x, weight, bias)


def _packed_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., in] times the packed weight [out, in] (transposed), + bias: oneDNN's linear."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row CPU inference products use a packed weight (:func:`linear`).

    Made by :func:`pack_linears` from an existing ``nn.Linear`` (its class is switched; the
    parameters, state dict and hooks stay); :func:`unpack_linears` switches it back.
    """

    def forward(self, input: Tensor) -> Tensor:
        if not is_registered(self.weight):  # a weight assigned after pack_linears
            register(self.weight)
        return linear(input, self.weight, self.bias)


def pack_linears(module: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` in ``module`` to :class:`PackedLinear` and register its
    weight; returns how many. Subclasses of ``nn.Linear`` (quantised, LoRA) are left alone."""
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = PackedLinear
            register(sub.weight)
            count += 1
    return count


def unpack_linears(module: nn.Module) -> int:
    """Undo :func:`pack_linears` (and free the packed copies); returns how many."""
    count = 0
    for sub in module.modules():
        if type(sub) is PackedLinear:
            unregister(sub.weight)
            sub.__class__ = nn.Linear
            count += 1
    return count
