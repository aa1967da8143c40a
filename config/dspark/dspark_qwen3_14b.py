"""DSpark drafter for Qwen/Qwen3-14B: the paper's recipe; every field not set here is the Qwen3-4B recipe
(the defaults, spelled out in config/dspark/dspark_qwen3_4b.py).

Run: dspark train --config config/dspark/dspark_qwen3_14b.py [--set key.path=value ...]
"""

from dspark.config import Config, DrafterSpec, TargetConfig

config = Config(
    name="dspark_qwen3_14b_block7",
    target=TargetConfig(name_or_path="Qwen/Qwen3-14B"),
    drafter=DrafterSpec(target_layer_ids=[1, 10, 19, 28, 37]),  # DeepSpec's layer ids for this target
)
