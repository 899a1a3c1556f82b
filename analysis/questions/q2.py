"""Q2: what work and state changes accompany the Q1 steps? (docs/paper_design.md section Q2)

Computed per run from the ledger tables: C_once = sum over admitted requests of prompt
tokens minus the prefix adopted at FIRST admission (requests), H = C_once + output tokens,
K = engine steps (steps rows), H/K per run, and per-run median, mean and maximum of the
1-s running/waiting gauges (poller). Cell values are means over runs (AMBIGUOUS A16: per-run
medians averaged over the runs). Exp 2c: the S0-normalized throughput index at q = 0,
formed within seed (I_S1 = mean r1, I_S2 = mean r1 r2).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.inference import stats
from analysis.pages import paper_figures as pf
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q2"
TITLE = "What work and state changes accompany the Q1 steps?"
CHAIN = ("S0", "S1", "S2")
WORK = ("throughput_span", "throughput_ledger", "c_once_tokens", "h_tokens", "engine_steps",
        "h_per_k", "running_median", "running_max", "waiting_median", "waiting_max",
        "poller_running_mean", "poller_waiting_mean", "preemptions")
POINTS = {"b63": "2a: b63/cap63, λ 3.0", "b108": "2b: b108/cap109, λ 4.5"}


def s0_index(runs: pd.DataFrame) -> pd.DataFrame:
    """Within-seed S0-normalized throughput index and C_once ratio per org (seeds with all
    three organizations)."""
    rows = []
    for stage, part in runs.groupby("stage", sort=False):
        wide = part.pivot_table(index="seed", columns="org", values="throughput_span")
        work = part.pivot_table(index="seed", columns="org", values="c_once_tokens")
        if not set(CHAIN) <= set(wide.columns):
            continue
        wide, work = wide[list(CHAIN)].dropna(), work[list(CHAIN)].loc[wide.index]
        if wide.empty:
            continue
        index = stats.normalized_index(wide.to_numpy())
        for k, org in enumerate(CHAIN):
            rows.append({"stage": stage, "org": org, "n": len(wide), "t_index": index.mean[k],
                         "c_once_index": float((work[org] / work["S0"]).mean())})
    return pd.DataFrame(rows)


def _fill(result: QuestionResult, plan, runs, con) -> None:
    anchors = readouts.family_runs(plan, "anchors", runs)
    anchors = anchors.assign(point=anchors["budget"].map(POINTS))
    result.add("anchor_runs", readouts.run_frame(anchors))
    cells = result.add("anchors", readouts.means_table(anchors, ["point", "org"], WORK))
    result.sections.append(Section(
        "Anchors 2a and 2b: work, gauges and throughput",
        "Means over runs (seeds 0-2). C_once, H in tokens per run; K engine steps; H/K the "
        "mean of per-run ratios; gauges per-run median and maximum of the 1-s samples. "
        "Paired changes per step (means of same-seed relative changes): family `anchors`.",
        [("", cells, None)]))
    control = readouts.family_runs(plan, "exp2c_no_sharing", runs)
    result.add("exp2c", readouts.means_table(control, ["org"], WORK))
    index = result.add("s0_index", s0_index(control))
    result.sections.append(Section(
        "Exp 2c: no sharing (b83, q = 0)",
        "The Q3 q = 0 runs. `t_index`: mean over seeds of the within-seed throughput ratio "
        "to S0 (I_S2 = mean r1 r2, not the product of averaged steps); `c_once_index`: mean "
        "within-seed C_once ratio to S0.",
        [("cell means", result.frames["exp2c"], None), ("S0-normalized index", index, None)]))


analyze = readouts.plan_analyzer(QUESTION, TITLE, _fill)


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    runs = f.get("runs")
    anchors, a_stage, a_note = pf.pick_stage(f.get("anchors"), runs)
    index, i_stage, i_note = pf.pick_stage(f.get("s0_index"), runs)
    return [(c, p) for c, p in (
        ("Fig. 3(a) C_once per run (bars) and throughput (hollow symbols) at anchors 2a, 2b",
         pf.c_once_bars(anchors, pf.stage_path(out_dir / "q2_fig3a_c_once.png", a_stage),
                        "Recorded initial input C_once and throughput", a_note, a_stage)),
        ("Fig. 3(b) normalized C_once and the S0-normalized throughput index at b83, q = 0",
         pf.index_panel(index, pf.stage_path(out_dir / "q2_fig3b_index.png", i_stage),
                        "No sharing: b83, q = 0, λ 3, cap 63", i_note, i_stage)),
    ) if p is not None]
