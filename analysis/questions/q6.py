"""Q6: does admission headroom change the ranking? (docs/paper_design.md sections Q6, 3.4)

Family Q6-17 decides (Holm over 17, seed-level bootstrap display intervals); the
headroom curves, completed requests/s and TTFT/E2E/request-TPOT p99 per cell (Tab. B-8)
are descriptive; the simultaneous upper bounds are a separate analysis. Fig. 6 rings the
preselected f of each organization and budget. The development stage's selections
(analysis.questions.development) are shown next to the paper's; the plan's `preselected: paper`
(default) or `development` says which ones Q6-17 tests.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.inference import estimands
from analysis.inference.families import FamilyResult, evaluate_plan
from analysis.pages import paper_figures as pf
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section
from analysis.questions import development

QUESTION = "q6"
TITLE = "Does admission headroom change the ranking?"
CELL_METRICS = ("throughput_span", "throughput_ledger", "requests_per_s", "ttft_p99", "e2e_p99",
                "tpot_p99")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    source = plan.raw.get("preselected", "paper")
    if source not in development.PRESELECTED_SOURCES:
        raise ValueError(f"q6 plan: preselected={source!r}: allowed values are "
                         f"{development.PRESELECTED_SOURCES}")
    selected = development_section(result, con, plan, plan_dir, source)
    tested = plan
    if source == "development":
        chosen = development.as_preselected(selected)
        tested = development.derive_plan(plan, chosen) if chosen is not None else None
    preselected = (tested or plan).raw.get("preselected_f", {})
    if not runs.empty:
        curves = readouts.family_runs(plan, "headroom_curves", runs)
        result.add("curve_runs", readouts.run_frame(curves))
        cells = result.add("cells", readouts.means_table(curves, ["budget", "f", "org"],
                                                         CELL_METRICS))
        result.frames["_preselected"] = pd.DataFrame(
            [{"budget": b, "org": org, "f": float(f)} for b, v in preselected.items()
             for org, f in v.items()], columns=["budget", "org", "f"])
        chosen_text = ", ".join(f"{b}: D0 {v['D0']:g} / S2 {v['S2']:g}"
                                for b, v in preselected.items())
        result.sections.append(Section(
            "Headroom curves and Tab. B-8", "Arithmetic means over runs: throughput (request "
            "span primary), completed requests/s (request span), mean run-level TTFT, E2E and "
            f"request-TPOT p99 (s). Preselected f ({source}): {chosen_text}.",
            [("", cells, None)]))
        bounds_section(result, plan, curves, preselected)
    if tested is None:  # preselected: development, but the selection is incomplete
        result.families.append(FamilyResult(
            QUESTION, plan.primary_family.name, plan.primary_family.role,
            plan.primary_family.decision["method"], "", False,
            ["refused: the plan tests the development selection (preselected: development), "
             "and the development search is incomplete"],
            m=len(plan.primary_family.tests), fill=["make campaign C=q6_development"]))
        readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                 allow_changed_plan,
                                 only=[f.name for f in plan.families if f.role != "primary"])
    elif tested is plan:
        readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    else:
        result.families += evaluate_plan(tested, runset.all_runs,
                                         allow_changed_plan=allow_changed_plan)
    return result


def development_section(result: QuestionResult, con, plan, plan_dir, source: str
                        ) -> pd.DataFrame:
    """The development stage's selections next to the paper's preselected f (AMBIGUOUS A5)."""
    try:
        dev_plan = readouts.load_plan(development.PLAN, plan_dir)
    except ValueError:  # a plan directory without the development plan
        return pd.DataFrame()
    dev_runs = development.development_runs(con)
    paper = plan.raw.get("preselected_f", {})
    tested = ("the paper's preselected f (`preselected: paper` in conf/prereg/q6.yaml)"
              if source == "paper" else
              "this system's development selection (`preselected: development`)")
    if dev_runs.empty:
        result.sections.append(Section(
            "Admission development: selected f against the paper's", "No runs yet: "
            "`make campaign C=q6_development` (105 runs) runs the paper's development stage. "
            f"Q6-17 tests {tested}."))
        return pd.DataFrame()
    selected = development.select(dev_plan, dev_runs)
    table = result.add("development_selection",
                       development.selection_table(selected, paper))
    spec = dev_plan.raw["selection"]
    result.sections.append(Section(
        "Admission development: selected f against the paper's",
        " ".join(str(spec["description"]).split()) + " `selected_f` is this system's choice, "
        "`paper_f` the paper's preselected f; `best_f` the highest-mean f (the alternative "
        "rule); `candidates` the f within the margin; means in output tokens/s (request span). "
        f"Seeds 76200-76202 (initial) and 76300-76302 (b83 extension). Q6-17 tests {tested}.",
        [("", table, None)]))
    return selected


def bounds_section(result: QuestionResult, plan, curves: pd.DataFrame,
                   preselected: dict) -> None:
    """The simultaneous upper bounds declared in the plan (AMBIGUOUS A4), the alternative
    reading beside them, and the bound behind the section-5.4 statement."""
    spec = plan.raw.get("simultaneous_upper_bounds")
    if not spec or curves.empty:
        return
    metric = spec.get("metric", "throughput_span")
    against = spec.get("against", "zero")
    table = result.add("upper_bounds", estimands.simultaneous_bounds(
        curves, spec, metric, preselected, against))
    m = len(estimands.bound_members(spec, preselected, against))
    tables = [(f"Reading: each f against {AGAINST_TEXT[against]}", table, None)]
    other = spec.get("alternative_against")
    if other:
        alt = result.add("upper_bounds_alternative", estimands.simultaneous_bounds(
            curves, spec, metric, preselected, other))
        tables.append((f"Alternative (not the reading): each f against {AGAINST_TEXT[other]}",
                       alt, None))
    statement = statement_text(spec, table, preselected, against)
    result.sections.append(Section(
        f"{m} simultaneous upper bounds",
        " ".join(str(spec["description"]).split()) + " `effect` = 100 (exp(mean d) - 1); "
        "`upper` = the simultaneous one-sided bound (%)." + (f" {statement}" if statement else ""),
        tables))


AGAINST_TEXT = {"preselected": "the preselected f of its organization and budget",
                "zero": "the same organization at f = 0"}


def statement_text(spec, table: pd.DataFrame, preselected: dict, against: str) -> str:
    """The bound behind the section-5.4 statement (S2 at b83, f = 0.27 against the preselected
    f), one sentence per stage."""
    said = spec.get("statement")
    if not said or against != "preselected" or table.empty or "upper" not in table:
        return ""
    org, budget, f = said["org"], said["budget"], float(said["f"])
    base = float(preselected[budget][org])
    name = f"{org}_{budget}_f{f:g}_vs_f{base:g}"
    margin = float(spec["margin_pct"])
    out = [" ".join(str(said.get("text", "")).split())]
    for row in table[table["bound"] == name].itertuples(index=False):
        if pd.isna(row.upper):
            out.append(f"{row.stage}: no paired seeds.")
            continue
        verdict = (f"a gain above {margin:g} % is ruled out" if row.upper < margin else
                   f"a gain above {margin:g} % is not ruled out (the paper: \"do not resolve\")")
        out.append(f"**{row.stage}, bound `{name}`**: effect {row.effect:+.2f} %, simultaneous "
                   f"upper bound {row.upper:+.2f} % (n = {row.n}, m = {row.m}): {verdict}.")
    return " ".join(out)


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    """Fig. 6, one collection stage per figure (pf.figure_stages: main when present)."""
    chosen = result.frames.get("_preselected")
    rings = ({} if chosen is None else
             {(r.budget, r.org): r.f for r in chosen.itertuples(index=False)})
    caption = "Fig. 6(a-c) headroom curves; open rings mark the preselected f"
    return [(caption + ("" if stage == "main" else f" ({stage} stage)"), path)
            for stage, path in pf.staged(
                result.frames.get("curve_runs"), out_dir / "q6_fig6_headroom.png",
                lambda r, p, n, s: pf.curves(r, "f", "admission headroom f", p,
                                             "Throughput against admission headroom",
                                             rings=rings, note=n, stage=s))]
