"""The figures (dspark.evaluation.plots): each writes a PNG, and importing the module loads no matplotlib."""

import subprocess
import sys

import numpy as np
import pytest

from dspark.scheduling.calibration import apply_temperatures
from dspark.evaluation.plots import reliability_diagram, reliability_grid
from helpers.calibration import synthetic_rounds

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_writes_png(tmp_path):
    rng = np.random.default_rng(4)
    pred = rng.random(500)
    path = tmp_path / "rel.png"
    reliability_diagram(pred, rng.random(500) < pred, path, title="test")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_reliability_grid_writes_png(tmp_path):
    rng = np.random.default_rng(5)
    conf, accepted, proposed = synthetic_rounds(2000, 2.0, rng)
    path = tmp_path / "grid.png"
    reliability_grid(conf, apply_temperatures(conf, [2.0, 2.0, 2.0]), accepted, proposed, path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_reliability_grid_names_the_shapes_that_differ(tmp_path):
    with pytest.raises(ValueError, match=r"conf_before \(2, 3\) and conf_after \(2, 2\) differ in shape"):
        reliability_grid(np.full((2, 3), 0.5), np.full((2, 2), 0.5), [0, 1], [3, 3], tmp_path / "grid.png")


def test_importing_plots_does_not_import_matplotlib():
    code = "import sys, dspark.evaluation.plots; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
