"""DFlash as DeepSpec trains it, for Qwen/Qwen3-4B: the DSpark config's backbone, target, data and
optimiser, without the sequential and confidence heads, trained on CE only (`dflash_of`).

Run: dspark train --config config/dflash/dflash_qwen3_4b.py [--set key.path=value ...]
"""

from pathlib import Path

from dspark.config import dflash_of, load_config

config = dflash_of(load_config(Path(__file__).parents[1] / "dspark" / "dspark_qwen3_4b.py"))
