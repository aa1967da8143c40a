"""Where the tests find the repository, the golden fixtures and the shared reference material.

``GOLDEN`` is ``$DSPARK_GOLDEN`` when set and non-empty, else ``tests/golden`` of the repository: the
checkpoints and tensors that DeepSpec and z-lab computed (its README.md says what computed each).
``SHARED`` is ``$DSPARK_SHARED`` when set (``scripts/test.sh`` sets it where a shared folder
sits beside the repository), else ``<repo>/../shared``; it holds the benchmark files, and tests
that need it skip with a reason when it is absent.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("DSPARK_GOLDEN") or REPO / "tests" / "golden")
SHARED = Path(os.environ.get("DSPARK_SHARED", REPO.parent / "shared"))


def load_script(relative: str) -> ModuleType:
    """A repository script that is not a package module (``bench/recipe_study.py``,
    ``eval_datasets/make_benchmarks.py``) imported by its path, once, under its file stem; it is
    registered in ``sys.modules`` first because dataclasses look their module up while built."""
    path = REPO / relative
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[path.stem]
            raise
    return sys.modules[path.stem]
