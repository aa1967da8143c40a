"""Drafter modules: backbone (Eq. 2-3), sequential heads (Eq. 5-6), confidence head (Eq. 7), Eagle3 (the Section 4.1 baseline)."""

from dspark.modeling.checkpoint import load_drafter, make_drafter, save_drafter
from dspark.modeling.config import DrafterConfig
from dspark.modeling.blocks import training_mask
from dspark.modeling.drafter import DraftContext, Drafter, Proposal
from dspark.modeling.eagle3 import Eagle3Context, Eagle3Drafter
from dspark.modeling.heads import ConfidenceHead, GatedMarkovHead, MarkovHead, RNNHead

__all__ = [
    "ConfidenceHead",
    "DraftContext",
    "Drafter",
    "DrafterConfig",
    "Eagle3Context",
    "Eagle3Drafter",
    "GatedMarkovHead",
    "MarkovHead",
    "Proposal",
    "RNNHead",
    "load_drafter",
    "make_drafter",
    "save_drafter",
    "training_mask",
]
