"""Builders shared by the evaluation tests: a character tokenizer with a chat template, tiny benchmark files."""

from __future__ import annotations

import json
from pathlib import Path


FILES = {"gsm8k": ["g0", "g1"], "mbpp": ["m0"], "alpaca": ["a0"]}


class CharTokenizer:
    """Chat template '<u>text</u><a>'; one token per character (id = code point)."""

    eos_token_id = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, enable_thinking=True):
        assert enable_thinking is False  # the protocol renders with thinking off
        text = "".join(f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>" for m in messages)
        return text + ("<a>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    chat_template = "char"


def write_benchmarks(folder: Path, files=FILES) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, prompts in files.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"turns": [p, "second turn"]}) + "\n" for p in prompts))
    return paths
