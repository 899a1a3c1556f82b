"""Q7: which state limits joint reuse depth? Probe containment first, then state depth.

Depth comes from the trace view, per admission episode (request, episode):
ADOPT carries the adopted joint depth Jadopt (`boundary`) and, under both
lookup brackets M0 (entries valid at the lookup instant) and M1 (also entries
valid at the start of that step), Amax (`a_*`), Rmax (`rmax_*`) and Jadopt
(`j_*`); GapR = Rmax - Jadopt per bracket. The ENTER_WAITING record of the
same episode carries the entry depth Jenter (`j_m0` at queue entry). Each
episode is classed by entry vs adopted depth. Depth results are produced only
after the ON/OFF probe containment gate passes (docs/statistics.md section 9). The
lineage counts (analysis/pages/lineage.py) come from the lineage table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.inference import prereg, stats
from analysis.inference.families import (
    NOT_INFORMATIVE,
    UNINFORMATIVE,
    FamilyResult,
    evaluate_family,
    fam_description,
    smoke_campaigns,
)
from analysis.inference.paired import seed_values
from analysis.pages import figures, readouts
from analysis.pages import lineage as q7_lineage
from analysis.pages import paper_figures as pf
from analysis.pages.common import DESIGN_COLUMNS, RunSet, cell_order, load_runs, query
from analysis.pages.render import QuestionResult, Section

QUESTION = "q7"
TITLE = "Which state limits joint reuse depth?"
READS = ("q7",)
MARGIN_PCT, CONTAINMENT_CONFIDENCE = 3.0, 0.90
CLASSES = ("zero->zero", "positive-equal", "zero->positive", "deeper", "shallower")
NO_ENTRY = "no entry record"
INITIAL_EPISODE = 1  # the trace numbers a request's admission episodes from 1 (INITIAL)
DEPTH_VALUES = ("jenter", "jadopt", "j_m0", "j_m1", "a_m0", "a_m1", "rmax_m0", "rmax_m1",
                "gap_m0", "gap_m1")
# Run-level metric names of the plans' depth estimands (M0 is the bracket the adoption used).
RUN_METRICS = {"jadopt": "jadopt_tokens_mean", "jenter": "jenter_tokens_mean",
               "a_m0": "amax_tokens_mean", "rmax_m0": "rmax_tokens_mean",
               "gap_m0": "gap_r_tokens_mean"}
# The secondary depth-change tables read what the families read: means over INITIAL
# admissions, Amax and Rmax at M1 with their M0 values as the bracket, GapR = Rmax - Jadopt.
DEPTH_CHANGE_METRICS = ("jadopt_initial_mean", "amax_m1_initial_mean", "amax_m0_initial_mean",
                        "rmax_m1_initial_mean", "rmax_m0_initial_mean", "gap_r_initial_mean",
                        "gap_r_m0_initial_mean")

_EPISODES_SQL = """
    WITH adopt AS (
        SELECT run_id, request_id, episode, seq, boundary AS jadopt,
               a_m0, a_m1, rmax_m0, rmax_m1, j_m0, j_m1
        FROM trace WHERE {campaigns} AND run_id IN ({adopted}) AND event = 'ADOPT'),
    entry AS (
        SELECT run_id, request_id, episode, j_m0 AS jenter
        FROM trace WHERE {campaigns} AND run_id IN ({adopted}) AND event = 'ENTER_WAITING'
        QUALIFY row_number() OVER (PARTITION BY run_id, request_id, episode ORDER BY seq DESC) = 1)
    SELECT adopt.*, entry.jenter FROM adopt LEFT JOIN entry USING (run_id, request_id, episode)
    ORDER BY run_id, seq
"""
_TRACE_HEALTH_SQL = """
    SELECT run_id, count(*) AS trace_events, max(seq) + 1 - count(*) AS seq_gaps,
           sum(dropped) AS dropped, sum(write_errors) AS write_errors,
           count(*) FILTER (WHERE event = 'ENTER_WAITING') AS entries
    FROM trace WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id
