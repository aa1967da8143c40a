"""Offline target cache: the target's features, written once, read every epoch (DeepSpec's offline mode).

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
DeepSpec stores 30,726 bytes/token at these sizes (int32 id, u8 mask,
bf16 layers, bf16 final hidden at every token). fp8 is at most 15,370 (f = 1,
which no real sample reaches: prompts are outside the loss mask and the last
token is never a candidate), 7 bytes over half of DeepSpec (15,363); it stays
within the half while f <= 2554/2561 = 0.9973. ``bench/cache_size.py`` prints the
table and measures f on SmolLM2's greedy answers to the built-in prompts.

Precision: ``bench/cache_size.py`` also measures, on SmolLM2-135M against fp32, the
relative L2 error of fp8 features and of the final hidden, and the total variation
it puts on p^t at the candidate positions, next to that of running the target
itself in bf16 (results in bench/README.md).

Modules: ``codec`` (the fp8 / bf16 / fp32 row encodings and byte sizes),
``format`` (files, manifest, index, validation on open), ``writer``
(:func:`build_cache`, resume) and ``reader`` (:class:`TargetCache`).
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
