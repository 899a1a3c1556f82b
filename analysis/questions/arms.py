"""Arms from the literature against S2 (issue 29; plan conf/prereg/arms.yaml).

S2, D0, Jenga's two-level allocator (serving_core/memory/jenga.py) and S2 and D0 under
Marconi's admission and eviction (serving_core/memory/cache_policy.py), at b63, b83, b108
(λ 3, cap 63, q 1, f 0, pinning K 2), paired by seed. The page shows, per arm and budget,
the arithmetic run means of throughput, C_once, the token hit rate and TTFT p99, then the
preregistered families: ARMS-9 (each literature arm against S2 per budget, Holm over 9)
decides; arms_within is descriptive.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "arms"
TITLE = "Arms from the literature against S2 (Jenga, Marconi)"
METRICS = ("throughput_span", "throughput_ledger", "c_once_tokens", "token_hit_rate",
           "ttft_p99")


def with_hit_rate(runs: pd.DataFrame) -> pd.DataFrame:
    """Token hit rate of a run: prompt tokens adopted at first admissions over all prompt
    tokens, cross / (cross + C_once) (C_once = prompt - adopted at first admission)."""
    cross = runs["prefix_hit_tokens_cross"].astype(float)
    total = cross + runs["c_once_tokens"].astype(float)
    return runs.assign(token_hit_rate=(cross / total).where(total > 0))


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        arms = with_hit_rate(readouts.family_runs(plan, "ARMS-9", runs))
        cells = result.add("cells", readouts.means_table(arms, ["budget", "org"], METRICS))
        result.sections.append(Section(
            "Arms by budget", "λ 3, cap 63, q 1, f 0, pin K 2; arithmetic means over runs "
            "(n seeds). Token hit rate: prompt tokens adopted at first admission over all "
            "prompt tokens. TTFT p99: per run over its finished requests.",
            [("cell means", cells, None)]))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # tables only: the arms' comparison is read from the cell means and the family
