"""Token counts that choose a draft vocabulary (dspark.modeling.vocab), and its coverage.

All counts run over the target vocabulary V at the supervised (loss-masked) positions of the
training data: :func:`hard_counts` (how often each id is the supervised token, EAGLE-3's count),
:func:`soft_counts_from_cache` / :func:`soft_counts_online` (the target's own probabilities summed
over those positions), and :func:`topped_up` (hard+soft: the hard ids first, the rest from the
soft ranking). :func:`choose_vocab` picks k ids by mode (``data.vocab_counts``),
:func:`coverage_table` says what each choice covers, :func:`count_draft_vocab` is the library call
and :func:`write_draft_vocab` the ``dspark vocab`` recipe.

Why soft counts, and which positions a cache-based count skips: docs/data.md,
"The draft vocabulary counts".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from dspark.modeling.vocab import DraftVocab

COUNT_MODES = ("hard", "soft", "hard+soft")


def hard_counts(samples: Iterable[dict[str, Tensor]], vocab_size: int) -> Tensor:
    """Float64 [V]: occurrences of each id at supervised positions (loss_mask > 0)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        ids = torch.as_tensor(s["input_ids"])[torch.as_tensor(s["loss_mask"]) > 0]
        counts += torch.bincount(ids, minlength=vocab_size).double()
    return counts


def soft_counts_from_cache(source: Any, target: Any, *, progress: bool = True) -> Tensor:
    """Float64 [V]: Σ softmax(LMHead(h_j)) over the cached final hidden states of ``source`` (a
    `CachedSource`: the rows where positions j and j+1 are supervised)."""
    counts = torch.zeros(target.vocab_size, dtype=torch.float64)
    w = target.lm_head_weight()
    for i in tqdm(range(len(source)), desc="soft counts (cache)", disable=not progress):
        item = source[i]
        hidden = item["final_hidden"][item["has_final"]]  # [F, d]
        if hidden.numel():
            with torch.no_grad():
                probs = torch.softmax(target.compute_logits(hidden.to(w.device, w.dtype)).float(), -1)
            counts += probs.double().sum(0).cpu()
    return counts


def soft_counts_online(source: Any, target: Any, *, progress: bool = True) -> Tensor:
    """Float64 [V]: Σ p_t(· | x_≤j) over positions j whose next token is supervised, from one target
    forward per sample of ``source`` (rendered input_ids / loss_mask)."""
    counts = torch.zeros(target.vocab_size, dtype=torch.float64)
    for i in tqdm(range(len(source)), desc="soft counts (online)", disable=not progress):
        item = source[i]
        ids, mask = torch.as_tensor(item["input_ids"]), torch.as_tensor(item["loss_mask"])
        rows = (mask[1:] > 0).nonzero().squeeze(1)  # j with x_{j+1} supervised
        if rows.numel() == 0:
            continue
        with torch.no_grad():
            out = target(ids[None].to(target.device), return_logits=False)
            probs = torch.softmax(target.compute_logits(out.last_hidden[0, rows.to(target.device)]).float(), -1)
        counts += probs.double().sum(0).cpu()
    return counts


def topped_up(hard: Tensor, soft: Tensor, k: int) -> DraftVocab:
    """The ids with a hard count (most frequent first, ties by id), then the best of the soft
    ranking, k in all, sorted by id."""
    hard, soft = hard.double(), soft.double()
    seen = int((hard > 0).sum())
    if k <= seen:
        return DraftVocab.from_counts(hard, k)
    # One score that ranks every hard id above every other, and soft counts among the rest.
    score = torch.where(hard > 0, hard + soft.max() + 1.0, soft)
    return DraftVocab.from_counts(score, k)


def choose_vocab(mode: str, k: int, hard: Tensor | None, soft: Tensor | None) -> DraftVocab:
    """The draft vocabulary of ``k`` ids for a counting mode ("hard", "soft", "hard+soft")."""
    if mode not in COUNT_MODES:
        raise ValueError(f"data.vocab_counts={mode!r} is not one of {COUNT_MODES}")
    if mode == "hard":
        return DraftVocab.from_counts(hard, k)
    if mode == "soft":
        return DraftVocab.from_counts(soft, k)
    return topped_up(hard, soft, k)


def coverage_table(
    modes: Sequence[str], ks: Sequence[int], train_hard: Tensor, train_soft: Tensor | None, evals: dict[str, Tensor]
) -> list[dict[str, Any]]:
    """Rows {mode, k, train, <eval name>...}: the share of supervised tokens inside the vocabulary
    chosen by each (mode, k), on the training tokens and on each evaluation set's hard counts."""
    rows = []
    for mode in modes:
        if mode != "hard" and train_soft is None:
            continue
        for k in ks:
            vocab = choose_vocab(mode, min(k, train_hard.numel()), train_hard, train_soft)
            row = {"mode": mode, "k": vocab.size, "train": round(vocab.coverage(train_hard), 4)}
            row.update({name: round(vocab.coverage(c), 4) for name, c in evals.items()})
            rows.append(row)
    return rows


