"""Batched speculative decoding: many requests per drafter forward and per target forward (paper Section 2.1, 3.2.2).

``SpeculativeBatch`` holds the live requests of a batch as rows. A round drafts
every row in one drafter forward and verifies every row in one target forward
with its own length ℓ_r: the rows are ragged, padded to 1 + max ℓ, and each row
attends only to its own tokens through a 4-D mask built from per-row positions.
``TargetBatch`` is the target-only baseline on the same machinery (every row
one token per step), so that speculative decoding at R rows is compared with
target-only decoding at R rows.

Per-row state, so that every request's tokens are the ones batch-1 decoding
(``dspark.decoding.loop``) gives with the same seed:

- its own ``torch.Generator``: the drafter samples each row from that row's
  generator (``dspark.sampling.uniforms``), and each row is verified with its own
  call of ``verify_draft`` on its own slices, so the draws come in batch-1 order;
- its own KV cache columns (``BatchKVCache``): the cache is one tensor per layer,
  [R, H_kv, S, d_h]; the columns a forward appends are shared by all rows, so
  the padding of short rows and the rejected drafts of every row become holes,
  masked from then on and dropped when the cache is compacted. Column order
  means nothing: the mask compares positions, so a freed row can take a new
  request's prompt in its first columns;
- its own drafter context row (``DraftContext`` / ``Eagle3Context``: per-row lengths).

Admission is continuous: a finished request frees its row, ``admit`` prefills
the next request alone (batch 1, the same forward as ``dspark.decoding.loop``)
and writes its cache and drafter context into the free row; ``shrink`` drops
rows left free when no request waits.

Timing: one ``PhaseClock`` for the batch (prefill, draft, verify, accept,
bookkeeping). Each request's ``timings`` hold its own prefill and its share of
every batched phase (a step's seconds over the rows it served), so the shares of
all requests add up to the batch's wall clock and Σ tokens / Σ wall_s over the
requests is the batch's throughput.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dspark.decoding.loop import (
    DecodeResult,
    PhaseClock,
    RoundRecord,
    _check_generate_args,
    _checked_verify_length,
    _first_eos,
)
from dspark.decoding.verify import verify_draft
from dspark.sampling import sample_token

__all__ = ["BatchKVCache", "BatchRow", "SpeculativeBatch", "TargetBatch", "put_row", "select_rows"]

_ATTENTION_KINDS = ("full_attention", "sliding_attention")


# ---------------------------------------------------------------------------
# The target's cache of a batch
# ---------------------------------------------------------------------------


class BatchKVCache:
    """A transformers ``DynamicCache`` of R rows with per-row validity and positions.

    valid [R, S] bool: column s of row r holds one of that row's tokens; pos [R, S]: its
    position; next_pos [R]: the position of the row's next token. ``forward`` runs the
    target over [R, q] new tokens (row r's first ``counts[r]`` real, the rest padding) at
    positions next_pos[r] + 0..q−1 under the mask "same row, valid, position ≤ the
    query's" (and within the window on sliding-window layers); ``commit`` then keeps the
    first ``keep[r]`` of them. Sliding-window layers keep every column (the window is a
    mask), so any row can be cropped.
    """

    def __init__(self, target: Any) -> None:
        from transformers import DynamicCache

        self.target = target
        self.cache = DynamicCache()
        device = target.device
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(0, dtype=torch.long, device=device)
        self._pending: tuple[Tensor, Tensor] | None = None  # (positions [R, q], real [R, q]) of the last forward
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
        return int(self.valid.shape[1])

    def _layers(self) -> list[Any]:
        return list(self.cache.layers)

    def lengths(self) -> Tensor:
        """[R] tokens each row holds."""
        return self.valid.sum(dim=1)

    # -------------------------------------------------------------- rows
    def add_row(self) -> int:
        """Append an empty row (no valid column); returns its index."""
        r = self.rows
        self.valid = torch.cat([self.valid, self.valid.new_zeros(1, self.columns)])
        self.pos = torch.cat([self.pos, self.pos.new_zeros(1, self.columns)])
        self.next_pos = torch.cat([self.next_pos, self.next_pos.new_zeros(1)])
        for layer in self._layers():
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(1, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(1, *layer.values.shape[1:])])
        return r

    def write_row(self, row: int, single: Any) -> None:
        """Put the prompt cache of one request (a batch-1 ``DynamicCache`` of P tokens, positions
        0..P−1) into row ``row``, which forgets what it held."""
        layers = list(single.layers)
        length = int(layers[0].keys.shape[-2])
        if not self._layers() or not getattr(self._layers()[0], "is_initialized", False):
            self._init_from(layers)
        if length > self.columns:
            self._grow(length - self.columns)
        for mine, theirs in zip(self._layers(), layers):
            mine.keys[row, :, :length] = theirs.keys[0]
            mine.values[row, :, :length] = theirs.values[0]
        cols = torch.arange(self.columns, device=self.valid.device)
        self.valid[row] = cols < length
        self.pos[row] = torch.where(cols < length, cols, 0)
        self.next_pos[row] = length

    def _init_from(self, layers: Sequence[Any]) -> None:
        """The per-layer tensors, [R, H_kv, 0, d_h], shaped after a request's prompt cache."""
        from transformers.cache_utils import DynamicLayer

        rows = self.rows
        self.cache.layers = []
        for theirs in layers:
            layer = DynamicLayer()
            layer.lazy_initialization(theirs.keys, theirs.values)
            layer.keys = theirs.keys.new_zeros(rows, theirs.keys.shape[1], 0, theirs.keys.shape[3])
            layer.values = theirs.values.new_zeros(rows, theirs.values.shape[1], 0, theirs.values.shape[3])
            self.cache.layers.append(layer)

    def _grow(self, extra: int) -> None:
        """Append ``extra`` invalid columns to every row."""
        self.valid = torch.cat([self.valid, self.valid.new_zeros(self.rows, extra)], dim=1)
        self.pos = torch.cat([self.pos, self.pos.new_zeros(self.rows, extra)], dim=1)
        for layer in self._layers():
            pad = layer.keys.new_zeros(*layer.keys.shape[:2], extra, layer.keys.shape[3])
            layer.keys = torch.cat([layer.keys, pad], dim=2)
            layer.values = torch.cat([layer.values, pad], dim=2)

    def select(self, rows: Tensor) -> None:
        """Keep the rows ``rows`` (Long [R']), in that order."""
        self.valid, self.pos, self.next_pos = self.valid[rows], self.pos[rows], self.next_pos[rows]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]

    def compact(self) -> None:
        """Move every row's valid columns to the front, in position order, and drop the columns no
        row uses (the holes of padding and rejected drafts)."""
        counts = self.lengths()
        width = int(counts.max()) if self.rows else 0
        # Valid columns first, by position; invalid ones after them.
        key = torch.where(self.valid, self.pos, torch.iinfo(torch.long).max)
        order = key.argsort(dim=1, stable=True)[:, :width]  # [R, width]
        self.valid = self.valid.gather(1, order)
        self.pos = self.pos.gather(1, order)
        for layer in self._layers():
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)

    def maybe_compact(self, slack: int = 16) -> None:
        """Compact once the holes outnumber ``slack`` columns plus an eighth of the longest row: every
        forward reads (and the cache's append copies) every column, holes included, so a few holes
        cost less than the gather that removes them, many cost more."""
        if not self.rows:
            return
        longest = int(self.lengths().max())
        if self.columns - longest > slack + longest // 8:
            self.compact()

    # ------------------------------------------------------------ forward
    def forward(self, tokens: Tensor, counts: Tensor, *, logits: bool = True) -> Any:
        """The target over tokens [R, q]: row r's first counts[r] tokens are real (counts ≥ 1).
        Returns the ``TargetOutput`` ([R, q, ...]; padded positions hold garbage)."""
        rows, q = tokens.shape
        device = tokens.device
        steps = torch.arange(q, device=device)
        qpos = self.next_pos.unsqueeze(1) + steps  # [R, q]
        real = steps.unsqueeze(0) < counts.unsqueeze(1)  # [R, q]
        kpos = torch.cat([self.pos, qpos], dim=1)  # [R, S+q]
        kvalid = torch.cat([self.valid, real], dim=1)  # [R, S+q]
        allowed = kvalid.unsqueeze(1) & (kpos.unsqueeze(1) <= qpos.unsqueeze(2))  # [R, q, S+q]
        # A padded query still sees its own row's past (every row holds ≥ 1 token): no empty softmax row.
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
            near = (qpos.unsqueeze(2) - kpos.unsqueeze(1)) < self.window
            mask = {"full_attention": full, "sliding_attention": additive(allowed & near)}
        out = self.target(tokens, past_key_values=self.cache, attention_mask=mask, position_ids=qpos,
                          use_cache=True, return_logits=logits)
        self._pending = (qpos, real)
        return out

    def commit(self, keep: Tensor) -> None:
        """Keep the first keep[r] (≤ counts[r]) tokens of row r's last forward; the rest become holes."""
        if self._pending is None:
            raise RuntimeError("commit() without a forward()")
        qpos, real = self._pending
        self._pending = None
        kept = torch.arange(qpos.shape[1], device=qpos.device).unsqueeze(0) < keep.unsqueeze(1)
        self.valid = torch.cat([self.valid, kept & real], dim=1)
        self.pos = torch.cat([self.pos, qpos], dim=1)
        self.next_pos = self.next_pos + keep


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


