"""Standard EAGLE-3 (what vLLM and SGLang serve) for the embedded default target, SmolLM2-135M-Instruct:
the DSpark demo config with the differences below (what `eagle3_of(dspark, "eagle3", 30)` derives).
It keeps the demo's draft vocabulary of k = 8,192 of the 49,152 target ids (the demo recipe's,
bench/recipe_study.py) and its γ = 4, as EAGLE-3's d2t / draft_vocab_size that vLLM reads.

Run:
    dspark vocab --config config/eagle3/eagle3_smollm2_135m.py   # writes <data_dir>/draft_vocab_8192.safetensors
    dspark train --config config/eagle3/eagle3_smollm2_135m.py
"""

from pathlib import Path

from dspark.config import load_config, set_values

dspark = load_config(Path(__file__).parents[1] / "dspark" / "dspark_smollm2_135m.py")
config = set_values(dspark, {
    "name": "eagle3_smollm2_135m",
    "drafter.variant": "eagle3",
    "drafter.eagle3_preset": "eagle3",  # standard EAGLE-3: a Llama-style layer, no q/k norms
    "drafter.layer_family": "",  # the target's (Llama), not the DSpark demo's Qwen3 layers
    "drafter.target_layer_ids": [1, 14, 26],  # EAGLE-3's [1, N/2 - 1, N - 4] of the N = 30 layers
    "drafter.num_draft_layers": 1,  # one autoregressive layer, one forward per draft token
    "drafter.ttt_length": 4, "drafter.step_loss_decay": 0.8,  # training-time test over the γ = 4 it drafts, step s weighs 0.8^s
    "drafter.markov_rank": 0,  # no sequential head
    "drafter.enable_confidence_head": False, "drafter.confidence_head_with_markov": False,  # no confidence head
    "loss.ce_weight": 1.0, "loss.tv_weight": 0.0, "loss.conf_weight": 0.0,  # loss weights: (soft) CE only
})
