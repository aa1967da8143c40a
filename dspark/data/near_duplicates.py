"""Near-duplicate and containment look-ups between texts, on sets of word 5-grams.

Texts are compared after :func:`normalize_text` (casefolded, punctuation removed). Jaccard and
containment compare sets of word 5-grams (:func:`word_shingles`). A text of fewer than 5 words is
one shingle, all its words; it is a near-duplicate of another text only when equal to it, and
contained in (or containing) another text when its words occur in the other as a run of
consecutive words (:func:`containment`). :class:`DuplicateIndex` answers these look-ups against
many texts at once; ``dspark.data.self_prompts`` checks self-written prompts with it against the
evaluation prompts, the training source and each other.
"""

from __future__ import annotations

import bisect
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Sequence

SHINGLE_WORDS = 5  # near-duplicates compare sets of word 5-grams


def normalize_text(text: str) -> str:
    """The text compared for duplicates: casefolded, punctuation (Unicode category P*) removed,
    whitespace runs collapsed to one space, stripped."""
    kept = "".join(c for c in text.casefold() if not unicodedata.category(c).startswith("P"))
    return " ".join(kept.split())


def word_shingles(text: str, n: int = SHINGLE_WORDS) -> frozenset[tuple[str, ...]]:
    """The set of word n-grams of the normalised text; a text of fewer than n words is one
    shingle (all its words), so short texts are near-duplicates only when equal."""
    return _shingles(normalize_text(text).split(), n)


def _shingles(words: Sequence[str], n: int) -> frozenset[tuple[str, ...]]:
    if len(words) < n:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a ∩ b| / |a ∪ b| (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def containment(a: frozenset, b: frozenset, n: int = SHINGLE_WORDS) -> float:
    """How much of one text's shingles the other holds: max(|a ∩ b| / |a|, |a ∩ b| / |b|).

    1 for a text wrapped in extra words or a piece cut from a longer one, where
    the Jaccard is low. A text of fewer than ``n`` words (one shingle shorter than
    ``n``) shares no n-gram with a longer text, so it counts as wholly contained
    (1) when its words occur in the other as consecutive words, else 0: a
    short text is in another completely or not at all. 0 when either text has no words.
    """
    if () in a or () in b:
        return 0.0
    for short, other in ((a, b), (b, a)):
        words = next(iter(short)) if len(short) == 1 else None
        if words and len(words) < n and any(_holds_run(s, words) for s in other):
            return 1.0
    common = len(a & b)
    return max(common / len(a), common / len(b)) if common else 0.0


def _holds_run(words: tuple[str, ...], run: tuple[str, ...]) -> bool:
    return any(words[i : i + len(run)] == run for i in range(len(words) - len(run) + 1))


class DuplicateIndex:
    """Texts added so far, for exact (normalised), near-duplicate (word 5-gram Jaccard) and,
    with ``containment``, containment (:func:`containment`) look-ups.

    Shingles are indexed, so a look-up only scores texts sharing a shingle with
    the query (a Jaccard or containment above 0 needs one); the cost grows with
    the matches, not the texts. Texts under ``n`` words are found by their own
    runs of words: a short indexed text inside the query is one of the query's
    word k-grams (k < n) in the shingle postings; a short query inside an indexed
    text is the start of one of its shingles (a prefix search in the sorted
    shingles) or lies among its last n - 1 words (``_tails``).
    """

    def __init__(self, threshold: float = 0.8, n: int = SHINGLE_WORDS, containment: float | None = None):
        self.threshold = threshold
        self.n = n
        self.containment = containment  # None: no containment look-ups
        self._exact: set[str] = set()
        self._sizes: list[int] = []  # shingle count of each added text
        self._postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self._tails: dict[tuple[str, ...], list[int]] = defaultdict(list)  # k-grams (k < n) of the last n - 1 words
        self._sorted: list[tuple[str, ...]] | None = None  # the postings' shingles in order, built when needed

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, text: str) -> None:
        normalized = normalize_text(text)
        self._exact.add(normalized)
        words = normalized.split()
        shingles = _shingles(words, self.n)
        for shingle in shingles:
            self._postings[shingle].append(len(self._sizes))
        if self.containment is not None:
            tail = words[-(self.n - 1) :]
            for run in {tuple(tail[i : i + k]) for k in range(1, len(tail) + 1) for i in range(len(tail) - k + 1)}:
                self._tails[run].append(len(self._sizes))
            self._sorted = None
        self._sizes.append(len(shingles))

    def match(self, text: str) -> str | None:
        """"duplicate" (same normalised text), "near_duplicate" (Jaccard >= threshold),
        "contained" (containment >= ``containment``, when set) or None, checked in this order."""
        normalized = normalize_text(text)
        if normalized in self._exact:
            return "duplicate"
        words = normalized.split()
        shingles = _shingles(words, self.n)
        shared = Counter(i for shingle in shingles for i in self._postings.get(shingle, ()))
        for i, common in shared.items():
            if common / (len(shingles) + self._sizes[i] - common) >= self.threshold:
                return "near_duplicate"
        if self.containment is None or not words:
            return None
        if any(common / min(len(shingles), self._sizes[i]) >= self.containment for i, common in shared.items()):
            return "contained"
        return "contained" if self._short_run_matches(words) else None

    def _short_run_matches(self, words: list[str]) -> bool:
        """True when an indexed text under n words occurs in ``words`` as consecutive words, or
        ``words`` (under n of them) occurs so in an indexed text."""
        n = self.n
        for k in range(1, min(n - 1, len(words)) + 1):
            if any(tuple(words[i : i + k]) in self._postings for i in range(len(words) - k + 1)):
                return True
        if len(words) >= n:
            return False
        run = tuple(words)
        if run in self._tails:
            return True
        if self._sorted is None:
            self._sorted = sorted(self._postings)
        i = bisect.bisect_left(self._sorted, run)  # shingles starting with `run` sort right after it
        return i < len(self._sorted) and self._sorted[i][: len(run)] == run
