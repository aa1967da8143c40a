"""DFlash as DeepSpec trains it (the paper's DFlash baseline, Section 4.1), for Qwen/Qwen3-14B: the DSpark
config with the differences below (what `dflash_of` derives from it).

Run: dspark train --config config/dflash/dflash_qwen3_14b.py [--set key.path=value ...]
"""

from pathlib import Path

from dspark.config import load_config, set_values

dspark = load_config(Path(__file__).parents[1] / "dspark" / "dspark_qwen3_14b.py")
config = set_values(dspark, {
    "name": "dflash_qwen3_14b_block7",
    "drafter.variant": "dflash",
    "drafter.markov_rank": 0,  # no sequential head
    "drafter.enable_confidence_head": False, "drafter.confidence_head_with_markov": False,  # no confidence head
    "loss.ce_weight": 1.0, "loss.tv_weight": 0.0, "loss.conf_weight": 0.0,  # loss weights: CE only
})
