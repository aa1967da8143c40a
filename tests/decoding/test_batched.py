"""Batched speculative decoding (dspark.decoding.batched): every request of a batch decodes the tokens
batch-1 decoding gives it with the same seed, the batch is lossless, and the per-row cache holds
exactly each row's sequence.

Oracles: ``dspark.decoding.loop`` at batch 1 (same seeds), the target's exact joint distribution of
the first tokens (enumerated on a tiny vocabulary), a fresh prefill of each row's tokens, and, for
the in-place cache (``dspark.decoding.batch_state.ColumnLayer``), plain tensors concatenated,
indexed and gathered.
"""

from __future__ import annotations

import pytest
import torch

from dspark.decoding.batch_state import ColumnLayer, column_cache
from dspark.decoding.batch_jobs import BatchJob, longest_first, speculative_batch_generate, target_batch_generate
from dspark.decoding.batched import SpeculativeBatch, TargetBatch
from dspark.decoding.loop import speculative_generate, target_generate
from dspark.modeling.vocab import DraftVocab
from dspark.sampling import uniforms
from helpers.decoding import chi_square_pvalue, exact_joint, random_drafter
from helpers.eagle3 import tiny_eagle3
from helpers.targets import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompts(vocab: int, n: int = 7, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (k,), generator=g).tolist() for k in lengths]


def _batch1(target, drafter, prompts, *, T, n=30, eos=()):
    return [speculative_generate(target, drafter, p, max_new_tokens=n, temperature=T, eos_token_ids=eos,
                                 generator=torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)]


def _batched(target, drafter, prompts, *, T, R, n=30, eos=()):
    jobs = [BatchJob(p, 100 + i, i) for i, p in enumerate(prompts)]
    out = speculative_batch_generate(target, drafter, jobs, batch_size=R, max_new_tokens=n, temperature=T,
                                     eos_token_ids=eos)
    return {r.tag: r for r in out}


def _same(batched, ref):
    for i, want in enumerate(ref):
        got = batched[i]
        assert got.tokens == want.tokens, f"request {i}"
        assert [(r.proposed, r.accepted, r.eos_accepted) for r in got.rounds] == \
            [(r.proposed, r.accepted, r.eos_accepted) for r in want.rounds], f"request {i}"
        for a, b in zip(got.rounds, want.rounds):
            if b.confidences is not None:
                assert a.confidences == pytest.approx(b.confidences, abs=1e-5)


def _drafter(target, kind):
    if kind == "eagle3":
        return tiny_eagle3(target, "eagle3")
    if kind == "draft-vocab":
        V = target.vocab_size
        drafter = random_drafter(target, gamma=4, draft_vocab_size=40)
        return drafter.set_vocab(DraftVocab.from_target_ids(list(range(0, 80, 2)), V))
    return random_drafter(target, gamma=4)


def test_uniforms_of_a_generator_list_are_each_rows_own_draws():
    """Row r of a per-row draw is what generator r alone gives (the batch-1 draw)."""
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    got = uniforms(3, 4, gens, "cpu")
    for r, s in enumerate((1, 2, 3)):
        assert torch.equal(got[r : r + 1], torch.rand(1, 4, generator=torch.Generator().manual_seed(s),
                                                       dtype=torch.float64))
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        uniforms(3, 1, gens[:2], "cpu")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma4"])
@pytest.mark.parametrize("T", [0.0, 1.0], ids=["greedy", "T1"])
def test_batched_decoding_gives_every_request_its_batch1_tokens(family, T):
    """7 requests of 3..19 prompt tokens through 3 rows (admission as rows free up): the same
    tokens, rounds and confidences as batch 1 with the same seeds. Gemma4's sliding window (8)
    is crossed, so the window mask over per-row positions is exercised."""
    target = make_tiny_target(family)
    drafter = random_drafter(target, gamma=4)
    prompts = _prompts(target.vocab_size)
    _same(_batched(target, drafter, prompts, T=T, R=3), _batch1(target, drafter, prompts, T=T))


@pytest.mark.parametrize("kind", ["eagle3", "draft-vocab"])
@pytest.mark.parametrize("T", [0.0, 1.0], ids=["greedy", "T1"])
def test_eagle3_and_the_draft_vocabulary_in_batch(kind, T):
    target = make_tiny_target("qwen3")
    drafter = _drafter(target, kind)
    prompts = _prompts(target.vocab_size, n=6, seed=9)
    _same(_batched(target, drafter, prompts, T=T, R=4), _batch1(target, drafter, prompts, T=T))