"""


def classify(entry: np.ndarray, adopted: np.ndarray) -> np.ndarray:
    """Entry vs adopted depth class of each episode (NaN entry: no ENTER_WAITING record)."""
    conditions = [np.isnan(entry), (entry == 0) & (adopted == 0), (entry > 0) & (adopted == entry),
                  (entry == 0) & (adopted > 0), adopted > entry, adopted < entry]
    return np.select(conditions, [NO_ENTRY, *CLASSES], default=NO_ENTRY)


def load_episodes(con, runset: RunSet) -> pd.DataFrame:
    """One row per admission episode of the run set's traced runs, with GapR and class."""
    episodes = query(con, _EPISODES_SQL, runset)
    entry = episodes["jenter"].astype(float).to_numpy()
    episodes["gap_m0"] = episodes["rmax_m0"] - episodes["jadopt"]  # GapR = Rmax - Jadopt
    episodes["gap_m1"] = episodes["rmax_m1"] - episodes["jadopt"]
    episodes["depth_class"] = classify(entry, episodes["jadopt"].astype(float).to_numpy())
    return episodes


def run_depth(con, runset: RunSet) -> pd.DataFrame:
    """Per run: episode means of every depth value, class shares (%) and trace health."""
    episodes = load_episodes(con, runset)
    health = query(con, _TRACE_HEALTH_SQL, runset)
    if episodes.empty:
        return health
    means = episodes.groupby("run_id")[list(DEPTH_VALUES)].mean().add_suffix("_mean")
    # depth classes over INITIAL episodes (Tab. C-2; AMBIGUOUS A15), counts per run
    first = episodes[episodes["episode"] == INITIAL_EPISODE]
    counts = pd.crosstab(first["run_id"], first["depth_class"])
    shares = (100 * counts.div(counts.sum(axis=1), axis=0)).add_prefix("share_")
    per_run = pd.concat([means, counts.add_prefix("count_"), shares], axis=1)
    per_run["episodes"] = episodes.groupby("run_id").size()
    for value, metric in RUN_METRICS.items():
        per_run[metric] = per_run[f"{value}_mean"]
    initial = episodes[episodes["episode"] == INITIAL_EPISODE]
    per_run = per_run.join(initial.groupby("run_id").agg(
        jadopt_initial_mean=("jadopt", "mean"), rmax_m1_initial_mean=("rmax_m1", "mean"),
        amax_m1_initial_mean=("a_m1", "mean"), rmax_m0_initial_mean=("rmax_m0", "mean"),
        amax_m0_initial_mean=("a_m0", "mean"), initial_episodes=("jadopt", "size")))
    per_run["gap_r_initial_mean"] = per_run["rmax_m1_initial_mean"] - per_run["jadopt_initial_mean"]
    per_run["gap_r_m0_initial_mean"] = (per_run["rmax_m0_initial_mean"]
                                        - per_run["jadopt_initial_mean"])
    per_run = per_run.reset_index().merge(health, on="run_id", how="left")
    per_run["unadmitted_entries"] = per_run["entries"] - per_run["episodes"]
    return per_run


def with_depth(runs: pd.DataFrame, depth: pd.DataFrame) -> pd.DataFrame:
    return runs.merge(depth, on="run_id", how="left") if not depth.empty else runs


def _bracket(m0: float, m1: float) -> str:
    return f"[{m0:.4g}; {m1:.4g}]"