def count_draft_vocab(samples: Any, target: Any, k: int, *, mode: str = "hard+soft", progress: bool = False) -> DraftVocab:
    """The draft vocabulary of ``k`` ids counted over the supervised tokens of ``samples`` (a
    ``dspark.data.dataset.SampleSource``: dicts with input_ids and loss_mask), for
    ``drafter.set_vocab``. ``mode`` as ``data.vocab_counts``: "hard" (EAGLE-3's token counts),
    "soft" or "hard+soft" (the target's own probabilities, from a cache's final hidden states when
    the samples carry them, else one target forward per sample). `dspark vocab` does the same over
    prepared data and writes it (:func:`write_draft_vocab`)."""
    if mode not in COUNT_MODES:
        raise ValueError(f"mode={mode!r} is not one of {COUNT_MODES}")
    hard = hard_counts((samples[i] for i in range(len(samples))), int(target.vocab_size))
    soft = None
    if mode != "hard":
        cached = len(samples) > 0 and "has_final" in samples[0]
        soft = (soft_counts_from_cache if cached else soft_counts_online)(samples, target, progress=progress)
    return choose_vocab(mode, k, hard, soft)


def check_vocab_counted(drafter: Any) -> None:
    """ValueError when the drafter has a draft vocabulary (``draft_vocab_size`` k > 0) that was never
    counted: its d2t / t2d maps still hold the placeholder target ids 0..k−1 they are built with."""
    k = int(getattr(drafter.config, "draft_vocab_size", 0) or 0)
    d2t = getattr(drafter, "d2t", None)
    if not k or d2t is None or bool(d2t.any()):
        return
    raise ValueError(
        f"drafter.draft_vocab_size={k}, but the drafter's draft vocabulary was never counted: its d2t / t2d "
        f"maps hold the placeholder target ids 0..{k - 1}. Count it from the training data before training: "
        f"drafter.set_vocab(dspark.count_draft_vocab(train_data, target, {k})) (`dspark train` reads the "
        "file `dspark vocab` writes)"
    )


# ----------------------------------------------------------------- the `dspark vocab` recipe
def vocab_path(config: Any) -> Any:
    """Where the draft vocabulary of ``config`` lives: ``drafter.draft_vocab``, else
    <data_dir>/draft_vocab_<k>.safetensors."""
    from pathlib import Path

    from dspark.data.prepare import data_dir

    spec = config.drafter
    return Path(spec.draft_vocab) if spec.draft_vocab else data_dir(config) / f"draft_vocab_{spec.draft_vocab_size}.safetensors"


def count_tokens(config: Any, target: Any, *, soft: bool = True, progress: bool = True) -> dict[str, Tensor]:
    """{"train": hard counts, "train_soft": soft counts (when ``soft``), "held-out": hard counts} of
    the prepared data of ``config`` (`dspark prepare` first): soft counts from the cache in cache
    mode, from online forwards otherwise."""
    import json

    from dspark.data.dataset import RenderedSource, load_rendered
    from dspark.data.prepare import data_dir, training_sources

    folder = data_dir(config)
    split = folder / "split.json"
    if not split.is_file():
        raise FileNotFoundError(f"{split} not found: run `dspark prepare --config ...` first")
    parts = json.loads(split.read_text())
    samples = load_rendered(folder / "rendered.jsonl")
    train = RenderedSource([samples[i] for i in parts["train"]])
    held = RenderedSource([samples[i] for i in parts["holdout"]])
    V = int(target.vocab_size)
    out = {"train": hard_counts(train, V), "held-out": hard_counts(held, V)}
    if soft:
        if config.data.feature_mode == "cache":
            out["train_soft"] = soft_counts_from_cache(training_sources(config, target)[0], target, progress=progress)
        else:
            out["train_soft"] = soft_counts_online(train, target, progress=progress)
    return out


def write_draft_vocab(config: Any, target: Any, *, ks: Sequence[int] = (), progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """Count the training tokens (``data.vocab_counts``), write the draft vocabulary of
    ``drafter.draft_vocab_size`` ids to :func:`vocab_path` (safetensors + .json with k, mode and
    coverage) and return (path, info). ``ks`` adds a coverage table of every mode at those sizes."""
    k, mode = int(config.drafter.draft_vocab_size), config.data.vocab_counts
    if k <= 0:
        raise ValueError("drafter.draft_vocab_size=0 means the full vocabulary: set it to the k to write, "
                         "e.g. --set drafter.draft_vocab_size=8192")
    counts = count_tokens(config, target, soft=mode != "hard" or bool(ks), progress=progress)
    vocab = choose_vocab(mode, k, counts["train"], counts.get("train_soft"))
    info: dict[str, Any] = {
        "mode": mode,
        "coverage": {"train": round(vocab.coverage(counts["train"]), 4),
                     "held-out": round(vocab.coverage(counts["held-out"]), 4)},
        "supervised_tokens": {"train": int(counts["train"].sum()), "held-out": int(counts["held-out"].sum())},
        "distinct_train_ids": int((counts["train"] > 0).sum()),
    }
    if ks:
        info["table"] = coverage_table(COUNT_MODES, ks, counts["train"], counts.get("train_soft"),
                                       {"held-out": counts["held-out"]})
    path = vocab.save(vocab_path(config), info)
    # The counts themselves, next to it: other k or modes are chosen from them without a recount.
    from safetensors.torch import save_file

    save_file({name: c.contiguous() for name, c in counts.items()}, str(path.with_suffix(".counts.safetensors")))
    return path, info
