"""Data path: prompts, chat rendering and loss masks, regeneration, target cache, anchors."""
