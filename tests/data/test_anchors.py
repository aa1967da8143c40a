"""Anchors and blocks (paper Section 3.3): hand-written examples and sampling properties."""

import itertools

import pytest
import torch

from dspark.data.anchors import anchor_candidates, block_labels, sample_anchors, target_positions


def _mask(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_candidates_need_the_token_and_the_next_one_supervised():
    loss_mask = _mask([[0, 1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1, 1, 1]])
    expected = _mask([[0, 1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 1, 1, 0]])
    assert torch.equal(anchor_candidates(loss_mask), expected)


def test_candidates_accept_integer_masks_and_never_the_last_position():
    loss_mask = torch.ones(2, 5, dtype=torch.uint8)
    candidates = anchor_candidates(loss_mask)
    assert candidates.dtype == torch.bool
    assert candidates[:, :-1].all() and not candidates[:, -1].any()


@pytest.mark.parametrize("num_anchors", [1, 6, 50])
def test_sampled_anchors_are_sorted_unique_candidates(num_anchors):
    gen = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(16, 40, generator=gen) < 0.7
    loss_mask[3] = False  # a sequence with no candidate at all
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator=gen)
    assert anchors.shape == keep.shape == (16, num_anchors)
    assert anchors.dtype == torch.long and keep.dtype == torch.bool
    candidates = anchor_candidates(loss_mask)
    for b in range(16):
        n_cand = int(candidates[b].sum())
        n_keep = int(keep[b].sum())
        assert n_keep == min(n_cand, num_anchors)
        assert keep[b, :n_keep].all() and not keep[b, n_keep:].any()  # real anchors first
        kept = anchors[b, :n_keep]
        assert (anchors[b, n_keep:] == 0).all()
        assert (kept[1:] > kept[:-1]).all()  # sorted and unique
        assert candidates[b, kept].all()
        # Never across the loss mask: the anchor and the token after it are supervised.
        assert loss_mask[b, kept].all() and loss_mask[b, kept + 1].all()


def test_sample_anchors_draws_every_subset_equally_often():
    # One sequence with 5 candidates, 2 anchors: each of the 10 pairs has probability 1/10.
    loss_mask = _mask([[0, 1, 1, 0, 1, 1, 1, 1, 1, 0]])
    cand = anchor_candidates(loss_mask)[0].nonzero().flatten().tolist()
    assert cand == [1, 4, 5, 6, 7]
    draws = 20_000
    gen = torch.Generator().manual_seed(1234)
    anchors, keep = sample_anchors(loss_mask.expand(draws, -1), 2, generator=gen)
    assert keep.all()
    pairs = list(itertools.combinations(cand, 2))
    counts = torch.zeros(len(pairs))
    for i, (a, b) in enumerate(pairs):
        counts[i] = ((anchors[:, 0] == a) & (anchors[:, 1] == b)).sum()
    assert counts.sum() == draws
    expected = draws / len(pairs)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88  # 9 degrees of freedom, p = 0.001


def test_sample_anchors_is_reproducible_with_a_generator():
    loss_mask = torch.rand(4, 30, generator=torch.Generator().manual_seed(0)) < 0.8
    first = sample_anchors(loss_mask, 5, generator=torch.Generator().manual_seed(7))
    second = sample_anchors(loss_mask, 5, generator=torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_block_labels_hand_example_with_a_mask_gap_and_the_sequence_end():
    input_ids = torch.arange(100, 110)[None].repeat(2, 1)
    input_ids[1] += 100
    loss_mask = _mask([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1], [1] * 10])
    anchors = torch.tensor([[1, 5, 7, 0], [0, 6, 0, 0]])
    keep = _mask([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels, valid, prev = block_labels(input_ids, loss_mask, anchors, keep, 4)

    # Row 0, anchor 1: targets 2,3,4,5; 4 is outside the mask, so 5 is cut too (prefix).
    # Row 0, anchor 5: targets 6..9 all supervised. Anchor 7: targets 10, 11 are past the end.
    expected_valid = _mask(
        [
            [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]],
            [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
        ]
    )
    expected_labels = torch.tensor(
        [
            [[102, 103, 0, 0], [106, 107, 108, 109], [108, 109, 0, 0], [0, 0, 0, 0]],
            [[201, 202, 203, 204], [207, 208, 209, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
        ]
    )
    expected_prev = torch.tensor(
        [
            [[101, 102, 0, 0], [105, 106, 107, 108], [107, 108, 0, 0], [0, 0, 0, 0]],
            [[200, 201, 202, 203], [206, 207, 208, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
        ]
    )
    assert torch.equal(valid, expected_valid)
    assert torch.equal(labels, expected_labels)
    assert torch.equal(prev, expected_prev)


def test_block_validity_is_a_contiguous_prefix_and_labels_are_safe():
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 50, (8, 64), generator=gen)
    loss_mask = torch.rand(8, 64, generator=gen) < 0.85
    anchors, keep = sample_anchors(loss_mask, 12, generator=gen)
    labels, valid, prev = block_labels(input_ids, loss_mask, anchors, keep, 7)
    assert labels.shape == valid.shape == prev.shape == (8, 12, 7)
    assert (valid[..., 1:] <= valid[..., :-1]).all()  # once false, stays false
    assert not valid[~keep].any()
    assert (labels[~valid] == 0).all() and (prev[~valid] == 0).all()
    # A valid label is exactly the token k steps after the anchor, and that token is supervised.
    b, a, k = valid.nonzero(as_tuple=True)
    pos = anchors[b, a] + k + 1
    assert torch.equal(labels[b, a, k], input_ids[b, pos])
    assert loss_mask[b, pos].all()
    # Teacher forcing: the previous token of position k is the token at anchor + k.
    assert torch.equal(prev[b, a, k], input_ids[b, anchors[b, a] + k])


def test_target_positions_hand_values():
    anchors = torch.tensor([[0, 3, 8]])
    expected = torch.tensor([[[0, 1, 2], [3, 4, 5], [8, 9, 9]]])
    assert torch.equal(target_positions(anchors, 3, 10), expected)


def test_target_position_of_each_valid_label_is_the_token_before_it():
    input_ids = torch.arange(20)[None]
    loss_mask = torch.ones(1, 20, dtype=torch.bool)
    anchors, keep = torch.tensor([[2, 15, 18]]), torch.ones(1, 3, dtype=torch.bool)
    labels, valid, _ = block_labels(input_ids, loss_mask, anchors, keep, 4)
    positions = target_positions(anchors, 4, 20)
    assert torch.equal(labels[valid], positions[valid] + 1)  # input_ids[i] == i here


def test_block_labels_rejects_mismatched_shapes():
    ids = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_mask"):
        block_labels(ids, torch.ones(2, 9, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long),
                     torch.ones(2, 3, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="keep"):
        block_labels(ids, torch.ones(2, 10, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long),
                     torch.ones(2, 4, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.ones(2, 10, dtype=torch.bool), 0)
