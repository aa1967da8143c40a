"""DFlash as DeepSpec trains it, for google/gemma-4-12B-it: the DSpark config's backbone, target, data and
optimiser, without the sequential and confidence heads, trained on CE only (`dflash_of`).

Run: dspark train --config config/dflash/dflash_gemma4_12b.py [--set key.path=value ...]
"""

from pathlib import Path

from dspark.config import dflash_of, load_config

config = dflash_of(load_config(Path(__file__).parents[1] / "dspark" / "dspark_gemma4_12b.py"))
