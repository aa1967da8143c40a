"""DSpark (Markov head + confidence head) drafter for Qwen/Qwen3-4B: the paper's recipe (Sections 3.3, 4.1).

These values are also the defaults of dspark.config, so the other config files state only what
differs from this one. Copy this file to start an experiment of your own.
Run: dspark train --config config/dspark/dspark_qwen3_4b.py [--set key.path=value ...]
"""

from dspark.config import Config, DataConfig, DrafterSpec, EvalConfig, GenerationConfig, LossConfig, TargetConfig, TrainConfig

config = Config(
    name="dspark_qwen3_4b_block7",
    out_dir="runs/dspark_qwen3_4b_block7",
    seed=42,
    target=TargetConfig(name_or_path="Qwen/Qwen3-4B", dtype="auto", device="auto"),  # bfloat16 on a GPU
    drafter=DrafterSpec(
        variant="dspark",
        target_layer_ids=[1, 9, 17, 25, 33],  # DeepSpec's convention: i = output of decoder layer i
        mask_token_id=151669,
        block_size=7,  # γ
        num_draft_layers=5,
        markov_rank=256,  # Eq. 5, r
        markov_head_type="vanilla",  # "vanilla" (Markov) | "gated" (DeepSpec) | "rnn" (Eq. 6) | a registered head
        rnn_bias=True,  # the RNN head's joint bias: DeepSpec's form; False is Eq. 6 exactly
        head_options={},  # keyword arguments of a registered head (docs/extending.md)
        enable_confidence_head=True,  # Eq. 7
        confidence_head_with_markov=True,
        attn_implementation="auto",  # flex attention on a GPU
    ),
    data=DataConfig(
        train_prompts="hub:mlabonne/open-perfectblend",
        holdout_fraction=0.05,
        max_length=4096,
        min_loss_tokens=14,
        num_anchors=512,
        feature_mode="cache",
        cache_precision="bf16",  # as DeepSpec stores it; "fp8" takes 0.47x the bytes (docs/configs.md)
    ),
    generation=GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=4096, backend="openai"),
    loss=LossConfig(ce_weight=0.1, tv_weight=0.9, conf_weight=1.0, loss_decay_gamma=4.0),
    train=TrainConfig(
        lr=6e-4,
        weight_decay=0.0,
        warmup_ratio=0.04,  # then cosine to 0
        grad_clip=1.0,
        global_batch_size=512,
        micro_batch_size=1,
        epochs=10,
        mixed_precision="auto",  # bf16 autocast over fp32 master weights on a bf16 GPU
        compile=True,
        save_every=3000,
        log_every=10,
    ),
    eval=EvalConfig(temperature=1.0, max_new_tokens=2048),
)
