"""Q4: all four organizations across memory budget (docs/paper_design.md section Q4).

Q1's S0/S1/S2 runs plus Q4's D0 at the default split, at b63, b83, b108 (λ 3, cap 63).
The D0/S2 contrasts per budget and their budget interactions are EXT-22 rows 7-11,
decided there and shown here; this page adds arithmetic run means and the C_once
difference D0 - S2 per budget (E.2) and D0's stranded bytes per budget (B.4). The paper
draws no Q4 figure.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section
from analysis.questions import supporting

QUESTION = "q4"
TITLE = "All four organizations across memory budget"
D0_ROWS = ("D0_vs_S2_b63", "D0_vs_S2_b83", "D0_vs_S2_b108", "D0_vs_S2_b108_minus_b63",
           "D0_vs_S2_b83_minus_b63")


def c_once_difference(runs: pd.DataFrame) -> pd.DataFrame:
    """Per stage and budget: mean over seeds of C_once(D0) - C_once(S2) (tokens/run)."""
    rows = []
    for (stage, budget), part in runs.groupby(["stage", "budget"], sort=False):
        wide = part.pivot_table(index="seed", columns="org", values="c_once_tokens")
        if {"D0", "S2"} <= set(wide.columns):
            diff = (wide["D0"] - wide["S2"]).dropna()
            rows.append({"stage": stage, "budget": budget, "n": len(diff),
                         "c_once_d0_minus_s2": float(diff.mean()),
                         "min": float(diff.min()), "max": float(diff.max())})
    return pd.DataFrame(rows)


def _fill(result: QuestionResult, plan, runs, con) -> None:
    four = readouts.family_runs(plan, "four_orgs", runs)
    cells = result.add("cells", readouts.means_table(
        four, ["budget", "org"], ("throughput_span", "throughput_ledger", "e2e_p99",
                                  "c_once_tokens")))
    diff = result.add("c_once_d0_minus_s2", c_once_difference(four))
    result.sections.append(Section(
        "Four organizations by budget", "λ 3, cap 63, q 1, f 0, pin K 2; arithmetic means "
        "over runs; C_once difference D0 - S2 as the mean of seedwise differences.",
        [("cell means", cells, None), ("C_once D0 - S2 (tokens/run)", diff, None)]))
    supporting.stranded_section(result, con, four, ["budget", "org"], plan)


analyze = readouts.plan_analyzer(QUESTION, TITLE, _fill,
                                 borrow=("q1", "EXT-22", D0_ROWS))


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # docs/paper_design.md section 6: Q4 has no figure (values in text and tables)
