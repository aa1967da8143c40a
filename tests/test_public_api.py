"""`import dspark`: the public names, each importable, loaded lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dspark


@pytest.mark.parametrize("name", sorted(set(dspark.__all__) - {"__version__"}))
def test_public_name_resolves_to_the_object_of_its_module(name):
    module = __import__(dspark._LOCATIONS[name], fromlist=[name])
    assert getattr(dspark, name) is getattr(module, name)
    assert name in dir(dspark)


def test_public_api_has_the_names_a_researcher_imports():
    assert 15 <= len(dspark.__all__) - 1 <= 22
    assert {"Drafter", "TargetModel", "verify_draft", "schedule_prefix", "evaluate"} <= set(dspark.__all__)


def test_import_dspark_loads_neither_torch_nor_transformers():
    code = "import sys, dspark; print('torch' in sys.modules, 'transformers' in sys.modules, dspark.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["False", "False"]


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        dspark.no_such_name  # noqa: B018
