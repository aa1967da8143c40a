"""The cache on disk: file names, the manifest, the index, and the checks a reader runs on open.

A cache is a folder of ``shard-XXXXX.bin`` (one record per sample), ``index-XXXXX.bin`` (int64
[n, 3] per shard: record offset, length S, final rows F) and ``manifest.json`` (:class:`Manifest`,
one :class:`ShardInfo` per finished shard). :func:`target_fingerprint` identifies the target;
:func:`check_target`, :func:`layer_positions` and :func:`read_index` are the checks
:class:`~dspark.data.cache.reader.TargetCache` runs on open. The record layout, the manifest's
fields and what the size figures count: docs/data.md, "The feature cache" ("Files").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.data.cache.codec import check_precision, record_bytes
from dspark.io.atomic import atomic_write_bytes

FORMAT_NAME = "dspark-target-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX_ROW_BYTES = 24  # int64 offset, length, num_final
DEFAULT_SHARD_TOKENS = 65536  # shards of about a gigabyte at Qwen3-4B sizes in fp8
FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_layers", "vocab_size", "lm_head_digest")
SHARD_RE = re.compile(r"^(shard|index)-(\d{5,})\.bin(\.tmp)?$")
_REBUILD = "delete the folder and rebuild the cache with `dspark cache`"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def index_name(k: int) -> str:
    return f"index-{k:05d}.bin"


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
    version: int = FORMAT_VERSION  # written to manifest.json, checked by read()

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

    def write(self, folder: Path) -> None:
        """(Re)write ``folder/manifest.json`` atomically."""
        atomic_write_bytes(folder / MANIFEST, json.dumps(asdict(self), indent=1).encode())

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
        check_precision(manifest.precision)
        return manifest


# ------------------------------------------------------- validation on open
def layer_positions(cached_ids: Sequence[int], wanted_ids: Sequence[int], folder: Any = "the cache") -> list[int]:
    """Where each of ``wanted_ids`` sits among the cache's ``cached_ids`` (features are concatenated
    in id order, so a strictly increasing subset keeps that order)."""
    cached, wanted = list(cached_ids), list(wanted_ids)
    missing = [i for i in wanted if i not in cached]
    if missing or wanted != sorted(set(wanted)):
        raise ValueError(
            f"the cache in {folder} was built for layer ids {cached}, the config asks for {wanted}"
            + (f" ({missing} not cached)" if missing else " (not strictly increasing)")
            + ": rebuild it with `dspark cache`, or choose ids among the cached ones"
        )
    return [cached.index(i) for i in wanted]


def check_target(
    folder: Path, manifest: Manifest, expected_target: Any, expected_layer_ids: Sequence[int] | None
) -> None:
    """Raise unless the cache was built for ``expected_target`` and ``expected_layer_ids`` (None: any).

    The layer ids may be any subset of the cached ones (``layer_positions``): one cache built for
    DSpark's five layers also serves a drafter that fuses three of them (e.g. standard EAGLE-3)."""
    m = manifest
    built = f"target {m.target.get('name')!r} with layer ids {m.target_layer_ids}"
    if expected_layer_ids is not None:
        layer_positions(m.target_layer_ids, expected_layer_ids, folder)
    if expected_target is None:
        return
    if isinstance(expected_target, (str, os.PathLike)):
        want = str(expected_target)
        if want not in (m.target.get("name"), m.target.get("path")):
            raise ValueError(
                f"the cache in {folder} was built for {built}, the config asks for target {want!r}: "
                "rebuild it with `dspark cache`"
            )
        return
    fingerprint = target_fingerprint(expected_target)
    diff = [
        f"{k}: cache {m.target.get(k)!r}, target {fingerprint[k]!r}"
        for k in FINGERPRINT_KEYS
        if m.target.get(k) != fingerprint[k]
    ]
    ids = list(expected_target.target_layer_ids)
    if not set(ids) <= set(m.target_layer_ids):
        diff.append(f"target_layer_ids: cache {m.target_layer_ids}, target {ids}")
    if diff:
        raise ValueError(
            f"the cache in {folder} was built for {built}, which does not match the given target "
            f"({'; '.join(diff)}): rebuild it with `dspark cache`"
        )


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _check_file(path: Path, size: int, sha256: str, verify: str) -> None:
    if not path.is_file():
        raise ValueError(f"cache file {path} is missing: {_REBUILD}")
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(
            f"cache file {path} has {actual} bytes, the manifest records {size} (truncated or overwritten): {_REBUILD}"
        )
    if verify == "checksum" and _sha256_file(path) != sha256:
        raise ValueError(f"cache file {path} fails its sha256 check (corrupted): {_REBUILD}")


def _read_shard_index(folder: Path, manifest: Manifest, shard: ShardInfo) -> np.ndarray:
    """The index rows [n, 3] of one shard (offset, length, num_final), checked against the shard."""
    rows = np.fromfile(folder / shard.index_file, dtype="<i8").reshape(-1, 3)
    if len(rows) != shard.num_samples or int(rows[:, 1].sum()) != shard.num_tokens:
        raise ValueError(f"index {shard.index_file} disagrees with the manifest's counts for {shard.file}: {_REBUILD}")
    m = manifest
    ends = rows[:, 0] + record_bytes(rows[:, 1], rows[:, 2], m.hidden_size, m.num_captured, m.precision)
    if len(rows) and (rows[:, 0].min() < 0 or ends.max() > shard.bytes or (rows[:, 2] > rows[:, 1]).any()):
        raise ValueError(f"index {shard.index_file} points outside {shard.file}: {_REBUILD}")
    return rows


def read_index(folder: Path, manifest: Manifest, verify: str) -> np.ndarray:
    """Check every shard and index file (size, and sha256 if ``verify="checksum"``) and that every
    record lies inside its shard; returns int64 [N, 4]: shard, offset, length, num_final."""
    parts = []
    for k, shard in enumerate(manifest.shards):
        _check_file(folder / shard.file, shard.bytes, shard.sha256, verify)
        _check_file(folder / shard.index_file, shard.index_bytes, shard.index_sha256, verify)
        rows = _read_shard_index(folder, manifest, shard)
        parts.append(np.column_stack([np.full(len(rows), k), rows]))
    index = np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)
    if len(index) != manifest.num_samples:
        raise ValueError(
            f"the shards hold {len(index)} samples, the manifest records {manifest.num_samples}: {_REBUILD}"
        )
    return index.astype(np.int64)
