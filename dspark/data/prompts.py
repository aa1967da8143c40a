"""Prompt sources for drafter training and evaluation.

A ``Conversation`` is a list of ``{"role": "system" | "user" | "assistant", "content": str}``
dicts, the shape ``tokenizer.apply_chat_template`` takes. Training data is prompts only (paper
Section 4.1): the target regenerates every answer itself, so what the loaders hand over is
usually passed through :func:`prompt_only` first. Sources: :func:`load_hub_prompts` (a Hugging
Face dataset with a ShareGPT-style ``conversations`` column), :func:`load_jsonl_prompts` (a local
JSON-lines file), :func:`load_builtin_prompts` (the small set in ``dspark/data/builtin/``, for
smoke tests and demos) and :func:`load_eval_benchmark` (a benchmark file: first user turn, the dev
or test part or all of it, a subset drawn by :func:`seeded_subset`, DeepSpec's rule).

Each source and the benchmark split: docs/data.md, "Prompts" and "Benchmark files and the
dev/test split".
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

Message = dict[str, str]
Conversation = list[Message]
T = TypeVar("T")

# DeepSpec's evaluator (eval.py, --seed) draws its benchmark subsets with this seed by default.
DEEPSPEC_EVAL_SEED = 980406


# Role names found in hub chat datasets (ShareGPT and relatives) -> our roles.
ROLE_MAP: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}

_BUILTIN_FILE = "builtin/prompts.jsonl"
# The built-in evaluation sets are named BUILTIN_PREFIX + domain ("builtin-math", ...).
BUILTIN_PREFIX = "builtin-"


def map_role(role: Any) -> str:
    """Map a dataset role name (``human``, ``gpt``, ``user``, ...) to system/user/assistant."""
    if not isinstance(role, str) or role.lower() not in ROLE_MAP:
        raise ValueError(
            f"unknown chat role {role!r}; known roles: {sorted(ROLE_MAP)} "
            "(extend dspark.data.prompts.ROLE_MAP if the dataset uses another name)"
        )
    return ROLE_MAP[role.lower()]


def _message_from_entry(entry: Any) -> Message:
    """One message from either ``{"role", "content"}`` or ShareGPT ``{"from", "value"}``."""
    if not isinstance(entry, dict):
        raise ValueError(f"a message must be a JSON object, got {type(entry).__name__}")
    if "role" in entry and "content" in entry:
        role, content = entry["role"], entry["content"]
    elif "from" in entry and "value" in entry:
        role, content = entry["from"], entry["value"]
    else:
        raise ValueError(
            f"a message needs the keys 'role' and 'content' (or ShareGPT 'from' and 'value'), "
            f"got keys {sorted(entry)}"
        )
    if not isinstance(content, str):
        raise ValueError(f"message content must be a string, got {type(content).__name__}")
    return {"role": map_role(role), "content": content}


def conversation_from_messages(entries: Iterable[Any]) -> Conversation:
    """Convert a list of ``{"role", "content"}`` / ``{"from", "value"}`` entries to a Conversation."""
    if isinstance(entries, (str, bytes, dict)):
        raise ValueError(f"a conversation must be a list of messages, got {type(entries).__name__}")
    conversation = [_message_from_entry(entry) for entry in entries]
    if not conversation:
        raise ValueError("a conversation must hold at least one message, got an empty list")
    return conversation


def conversation_from_turns(turns: Any) -> Conversation:
    """Convert ``["user msg", "assistant msg", "user msg", ...]`` (alternating, user first)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'turns' must be a non-empty list of strings, got {turns!r:.80}")
    conversation = []
    for i, text in enumerate(turns):
        if not isinstance(text, str):
            raise ValueError(f"turns[{i}] must be a string, got {type(text).__name__}")
        conversation.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return conversation


def conversation_from_record(record: Any) -> Conversation:
    """A Conversation from one JSON record: ``conversations``/``messages`` or ``turns``."""
    if not isinstance(record, dict):
        raise ValueError(f"each line must be a JSON object, got {type(record).__name__}")
    for key in ("conversations", "messages"):
        if key in record:
            return conversation_from_messages(record[key])
    if "turns" in record:
        return conversation_from_turns(record["turns"])
    raise ValueError(
        f"a record needs one of the keys 'conversations', 'messages' or 'turns', got keys {sorted(record)}"
    )


