"""dspark: confidence-scheduled, semi-autoregressive draft models for speculative decoding.

The names a researcher imports, by the paper's parts, loaded on first use (``import dspark`` pulls in neither
torch nor transformers; docs/library.md composes them into a training loop and a calibration of your own)::

    import dspark
    target = dspark.load_target(dspark.load_config("config/dspark/dspark_smollm2_135m.py"))
    drafter = dspark.load_drafter("runs/demo/dspark_smollm2_135m", target=target)
    result = dspark.speculative_generate(target, drafter, prompt_ids, max_new_tokens=64)

- models (Eq. 2-7): ``TargetModel``, ``Drafter``, ``DrafterConfig``, ``build_drafter``, ``load_drafter``, ``save_drafter``
- data (Section 4.1): ``render_conversation``, ``render_prompt``, ``count_draft_vocab``
- training (Section 3.3): ``sample_anchors``, ``block_labels``, ``target_positions``, ``block_loss``, ``dspark_loss``
  (Eq. 8-12), ``LossWeights``, ``Trainer``
- decoding (Section 2): ``verify_draft``, ``speculative_generate``, ``target_generate``, ``SpeculativeBatch``,
  ``speculative_batch_generate``
- scheduling (Section 3.2): ``sts_inputs``, ``fit_sts``, ``apply_temperatures``, ``schedule_prefix``, ``SPSTable``
- running it: ``Config``, ``load_config``, ``load_target``, ``evaluate``, ``DecodeSettings``, ``ServeSettings``
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_LOCATIONS = {
    "TargetModel": "dspark.target",
    "Drafter": "dspark.modeling.drafter",
    "DrafterConfig": "dspark.modeling.config",
    "build_drafter": "dspark.build",
    "load_drafter": "dspark.modeling.checkpoint",
    "save_drafter": "dspark.modeling.checkpoint",
    "render_conversation": "dspark.data.render",
    "render_prompt": "dspark.data.render",
    "count_draft_vocab": "dspark.data.vocab_counts",
    "sample_anchors": "dspark.data.anchors",
    "block_labels": "dspark.data.anchors",
    "target_positions": "dspark.data.anchors",
    "block_loss": "dspark.training.block_loss",
    "dspark_loss": "dspark.training.loss",
    "LossWeights": "dspark.training.loss",
    "Trainer": "dspark.training.trainer",
    "verify_draft": "dspark.decoding.verify",
    "speculative_generate": "dspark.decoding.loop",
    "target_generate": "dspark.decoding.loop",
    "SpeculativeBatch": "dspark.decoding.batched",
    "speculative_batch_generate": "dspark.decoding.batch_jobs",
    "sts_inputs": "dspark.rounds",
    "fit_sts": "dspark.scheduling.calibration",
    "apply_temperatures": "dspark.scheduling.calibration",
    "schedule_prefix": "dspark.scheduling.algorithm1",
    "SPSTable": "dspark.scheduling.algorithm1",
    "Config": "dspark.config",
    "load_config": "dspark.config",
    "load_target": "dspark.build",
    "evaluate": "dspark.evaluation.evaluate",
    "DecodeSettings": "dspark.evaluation.evaluate",
    "ServeSettings": "dspark.evaluation.evaluate",
}

__all__ = sorted(_LOCATIONS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LOCATIONS))
