"""`dspark compare` (dspark.evaluation.compare): the macro-average gains and the conditional-acceptance figure.

Oracles: gains computed by hand from the synthetic reports' τ; the figure's own line data (one
matplotlib line per drafter, its y the report's curve), never pixels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from dspark.cli.main import main
from dspark.evaluation.compare import acceptance_path, compare_reports, fmt_gain, macro_gains, write_comparison
from dspark.evaluation.plots import acceptance_comparison_figure


def report(label, taus, curve):
    """A minimal report.json: τ per benchmark and the conditional acceptance over all rounds."""
    return {"label": label, "benchmarks": {n: {"tau": t} for n, t in taus.items()}, "macro": {},
            "gamma": len(curve), "all": {"conditional_acceptance": curve}}


# Avg = mean over the benchmarks: DSpark (3.0 + 2.8) / 2 = 2.9, DFlash (2.5 + 2.5) / 2 = 2.5, Eagle3 2.2.
DSPARK = report("dspark", {"gsm8k": 3.0, "mbpp": 2.8}, [0.9, 0.85, 0.8, 0.8])
DFLASH = report("dflash", {"gsm8k": 2.5, "mbpp": 2.5}, [0.9, 0.7, 0.5, 0.3])
EAGLE3 = report("eagle3", {"gsm8k": 2.0, "mbpp": 2.4}, [0.7, 0.7, 0.72, None])
REPORTS = {"dspark": DSPARK, "dflash": DFLASH, "eagle3": EAGLE3}


def test_gains_are_ratios_of_the_macro_average_tau():
    gains = macro_gains(REPORTS)
    assert gains["dspark", "dflash"] == pytest.approx(2.9 / 2.5 - 1)  # +16 %
    assert gains["dspark", "eagle3"] == pytest.approx(2.9 / 2.2 - 1)  # +31.8 %
    assert gains["eagle3", "dflash"] == pytest.approx(2.2 / 2.5 - 1)  # −12 %
    assert len(gains) == 6
    assert fmt_gain(2.9 / 2.5 - 1) == "+16 %" and fmt_gain(2.2 / 2.5 - 1) == "−12 %" and fmt_gain(0.0) == "+0 %"


def test_compare_prints_the_gain_table_and_a_sentence_per_drafter():
    lines = compare_reports(REPORTS).splitlines()
    assert "| drafter | over dspark | over dflash | over eagle3 |" in lines
    assert "| dspark | – | +16 % | +32 % |" in lines
    assert "| dflash | −14 % | – | +14 % |" in lines  # 2.5 / 2.9 − 1 = −13.8 %; 2.5 / 2.2 − 1 = +13.6 %
    assert "- dspark: +16 % over dflash, +32 % over eagle3" in lines
    assert lines[-1].startswith(("Intervals apart", "Every compared", "No two drafters"))  # the overlap check stays last


def test_a_single_drafter_or_one_without_tau_has_no_gains():
    assert "over" not in compare_reports({"dspark": DSPARK})
    empty = report("none", {}, [0.5])
    assert macro_gains({"dspark": DSPARK, "none": empty}) == {}


def test_the_figure_has_one_line_per_drafter_with_its_curve():
    fig = acceptance_comparison_figure(REPORTS)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["dspark", "dflash", "eagle3"]
    for line, rep in zip(lines, REPORTS.values()):
        curve = np.array([math.nan if y is None else y for y in rep["all"]["conditional_acceptance"]])
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, len(curve) + 1))
        np.testing.assert_array_equal(line.get_ydata(), curve)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["dspark", "dflash", "eagle3"]


def test_the_figure_draws_each_positions_interval_as_a_bar_in_the_drafters_colour():
    with_ci = {"dspark": {**DSPARK, "all": {**DSPARK["all"], "conditional_acceptance_ci": [[0.8, 0.95], [0.7, 0.9], None, [0.6, 0.9]]}},
               "dflash": DFLASH}  # no intervals: no bars
    fig = acceptance_comparison_figure(with_ci)
    (ax,) = fig.axes
    (bars,) = ax.collections
    segments = bars.get_segments()
    # three bars (position 3 has none), shifted −0.04 from k so that two drafters' bars stay apart
    assert len(segments) == 3
    np.testing.assert_allclose([s[:, 0].mean() for s in segments], [0.96, 1.96, 3.96])
    np.testing.assert_allclose([sorted(s[:, 1]) for s in segments], [[0.8, 0.95], [0.7, 0.9], [0.6, 0.9]])
    assert tuple(bars.get_colors()[0][:3]) == pytest.approx(to_rgb(ax.get_lines()[0].get_color()))


def test_write_comparison_puts_the_figure_next_to_the_markdown_and_links_it(tmp_path):
    out, figure = write_comparison(REPORTS, tmp_path / "cmp" / "report.md")
    assert figure == tmp_path / "cmp" / "report-acceptance.png" == acceptance_path(out)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![conditional acceptance](report-acceptance.png)" in out.read_text()


def test_cli_compare_of_run_folders_writes_both(tmp_path, capsys):
    folders = []
    for label, rep in REPORTS.items():
        folder = tmp_path / label
        folder.mkdir()
        (folder / "report.json").write_text(json.dumps(rep))
        folders.append(str(folder))
    assert main(["compare", *folders, "--out", str(tmp_path / "cmp.md")]) == 0
    printed = capsys.readouterr().out
    assert "- eagle3: −24 % over dspark, −12 % over dflash" in printed  # 2.2 / 2.9 − 1 = −24.1 %
    assert (tmp_path / "cmp-acceptance.png").is_file() and "cmp-acceptance.png" in (tmp_path / "cmp.md").read_text()
