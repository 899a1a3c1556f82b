"""Q8: does longer checkpoint lifetime restore reuse depth? S2 vs S2+Retention.

Depth is analysed only once the trace probe is shown harmless: by Q8's own
trace ON/OFF pairs when the ledger has them, otherwise by the Q7 containment
family (the same recorder), which the report then states.
"""

from __future__ import annotations

from pathlib import Path

from analysis import figures, q7, readouts
from analysis.render import QuestionResult, Section

QUESTION = "q8"
TITLE = "Does longer checkpoint lifetime restore reuse depth?"
READS = ("q8",)
RETENTION = (("S2_RETENTION", "S2"),)


def gate_status(con, runs, plan_dir, allow_changed_plan) -> tuple[bool, str]:
    """(passed, how it was established)."""
    own = q7.containment_pairs(runs) if not runs.empty else None
    if own is not None and not own.empty and (own["n"] >= 2).all():
        passed = bool(own["passed"].all())
        return passed, (f"Q8's own trace ON/OFF pairs ({len(own)} conditions): "
                        f"{'all pass' if passed else 'not all pass'}")
    borrowed = q7.gate(con, plan_dir, allow_changed_plan)
    return bool(borrowed.gate_passed), (
        "Q8 has no trace ON/OFF pairs with n >= 2, so the Q7 containment family "
        f"`{borrowed.name}` is used: {borrowed.status}, gate "
        f"{'passed' if borrowed.gate_passed else 'not passed'}")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    runs = runset.runs
    if not runset.empty:
        readouts.throughput_section(result, runs)
        readouts.changes_section(result, runs, "retention", "S2+Retention vs S2 throughput",
                                 ("throughput_ledger", "throughput_span"), RETENTION)
    passed, how = gate_status(con, runs, plan_dir, allow_changed_plan)
    result.notes.append(f"Probe containment for depth: {how}.")
    plan = readouts.load_plan(QUESTION, plan_dir)
    if not passed:
        reason = f"withheld: depth is analysed only after the probe containment passes ({how})"
        result.sections.append(Section("State depth", f"Depth analysis {reason}."))
        result.families += q7.withheld(plan, reason, ())
        return result
    depth = q7.run_depth(con, runset)
    runs = q7.with_depth(runs, depth)
    q7.depth_section(result, runs)
    readouts.changes_section(result, runs[runs["trace"]], "depth_changes",
                             "S2+Retention vs S2 depth (trace ON)",
                             ("jadopt_tokens_mean", "gap_r_tokens_mean", "rmax_tokens_mean"),
                             RETENTION)
    readouts.attach_families(result, q7.with_depth(runset.all_runs, depth), QUESTION, plan_dir,
                             allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("State depth of S2 and S2+Retention with M0/M1 brackets, and depth classes",
         figures.depth_panels(f.get("depth_cells"), f.get("depth_classes"),
                              out_dir / "q8_depth.png", "Q8 reuse depth with retention")),
        ("S2+Retention vs S2 paired change in adopted depth Jadopt (tokens)",
         figures.change_bars(f.get("depth_changes"), f.get("depth_changes_seeds"),
                             out_dir / "q8_depth_change.png", "Q8 retention effect on Jadopt",
                             metric="jadopt_tokens_mean")),
        ("Throughput by cell: geometric mean (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q8_throughput.png",
                                 "Q8 throughput by cell")),
    ])