def depth_tables(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per traced cell: means of run-level depth means, and class counts / mean shares."""
    if "episodes" not in runs:
        return pd.DataFrame(), pd.DataFrame()
    traced = runs[runs["trace"] & runs["episodes"].notna()]
    names = (*CLASSES, NO_ENTRY)
    cells, classes = [], []
    for cell in cell_order(traced):
        group = traced[traced["cell"] == cell]
        totals = {c: int(group[c].sum()) for c in ("episodes", "unadmitted_entries", "dropped",
                                                    "write_errors")}
        cells.append({"cell": cell, "n": len(group), **totals,
                      **{f"{v}_mean": float(group[f"{v}_mean"].mean()) for v in DEPTH_VALUES}})
        counts = {f"count_{c}": int(_column(group, f"count_{c}").sum()) for c in names}
        shares = {f"share_{c}": float(_column(group, f"share_{c}").mean()) for c in names}
        classes.append({"cell": cell, "n": len(group), **counts, **shares})
    return pd.DataFrame(cells), pd.DataFrame(classes)


def _column(group: pd.DataFrame, name: str) -> pd.Series:
    """A class count/share column; a class no episode fell into counts as 0."""
    return group[name].fillna(0) if name in group else pd.Series(0.0, index=group.index)


def _display(cells: pd.DataFrame) -> pd.DataFrame:
    shown = cells[["cell", "n", "episodes", "unadmitted_entries", "dropped"]].copy()
    shown["Jenter"] = cells["jenter_mean"]
    shown["Jadopt"] = cells["jadopt_mean"]
    for label, value in (("Jadopt", "j"), ("Amax", "a"), ("Rmax", "rmax"), ("GapR", "gap")):
        shown[f"{label} [M0; M1]"] = [_bracket(a, b) for a, b in
                                      zip(cells[f"{value}_m0_mean"], cells[f"{value}_m1_mean"],
                                          strict=True)]
    return shown


DEPTH_TEXT = ("Depths in tokens, means over admission episodes within a run, then over runs "
              "(seeds). Jenter: joint depth at queue entry; Jadopt: adopted joint depth. "
              "[M0; M1] are the two lookup-time brackets (M0: entries valid at the lookup "
              "instant; M1: also entries valid at the start of that step), shown as brackets, "
              "not intervals. GapR = Rmax - Jadopt per bracket (the adopted depth, not the "
              "bracket's J). "
              "Over every admission episode (INITIAL and RESUME); the INITIAL-only depths the "
              "families read are in the per-seed table and the paired depth changes. Jenter is "
              "read from the engine's own ENTER_WAITING record, while the paper reconstructs it "
              "offline from block ids.")


def depth_section(result: QuestionResult, runs: pd.DataFrame) -> None:
    """Depth and class tables of the traced runs (frames depth_cells, depth_classes)."""
    cells, classes = depth_tables(runs)
    if cells.empty:
        result.sections.append(Section("State depth", "No data for state depth: no traced run "
                                                      "has ADOPT events."))
        return
    result.add("depth_cells", cells)
    result.add("depth_classes", classes)
    class_columns = ["cell", "n", *(f"count_{c}" for c in (*CLASSES, NO_ENTRY)),
                     *(f"share_{c}" for c in CLASSES)]
    result.sections.append(Section("State depth", DEPTH_TEXT, [
        ("depth per cell", _display(cells), None),
        ("entry vs adopted depth per INITIAL admission episode: pooled counts and mean "
         "run-level shares (%)", classes, class_columns)]))


def lineage_section(result: QuestionResult, con, runset: RunSet, runs: pd.DataFrame) -> None:
    """Lineage counts per traced cell beside their definitions (frame lineage_counts)."""
    lineage = query(con, q7_lineage.LINEAGE_SQL, runset)
    traced = runs[runs["trace"]]
    lineage = lineage[lineage["run_id"].isin(traced["run_id"])]
    if lineage.empty:
        result.sections.append(Section("Checkpoint lineage", "No data for the lineage: no "
                                       "traced run has a lineage table."))
        return
    per_run = q7_lineage.lineage_counts(lineage, load_episodes(con, runset))
    table = result.add("lineage_counts", q7_lineage.cell_counts(per_run, traced))
    result.sections.append(Section("Checkpoint lineage", q7_lineage.DEFINITIONS,
                                   [("lineage counts per traced cell", table, None)]))


def containment_pairs(runs: pd.DataFrame) -> pd.DataFrame:
    """Trace ON vs OFF per condition: 90% paired-t interval of 100 ln(ON/OFF) vs +-3."""
    rows = []
    keys = [c for c in DESIGN_COLUMNS if c != "trace"]
    for _, group in runs.groupby(keys, dropna=False, sort=False):
        on_cells = list(dict.fromkeys(group.loc[group["trace"], "cell"]))
        off_cells = list(dict.fromkeys(group.loc[~group["trace"], "cell"]))
        for on in on_cells:
            for off in off_cells:
                pair = pd.concat([seed_values(runs, on, "throughput_ledger").rename("on"),
                                  seed_values(runs, off, "throughput_ledger").rename("off")],
                                 axis=1, join="inner").dropna()
                row = {"campaign": group["campaign"].iloc[0], "on": on, "off": off,
                       "n": len(pair), "estimate_log_pct": np.nan,
                       "low_log_pct": np.nan, "high_log_pct": np.nan, "passed": False}
                if len(pair) >= 2:
                    check = stats.containment(pair["on"], pair["off"], MARGIN_PCT,
                                              CONTAINMENT_CONFIDENCE)
                    row.update(estimate_log_pct=check.estimate_log_pct,
                               low_log_pct=check.low_log_pct, high_log_pct=check.high_log_pct,
                               passed=check.passed,
                               informative=bool((pair["on"] != pair["off"]).any()))
                rows.append(row)
    return pd.DataFrame(rows)


INITIAL_COLUMNS = {"jadopt_initial_mean": "jadopt", "rmax_m1_initial_mean": "rmax_m1",
                   "rmax_m0_initial_mean": "rmax_m0", "amax_m1_initial_mean": "amax_m1",
                   "amax_m0_initial_mean": "amax_m0", "gap_r_initial_mean": "gap_r",
                   "initial_episodes": "initial_episodes"}


def initial_depth(runs: pd.DataFrame, by: str) -> pd.DataFrame:
    """Per traced run: means over its INITIAL admissions (docs/statistics.md section 2.4),
    M1 for Rmax and Amax as plotted, M0 kept for the brackets; GapR = Rmax(M1) - Jadopt."""
    if "jadopt_initial_mean" not in runs:
        return pd.DataFrame()
    traced = runs[runs["trace"] & runs["jadopt_initial_mean"].notna()]
    keep = ["stage", "org", by, "seed", *INITIAL_COLUMNS]
    return traced[[c for c in dict.fromkeys(keep) if c in traced]].rename(
        columns=INITIAL_COLUMNS).sort_values(["stage", "org", by, "seed"]).reset_index(drop=True)


def initial_section(result: QuestionResult, runs: pd.DataFrame, by: str) -> pd.DataFrame:
    table = result.add("initial_depth", initial_depth(runs, by))
    if table.empty:
        return table
    result.sections.append(Section(
        "Depth over INITIAL admissions, per seed",
        "Means over each run's INITIAL admissions (RESUME episodes excluded), in tokens per "
        "request: Jadopt, Rmax and Amax at the M1 bracket (M0 alongside), GapR = Rmax(M1) - "
        "Jadopt. Descriptive: no test, no interval over seeds.", [("", table, None)]))
    return table


def containment_section(result: QuestionResult, runs: pd.DataFrame) -> pd.DataFrame:
    pairs = result.add("containment", containment_pairs(runs))
    text = (f"Throughput (ledger) of trace ON vs OFF runs paired by seed: "
            f"{100 * CONTAINMENT_CONFIDENCE:g}% paired-t interval of 100 ln(ON/OFF) must lie "
            f"within [-{MARGIN_PCT:g}, +{MARGIN_PCT:g}]. This table covers the seeds present; "
            "the gate is the preregistered containment family.")
    if pairs.empty:
        text = "No data for the probe containment: no condition has both trace ON and OFF runs."
    result.sections.append(Section("Probe effect: trace ON vs OFF", text,
                                    [("", pairs, None)] if not pairs.empty else []))
    return pairs


def q7_gates(con, plan_dir=None, allow_changed_plan: bool = False) -> dict[str, tuple[bool, str]]:
    """Depth gate of every Q7 campaign, and of the plan's campaign even without runs (Q8)."""
    runset = load_runs(con, READS)
    plan = readouts.load_plan(QUESTION, plan_dir)
    gates = [evaluate_family(plan, fam, runset.all_runs, allow_changed_plan=allow_changed_plan)
             for fam in plan.families if fam.decision["method"] == "containment"]
    pairs = containment_pairs(runset.runs) if not runset.empty else pd.DataFrame()
    campaigns = sorted({plan.campaign, *runset.runs["campaign"]})
    return campaign_gates(campaigns, pairs, plan, gates)


def withheld(plan: prereg.Plan, reason: str, skip: tuple[str, ...]) -> list[FamilyResult]:
    """The plan's families other than `skip`, refused because the depth gate has not passed."""
    return [FamilyResult(plan.question, fam.name, fam.role, fam.decision["method"],
                         " ".join(fam_description(plan, fam).split()), False, [reason],
                         m=len(fam.tests))
            for fam in plan.families if fam.name not in skip]


def campaign_gates(campaigns, pairs: pd.DataFrame, plan: prereg.Plan,
                   gates: list[FamilyResult]) -> dict[str, tuple[bool, str]]:
    """Per campaign: may its depth be analysed, and how that was decided.

    The plan's campaign needs its preregistered containment family to pass; any other
    campaign (a smoke or demo run) needs every one of its own ON/OFF pairs (n >= 2) to
    pass, and its depth results are exploratory.
    """
    out = {}
    for campaign in campaigns:
        if campaign == plan.campaign:
            ok = bool(gates) and all(g.gate_passed for g in gates)
            how = "preregistered containment family " + "; ".join(
                f"{g.name}: {g.status}, gate {_gate_word(g)}" for g in gates)
        else:
            own = pairs[pairs["campaign"] == campaign] if len(pairs) else pairs
            ok = bool(len(own)) and bool((own["n"] >= 2).all() and own["passed"].all())
            same = ok and "informative" in own and not own["informative"].any()
            verdict = ("are not informative in simulation (ON and OFF identical)" if same else
                       "all pass" if ok else "do not all pass (or n < 2)")
            how = f"its own {len(own)} trace ON/OFF condition(s) {verdict}; exploratory"
        out[campaign] = (ok, how)
    return out


def _gate_word(gate: FamilyResult) -> str:
    if not gate.gate_passed:
        return "not passed"
    same = any((table["decision"] == UNINFORMATIVE).all() for table in gate.tables.values())
    return "not informative in simulation (ON and OFF identical)" if same else "passed"


def gate_notes(gates: dict[str, tuple[bool, str]]) -> list[str]:
    return [f"campaign {c}: depth {'analysed' if ok else 'withheld'} ({how})"
            for c, (ok, how) in gates.items()]


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    pairs = pd.DataFrame()
    if not runset.empty:
        readouts.throughput_section(result, runset.runs)
        pairs = containment_section(result, runset.runs)
    plan = readouts.load_plan(QUESTION, plan_dir)
    gate_names = tuple(f.name for f in plan.families if f.decision["method"] == "containment")
    gates = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                     allow_changed_plan, only=gate_names)
    campaign_gate = campaign_gates(list(runset.campaigns), pairs, plan, gates)
    probe_rows = [table for g in gates for table in g.tables.values()]
    if probe_rows and all((table["note"] == NOT_INFORMATIVE).all() for table in probe_rows):
        result.notes.append(f"Probe containment {NOT_INFORMATIVE}; depth may be analysed, "
                            "but the check is no evidence that tracing is harmless.")
    passed = [c for c, (ok, _) in campaign_gate.items() if ok]
    notes = gate_notes(campaign_gate)
    result.notes += notes
    if not passed:
        reason = ("withheld: depth is analysed only after the ON/OFF probe containment gate "
                  f"passes ({'; '.join(notes) or 'no runs'})")
        result.sections.append(Section("State depth", f"Depth analysis {reason}."))
    else:
        depth = run_depth(con, runset)
        runs = with_depth(runset.runs, depth)
        runs = runs[runs["campaign"].isin(passed)]
        depth_section(result, runs)
        lineage_section(result, con, runset, runs)
        initial_section(result, runs, "f")
        readouts.changes_section(result, runs[runs["trace"]], "depth_changes",
                                 "D0 vs S2 depth over INITIAL admissions (trace ON)",
                                 DEPTH_CHANGE_METRICS,
                                 (("D0", "S2"),))
    others = tuple(f.name for f in plan.families if f.name not in gate_names)
    attach_gated(result, plan, passed, lambda: with_depth(runset.all_runs, depth), plan_dir,
                 allow_changed_plan, others,
                 "withheld: depth is analysed only after the preregistered ON/OFF probe "
                 "containment gate passes", gate_names)
    return result