def _add_ctx_row(ctx: Any) -> None:
    """Append one empty row to a drafter context (length 0)."""
    for f in dataclasses.fields(ctx):
        value = getattr(ctx, f.name)
        grow = (lambda t: torch.cat([t, t.new_full((1, *t.shape[1:]), 0 if t.dim() == 1 else
                                                   (-1 if not t.is_floating_point() else 0))]))
        if isinstance(value, list):
            setattr(ctx, f.name, [grow(t) for t in value])
        elif isinstance(value, Tensor):
            setattr(ctx, f.name, grow(value))


# ---------------------------------------------------------------------------
# Requests and the speculative batch
# ---------------------------------------------------------------------------


@dataclass
class BatchRow:
    """One request of a batch: its prompt, the tokens so far, its rounds, its generator, its tag
    (any value the caller keys it by) and its timings (own prefill + share of batched phases)."""

    tag: Any
    prompt_len: int
    max_new_tokens: int
    generator: torch.Generator | None
    eos: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    admitted_at: float = 0.0
    latency_s: float = math.nan

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (bool(self.tokens) and self.tokens[-1] in self.eos)

    def result(self) -> DecodeResult:
        """The request's DecodeResult; timings["total"] is its share of the batch's wall clock."""
        finished = bool(self.tokens) and self.tokens[-1] in self.eos
        timings = {**self.timings, "total": sum(self.timings.values())}
        return DecodeResult(self.prompt_len, list(self.tokens), list(self.rounds), finished, timings)


