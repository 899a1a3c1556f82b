"""Q3: does prefix sharing interact with memory organization?

Relative throughput is each org's within-seed throughput relative to S0 at the
same sharing level q; the org x sharing interactions are the family tests.
"""

from __future__ import annotations

from pathlib import Path

from analysis import figures, readouts
from analysis.render import QuestionResult

QUESTION = "q3"
TITLE = "Does prefix sharing interact with memory organization?"
READS = ("q3",)
RELATIVE = (("S1", "S0"), ("S2", "S0"), ("D0", "S0"))
STEPS = (("S1", "S0"), ("S2", "S1"), ("D0", "S2"))


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    if not runset.empty:
        readouts.throughput_section(result, runset.runs)
        readouts.changes_section(result, runset.runs, "relative",
                                 "Relative throughput vs S0 by sharing level q",
                                 ("throughput_ledger", "throughput_span"), RELATIVE)
        readouts.changes_section(result, runset.runs, "steps", "Paired org steps by sharing level",
                                 ("throughput_ledger",), STEPS)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Relative throughput (within seed, % of S0) against the shared-context fraction q",
         figures.relative_curves(f.get("relative"), out_dir / "q3_relative.png", "q",
                                 "shared-context fraction q", "Q3 org x sharing")),
        ("Throughput by cell: geometric mean over seeds (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q3_throughput.png",
                                 "Q3 throughput by cell")),
        ("Paired org steps in throughput by sharing level, 95% paired-t intervals",
         figures.change_bars(f.get("steps"), f.get("steps_seeds"), out_dir / "q3_steps.png",
                             "Q3 paired org steps")),
    ])
