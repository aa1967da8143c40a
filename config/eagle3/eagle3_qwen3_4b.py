"""Eagle3 as DeepSpec trains it (the paper's baseline, SPEC 8), for Qwen/Qwen3-4B: the DSpark config's target,
data, optimiser and 5 target layers, one autoregressive draft layer with q/k norms, the full
vocabulary, training-time test over 7 steps with step-loss decay 0.8, soft CE only (`eagle3_of`).

Run: dspark train --config config/eagle3/eagle3_qwen3_4b.py [--set key.path=value ...]
"""

from pathlib import Path

from dspark.config import eagle3_of, load_config

config = eagle3_of(load_config(Path(__file__).parents[1] / "dspark" / "dspark_qwen3_4b.py"), "eagle3_deepspec")
