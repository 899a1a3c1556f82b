"""Q5: does the D0/S2 ranking change with offered load? Throughput curves and contrasts."""

from __future__ import annotations

from pathlib import Path

from analysis import figures, readouts
from analysis.render import QuestionResult

QUESTION = "q5"
TITLE = "Does the D0/S2 ranking change with offered load?"
READS = ("q5",)
CONTRAST = (("D0", "S2"),)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    if not runset.empty:
        readouts.throughput_section(result, runset.runs, "Throughput curves: cells by load")
        readouts.changes_section(result, runset.runs, "d0_vs_s2",
                                 "D0/S2 paired contrast by budget and load",
                                 ("throughput_ledger", "throughput_span", "ttft_p99", "e2e_p99"),
                                 CONTRAST)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Throughput against offered load per budget (lines: means, dots: seeds) and the "
         "D0 vs S2 change with 95% paired-t intervals",
         figures.load_curves(f.get("runs"), f.get("d0_vs_s2"), out_dir / "q5_load_curves.png")),
    ])
