"""fused_dspark_loss (Eq. 8-12) against dspark_loss fed the equivalent logits callables.

The fused path computes the gradient w.r.t. the logits in closed form during
forward; these tests check that it is the same function with the same
gradients as the general path, that the closed form is the derivative torch
would take (sign(0) = 0 included), and that no vocabulary-sized tensor
survives a chunk or is recomputed in backward.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from helpers.memory import LiveStorages

from dspark.training.fused_loss import LogitFactors, fused_dspark_loss
from dspark.training.fused_pass import release_workspace
from dspark.training.loss import LossWeights, dspark_loss, naive_dspark_loss, position_weights

N, GAMMA, DIM, VOCAB, RANK = 5, 4, 6, 17, 3
LENGTHS = torch.tensor([4, 2, 0, 1, 3])  # supervised prefix per row; row 2 has none
VALID = torch.arange(GAMMA)[None] < LENGTHS[:, None]
DFLASH = LossWeights(ce=1.0, tv=0.0, conf=0.0)


def _case(dtype=torch.float64, seed=0, rows=N, dim=DIM, vocab=VOCAB, rank=RANK, valid=VALID):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    labels = torch.randint(0, vocab, (rows, GAMMA), generator=gen)
    labels[~valid] = -100  # garbage where unsupervised: the loss must not read it
    return dict(
        hidden=randn(rows, GAMMA, dim),
        lm_head=randn(vocab, dim, scale=2.0 / dim**0.5),
        target_hidden=randn(rows, GAMMA, dim),
        labels=labels,
        valid=valid,
        conf=randn(rows, GAMMA),
        latent=randn(rows, GAMMA, rank),
        w2=randn(vocab, rank, scale=0.5),
    )


def _run(case, weights, *, fused, markov=True, softcap=None, chunk_rows=64, denominator=None):
    """One loss + backward; returns (LossOutput, {input name: grad})."""
    leaves = {"hidden": case["hidden"].clone().requires_grad_(True)}
    if markov:
        leaves["latent"] = case["latent"].clone().requires_grad_(True)
        leaves["w2"] = case["w2"].clone().requires_grad_(True)
    if weights.conf != 0:
        leaves["conf"] = case["conf"].clone().requires_grad_(True)
    head, target_hidden = case["lm_head"], case["target_hidden"]
    latent, w2, conf = leaves.get("latent"), leaves.get("w2"), leaves.get("conf")
    if fused:
        out = fused_dspark_loss(
            LogitFactors(leaves["hidden"], head, target_hidden, latent=latent, w2=w2, softcap=softcap),
            case["labels"], case["valid"], conf, weights, chunk_rows=chunk_rows, denominator=denominator,
        )
    else:
        def cap(x):
            return x if softcap is None else torch.tanh(x / softcap) * softcap

        def draft_logits(a, b):
            logits = cap(leaves["hidden"][a:b] @ head.T)
            return logits + latent[a:b] @ w2.T if markov else logits

        out = dspark_loss(
            draft_logits, lambda a, b: cap(target_hidden[a:b] @ head.T), case["labels"], case["valid"],
            conf, weights, chunk_rows=chunk_rows, denominator=denominator,
        )
    out.loss.backward()
    return out, {name: leaf.grad for name, leaf in leaves.items()}


def _assert_same(fused, reference, tol):
    (out, grads), (ref, ref_grads) = fused, reference
    for name in ("loss", "ce", "tv", "conf", "accept_sum"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), atol=tol, rtol=tol)
    assert torch.equal(out.count, ref.count)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=tol, rtol=tol, msg=name)


SETUPS = {
    "markov": dict(weights=LossWeights(), markov=True, softcap=None),
    "dflash": dict(weights=DFLASH, markov=False, softcap=None),
    "gemma_softcap": dict(weights=LossWeights(), markov=True, softcap=2.0),
}


@pytest.mark.parametrize("chunk_rows", [1, 3, N])
@pytest.mark.parametrize("setup", SETUPS)
def test_equals_dspark_loss_in_float64(setup, chunk_rows):
    case = _case(seed=1)
    fused = _run(case, fused=True, chunk_rows=chunk_rows, **SETUPS[setup])
    reference = _run(case, fused=False, chunk_rows=2, **SETUPS[setup])
    _assert_same(fused, reference, tol=1e-10)
    assert fused[0].tv > 0  # the TV metric is reported in DFlash mode too


def test_a_chunk_longer_than_the_l1_scratch_equals_dspark_loss():
    # 12 rows x γ = 48 supervised positions in one chunk: the TV row norms take two passes of the
    # 32-row scratch; the reference computes them in one.
    rows = 12
    case = _case(seed=3, rows=rows, valid=torch.ones(rows, GAMMA, dtype=torch.bool))
    fused = _run(case, LossWeights(), fused=True, chunk_rows=rows)
    reference = _run(case, LossWeights(), fused=False, chunk_rows=rows)
    _assert_same(fused, reference, tol=1e-10)


@pytest.mark.parametrize("setup", SETUPS)
def test_equals_dspark_loss_in_float32(setup):
    case = _case(torch.float32, seed=2)
    fused = _run(case, fused=True, chunk_rows=2, **SETUPS[setup])
    reference = _run(case, fused=False, chunk_rows=2, **SETUPS[setup])
    assert fused[0].loss.dtype == torch.float32
    _assert_same(fused, reference, tol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_explicit_denominator_is_used_as_given(scale):
    case = _case(seed=3)
    # denominator = 1: raw weighted sums, as the trainer uses them before its global reduction.
    denominator = torch.tensor(scale, dtype=torch.float64)
    fused = _run(case, LossWeights(), fused=True, chunk_rows=3, denominator=denominator)
    reference = _run(case, LossWeights(), fused=False, chunk_rows=3, denominator=denominator)
    _assert_same(fused, reference, tol=1e-10)
    local = _run(case, LossWeights(), fused=True, chunk_rows=3)
    ratio = (position_weights(GAMMA, 4.0, dtype=torch.float64) * VALID).sum() / scale
    torch.testing.assert_close(fused[0].loss, local[0].loss * ratio, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("rows", [0, N])
def test_no_supervised_position_gives_zero_loss_and_zero_gradients(rows):
    valid = torch.zeros(rows, GAMMA, dtype=torch.bool)
    case = _case(rows=rows, valid=valid)
    (out, grads) = fused = _run(case, LossWeights(), fused=True)
    assert out.loss.item() == 0.0 and out.count.tolist() == [0] * GAMMA
    assert all((g == 0).all() for g in grads.values())
    _assert_same(fused, _run(case, LossWeights(), fused=False), tol=1e-12)


def test_unsupervised_slots_are_never_read():
    case = _case(seed=4)
    clean = _run(case, LossWeights(), fused=True, chunk_rows=2)
    for name in ("hidden", "target_hidden", "latent"):
        case[name] = case[name].clone()
        case[name][~VALID] = float("nan")
    out, grads = _run(case, LossWeights(), fused=True, chunk_rows=2)
    _assert_same((out, grads), clean, tol=0.0)
    assert (grads["hidden"][~VALID] == 0).all() and (grads["latent"][~VALID] == 0).all()


def test_tv_gradient_closed_form_is_torch_autograd_including_ties():
    """∂Σ_v|p_v − p^t_v|/∂z_u = p_u (s_u − ⟨p, s⟩), s = sign(p − p^t), sign(0) = 0 (torch.abs)."""
    gen = torch.Generator().manual_seed(5)
    vocab = 6
    z = torch.randn(7, vocab, generator=gen, dtype=torch.float64)
    t = torch.randn(7, vocab, generator=gen, dtype=torch.float64)
    t[3:5] = z[3:5]  # p = p^t in every entry
    # Rows 5-6: the first 4 entries tie exactly (same normaliser: exp(−800) is 0), the
    # last two do not and carry real mass, so sign(0) = +1 would give other gradients.
    z[5:, 5] = -800.0
    t[5:, :4] = z[5:, :4]
    t[5:, 4], t[5:, 5] = -800.0, z[5:, 4]

    z_leaf = z.clone().requires_grad_(True)
    p, p_t = torch.softmax(z_leaf, -1), torch.softmax(t, -1)
    assert torch.equal(p[3:5], p_t[3:5]) and torch.equal(p[5:, :4], p_t[5:, :4])
    (p - p_t).abs().sum().backward()
    expected = z_leaf.grad
    assert (expected[3:5] == 0).all() and (expected[5:, :4].abs() > 1e-3).all()

    # Through the fused loss: W_lm = I makes z = h and t = h_t; only the TV term, raw sum.
    hidden = z[:, None, :].clone().requires_grad_(True)  # [7, γ=1, V]
    out = fused_dspark_loss(
        LogitFactors(hidden, torch.eye(vocab, dtype=torch.float64), t[:, None, :]),
        torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1, dtype=torch.bool), None,
        LossWeights(ce=0.0, tv=1.0, conf=0.0), chunk_rows=2, denominator=torch.tensor(1.0),
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, (p - p_t).abs().sum().detach(), atol=1e-14, rtol=0)
    torch.testing.assert_close(hidden.grad[:, 0], expected, atol=1e-14, rtol=0)


# ------------------------------------------------------------------------- memory and work

MEM_ROWS, MEM_VOCAB, MEM_DIM, MEM_RANK = 16, 8000, 8, 4  # one fp32 [N, γ, V] tensor = 2 MB
FULL = MEM_ROWS * GAMMA * MEM_VOCAB  # elements of one [N, γ, V] tensor


def _memory_case():
    case = _case(torch.float32, seed=6, rows=MEM_ROWS, dim=MEM_DIM, vocab=MEM_VOCAB, rank=MEM_RANK,
                 valid=torch.ones(MEM_ROWS, GAMMA, dtype=torch.bool))
    for name in ("hidden", "latent", "w2", "conf"):
        case[name].requires_grad_(True)
    return case


def _fused_loss(case, chunk_rows, softcap=None):
    return fused_dspark_loss(
        LogitFactors(case["hidden"], case["lm_head"], case["target_hidden"], latent=case["latent"], w2=case["w2"],
                     softcap=softcap),
        case["labels"], case["valid"], case["conf"], LossWeights(), chunk_rows=chunk_rows,
    )


def _saved_numels(loss_fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sizes


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_saved_for_backward_is_input_sized(softcap):
    case = _memory_case()
    sizes = _saved_numels(lambda: _fused_loss(case, chunk_rows=4, softcap=softcap))
    assert sizes and max(sizes) < FULL / 2
    # The hook does see vocabulary-sized tensors when a loss keeps them (the baseline does).
    logits = (case["hidden"] @ case["lm_head"].T).detach().requires_grad_(True)
    naive_sizes = _saved_numels(lambda: naive_dspark_loss(
        logits, logits.detach(), case["labels"], case["valid"], case["conf"], LossWeights()))
    assert max(naive_sizes) >= FULL


def test_nothing_vocabulary_sized_outlives_the_forward_but_the_cpu_workspace():
    case = _memory_case()
    release_workspace()
    mode = LiveStorages()
    with mode:
        out = _fused_loss(case, chunk_rows=4)
        kept = mode.alive()
        released = release_workspace()
    # The workspace: [chunk_rows·γ, V] buffers (draft, target, the L1 scratch), kept for the next call.
    assert released >= 2 * 4 * GAMMA * VOCAB * 4 and kept >= released
    # Left: the gradients kept for backward ([N, γ, d], [N, γ, r], [V, r]) and [N, γ] terms.
    assert mode.alive() < 0.2 * FULL * 4
    out.loss.backward()


def test_the_cpu_workspace_is_reused_and_a_reused_one_gives_the_same_bits():
    case = _memory_case()
    release_workspace()
    fresh = _fused_loss(case, chunk_rows=4)
    _fused_loss(case, chunk_rows=8)  # grows the workspace: later calls use views of larger buffers
    mode = LiveStorages()
    with mode:
        again = _fused_loss(case, chunk_rows=4)
    assert mode.peak < 0.2 * FULL * 4  # nothing vocabulary-sized was allocated this time
    assert torch.equal(again.loss, fresh.loss) and torch.equal(again.tv, fresh.tv) and torch.equal(again.accept_sum, fresh.accept_sum)
    assert release_workspace() > 0 and release_workspace() == 0


def _peak_fraction(chunk_rows):
    case = _memory_case()
    release_workspace()  # a cold call: the measurement sees the buffers it makes
    mode = LiveStorages()
    with mode:
        _fused_loss(case, chunk_rows, softcap=30.0).loss.backward()
    return mode.peak / (FULL * 4)


def test_peak_memory_grows_with_the_chunk_not_the_batch():
    small, larger, whole = _peak_fraction(1), _peak_fraction(4), _peak_fraction(MEM_ROWS)
    assert small < 0.5  # even one full-size fp32 tensor would exceed this
    assert small < larger < whole
    assert whole > 2.0  # the measurement sees full-size buffers when the chunk is the batch
    # As documented: with softcap at most 4 fp32 [chunk_rows·γ, V] buffers, the L1 scratch of at most
    # 32 rows (here the whole 16-row chunk), plus the [V, r] W2 gradient.
    chunk_buffer = 4 / MEM_ROWS
    l1_scratch = min(4 * GAMMA, 32) / (MEM_ROWS * GAMMA)
    assert larger <= 4 * chunk_buffer + l1_scratch + MEM_RANK / (MEM_ROWS * GAMMA) + 0.01


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []  # (op name, input shapes, largest output numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        numel = max((t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)), default=0)
        self.ops.append((func.overloadpacket.__name__, shapes, numel))
        return out


def _lm_head_matmuls(ops, vocab, dim):
    return sum(name in ("mm", "addmm", "bmm", "matmul") and bool({(vocab, dim), (dim, vocab)} & set(shapes))
               for name, shapes, _ in ops)


def test_lm_head_runs_three_times_per_chunk_in_training_and_twice_in_eval():
    case = _case(seed=7)  # 10 supervised positions: 2 chunks of 2·γ = 8 positions
    for grad_mode, per_chunk in ((True, 3), (False, 2)):
        mode = _RecordOps()
        with mode, torch.set_grad_enabled(grad_mode):
            hidden = case["hidden"].clone().requires_grad_(True)
            factors = LogitFactors(hidden, case["lm_head"], case["target_hidden"], latent=case["latent"],
                                   w2=case["w2"])
            out = fused_dspark_loss(factors, case["labels"], case["valid"], case["conf"], LossWeights(),
                                    chunk_rows=2)
        assert _lm_head_matmuls(mode.ops, VOCAB, DIM) == 2 * per_chunk
        assert out.loss.requires_grad == grad_mode


def test_backward_only_scales_the_stored_gradients():
    case = _memory_case()
    out = _fused_loss(case, chunk_rows=4)
    mode = _RecordOps()
    with mode:
        out.loss.backward()
    largest_input = max(case[name].numel() for name in ("hidden", "latent", "w2", "conf"))
    assert mode.ops and max(numel for _, _, numel in mode.ops) <= largest_input
    assert _lm_head_matmuls(mode.ops, MEM_VOCAB, MEM_DIM) == 0


def test_eval_mode_returns_the_same_values():
    case = _case(seed=8)
    train, _ = _run(case, LossWeights(), fused=True, chunk_rows=3)
    with torch.no_grad():
        out = _fused_loss({**case, "hidden": case["hidden"].requires_grad_(True)}, chunk_rows=3)
    assert not out.loss.requires_grad
    for name in ("loss", "ce", "tv", "conf", "accept_sum"):
        torch.testing.assert_close(getattr(out, name), getattr(train, name), atol=0, rtol=0)


def test_double_backward_is_refused():
    case = _case(seed=9)
    hidden = case["hidden"].clone().requires_grad_(True)
    out = fused_dspark_loss(LogitFactors(hidden, case["lm_head"], case["target_hidden"]), case["labels"],
                            case["valid"], None, DFLASH)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(out.loss, hidden, create_graph=True)


def test_bfloat16_inputs_get_bfloat16_gradients_from_fp32_math():
    case = _case(torch.bfloat16, seed=10)
    out, grads = _run(case, LossWeights(), fused=True, softcap=2.0, chunk_rows=2)
    assert out.loss.dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    # Reference: the same bf16 inputs in float64. The fused LM-head matmul runs in bf16 (its
    # logits are rounded to bf16 before the fp32 softmax), hence the loose tolerance.
    wide = {k: v.double() if v.is_floating_point() else v for k, v in case.items()}
    ref, ref_grads = _run(wide, LossWeights(), fused=False, softcap=2.0, chunk_rows=2)
    torch.testing.assert_close(out.loss.double(), ref.loss, atol=1e-3, rtol=1e-3)
    for name in grads:  # gradients of size ~0.05, rounded to bf16 (8 bits) on return
        torch.testing.assert_close(grads[name].double(), ref_grads[name], atol=1e-3, rtol=1e-2, msg=name)


def test_argument_errors_name_the_argument():
    case = _case()
    factor_tensors = (case["hidden"], case["lm_head"], case["target_hidden"])
    args = (case["labels"], case["valid"], case["conf"], LossWeights())
    with pytest.raises(ValueError, match="latent and w2"):
        fused_dspark_loss(LogitFactors(*factor_tensors, latent=case["latent"]), *args)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_dspark_loss(LogitFactors(*factor_tensors, latent=case["latent"], w2=case["w2"][:, :2]), *args)
    with pytest.raises(ValueError, match="target_hidden"):
        fused_dspark_loss(LogitFactors(case["hidden"], case["lm_head"], case["target_hidden"][:2]), *args)
    with pytest.raises(ValueError, match="lm_head_weight requires grad"):
        fused_dspark_loss(LogitFactors(case["hidden"], case["lm_head"].clone().requires_grad_(True),
                                       case["target_hidden"]), *args)
    with pytest.raises(ValueError, match="softcap"):
        fused_dspark_loss(LogitFactors(*factor_tensors, softcap=0.0), *args)
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_dspark_loss(LogitFactors(*factor_tensors), *args, chunk_rows=0)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_enclosing_autocast_changes_nothing(setup, dtype):
    """Training runs the loss under bf16 autocast (GPU recipe, CPUs with native bf16). The fused
    loss sets its own precision, so autocast must not re-type its matmuls: same bits with and
    without it (under autocast an fp32 gradient buffer would otherwise receive bf16 products)."""
    case = _case(dtype, seed=11)
    plain = _run(case, fused=True, chunk_rows=2, **SETUPS[setup])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = _run(case, fused=True, chunk_rows=2, **SETUPS[setup])
    _assert_same(under, plain, tol=0)


# --------------------------------------------------------------------------- distinct target rows
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full", "draft-vocab"])
@pytest.mark.parametrize("chunk_rows", [2, 64])
def test_target_rows_compute_each_target_position_once_with_the_same_loss_and_gradients(
        draft_vocab, chunk_rows, monkeypatch):
    """Blocks of nearby anchors overlap (anchor a reads positions a..a+γ−1): with target_rows the
    fused loss projects each distinct position once per chunk; nothing else may change."""
    from dspark.training import fused_pass
    from dspark.modeling.vocab import DraftVocab

    gen = torch.Generator().manual_seed(5)
    S, rows, V = 24, 9, 40
    seq = torch.randn(S, DIM, generator=gen, dtype=torch.float64)  # the target's final hidden states
    anchors = torch.tensor([0, 1, 2, 4, 5, 9, 10, 11, 18])  # ascending, overlapping blocks
    tpos = anchors[:, None] + torch.arange(GAMMA)  # [rows, γ]
    valid = torch.arange(GAMMA)[None] < torch.tensor([4, 3, 4, 2, 4, 1, 4, 4, 3])[:, None]
    case = _case(rows=rows, vocab=V, valid=valid, seed=6)
    case["target_hidden"] = seq[tpos]
    vocab = DraftVocab(torch.arange(0, V, 2), V) if draft_vocab else None
    head = vocab.head_weight(case["lm_head"]) if draft_vocab else case["lm_head"]
    w2 = case["w2"][vocab.d2t] if draft_vocab else case["w2"]
    weights = LossWeights(ce=0.4, tv=0.6, conf=0.5)

    saved = []
    real = fused_pass._distinct_target_rows

    def spy(run, pos):
        out = real(run, pos)
        saved.append((pos.numel(), out[0].numel(), out[1] is not None))
        return out

    monkeypatch.setattr(fused_pass, "_distinct_target_rows", spy)

    def run(target_rows):
        leaves = [x.clone().requires_grad_(True) for x in (case["hidden"], case["latent"], w2, case["conf"])]
        factors = LogitFactors(leaves[0], head, case["target_hidden"], latent=leaves[1], w2=leaves[2], vocab=vocab,
                               target_lm_head_weight=case["lm_head"] if draft_vocab else None,
                               target_rows=target_rows)
        out = fused_dspark_loss(factors, case["labels"], valid, leaves[3], weights, chunk_rows=chunk_rows)
        return out, torch.autograd.grad(out.loss, leaves)

    plain, plain_grads = run(None)
    saved.clear()
    once, once_grads = run(tpos)
    assert any(used for _, _, used in saved)  # some chunk projected fewer rows than positions
    assert sum(distinct for _, distinct, _ in saved) < int(valid.sum())
    for name in ("loss", "ce", "tv", "conf", "accept_sum"):
        torch.testing.assert_close(getattr(once, name), getattr(plain, name), rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(once_grads, plain_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_target_rows_must_be_integer_ids_of_the_labels_shape():
    case = _case()
    factor_tensors = (case["hidden"], case["lm_head"], case["target_hidden"])
    args = (case["labels"], case["valid"], None, DFLASH)
    with pytest.raises(ValueError, match="target_rows"):
        fused_dspark_loss(LogitFactors(*factor_tensors, target_rows=torch.zeros(N, GAMMA)), *args)
    with pytest.raises(ValueError, match="target_rows"):
        fused_dspark_loss(LogitFactors(*factor_tensors, target_rows=torch.zeros(N, GAMMA + 1, dtype=torch.long)), *args)


@pytest.mark.parametrize("weights", [LossWeights(), DFLASH], ids=["dspark", "dflash"])
def test_reads_no_tensor_value_on_the_host_under_torch_compile(weights):
    """train.compile wraps the loss in torch.compile. A Python branch on a tensor's value is a
    device sync on a GPU and splits the graph there; the only splits left are at the supervised
    positions' nonzero (the chunk loop's length), by design. Compiled loss and gradients equal
    the eager ones."""
    case = _case(torch.float32)

    def loss_and_grads(hidden, latent, w2, conf):
        out = fused_dspark_loss(
            LogitFactors(hidden, case["lm_head"], case["target_hidden"], latent=latent, w2=w2),
            case["labels"], case["valid"], conf, weights, chunk_rows=2,
        )
        return out.loss, *torch.autograd.grad(out.loss, (hidden, latent, w2))

    def leaves():
        return [case[k].clone().requires_grad_(True) for k in ("hidden", "latent", "w2", "conf")]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss_and_grads)(*leaves())
    reasons = [str(r.reason) for r in explained.break_reasons]
    assert reasons and all("nonzero" in r or "Dynamic shape operator" in r for r in reasons), reasons
    torch._dynamo.reset()
    compiled = torch.compile(loss_and_grads, backend="eager")
    for got, want in zip(compiled(*leaves()), loss_and_grads(*leaves())):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
