"""Q5: does the D0/S2 ranking change with offered load? (docs/paper_design.md section Q5)

Load curves: arithmetic means of request-span throughput over seeds 0-2 at the paper's
grid (b63/cap63: λ 0.8, 1.3, 1.7, 2.2, 3.0; b108/cap109: the same plus 4.5); the D0/S2 gap
as the mean seedwise percent change (family `load_curves`, descriptive). The enlarged
high-load tests are family ORIG-5 (page orig5).
"""

from __future__ import annotations

from pathlib import Path

from analysis.pages import paper_figures as pf
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q5"
TITLE = "Does the D0/S2 ranking change with offered load?"


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        curves = readouts.planned_runs(plan, "load_curves", runs)  # seeds 0-2 only
        result.add("curve_runs", readouts.run_frame(curves))
        cells = result.add("curves", readouts.means_table(
            curves, ["budget", "cap", "rate", "org"],
            ("throughput_span", "throughput_ledger", "e2e_p99")))
        result.sections.append(Section("Load curves", "Arithmetic means over runs (seeds).",
                                       [("", cells, None)]))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    """Fig. 5, one collection stage per figure (pf.figure_stages: main when present)."""
    return [("Fig. 5(a, b) load curves, D0 and S2" + ("" if stage == "main" else
                                                       f" ({stage} stage)"), path)
            for stage, path in pf.staged(
                result.frames.get("curve_runs"), out_dir / "q5_fig5_load_curves.png",
                lambda r, p, n, s: pf.curves(r, "rate", "arrival rate λ (requests/s)", p,
                                             "Throughput against offered load", note=n,
                                             stage=s))]
