"""Q1: does S0 -> S1 -> S2 improve serving? Throughput, paired step changes, TTFT/E2E p99."""

from __future__ import annotations

from pathlib import Path

from analysis import figures, readouts
from analysis.render import QuestionResult

QUESTION = "q1"
TITLE = "Does S0 -> S1 -> S2 improve serving?"
READS = ("q1",)
STEPS = (("S1", "S0"), ("S2", "S1"))
STEP_METRICS = ("throughput_ledger", "throughput_span", "ttft_p99", "e2e_p99")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    if not runset.empty:
        readouts.throughput_section(result, runset.runs)
        readouts.changes_section(result, runset.runs, "steps", "Paired step changes S0 -> S1 -> S2",
                                 STEP_METRICS, STEPS)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Throughput by cell: geometric mean over seeds (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q1_throughput.png",
                                 "Q1 throughput by cell")),
        ("Paired step changes in throughput (ledger timebase), 95% paired-t intervals",
         figures.change_bars(f.get("steps"), f.get("steps_seeds"), out_dir / "q1_steps.png",
                             "Q1 step changes S0 -> S1 -> S2")),
    ])
