"""Training (paper Section 3.3): the DSpark and Eagle3 losses, a batch's block loss in one call,
the training step, the trainer."""
