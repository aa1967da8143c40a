"""Training (paper Section 3.3): the DSpark and Eagle3 losses, the training step, the trainer."""
