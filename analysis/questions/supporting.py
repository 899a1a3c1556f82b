"""Pages of the supporting campaigns: ORIG-5, pinning (PIN-2), D0 split, caps, bursts.

Each page shows arithmetic run means per cell of its plan and every family of the plan;
the split page also shows EXT-22 rows 12-19, decided in that family (conf/prereg/q1.yaml).
Section-2 estimands (analysis.inference.estimands): ORIG-5 and bursts get latency ratios and
goodput (Tab. E-13), ORIG-5 the central-arrival window and drift count (E-14, E.9) and
D0's stranded bytes (also on the split page); caps get the per-completion ratios (E-11).
The paper draws no figure for them (docs/paper_design.md section 6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.inference import estimands
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

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
    extras: Callable | None = None  # (result, con, runs, plan): the page's section-2 estimands
    cells_family: str | None = None  # the Cells table (and extras) show only this family's
    # runs at its planned seeds (caps: the three-seed curves, not the six-seed comparison's)

    def analyze(self, con, *, plan_dir=None, allow_changed_plan: bool = False
                ) -> QuestionResult:
        result, runset, plan = readouts.begin_plan(con, self.QUESTION, self.TITLE, plan_dir)
        runs = runset.runs
        if not runs.empty and self.cells_family:
            runs = readouts.planned_runs(plan, self.cells_family, runs)
        if not runs.empty:
            by = [c for c in BY if runs[c].nunique(dropna=False) > 1 or c == "org"]
            cells = result.add("cells", readouts.means_table(runs, by, METRICS))
            result.sections.append(Section(
                "Cells", "Arithmetic means over runs (seeds): request-span throughput (primary) "
                "and ledger throughput (output tokens/s), run-level E2E and request-TPOT p99 "
                "(s), waiting-gauge p99, preemptions per run.", [("", cells, None)]))
            if self.extras is not None:
                self.extras(result, con, runs, plan)
        readouts.attach_families(result, runset.all_runs, self.QUESTION, plan_dir,
                                 allow_changed_plan)
        if self.borrowed:
            readouts.borrow_rows(result, con, "q1", "EXT-22", self.borrowed, plan_dir,
                                 allow_changed_plan)
        return result

    def draw(self, result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
        return []


PAIR_READINGS = ("latency ratios", "goodput", "central window", "drift heuristic", "intervals")


def planned_seeds(plan, family: str, cell_runs: pd.DataFrame) -> pd.DataFrame:
    """Main-stage runs at their cell's planned seeds (smoke-stage runs kept as collected)."""
    seeds = {c.id: set(c.seeds) for c in plan.family(family).cells}
    planned = [int(s) in seeds.get(c, ()) for c, s in zip(cell_runs["cell_id"],
                                                            cell_runs["seed"], strict=True)]
    return cell_runs[(cell_runs["stage"] != "main").to_numpy() | np.array(planned, dtype=bool)]


def pair_section(result: QuestionResult, con, runs, plan, family: str, tests=None,
                 title: str = "Latency ratios, goodput and the central-arrival window") -> None:
    """Tab. E-13 / E-14 / E.9 rows of the family's D0-vs-comparator tests."""
    fam = plan.family(family)
    cell_runs = planned_seeds(plan, family, readouts.family_runs(plan, family, runs))
    chosen = [t for t in fam.tests if t.kind == "paired" and (tests is None or t.id in tests)]
    table = result.add("pair_estimands", estimands.pair_table(
        con, cell_runs, chosen, estimands.settings(plan.raw)))
    if len(table):
        result.sections.append(Section(
            title, "Descriptive and sensitivity estimands (docs/paper_design.md sections "
            "2.1-2.4; Tab. E-13, "
            "E-14, E.9): intervals, no decisions; full-run p-values do not carry over to the "
            "window. Declared readings (conf/prereg): " + estimands.readings_text(
                plan.raw, PAIR_READINGS),
            [("", table, None)]))


def stranded_section(result: QuestionResult, con, runs, by, plan) -> None:
    """Step-weighted stranded-byte fractions of the D0 runs, as cell means (B.4)."""
    per_run = estimands.stranded_table(con, runs)
    if per_run.empty:
        return
    merged = runs.merge(per_run, on="run_id")
    table = result.add("stranded_bytes", readouts.means_table(
        merged, by, ("stranded_frac", "stranded_frac_free_only", "stranded_max_progress")))
    result.sections.append(Section(
        "Stranded bytes (D0)", "Arithmetic means over runs; descriptive. "
        + estimands.readings_text(plan.raw, ("stranded bytes",))
        + estimands.units_bytes_note(runs),
        [("", table, None)]))


def _orig5(result, con, runs, plan) -> None:
    pair_section(result, con, runs, plan, "ORIG-5")
    stranded_section(result, con, readouts.family_runs(plan, "ORIG-5", runs),
                     ["model", "budget", "cap", "rate", "arrival", "org"], plan)


def _bursts(result, con, runs, plan) -> None:
    pair_section(result, con, runs, plan, "burst_pattern",
                 ("D0_vs_S2_onoff", "D0_vs_S2_poisson"),
                 "Within-burst latency ratios and goodput (Tab. E-13)")


def _caps(result, con, runs, plan) -> None:
    per_run = estimands.cap_ratios(con, runs)
    if per_run.empty:
        return
    table = result.add("cap_ratios", readouts.means_table(
        runs.merge(per_run, on="run_id"), ["budget", "cap", "org"],
        ("rejections_per_completion", "victims_per_completion", "preemptions_per_completion")))
    result.sections.append(Section(
        "Cap-sweep ratios (Tab. E-11)", "Arithmetic means over runs; descriptive. "
        + estimands.readings_text(plan.raw), [("", table, None)]))


def _split(result, con, runs, plan) -> None:
    stranded_section(result, con, runs, ["budget", "d0_attention_fraction", "org"], plan)


PAGES = (
    SupportingPage("orig5", "The original five enlarged high-load tests (ORIG-5)",
                   extras=_orig5),
    SupportingPage("pinning", "Preemption-time pinning (PIN-2)"),
    SupportingPage("d0_split", "D0 pool split", SPLIT_ROWS, extras=_split),
    SupportingPage("caps", "Concurrency caps", extras=_caps, cells_family="cap_curves"),
    SupportingPage("bursts", "Arrival bursts", extras=_bursts),
)
