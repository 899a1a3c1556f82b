"""Q8: does longer checkpoint lifetime restore reuse depth? S2 vs S2+Retention.

Depth is analysed only once the trace probe is shown harmless, per campaign:
by the campaign's own trace ON/OFF pairs when it has them, otherwise by the
gate of the matching Q7 campaign (the same recorder; for campaign q8 that is
the preregistered Q7 containment family). The report states which.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.pages import figures, readouts
from analysis.pages import paper_figures as pf
from analysis.pages.render import QuestionResult, Section
from analysis.questions import q7

QUESTION = "q8"
TITLE = "Does longer checkpoint lifetime restore reuse depth?"
READS = ("q8",)
RETENTION = (("S2_RETENTION", "S2"),)


def campaign_gates(con, runs, plan_dir, allow_changed_plan) -> dict[str, tuple[bool, str]]:
    """Per Q8 campaign: its own ON/OFF pairs if it has them (n >= 2), else the gate of the
    matching Q7 campaign (q8 -> q7, q8_smoke -> q7_smoke)."""
    pairs = q7.containment_pairs(runs) if not runs.empty else pd.DataFrame()
    borrowed = None
    out = {}
    for campaign in sorted(runs["campaign"].unique()):
        own = pairs[pairs["campaign"] == campaign] if len(pairs) else pairs
        if len(own) and (own["n"] >= 2).all():
            ok = bool(own["passed"].all())
            out[campaign] = (ok, f"its own {len(own)} trace ON/OFF condition(s) "
                                 f"{'all pass' if ok else 'do not all pass'}")
            continue
        borrowed = borrowed or q7.q7_gates(con, plan_dir, allow_changed_plan)
        source = q7.QUESTION + campaign[len(QUESTION):] if campaign.startswith(QUESTION) else ""
        ok, how = borrowed.get(source, (False, "no such Q7 campaign in the ledger"))
        out[campaign] = (ok, f"no trace ON/OFF pairs of its own; Q7 campaign "
                             f"{source or '(none)'}: {how}")
    return out


def retention_brackets(initial: pd.DataFrame) -> pd.DataFrame:
    """Per seed and mean: dJadopt, dRmax(M1), dAmax(M1), the dAmax bracket
    [A_M0(Ret) - A_M1(S2), A_M1(Ret) - A_M0(S2)] and dGapR from M0 to M1 (Ret - S2)."""
    if initial.empty or not {"S2", "S2_RETENTION"} <= set(initial["org"]):
        return pd.DataFrame()
    rows = []
    for stage, part in initial.groupby("stage", sort=False):
        s2 = part[part["org"] == "S2"].set_index("seed")
        ret = part[part["org"] == "S2_RETENTION"].set_index("seed")
        seeds = sorted(set(s2.index) & set(ret.index))
        for seed in seeds:
            a, b = ret.loc[seed], s2.loc[seed]
            gap_m0 = (a["rmax_m0"] - a["jadopt"]) - (b["rmax_m0"] - b["jadopt"])
            gap_m1 = (a["rmax_m1"] - a["jadopt"]) - (b["rmax_m1"] - b["jadopt"])
            rows.append({"stage": stage, "seed": seed, "d_jadopt": a["jadopt"] - b["jadopt"],
                         "d_rmax_m1": a["rmax_m1"] - b["rmax_m1"],
                         "d_amax_m1": a["amax_m1"] - b["amax_m1"],
                         "d_amax_low": a["amax_m0"] - b["amax_m1"],
                         "d_amax_high": a["amax_m1"] - b["amax_m0"],
                         "d_gap_r_m0": gap_m0, "d_gap_r_m1": gap_m1})
    table = pd.DataFrame(rows)
    means = table.drop(columns="seed").groupby("stage", sort=False).mean().reset_index()
    return pd.concat([table, means.assign(seed="mean")], ignore_index=True)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    runs = runset.runs
    plan = readouts.load_plan(QUESTION, plan_dir)
    if runset.empty:
        result.families += q7.withheld(plan, "no data: depth needs traced Q8 runs", ())
        return result
    readouts.throughput_section(result, runs)
    readouts.changes_section(result, runs, "retention", "S2+Retention vs S2 throughput",
                             ("throughput_ledger", "throughput_span"), RETENTION,
                             effect="mean_seedwise")
    gates = campaign_gates(con, runs, plan_dir, allow_changed_plan)
    result.notes += q7.gate_notes(gates)
    passed = [c for c, (ok, _) in gates.items() if ok]
    if not passed:
        result.sections.append(Section("State depth", "Depth analysis withheld: depth is "
                                       "analysed only after the probe containment passes."))
    else:
        depth = q7.run_depth(con, runset)
        traced = q7.with_depth(runs, depth)
        traced = traced[traced["campaign"].isin(passed)]
        q7.depth_section(result, traced)
        initial = q7.initial_section(result, traced, "org")
        brackets = result.add("amax_bracket", retention_brackets(initial))
        if len(brackets):
            result.sections.append(Section(
                "Retention changes with M0/M1 brackets",
                "S2+Retention minus S2 per seed and their mean (tokens/request, INITIAL "
                "admissions): dAmax bracket [A_M0(Ret) - A_M1(S2), A_M1(Ret) - A_M0(S2)] "
                "(d_amax_low, d_amax_high); dGapR from M0 to M1. Brackets, not intervals.",
                [("", brackets, None)]))
        readouts.changes_section(result, traced[traced["trace"]], "depth_changes",
                                 "S2+Retention vs S2 depth over INITIAL admissions (trace ON)",
                                 ("jadopt_initial_mean", "gap_r_initial_mean",
                                  "gap_r_m0_initial_mean", "rmax_m1_initial_mean",
                                  "rmax_m0_initial_mean"),
                                 RETENTION)
    q7.attach_gated(result, plan, passed, lambda: q7.with_depth(runset.all_runs, depth),
                    plan_dir, allow_changed_plan, None,
                    "withheld: depth is analysed only after the probe containment passes for "
                    f"campaign {plan.campaign}", ())
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    table, stage, note = pf.pick_stage(f.get("initial_depth"), f.get("runs"))
    if table is not None and len(table):
        table = table.assign(org=table["org"].map(pf.org_name))
    return figures.kept([
        ("Fig. 7(b) Q8 checkpoint retention per seed: open S2, filled S2+Retention; Rmax at "
         "M1 with a bar down to M0",
         pf.depth_per_seed(table, pf.stage_path(out_dir / "q8_fig7b_retention.png", stage),
                           "Q8 checkpoint retention: 254 S2 pages, λ 3, cap 63, f 0, SHARE, "
                           "pin K 1; INITIAL admissions", "org",
                           (("jadopt", "Jadopt", "o"), ("rmax_m1", "Rmax (M1; bar to M0)", "^"),
                            ("amax_m1", "Amax (M1)", "s")), "S2", note, stage)),
        ("State depth of S2 and S2+Retention with M0/M1 brackets, and depth classes",
         figures.depth_panels(f.get("depth_cells"), f.get("depth_classes"),
                              out_dir / "q8_depth.png", "Q8 reuse depth with retention")),
        ("S2+Retention vs S2 paired change in adopted depth Jadopt over INITIAL admissions "
         "(tokens)",
         figures.change_bars(f.get("depth_changes"), f.get("depth_changes_seeds"),
                             out_dir / "q8_depth_change.png", "Q8 retention effect on Jadopt",
                             metric="jadopt_initial_mean")),
        ("Throughput by cell: geometric mean (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q8_throughput.png",
                                 "Q8 throughput by cell")),
    ])