class _Batch:
    """What the speculative and target-only batches share: rows, admission, the cache, timing."""

    def __init__(self, target: Any, *, max_new_tokens: int, temperature: float = 1.0,
                 eos_token_ids: Iterable[int] = ()) -> None:
        _check_generate_args([0], max_new_tokens, temperature)
        self.target = target
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.kv = BatchKVCache(target)
        self.rows: list[BatchRow | None] = []  # None: a free row
        self.anchor = torch.zeros(0, dtype=torch.long, device=target.device)  # [R] x_0 of every row
        self.clock = PhaseClock(target.device)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    def free_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def _prefill(self, prompt_ids: Sequence[int], request: BatchRow) -> Any:
        """Prefill one request alone (batch 1: the same forward as ``dspark.decoding.loop``) and draw x_0."""
        from transformers import DynamicCache

        start = time.perf_counter()
        with self.clock("prefill"):
            single = DynamicCache()
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            out = self.target(ids, past_key_values=single, use_cache=True, logits_to_keep=1)
            anchor = sample_token(out.logits[:, -1], self.temperature, request.generator)  # [1]
            request.tokens.append(int(anchor))
        request.timings["prefill"] = time.perf_counter() - start
        return single, out, anchor

    def _place(self, request: BatchRow, single: Any, anchor: Tensor) -> int:
        """Put a prefilled request into a free row (or a new one); returns the row."""
        free = self.free_rows()
        if free:
            row = free[0]
        else:
            row = self.kv.add_row()
            self.rows.append(None)
            self.anchor = torch.cat([self.anchor, anchor.new_zeros(1)])
            self._add_row()
        self.kv.write_row(row, single)
        self.rows[row] = request
        self.anchor[row] = anchor[0]
        return row

    def _add_row(self) -> None:
        """Grow whatever else the subclass keeps per row."""

    def shrink(self) -> None:
        """Drop the free rows (when no request waits for them)."""
        keep = [i for i, r in enumerate(self.rows) if r is not None]
        if len(keep) == len(self.rows):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.kv.select(index)
        self.anchor = self.anchor[index]
        self._select(index)
        self.rows = [self.rows[i] for i in keep]

    def _select(self, index: Tensor) -> None:
        """Keep rows ``index`` of whatever else the subclass keeps per row."""

    def _share(self, before: dict[str, float], rows: Sequence[BatchRow]) -> None:
        """Give each of ``rows`` an equal share of the phase seconds recorded since ``before``."""
        if not rows:
            return
        for phase, seconds in self.clock.totals.items():
            spent = seconds - before.get(phase, 0.0)
            if phase == "prefill" or spent <= 0:
                continue
            for request in rows:
                request.timings[phase] = request.timings.get(phase, 0.0) + spent / len(rows)

    def _retire(self, served: Sequence[BatchRow], before: dict[str, float]) -> list[BatchRow]:
        """After a step over ``served`` (the rows in order): free the rows of the finished requests,
        share the step's phase seconds among every served request; returns the finished ones."""
        finished = []
        for row, request in enumerate(served):
            if request.done:
                request.latency_s = time.perf_counter() - request.admitted_at
                finished.append(request)
                self.rows[row] = None
        self._share(before, served)
        return finished


