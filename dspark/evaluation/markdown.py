"""Markdown for every table the library prints or writes: one number format (with its
interval, ``fmt_ci``: "estimate [lo, hi]"), one table layout."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def fmt_number(x: Any, digits: int = 2) -> str:
    """A table cell: "–" for a missing or non-finite value, integers as they are,
    other numbers with ``digits`` decimals."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    return f"{float(x):.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table (no trailing newline) of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ci(x: Any, ci: Any = None, digits: int = 2) -> str:
    """A number with its interval as "1.14 [1.09, 1.20]": the estimate, then the 95 % bounds
    [lo, hi] in ``fmt_number``'s format (intervals are asymmetric in general: a proportion
    near 0 or 1, a ratio on the log scale); the plain number when ``ci`` is missing (a
    report written without intervals), and "1.14 (no interval)" when the interval is not
    finite or null (it rests on too few requests or rounds, ``dspark.bootstrap``). An interval
    narrower than the last digit gets one more decimal."""
    cell = fmt_number(x, digits)
    if cell == "–" or ci is None or len(ci) != 2:
        return cell
    lo, hi = (math.nan if v is None else float(v) for v in ci)  # JSON keeps a withheld bound as null
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{cell} (no interval)"
    if 0 < hi - lo < 10**-digits:  # an interval narrower than the last digit: one more decimal
        digits += 1
        cell = fmt_number(x, digits)
    return f"{cell} [{lo:.{digits}f}, {hi:.{digits}f}]"
