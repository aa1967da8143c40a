"""Batched speculative decoding: many requests per drafter forward and per target forward (paper Section 2.1, 3.2.2).

``SpeculativeBatch`` holds the live requests of a batch as rows. A round drafts every row in one
drafter forward and verifies every row in one target forward with its own length ℓ_r: the rows
are ragged, padded to 1 + max ℓ, and each row attends only to its own tokens through a 4-D mask
built from per-row positions (``dspark.decoding.batch_state``). ``TargetBatch`` is the target-only
baseline on the same machinery, so that speculative decoding at R rows is compared with
target-only decoding at R rows. Every request decodes the tokens batch-1 decoding
(``dspark.decoding.loop``) gives it with the same seed: it keeps its own generator, cache
columns and drafter context row.

Admission is continuous: a finished request frees its row, ``admit`` prefills the next request
alone and writes it into the free row; ``shrink`` drops rows left free when no request waits.
Arguments are checked before any forward (``dspark.decoding.checks``). Whole runs over a list of
jobs: ``dspark.decoding.batch_jobs``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dspark.decoding.batch_state import BatchKVCache, add_ctx_row, put_row, select_rows
from dspark.decoding.checks import check_drafter, check_generate_args, check_prompt_ids, checked_verify_length
from dspark.decoding.loop import DecodeResult, PhaseClock, RoundRecord, _first_eos
from dspark.decoding.prefill_store import PrefillStore
from dspark.decoding.verify import rejection_sample, verify_draft
from dspark.sampling import logits_to_probs, sample_token

# Positions of every row whose logits a verification forward computes at once (``SpeculativeBatch._decide``):
# x_0's and the first draft's. Later positions only for the rows that accepted all of these.
HEAD_POSITIONS = 2

__all__ = ["BatchRow", "SpeculativeBatch", "TargetBatch"]

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
    """What the speculative and target-only batches share: rows, admission, the cache, timing.

    Timing: one ``PhaseClock`` for the batch (prefill, draft, verify, accept, bookkeeping). Each
    request's ``timings`` hold its own prefill and its share of every batched phase (a step's
    seconds over the rows it served), so the shares of all requests add up to the batch's wall
    clock and Σ tokens / Σ wall_s over the requests is the batch's throughput. A prefill taken from a
    ``PrefillStore`` is charged the seconds its forward took when it ran (not the batch's clock)."""

    def __init__(self, target: Any, *, max_new_tokens: int, temperature: float = 1.0,
                 eos_token_ids: Iterable[int] = (), prefills: PrefillStore | None = None) -> None:
        check_generate_args(max_new_tokens, temperature)
        self.target = target
        self.prefills = prefills  # prompt prefills kept for reuse (dspark.decoding.prefill_store)
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
        """Prefill one request alone (batch 1: the same forward as ``dspark.decoding.loop``) and draw x_0.
        With a ``PrefillStore`` the prompt's kept prefill is taken instead of the forward, and the
        request is charged the seconds that forward took; a new prefill is offered to the store."""
        from transformers import DynamicCache

        start = time.perf_counter()
        kept = None if self.prefills is None else self.prefills.get(self.target, prompt_ids)
        with self.clock("prefill"):
            if kept is None:
                single = DynamicCache()
                ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
                out = self.target(ids, past_key_values=single, use_cache=True, logits_to_keep=1)
            else:
                single, out = kept.cache, kept.out
            anchor = sample_token(out.logits[:, -1], self.temperature, request.generator)  # [1]
            request.tokens.append(int(anchor))
        seconds = time.perf_counter() - start
        if kept is None and self.prefills is not None:
            self.prefills.put(self.target, prompt_ids, single, out, seconds)
        request.timings["prefill"] = seconds if kept is None else kept.seconds
        return single, out, anchor

    def _checked_prompt(self, prompt_ids: Any, name: str = "prompt_ids",
                        many: str = "admit each prompt on its own") -> list[int]:
        """The prompt as a list of ids in [0, V) (``dspark.decoding.checks.check_prompt_ids``)."""
        return check_prompt_ids(prompt_ids, getattr(self.target, "vocab_size", None), name=name, many=many)

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

    @torch.inference_mode()
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
    P+n−1, exactly as in ``dspark.decoding.loop.SpeculativeRequest``. The drafter samples each
    row from that row's generator (``dspark.sampling.uniforms``) and each row is verified with
    its own call of ``verify_draft`` on its own slices, so the draws come in batch-1 order.
    Construction checks the drafter against the target
    (``dspark.modeling.checkpoint.check_against_target``) before any forward.
    """

    def __init__(self, target: Any, drafter: Any, *, max_new_tokens: int, temperature: float = 1.0,
                 eos_token_ids: Iterable[int] = (), prefills: PrefillStore | None = None) -> None:
        super().__init__(target, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids,
                         prefills=prefills)
        check_drafter(drafter, target)
        self.drafter = drafter
        self.ctx = drafter.new_context(0, target.device, capacity=1)
        self.proposal: Any = None
        self.drafting: list[bool] | None = None
        self._scratch = torch.Generator(device=target.device)  # the draws of rows that do not draft

    def _add_row(self) -> None:
        add_ctx_row(self.ctx)

    def _select(self, index: Tensor) -> None:
        select_rows(self.ctx, index)

    @torch.inference_mode()
    def admit(self, prompt_ids: Sequence[int], generator: torch.Generator | None = None,
              tag: Any = None) -> BatchRow:
        """Prefill a request and give it a free row (a new one when none is free). A request
        that is done at once (x_0 is an EOS, or max_new_tokens = 1) takes no row; check ``done``."""
        if self.proposal is not None:
            raise RuntimeError("admit() between draft() and verify(); admit after verify()")
        prompt_ids = self._checked_prompt(prompt_ids)
        request = BatchRow(tag, len(prompt_ids), self.max_new_tokens, generator, self.eos,
                           admitted_at=time.perf_counter())
        single, out, anchor = self._prefill(prompt_ids, request)
        if request.done:
            request.latency_s = time.perf_counter() - request.admitted_at
            return request
        start = time.perf_counter()
        with self.clock("prefill"):
            one = self.drafter.new_context(1, self.device, capacity=len(prompt_ids) + self.max_new_tokens)
            _extend(self.drafter, one, out.features, torch.tensor([prompt_ids], device=self.device))
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
            checked_verify_length(int(e), gamma) for e in lengths]
        if len(ells) != rows:
            raise ValueError(f"lengths has {len(ells)} entries for the batch's {rows} rows; give one ℓ per row")
        if any(e and not d for e, d in zip(ells, drafting)):
            raise ValueError("a row that did not draft must verify ℓ = 0 (draft(drafting=...) left it out)")
        self.proposal = self.drafting = None
        width = max(ells)
        counts = torch.tensor(ells, dtype=torch.long, device=self.device) + 1
        lazy = all(isinstance(r.generator, torch.Generator) for r in self.rows)
        head = min(width + 1, HEAD_POSITIONS) if lazy else width + 1
        with self.clock("verify"):  # row r: x_0 at next_pos[r], drafts after it, padding after 1 + ℓ_r
            x = torch.cat([self.anchor[:, None], proposal.tokens[:, :width]], dim=1)  # [R, 1+max ℓ]
            out = self.kv.forward(x, counts, logits=False)
            logits = self.target.compute_logits(out.last_hidden[:, :head])  # [R, head, V]
        decided = self._decide(proposal, ells, logits, out.last_hidden)
        keep = [0] * rows
        next_tokens = self.anchor.clone()
        with self.clock("accept"):
            for r, (request, ell) in enumerate(zip(self.rows, ells)):
                draft = proposal.tokens[r : r + 1, :ell]
                m, nxt = decided[r]
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
            width = max(keep)  # the longest kept prefix: no feature rows past it go through the context
            _extend(self.drafter, self.ctx, out.features[:, :width], x[:, :width], num_valid=keep_t)
            self.anchor = next_tokens
        return self._retire(served, before)

    def _decide(self, proposal: Any, ells: Sequence[int], logits: Tensor,
                hidden: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(accepted count m, next token) of every row: ``verify_draft`` on the row's own slices and
        generator, with the target's logits of its first ``head`` = logits.shape[1] positions only.

        The LM head of a verification forward is a large share of it at R rows (R · (1 + ℓ) rows of
        V = 49,152 on a CPU), yet a round reads the logits of position k only when drafts 1..k were
        all accepted. A row whose outcome the known positions settle (a rejection at m < head) keeps
        it: the later positions, filled with a copy of the last known one, change neither m nor the
        draw at m. A row that accepted every known position has its generator put back and is
        verified again with all its positions, their logits computed for all such rows in one
        product; ``verify_draft`` draws the same uniforms again, so every row decodes exactly what
        the whole forward's logits give. Rows without their own generator get whole logits."""
        head, decided, pending = int(logits.shape[1]), [], []
        with self.clock("accept"):
            # every row's target probabilities in one softmax (verify_draft's own, row by row)
            target = logits if self.temperature == 0 else logits_to_probs(logits, self.temperature)
            for r, ell in enumerate(ells):
                gen = self.rows[r].generator
                row = target[r : r + 1, : ell + 1]
                state = None
                if ell + 1 > head:
                    state = gen.get_state()
                    row = torch.cat([row, row[:, -1:].expand(1, ell + 1 - head, -1)], dim=1)
                m, nxt = _verify_row(proposal.tokens[r : r + 1, :ell], proposal.probs[r : r + 1, :ell], row,
                                     self.temperature, gen)
                if state is not None and int(m) >= head:  # every known position accepted: not settled
                    gen.set_state(state)
                    pending.append(r)
                decided.append((m, nxt))
        if not pending:
            return decided
        with self.clock("verify"):
            rest = self.target.compute_logits(hidden[pending, head:])  # [P, 1 + max ℓ − head, V]
        with self.clock("accept"):
            for i, r in enumerate(pending):
                ell = ells[r]
                row = torch.cat([logits[r : r + 1], rest[i : i + 1, : ell + 1 - head]], dim=1)  # [1, ℓ+1, V]
                decided[r] = verify_draft(proposal.tokens[r : r + 1, :ell], proposal.probs[r : r + 1, :ell], row,
                                          self.temperature, self.rows[r].generator)
        return decided


class TargetBatch(_Batch):
    """Target-only decoding of up to R requests at once: every step one forward of one token per
    row, each row sampled from its own generator (the baseline of ``SpeculativeBatch``)."""

    @torch.inference_mode()
    def admit(self, prompt_ids: Sequence[int], generator: torch.Generator | None = None,
              tag: Any = None) -> BatchRow:
        """Prefill a request and give it a free row; as ``SpeculativeBatch.admit``."""
        prompt_ids = self._checked_prompt(prompt_ids)
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
            self.anchor = token
        return self._retire(served, before)


def _verify_row(tokens: Tensor, draft_probs: Tensor, target: Tensor, temperature: float,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """``verify_draft`` of one row whose target side is already probabilities at T > 0 (its
    logits at T = 0): the same rule and the same draws."""
    if temperature == 0:
        return verify_draft(tokens, draft_probs, target, temperature, generator)
    return rejection_sample(tokens, draft_probs, target, generator=generator)


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
