"""Eagle3 as DeepSpec trains it (the paper's Eagle3 baseline, Section 4.1), for google/gemma-4-12B-it: the DSpark
config with the differences below (what `eagle3_of(dspark, "eagle3_deepspec")` derives from it).

Run: dspark train --config config/eagle3/eagle3_gemma4_12b.py [--set key.path=value ...]
"""

from pathlib import Path

from dspark.config import load_config, set_values

dspark = load_config(Path(__file__).parents[1] / "dspark" / "dspark_gemma4_12b.py")
config = set_values(dspark, {
    "name": "eagle3_gemma4_12b_block7",
    "drafter.variant": "eagle3",
    "drafter.eagle3_preset": "eagle3_deepspec",  # DeepSpec's Qwen3Eagle3Model: q/k norms, full vocabulary
    "drafter.target_layer_ids": [5, 17, 29, 41, 46],  # DSpark's: all drafters read the same features (Section 4.1)
    "drafter.num_draft_layers": 1,  # one autoregressive layer, one forward per draft token
    "drafter.ttt_length": 7,  # training-time test over 7 steps, the block size γ of DSpark
    "drafter.step_loss_decay": 0.8,  # step s of the TTT loss weighs 0.8^s
    "drafter.markov_rank": 0,  # no sequential head
    "drafter.enable_confidence_head": False, "drafter.confidence_head_with_markov": False,  # no confidence head
    "loss.ce_weight": 1.0, "loss.tv_weight": 0.0, "loss.conf_weight": 0.0,  # loss weights: (soft) CE only
})
