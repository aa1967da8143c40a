"""dspark: confidence-scheduled, semi-autoregressive draft models for speculative decoding."""

__version__ = "0.1.0"
