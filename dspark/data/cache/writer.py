"""Building the cache: run the target over the samples and write shards, resuming a killed build.

Every file is written under a temporary name and ``os.replace``d into place; the
manifest is rewritten (atomically) after each finished shard, so a killed
build resumes from its last complete shard.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from dspark.data.cache.codec import MASK_BIT, RECORD_ALIGN, check_precision, encode_rows, record_bytes
from dspark.data.cache.format import (
    DEFAULT_SHARD_TOKENS,
    FINGERPRINT_KEYS,
    INDEX_ROW_BYTES,
    MANIFEST,
    SHARD_RE,
    CacheDims,
    Manifest,
    ShardInfo,
    index_name,
    shard_name,
    target_fingerprint,
)
from dspark.io.atomic import atomic_write_bytes, fsync_dir, is_leftover

Sample = tuple[list[int], list[int], np.ndarray]  # ids, loss mask, packed uint32 tokens


# ------------------------------------------------------------------- samples
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


def _num_final(loss_mask: Sequence[int] | np.ndarray) -> int:
    mask = np.asarray(loss_mask, dtype=bool)
    return int(np.count_nonzero(mask[:-1] & mask[1:]))


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


class _SampleStream:
    """The input samples in order, checked and packed as they are drawn, with a running sha256 of them
    (what ``Manifest.samples_sha256`` records). ``count`` is the number drawn so far."""

    def __init__(self, samples: Iterable[Any]):
        self.samples = iter(samples)
        self.digest = hashlib.sha256()
        self.count = 0

    def next(self) -> Sample | None:
        try:
            sample = next(self.samples)
        except StopIteration:
            return None
        ids, mask = _ids_and_mask(sample)
        tokens = _pack_tokens(ids, mask, self.count)
        self.digest.update(len(tokens).to_bytes(8, "little"))
        self.digest.update(tokens.tobytes())
        self.count += 1
        return ids, mask, tokens

    def take(self, n: int) -> list[Sample]:
        """Up to n more samples (fewer only at the end)."""
        batch = []
        while len(batch) < n and (item := self.next()) is not None:
            batch.append(item)
        return batch


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
    check_precision(precision)
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


# ---------------------------------------------------------------- one shard
class _ShardWriter:
    """Streams records into ``shard-k.bin.tmp``, hashing as it goes; ``finish`` moves it into place."""

    def __init__(self, folder: Path, k: int):
        self.folder, self.k = folder, k
        self.path = folder / shard_name(k)
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
        atomic_write_bytes(self.folder / index_name(self.k), index)
        return ShardInfo(
            file=self.path.name,
            bytes=self.offset,
            sha256=self.hash.hexdigest(),
            index_file=index_name(self.k),
            index_bytes=len(index),
            index_sha256=hashlib.sha256(index).hexdigest(),
            num_samples=len(self.rows),
            num_tokens=self.num_tokens,
        )

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


# --------------------------------------------------------------- open/resume
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
    for key in FINGERPRINT_KEYS:
        if old.target.get(key) != new.target.get(key):
            problems.append(f"target {key} {old.target.get(key)!r} vs {new.target.get(key)!r}")
    if problems:
        raise ValueError(
            f"cannot resume the cache in {folder}: it was built with " + "; ".join(problems)
            + " (existing vs requested). Use another output folder, or resume=False to rebuild it from scratch"
        )


def _remove_cache_files(folder: Path, keep_shards: int) -> None:
    """Delete temp files and shard/index files numbered >= keep_shards (left by a killed build)."""
    for p in folder.iterdir():
        m = SHARD_RE.match(p.name)
        leftover = is_leftover(p.name) or p.name == MANIFEST + ".tmp"  # the latter: a manifest write cut short
        if leftover or (m and (m.group(3) or int(m.group(2)) >= keep_shards)):
            p.unlink()


def _open(
    folder: Path, target: Any, precision: str, shard_tokens: int, batch_size: int, resume: bool, target_name: str | None
) -> Manifest:
    """Create ``folder`` if needed and return the manifest to build on: the folder's own when resuming one
    built for the same target and precision, else a new one; shard files past it and temp files are deleted."""
    folder.mkdir(parents=True, exist_ok=True)
    new = Manifest(
        precision=precision,
        target=target_fingerprint(target, target_name),
        target_layer_ids=list(target.target_layer_ids),
        hidden_size=int(target.hidden_size),
        num_captured=len(target.target_layer_ids),
        shard_tokens=shard_tokens,
        batch_size=batch_size,
        created=_creation_info(),
    )
    manifest = new
    if resume and (folder / MANIFEST).exists():
        manifest = Manifest.read(folder)
        _check_resumable(manifest, new, folder)
    elif not resume:
        (folder / MANIFEST).unlink(missing_ok=True)
    _remove_cache_files(folder, keep_shards=len(manifest.shards))
    return manifest


def _skip_done(stream: _SampleStream, manifest: Manifest, folder: Path, bar: tqdm) -> None:
    """Draw the samples already in complete shards and check they are the ones they were built from."""
    done = manifest.num_samples
    for _ in range(done):
        if stream.next() is None:
            raise ValueError(
                f"cannot resume the cache in {folder}: it already holds {done} samples but only {stream.count} "
                "were given; pass the same samples, or resume=False to rebuild"
            )
    bar.update(sum(s.num_tokens for s in manifest.shards))
    if done and stream.digest.hexdigest() != manifest.samples_sha256:
        raise ValueError(
            f"cannot resume the cache in {folder}: the first {done} samples given differ from the ones it was "
            "built from; pass the same samples in the same order, or resume=False to rebuild"
        )


# ------------------------------------------------------------------ encoding
def _batch_forward(target: Any, batch: list[Sample]) -> tuple[Tensor, Tensor]:
    """Right-padded forward of a batch; returns features [B, S, m*d] and last_hidden [B, S, d].

    Right padding leaves the real positions unchanged: causal attention never
    looks forward, and the padded tail is masked out.
    """
    lengths = [len(ids) for ids, _, _ in batch]
    width = max(lengths)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    for b, (ids, _, _) in enumerate(batch):
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


def _add_batch(
    writer: _ShardWriter, manifest: Manifest, batch: list[Sample], features: Tensor, last_hidden: Tensor, first: int
) -> None:
    """Encode the batch's samples (numbered from ``first``) into ``writer`` and count them in ``manifest``."""
    for b, (ids, mask, tokens) in enumerate(batch):
        length = len(ids)
        try:
            parts, final = _encode_sample(
                features[b, :length], last_hidden[b, :length], tokens, mask, manifest.precision, manifest.num_captured
            )
        except ValueError as err:
            raise ValueError(f"sample {first + b}: {err}") from err
        writer.add(parts, length, final)
        manifest.num_final_rows += final
        manifest.num_loss_tokens += sum(mask)


