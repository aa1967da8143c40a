"""Offline target cache: the target's features, written once, read every epoch (SPEC 4 "Target cache").

Training needs, per sample, the token ids, the loss mask, the captured target
layers H^{l_1..l_m} at every position (the drafter's context, Eq. 2) and the
target's final (post-norm) hidden state at the positions whose next-token
distribution p^t is a training target. Those are exactly the anchor candidates
j (``loss_mask[j] and loss_mask[j+1]``): p^t of block position k of anchor i
comes from the final hidden at i+k-1, and every such position with a
supervised label is a candidate. So the final hidden is stored at candidate
rows only, and the loss mask itself is the index of which rows have one.

Bytes per token (d = hidden size, m = captured layers, f = fraction of tokens
that are candidates)::

    precision  value bytes b  scale bytes s  bytes/token = 4 + (m + f) * (d*b + s)
    fp8        1              1              Qwen3-4B (d=2560, m=5): 12,809 + 2,561 f
    bf16       2              0              25,604 + 5,120 f
    fp32       4              0              51,204 + 10,240 f

plus, per sample, 24 index bytes and up to 7 bytes padding the record to 8.
DeepSpec stores 30,726 bytes/token at these sizes (SPEC 4: int32 id, u8 mask,
bf16 layers, bf16 final hidden at every token). fp8 is at most 15,370 (f = 1,
which no real sample reaches: prompts are outside the loss mask and the last
token is never a candidate), 7 bytes over half of DeepSpec (15,363); it stays
within the half while f <= 2554/2561 = 0.9973. SmolLM2's greedy answers to the
built-in prompts give f = 0.67, i.e. 14,534 B/token at Qwen3-4B sizes (0.47 of
DeepSpec). ``bench/cache_size.py`` prints the table and measures f.

Precision (bench/cache_size.py, SmolLM2-135M, against fp32): fp8 features
have 1.4 % relative L2 error (1.1-2.8 % per layer), the final hidden 2.7 %, and
p^t from it is off by a mean total variation of 0.020 at the candidate positions
(0.035 on a hand-written chat); running the target itself in bf16 gives 0.009.

Encoding
--------
- token: one little-endian uint32, ``id | loss_mask << 31`` (ids must be < 2^31).
- fp8: every row of d values (one captured layer of one token, or one final
  hidden) is stored as float8 e4m3fn bytes q with one uint8 exponent e
  (E8M0-style): value = q * 2^(e-127). e is the smallest power of two that
  maps the row's absmax to at most 448 (e4m3's largest finite value), so no
  value ever overflows, and scaling by a power of two is exact both ways: the
  only error is e4m3's rounding (3 mantissa bits, relative error <= 2^-4 on
  normal values).
- bf16 / fp32: the values themselves, no scales.

Files (a cache is a folder)
---------------------------
``shard-XXXXX.bin``
    records, one per sample, each starting at a multiple of 8 bytes::

        tokens          uint32 [S]
        feature values  [S, m, d]   (fp8 bytes, bf16 or fp32)
        final values    [F, d]      (F = number of candidates, in position order)
        feature scales  uint8 [S, m]   (fp8 only)
        final scales    uint8 [F]      (fp8 only)
        zero padding to a multiple of 8

``index-XXXXX.bin``
    little-endian int64 [n, 3] per shard: record byte offset, length S, F.
    One index per shard, so that resuming never rewrites a finished file.
``manifest.json``
    format name and version, precision, target fingerprint and layer ids,
    sample and token counts, each shard and index file with its size and
    sha256, a digest of the input samples, creation info, and ``complete``.

Every file is written under a temporary name and ``os.replace``d into place; the
manifest is rewritten (atomically) after each finished shard, so a killed
build resumes from its last complete shard. Size figures of this module
(:func:`estimate_cache_size`, ``Manifest.data_bytes``) count shards and
indexes, not the manifest itself (a few kB).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from dspark.fsutil import atomic_write_bytes, fsync_dir, is_leftover

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PRECISIONS",
    "CacheDims",
    "Manifest",
    "ShardInfo",
    "TargetCache",
    "build_cache",
    "bytes_per_token",
    "decode_rows",
    "encode_rows",
    "estimate_cache_size",
    "record_bytes",
    "target_fingerprint",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "dspark-target-cache"
FORMAT_VERSION = 1
PRECISIONS = ("fp8", "bf16", "fp32")
VALUE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
SCALE_BYTES = {"fp8": 1, "bf16": 0, "fp32": 0}
TOKEN_BYTES = 4
INDEX_ROW_BYTES = 24  # int64 offset, length, num_final
RECORD_ALIGN = 8
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E8M0_BIAS = 127
MASK_BIT = 1 << 31
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 65536  # about 1 GB per shard at Qwen3-4B sizes in fp8

_SHARD_RE = re.compile(r"^(shard|index)-(\d{5,})\.bin(\.tmp)?$")


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def _index_name(k: int) -> str:
    return f"index-{k:05d}.bin"


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; choose one of {list(PRECISIONS)}")
    return precision


# --------------------------------------------------------------------- codec
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
    _check_precision(precision)
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
    _check_precision(precision)
    if precision == "fp8":
        if scales is None:
            raise ValueError("fp8 rows need their uint8 exponents (scales)")
        q = values.view(torch.float8_e4m3fn).float()
        k = scales.to(torch.int32) - E8M0_BIAS
        return (q * _pow2(k)[:, None]).to(dtype)
    return values.to(dtype)


# ------------------------------------------------------------------- sizes
def bytes_per_token(hidden_size: int, num_captured: int, precision: str, candidate_fraction: float) -> float:
    """Stored bytes per token, without the per-sample index and padding: 4 + (m + f)(d·b + s)."""
    _check_precision(precision)
    row = hidden_size * VALUE_BYTES[precision] + SCALE_BYTES[precision]
    return TOKEN_BYTES + (num_captured + candidate_fraction) * row


def record_bytes(length: Any, num_final: Any, hidden_size: int, num_captured: int, precision: str) -> Any:
    """Exact bytes of one sample's record in a shard, padding to 8 included (ints or int arrays)."""
    row = hidden_size * VALUE_BYTES[precision] + SCALE_BYTES[precision]
    raw = TOKEN_BYTES * length + (length * num_captured + num_final) * row
    return -(-raw // RECORD_ALIGN) * RECORD_ALIGN


@dataclass(frozen=True)
class CacheDims:
    """What the cache size depends on: hidden size d and number of captured layers m."""

    hidden_size: int
    num_captured: int

    @classmethod
    def of(cls, target_or_config: Any, target_layer_ids: Sequence[int] | None = None) -> CacheDims:
        """From a TargetModel, a CacheDims, a ``(d, m)`` pair, or a (transformers) config / dict with
        ``hidden_size`` (then ``target_layer_ids`` gives m)."""
        if isinstance(target_or_config, CacheDims):
            return target_or_config
        if isinstance(target_or_config, tuple) and len(target_or_config) == 2:
            return cls(int(target_or_config[0]), int(target_or_config[1]))
        ids = getattr(target_or_config, "target_layer_ids", None)
        ids = target_layer_ids if target_layer_ids is not None else ids
        config = getattr(target_or_config, "text_config", target_or_config)
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        d = config.get("hidden_size") if isinstance(config, dict) else getattr(config, "hidden_size", None)
        if d is None or ids is None:
            raise ValueError(
                f"cannot tell the cache dimensions from {type(target_or_config).__name__}: give a TargetModel, "
                "a (hidden_size, num_captured) pair, or a config with hidden_size plus target_layer_ids"
            )
        return cls(int(d), len(ids))


def _num_final(loss_mask: Sequence[int] | np.ndarray) -> int:
    mask = np.asarray(loss_mask, dtype=bool)
    return int(np.count_nonzero(mask[:-1] & mask[1:]))


def estimate_cache_size(
    target_or_dims: Any,
    samples: Iterable[Any],
    precision: str = "fp8",
    *,
    target_layer_ids: Sequence[int] | None = None,
    candidate_fraction: float | None = None,
) -> int:
    """Bytes of shards and indexes that :func:`build_cache` will write for ``samples``; no forward.

    ``samples`` holds sample-like objects (``input_ids`` and ``loss_mask``,
    as attributes or keys: exact), or plain token counts. For a count S the
    number of candidates is ``candidate_fraction * S`` (rounded down) if given,
    else the worst case S - 1. ``target_or_dims``: see :meth:`CacheDims.of`.
    """
    _check_precision(precision)
    dims = CacheDims.of(target_or_dims, target_layer_ids)
    total = 0
    for item in samples:
        if isinstance(item, (int, np.integer)):
            length = int(item)
            final = int(candidate_fraction * length) if candidate_fraction is not None else max(length - 1, 0)
            final = min(final, max(length - 1, 0))
        else:
            ids, mask = _ids_and_mask(item)
            length, final = len(ids), _num_final(mask)
        total += record_bytes(length, final, dims.hidden_size, dims.num_captured, precision) + INDEX_ROW_BYTES
    return total


# ------------------------------------------------------------------ manifest
def target_fingerprint(target: Any, name: str | None = None) -> dict[str, Any]:
    """What identifies a target for the cache: its config sizes and a digest of its LM head.

    The digest hashes the first 64 rows of the LM head rounded to bfloat16, so
    a float32 and a bfloat16 load of the same bf16 checkpoint agree.
    """
    config = target.text_config
    head = target.lm_head_weight()[:64].detach().to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(head.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    path = getattr(getattr(target, "model", None), "name_or_path", "") or ""
    return {
        "name": name if name is not None else path,
        "path": path,
        "family": target.family,
        "model_type": getattr(config, "model_type", None),
        "hidden_size": int(target.hidden_size),
        "num_layers": int(target.num_layers),
        "vocab_size": int(target.vocab_size),
        "lm_head_digest": digest,
    }


_FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_layers", "vocab_size", "lm_head_digest")


@dataclass
class ShardInfo:
    """One finished shard: its data file and index file, their sizes and sha256."""

    file: str
    bytes: int
    sha256: str
    index_file: str
    index_bytes: int
    index_sha256: str
    num_samples: int
    num_tokens: int


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    precision: str
    target: dict[str, Any]
    target_layer_ids: list[int]
    hidden_size: int
    num_captured: int
    num_samples: int = 0
    num_tokens: int = 0
    num_final_rows: int = 0
    num_loss_tokens: int = 0
    samples_sha256: str = ""  # digest of every sample's (ids, mask) so far, in order
    complete: bool = False
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    batch_size: int = 1
    shards: list[ShardInfo] = field(default_factory=list)
    created: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def data_bytes(self) -> int:
        """Bytes of all shards and indexes (what :func:`estimate_cache_size` predicts)."""
        return sum(s.bytes + s.index_bytes for s in self.shards)

    @property
    def bytes_per_token(self) -> float:
        return self.data_bytes / max(self.num_tokens, 1)

    @property
    def candidate_fraction(self) -> float:
        return self.num_final_rows / max(self.num_tokens, 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        data = dict(data)
        data["shards"] = [ShardInfo(**s) for s in data.get("shards", [])]
        return cls(**data)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise ValueError(
                f"{folder} has no {MANIFEST}: not a dspark target cache, or its build stopped before the first "
                "shard; build it with `dspark cache`"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); rebuild the cache with `dspark cache`") from err
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: format={data.get('format')!r}, expected {FORMAT_NAME!r}: not a dspark cache")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: cache format version {data.get('version')} is not the version this dspark reads "
                f"({FORMAT_VERSION}); rebuild the cache with `dspark cache`"
            )
        try:
            manifest = cls.from_dict(data)
        except TypeError as err:
            raise ValueError(f"{path}: malformed manifest ({err}); rebuild the cache with `dspark cache`") from err
        _check_precision(manifest.precision)
        return manifest


# --------------------------------------------------------------- file writing
class _ShardWriter:
    """Streams records into ``shard-k.bin.tmp``, hashing as it goes; ``finish`` moves it into place."""

    def __init__(self, folder: Path, k: int):
        self.folder, self.k = folder, k
        self.path = folder / _shard_name(k)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.offset = 0
        self.rows: list[tuple[int, int, int]] = []  # offset, length, num_final
        self.num_tokens = 0

    def add(self, parts: list[bytes], length: int, num_final: int) -> None:
        size = sum(len(p) for p in parts)
        parts.append(b"\0" * (-size % RECORD_ALIGN))
        for p in parts:
            self.file.write(p)
            self.hash.update(p)
        self.rows.append((self.offset, length, num_final))
        self.offset += size + len(parts[-1])
        self.num_tokens += length

    def finish(self) -> ShardInfo:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.folder)
        index = np.asarray(self.rows, dtype="<i8").reshape(-1, 3).tobytes()
        atomic_write_bytes(self.folder / _index_name(self.k), index)
        return ShardInfo(
            file=self.path.name,
            bytes=self.offset,
            sha256=self.hash.hexdigest(),
            index_file=_index_name(self.k),
            index_bytes=len(index),
            index_sha256=hashlib.sha256(index).hexdigest(),
            num_samples=len(self.rows),
            num_tokens=self.num_tokens,
        )

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _remove_cache_files(folder: Path, keep_shards: int) -> None:
    """Delete temp files and shard/index files numbered >= keep_shards (left by a killed build)."""
    for p in folder.iterdir():
        m = _SHARD_RE.match(p.name)
        leftover = is_leftover(p.name) or p.name == MANIFEST + ".tmp"  # the latter: older versions
        if leftover or (m and (m.group(3) or int(m.group(2)) >= keep_shards)):
            p.unlink()


# ------------------------------------------------------------------ building
def _ids_and_mask(sample: Any) -> tuple[list[int], list[int]]:
    if isinstance(sample, dict):
        ids, mask = sample["input_ids"], sample["loss_mask"]
    else:
        ids, mask = sample.input_ids, sample.loss_mask
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    if isinstance(mask, Tensor):
        mask = mask.int().tolist()
    return list(ids), [int(bool(v)) for v in mask]


def _pack_tokens(ids: list[int], mask: list[int], number: int) -> np.ndarray:
    if len(ids) != len(mask) or not ids:
        raise ValueError(
            f"sample {number}: input_ids has {len(ids)} tokens and loss_mask {len(mask)}; "
            "they must have the same, non-zero length"
        )
    ids_arr = np.asarray(ids, dtype=np.int64)
    if ids_arr.min() < 0 or ids_arr.max() >= MASK_BIT:
        raise ValueError(
            f"sample {number}: token ids must be in [0, 2^31), got min {ids_arr.min()} max {ids_arr.max()}"
        )
    return (ids_arr | (np.asarray(mask, dtype=np.int64) << 31)).astype("<u4")


def _creation_info() -> dict[str, Any]:
    import transformers

    from dspark import __version__

    return {
        "dspark": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _check_resumable(old: Manifest, new: Manifest, folder: Path) -> None:
    problems = []
    if old.precision != new.precision:
        problems.append(f"precision {old.precision!r} vs {new.precision!r}")
    if old.target_layer_ids != new.target_layer_ids:
        problems.append(f"target_layer_ids {old.target_layer_ids} vs {new.target_layer_ids}")
    for key in _FINGERPRINT_KEYS:
        if old.target.get(key) != new.target.get(key):
            problems.append(f"target {key} {old.target.get(key)!r} vs {new.target.get(key)!r}")
    if problems:
        raise ValueError(
            f"cannot resume the cache in {folder}: it was built with " + "; ".join(problems)
            + " (existing vs requested). Use another output folder, or resume=False to rebuild it from scratch"
        )


def _batch_forward(target: Any, batch: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor]:
    """Right-padded forward of a batch; returns features [B, S, m*d] and last_hidden [B, S, d].

    Right padding leaves the real positions unchanged: causal attention never
    looks forward, and the padded tail is masked out.
    """
    lengths = [len(ids) for ids, _ in batch]
    width = max(lengths)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, (ids, _) in enumerate(batch):
        input_ids[b, : len(ids)] = torch.tensor(ids)
    attention_mask = None
    if min(lengths) < width:
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        attention_mask = attention_mask.to(target.device)
    out = target(input_ids.to(target.device), attention_mask=attention_mask, return_logits=False)
    return out.features, out.last_hidden


def _encode_sample(
    features: Tensor, last_hidden: Tensor, tokens: np.ndarray, mask: list[int], precision: str, m: int
) -> tuple[list[bytes], int]:
    """The byte parts of one record (features [S, m*d], last_hidden [S, d] of this sample only)."""
    length, d = last_hidden.shape
    mask_t = torch.tensor(mask, dtype=torch.bool, device=last_hidden.device)
    candidates = torch.zeros_like(mask_t)
    candidates[:-1] = mask_t[:-1] & mask_t[1:]
    feat_values, feat_scales = encode_rows(features.reshape(length * m, d), precision)  # [S*m, d]
    fin_values, fin_scales = encode_rows(last_hidden[candidates], precision)  # [F, d]

    def raw(t: Tensor) -> bytes:
        t = t.contiguous().cpu()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy().tobytes()

    parts = [tokens.tobytes(), raw(feat_values), raw(fin_values)]
    if feat_scales is not None:
        parts += [raw(feat_scales), raw(fin_scales)]
    return parts, int(candidates.sum())


def build_cache(
    target: Any,
    samples: Iterable[Any],
    out_dir: str | os.PathLike,
    *,
    precision: str = "fp8",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_size: int = 8,
    resume: bool = True,
    progress: bool = True,
    target_name: str | None = None,
) -> Manifest:
    """Run ``target`` over ``samples`` and write a cache folder; returns its manifest.

    samples: objects with ``input_ids`` and ``loss_mask`` (attributes or keys,
        lists or tensors), e.g. :class:`~dspark.data.render.RenderedSample`.
        The cache keeps their order: item i of the cache is sample i.
    shard_tokens: a shard is closed once it holds at least this many tokens
        (checked after each batch, so batches never straddle shards).
    batch_size: sequences per target forward, right-padded to the longest.
    resume: continue a partial cache in ``out_dir`` from its last complete
        shard (the samples must be the same, checked by digest); a complete
        one is returned as is. False deletes the cache files there and starts over.
    target_name: recorded in the manifest (default: the model's name_or_path).
    """
    _check_precision(precision)
    if shard_tokens < 1 or batch_size < 1:
        raise ValueError(f"shard_tokens={shard_tokens} and batch_size={batch_size} must both be >= 1")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    m, d = len(target.target_layer_ids), int(target.hidden_size)
    manifest = Manifest(
        precision=precision,
        target=target_fingerprint(target, target_name),
        target_layer_ids=list(target.target_layer_ids),
        hidden_size=d,
        num_captured=m,
        shard_tokens=shard_tokens,
        batch_size=batch_size,
        created=_creation_info(),
    )
    done = 0  # samples already in complete shards
    if resume and (folder / MANIFEST).exists():
        old = Manifest.read(folder)
        _check_resumable(old, manifest, folder)
        manifest, done = old, old.num_samples
    elif not resume:
        (folder / MANIFEST).unlink(missing_ok=True)
    _remove_cache_files(folder, keep_shards=len(manifest.shards))

    total = None
    if isinstance(samples, Sequence):
        total = sum(len(s["input_ids"] if isinstance(s, dict) else s.input_ids) for s in samples)
    bar = tqdm(total=total, desc="cache", unit="tok", unit_scale=True, disable=not progress)
    digest = hashlib.sha256()
    stream: Iterator[Any] = iter(samples)

    def next_sample(number: int) -> tuple[list[int], list[int], np.ndarray] | None:
        try:
            sample = next(stream)
        except StopIteration:
            return None
        ids, mask = _ids_and_mask(sample)
        tokens = _pack_tokens(ids, mask, number)
        digest.update(len(tokens).to_bytes(8, "little"))
        digest.update(tokens.tobytes())
        return ids, mask, tokens

    for number in range(done):
        if next_sample(number) is None:
            raise ValueError(
                f"cannot resume the cache in {folder}: it already holds {done} samples but only {number} were "
                "given; pass the same samples, or resume=False to rebuild"
            )
    skipped = sum(s.num_tokens for s in manifest.shards)
    bar.update(skipped)
    if done and digest.hexdigest() != manifest.samples_sha256:
        raise ValueError(
            f"cannot resume the cache in {folder}: the first {done} samples given differ from the ones it was "
            "built from; pass the same samples in the same order, or resume=False to rebuild"
        )
    if manifest.complete:
        extra = next_sample(done)
        bar.close()
        if extra is not None:
            raise ValueError(
                f"the cache in {folder} is complete with {done} samples but more were given; "
                "use resume=False to rebuild it with all of them"
            )
        return manifest

    manifest.shard_tokens, manifest.batch_size = shard_tokens, batch_size
    writer: _ShardWriter | None = None
    number = done
    try:
        while True:
            batch = []
            while len(batch) < batch_size:
                item = next_sample(number + len(batch))
                if item is None:
                    break
                batch.append(item)
            if batch:
                features, last_hidden = _batch_forward(target, [(ids, mask) for ids, mask, _ in batch])
                if writer is None:
                    writer = _ShardWriter(folder, len(manifest.shards))
                for b, (ids, mask, tokens) in enumerate(batch):
                    length = len(ids)
                    try:
                        parts, final = _encode_sample(
                            features[b, :length], last_hidden[b, :length], tokens, mask, precision, m
                        )
                    except ValueError as err:
                        raise ValueError(f"sample {number + b}: {err}") from err
                    writer.add(parts, length, final)
                    manifest.num_final_rows += final
                    manifest.num_loss_tokens += sum(mask)
                number += len(batch)
                bar.update(sum(len(ids) for ids, _, _ in batch))
            last = len(batch) < batch_size
            if writer is not None and (writer.num_tokens >= shard_tokens or last):
                info = writer.finish()
                writer = None
                manifest.shards.append(info)
                manifest.num_samples += info.num_samples
                manifest.num_tokens += info.num_tokens
                manifest.samples_sha256 = digest.hexdigest()
                manifest.complete = last
                manifest.created["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                atomic_write_bytes(folder / MANIFEST, manifest.to_json().encode())
            if last:
                break
    finally:
        if writer is not None:
            writer.abort()
        bar.close()
    if not manifest.complete:  # no samples at all, or a resume whose last shard was already final
        manifest.complete = True
        manifest.samples_sha256 = digest.hexdigest()
        atomic_write_bytes(folder / MANIFEST, manifest.to_json().encode())
    return manifest


# ------------------------------------------------------------------- reading
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class TargetCache:
    """A built cache, opened read-only and validated; ``cache[i]`` is sample i, dequantized.

    Validation on open: the manifest's format and version, that the build
    completed, the expected target and layer ids (if given), that every shard
    and index file exists with its recorded size (and sha256 if
    ``verify="checksum"``), and that every record lies inside its shard.
    Shards are memory-mapped lazily, so opening a large cache is cheap.

    expected_target: a TargetModel (compared by config fingerprint and LM-head
        digest), or a name / path string (compared with the recorded name and path).
    expected_layer_ids: the drafter's ``target_layer_ids``.
    verify: "size" (default) or "checksum" (also reads and hashes every file).
    dtype: dtype of the returned features and final hidden.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected_target: Any = None,
        expected_layer_ids: Sequence[int] | None = None,
        *,
        verify: str = "size",
        dtype: torch.dtype = torch.float32,
    ):
        if verify not in ("size", "checksum"):
            raise ValueError(f"verify={verify!r} must be 'size' or 'checksum'")
        self.path = Path(path)
        self.dtype = dtype
        self.manifest = manifest = Manifest.read(self.path)
        if not manifest.complete:
            raise ValueError(
                f"the cache in {self.path} is incomplete ({manifest.num_samples} samples in "
                f"{len(manifest.shards)} shards so far): its build was interrupted; rerun `dspark cache` to resume it"
            )
        self._check_target(expected_target, expected_layer_ids)
        self._check_files(verify)
        self._maps: dict[int, np.memmap] = {}

    # ------------------------------------------------------------ validation
    def _check_target(self, expected_target: Any, expected_layer_ids: Sequence[int] | None) -> None:
        m = self.manifest
        built = f"target {m.target.get('name')!r} with layer ids {m.target_layer_ids}"
        if expected_layer_ids is not None and list(expected_layer_ids) != m.target_layer_ids:
            raise ValueError(
                f"the cache in {self.path} was built for {built}, the config asks for layer ids "
                f"{list(expected_layer_ids)}: rebuild it with `dspark cache`"
            )
        if expected_target is None:
            return
        if isinstance(expected_target, (str, os.PathLike)):
            want = str(expected_target)
            if want not in (m.target.get("name"), m.target.get("path")):
                raise ValueError(
                    f"the cache in {self.path} was built for {built}, the config asks for target {want!r}: "
                    "rebuild it with `dspark cache`"
                )
            return
        fingerprint = target_fingerprint(expected_target)
        diff = [
            f"{k}: cache {m.target.get(k)!r}, target {fingerprint[k]!r}"
            for k in _FINGERPRINT_KEYS
            if m.target.get(k) != fingerprint[k]
        ]
        ids = list(expected_target.target_layer_ids)
        if ids != m.target_layer_ids:
            diff.append(f"target_layer_ids: cache {m.target_layer_ids}, target {ids}")
        if diff:
            raise ValueError(
                f"the cache in {self.path} was built for {built}, which does not match the given target "
                f"({'; '.join(diff)}): rebuild it with `dspark cache`"
            )

    def _check_files(self, verify: str) -> None:
        m = self.manifest
        rebuild = "delete the folder and rebuild the cache with `dspark cache`"
        index_parts = []
        for k, shard in enumerate(m.shards):
            files = ((shard.file, shard.bytes, shard.sha256), (shard.index_file, shard.index_bytes, shard.index_sha256))
            for name, size, sha in files:
                p = self.path / name
                if not p.is_file():
                    raise ValueError(f"cache file {p} is missing: {rebuild}")
                actual = p.stat().st_size
                if actual != size:
                    raise ValueError(
                        f"cache file {p} has {actual} bytes, the manifest records {size} "
                        f"(truncated or overwritten): {rebuild}"
                    )
                if verify == "checksum" and _sha256_file(p) != sha:
                    raise ValueError(f"cache file {p} fails its sha256 check (corrupted): {rebuild}")
            rows = np.fromfile(self.path / shard.index_file, dtype="<i8").reshape(-1, 3)
            if len(rows) != shard.num_samples or int(rows[:, 1].sum()) != shard.num_tokens:
                raise ValueError(
                    f"index {shard.index_file} disagrees with the manifest's counts for {shard.file}: {rebuild}"
                )
            ends = rows[:, 0] + record_bytes(rows[:, 1], rows[:, 2], m.hidden_size, m.num_captured, m.precision)
            if len(rows) and (rows[:, 0].min() < 0 or ends.max() > shard.bytes or (rows[:, 2] > rows[:, 1]).any()):
                raise ValueError(f"index {shard.index_file} points outside {shard.file}: {rebuild}")
            index_parts.append(np.column_stack([np.full(len(rows), k), rows]))
        index = np.concatenate(index_parts) if index_parts else np.zeros((0, 4), dtype=np.int64)
        if len(index) != m.num_samples:
            raise ValueError(f"the shards hold {len(index)} samples, the manifest records {m.num_samples}: {rebuild}")
        self.index = index.astype(np.int64)  # [N, 4]: shard, offset, length, num_final

    # ----------------------------------------------------------------- access
    @property
    def precision(self) -> str:
        return self.manifest.precision

    @property
    def target_layer_ids(self) -> list[int]:
        return self.manifest.target_layer_ids

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def lengths(self) -> np.ndarray:
        """Int64 [N]: tokens per sample, for length bucketing."""
        return self.index[:, 2]

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps would pickle as full copies; DataLoader workers reopen them.
        return {**self.__dict__, "_maps": {}}

    def _map(self, k: int) -> np.memmap:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.path / self.manifest.shards[k].file, dtype=np.uint8, mode="r")
        return self._maps[k]

    def read(self, i: int, dequantize: bool = True) -> dict[str, Tensor]:
        """Sample i. ``dequantize=False`` returns the stored encoding instead of
        ``features``/``final_hidden``: ``feature_values`` [S*m, d], ``feature_scales``
        [S*m] (fp8 only), ``final_values`` [F, d], ``final_scales`` [F] (fp8 only),
        for decoding elsewhere (e.g. on the GPU) with :func:`decode_rows`."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a cache of {n} samples")
        shard, offset, length, final = (int(v) for v in self.index[i])
        m, d, precision = self.manifest.num_captured, self.manifest.hidden_size, self.manifest.precision
        buf = self._map(shard)
        b, s = VALUE_BYTES[precision], SCALE_BYTES[precision]
        value_type = {"fp8": np.uint8, "bf16": "<i2", "fp32": "<f4"}[precision]

        def take(count: int, dtype: Any, itemsize: int) -> Tensor:
            nonlocal offset
            array = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).copy()
            offset += count * itemsize
            return torch.from_numpy(array)

        tokens = take(length, "<u4", 4).to(torch.int64)
        feat_values = take(length * m * d, value_type, b).view(length * m, d)
        fin_values = take(final * d, value_type, b).view(final, d)
        feat_scales = fin_scales = None
        if s:
            feat_scales, fin_scales = take(length * m, np.uint8, 1), take(final, np.uint8, 1)
        if precision == "bf16":
            feat_values, fin_values = feat_values.view(torch.bfloat16), fin_values.view(torch.bfloat16)

        loss_mask = tokens >> 31  # [S]
        has_final = torch.zeros(length, dtype=torch.bool)
        has_final[:-1] = loss_mask[:-1].bool() & loss_mask[1:].bool()
        if int(has_final.sum()) != final:
            raise ValueError(
                f"sample {i} of {self.path}: its loss mask has {int(has_final.sum())} anchor candidates but "
                f"{final} final-hidden rows are stored (corrupted cache): rebuild it with `dspark cache`"
            )
        out = {"input_ids": tokens & (MASK_BIT - 1), "loss_mask": loss_mask, "has_final": has_final}
        if not dequantize:
            return out | {
                "feature_values": feat_values,
                "feature_scales": feat_scales,
                "final_values": fin_values,
                "final_scales": fin_scales,
            }
        features = decode_rows(feat_values, feat_scales, precision, self.dtype).view(length, m * d)  # [S, m*d]
        final_hidden = torch.zeros(length, d, dtype=self.dtype)  # [S, d], zero where has_final is False
        final_hidden[has_final] = decode_rows(fin_values, fin_scales, precision, self.dtype)
        return out | {"features": features, "final_hidden": final_hidden}

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        """input_ids Long [S], loss_mask Long [S] (0/1), features [S, m*d], final_hidden [S, d]
        (zeros where has_final is False), has_final Bool [S] (= anchor candidates)."""
        return self.read(i)

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"TargetCache({str(self.path)!r}, {len(self)} samples, {m.num_tokens} tokens, {m.precision}, "
            f"target={m.target.get('name')!r}, layer_ids={m.target_layer_ids}, "
            f"{m.bytes_per_token:.0f} B/token)"
        )
