"""One training micro-step: the drafter and the DSpark loss as one module, and the
ratio metrics the trainer builds from the sums it returns.

:class:`DraftLossModule` is what DDP / FSDP wrap (dspark.training.trainer): its forward
takes a collated micro-batch with its anchors, runs the frozen target when the
batch carries no cached features, then the drafter and the loss of every anchor's block
(dspark.training.block_loss.block_terms, fused with the LM head by default), and returns
raw weighted sums: the trainer divides them by the global denominator D.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dspark.training.block_loss import block_terms
from dspark.training.loss import LossWeights, position_weights
from dspark.modeling import Drafter


class DraftLossModule(nn.Module):
    """Drafter + loss as one module, so DDP / FSDP see every parameter use inside forward()."""

    def __init__(self, drafter: Drafter, target: Any, weights: LossWeights, chunk_rows: int, fused: bool = True) -> None:
        super().__init__()
        self.drafter = drafter
        self.weights = weights
        self.chunk_rows = chunk_rows
        # fused: gradients of the vocabulary-sized terms computed in the forward pass, no
        # recomputation (fused_loss.fused_dspark_loss); otherwise the general chunked dspark_loss.
        self.fused = fused
        # Not a submodule: the frozen target is neither trained, synced nor saved.
        self._target = [target]

    @property
    def target(self) -> Any:
        return self._target[0]

    def forward(self, batch: dict[str, Tensor], anchors: Tensor, keep: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Returns (Σ w·(ce·CE + tv·TV + conf·CONF) over this micro-batch, detached metric sums)."""
        drafter = self.drafter
        gamma = drafter.config.block_size
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        features, final_hidden = self._target_states(batch)
        # Raw weighted sums (denominator 1): the trainer divides by the global D.
        one = torch.ones((), device=input_ids.device)
        out, valid = block_terms(drafter, features, final_hidden, input_ids, loss_mask, anchors, keep, self.weights,
                                 self.chunk_rows, self.fused, one)
        w = position_weights(gamma, self.weights.decay_gamma, device=input_ids.device)
        metrics = {
            "ce": out.ce.detach(),
            "tv": out.tv.detach(),
            "conf": out.conf.detach(),
            "weight": (valid.float() * w).sum(),
            "accept_sum": out.accept_sum.detach(),
            "count": out.count.detach().float(),
            "prefix_sum": out.prefix_sum.detach(),
            "blocks": out.blocks.detach().float(),
            "anchors": keep.sum().float(),
            "tokens": (loss_mask > 0).sum().float(),
        }
        return out.loss, metrics

    def _target_states(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The target's features [B, S, m·d] and final hidden states [B, S, d]: cached, or computed here."""
        if "features" in batch:
            return batch["features"], batch["final_hidden"]
        # Online mode: the frozen target runs here, its features are never stored. Right
        # padding: causal attention keeps real positions from seeing it.
        out = self.target(batch["input_ids"], return_logits=False)
        return out.features, out.last_hidden


def build_loss_module(drafter: nn.Module, target: Any, loss: Any) -> nn.Module:
    """The micro-step module of a drafter: the TTT loss for an Eagle3 drafter (dspark.training.eagle3_loss),
    else the DSpark block loss. `loss` is the config's LossConfig."""
    if drafter.config.variant == "eagle3":
        from dspark.training.eagle3_loss import Eagle3LossModule

        return Eagle3LossModule(drafter, target, parity=loss.eagle3_parity, chunk_rows=max(loss.chunk_rows, 256))
    weights = LossWeights(ce=loss.ce_weight, tv=loss.tv_weight, conf=loss.conf_weight, decay_gamma=loss.loss_decay_gamma)
    return DraftLossModule(drafter, target, weights, loss.chunk_rows, fused=loss.fused)


# The metric sums ratio_metrics reads (what evaluation reduces across ranks).
METRIC_SUMS = ("ce", "tv", "conf", "weight", "accept_sum", "count", "prefix_sum", "blocks")


def tau_probabilistic(prefix_sum: Tensor, blocks: Tensor) -> float:
    """DeepSpec's τ_prob: the mean over blocks of 1 + Σ_k Π_{i≤k} c*_i·mask_i, from
    ``prefix_sum`` = Σ_blocks Σ_k Π_{i≤k} c*_i·mask_i and ``blocks`` = blocks with a
    supervised slot, both summed over the global batch (1.0 without a block).
    c*_k = clamp(1 − ½‖p^d_k − p^t_k‖₁, 0, 1) is the expected acceptance of slot k (Eq. 8)."""
    return float(1.0 + prefix_sum.double() / blocks.double().clamp_min(1.0))


def tau_from_acceptance_rates(accept: Tensor) -> float:
    """τ from the pooled per-position acceptance rates acc_k = Σ c*_k / #slots k: 1 + Σ_k Π_{i≤k} acc_i.

    Not DeepSpec's estimator: a product of means, where τ_prob is a mean of products; logged
    as ``tau_prob_pooled``."""
    return float(1.0 + torch.cumprod(accept.double(), 0).sum())


def ratio_metrics(reduced: dict[str, Tensor]) -> dict[str, Any]:
    """Ratio metrics from sums reduced over the global batch: each loss term's weighted mean
    Σ w·term / Σ w, the per-position acceptance accept_sum / count (rounded to 4 digits),
    ``tau_prob`` (DeepSpec's estimator, ``tau_probabilistic``) and ``tau_prob_pooled``
    (``tau_from_acceptance_rates``)."""
    denom = reduced["weight"].clamp_min(1e-12)
    accept = reduced["accept_sum"] / reduced["count"].clamp_min(1)
    ce, tv, conf = (float(reduced[k] / denom) for k in ("ce", "tv", "conf"))
    return {
        "ce": ce,
        "tv": tv,
        "conf": conf,
        "accept": [round(float(a), 4) for a in accept],
        "tau_prob": tau_probabilistic(reduced["prefix_sum"], reduced["blocks"]),
        "tau_prob_pooled": tau_from_acceptance_rates(accept),
    }
