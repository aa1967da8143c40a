"""Where the tests find the repository, the golden fixtures and the shared reference material.

``GOLDEN`` is ``$DSPARK_GOLDEN`` when set and non-empty, else ``tests/golden`` of the repository: the
checkpoints and tensors that DeepSpec and z-lab computed (its README.md says what computed each).
``SHARED`` is ``$DSPARK_SHARED`` when set (``scripts/test.sh`` sets it where a shared folder
sits beside the repository), else ``<repo>/../shared``; it holds the benchmark files, and tests
that need it skip with a reason when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(os.environ.get("DSPARK_GOLDEN") or REPO / "tests" / "golden")
SHARED = Path(os.environ.get("DSPARK_SHARED", REPO.parent / "shared"))
