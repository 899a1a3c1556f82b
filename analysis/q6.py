"""Q6: does admission headroom change the ranking? Headroom curves and D0/S2 contrasts."""

from __future__ import annotations

from pathlib import Path

from analysis import figures, readouts
from analysis.render import QuestionResult

QUESTION = "q6"
TITLE = "Does admission headroom change the ranking?"
READS = ("q6",)
CONTRAST = (("D0", "S2"),)
METRICS = ("throughput_ledger", "throughput_span", "ttft_p99", "e2e_p99")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    if not runset.empty:
        runs = runset.runs
        readouts.throughput_section(result, runs, "Headroom curves: cells by headroom f")
        readouts.changes_section(result, runs, "d0_vs_s2", "D0/S2 paired contrast by budget and f",
                                 METRICS, CONTRAST)
        headroom = [(f, 0.0) for f in sorted(runs["f"].unique()) if f > 0]
        readouts.changes_section(result, runs, "headroom",
                                 "Headroom effect: each f > 0 against f = 0, per org and budget",
                                 METRICS, headroom, vary="f")
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Headroom curves: throughput and TTFT p99 against f per budget (lines: means over "
         "seeds, dots: seeds)", figures.headroom_curves(f.get("runs"),
                                                        out_dir / "q6_headroom.png")),
        ("D0/S2 paired throughput contrast per budget and f, 95% paired-t intervals",
         figures.change_bars(f.get("d0_vs_s2"), f.get("d0_vs_s2_seeds"),
                             out_dir / "q6_d0_vs_s2.png", "Q6 D0 vs S2 by budget and headroom")),
    ])
