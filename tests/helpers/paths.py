"""Where the tests find the repository and the shared reference material.

``SHARED`` is ``$DSPARK_SHARED`` when set (``scripts/test.sh`` sets it where a shared folder
sits beside the repository), else ``<repo>/../shared``; tests that need it skip with a reason
when it is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DSPARK_SHARED", REPO.parent / "shared"))
