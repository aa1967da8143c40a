"""DFlash drafter for the embedded default target, SmolLM2-135M-Instruct, sized for 2 CPU cores:
the DSpark config with the differences below (what `dflash_of` derives from it).

Run: bash scripts/demo.sh   (or: dspark train --config config/dflash/dflash_smollm2_135m.py)
"""

from pathlib import Path

from dspark.config import load_config, set_values

dspark = load_config(Path(__file__).parents[1] / "dspark" / "dspark_smollm2_135m.py")
config = set_values(dspark, {
    "name": "dflash_smollm2_135m",
    "drafter.variant": "dflash",
    "drafter.markov_rank": 0,  # no sequential head
    "drafter.enable_confidence_head": False, "drafter.confidence_head_with_markov": False,  # no confidence head
    "loss.ce_weight": 1.0, "loss.tv_weight": 0.0, "loss.conf_weight": 0.0,  # loss weights: CE only
})