# ------------------------------------------------------------------- writing
def _record_shard(folder: Path, manifest: Manifest, info: ShardInfo, digest: str, complete: bool) -> None:
    """Count a finished shard in the manifest and rewrite it: from now on a resume starts after it."""
    manifest.shards.append(info)
    manifest.num_samples += info.num_samples
    manifest.num_tokens += info.num_tokens
    manifest.samples_sha256 = digest
    manifest.complete = complete
    manifest.created["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    manifest.write(folder)


def _write_shards(target: Any, stream: _SampleStream, manifest: Manifest, folder: Path, bar: tqdm) -> None:
    """Forward the remaining samples batch by batch and write them; a shard is closed once it holds
    ``manifest.shard_tokens`` tokens, and after the last batch."""
    writer: _ShardWriter | None = None
    try:
        while True:
            batch = stream.take(manifest.batch_size)
            if batch:
                features, last_hidden = _batch_forward(target, batch)
                if writer is None:
                    writer = _ShardWriter(folder, len(manifest.shards))
                _add_batch(writer, manifest, batch, features, last_hidden, stream.count - len(batch))
                bar.update(sum(len(ids) for ids, _, _ in batch))
            last = len(batch) < manifest.batch_size
            if writer is not None and (writer.num_tokens >= manifest.shard_tokens or last):
                info = writer.finish()
                writer = None
                _record_shard(folder, manifest, info, stream.digest.hexdigest(), complete=last)
            if last:
                return
    finally:
        if writer is not None:
            writer.abort()


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
    check_precision(precision)
    if shard_tokens < 1 or batch_size < 1:
        raise ValueError(f"shard_tokens={shard_tokens} and batch_size={batch_size} must both be >= 1")
    folder = Path(out_dir)
    manifest = _open(folder, target, precision, shard_tokens, batch_size, resume, target_name)
    total = None
    if isinstance(samples, Sequence):
        total = sum(len(s["input_ids"] if isinstance(s, dict) else s.input_ids) for s in samples)
    stream = _SampleStream(samples)
    with tqdm(total=total, desc="cache", unit="tok", unit_scale=True, disable=not progress) as bar:
        _skip_done(stream, manifest, folder, bar)
        if manifest.complete:
            if stream.next() is not None:
                raise ValueError(
                    f"the cache in {folder} is complete with {manifest.num_samples} samples but more were given; "
                    "use resume=False to rebuild it with all of them"
                )
            return manifest
        manifest.shard_tokens, manifest.batch_size = shard_tokens, batch_size
        _write_shards(target, stream, manifest, folder, bar)
    if not manifest.complete:  # no samples at all, or a resume whose last shard was already final
        manifest.complete = True
        manifest.samples_sha256 = stream.digest.hexdigest()
        manifest.write(folder)
    return manifest
