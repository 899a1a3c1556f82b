"""Q1: does S0 -> S1 -> S2 improve serving? (docs/paper_design.md section Q1)

Exp 1a (main load): arithmetic run means of request-span throughput and mean run-level
E2E p99 per organization and budget; the six stepwise contrasts are EXT-22 rows 1-6,
shown here with the whole 22-test family. Exp 1b (low load): throughput, TTFT/E2E p50
and p99 (run-level, averaged) and the waiting gauge's run maxima; descriptive. EXT-22 under
the adoption scenarios A, B and C (E.14) is a sensitivity table.
"""

from __future__ import annotations

from pathlib import Path

from analysis.inference import estimands
from analysis.pages import paper_figures as pf
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q1"
TITLE = "Does S0 -> S1 -> S2 improve serving?"
STEP_ORGS = ("S0", "S1", "S2")
MAIN = ("throughput_span", "throughput_ledger", "e2e_p99", "ttft_p99")
LOW = ("throughput_span", "throughput_ledger", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99",
       "preemptions")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        main = readouts.family_runs(plan, "EXT-22", runs)
        main = main[main["org"].isin(STEP_ORGS) & (main["q"] == 1.0)]
        low = readouts.family_runs(plan, "exp1b_low_load", runs)
        result.add("exp1a_runs", readouts.run_frame(main))
        result.add("exp1b_runs", readouts.run_frame(low))
        table = result.add("exp1a", readouts.means_table(main, ["budget", "org"], MAIN))
        if len(table):
            result.sections.append(Section(
                "Exp 1a: main load", "Arithmetic means over runs (seeds) of request-span "
                "throughput (primary, output tokens/s), ledger throughput (sensitivity), and "
                "run-level E2E/TTFT p99 (s). Stepwise effects and decisions: family EXT-22 "
                "below.", [("", table, None)]))
        low_table = result.add("exp1b", readouts.means_table(low, ["budget", "cap", "org"], LOW,
                                                              ranges=("waiting_max",)))
        if len(low_table):
            result.sections.append(Section(
                "Exp 1b: low load", "Lambda 0.8, seeds 0-2. Arithmetic means of run values; "
                "`waiting_max_range` is the range across runs of each run's maximum sampled "
                "waiting count (the micro-tables of Fig. 2(c, d)). Descriptive.",
                [("", low_table, None)]))
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    scenarios_section(result, plan, families)
    return result


def scenarios_section(result: QuestionResult, plan, families) -> None:
    """EXT-22 under adoption scenarios A, B and C (E.14, Tab. E-17), from its per-seed d."""
    spec = plan.raw.get("adoption_scenarios")
    fam = next((f for f in families if spec and f.name == spec["family"] and f.accepted), None)
    if fam is None:
        return
    table = result.add("adoption_scenarios", estimands.adoption_scenarios(
        fam, plan.family(spec["family"]), spec))
    if len(table):
        result.sections.append(Section(
            "EXT-22 adoption scenarios (Tab. E-17)", " ".join(str(spec["description"]).split())
            + " `effect_B`: mean seedwise percent change without the seed (paired tests).",
            [("", table, None)]))


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    """Fig. 2, one collection stage per figure (pf.figure_stages: main when present)."""
    f = result.frames
    main, low = f.get("exp1a_runs"), f.get("exp1b_runs")
    specs = (
        ("Fig. 2(a) main throughput: bars by organization within budget", main,
         out_dir / "q1_fig2a_throughput.png",
         lambda r, p, n, s: pf.grouped_bars(r, "throughput_span",
                                            "throughput, request span (output tokens/s)",
                                            "Main throughput (Exp 1a)", p, n, s)),
        ("Fig. 2(b) main E2E p99: mean of run-level p99", main, out_dir / "q1_fig2b_e2e_p99.png",
         lambda r, p, n, s: pf.grouped_bars(r, "e2e_p99", "E2E p99, mean of run p99s (s)",
                                            "Main E2E p99 (Exp 1a)", p, n, s)),
        ("Fig. 2(c, d) low load: throughput bars, TTFT/E2E p99 markers, waiting run maxima",
         low, out_dir / "q1_fig2cd_low_load.png",
         lambda r, p, n, s: pf.low_load(r, p, "Low load (Exp 1b)", n, s)),
    )
    return [(caption if stage == "main" else f"{caption} ({stage} stage)", path)
            for caption, frame, path, drawer in specs
            for stage, path in pf.staged(frame, path, drawer)]
