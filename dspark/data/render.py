"""Chat rendering and loss masks (the training data of paper Sections 3.3 and 4.1).

Every sequence is produced by the target's own ``tokenizer.apply_chat_template``; nothing here
knows a chat format. :func:`render_conversation` gives a conversation's token ids and loss mask
(:class:`RenderedSample`; the mask is 1 on every token the target generated as an assistant, its
end-of-turn token included), :func:`render_dataset` renders many (:class:`RenderStats`), and
:func:`render_prompt` renders a prompt with the generation prompt appended, for generation and
evaluation. :func:`assistant_spans` finds each answer by rendering prefixes of the conversation
and trusts those boundaries only where the renderings are prefixes of the whole, in text and in
tokens, with a fallback for each.

Where an answer starts and ends, the two prefix properties and their fallbacks
(``turns_outside_mask``, ``tokenized_piecewise``): docs/data.md, "Chat rendering and loss masks".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from tqdm.auto import tqdm

from dspark.data.prompts import Conversation


@dataclass(frozen=True)
class RenderedSample:
    """One tokenized conversation.

    ``loss_mask[t]`` is 1 where token t is a token the target generated as an
    assistant (answer text and end-of-turn token), else 0.
    """

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to max_length from the right
    turns_outside_mask: int = 0  # assistant turns left out by a prefix-property fallback
    tokenized_piecewise: bool = False  # token prefix property failed; see docs/data.md

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RenderStats:
    """What :func:`render_dataset` did with its input conversations."""

    total: int = 0
    kept: int = 0
    dropped_too_few_loss_tokens: int = 0
    truncated: int = 0  # over all inputs, kept or dropped
    turns_outside_mask: int = 0  # over all inputs
    tokenized_piecewise: int = 0  # over all inputs
    num_tokens: int = 0  # over kept samples
    num_loss_tokens: int = 0  # over kept samples


def render_text(
    tokenizer: Any, messages: Conversation, add_generation_prompt: bool, enable_thinking: bool
) -> str:
    """The text of ``messages`` under the tokenizer's chat template (no tokenization)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "tokenizer has no chat_template; use the tokenizer of an instruct/chat model "
            "or set tokenizer.chat_template"
        )
    # enable_thinking is a template variable: Qwen3 reads it, other templates ignore it.
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    # The template writes BOS itself where the model wants one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _answer_char_spans(
    tokenizer: Any, conversation: Conversation, enable_thinking: bool
) -> tuple[str, list[tuple[int, int]], int]:
    """The full rendering, the [start, end) character span of each assistant turn that
    passes the text prefix property, and the number of turns that do not."""
    full = render_text(tokenizer, conversation, False, enable_thinking)
    spans: list[tuple[int, int]] = []
    outside = 0
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = render_text(tokenizer, conversation[:i], True, enable_thinking)
        if i + 1 == len(conversation):
            through = full
        else:
            through = render_text(tokenizer, conversation[: i + 1], False, enable_thinking)
        start, end = len(before), len(through.rstrip())
        previous_end = spans[-1][1] if spans else 0
        if previous_end <= start < end and full.startswith(before) and full.startswith(through[:end]):
            spans.append((start, end))
        else:
            outside += 1
    return full, spans, outside


def assistant_spans(
    tokenizer: Any, conversation: Conversation, enable_thinking: bool = False
) -> tuple[list[int], list[tuple[int, int]], int, bool]:
    """Token ids of the whole conversation and the [start, end) token span of each masked turn.

    Returns ``(input_ids, spans, turns_outside_mask, tokenized_piecewise)``;
    docs/data.md ("Chat rendering and loss masks") says how spans are found and what the
    fallbacks do.
    """
    full, char_spans, outside = _answer_char_spans(tokenizer, conversation, enable_thinking)
    whole = _tokenize(tokenizer, full)
    cuts = [c for span in char_spans for c in span]

    # Token prefix property: tokenizing the text up to each cut gives a prefix of the whole.
    cut_tokens = []
    for cut in cuts:
        prefix = _tokenize(tokenizer, full[:cut])
        if whole[: len(prefix)] != prefix:
            break
        cut_tokens.append(len(prefix))
    else:
        spans = list(zip(cut_tokens[::2], cut_tokens[1::2]))
        return whole, spans, outside, False

    ids: list[int] = []
    cut_tokens = []
    for begin, stop in zip([0] + cuts, cuts + [len(full)]):
        ids += _tokenize(tokenizer, full[begin:stop])
        cut_tokens.append(len(ids))
    if tokenizer.decode(ids) != tokenizer.decode(whole):
        return whole, [], outside + len(char_spans), True
    spans = list(zip(cut_tokens[0:-1:2], cut_tokens[1::2]))
    return ids, spans, outside, True


