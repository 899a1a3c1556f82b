"""The question and campaign pages, registered once: the report (analysis/report.py)
writes, indexes and cleans exactly these, and the tests iterate them.

A question page is a module of this package with QUESTION (its page is <QUESTION>.md and
its plan conf/prereg/<QUESTION>.yaml), TITLE, `analyze(con, *, plan_dir, allow_changed_plan)`
and `draw(result, out_dir)`; a module with PAGES (supporting.py) contributes one page per
entry, each with that interface. A campaign page (a campaign without a preregistered
question) is a module with PAGE, TITLE and `write_page(con, out)`, which returns None when
its campaign has no runs. Adding one is its module plus its name below. Modules are
imported on first use, so `python -m analysis.questions.q1` loads only what it needs.
"""

from __future__ import annotations

import importlib

QUESTION_MODULES = ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "supporting",
                    "q10_tq4", "q11_state_codec", "arms", "models", "traces", "placement")
CAMPAIGN_PAGE_MODULES = ("vllm_arm", "n0_native", "n0_validate", "n0_vllm", "fidelity_field",
                         "vllm_knobs")


def question_pages() -> tuple:
    """Every question page in index order."""
    pages = []
    for name in QUESTION_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        pages += list(getattr(module, "PAGES", (module,)))
    return tuple(pages)


def campaign_pages() -> tuple:
    """Every campaign page module in index order."""
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in CAMPAIGN_PAGE_MODULES)
