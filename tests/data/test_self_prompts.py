"""Self-written training prompts (dspark.data.self_prompts, dspark.data.near_duplicates): template
cut, filters, deduplication, evaluation guard, determinism, the data.train_prompts spec and the
path through `prepare`.

Tokenizers are tiny byte-level BPEs trained here with three chat formats: SmolLM2's ChatML
(``dspark.hub.CHATML_TEMPLATE``, a default system turn), Llama 3 and Gemma (written from
their documented formats). The sampling step is replaced by scripted texts wherever the
test is about what happens to a text; one test samples a tiny random Llama for determinism.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from dspark.config import Config, DataConfig, EvalConfig, GenerationConfig, load_config
from dspark.config_checks import split_train_prompts, validate
from dspark.data import prepare as prepare_module
from dspark.data import near_duplicates as N
from dspark.data import self_prompts as S
from dspark.data.generate import Result
from dspark.data.prepare import load_train_prompts, prepare, split_indices
from dspark.data.prompts import builtin_eval_sets
from dspark.data.dataset import load_rendered
from dspark.hub import CHATML_TEMPLATE
from helpers.bpe import LLAMA3_TEMPLATE, chat_tokenizer, train_bpe
from helpers.targets import build_tiny_model

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
]
GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' + message.content | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
FAMILIES = {
    "chatml": dict(chat_template=CHATML_TEMPLATE, eos_token="<|im_end|>"),
    "llama3": dict(chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "gemma": dict(chat_template=GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>"),
}
# The hand-written text each template puts before a first user message, and its end-of-turn token.
PREFIXES = {
    "chatml": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\n",
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
    "gemma": "<bos><start_of_turn>user\n",
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
CORPUS = [
    "system\nuser\nassistant\nmodel\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "What is two plus two? Name a colour. Write a short poem about the sea and the wind.",
    "Please describe the moon, a volcano and the ocean in three short sentences. Sure, here it is.",
] * 10

STORY = "please write a short story about a dragon who learns to bake bread in a small village"  # 17 words
FRESH = [
    "Please describe the moon in three short sentences.",
    "Explain why the sky looks blue during the day.",
    "Give me four ideas for a rainy afternoon at home.",
]
BENCHMARK_PROMPT = "Tom has 12 apples and gives 5 of them to his sister. How many apples does Tom have left now?"
LONG_BENCHMARK_PROMPT = (  # 46 words, 42 shingles
    "A farmer plants 3 rows of corn with 15 stalks in each row. Every stalk grows 2 ears of corn, and the farmer "
    "sells each ear for 50 cents at the market on Saturday. How much money does the farmer make if he sells every ear?"
)
WRAPPED = f"Here is a problem for you: {BENCHMARK_PROMPT} Please explain step by step."  # 16 of its 27 shingles
FRAGMENT = "Every stalk grows 2 ears of corn, and the farmer sells each ear for 50 cents at the market on Saturday."


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return train_bpe(CORPUS, 400, SPECIAL_TOKENS).to_str()


@pytest.fixture(scope="module")
def make_tokenizer(tokenizer_json):
    def make(family: str) -> PreTrainedTokenizerFast:
        return chat_tokenizer(tokenizer_json, FAMILIES[family], SPECIAL_TOKENS)

    return make


@pytest.fixture
def chatml(make_tokenizer) -> PreTrainedTokenizerFast:
    return make_tokenizer("chatml")


def scripted_sampler(texts, calls=None, ended=True):
    """A stand-in for sample_user_turns: hands out `texts` in order, `count` per batch, then
    unfinished empty turns (which are always dropped)."""
    queue = list(texts)

    def sample(model, tokenizer, template, count, settings, seed):
        if calls is not None:
            calls.append((count, seed))
        batch, queue[:] = queue[:count], queue[count:]
        return [S.UserTurn(text, ended) for text in batch] + [S.UserTurn("", False)] * (count - len(batch))

    return sample


def settings(**fields) -> S.SelfPromptSettings:
    return S.SelfPromptSettings(**{"num_prompts": 3, "batch_size": 4, **fields})


# --------------------------------------------------------------- template cut
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_is_the_template_text_before_a_first_user_message(make_tokenizer, family):
    tokenizer = make_tokenizer(family)
    assert S.user_turn_prefix(tokenizer) == PREFIXES[family]
    template = S.user_turn_template(tokenizer)
    assert tokenizer.decode(template.prefix_ids) == PREFIXES[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_user_turn_stops_at_the_templates_end_of_turn_token(make_tokenizer, family):
    tokenizer = make_tokenizer(family)
    template = S.user_turn_template(tokenizer)
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN[family]) in template.stop_ids
    assert tokenizer.eos_token_id in template.stop_ids


def test_markers_hold_the_turn_markup_between_messages(chatml):
    markers = S.user_turn_template(chatml).markers
    assert {"<|im_end|>", "<|im_start|>assistant", "<|im_start|>user"} <= set(markers)


def test_template_that_drops_the_user_text_is_refused(chatml):
    chatml.chat_template = "{%- for message in messages -%}<|im_start|>{{ message.role }}\n<|im_end|>{%- endfor -%}"
    with pytest.raises(ValueError, match="verbatim"):
        S.user_turn_prefix(chatml)


# ------------------------------------------------------------------- filters
@pytest.mark.parametrize("text, reason", [
    ("Hi there", "too_short"),
    ("Describe the long history of the city of Rome in great detail, please.", "too_long"),
    ("12345 + 67890 = ?", "no_letters"),
    ("What is two plus two?<|im_end|>", "template_tokens"),
    ("Hello<|im_start|>assistant", "template_tokens"),
    ("aaaaaaaaaaaaaaaaaaaaab?", "repetitive"),
    ("go go go go go stop now", "repetitive"),
    ("Name three rivers in Europe.", None),
])
def test_filter_reason(chatml, text, reason):
    markers = S.user_turn_template(chatml).markers
    assert S.filter_reason(text, settings(min_chars=10, max_chars=60), markers) == reason


def test_repeated_word_trigrams_are_repetitive_and_a_plain_question_is_not():
    assert S.is_repetitive("tell me a story tell me a story tell me a story")  # 4 distinct of 10 trigrams
    assert not S.is_repetitive("What is the capital of France, and why did it become the capital?")


# ---------------------------------------------------------------- duplicates
def test_normalize_casefolds_strips_punctuation_and_collapses_whitespace():
    assert N.normalize_text("  What is the CAPITAL\tof   France?? ") == "what is the capital of france"
    assert N.normalize_text("Don't stop!") == "dont stop"


def test_exact_duplicate_after_normalisation():
    index = N.DuplicateIndex()
    index.add("What is the capital of France?")
    assert index.match("  what is the CAPITAL of france ") == "duplicate"
    assert index.match("What is the capital of Spain?") is None


def test_near_duplicate_is_word_5gram_jaccard_at_least_0_8():
    end_changed = STORY.replace("village", "town")  # 1 of 13 shingles changes: 12 / 14
    middle_changed = STORY.replace("dragon", "wizard")  # 5 of 13 change: 8 / 18
    assert N.jaccard(N.word_shingles(STORY), N.word_shingles(end_changed)) == pytest.approx(12 / 14)
    assert N.jaccard(N.word_shingles(STORY), N.word_shingles(middle_changed)) == pytest.approx(8 / 18)
    index = N.DuplicateIndex(threshold=0.8)
    index.add(STORY)
    assert index.match(end_changed) == "near_duplicate"
    assert index.match(middle_changed) is None


def test_texts_under_five_words_are_near_duplicates_only_when_equal():
    index = N.DuplicateIndex()
    index.add("Name a colour.")
    assert index.match("Name a color.") is None
    assert index.match("name a colour!") == "duplicate"


def test_containment_is_the_larger_share_of_shingles_the_other_text_holds():
    piece = " ".join(STORY.split()[:10])  # 6 shingles, all of them among STORY's 13
    wrapped = "I would love it if you could " + STORY  # 7 more words: 20 shingles, 13 of them STORY's
    assert N.containment(N.word_shingles(piece), N.word_shingles(STORY)) == 1.0
    assert N.containment(N.word_shingles(STORY), N.word_shingles(wrapped)) == 1.0
    assert N.jaccard(N.word_shingles(STORY), N.word_shingles(wrapped)) == pytest.approx(13 / 20)
    half = " ".join(STORY.split()[:10]) + " and then sings a song to the moon"  # 14 shingles, 6 of them STORY's
    assert N.containment(N.word_shingles(half), N.word_shingles(STORY)) == pytest.approx(6 / 13)


def test_a_text_under_five_words_is_contained_when_its_words_run_consecutively_in_the_other():
    story = N.word_shingles(STORY)
    assert N.containment(N.word_shingles("A dragon, who"), story) == 1.0  # in both argument orders
    assert N.containment(story, N.word_shingles("bake bread")) == 1.0
    assert N.containment(N.word_shingles("dragon who bake"), story) == 0.0  # words of STORY, not a run of it
    assert N.containment(N.word_shingles("name a colour"), N.word_shingles("Name a colour, please")) == 1.0
    index = N.DuplicateIndex(containment=0.8)
    index.add(STORY)
    index.add("Name a colour, please.")
    for text, found in [("A dragon who", "contained"), ("village", "contained"), ("in a small village", "contained"),
                        ("dragon who bake", None), ("please name a colour", None),
                        ("Now name a colour, please, and a fruit.", "contained")]:
        assert index.match(text) == found, text


def test_containment_is_looked_up_only_when_the_index_is_given_a_threshold():
    plain, with_containment = N.DuplicateIndex(), N.DuplicateIndex(containment=0.8)
    for index in (plain, with_containment):
        index.add(BENCHMARK_PROMPT)
    assert N.jaccard(N.word_shingles(BENCHMARK_PROMPT), N.word_shingles(WRAPPED)) < 0.8
    assert plain.match(WRAPPED) is None
    assert with_containment.match(WRAPPED) == "contained"


def test_generator_drops_duplicates_and_near_duplicates_of_kept_prompts(chatml, monkeypatch):
    texts = [STORY, STORY.upper() + "!", STORY.replace("village", "town"), FRESH[0], FRESH[1]]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(texts))
    result = S.generate_self_prompts(None, chatml, settings(), progress=False)
    assert [c[0]["content"] for c in result.conversations] == [STORY, FRESH[0], FRESH[1]]
    assert (result.stats["dropped"]["duplicate"], result.stats["dropped"]["near_duplicate"]) == (1, 1)


# ------------------------------------------------------------ evaluation guard
def test_evaluation_prompts_emitted_by_the_generator_are_dropped(chatml, monkeypatch, tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"turns": [BENCHMARK_PROMPT]}) + "\n")
    builtin = builtin_eval_sets()["builtin-chat"][0][0]["content"]
    texts = [
        builtin,  # verbatim
        "  " + builtin.upper().replace(".", "!") + " ",  # same after normalisation
        BENCHMARK_PROMPT.replace("now?", "then?"),  # near-duplicate of a benchmark file's prompt
        FRESH[0],
    ]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(texts))
    evals = S.evaluation_prompts(tmp_path, ["gsm8k", "mbpp"])
    assert sorted(evals) == ["builtin-chat", "builtin-code", "builtin-math", "gsm8k"]
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=2), evals, progress=False)
    assert result.conversations == [[{"role": "user", "content": FRESH[0]}]]
    assert result.stats["dropped"]["eval_overlap"] == 3
    assert result.stats["eval_prompts"]["gsm8k"] == 1


def test_a_wrapped_benchmark_question_and_a_piece_of_one_are_dropped_by_containment(chatml, monkeypatch, tmp_path):
    lines = [json.dumps({"turns": [BENCHMARK_PROMPT]}), json.dumps({"turns": [LONG_BENCHMARK_PROMPT]})]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    assert N.jaccard(N.word_shingles(BENCHMARK_PROMPT), N.word_shingles(WRAPPED)) == pytest.approx(16 / 27)
    assert N.jaccard(N.word_shingles(LONG_BENCHMARK_PROMPT), N.word_shingles(FRAGMENT)) == pytest.approx(17 / 42)
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler([WRAPPED, FRAGMENT, FRESH[0]]))
    evals = S.evaluation_prompts(tmp_path, ["gsm8k"])
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=1), evals, progress=False)
    assert result.conversations == [[{"role": "user", "content": FRESH[0]}]]
    assert (result.stats["dropped"]["eval_overlap"], result.stats["dropped"]["eval_containment"]) == (0, 2)


def test_a_prompt_repeating_or_wrapping_a_training_prompt_is_dropped_as_source_overlap(chatml, monkeypatch):
    texts = [STORY, "Could you do this for me? " + STORY + " Thanks a lot!", STORY.replace("village", "town"),
             FRESH[0]]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(texts))
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=1, batch_size=4), source_prompts=[STORY],
                                     progress=False)
    assert result.conversations == [[{"role": "user", "content": FRESH[0]}]]
    assert result.stats["dropped"]["source_overlap"] == 3 and result.stats["source_prompts"] == 1


def test_builtin_evaluation_sets_are_checked_by_default(chatml, monkeypatch):
    builtin = builtin_eval_sets()["builtin-math"][0][0]["content"]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler([builtin, FRESH[0]]))
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=1), progress=False)
    assert [c[0]["content"] for c in result.conversations] == [FRESH[0]]


# ------------------------------------------------------------------- driver
def test_stats_ids_and_stop_after_the_nth_kept_prompt(chatml, monkeypatch):
    calls = []
    texts = ["  " + FRESH[0] + "\n", "Hi", FRESH[1], FRESH[2], "never examined"]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(texts, calls))
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=2, seed=7), progress=False)
    assert result.conversations == [[{"role": "user", "content": FRESH[0]}], [{"role": "user", "content": FRESH[1]}]]
    assert result.ids == ["self-000000", "self-000001"]
    assert (result.stats["generated"], result.stats["kept"], result.stats["dropped"]["too_short"]) == (3, 2, 1)
    assert sum(result.stats["dropped"].values()) + result.stats["kept"] == result.stats["generated"]
    assert calls == [(4, 7)]


def test_sampling_gives_up_after_the_draw_budget(chatml, monkeypatch):
    calls = []
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler([FRESH[0]] * 20, calls, ended=False))
    result = S.generate_self_prompts(None, chatml, settings(num_prompts=3, max_draws_per_prompt=2.0), progress=False)
    assert result.conversations == [] and result.ids == []
    assert (result.stats["generated"], result.stats["dropped"]["unfinished"]) == (6, 6)
    assert calls == [(4, 0), (2, 1)]  # batch b under seed + b, the last one cut to the budget


def test_sampling_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone(chatml, one_thread):
    model = build_tiny_model("llama", vocab_size=len(chatml))
    template = S.user_turn_template(chatml, model)
    config = settings(max_new_tokens=8)
    before = torch.random.get_rng_state()
    first = S.sample_user_turns(model, chatml, template, 4, config, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert S.sample_user_turns(model, chatml, template, 4, config, seed=5) == first
    assert S.sample_user_turns(model, chatml, template, 4, config, seed=6) != first
    runs = [S.generate_self_prompts(model, chatml, settings(max_new_tokens=8, seed=5), progress=False)
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].stats["generated"] > 0


def test_settings_out_of_range_name_the_field():
    with pytest.raises(ValueError, match="SelfPromptSettings.top_p"):
        S.SelfPromptSettings(num_prompts=3, top_p=1.5)


# --------------------------------------------------------------------- saved
def test_saved_prompts_are_reused_only_with_the_same_settings_and_no_eval_overlap(chatml, monkeypatch, tmp_path):
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(FRESH))
    written = S.generate_self_prompts(None, chatml, settings(), progress=False)
    path = tmp_path / "self_prompts.json"
    S.save_self_prompts(path, written, settings())
    assert S.load_self_prompts(path, settings(), S.evaluation_prompts()) == written
    assert S.load_self_prompts(tmp_path / "absent.json", settings(), {}) is None
    with pytest.raises(ValueError, match="settings"):
        S.load_self_prompts(path, settings(seed=1), {})
    with pytest.raises(ValueError, match="self-000001 repeats an evaluation prompt"):
        S.load_self_prompts(path, settings(), {"gsm8k": [FRESH[1]]})
    with pytest.raises(ValueError, match="self-000002 holds or is a piece of an evaluation prompt"):
        S.load_self_prompts(path, settings(), {"gsm8k": [f"Read this first. {FRESH[2]} Then answer."]})


# -------------------------------------------------------------------- config
@pytest.mark.parametrize("spec, parsed", [
    ("builtin", ("builtin", 0)),
    ("builtin+self:200", ("builtin", 200)),
    ("self:7", ("", 7)),
    ("hub:mlabonne/open-perfectblend+self:5", ("hub:mlabonne/open-perfectblend", 5)),
    ("prompts/self.jsonl", ("prompts/self.jsonl", 0)),
])
def test_train_prompts_spec_parses(spec, parsed):
    assert split_train_prompts(spec) == parsed


@pytest.mark.parametrize("spec, problem", [
    ("builtin+self", "integer >= 1"),
    ("builtin+self:0", "integer >= 1"),
    ("self:many", "integer >= 1"),
    ("+self:3", "must follow one source"),
    ("builtin+self:2+self:3", "must follow one source"),
])
def test_bad_train_prompts_spec_names_the_field_and_the_fix(spec, problem):
    with pytest.raises(ValueError, match=problem) as error:
        load_config(None, [f"data.train_prompts={spec}"])  # refused before any model is loaded
    assert "data.train_prompts=" in str(error.value) and "'builtin+self:2000'" in str(error.value)


def test_self_only_spec_loads_no_source_prompts():
    assert load_train_prompts(Config(data=DataConfig(train_prompts="self:4"))) == ([], [])


# ------------------------------------------------------------------- prepare
class AnsweringBackend:
    def generate(self, batch, start):
        return [Result(text="Sure, here it is.", finish_reason="stop", num_tokens=5) for _ in batch]


UNCHECKED = ["math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2"]


def gsm8k_only_config(tmp_path, **data) -> Config:
    """A "builtin+self:3" config whose benchmark folder holds gsm8k.jsonl only (eval.benchmarks: all nine)."""
    bench = tmp_path / "bench"
    bench.mkdir(exist_ok=True)
    (bench / "gsm8k.jsonl").write_text(json.dumps({"turns": [BENCHMARK_PROMPT]}) + "\n")
    fields = dict(train_prompts="builtin+self:3", max_samples=5, holdout_fraction=0.5, min_loss_tokens=1, **data)
    config = Config(out_dir=str(tmp_path / "run"), seed=3, data=DataConfig(**fields),
                    generation=GenerationConfig(batch_size=4), eval=EvalConfig(data_dir=str(bench)))
    validate(config)
    return config


def test_prepare_puts_self_prompts_through_the_split_after_the_eval_and_source_filters(chatml, monkeypatch, tmp_path):
    config = gsm8k_only_config(tmp_path, self_prompts_unchecked=UNCHECKED)
    source = load_train_prompts(config)[0]
    wrapped_source = "Could you help me with this one? " + source[2][0]["content"]
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler([BENCHMARK_PROMPT, wrapped_source] + FRESH))
    monkeypatch.setattr(prepare_module, "make_backend", lambda config, target: AnsweringBackend())
    target = SimpleNamespace(model=None, tokenizer=chatml)
    unchecked = r"not checked against benchmark\(s\) \['math500', .*'arena-hard-v2'\]"
    with pytest.warns(UserWarning, match=unchecked) as seen:
        result = prepare(config, target, build_cache=False, progress=False)
    assert "'gsm8k'" not in str(seen[0].message) and "data.self_prompts_unchecked" in str(seen[0].message)

    rows = [json.loads(line) for line in result.responses.read_text().splitlines()]
    assert [r["id"] for r in rows][5:] == ["self-000000", "self-000001", "self-000002"]
    samples = load_rendered(result.rendered)
    texts = [chatml.decode(s.input_ids) for s in samples]
    assert len(samples) == 8 and [FRESH[i] in texts[5 + i] for i in range(3)] == [True] * 3
    assert not any(BENCHMARK_PROMPT in t for t in texts)
    split = json.loads(result.split.read_text())
    assert (split["train"], split["holdout"]) == split_indices(8, 0.5, 3)
    assert set(split["holdout"]) & {5, 6, 7} and set(split["train"]) & {5, 6, 7}  # self prompts on both sides
    assert split["self_prompts"]["kept"] == 3 and split["self_prompts"]["dropped"]["eval_overlap"] == 1
    assert split["self_prompts"]["dropped"]["source_overlap"] == 1 and split["self_prompts"]["source_prompts"] == 5
    assert split["self_prompts"]["eval_prompts"]["gsm8k"] == 1

    def no_sampling(*args):
        raise AssertionError("the saved self-written prompts must be reused")

    monkeypatch.setattr(S, "sample_user_turns", no_sampling)
    again = prepare(config, target, build_cache=False, progress=False)
    assert again.stats["split"]["self_prompts"] == split["self_prompts"]


def test_prepare_writes_self_prompts_silently_when_every_benchmark_is_checked(chatml, monkeypatch, tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gsm8k.jsonl").write_text(json.dumps({"turns": [BENCHMARK_PROMPT]}) + "\n")
    monkeypatch.setattr(S, "sample_user_turns", scripted_sampler(FRESH))
    monkeypatch.setattr(prepare_module, "make_backend", lambda config, target: AnsweringBackend())
    config = Config(
        out_dir=str(tmp_path / "run"), seed=3,
        data=DataConfig(train_prompts="builtin+self:2", max_samples=2, holdout_fraction=0.5, min_loss_tokens=1),
        generation=GenerationConfig(batch_size=4), eval=EvalConfig(data_dir=str(bench), benchmarks=["gsm8k"]),
    )
    validate(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = prepare(config, SimpleNamespace(model=None, tokenizer=chatml), build_cache=False, progress=False)
    assert result.stats["split"]["self_prompts"]["eval_prompts"]["gsm8k"] == 1


def test_a_missing_benchmark_file_is_an_error_naming_the_file_the_folder_and_both_fixes(chatml, tmp_path):
    config = gsm8k_only_config(tmp_path, self_prompts_unchecked=UNCHECKED[1:])  # math500 left checked
    with pytest.raises(ValueError) as error:
        prepare(config, SimpleNamespace(model=None, tokenizer=chatml), build_cache=False, progress=False)
    message = str(error.value)
    assert "math500.jsonl" in message and "aime25.jsonl" not in message and str(tmp_path / "bench") in message
    assert "eval.data_dir" in message and "$DSPARK_EVAL_DATA" in message and "data.self_prompts_unchecked" in message
    assert not (tmp_path / "run" / "data" / "self_prompts.json").exists()


def test_the_cli_refuses_a_missing_benchmark_file_before_loading_the_target(monkeypatch, tmp_path, capsys):
    import dspark.build
    from dspark.cli.main import main

    def no_loading(config):
        raise AssertionError("the target must not be loaded")

    monkeypatch.setattr(dspark.build, "load_target", no_loading)
    bench = gsm8k_only_config(tmp_path).eval.data_dir
    argv = ["--set", "data.train_prompts=builtin+self:3", f"eval.data_dir={bench}", f"out_dir={tmp_path / 'run'}"]
    assert main(["prepare", *argv]) == 2
    assert "math500.jsonl" in capsys.readouterr().err
    assert main(["cache", *argv]) == 2
    assert "math500.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_unchecked_name_outside_eval_benchmarks_is_refused():
    config = Config(data=DataConfig(train_prompts="builtin+self:3", self_prompts_unchecked=["mbpp"]),
                    eval=EvalConfig(benchmarks=["gsm8k"]))
    with pytest.raises(ValueError, match=r"data.self_prompts_unchecked names \['mbpp'\], not in eval.benchmarks"):
        prepare_module.check_prepare_inputs(config)


def test_prompts_without_self_written_ones_need_no_benchmark_files(tmp_path):
    config = Config(data=DataConfig(train_prompts="builtin", self_prompts_unchecked=["unknown"]),
                    eval=EvalConfig(data_dir=str(tmp_path)))
    prepare_module.check_prepare_inputs(config)  # no error