def render_conversation(
    tokenizer: Any, conversation: Conversation, max_length: int, enable_thinking: bool = False
) -> RenderedSample:
    """Token ids and loss mask of a conversation (paper Section 4.1), cut to ``max_length`` tokens.

    ``conversation`` is a list of {"role", "content"} messages rendered by the target's own chat
    template (``tokenizer``: ``target.tokenizer``); the result's ``input_ids`` / ``loss_mask`` are
    a training sample (``dspark.data.dataset.RenderedSource`` wraps a list of them), the mask 1 on
    every assistant turn's tokens (docs/data.md). Truncation keeps the first ``max_length``
    tokens. ``enable_thinking=False`` (the paper's non-thinking mode, Section 4.1) is passed to
    the chat template.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    input_ids, spans, outside, piecewise = assistant_spans(tokenizer, conversation, enable_thinking)
    loss_mask = [0] * len(input_ids)
    for start, end in spans:
        loss_mask[start:end] = [1] * (end - start)
    return RenderedSample(
        input_ids=input_ids[:max_length],
        loss_mask=loss_mask[:max_length],
        truncated=len(input_ids) > max_length,
        turns_outside_mask=outside,
        tokenized_piecewise=piecewise,
    )


def render_dataset(
    tokenizer: Any,
    conversations: Iterable[Conversation],
    max_length: int,
    min_loss_tokens: int = 2,
    enable_thinking: bool = False,
    progress: bool = True,
) -> tuple[list[RenderedSample], RenderStats]:
    """Render many conversations; drop samples with fewer than ``min_loss_tokens`` loss tokens.

    The default of 2 is the least that yields a training anchor (an
    anchor i needs loss_mask[i] and loss_mask[i+1]). Counting happens after
    truncation, so a conversation whose answer was cut away is dropped too.
    """
    if min_loss_tokens < 0:
        raise ValueError(f"min_loss_tokens must be >= 0, got {min_loss_tokens}")
    samples = []
    stats = RenderStats()
    for conversation in tqdm(conversations, desc="render", unit="conv", disable=not progress):
        sample = render_conversation(tokenizer, conversation, max_length, enable_thinking)
        stats.total += 1
        stats.truncated += int(sample.truncated)
        stats.turns_outside_mask += sample.turns_outside_mask
        stats.tokenized_piecewise += int(sample.tokenized_piecewise)
        if sample.num_loss_tokens < min_loss_tokens:
            stats.dropped_too_few_loss_tokens += 1
            continue
        samples.append(sample)
        stats.kept += 1
        stats.num_tokens += len(sample.input_ids)
        stats.num_loss_tokens += sample.num_loss_tokens
    return samples, stats


def render_prompt(
    tokenizer: Any, conversation: Conversation, enable_thinking: bool = False
) -> list[int]:
    """Token ids of a prompt with the generation prompt appended, for generation and evaluation:
    ``conversation`` a list of {"role", "content"} messages ending with a user message, rendered
    by the target's chat template (``tokenizer``: ``target.tokenizer``); what
    ``dspark.speculative_generate`` takes as ``prompt_ids``."""
    if not conversation:
        raise ValueError("conversation is empty; a prompt needs at least one user message")
    if conversation[-1]["role"] == "assistant":
        raise ValueError(
            "the prompt ends with an assistant turn; pass prompt_only(conversation) "
            "or a conversation ending with a user message"
        )
    return _tokenize(tokenizer, render_text(tokenizer, conversation, True, enable_thinking))
