"""Reading the cache: open a built cache (validated) and return sample i, dequantized or as stored."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dspark.data.cache.codec import MASK_BIT, SCALE_BYTES, VALUE_BYTES, decode_rows
from dspark.data.cache.format import Manifest, check_target, layer_positions, read_index


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
        check_target(self.path, manifest, expected_target, expected_layer_ids)
        # Reading a subset of the cached layers (check_target accepted it): positions among them.
        wanted = expected_layer_ids if expected_layer_ids is not None else getattr(expected_target, "target_layer_ids", None)
        self.layers = None if wanted is None else layer_positions(manifest.target_layer_ids, wanted, self.path)
        if self.layers == list(range(manifest.num_captured)):
            self.layers = None
        self.index = read_index(self.path, manifest, verify)  # [N, 4]: shard, offset, length, num_final
        self._maps: dict[int, np.memmap] = {}

    @property
    def precision(self) -> str:
        return self.manifest.precision

    @property
    def target_layer_ids(self) -> list[int]:
        """The layer ids of the features this reader returns (a subset of the cached ones, or all)."""
        ids = self.manifest.target_layer_ids
        return ids if self.layers is None else [ids[k] for k in self.layers]

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

    def _record(self, i: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """The stored parts of record i: tokens Long [S], feature values [S*m, d], final values [F, d],
        feature scales uint8 [S*m] and final scales uint8 [F] (None unless fp8)."""
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
        if self.layers is not None:  # keep the selected layers' rows (one row per position and layer)
            feat_values = feat_values.view(length, m, d)[:, self.layers].reshape(-1, d)
            if feat_scales is not None:
                feat_scales = feat_scales.view(length, m)[:, self.layers].reshape(-1)
        if precision == "bf16":
            feat_values, fin_values = feat_values.view(torch.bfloat16), fin_values.view(torch.bfloat16)
        return tokens, feat_values, fin_values, feat_scales, fin_scales

    def read(self, i: int, dequantize: bool = True) -> dict[str, Tensor]:
        """Sample i. ``dequantize=False`` returns the stored encoding instead of
        ``features``/``final_hidden``: ``feature_values`` [S*m, d], ``feature_scales``
        [S*m] (fp8 only), ``final_values`` [F, d], ``final_scales`` [F] (fp8 only),
        for decoding elsewhere (e.g. on the GPU) with :func:`decode_rows`."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a cache of {n} samples")
        tokens, feat_values, fin_values, feat_scales, fin_scales = self._record(i)
        length, final = len(tokens), len(fin_values)
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
        d, precision = self.manifest.hidden_size, self.manifest.precision
        m = len(self.target_layer_ids)
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
