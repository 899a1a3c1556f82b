"""Q2: what work and state changes accompany the Q1 steps?

Recorded input work is the prefill tokens computed per run (steps view: first
admissions + recomputation on resume); gauges are run means of the 1-s poller
samples; preemptions are per-run counts (requests view).
"""

from __future__ import annotations

from pathlib import Path

from analysis import figures, readouts
from analysis.common import cell_summary
from analysis.render import QuestionResult, Section

QUESTION = "q2"
TITLE = "What work and state changes accompany the Q1 steps?"
READS = ("q2",)
STEPS = (("S1", "S0"), ("S2", "S1"))
WORK_METRICS = ("prefill_tokens_initial", "prefill_tokens_resume", "prefill_tokens_computed",
                "poller_running_mean", "poller_waiting_mean", "preemptions")
CHANGE_METRICS = ("prefill_tokens_computed", "prefill_tokens_resume", "poller_running_mean",
                  "poller_waiting_mean", "preemptions", "throughput_ledger")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    if not runset.empty:
        readouts.throughput_section(result, runset.runs)
        work = result.add("work", cell_summary(runset.runs, WORK_METRICS))
        text = ("Means over seeds of run values: prefill tokens computed per run (tokens), "
                "poller means of running and waiting requests (requests), preemptions per run.")
        result.sections.append(Section("Recorded input work, gauges and preemptions", text,
                                       [("", work, ["cell", "n", "seeds",
                                                    *(f"{m}_mean" for m in WORK_METRICS)])]))
        readouts.changes_section(result, runset.runs, "steps",
                                 "Paired step changes in work, state and throughput",
                                 CHANGE_METRICS, STEPS)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("Recorded input work (prefill tokens per run) and poller gauges by cell",
         figures.work_bars(f.get("work"), out_dir / "q2_work.png")),
        ("Paired step changes in prefill tokens computed, 95% paired-t intervals",
         figures.change_bars(f.get("steps"), f.get("steps_seeds"), out_dir / "q2_work_steps.png",
                             "Q2 step changes in recorded input work",
                             metric="prefill_tokens_computed")),
        ("Throughput by cell: geometric mean over seeds (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q2_throughput.png",
                                 "Q2 throughput by cell")),
    ])
