"""Pages of the supporting campaigns: ORIG-5, pinning (PIN-2), D0 split, caps, bursts.

Each page shows arithmetic run means per cell of its plan and every family of the plan;
the split page also shows EXT-22 rows 12-19, decided in that family (conf/prereg/q1.yaml).
PAPER_DESIGN section 6 draws no figure for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from analysis import readouts
from analysis.render import QuestionResult, Section

SPLIT_ROWS = tuple(f"D0_{n}_vs_default_{b}" for b in ("b63", "b108")
                   for n in ("RM10", "RM05", "RP05", "RP10"))
METRICS = ("throughput_span", "throughput_ledger", "e2e_p99", "tpot_p99", "waiting_p99",
           "preemptions")
BY = ("budget", "cap", "rate", "arrival", "pinning_k", "d0_attention_fraction", "org")


@dataclass(frozen=True)
class SupportingPage:
    """A report page for one supporting campaign (the interface of a question module)."""

    QUESTION: str
    TITLE: str
    borrowed: tuple[str, ...] = ()

    def analyze(self, con, *, plan_dir=None, allow_changed_plan: bool = False
                ) -> QuestionResult:
        result, runset, plan = readouts.begin_plan(con, self.QUESTION, self.TITLE, plan_dir)
        runs = runset.runs
        if not runs.empty:
            by = [c for c in BY if runs[c].nunique(dropna=False) > 1 or c == "org"]
            cells = result.add("cells", readouts.means_table(runs, by, METRICS))
            result.sections.append(Section(
                "Cells", "Arithmetic means over runs (seeds): request-span throughput (primary) "
                "and ledger throughput (output tokens/s), run-level E2E and request-TPOT p99 "
                "(s), waiting-gauge p99, preemptions per run.", [("", cells, None)]))
        readouts.attach_families(result, runset.all_runs, self.QUESTION, plan_dir,
                                 allow_changed_plan)
        if self.borrowed:
            readouts.borrow_rows(result, con, "q1", "EXT-22", self.borrowed, plan_dir,
                                 allow_changed_plan)
        return result

    def draw(self, result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
        return []


PAGES = (
    SupportingPage("orig5", "The original five enlarged high-load tests (ORIG-5)"),
    SupportingPage("pinning", "Preemption-time pinning (PIN-2)"),
    SupportingPage("d0_split", "D0 pool split", SPLIT_ROWS),
    SupportingPage("caps", "Concurrency caps"),
    SupportingPage("bursts", "Arrival bursts"),
)
