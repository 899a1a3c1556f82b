"""The study pages, registered once: the report (analysis/report.py) writes, indexes and
cleans exactly these, and the tests iterate them.

One page per study of experiments/studies/ (same module name): PAGE (its file in the
report directory), TITLE, TABLES (the study tables of ledgers.studies it reads, read
through the catalog) and `write_page(con, out)`, which returns None when its study has
not run (sensitivity's always writes: it names the command that fills it). Adding a study
is its driver, its table in ledgers/studies.py, its page module here and its name below.
Modules are imported on first use.
"""

from __future__ import annotations

import importlib

STUDY_PAGE_MODULES = ("fidelity", "sensitivity", "reload_study", "continuation",
                      "codec_continuation", "continuation_http", "identify")


def study_pages() -> tuple:
    """Every study page module in index order."""
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in STUDY_PAGE_MODULES)
