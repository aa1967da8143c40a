"""How the cache stores one row of d values and one token, and how many bytes that takes.

- token: one little-endian uint32, ``id | loss_mask << 31`` (ids must be < 2^31).
- fp8: every row of d values (one captured layer of one token, or one final
  hidden) is stored as float8 e4m3fn bytes q with one uint8 exponent e
  (E8M0-style): value = q * 2^(e-127). e is the smallest power of two that
  maps the row's absmax to at most 448 (e4m3's largest finite value), so no
  value ever overflows, and scaling by a power of two is exact both ways: the
  only error is e4m3's rounding (3 mantissa bits, relative error <= 2^-4 on
  normal values).
- bf16 / fp32: the values themselves, no scales.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PRECISIONS = ("fp8", "bf16", "fp32")
VALUE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
SCALE_BYTES = {"fp8": 1, "bf16": 0, "fp32": 0}
TOKEN_BYTES = 4
RECORD_ALIGN = 8
E8M0_BIAS = 127
MASK_BIT = 1 << 31


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {list(PRECISIONS)}")


def _pow2(k: Tensor) -> Tensor:
    """int32 exponents k in [-127, 127] -> float32 2**k, built from the bit pattern (exact)."""
    normal = (k + 127) << 23  # biased exponent field, zero mantissa
    subnormal = torch.full_like(k, 1 << 22)  # 2**-127, the only subnormal we need
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _e8m0_shift(rows: Tensor) -> Tensor:
    """Per row, the smallest k in [-127, 127] with absmax * 2**-k <= 448; int32 [N].

    absmax = mant * 2**E with mant in [0.5, 1) (frexp, exact); 448 = 0.875 * 2**9,
    so k = E - 9 if mant <= 0.875, else E - 8.
    """
    amax = rows.abs().amax(dim=-1)
    mant, exp = torch.frexp(amax)
    k = torch.where(mant <= 0.875, exp - 9, exp - 8)
    return k.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS)


def encode_rows(rows: Tensor, precision: str) -> tuple[Tensor, Tensor | None]:
    """Encode rows [N, d] of any float dtype for storage.

    Returns ``(values, scales)``: fp8: uint8 [N, d] e4m3fn bytes and uint8 [N]
    biased exponents e (value = q * 2^(e-127)); bf16: bfloat16 [N, d], None;
    fp32: float32 [N, d], None. Raises ValueError on non-finite input.
    """
    check_precision(precision)
    if rows.dim() != 2:
        raise ValueError(f"rows must be 2-D [N, d], got shape {tuple(rows.shape)}")
    rows = rows.float()
    if not torch.isfinite(rows).all():
        raise ValueError("the target produced non-finite hidden states (inf/nan); they cannot be cached")
    if precision == "fp32":
        return rows, None
    if precision == "bf16":
        return rows.to(torch.bfloat16), None
    k = _e8m0_shift(rows)  # [N]
    scaled = rows * _pow2(-k)[:, None]  # exact: a power of two; |scaled| <= 448
    q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)  # [N, d]
    return q, (k + E8M0_BIAS).to(torch.uint8)


def decode_rows(values: Tensor, scales: Tensor | None, precision: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`encode_rows`: [N, d] in ``dtype`` (fp8 rows times their power-of-two scale)."""
    check_precision(precision)
    if precision == "fp8":
        if scales is None:
            raise ValueError("fp8 rows need their uint8 exponents (scales)")
        q = values.view(torch.float8_e4m3fn).float()
        k = scales.to(torch.int32) - E8M0_BIAS
        return (q * _pow2(k)[:, None]).to(dtype)
    return values.to(dtype)


def bytes_per_token(hidden_size: int, num_captured: int, precision: str, candidate_fraction: float) -> float:
    """Stored bytes per token, without the per-sample index and padding: 4 + (m + f)(d·b + s)."""
    check_precision(precision)
    row = hidden_size * VALUE_BYTES[precision] + SCALE_BYTES[precision]
    return TOKEN_BYTES + (num_captured + candidate_fraction) * row


def record_bytes(length: Any, num_final: Any, hidden_size: int, num_captured: int, precision: str) -> Any:
    """Exact bytes of one sample's record in a shard, padding to 8 included (ints or int arrays)."""
    row = hidden_size * VALUE_BYTES[precision] + SCALE_BYTES[precision]
    raw = TOKEN_BYTES * length + (length * num_captured + num_final) * row
    return -(-raw // RECORD_ALIGN) * RECORD_ALIGN