@pytest.mark.parametrize("T, head", [(0.0, 1), (1.0, 1), (1.0, 2)], ids=["greedy", "T1-head1", "T1-head2"])
def test_rows_that_accept_past_the_first_positions_get_the_logits_of_the_whole_forward(T, head, monkeypatch):
    """The LM head runs on every row's first HEAD_POSITIONS positions; a row that accepts all of them is
    verified again with every position's logits. On a vocabulary of 8 (drafts often accepted): the
    same tokens and rounds as batch 1, with rows accepting past the first positions in many rounds."""
    import dspark.decoding.batched as batched

    monkeypatch.setattr(batched, "HEAD_POSITIONS", head)
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter = random_drafter(target, gamma=4, seed=2)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    prompts = _prompts(target.vocab_size, n=6)
    later, real = [], SpeculativeBatch._decide

    def counted(self, proposal, ells, logits, hidden):
        decided = real(self, proposal, ells, logits, hidden)
        assert logits.shape[1] <= head
        later.append(sum(int(m) >= logits.shape[1] for m, _ in decided))
        return decided

    monkeypatch.setattr(SpeculativeBatch, "_decide", counted)
    _same(_batched(target, drafter, prompts, T=T, R=3), _batch1(target, drafter, prompts, T=T))
    assert sum(later) >= 10  # 12, 51 and 28 rows here


def test_the_target_only_batch_gives_every_request_its_batch1_tokens():
    target = make_tiny_target("qwen3")
    prompts = _prompts(target.vocab_size)
    for T in (0.0, 1.0):
        jobs = [BatchJob(p, 100 + i, i) for i, p in enumerate(prompts)]
        got = {r.tag: r for r in target_batch_generate(target, jobs, batch_size=3, max_new_tokens=25,
                                                        temperature=T, eos_token_ids=[3])}
        for i, p in enumerate(prompts):
            want = target_generate(target, p, max_new_tokens=25, temperature=T, eos_token_ids=[3],
                                   generator=torch.Generator().manual_seed(100 + i))
            assert got[i].tokens == want.tokens


def test_an_eos_mid_batch_ends_one_row_while_the_others_go_on():
    """An EOS id that some requests emit: those end early (by EOS), the others run to the cap,
    and every request still matches batch 1."""
    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=4)
    prompts = _prompts(target.vocab_size)
    ref = _batch1(target, drafter, prompts, T=0.0, eos=[3])
    ended = [r.finished_by_eos and len(r.tokens) < 30 for r in ref]
    assert any(ended) and not all(ended)  # the design: some end early, some do not
    _same(_batched(target, drafter, prompts, T=0.0, R=len(prompts), eos=[3]), ref)


def _drive(batch, prompts, R):
    """Run ``prompts`` through ``batch`` by hand with R rows; returns (finished by tag, per-round m of
    every row, the rows admission filled after a request freed them, prompt by tag)."""
    queue = list(enumerate(prompts))
    finished, ms, refills = {}, [], []
    freed: list[int] = []
    while queue or batch.rows:
        while queue and (batch.free_rows() or len(batch.rows) < R):
            i, p = queue.pop(0)
            free = batch.free_rows()
            request = batch.admit(p, torch.Generator().manual_seed(100 + i), i)
            if free and batch.rows[free[0]] is request:
                refills.append(free[0])
        batch.shrink()
        if not batch.rows:
            break
        batch.draft()
        done = batch.verify()
        ms.append([r.rounds[-1].accepted for r in [*batch.rows, *done] if r is not None])
        for request in done:
            finished[request.tag] = request
        freed += [i for i, r in enumerate(batch.rows) if r is None]
    return finished, ms, refills


