"""Standard EAGLE-3 (what vLLM and SGLang serve) for the embedded default target, SmolLM2-135M-Instruct:
the DSpark demo config's data, budget and optimiser; one Llama-style draft layer over the 3 target
layers [1, N/2 - 1, N - 4] = [1, 14, 26] of the 30, trained by training-time test over 7 steps with
step-loss decay 0.8, soft CE only (`eagle3_of`), over a draft vocabulary of k = 16,384 of the
49,152 target ids (the size measured best for SmolLM2 by held-out coverage; EAGLE-3's reduced
vocabulary, d2t / draft_vocab_size in the checkpoint as vLLM reads them).

Run:
    dspark vocab --config config/eagle3/eagle3_smollm2_135m.py   # writes <data_dir>/draft_vocab_16384.safetensors
    dspark train --config config/eagle3/eagle3_smollm2_135m.py
"""

from pathlib import Path

from dspark.config import eagle3_of, load_config

config = eagle3_of(load_config(Path(__file__).parents[1] / "dspark" / "dspark_smollm2_135m.py"), "eagle3",
                   num_target_layers=30)  # keeps the DSpark config's draft_vocab_size = 16,384
