"""A byte-level BPE tokenizer trained in a moment on a small corpus (no downloads)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# A Llama-3-style chat template (header ids around the role, <|eot_id|> after each turn).
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


def train_bpe(corpus: Sequence[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    """Byte-level BPE with `special_tokens` first in the vocabulary, trained on `corpus`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def chat_tokenizer(tokenizer_json: str, settings: dict, special_tokens: list[str]):
    """A PreTrainedTokenizerFast from a trained BPE's JSON, with ``settings`` (its keyword arguments
    plus a "chat_template") and ``special_tokens`` added as additional special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    kwargs = dict(settings)
    template = kwargs.pop("chat_template")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), **kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    tokenizer.chat_template = template
    return tokenizer
