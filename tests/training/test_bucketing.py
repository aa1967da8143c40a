"""Length-bucketed micro-batches (train.bucketing): the same samples per epoch, the same loss per
sample, less padding, still random, resumable and rank-invariant; and train.mixed_precision=auto."""

from __future__ import annotations

import pytest
import torch
from helpers.training import fit_killed_after, synthetic_samples, tiny_trainer

from dspark.data.dataset import RenderedSource, bucketed_order, collate, padding_share, sample_lengths
from dspark.data.render import RenderedSample
from dspark.training.checkpoints import latest_checkpoint
from dspark.training.schedule import Schedule, anchors_for
from dspark import build as runtime
from helpers.paths import REPO


def _lengths(n: int, seed: int = 0) -> torch.Tensor:
    """A long-tailed length distribution (log-normal, 16..2048 tokens), like chat answers."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.8 + 5.5).exp().clamp(16, 2048).long()


def _schedule(n, lengths, gb=16, world=1, rank=0, mb=4, window=8) -> Schedule:
    return Schedule(n, gb, world, rank, seed=3, total_steps=100, micro_batch=mb, lengths=lengths, bucket_window=window)


def test_padding_share_by_hand():
    # [3, 5] pads to 2x5 = 10 tokens for 8 real; [2] alone has none: 1 - 10/12.
    assert padding_share([3, 5, 2], 2) == pytest.approx(1 - 10 / 12)
    assert padding_share([4, 4, 4, 4], 2) == 0.0


def test_bucketed_order_is_a_permutation_of_the_same_samples():
    lengths = _lengths(203)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(203, generator=g)
    for head in (0, 1, 3):
        order = bucketed_order(perm, lengths, 4, 32, head, g)
        assert sorted(order.tolist()) == list(range(203))


def test_an_epoch_covers_every_sample_exactly_once_with_bucketing():
    """Steps run across epoch boundaries (N = 203 is no multiple of the batch): every epoch
    still yields each sample once, and the first 2 epochs differ in order."""
    n = 203
    sched = _schedule(n, _lengths(n))
    seen: dict[int, list[int]] = {}
    for step in range(3 * n // 16 + 1):
        for epoch, idx in sched.step_samples(step):
            seen.setdefault(epoch, []).append(idx)
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(n))
    assert seen[0] != seen[1]


def test_bucketing_cuts_padding_in_every_epoch():
    """Micro-batches of 4 on long-tailed lengths: padding is most of the tokens unbucketed and a
    small share bucketed, also in epoch 1 whose micro-batch boundaries are shifted by N mod 4."""
    n = 2003
    lengths = _lengths(n)
    plain, bucketed = _schedule(n, None, mb=4, window=64), _schedule(n, lengths, mb=4, window=64)
    for epoch in (0, 1):
        start = -(-epoch * n // 16)  # first step wholly inside the epoch
        steps = range(start, start + n // 16 - 1)
        share = {}
        for name, sched in (("plain", plain), ("bucketed", bucketed)):
            order = [idx for s in steps for _, idx in sched.step_samples(s)]
            share[name] = padding_share(lengths[order], 4)
        assert share["plain"] > 0.3
        assert share["bucketed"] < 0.06
        assert share["bucketed"] < share["plain"] / 5


def test_bucketed_batches_stay_random():
    """The groups are shuffled over the epoch: the micro-batch lengths are not sorted, and two
    seeds give different global batches."""
    n = 512
    lengths = _lengths(n)
    sched = _schedule(n, lengths)
    firsts = [int(lengths[sched.step_samples(s)[0][1]]) for s in range(30)]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)
    other = Schedule(n, 16, 1, 0, seed=4, total_steps=100, micro_batch=4, lengths=lengths, bucket_window=8)
    assert sched.step_samples(0) != other.step_samples(0)


def test_ranks_split_the_one_process_global_batch():
    n = 203
    lengths = _lengths(n)
    one = _schedule(n, lengths, gb=16, world=1)
    ranks = [_schedule(n, lengths, gb=16, world=2, rank=r) for r in (0, 1)]
    for step in (0, 5, 12, 13):
        assert ranks[0].step_samples(step) + ranks[1].step_samples(step) == one.step_samples(step)


def test_sample_lengths_of_sources():
    samples = [RenderedSample(input_ids=[1] * k, loss_mask=[1] * k) for k in (3, 7, 5)]
    src = RenderedSource(samples)
    assert sample_lengths(src).tolist() == [3, 7, 5]

    class NoLengths:  # a source without lengths(): read from input_ids
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return src[i]

    assert sample_lengths(NoLengths()).tolist() == [3, 7, 5]


@pytest.mark.parametrize("mode", ["online", "cache"])
def test_a_samples_loss_does_not_depend_on_its_micro_batch(tiny_qwen3, tmp_path, mode):
    """Σ of each sample's loss alone == the loss of the padded micro-batch holding both (a
    short sample padded to a long one), in online mode (the target runs on the padded batch)
    and cache mode (features of each sample computed alone, then padded with zeros)."""
    t = tiny_trainer(tiny_qwen3, str(tmp_path / mode), max_steps=1, bucketing=True)
    samples = synthetic_samples(tiny_qwen3.vocab_size, n=12)
    short, long = sorted(range(12), key=lambda i: len(samples[i].input_ids))[:: 11]
    src = RenderedSource(samples)

    def item(i):
        it = src[i]
        if mode == "cache":
            with torch.no_grad():
                out = tiny_qwen3(it["input_ids"][None], return_logits=False)
            it = {**it, "features": out.features[0], "final_hidden": out.last_hidden[0]}
        return it

    def loss_of(ids):
        items = [item(i) for i in ids]
        anchors, keep = zip(*(anchors_for(it["loss_mask"], 6, 7, 0, i) for it, i in zip(items, ids)))
        with torch.no_grad():
            loss, metrics = t.module(collate(items), torch.stack(anchors), torch.stack(keep))
        return float(loss), float(metrics["weight"])

    assert len(samples[short].input_ids) < len(samples[long].input_ids)
    (a, wa), (b, wb), (ab, wab) = loss_of([short]), loss_of([long]), loss_of([short, long])
    assert a > 0 and b > 0
    assert ab == pytest.approx(a + b, rel=1e-5)
    assert wab == pytest.approx(wa + wb, rel=1e-6)


def test_resume_mid_epoch_is_exact_with_bucketing(tiny_qwen3, tmp_path):
    """13 samples (no multiple of the micro-batch), batches of 4 in micro-batches of 2: a run
    killed at step 3 and resumed from step 2 (mid-epoch) ends where an uninterrupted one does;
    and bucketing did reorder the samples (power check)."""
    samples = synthetic_samples(tiny_qwen3.vocab_size, n=13, seed=5)
    kw = dict(samples=samples, max_steps=7, bucketing=True, bucket_window=2)
    full = tiny_trainer(tiny_qwen3, str(tmp_path / "full"), **kw)
    full.fit()
    killed = tiny_trainer(tiny_qwen3, str(tmp_path / "killed"), **kw)
    fit_killed_after(killed, 3)
    assert latest_checkpoint(tmp_path / "killed").name == "step-0000002"
    resumed = tiny_trainer(tiny_qwen3, str(tmp_path / "killed"), **kw)
    resumed.fit(resume=True)
    for k, v in full.drafter.state_dict().items():
        assert torch.equal(v, resumed.drafter.state_dict()[k]), k
    plain = tiny_trainer(tiny_qwen3, str(tmp_path / "plain"), samples=samples, max_steps=7, bucketing=False)
    steps = range(7)
    assert [full.schedule.step_samples(s) for s in steps] != [plain.schedule.step_samples(s) for s in steps]


# ------------------------------------------------------------ mixed precision
@pytest.mark.parametrize(
    ("device", "cuda_bf16", "cpu_bf16", "expected"),
    [("cuda", True, False, "bf16"), ("cuda", False, True, "no"), ("cpu", True, True, "bf16"), ("cpu", True, False, "no")],
)
def test_mixed_precision_auto_resolution(monkeypatch, device, cuda_bf16, cpu_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: cpu_bf16)
    assert runtime.resolve_mixed_precision("auto", device) == expected
    assert runtime.resolve_mixed_precision("no", device) == "no"
    assert runtime.resolve_mixed_precision("bf16", device) == "bf16"


def test_mixed_precision_rejects_unknown_names():
    with pytest.raises(ValueError, match="train.mixed_precision"):
        runtime.resolve_mixed_precision("fp16", "cpu")


def test_trainer_autocasts_as_auto_resolves(tiny_qwen3, tmp_path, monkeypatch):
    for native, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda native=native: native)
        t = tiny_trainer(tiny_qwen3, str(tmp_path / str(native)), mixed_precision="auto")
        assert t.precision == expected
        with t._autocast():
            assert torch.is_autocast_enabled("cpu") == (expected == "bf16")


def test_smollm2_configs_use_auto_precision():
    from dspark.config import load_config

    root = REPO / "config"
    for path in (root / "dspark" / "dspark_smollm2_135m.py", root / "dflash" / "dflash_smollm2_135m.py"):
        c = load_config(path)
        assert (c.target.dtype, c.train.mixed_precision, c.train.bucketing) == ("auto", "auto", True)
