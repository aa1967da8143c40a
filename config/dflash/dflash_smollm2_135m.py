"""DFlash drafter for the embedded default target, SmolLM2-135M-Instruct, sized for 2 CPU cores:
the DSpark config without the sequential and confidence heads, trained on CE only (`dflash_of`).

Run: bash scripts/demo.sh   (or: dspark train --config config/dflash/dflash_smollm2_135m.py)
"""

from pathlib import Path

from dspark.config import dflash_of, load_config

config = dflash_of(load_config(Path(__file__).parents[1] / "dspark" / "dspark_smollm2_135m.py"))