class SpeculativeBatch(_Batch):
    """Speculative decoding of up to R requests at once (module docstring).

    Use::

        batch = SpeculativeBatch(target, drafter, max_new_tokens=..., temperature=..., eos_token_ids=...)
        batch.admit(prompt_ids, generator, tag)   # until the rows you want are full
        while batch.live:
            batch.draft()                         # one drafter forward over every row
            finished = batch.verify(lengths)      # one target forward; lengths [R] (None: γ each)
            ...admit waiting requests into the freed rows, then batch.shrink()

    Invariant at the start of every round, per row: the target cache and the drafter context
    hold positions 0 .. P+n−2 of the row's request and its anchor x_0 (the last token) sits at
    P+n−1, exactly as in ``dspark.decoding.loop.SpeculativeRequest``.
    """

    def __init__(self, target: Any, drafter: Any, *, max_new_tokens: int, temperature: float = 1.0,
                 eos_token_ids: Iterable[int] = ()) -> None:
        super().__init__(target, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids)
        self.drafter = drafter
        self.ctx = drafter.new_context(0, target.device, capacity=1)
        self.proposal: Any = None
        self.drafting: list[bool] | None = None
        self._scratch = torch.Generator(device=target.device)  # the draws of rows that do not draft

    def _add_row(self) -> None:
        _add_ctx_row(self.ctx)

    def _select(self, index: Tensor) -> None:
        select_rows(self.ctx, index)

    @torch.inference_mode()
    def admit(self, prompt_ids: Sequence[int], generator: torch.Generator | None = None,
              tag: Any = None) -> BatchRow:
        """Prefill a request and give it a free row (a new one when none is free). A request
        that is done at once (x_0 is an EOS, or max_new_tokens = 1) takes no row; check ``done``."""
        if self.proposal is not None:
            raise RuntimeError("admit() between draft() and verify(); admit after verify()")
        _check_generate_args(prompt_ids, self.max_new_tokens, self.temperature)
        request = BatchRow(tag, len(prompt_ids), self.max_new_tokens, generator, self.eos,
                           admitted_at=time.perf_counter())
        single, out, anchor = self._prefill(prompt_ids, request)
        if request.done:
            request.latency_s = time.perf_counter() - request.admitted_at
            return request
        start = time.perf_counter()
        with self.clock("prefill"):
            one = self.drafter.new_context(1, self.device, capacity=len(prompt_ids) + self.max_new_tokens)
            _extend(self.drafter, one, out.features, torch.tensor([list(prompt_ids)], device=self.device))
            self._place(request, single, anchor)
            put_row(self.ctx, self.rows.index(request), one)
        request.timings["prefill"] += time.perf_counter() - start
        return request

    @property
    def gamma(self) -> int:
        return int(self.proposal.tokens.shape[1])

    @torch.inference_mode()
    def draft(self, drafting: Sequence[bool] | None = None) -> Any:
        """Draft a block for every row in one drafter forward (a free row must not exist: ``shrink``
        first). ``drafting``: which rows draft (default all); the others are drafted from a scratch
        generator, so their own streams are untouched, and must verify ℓ = 0."""
        if self.proposal is not None:
            raise RuntimeError("draft() called twice without verify(); each round drafts once")
        if any(r is None for r in self.rows) or not self.rows:
            raise RuntimeError("draft() with free rows; call shrink() (or admit into them) first")
        self.drafting = [True] * len(self.rows) if drafting is None else [bool(d) for d in drafting]
        if len(self.drafting) != len(self.rows):
            raise ValueError(f"drafting has {len(self.drafting)} entries for the batch's {len(self.rows)} rows")
        if not any(self.drafting):  # a plain target step for every row: no drafter forward
            self.proposal = _no_draft(len(self.rows), int(self.target.vocab_size), self.device)
            return self.proposal
        gens = [r.generator if d else self._scratch for r, d in zip(self.rows, self.drafting)]
        if any(g is None for g in gens):
            gens = None  # rows without generators draw from the global stream, like batch 1
        before = dict(self.clock.totals)
        with self.clock("draft"):
            self.proposal = self.drafter.propose(self.ctx, self.anchor, temperature=self.temperature, generator=gens)
        self._share(before, self.rows)
        return self.proposal

    def confidences(self) -> list[list[float] | None]:
        """c_1..c_γ of every row's pending draft (None without a confidence head or for a row not drafting)."""
        c = self.proposal.confidences
        rows = c.tolist() if c is not None else [None] * len(self.rows)
        return [row if d else None for row, d in zip(rows, self.drafting)]

    @torch.inference_mode()
    def verify(self, lengths: Sequence[int] | None = None) -> list[BatchRow]:
        """Verify ℓ_r drafts of every row in one target forward; returns the requests that finished
        (their rows are now free). ``lengths`` default: γ for every drafting row."""
        if self.proposal is None:
            raise RuntimeError("verify() without draft()")
        before = dict(self.clock.totals)
        proposal, drafting, gamma = self.proposal, self.drafting, self.gamma
        rows = len(self.rows)
        ells = [gamma if d else 0 for d in drafting] if lengths is None else [
            _checked_verify_length(int(e), gamma) for e in lengths]
        if len(ells) != rows:
            raise ValueError(f"lengths has {len(ells)} entries for the batch's {rows} rows; give one ℓ per row")
        if any(e and not d for e, d in zip(ells, drafting)):
            raise ValueError("a row that did not draft must verify ℓ = 0 (draft(drafting=...) left it out)")
        self.proposal = self.drafting = None
        width = max(ells)
        counts = torch.tensor(ells, dtype=torch.long, device=self.device) + 1
        with self.clock("verify"):  # row r: x_0 at next_pos[r], drafts after it, padding after 1 + ℓ_r
            x = torch.cat([self.anchor[:, None], proposal.tokens[:, :width]], dim=1)  # [R, 1+max ℓ]
            out = self.kv.forward(x, counts)
        keep = [0] * rows
        next_tokens = self.anchor.clone()
        with self.clock("accept"):
            logits = out.logits
            for r, (request, ell) in enumerate(zip(self.rows, ells)):
                draft = proposal.tokens[r : r + 1, :ell]
                m, nxt = verify_draft(draft, proposal.probs[r : r + 1, :ell], logits[r : r + 1, : ell + 1],
                                      self.temperature, request.generator)
                m, *drafted, nxt = torch.cat([m, draft[0], nxt]).tolist()
                confidences = None
                if drafting[r] and proposal.confidences is not None:
                    confidences = proposal.confidences[r].tolist()
                eos_at = _first_eos(drafted[:m], self.eos)
                if eos_at is None:
                    emitted, record = drafted[:m] + [nxt], RoundRecord(ell, m, confidences)
                else:
                    m = eos_at + 1
                    emitted, record = drafted[:m], RoundRecord(m, m, confidences, eos_accepted=True)
                request.rounds.append(record)
                request.tokens += emitted[: self.max_new_tokens - len(request.tokens)]
                if request.done:
                    continue
                keep[r] = m + 1
                next_tokens[r] = nxt
        served = list(self.rows)
        with self.clock("bookkeeping"):  # keep x_0..x_m of every row, drop the rejected drafts
            keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.kv.commit(keep_t)
            self.kv.maybe_compact()
            width = max(keep)  # the longest kept prefix: no feature rows past it go through the context
            _extend(self.drafter, self.ctx, out.features[:, :width], x[:, :width], num_valid=keep_t)
            self.anchor = next_tokens
        return self._retire(served, before)