def attach_gated(result: QuestionResult, plan: prereg.Plan, passed: list[str], runs,
                 plan_dir, allow_changed_plan: bool, only, reason: str, skip) -> None:
    """Attach the depth families whose stage passed its gate: the main families when the
    plan's campaign passed, their smoke counterparts when a smoke or demo campaign did; the
    main families are otherwise listed as withheld."""
    main_ok = plan.campaign in passed
    smoke_ok = any(c in passed for c in smoke_campaigns(plan.campaign))
    if main_ok or smoke_ok:
        families = readouts.attach_families(result, runs(), plan.campaign, plan_dir,
                                            allow_changed_plan, only=only)
        dropped = [f for f in families if (f.smoke and not smoke_ok)
                   or (not f.smoke and not main_ok)]
        result.families = [f for f in result.families if f not in dropped]
    if not main_ok and (plan.campaign in result.campaigns or not smoke_ok):
        if plan.campaign not in result.campaigns:  # nothing was refused: nothing ran yet
            reason = (f"no data: no runs yet of campaign {plan.campaign} "
                      f"(`make {plan.campaign}`)")
        result.families += withheld(plan, reason, skip)


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    table, stage, note = pf.pick_stage(f.get("initial_depth"), f.get("runs"))
    if table is not None and len(table):
        table = table[table["org"] == "S2"]
        table = table.assign(f=table["f"].map(lambda v: f"f = {v:g}"))
    return figures.kept([
        ("Fig. 7(a) Q7 state availability: S2 per seed, open f = 0, filled f = 0.19",
         pf.depth_per_seed(table, pf.stage_path(out_dir / "q7_fig7a_state.png", stage),
                           "Q7 state availability: S2, b83, λ 3, cap 63, q 1, pin K 1; "
                           "INITIAL admissions", "f",
                           (("jadopt", "Jadopt", "o"), ("rmax_m1", "Rmax (M1)", "^"),
                            ("amax_m1", "Amax (M1)", "s")), "f = 0", note, stage)),
        ("State depth per cell with M0/M1 brackets, and entry vs adopted depth classes",
         figures.depth_panels(f.get("depth_cells"), f.get("depth_classes"),
                              out_dir / "q7_depth.png", "Q7 joint reuse depth (trace ON)")),
        ("Throughput by cell (trace ON and OFF): geometric mean (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q7_throughput.png",
                                 "Q7 throughput by cell")),
    ])
