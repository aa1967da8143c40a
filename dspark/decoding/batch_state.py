"""The per-row state of a batch: the target's KV cache and the drafter's context, R rows each.

``BatchKVCache``: one tensor per layer, [R, H_kv, S, d_h], in which column c of row r holds that
row's position c. A forward writes each row's new tokens at the row's own next columns, and a
commit keeps the accepted ones by moving the row's length past them: the rejected drafts and the
padding of a short row stay behind its length, unread, and the next forward writes over them. So a
row's tokens are always its first columns, with no holes to mask or compact, and a forward's
attention reads row r's first n_r + q columns (``dspark.kernels.attention.row_extents``). The
columns live in a buffer with spare capacity (``ColumnLayer``), so a forward writes in place:
appending by concatenation would copy the whole cache of every layer on every forward, which at
R rows costs more than the attention that reads it. The drafter's context (``DraftContext`` /
``Eagle3Context``, per-row lengths) is a dataclass of batch-first tensors: ``put_row``,
``select_rows`` and ``add_ctx_row`` write, keep and append its rows. ``dspark.decoding.batched``
steps both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

__all__ = ["BatchKVCache", "ColumnLayer", "add_ctx_row", "column_cache", "put_row", "select_rows"]

_ATTENTION_KINDS = ("full_attention", "sliding_attention")


class ColumnLayer(DynamicLayer):
    """A transformers ``DynamicLayer`` whose K/V live in a buffer [R_cap, H_kv, S_cap, d_h] with
    spare rows and columns; ``keys`` / ``values`` are views of its first R rows and S columns.

    ``update`` writes a forward's new columns in place and ``add_row`` takes a spare row, so a
    forward costs a write of its own columns, not a copy of the whole cache (a buffer that is
    full is replaced by one half as large again). By default a forward's columns follow the S in
    use, the same for every row; with ``at`` set (``BatchKVCache``) row r's go to its own columns
    at[r] .. at[r] + q − 1. The buffer starts as zeros, so every entry of a view holds a finite
    value even where nothing was written: a masked column must, since attention weighs it by 0."""

    at: Tensor | None = None  # [R] the first column each row's new tokens go to (None: after S)
    at_end: int | None = None  # max(at) + q when the caller knows it (no device sync per layer)

    def store(self, keys: Tensor, values: Tensor, columns: int = 0, rows: int = 0) -> None:
        """Hold ``keys`` / ``values`` [R, H, S, d] in a new buffer of at least ``rows`` rows and
        ``columns`` columns."""
        r, h, s, d = (int(n) for n in keys.shape)
        self._k = keys.new_zeros(max(r, int(rows)), h, max(s, int(columns)), d)
        self._v = values.new_zeros(max(r, int(rows)), h, max(s, int(columns)), d)
        self._k[:r, :, :s] = keys
        self._v[:r, :, :s] = values
        self.device, self.is_initialized = keys.device, True
        self._use(r, s)

    def _use(self, rows: int, columns: int) -> None:
        self.keys, self.values = self._k[:rows, :, :columns], self._v[:rows, :, :columns]

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the buffer holds."""
        return int(self._k.shape[0]), int(self._k.shape[2])

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) in use."""
        return int(self.keys.shape[0]), int(self.keys.shape[2])

    def _reserve(self, rows: int, columns: int) -> None:
        cap_rows, cap_columns = self.capacity
        if rows > cap_rows or columns > cap_columns:
            self.store(self.keys, self.values, columns + columns // 2 + 32 if columns > cap_columns else cap_columns,
                       rows + rows // 2 + 1 if rows > cap_rows else cap_rows)

    def add_row(self) -> None:
        """Append a row of zeros."""
        rows, columns = self.shape
        self._reserve(rows + 1, columns)
        self._k[rows, :, :columns] = 0
        self._v[rows, :, :columns] = 0
        self._use(rows + 1, columns)

    def widen(self, extra: int) -> None:
        """Use ``extra`` more columns (zeros where nothing was written)."""
        rows, columns = self.shape
        self._reserve(rows, columns + extra)
        self._use(rows, columns + extra)

    def select_rows(self, index: Tensor) -> None:
        """Keep rows ``index`` (Long [R']), in that order, in the same buffer."""
        keys, values = self.keys[index], self.values[index]  # copies: the buffer may be overwritten
        self._k[: len(index), :, : keys.shape[2]] = keys
        self._v[: len(index), :, : keys.shape[2]] = values
        self._use(len(index), int(keys.shape[2]))

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.store(key_states[:, :, :0], value_states[:, :, :0])

    def batch_select_indices(self, indices: Tensor) -> None:
        """transformers' row selection, on the buffer (``select_rows``)."""
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """transformers' row repetition, into a new buffer."""
        self.store(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0),
                   self.capacity[1])

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
               ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, columns = self.shape
        new = int(key_states.shape[2])
        if self.at is None:
            self._reserve(rows, columns + new)
            self._k[:rows, :, columns:columns + new] = key_states
            self._v[:rows, :, columns:columns + new] = value_states
            self._use(rows, columns + new)
            return self.keys, self.values
        # row r's new columns at at[r] + 0..q-1; the view spans the longest row's
        width = self.at_end if self.at_end is not None else int(self.at.max()) + new
        self._reserve(rows, width)
        self._use(rows, width)
        rows_index = torch.arange(rows, device=self.at.device).view(-1, 1)  # [R, 1]
        columns_index = self.at.view(-1, 1) + torch.arange(new, device=self.at.device)  # [R, q]
        self.keys[rows_index, :, columns_index] = key_states.transpose(1, 2)  # indexed as [R, q, H, d]
        self.values[rows_index, :, columns_index] = value_states.transpose(1, 2)
        return self.keys, self.values


def column_cache(cache: Any, columns: int) -> Any:
    """Turn the layers of a filled transformers ``DynamicCache`` into ``ColumnLayer``s with room for
    ``columns`` columns (same keys and values), in place; returns ``cache``. Cropping still works: a
    crop shortens the views and the next forward writes after them."""
    layers = []
    for layer in cache.layers:
        column = ColumnLayer()
        column.store(layer.keys, layer.values, columns)
        layers.append(column)
    cache.layers = layers
    return cache


# ---------------------------------------------------------------------------
# The target's cache of a batch
# ---------------------------------------------------------------------------


class BatchKVCache:
    """A transformers ``DynamicCache`` of R rows, row r holding positions 0 .. n_r − 1 in its
    first n_r columns (module docstring).

    next_pos [R]: n_r, the position (and column) of the row's next token. ``forward`` runs the
    target over [R, q] new tokens (row r's first ``counts[r]`` real, the rest padding) at positions
    and columns n_r + 0..q−1 under the mask "column ≤ the query's position" (and within the window
    on sliding-window layers); ``commit`` then keeps the first ``keep[r]`` of them. Every row can
    be cropped, sliding-window layers included (they keep every column; the window is a mask).
    """

    def __init__(self, target: Any) -> None:
        from transformers import DynamicCache

        self.target = target
        self.cache = DynamicCache()
        self.next_pos = torch.zeros(0, dtype=torch.long, device=target.device)
        self._pending = False  # a forward not yet committed or discarded
        config = target.text_config
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"])
        unknown = sorted(set(kinds) - set(_ATTENTION_KINDS))
        if unknown:
            raise ValueError(f"batched decoding supports {list(_ATTENTION_KINDS)} layers; the target has {unknown}: "
                             "decode it at batch size 1 (eval.batch_size = 1)")
        self.window = int(config.sliding_window) if "sliding_attention" in kinds else None
        self.kinds = sorted(set(kinds))
        impl = str(getattr(target.model.config, "_attn_implementation", "") or "")
        self._boolean_mask = "sdpa" in impl

    @property
    def rows(self) -> int:
        return int(self.next_pos.shape[0])

    @property
    def columns(self) -> int:
        """Columns in use: the longest row's tokens."""
        return int(self.next_pos.max()) if self.rows else 0

    def _layers(self) -> list[Any]:
        return list(self.cache.layers)

    def lengths(self) -> Tensor:
        """[R] tokens each row holds."""
        return self.next_pos.clone()

    def _fit(self) -> None:
        """Every layer's view spans the rows and the columns in use."""
        for layer in self._layers():
            if getattr(layer, "is_initialized", False):
                layer._use(self.rows, self.columns)

    # -------------------------------------------------------------- rows
    @torch.inference_mode()
    def add_row(self) -> int:
        """Append an empty row (no tokens); returns its index."""
        r = self.rows
        self.next_pos = torch.cat([self.next_pos, self.next_pos.new_zeros(1)])
        for layer in self._layers():
            if getattr(layer, "is_initialized", False):
                layer.add_row()
        return r

    @torch.inference_mode()
    def write_row(self, row: int, single: Any) -> None:
        """Put the prompt cache of one request (a batch-1 ``DynamicCache`` of P tokens, positions
        0..P−1) into row ``row``, which forgets what it held."""
        layers = list(single.layers)
        length = int(layers[0].keys.shape[-2])
        if not self._layers() or not getattr(self._layers()[0], "is_initialized", False):
            self._init_from(layers)
        for mine, theirs in zip(self._layers(), layers):
            if length > mine.shape[1]:
                mine.widen(length - mine.shape[1])
            mine.keys[row, :, :length] = theirs.keys[0]
            mine.values[row, :, :length] = theirs.values[0]
        self.next_pos[row] = length
        self._fit()

    def _init_from(self, layers: Sequence[Any]) -> None:
        """The per-layer buffers (``ColumnLayer``), [R, H_kv, 0, d_h], shaped after a request's prompt cache."""
        rows = self.rows
        self.cache.layers = []
        for theirs in layers:
            layer = ColumnLayer()
            layer.store(theirs.keys.new_zeros(rows, theirs.keys.shape[1], 0, theirs.keys.shape[3]),
                        theirs.values.new_zeros(rows, theirs.values.shape[1], 0, theirs.values.shape[3]))
            self.cache.layers.append(layer)

    @torch.inference_mode()
    def select(self, rows: Tensor) -> None:
        """Keep the rows ``rows`` (Long [R']), in that order."""
        self.next_pos = self.next_pos[rows]
        for layer in self._layers():
            layer.select_rows(rows)
        self._fit()

    # ------------------------------------------------------------ forward
    def forward(self, tokens: Tensor, counts: Tensor, *, logits: bool = True) -> Any:
        """The target over tokens [R, q]: row r's first counts[r] tokens are real (counts ≥ 1).
        Returns the ``TargetOutput`` ([R, q, ...]; padded positions hold garbage)."""
        from dspark.kernels.attention import row_extents

        rows, q = tokens.shape
        device = tokens.device
        steps = torch.arange(q, device=device)
        qpos = self.next_pos.unsqueeze(1) + steps  # [R, q]: positions, and the columns the tokens go to
        extents = (self.next_pos + q).tolist()  # row r's attention reads its first n_r + q columns
        cols = torch.arange(max(extents), device=device)
        # Query (r, i) sees row r's columns 0 .. n_r + i: its past and the block's tokens up to itself.
        # A padded query sees the padding before it too; its output is never read.
        allowed = cols.view(1, 1, -1) <= qpos.unsqueeze(2)  # [R, q, W]
        # sdpa takes a boolean mask (what transformers itself builds for it, so a batch of one row runs
        # the same kernel as batch-1 decoding); eager attention adds the mask, so it gets 0 / min.
        dtype = self.target.dtype
        boolean = self._boolean_mask

        def additive(ok: Tensor) -> Tensor:
            if boolean:
                return ok.unsqueeze(1)
            return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, torch.finfo(dtype).min).unsqueeze(1)

        full = additive(allowed)
        mask: Any = full
        if self.window is not None:
            near = (qpos.unsqueeze(2) - cols.view(1, 1, -1)) < self.window
            mask = {"full_attention": full, "sliding_attention": additive(allowed & near)}
        layers = self._layers()
        for layer in layers:
            layer.at, layer.at_end = self.next_pos, max(extents)
        try:
            with row_extents(extents, self.target.dtype):
                out = self.target(tokens, past_key_values=self.cache, attention_mask=mask, position_ids=qpos,
                                  use_cache=True, return_logits=logits)
        finally:
            for layer in self._layers():  # the forward may have initialised the layers
                layer.at = layer.at_end = None
        self._pending = True
        return out

    def discard(self) -> None:
        """Forget the last forward: the cache is what it was before it (its columns lie past every
        row's length; what a timed forward of ``dspark.scheduling.sps_profile`` leaves behind)."""
        self._pending = False
        self._fit()

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` more columns in every layer's buffer, so that forwards of up to ``extra``
        tokens write in place."""
        for layer in self._layers():
            layer._reserve(self.rows, self.columns + int(extra))

    def crop(self, lengths: Tensor) -> None:
        """Row r keeps its first lengths[r] (≤ n_r) tokens."""
        if bool((lengths > self.next_pos).any()) or bool((lengths < 0).any()):
            raise ValueError(f"crop to {lengths.tolist()}: a row keeps 0 .. its {self.next_pos.tolist()} tokens")
        self.next_pos = lengths.to(self.next_pos)
        self._fit()

    def commit(self, keep: Tensor) -> None:
        """Keep the first keep[r] (≤ counts[r]) tokens of row r's last forward; the rest lie past the
        row's length, where the next forward writes."""
        if not self._pending:
            raise RuntimeError("commit() without a forward()")
        self._pending = False
        self.next_pos = self.next_pos + keep
        self._fit()


# ---------------------------------------------------------------------------
# The drafter context of a batch (dataclasses of batch-first tensors)
# ---------------------------------------------------------------------------


def put_row(ctx: Any, row: int, single: Any) -> None:
    """Write the one-row context ``single`` into row ``row`` of ``ctx`` (same dataclass), growing
    ``ctx`` along any dimension where ``single`` is larger. Works for every drafter context that
    is a dataclass of batch-first tensors (or lists of them): ``DraftContext``, ``Eagle3Context``.
    Entries of the row beyond ``single``'s are reset (−1 for integer tensors, 0 otherwise)."""
    for f in dataclasses.fields(ctx):
        mine, theirs = getattr(ctx, f.name), getattr(single, f.name)
        if isinstance(mine, list):
            setattr(ctx, f.name, [_put(m, row, t) for m, t in zip(mine, theirs)])
        elif isinstance(mine, Tensor):
            setattr(ctx, f.name, _put(mine, row, theirs))


def _put(mine: Tensor, row: int, theirs: Tensor) -> Tensor:
    if mine.dim() == 1:
        mine[row] = theirs[0]
        return mine
    fill = -1 if not mine.is_floating_point() and mine.dtype != torch.bool else 0
    for dim in range(1, mine.dim()):
        extra = theirs.shape[dim] - mine.shape[dim]
        if extra > 0:
            shape = list(mine.shape)
            shape[dim] = extra
            mine = torch.cat([mine, mine.new_full(shape, fill)], dim=dim)
    mine[row] = fill
    mine[(row, *[slice(0, n) for n in theirs.shape[1:]])] = theirs[0]
    return mine


def select_rows(ctx: Any, rows: Tensor) -> None:
    """Keep rows ``rows`` (Long [R']) of a drafter context, in that order."""
    for f in dataclasses.fields(ctx):
        value = getattr(ctx, f.name)
        if isinstance(value, list):
            setattr(ctx, f.name, [t[rows] for t in value])
        elif isinstance(value, Tensor):
            setattr(ctx, f.name, value[rows])


def add_ctx_row(ctx: Any) -> None:
    """Append one empty row to a drafter context (length 0)."""
    for f in dataclasses.fields(ctx):
        value = getattr(ctx, f.name)
        grow = (lambda t: torch.cat([t, t.new_full((1, *t.shape[1:]), 0 if t.dim() == 1 else
                                                   (-1 if not t.is_floating_point() else 0))]))
        if isinstance(value, list):
            setattr(ctx, f.name, [grow(t) for t in value])
        elif isinstance(value, Tensor):
            setattr(ctx, f.name, grow(value))
