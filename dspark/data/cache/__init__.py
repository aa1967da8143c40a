"""Offline target cache: the target's features, written once, read every epoch (DeepSpec's offline mode).

Per sample it holds the token ids and loss mask, the captured target layers H^{l_1..l_m} at every
position (the drafter's context, Eq. 2) and the target's final hidden state at the anchor-candidate
rows only (``loss_mask[j] and loss_mask[j+1]``: the positions whose p^t is a training target), in
fp8, bf16 or fp32 (``data.cache_precision``).

Modules: ``codec`` (the fp8 / bf16 / fp32 row encodings and byte sizes),
``format`` (files, manifest, index, validation on open), ``writer``
(:func:`build_cache`, resume) and ``reader`` (:class:`TargetCache`).

Why the final hidden is stored at candidate rows only, the bytes per token of each precision
against DeepSpec's, and what fp8 costs in precision: docs/data.md, "The feature cache".
"""

from dspark.data.cache.codec import PRECISIONS, bytes_per_token, decode_rows, encode_rows, record_bytes
from dspark.data.cache.format import FORMAT_NAME, FORMAT_VERSION, CacheDims, Manifest, ShardInfo, target_fingerprint
from dspark.data.cache.reader import TargetCache
from dspark.data.cache.writer import build_cache, estimate_cache_size

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
