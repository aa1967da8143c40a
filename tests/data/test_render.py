"""Chat rendering and loss masks on offline tokenizers with four template families.

The templates below are written from the documented chat formats of each
family; the tokenizer is a tiny byte-level BPE trained here, with the
family's control tokens registered as special tokens. The oracle for every
loss mask is the hand-written text of each assistant turn plus its
end-of-turn token.
"""

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dspark.data.prompts import prompt_only
from helpers.bpe import LLAMA3_TEMPLATE, chat_tokenizer, train_bpe
from dspark.data.render import (
    RenderedSample,
    render_conversation,
    render_dataset,
    render_prompt,
)

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
]

# SmolLM2-Instruct: ChatML with a default system turn.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3: ChatML; an assistant turn after the last user message carries a
# (here empty) think block, earlier assistant turns are rendered without one;
# enable_thinking=false puts the empty think block into the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set content = message.content -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


# Gemma: no system role; the system text is prepended to the first user turn.
GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{%- set prefix = messages[0].content | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message.content | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

FAMILIES = {
    "chatml": dict(chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"),
    "qwen3": dict(chat_template=QWEN3_TEMPLATE, eos_token="<|im_end|>"),
    "llama3": dict(chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "gemma": dict(chat_template=GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>"),
}

SYSTEM = {"role": "system", "content": "You answer in one sentence."}
TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And how many people live there?"},
    {"role": "assistant", "content": "About two million people live in the city itself."},
]
ANSWER_1 = "The capital of France is Paris."
ANSWER_2 = "About two million people live in the city itself."

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "And how many people live there? About two million people live in the city itself.",
    "You answer in one sentence. You are a helpful assistant.",
    "system\nuser\nassistant\nmodel\n\n\n  the and of in is to a",
] * 20


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tokenizer = train_bpe(CORPUS, 500, SPECIAL_TOKENS)
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def make_tokenizer(tokenizer_json):
    def make(family: str) -> PreTrainedTokenizerFast:
        return chat_tokenizer(tokenizer_json, FAMILIES[family], SPECIAL_TOKENS)

    return make


def masked_spans(tokenizer, sample: RenderedSample) -> list[str]:
    """Decoded text of each maximal run of loss-masked tokens."""
    spans, run = [], []
    for token, m in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if m:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


# ---- loss masks per family -------------------------------------------------

@pytest.mark.parametrize("family, end_of_turn", [
    ("chatml", "<|im_end|>"),
    ("qwen3", "<|im_end|>"),
    ("llama3", "<|eot_id|>"),
    ("gemma", "<end_of_turn>"),
])
def test_mask_is_last_answer_plus_end_of_turn_token(make_tokenizer, family, end_of_turn):
    tokenizer = make_tokenizer(family)
    sample = render_conversation(tokenizer, [SYSTEM] + TWO_TURNS[:2], max_length=4096)
    assert masked_spans(tokenizer, sample) == [ANSWER_1 + end_of_turn]
    assert sample.num_loss_tokens == sum(sample.loss_mask) > 0
    assert sample.turns_outside_mask == 0


@pytest.mark.parametrize("family, end_of_turn", [
    ("chatml", "<|im_end|>"),
    ("llama3", "<|eot_id|>"),
    ("gemma", "<end_of_turn>"),
])
@pytest.mark.parametrize("with_system", [False, True])
def test_mask_covers_both_answers_of_a_two_turn_chat(make_tokenizer, family, end_of_turn, with_system):
    tokenizer = make_tokenizer(family)
    conversation = ([SYSTEM] if with_system else []) + TWO_TURNS
    sample = render_conversation(tokenizer, conversation, max_length=4096)
    assert masked_spans(tokenizer, sample) == [ANSWER_1 + end_of_turn, ANSWER_2 + end_of_turn]
    assert sample.turns_outside_mask == 0


def test_chatml_sequence_is_the_template_output_and_newline_after_im_end_is_unmasked(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    sample = render_conversation(tokenizer, [SYSTEM] + TWO_TURNS, max_length=4096)
    expected = (
        "<|im_start|>system\nYou answer in one sentence.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        f"<|im_start|>assistant\n{ANSWER_1}<|im_end|>\n"
        "<|im_start|>user\nAnd how many people live there?<|im_end|>\n"
        f"<|im_start|>assistant\n{ANSWER_2}<|im_end|>\n"
    )
    assert tokenizer.decode(sample.input_ids) == expected
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, token in enumerate(sample.input_ids):
        if token == im_end and sample.loss_mask[i]:
            assert tokenizer.decode(sample.input_ids[i + 1:i + 2]) == "\n"
            assert sample.loss_mask[i + 1] == 0


def test_chatml_default_system_turn_is_not_masked(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    sample = render_conversation(tokenizer, TWO_TURNS[:2], max_length=4096)
    assert "named SmolLM" in tokenizer.decode(sample.input_ids)
    assert masked_spans(tokenizer, sample) == [ANSWER_1 + "<|im_end|>"]


# ---- Qwen3: thinking switch and the prefix-property fallback -------------

def test_qwen3_prompt_without_thinking_ends_with_empty_think_block(make_tokenizer):
    tokenizer = make_tokenizer("qwen3")
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    off = tokenizer.decode(render_prompt(tokenizer, prompt))
    on = tokenizer.decode(render_prompt(tokenizer, prompt, enable_thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    assert "<think>" not in on


def test_qwen3_empty_think_block_is_prompt_not_loss(make_tokenizer):
    tokenizer = make_tokenizer("qwen3")
    sample = render_conversation(tokenizer, TWO_TURNS[:2], max_length=4096)
    start = sample.loss_mask.index(1)
    assert tokenizer.decode(sample.input_ids[:start]).endswith("assistant\n<think>\n\n</think>\n\n")


def test_qwen3_with_thinking_on_the_model_writes_the_think_block(make_tokenizer):
    # The generation prompt stops at the header, so the (empty) think block is generated text.
    tokenizer = make_tokenizer("qwen3")
    sample = render_conversation(tokenizer, TWO_TURNS[:2], max_length=4096, enable_thinking=True)
    assert masked_spans(tokenizer, sample) == ["<think>\n\n</think>\n\n" + ANSWER_1 + "<|im_end|>"]


def test_qwen3_earlier_turn_breaking_prefix_property_stays_as_unmasked_context(make_tokenizer):
    # The first answer is rendered without a think block once a later user turn
    # exists, so its generation prompt is not a prefix of the full rendering.
    tokenizer = make_tokenizer("qwen3")
    sample = render_conversation(tokenizer, [SYSTEM] + TWO_TURNS, max_length=4096)
    assert sample.turns_outside_mask == 1
    assert masked_spans(tokenizer, sample) == [ANSWER_2 + "<|im_end|>"]
    text = tokenizer.decode(sample.input_ids)
    assert f"<|im_start|>assistant\n{ANSWER_1}<|im_end|>\n" in text


# ---- generation prompt matches training sequences ------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_tokens_are_the_sequence_before_the_answer(make_tokenizer, family):
    tokenizer = make_tokenizer(family)
    conversation = [SYSTEM] + TWO_TURNS[:2]
    sample = render_conversation(tokenizer, conversation, max_length=4096)
    prompt = render_prompt(tokenizer, prompt_only(conversation))
    assert prompt == sample.input_ids[:sample.loss_mask.index(1)]


def test_chatml_keeps_the_one_piece_tokenization_when_token_prefixes_hold(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    conversation = [SYSTEM] + TWO_TURNS
    sample = render_conversation(tokenizer, conversation, max_length=4096)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert not sample.tokenized_piecewise
    assert sample.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_merge_across_the_answer_boundary_falls_back_to_piecewise_tokens(make_tokenizer):
    # The toy pre-tokenizer reads "\n\n" at the end of the Llama 3 generation
    # prompt as one token, but "\n\nThe" as "\n", "\n", "The".
    tokenizer = make_tokenizer("llama3")
    conversation = TWO_TURNS[:2]
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    sample = render_conversation(tokenizer, conversation, max_length=4096)
    assert sample.tokenized_piecewise and sample.input_ids != whole
    assert tokenizer.decode(sample.input_ids) == tokenizer.decode(whole)
    start = sample.loss_mask.index(1)
    assert sample.input_ids[:start] == render_prompt(tokenizer, conversation[:1])
    assert tokenizer.decode(sample.input_ids[start:start + 1]) == "The"


# The pre-tokenizer pattern of the Qwen2/Qwen3 and Llama 3 tokenizers: "\s*[\r\n]+"
# keeps a run of newlines together whatever follows it.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_qwen_style_pretokenizer_needs_no_piecewise_fallback(family):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    kwargs = dict(FAMILIES[family])
    chat_template = kwargs.pop("chat_template")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    fast.chat_template = chat_template
    sample = render_conversation(fast, TWO_TURNS[:2], max_length=4096)
    assert not sample.tokenized_piecewise
    assert masked_spans(fast, sample) == [ANSWER_1 + FAMILIES[family]["eos_token"]]


class AddsPrefixSpace:
    """A tokenizer that inserts a space at the start of every call, as SentencePiece's dummy prefix does."""

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def __call__(self, text, **kwargs):
        return self.inner(" " + text, **kwargs)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_piecewise_tokens_that_change_the_text_leave_every_turn_unmasked(make_tokenizer):
    tokenizer = AddsPrefixSpace(make_tokenizer("llama3"))
    sample = render_conversation(tokenizer, TWO_TURNS, max_length=4096)
    assert sample.tokenized_piecewise
    assert sample.num_loss_tokens == 0 and sample.turns_outside_mask == 2


def test_render_prompt_rejects_a_trailing_assistant_turn(make_tokenizer):
    with pytest.raises(ValueError, match="prompt_only"):
        render_prompt(make_tokenizer("chatml"), TWO_TURNS[:2])


def test_tokenizer_without_chat_template_is_rejected(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        render_conversation(tokenizer, TWO_TURNS[:2], max_length=64)


# ---- truncation and filtering --------------------------------------------

def test_truncation_keeps_the_first_max_length_tokens(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    full = render_conversation(tokenizer, TWO_TURNS, max_length=4096)
    cut = render_conversation(tokenizer, TWO_TURNS, max_length=len(full.input_ids) - 5)
    assert not full.truncated and cut.truncated
    assert cut.input_ids == full.input_ids[:-5]
    assert cut.loss_mask == full.loss_mask[:-5]
    exact = render_conversation(tokenizer, TWO_TURNS, max_length=len(full.input_ids))
    assert not exact.truncated and exact == full


def test_render_dataset_drops_samples_with_too_few_loss_tokens_and_counts(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    short = TWO_TURNS[:2]
    long_question = [{"role": "user", "content": "the and of in is to a " * 40}, TWO_TURNS[1]]
    prompt_only_conv = TWO_TURNS[:1]
    max_length = len(render_conversation(tokenizer, short, max_length=4096).input_ids)
    samples, stats = render_dataset(
        tokenizer, [short, long_question, prompt_only_conv, short],
        max_length=max_length, min_loss_tokens=2, progress=False,
    )
    assert len(samples) == 2 and all(s.num_loss_tokens >= 2 for s in samples)
    assert (stats.total, stats.kept, stats.dropped_too_few_loss_tokens, stats.truncated) == (4, 2, 2, 1)
    assert stats.num_tokens == 2 * max_length
    assert stats.num_loss_tokens == sum(s.num_loss_tokens for s in samples)


def test_min_loss_tokens_threshold_is_inclusive(make_tokenizer):
    tokenizer = make_tokenizer("chatml")
    n = render_conversation(tokenizer, TWO_TURNS[:2], max_length=4096).num_loss_tokens
    kept, _ = render_dataset(tokenizer, [TWO_TURNS[:2]], 4096, min_loss_tokens=n, progress=False)
    dropped, stats = render_dataset(tokenizer, [TWO_TURNS[:2]], 4096, min_loss_tokens=n + 1, progress=False)
    assert len(kept) == 1 and not dropped and stats.dropped_too_few_loss_tokens == 1


# ---- the real SmolLM2 tokenizer, when available --------------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    hub = pytest.importorskip("dspark.hub")
    from transformers import AutoTokenizer

    folder = hub.cache_dir() / "targets" / hub.SMOLLM2_FOLDER
    try:
        if (folder / hub.MARKER_FILE).is_file():  # already converted by resolve_target_path
            return AutoTokenizer.from_pretrained(folder)
        # Not converted yet: read the tokenizer straight from the GGUF (seconds, not the full model).
        gguf = hub.find_smollm2_gguf()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001 - any failure here means "not available"
        pytest.skip(f"SmolLM2 tokenizer not available: {e}")


def test_smollm2_real_tokenizer_mask_and_sequence(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    sample = render_conversation(tokenizer, [SYSTEM] + TWO_TURNS, max_length=4096)
    assert masked_spans(tokenizer, sample) == [ANSWER_1 + "<|im_end|>", ANSWER_2 + "<|im_end|>"]
    assert tokenizer.decode(sample.input_ids) == (
        "<|im_start|>system\nYou answer in one sentence.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        f"<|im_start|>assistant\n{ANSWER_1}<|im_end|>\n"
        "<|im_start|>user\nAnd how many people live there?<|im_end|>\n"
        f"<|im_start|>assistant\n{ANSWER_2}<|im_end|>\n"
    )
    prompt = render_prompt(tokenizer, prompt_only([SYSTEM] + TWO_TURNS))
    assert prompt == sample.input_ids[:len(prompt)] and sample.loss_mask[len(prompt)] == 1


def test_smollm2_answer_starting_with_newlines_is_cut_at_the_prompt_boundary(smollm2_tokenizer):
    # SmolLM2's GPT-2-style pre-tokenizer merges "\n" + "\n\n" across the cut.
    tokenizer = smollm2_tokenizer
    conversation = [TWO_TURNS[0], {"role": "assistant", "content": "\n\nParis."}]
    sample = render_conversation(tokenizer, conversation, max_length=4096)
    assert sample.tokenized_piecewise
    assert masked_spans(tokenizer, sample) == ["\n\nParis.<|im_end|>"]
    prompt = render_prompt(tokenizer, conversation[:1])
    assert sample.input_ids[:len(prompt)] == prompt and sample.loss_mask.index(1) == len(prompt)