def test_rows_accept_different_counts_in_one_round_and_freed_rows_take_new_requests():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, gamma=4)
    with torch.no_grad():  # flatter drafts: partial acceptance, so rows differ within a round
        drafter.norm.weight.mul_(0.3)
    prompts = _prompts(target.vocab_size, n=6)
    batch = SpeculativeBatch(target, drafter, max_new_tokens=20, temperature=1.0)
    finished, ms, refills = _drive(batch, prompts, R=2)
    assert any(len(set(round_m)) > 1 for round_m in ms)  # different m in the same round
    assert refills  # a finished request's row took the next request
    ref = [speculative_generate(target, drafter, p, max_new_tokens=20, temperature=1.0,
                                generator=torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)]
    assert [finished[i].tokens for i in range(len(prompts))] == [r.tokens for r in ref]


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_after_many_rounds_each_rows_cache_gives_the_logits_of_a_fresh_prefill(family):
    """After 12 rounds (rejected drafts and padding, rows of different lengths), one more forward of
    each row's anchor over the batch cache gives the logits a fresh prefill of prompt + tokens gives."""
    target = make_tiny_target(family)
    drafter = random_drafter(target, gamma=4)
    prompts = _prompts(target.vocab_size, n=4, seed=11)
    batch = SpeculativeBatch(target, drafter, max_new_tokens=200, temperature=1.0)
    for i, p in enumerate(prompts):
        batch.admit(p, torch.Generator().manual_seed(i), i)
    stale = False
    for step in range(12):
        batch.draft()
        batch.verify([1, 2, 3, 4])  # ragged lengths: padding in every forward
        buffer = batch.kv.cache.layers[0]._k
        stale |= any(bool(buffer[r, :, n:n + 5].abs().sum() > 0) for r, n in enumerate(batch.kv.lengths().tolist()))
    assert stale  # rejected drafts and padding lie past the rows' lengths, unread
    assert len(set(batch.kv.lengths().tolist())) > 1 and batch.kv.columns == int(batch.kv.lengths().max())
    rows = len(batch.rows)
    with torch.inference_mode():
        out = batch.kv.forward(batch.anchor[:, None], torch.ones(rows, dtype=torch.long))
    for r, request in enumerate(batch.rows):
        ids = torch.tensor([prompts[request.tag] + request.tokens])
        fresh = target(ids).logits[0, -1]
        torch.testing.assert_close(out.logits[r, 0], fresh, atol=1e-4, rtol=1e-4)


def test_the_batch_is_lossless():
    """The first three tokens of a prompt decoded in a batch of 8 rows beside requests of other
    prompts (ragged lengths, admission, rows at different points) against their exact joint
    distribution under target-only sampling."""
    target = make_tiny_target("llama", vocab_size=8, num_hidden_layers=2, target_layer_ids=(-1, 1))
    drafter = random_drafter(target, gamma=2, seed=2)
    with torch.no_grad():
        drafter.norm.weight.mul_(0.3)
    prompt, others, V = [1, 3, 2, 0], ([5, 6], [2, 2, 7, 1, 4, 4, 3]), target.vocab_size
    jobs = []
    for i in range(1200):
        jobs.append(BatchJob(prompt, 10_000 + i, ("p", i)))
        if i % 3 == 0:
            jobs.append(BatchJob(others[i % 2], 90_000 + i, ("o", i)))
    out = speculative_batch_generate(target, drafter, jobs, batch_size=8, max_new_tokens=3, temperature=1.0)
    counts = torch.zeros(V, V, V)
    accepted = rounds = 0  # rounds: drafts proposed
    for r in out:
        if r.tag[0] == "p":
            counts[tuple(r.tokens)] += 1
            accepted += sum(x.accepted for x in r.rounds)
            rounds += sum(x.proposed for x in r.rounds)
    assert counts.sum() == 1200 and 0.2 < accepted / rounds < 0.8  # both branches sampled often
    exact = exact_joint(target, prompt, 3, 1.0)
    assert chi_square_pvalue(counts.sum(-1), exact.sum(-1)) > 1e-3
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_misuse_is_refused_with_the_fix():
    target = make_tiny_target("qwen3")
    drafter = random_drafter(target, gamma=4)
    batch = SpeculativeBatch(target, drafter, max_new_tokens=10)
    with pytest.raises(RuntimeError, match="shrink"):
        batch.draft()
    batch.admit([1, 2, 3], torch.Generator().manual_seed(0))
    batch.admit([4, 5], torch.Generator().manual_seed(1))
    batch.draft(drafting=[True, False])
    with pytest.raises(ValueError, match="did not draft"):
        batch.verify([2, 1])
    with pytest.raises(ValueError, match="one ℓ per row"):
        batch.verify([2])
    assert [len(r.rounds) for r in batch.verify([2, 0])] == [] and [len(r.rounds) for r in batch.rows] == [1, 1]
    with pytest.raises(RuntimeError, match="without draft"):
        batch.verify([0, 0])
    with pytest.raises(ValueError, match="batch_size"):
        target_batch_generate(target, [], batch_size=0, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="shrink"):
        TargetBatch(target, max_new_tokens=4).step()


