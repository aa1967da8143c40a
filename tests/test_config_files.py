"""The DFlash and Eagle3 config files spell out their differences from DSpark, and those are
exactly what `dflash_of` / `eagle3_of` derive from the DSpark config of the same target."""

from __future__ import annotations

import pytest

from dspark.config import dflash_of, eagle3_of, load_config
from helpers.paths import REPO

CONFIG = REPO / "config"
TARGETS = ("qwen3_4b", "qwen3_8b", "qwen3_14b", "gemma4_12b", "smollm2_135m")


def dspark_config(target: str):
    return load_config(CONFIG / "dspark" / f"dspark_{target}.py")


@pytest.mark.parametrize("target", TARGETS)
def test_dflash_file_equals_dflash_of_its_dspark_config(target):
    assert load_config(CONFIG / "dflash" / f"dflash_{target}.py") == dflash_of(dspark_config(target))


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "smollm2_135m"])
def test_eagle3_file_equals_deepspec_eagle3_of_its_dspark_config(target):
    expected = eagle3_of(dspark_config(target), "eagle3_deepspec")
    assert load_config(CONFIG / "eagle3" / f"eagle3_{target}.py") == expected


def test_smollm2_eagle3_file_equals_standard_eagle3_of_the_demo_config():
    expected = eagle3_of(dspark_config("smollm2_135m"), "eagle3", num_target_layers=30)
    assert load_config(CONFIG / "eagle3" / "eagle3_smollm2_135m.py") == expected


@pytest.mark.parametrize("path", sorted((CONFIG / "dflash").glob("*.py")) + sorted((CONFIG / "eagle3").glob("*.py")),
                         ids=lambda p: p.stem)
def test_baseline_files_state_their_head_and_loss_changes(path):
    text = path.read_text()
    for key in ('"drafter.variant"', '"drafter.markov_rank": 0', '"drafter.enable_confidence_head": False',
                '"loss.ce_weight": 1.0'):
        assert key in text, f"{path.name} does not state {key}"
