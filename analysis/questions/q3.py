"""Q3: does prefix sharing interact with memory organization? (docs/paper_design.md section Q3)

Per sharing level q: mean seedwise S1/S0, S2/S1 and D0/S2 percent changes (family
`sharing_levels`, descriptive). The endpoint interactions (q = 1 minus q = 0, in pp) are
EXT-22 rows 20-22, decided in that family and shown here.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.pages import paper_figures as pf
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q3"
TITLE = "Does prefix sharing interact with memory organization?"
STEPS = (("S1", "S0"), ("S2", "S1"), ("D0", "S2"))
ENDPOINT_ROWS = ("S1_vs_S0_b83_q1_minus_q0", "S2_vs_S1_b83_q1_minus_q0",
                 "D0_vs_S2_b83_q1_minus_q0")


def step_effects(runs: pd.DataFrame) -> pd.DataFrame:
    """Per stage, q and step: the mean seedwise percent change and its per-seed values."""
    rows = []
    for (stage, q), part in runs.groupby(["stage", "q"], sort=True):
        wide = part.pivot_table(index="seed", columns="org", values="throughput_span")
        for t, c in STEPS:
            if t in wide and c in wide:
                pct = (100 * (wide[t] / wide[c] - 1)).dropna()
                if len(pct):
                    rows.append({"stage": stage, "q": q, "step": f"{t} over {c}", "n": len(pct),
                                 "effect": float(pct.mean()), "values": pct.to_numpy()})
    return pd.DataFrame(rows)


def _fill(result: QuestionResult, plan, runs, con) -> None:
    levels = readouts.family_runs(plan, "sharing_levels", runs)
    cells = result.add("cells", readouts.means_table(
        levels, ["q", "org"], ("throughput_span", "throughput_ledger", "c_once_tokens")))
    effects = step_effects(levels)
    result.frames["_endpoints"] = effects  # for the figure; not a CSV (array column)
    shown = effects.drop(columns="values") if len(effects) else effects
    result.add("step_effects", shown)
    result.sections.append(Section(
        "Organization steps by sharing level",
        "b83, λ 3, cap 63, f 0; arithmetic run means and mean seedwise percent changes "
        "(request span). The q = 1 runs are Q1's (S0-S2) and Q4's (D0).",
        [("cell means", cells, None), ("mean seedwise step effects (%)", shown, None)]))


analyze = readouts.plan_analyzer(QUESTION, TITLE, _fill,
                                 borrow=("q1", "EXT-22", ENDPOINT_ROWS))


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    effects, stage, note = pf.pick_stage(result.frames.get("_endpoints"),
                                         result.frames.get("runs"))
    if effects is not None and len(effects):
        effects = effects[effects["q"].isin((0.0, 1.0))
                          & effects["step"].isin(("S1 over S0", "S2 over S1"))]
    path = pf.endpoint_bars(effects, pf.stage_path(out_dir / "q3_fig4_endpoints.png", stage),
                            "Sharing endpoints: S1 over S0 and S2 over S1", note, stage)
    return [("Fig. 4 endpoint bars at q = 0 and q = 1 (mean seedwise throughput effect)",
             path)] if path is not None else []