class TargetBatch(_Batch):
    """Target-only decoding of up to R requests at once: every step one forward of one token per
    row, each row sampled from its own generator (the baseline of ``SpeculativeBatch``)."""

    @torch.inference_mode()
    def admit(self, prompt_ids: Sequence[int], generator: torch.Generator | None = None,
              tag: Any = None) -> BatchRow:
        """Prefill a request and give it a free row; as ``SpeculativeBatch.admit``."""
        _check_generate_args(prompt_ids, self.max_new_tokens, self.temperature)
        request = BatchRow(tag, len(prompt_ids), self.max_new_tokens, generator, self.eos,
                           admitted_at=time.perf_counter())
        single, _, anchor = self._prefill(prompt_ids, request)
        if not request.done:
            self._place(request, single, anchor)
        else:
            request.latency_s = time.perf_counter() - request.admitted_at
        return request

    @torch.inference_mode()
    def step(self) -> list[BatchRow]:
        """One token for every row; returns the requests that finished (their rows are now free)."""
        if any(r is None for r in self.rows) or not self.rows:
            raise RuntimeError("step() with free rows; call shrink() (or admit into them) first")
        before = dict(self.clock.totals)
        rows = len(self.rows)
        ones = torch.ones(rows, dtype=torch.long, device=self.device)
        with self.clock("decode"):
            out = self.kv.forward(self.anchor[:, None], ones, logits=False)
            logits = self.target.compute_logits(out.last_hidden[:, -1])  # [R, V]
        with self.clock("sample"):
            gens = [r.generator for r in self.rows]
            token = sample_token(logits, self.temperature, None if any(g is None for g in gens) else gens)
            values = token.tolist()
        served = list(self.rows)
        for request, value in zip(served, values):
            request.tokens.append(value)
        with self.clock("bookkeeping"):
            self.kv.commit(ones)
            self.kv.maybe_compact()
            self.anchor = token
        return self._retire(served, before)


