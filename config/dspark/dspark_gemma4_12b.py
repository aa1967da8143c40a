"""DSpark drafter for google/gemma-4-12B-it: the paper's recipe; every field not set here is the Qwen3-4B recipe
(the defaults, spelled out in config/dspark/dspark_qwen3_4b.py).

Run: dspark train --config config/dspark/dspark_gemma4_12b.py [--set key.path=value ...]
"""

from dspark.config import Config, DrafterSpec, TargetConfig

config = Config(
    name="dspark_gemma4_12b_block7",
    target=TargetConfig(name_or_path="google/gemma-4-12B-it"),
    drafter=DrafterSpec(target_layer_ids=[5, 17, 29, 41, 46], mask_token_id=4),  # DeepSpec's layer ids, Gemma's mask token
)