def _read_jsonl_records(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line; errors name file and line."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return records


def load_jsonl_prompts(path: str | Path) -> list[Conversation]:
    """Read conversations from a JSON-lines file, one record per line.

    Each line is ``{"conversations": [...]}`` (or ``"messages"``) with
    ``{"role", "content"}`` or ShareGPT ``{"from", "value"}`` entries, or
    ``{"turns": ["user msg", "assistant msg", ...]}``. Other keys are ignored;
    blank lines are skipped. A bad line raises ValueError naming file and line.
    """
    conversations = []
    for lineno, record in _read_jsonl_records(path):
        try:
            conversations.append(conversation_from_record(record))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    return conversations


def prompt_only(conversation: Conversation) -> Conversation:
    """The conversation up to, excluding, its first assistant turn: what the target answers."""
    prompt = []
    for message in conversation:
        if message["role"] == "assistant":
            break
        prompt.append(dict(message))
    return prompt


def load_hub_prompts(
    name: str = "mlabonne/open-perfectblend",
    split: str = "train",
    holdout_fraction: float = 0.05,
    seed: int = 42,
    which: str = "train",
    max_samples: int | None = None,
) -> list[Conversation]:
    """Conversations of a hub dataset with a ShareGPT-style ``conversations`` column (default
    ``mlabonne/open-perfectblend``, the DeepSpec recipe).

    The split is divided with ``Dataset.train_test_split(test_size=holdout_fraction,
    seed=seed)``; ``which="train"`` returns the larger part, ``which="holdout"``
    the held-out part. ``max_samples`` keeps the first N of that part (already
    shuffled by the split). Answers are kept; apply :func:`prompt_only` to get
    the prompts the target regenerates answers for.
    """
    if which not in ("train", "holdout"):
        raise ValueError(f"which must be 'train' or 'holdout', got {which!r}")
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"max_samples must be >= 0 or None, got {max_samples}")
    import datasets  # heavy import, only needed here

    dataset = datasets.load_dataset(name, split=split)
    if "conversations" not in dataset.column_names:
        raise ValueError(
            f"dataset {name!r} (split {split!r}) has no 'conversations' column; "
            f"columns are {dataset.column_names}"
        )
    parts = dataset.train_test_split(test_size=holdout_fraction, seed=seed)
    part = parts["train" if which == "train" else "test"]
    if max_samples is not None:
        part = part.select(range(min(max_samples, len(part))))
    conversations = []
    for index, entries in enumerate(part["conversations"]):
        try:
            conversations.append(conversation_from_messages(entries))
        except ValueError as e:
            raise ValueError(f"{name} ({which} part, row {index}): {e}") from None
    return conversations


def load_builtin_prompts(domain: str | None = None) -> list[Conversation]:
    """The prompts shipped in ``dspark/data/builtin/prompts.jsonl`` (see its README).

    ``domain`` selects one of ``builtin_domains()`` (math, code, chat); None returns all.
    """
    if domain is not None and domain not in builtin_domains():
        raise ValueError(f"domain must be one of {builtin_domains()} or None, got {domain!r}")
    return [conv for _, record_domain, conv in builtin_prompt_records() if domain in (None, record_domain)]


def builtin_domains() -> tuple[str, ...]:
    """The domains of the built-in prompts, in file order (the paper's math, code, chat)."""
    return tuple(dict.fromkeys(domain for _, domain, _ in builtin_prompt_records()))


def is_reserved_for_eval(prompt_id: str) -> bool:
    """Every tenth built-in prompt (ids ending in 0: math-010, code-020, ...) is held out of
    training and forms the small built-in evaluation set used when no benchmark files exist."""
    return prompt_id.endswith("0")


def builtin_eval_sets() -> dict[str, list[Conversation]]:
    """{"builtin-math": [...], "builtin-code": [...], "builtin-chat": [...]}: the reserved prompts."""
    sets: dict[str, list[Conversation]] = {}
    for pid, domain, conv in builtin_prompt_records():
        if is_reserved_for_eval(pid):
            sets.setdefault(BUILTIN_PREFIX + domain, []).append(conv)
    return sets


def builtin_prompt_records() -> list[tuple[str, str, Conversation]]:
    """(id, domain, conversation) for every built-in prompt, in file order."""
    text = resources.files("dspark.data").joinpath(_BUILTIN_FILE).read_text(encoding="utf-8")
    records = []
    # split("\n"), not splitlines(): the latter also breaks at U+2028 and friends inside strings.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        try:
            records.append((record["id"], record["domain"], conversation_from_record(record)))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{_BUILTIN_FILE}:{lineno}: {e}") from None
    return records


def load_eval_benchmark(
    path: str | Path, num_samples: int | None = None, seed: int = 0, split: str = "all"
) -> list[Conversation]:
    """First-user-turn prompts of a benchmark file (``{"turns": [...]}`` per line).

    ``split`` picks the part of the file: "all" (the default), "dev" or "test"
    (``dspark.data.benchmarks.split_prompts``). With ``num_samples`` smaller than the
    part, the subset is ``seeded_subset(part, num_samples, seed)`` (DeepSpec's rule, so
    with "all" a (file, size, seed) triple names the same prompts, in the same order, in
    both tools). Otherwise every prompt of the part is returned in file order (the alpaca
    file holds fewer prompts than the protocol's 500).
    """
    from dspark.data.benchmarks import split_prompts  # the split rule lives with the benchmarks, which import us

    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 or None, got {num_samples}")
    prompts = []
    for lineno, record in _read_jsonl_records(path):
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{lineno}: expected {{\"turns\": [\"user message\", ...]}}")
        prompts.append([{"role": "user", "content": turns[0]}])
    return split_prompts(prompts, split, num_samples, seed)


def seeded_subset(items: Sequence[T], num_samples: int | None, seed: int) -> list[T]:
    """``num_samples`` of ``items`` drawn as DeepSpec's evaluator draws a benchmark subset.

    DeepSpec (``BaseEvaluator.run_dataset``): when the benchmark holds more
    than ``num_samples`` items, shuffle a copy with ``random.Random(seed).shuffle``
    and keep the first ``num_samples``, in that shuffled order (request i is
    DeepSpec's sample i); otherwise keep every item in file order. None keeps
    everything. Its default seed is ``DEEPSPEC_EVAL_SEED``.
    """
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0):
        raise ValueError(f"num_samples must be an int >= 0 or None, got {num_samples!r}")
    items = list(items)
    if num_samples is None or len(items) <= num_samples:
        return items
    random.Random(seed).shuffle(items)
    return items[:num_samples]
