"""Q4: all four organizations across memory budget (reuses the Q1 runs).

Readouts at the Q4 plan's fixed settings (lambda 3, cap 63, q 1, f 0, SHARE:
the values every cell of its primary family shares): D0/S2
paired contrasts by budget, and within-seed normalized indices S0 -> S1 -> S2
(products of step ratios formed within each seed before averaging) with every
D0 cell indexed against S0 of the same seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import figures, prereg, readouts, stats
from analysis.common import budget_rank, cell_labels
from analysis.paired import seed_values
from analysis.render import QuestionResult, Section

QUESTION = "q4"
TITLE = "All four organizations across memory budget"
READS = ("q1", "q4")
FIXED_KEYS = ("cap", "rate", "arrival", "q", "f", "reuse")
CONTRAST = (("D0", "S2"),)
CHAIN = ("S0", "S1", "S2")


def fixed_values(plan: prereg.Plan) -> dict:
    """Settings shared by every cell of the plan's primary family."""
    cells = plan.primary_family.cells
    return {k: cells[0].keys[k] for k in FIXED_KEYS
            if k in cells[0].keys and all(c.keys.get(k) == cells[0].keys[k] for c in cells)}


def fixed_settings(runs: pd.DataFrame, fixed: dict) -> pd.DataFrame:
    """Runs at the fixed settings, relabelled so labels name only what varies among them."""
    mask = pd.Series(True, index=runs.index)
    for column, value in fixed.items():
        col = runs[column]
        if isinstance(value, str):
            mask &= col.astype(str).str.casefold() == value.casefold()
        else:
            mask &= np.isclose(col.astype(float), float(value))
    kept = runs[mask].copy()
    kept["cell"] = cell_labels(kept)
    return kept


def normalized_indices(runs: pd.DataFrame) -> pd.DataFrame:
    """Per budget: S0 -> S1 -> S2 index (seeds with all three) and each D0 cell / S0."""
    rows = []
    for budget in sorted(runs["budget"].unique(), key=budget_rank):
        part = runs[runs["budget"] == budget]
        cells = {org: list(dict.fromkeys(part.loc[part["org"] == org, "cell"])) for org in
                 (*CHAIN, "D0")}
        if any(len(cells[o]) != 1 for o in CHAIN):
            continue
        chain = pd.concat([seed_values(part, cells[o][0], "throughput_ledger").rename(o)
                           for o in CHAIN], axis=1, join="inner").dropna()
        if chain.empty:
            continue
        index = stats.normalized_index(chain.to_numpy())
        for k, org in enumerate(CHAIN):
            rows.append({"budget": budget, "arm": cells[org][0], "n": len(chain),
                         "index_mean": index.mean[k], "index_geomean": index.geometric_mean[k]})
        for d0 in cells["D0"]:
            pair = pd.concat([chain["S0"], seed_values(part, d0, "throughput_ledger")], axis=1,
                             join="inner").dropna()
            ratio = pair.iloc[:, 1] / pair.iloc[:, 0]
            if len(ratio):
                rows.append({"budget": budget, "arm": d0, "n": len(ratio),
                             "index_mean": float(ratio.mean()),
                             "index_geomean": stats.geometric_mean(ratio.to_numpy())})
    return pd.DataFrame(rows)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    fixed = fixed_values(readouts.load_plan(QUESTION, plan_dir))
    settings = ", ".join(f"{k} {v}" for k, v in fixed.items())
    runs = fixed_settings(runset.runs, fixed) if not runset.empty else runset.runs
    if not runset.empty and runs.empty:
        result.frames.pop("runs")
        result.sections.append(Section("No data for Q4 settings",
                                       f"No data for Q4: no run at {settings}."))
    elif not runs.empty:
        result.add("runs", readouts.run_frame(runs))
        result.notes.append(f"Runs at the Q4 plan's fixed settings: {settings}.")
        readouts.throughput_section(result, runs, "Four organizations by budget")
        readouts.changes_section(result, runs, "d0_vs_s2", "D0/S2 paired contrast by budget",
                                 ("throughput_ledger", "throughput_span", "ttft_p99", "e2e_p99"),
                                 CONTRAST)
        index = result.add("normalized_index", normalized_indices(runs))
        text = ("Within-seed normalized throughput index relative to S0 (= 1): "
                "`index_mean` averages the per-seed products of step ratios, `index_geomean` "
                "is their geometric mean.")
        result.sections.append(Section("Normalized indices", text, [("", index, None)])
                               if not index.empty else Section(
            "Normalized indices", "No data for normalized indices: no budget has S0, S1 and "
                                  "S2 runs on common seeds."))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Throughput of the four organizations by budget: geometric mean (bars), seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q4_throughput.png",
                                 "Q4 four organizations by budget")),
        ("D0 vs S2 paired throughput contrast by budget, 95% paired-t intervals",
         figures.change_bars(f.get("d0_vs_s2"), f.get("d0_vs_s2_seeds"),
                             out_dir / "q4_d0_vs_s2.png", "Q4 D0 vs S2 by budget")),
    ])
