"""Self-written training prompts: user turns sampled from the target itself, no dataset needed.

Training data is prompts only (paper Section 4.1) and the target answers them
itself; here it writes the questions too. The chat template is rendered up to
and including the header of a user turn (:func:`user_turn_prefix`; found by
rendering a sentinel user message and cutting at it, so no chat format is
written here), and the target continues that text until it ends the turn.
:func:`generate_self_prompts` says what is kept of it (``DROP_REASONS``, in order).

Batch ``b`` is sampled under ``torch.manual_seed(seed + b)`` in a forked RNG,
so a run is deterministic for given settings on CPU (GPU kernels may differ
in the last bits). ``dspark prepare`` keeps the result in
``<data_dir>/self_prompts.json`` (:func:`save_self_prompts`), so the
answers it regenerates can resume against the same prompts.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dspark.data.benchmarks import BENCHMARKS, eval_data_folder
from dspark.data.generate import end_of_turn_token_ids, split_completion
from dspark.data.near_duplicates import DuplicateIndex, normalize_text
from dspark.data.prompts import Conversation, builtin_eval_sets, load_eval_benchmark
from dspark.data.render import render_text
from dspark.io.atomic import atomic_write_text

logger = logging.getLogger(__name__)

SENTINEL = "DSPARK_USER_TURN_SENTINEL"
ID_PREFIX = "self-"  # ids are ID_PREFIX + the 6-digit index among kept prompts: self-000000, ...
# Every reason a sampled user turn is dropped, in the order they are checked.
DROP_REASONS = (
    "unfinished", "template_tokens", "too_short", "too_long", "no_letters", "repetitive",
    "eval_overlap", "eval_containment", "source_overlap", "duplicate", "near_duplicate",
)


@dataclass(frozen=True)
class SelfPromptSettings:
    """How many prompts to write, how to sample them, and what to keep."""

    num_prompts: int  # N: prompts to keep
    temperature: float = 1.0  # > 0: the target's own distribution of user turns, for variety
    top_p: float = 0.95
    top_k: int = 0  # 0 = no top-k cut
    max_new_tokens: int = 256  # per user turn; a turn not ended by then is dropped ("unfinished")
    batch_size: int = 32  # user turns per generate call
    seed: int = 0  # batch b is sampled under torch.manual_seed(seed + b)
    max_draws_per_prompt: float = 4.0  # give up after ceil(this * num_prompts) sampled turns
    min_chars: int = 10  # after stripping
    max_chars: int = 2000
    near_duplicate_jaccard: float = 0.8  # word 5-gram Jaccard at which two prompts count as one
    # word 5-gram containment (dspark.data.near_duplicates.containment) at which a prompt counts as
    # holding an evaluation or source prompt, or as a piece of one
    containment: float = 0.8

    def __post_init__(self) -> None:
        checks = {
            "num_prompts": self.num_prompts >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "max_new_tokens": self.max_new_tokens >= 1,
            "batch_size": self.batch_size >= 1,
            "max_draws_per_prompt": self.max_draws_per_prompt >= 1,
            "min_chars": self.min_chars >= 1,
            "max_chars": self.max_chars >= self.min_chars,
            "near_duplicate_jaccard": 0 < self.near_duplicate_jaccard <= 1,
            "containment": 0 < self.containment <= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"SelfPromptSettings.{bad[0]}={getattr(self, bad[0])!r} is out of range; need num_prompts, "
                "max_new_tokens, batch_size, min_chars >= 1, temperature > 0, top_p, near_duplicate_jaccard and "
                "containment in (0, 1], top_k >= 0, max_draws_per_prompt >= 1, max_chars >= min_chars"
            )


@dataclass(frozen=True)
class SelfPrompts:
    """Self-written prompts: one user turn per conversation, ids ``self-000000`` ... in order.

    ``stats``: ``requested`` (N), ``generated`` (sampled turns examined; turns of
    the last batch after the N-th kept one are not), ``kept``, ``dropped``
    ({reason: count} over ``DROP_REASONS``; kept + dropped = generated),
    ``eval_prompts`` ({evaluation set: prompts compared against}) and
    ``source_prompts`` (training-source prompts compared against)."""

    conversations: list[Conversation]
    ids: list[str]
    stats: dict[str, Any]


@dataclass(frozen=True)
class UserTurnTemplate:
    """What the chat template says about a user turn, for one tokenizer."""

    prefix: str  # the rendering up to and including the start of a first user turn
    prefix_ids: list[int]  # its tokens (the template writes BOS itself where the model wants one)
    stop_ids: list[int]  # tokens that end the turn: the template's end-of-turn token, eos
    markers: tuple[str, ...]  # texts a kept prompt may not contain: special tokens, turn markup


@dataclass(frozen=True)
class UserTurn:
    """One sampled user turn: its decoded text and whether the model ended the turn."""

    text: str
    ended: bool


# ------------------------------------------------------------------ template
def _render(tokenizer: Any, messages: Conversation) -> str:
    """``messages`` under the chat template, no generation prompt, thinking off."""
    return render_text(tokenizer, messages, False, False)


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template's text before the content of a first user message: a default system
    turn when the template writes one, BOS, and the user turn's header.

    Found by rendering ``[{"role": "user", "content": SENTINEL}]`` and cutting at the sentinel.
    """
    text = _render(tokenizer, [{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise ValueError(
            f"the chat template does not copy a user message into its output (rendered {text!r:.200}); "
            "self-written prompts need a template that writes the user's text verbatim"
        )
    return text[: text.index(SENTINEL)]


def _turn_markup(tokenizer: Any) -> set[str]:
    """Whitespace-separated pieces the template writes between turns (``<|im_end|>``,
    ``<|im_start|>assistant``, ...): a prompt holding one has run into another turn."""
    a, b, c = (f"{SENTINEL}{i}" for i in range(3))
    text = _render(tokenizer, [{"role": "user", "content": a}, {"role": "assistant", "content": b},
                               {"role": "user", "content": c}])
    pieces: set[str] = set()
    for start, end in ((a, b), (b, c)):
        if start in text and end in text:
            between = text[text.index(start) + len(start) : text.index(end)]
            pieces.update(p for p in between.split() if len(p) >= 2)
    return pieces


def user_turn_template(tokenizer: Any, model: Any = None) -> UserTurnTemplate:
    """The prefix to sample user turns from, the tokens that end them and the markers to reject.

    Stop tokens: the token right after a user message in the template (when the
    text there starts with one single token), the end-of-turn token after an
    assistant message and the eos ids of the tokenizer and of ``model.generation_config``.
    """
    prefix = user_turn_prefix(tokenizer)
    stop = set(end_of_turn_token_ids(tokenizer))
    rendered = _render(tokenizer, [{"role": "user", "content": SENTINEL}])
    after = rendered[rendered.index(SENTINEL) + len(SENTINEL) :].split()
    if after:
        ids = tokenizer(after[0], add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            stop.add(ids[0])
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop.update(model_eos if isinstance(model_eos, list) else [model_eos] if model_eos is not None else [])
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    specials.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    markers = tuple(sorted(m for m in specials | _turn_markup(tokenizer) if m.strip()))
    prefix_ids = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    return UserTurnTemplate(prefix, prefix_ids, sorted(stop), markers)


# ------------------------------------------------------------------ sampling
@torch.no_grad()
def sample_user_turns(
    model: Any, tokenizer: Any, template: UserTurnTemplate, count: int, settings: SelfPromptSettings, seed: int
) -> list[UserTurn]:
    """``count`` user turns sampled by ``model`` after ``template.prefix``, under ``torch.manual_seed(seed)``.

    Every row shares the prefix, so the batch needs no padding; the caller's RNG is left untouched.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([template.prefix_ids] * count, dtype=torch.long, device=device)  # [B, P]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else template.stop_ids[0]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=template.stop_ids,
            pad_token_id=pad_id,
        )
    turns = []
    for generated in output[:, input_ids.shape[1] :].tolist():  # [B, <= max_new_tokens]
        ids, finish_reason, _ = split_completion(generated, set(template.stop_ids))
        turns.append(UserTurn(tokenizer.decode(ids, skip_special_tokens=False), finish_reason == "stop"))
    return turns


# ------------------------------------------------------------------- filters
def is_repetitive(text: str) -> bool:
    """True when one character makes up over half of the non-space characters, one word over
    half of the words (4 words or more), or under half of the word 3-grams are distinct
    (10 words or more): the loops a sampled model falls into, not natural prompts."""
    chars = [c for c in text.casefold() if not c.isspace()]
    if chars and Counter(chars).most_common(1)[0][1] > len(chars) / 2:
        return True
    words = normalize_text(text).split()
    if len(words) >= 4 and Counter(words).most_common(1)[0][1] > len(words) / 2:
        return True
    if len(words) >= 10:
        trigrams = list(zip(words, words[1:], words[2:]))
        return len(set(trigrams)) < len(trigrams) / 2
    return False


def filter_reason(text: str, settings: SelfPromptSettings, markers: Iterable[str] = ()) -> str | None:
    """Why a stripped user turn is not a usable prompt (a reason of ``DROP_REASONS``), or None."""
    if any(marker in text for marker in markers):
        return "template_tokens"
    if len(text) < settings.min_chars:
        return "too_short"
    if len(text) > settings.max_chars:
        return "too_long"
    if not any(c.isalpha() for c in text):
        return "no_letters"
    if is_repetitive(text):
        return "repetitive"
    return None


# ---------------------------------------------------------- evaluation sets
def evaluation_prompts(
    data_dir: str | os.PathLike | None = None, names: Sequence[str] = BENCHMARKS
) -> dict[str, list[str]]:
    """The prompts a self-written prompt may not repeat: {set name: texts}.

    Always the built-in evaluation sets (``builtin_eval_sets``, every user
    turn); with ``data_dir`` (resolved by ``eval_data_folder``, so
    ``$DSPARK_EVAL_DATA`` applies to the default) also every first user turn of
    each ``<name>.jsonl`` found there: the whole file, not the subset an
    evaluation draws, since another ``eval.seed`` or ``eval.num_samples`` draws
    others. Missing files are skipped; the keys name the sets found.
    """
    sets = {
        name: [m["content"] for conversation in conversations for m in conversation if m["role"] == "user"]
        for name, conversations in builtin_eval_sets().items()
    }
    if data_dir is not None:
        folder = eval_data_folder(data_dir)
        for name in names:
            path = folder / f"{name}.jsonl"
            if path.is_file():
                sets[name] = [conversation[0]["content"] for conversation in load_eval_benchmark(path)]
    return sets


def _index_of(texts: Iterable[str], settings: SelfPromptSettings) -> DuplicateIndex:
    """The index the self-written prompts are checked against: Jaccard and containment on."""
    index = DuplicateIndex(settings.near_duplicate_jaccard, containment=settings.containment)
    for text in texts:
        index.add(text)
    return index


# --------------------------------------------------------------------- driver
def generate_self_prompts(
    model: Any,
    tokenizer: Any,
    settings: SelfPromptSettings,
    eval_prompts: Mapping[str, Sequence[str]] | None = None,
    *,
    source_prompts: Sequence[str] | None = None,
    progress: bool = True,
) -> SelfPrompts:
    """Up to ``settings.num_prompts`` user prompts written by ``model`` (a transformers causal LM)
    under its own chat template.

    What the model wrote is kept or dropped by :func:`_drop_reason` (the reasons in order there).

    ``eval_prompts`` ({set name: texts}, default ``evaluation_prompts()``: the
    built-in evaluation sets) are never returned, nor near-duplicates of them,
    texts holding one or pieces of one. ``source_prompts`` (texts, default none:
    the user turns of the training source the result is appended to) are never
    returned either, nor near-duplicates, holders or pieces of them.
    Sampling stops once N prompts are kept or ``ceil(max_draws_per_prompt * N)``
    turns were sampled; fewer than N are then returned, with a warning.
    """
    template = user_turn_template(tokenizer, model)
    eval_prompts = evaluation_prompts() if eval_prompts is None else eval_prompts
    source_prompts = [] if source_prompts is None else list(source_prompts)
    eval_index = _index_of((t for texts in eval_prompts.values() for t in texts), settings)
    source_index = _index_of(source_prompts, settings)
    kept_index = DuplicateIndex(settings.near_duplicate_jaccard)
    budget = math.ceil(settings.max_draws_per_prompt * settings.num_prompts)
    kept: list[str] = []
    dropped = Counter({reason: 0 for reason in DROP_REASONS})
    generated = batch = 0
    bar = tqdm(total=settings.num_prompts, unit="prompt", desc="self-prompts", disable=not progress)
    try:
        while len(kept) < settings.num_prompts and generated < budget:
            count = min(settings.batch_size, budget - generated)
            turns = sample_user_turns(model, tokenizer, template, count, settings, settings.seed + batch)
            if len(turns) != count:
                raise RuntimeError(f"sample_user_turns returned {len(turns)} user turns, asked for {count}")
            for turn in turns:
                if len(kept) == settings.num_prompts:
                    break
                generated += 1
                text = turn.text.strip()
                reason = _drop_reason(turn, text, settings, template, eval_index, source_index, kept_index)
                if reason is None:
                    kept_index.add(text)
                    kept.append(text)
                    bar.update(1)
                else:
                    dropped[reason] += 1
            batch += 1
            bar.set_postfix(generated=generated, dropped=generated - len(kept))
    finally:
        bar.close()
    if len(kept) < settings.num_prompts:
        logger.warning("kept %d of %d self-written prompts after %d samples (dropped: %s)",
                       len(kept), settings.num_prompts, generated, dict(+dropped))
    stats = {
        "requested": settings.num_prompts, "generated": generated, "kept": len(kept),
        "dropped": dict(dropped), "eval_prompts": {name: len(texts) for name, texts in eval_prompts.items()},
        "source_prompts": len(source_prompts),
    }
    conversations = [[{"role": "user", "content": text}] for text in kept]
    return SelfPrompts(conversations, [f"{ID_PREFIX}{i:06d}" for i in range(len(kept))], stats)


def _drop_reason(
    turn: UserTurn, text: str, settings: SelfPromptSettings, template: UserTurnTemplate,
    eval_index: DuplicateIndex, source_index: DuplicateIndex, kept_index: DuplicateIndex,
) -> str | None:
    """The first reason of ``DROP_REASONS`` that applies to a sampled turn, None to keep it.

    What a sampled turn is dropped for, in this order (the comparisons are those of
    ``dspark.data.near_duplicates``):

    1. dropped when it never ended the turn within ``max_new_tokens`` (``unfinished``);
    2. stripped and filtered (:func:`filter_reason`): ``template_tokens`` (a special token or a
       piece of the template's turn markup is left), ``too_short`` / ``too_long`` (characters),
       ``no_letters``, ``repetitive`` (see :func:`is_repetitive`);
    3. dropped as ``eval_overlap`` when it equals or near-duplicates an evaluation prompt
       (:func:`evaluation_prompts`: the built-in evaluation sets and the benchmark files), so no
       evaluation prompt reaches training or its held-out part;
    4. dropped as ``eval_containment`` when it holds an evaluation prompt or is a piece of one
       (``containment`` >= ``settings.containment``): a benchmark question wrapped in a sentence
       of its own has a low Jaccard with the question;
    5. dropped as ``source_overlap`` when it equals, near-duplicates, holds or is a piece of a
       prompt of the training source it is appended to (``source_prompts``): a repeat adds no
       fresh data;
    6. deduplicated against the prompts kept so far: ``duplicate`` (same text after
       ``normalize_text``) or ``near_duplicate`` (word 5-gram Jaccard >= ``near_duplicate_jaccard``).
    """
    if not turn.ended:
        return "unfinished"
    reason = filter_reason(text, settings, template.markers)
    if reason is not None:
        return reason
    match = eval_index.match(text)
    if match is not None:
        return "eval_containment" if match == "contained" else "eval_overlap"
    if source_index.match(text) is not None:
        return "source_overlap"
    return kept_index.match(text)


# ----------------------------------------------------------------------- file
def save_self_prompts(path: str | os.PathLike, prompts: SelfPrompts, settings: SelfPromptSettings) -> None:
    """Write ``{"settings", "stats", "prompts": [{"id", "conversations"}, ...]}`` to ``path`` atomically."""
    rows = [{"id": i, "conversations": c} for i, c in zip(prompts.ids, prompts.conversations)]
    body = {"settings": asdict(settings), "stats": prompts.stats, "prompts": rows}
    atomic_write_text(Path(path), json.dumps(body, ensure_ascii=False, indent=1) + "\n")


def load_self_prompts(
    path: str | os.PathLike, settings: SelfPromptSettings, eval_prompts: Mapping[str, Sequence[str]]
) -> SelfPrompts | None:
    """The prompts :func:`save_self_prompts` wrote to ``path``, None when there is no file.

    ValueError when the file was written with other settings, or when one of
    its prompts equals, near-duplicates, holds or is a piece of one of
    ``eval_prompts`` (a benchmark file added since), by the checks writing
    applies: regenerating would change the prompts the saved answers belong
    to, so the fix is to start a fresh data folder. The training source is not
    checked again: a prompt repeating one of it costs a little redundancy, not
    a leak.
    """
    path = Path(path)
    if not path.is_file():
        return None
    body = json.loads(path.read_text(encoding="utf-8"))
    fix = f"delete the folder {path.parent} (or set data.data_dir to a new one) to write them again"
    if body.get("settings") != asdict(settings):
        raise ValueError(f"{path} holds self-written prompts made with settings {body.get('settings')}, "
                         f"not {asdict(settings)}; {fix}")
    prompts = SelfPrompts([row["conversations"] for row in body["prompts"]],
                          [row["id"] for row in body["prompts"]], body["stats"])
    eval_index = _index_of((t for texts in eval_prompts.values() for t in texts), settings)
    for prompt_id, conversation in zip(prompts.ids, prompts.conversations):
        match = eval_index.match(conversation[0]["content"])
        if match is not None:
            how = "holds or is a piece of" if match == "contained" else "repeats"
            raise ValueError(f"{path}: prompt {prompt_id} {how} an evaluation prompt "
                             f"(sets {sorted(eval_prompts)}); {fix}")
    return prompts