def _no_draft(rows: int, vocab: int, device: torch.device) -> Any:
    """The proposal of a step in which no row drafts: γ = 0 for every row."""
    from dspark.modeling import Proposal

    empty = torch.empty(rows, 0, vocab, dtype=torch.float32, device=device)
    return Proposal(torch.empty(rows, 0, dtype=torch.long, device=device), empty, empty, None)


def _extend(drafter: Any, ctx: Any, features: Tensor, tokens: Tensor, num_valid: Tensor | None = None) -> None:
    """Append context positions to every row (row r's first num_valid[r]); a drafter that reads the
    tokens (Eagle3: ``reads_tokens``) gets them too."""
    if getattr(drafter, "reads_tokens", False):
        drafter.extend_context(ctx, features, num_valid=num_valid, input_ids=tokens)
    else:
        drafter.extend_context(ctx, features, num_valid=num_valid)


# ---------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------


@dataclass
class BatchJob:
    """One request to decode: prompt ids, the seed of its generator, a tag to key it by."""

    prompt_ids: Sequence[int]
    seed: int | None
    tag: Any = None


def _generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(int(seed))


@torch.inference_mode()
def speculative_batch_generate(target: Any, drafter: Any, jobs: Iterable[BatchJob], *, batch_size: int,
                               max_new_tokens: int, temperature: float = 1.0, eos_token_ids: Iterable[int] = (),
                               on_finish: Any = None) -> list[BatchRow]:
    """Speculative decoding of ``jobs`` with at most ``batch_size`` rows, every round verifying all
    γ drafts of every row; rows are refilled from ``jobs`` as requests finish. Returns the
    requests in the order they finished; ``on_finish(request)`` is called as each does."""
    batch = SpeculativeBatch(target, drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                             eos_token_ids=eos_token_ids)
    return _drive(batch, jobs, batch_size, on_finish, lambda: (batch.draft(), batch.verify())[1])


