"""Markdown tables: one cell's text and a whole table, shared by pages and inference."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

MISSING = "n/a"


def fmt(value) -> str:
    """One table cell: NaN -> n/a, floats with 4 significant digits (whole numbers from 1e4)."""
    if value is None:
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return MISSING
        return f"{float(value):.0f}" if abs(value) >= 1e4 else f"{float(value):.4g}"
    return str(value).replace("|", "\\|")


def md_table(frame: pd.DataFrame, columns: Sequence[str] | None = None,
             headers: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of `columns` (default all), headers renamed by `headers`."""
    columns = list(frame.columns if columns is None else [c for c in columns if c in frame])
    if frame.empty or not columns:
        return "_(empty table)_"
    names = list(headers) if headers is not None else columns
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |"
              for row in frame[columns].itertuples(index=False)]
    return "\n".join(lines)