def test_eager_attention_gets_an_additive_mask_and_the_same_tokens():
    """transformers' eager attention adds the mask (sdpa takes the boolean one): the batch builds 0 / min."""
    from transformers import AutoModelForCausalLM

    from dspark.target import TargetModel
    from helpers.targets import DEFAULT_LAYER_IDS, tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("gemma4"), attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    target = TargetModel(model, DEFAULT_LAYER_IDS["gemma4"])
    drafter = random_drafter(target, gamma=4)
    prompts = _prompts(target.vocab_size, n=5)
    batch = SpeculativeBatch(target, drafter, max_new_tokens=4)
    assert not batch.kv._boolean_mask
    _same(_batched(target, drafter, prompts, T=1.0, R=3, n=25), _batch1(target, drafter, prompts, T=1.0, n=25))


def test_the_in_place_cache_layer_holds_what_concatenation_would():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 3, 5, 4, generator=g)
    layer = ColumnLayer()
    layer.store(k, v)
    assert layer.capacity == (2, 5)
    for step in range(6):  # appends past the capacity grow the buffer by half again
        new_k, new_v = torch.randn(2, 3, 3, 4, generator=g), torch.randn(2, 3, 3, 4, generator=g)
        got_k, got_v = layer.update(new_k, new_v)
        k, v = torch.cat([k, new_k], dim=2), torch.cat([v, new_v], dim=2)
        assert torch.equal(got_k, k) and torch.equal(got_v, v) and layer.get_seq_length() == k.shape[2]
    assert layer.capacity[1] >= k.shape[2]
    layer.add_row()  # a row of zeros, in a spare row
    k, v = torch.cat([k, torch.zeros_like(k[:1])]), torch.cat([v, torch.zeros_like(v[:1])])
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    layer.widen(2)
    k = torch.cat([k, torch.zeros(3, 3, 2, 4)], dim=2)
    assert torch.equal(layer.keys, k)
    index = torch.tensor([2, 0])
    layer.select_rows(index)
    k, v = k[index], v[index]
    assert torch.equal(layer.keys, k)
    layer.batch_select_indices(torch.tensor([1, 0]))  # transformers' own row selection stays on the buffer
    k = k[[1, 0]]
    assert torch.equal(layer.keys, k) and layer.update(k[:, :, :1], k[:, :, :1])[0].shape[2] == k.shape[2] + 1
    layer.crop(-1)


def test_a_row_offset_write_puts_each_rows_columns_after_its_own_length():
    """``ColumnLayer.at``: row r's q new columns go to at[r] .. at[r] + q − 1 (past the capacity too),
    the view spans max(at) + q columns, and every other entry is kept."""
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(3, 2, 6, 4, generator=g), torch.randn(3, 2, 6, 4, generator=g)
    layer = ColumnLayer()
    layer.store(k, v)
    for at in ([1, 6, 3], [7, 2, 9]):
        new_k, new_v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
        width = max(at) + 4
        k = torch.cat([k, torch.zeros(3, 2, width - k.shape[2], 4)], dim=2) if width > k.shape[2] else k.clone()
        v = torch.cat([v, torch.zeros(3, 2, width - v.shape[2], 4)], dim=2) if width > v.shape[2] else v.clone()
        for r, a in enumerate(at):
            k[r, :, a:a + 4], v[r, :, a:a + 4] = new_k[r], new_v[r]
        layer.at = torch.tensor(at)
        got_k, got_v = layer.update(new_k, new_v)
        layer.at = None
        assert torch.equal(got_k, k) and torch.equal(got_v, v) and layer.shape == (3, width)


def test_a_column_cache_continues_and_crops_like_a_plain_one():
    target = make_tiny_target("llama")
    ids = torch.randint(0, target.vocab_size - 1, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain, column = target.new_cache(), target.new_cache()
        target(ids, past_key_values=plain, use_cache=True)
        target(ids, past_key_values=column, use_cache=True)
        column_cache(column, 12)
        x = torch.randint(0, target.vocab_size - 1, (3, 4), generator=torch.Generator().manual_seed(2))
        for _ in range(3):  # past the room it was given, and back after each crop
            a = target(x, past_key_values=plain, use_cache=True).logits
            b = target(x, past_key_values=column, use_cache=True).logits
            assert torch.equal(a, b)
            target.crop_cache(plain, 10)
            target.crop_cache(column, 10)


def test_longest_first_orders_jobs_by_prompt_length_and_keeps_ties_in_order():
    jobs = [BatchJob([1] * n, i, i) for i, n in enumerate([3, 9, 3, 12, 9])]
    assert [j.tag for j in longest_first(jobs)] == [3, 1, 4, 0, 2]