@torch.inference_mode()
def target_batch_generate(target: Any, jobs: Iterable[BatchJob], *, batch_size: int, max_new_tokens: int,
                          temperature: float = 1.0, eos_token_ids: Iterable[int] = (),
                          on_finish: Any = None) -> list[BatchRow]:
    """Target-only decoding of ``jobs`` with at most ``batch_size`` rows (as ``speculative_batch_generate``)."""
    batch = TargetBatch(target, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids)
    return _drive(batch, jobs, batch_size, on_finish, batch.step)


def _drive(batch: _Batch, jobs: Iterable[BatchJob], batch_size: int, on_finish: Any, step: Any) -> list[BatchRow]:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    pending = iter(jobs)
    done: list[BatchRow] = []

    def finish(request: BatchRow) -> None:
        done.append(request)
        if on_finish is not None:
            on_finish(request)

    exhausted = False
    while True:
        while not exhausted and (batch.free_rows() or len(batch.rows) < batch_size):
            job = next(pending, None)
            if job is None:
                exhausted = True
                break
            request = batch.admit(job.prompt_ids, _generator(batch.device, job.seed), job.tag)
            if request.done:
                finish(request)
        batch.shrink()
        if not batch.rows:
            return done
        for request in step():
            finish(request)


# ---------------------------------------------------------------------------
# How many rows
# ---------------------------------------------------------------------------

DEFAULT_ROWS = {"cpu": 8, "cuda": 64}  # auto_batch_size without an SPS table
MIN_GAIN = 1.1  # a doubling of R must raise the round throughput by at least this factor


def auto_batch_size(sps: Any, gamma: int, device: torch.device | str = "cpu", *, max_rows: int = 128,
                    requests: int | None = None) -> int:
    """The default number of rows: the largest R in 1, 2, 4, ... ≤ ``max_rows`` such that each doubling
    up to it raises the throughput of full rounds, R · SPS(R · (1 + γ)) on the SPS table ``sps`` (every
    row verifying x_0 and γ drafts), by at least ``MIN_GAIN`` (10 %): the point past which more rows
    only make each round slower. A table that stops before R · (1 + γ) ends the search there. Without a
    table: ``DEFAULT_ROWS`` of the device type. Never more than ``requests`` (when given)."""
    kind = torch.device(device).type
    if sps is None:
        rows = DEFAULT_ROWS.get(kind, 8)
    else:
        def throughput(r: int) -> float:
            tokens = r * (1 + gamma)
            if tokens > sps.max_batch_tokens:
                return math.nan
            return r * float(sps(tokens))

        rows = 1
        while rows * 2 <= max_rows:
            now, doubled = throughput(rows), throughput(rows * 2)
            if not (math.isfinite(doubled) and doubled >= MIN_GAIN * now):
                break
            rows *= 2
    if requests is not None:
        rows = max(1, min(rows, requests))
    return rows
