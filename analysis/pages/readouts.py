"""Standard readouts shared by the questions: throughput/latency by cell, paired changes.

Each builder adds its CSV frame to the QuestionResult and appends a Markdown
section; the question modules only choose which readouts and comparisons apply.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.inference import prereg
from analysis.inference.families import SMOKE_TAG, evaluate_plan, relaxed_match, smoke_plan
from analysis.inference.paired import paired_changes
from analysis.pages.common import (
    DESIGN_COLUMNS,
    METRICS,
    ORG_ORDER,
    RunSet,
    budget_rank,
    cell_summary,
    load_runs,
)
from analysis.pages.render import QuestionResult, Section, no_data_section

RUN_COLUMNS = ("run_id", "campaign", "cell", "seed", *DESIGN_COLUMNS, "throughput_ledger",
               "throughput_span", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "tpot_p99",
               "requests_per_s", "finished_requests", "num_requests", "c_once_tokens", "h_tokens",
               "engine_steps", "h_per_k", "running_median", "running_max", "waiting_median",
               "waiting_max", "waiting_p99",
               "prefill_tokens_initial", "prefill_tokens_resume", "prefill_tokens_computed",
               "poller_running_mean", "poller_waiting_mean", "preemptions",
               "prereg_plan_hash", "code_version")
CHANGE_COLUMNS = ("comparison", "n", "effect", "unit", "ci_low", "ci_high", "display_mean_pct",
                  "n_pos", "n_neg", "n_zero", "p_exact", "note")
CHANGE_TEXT = ("Paired by seed within each condition. Throughput and latency effects are "
               "100 (exp(mean d) - 1) % of per-seed log ratios d = ln(T/C) with the 95% "
               "paired-t interval; `display_mean_pct` is the mean of seedwise 100 (T/C - 1), a "
               "display statistic only. Counts, gauges and depths compare by per-seed "
               "differences in their own unit. `p_exact` is the unadjusted exact two-sided "
               "sign-flip p (Holm-adjusted decisions are in the family tables).")


def begin(con, question: str, title: str,
          reads: Sequence[str]) -> tuple[QuestionResult, RunSet]:
    """Load the runs serving `reads` (question names) and start the result.

    A question without runs gets a no-data section.
    """
    runset = load_runs(con, reads)
    result = QuestionResult(question, title, tuple(reads), runset.campaigns, len(runset.runs))
    result.notes += runset.notes()
    if runset.empty:
        result.sections.append(no_data_section(question, reads))
    else:
        result.add("runs", run_frame(runset.runs))
    return result, runset


def plan_reads(plan: prereg.Plan) -> tuple[str, ...]:
    """The questions (campaign names) whose runs the plan's cells name, its own first."""
    homes = {c for fam in plan.families for cell in fam.cells
             for c in prereg.cell_campaigns(cell)}
    return (plan.campaign, *sorted(homes - {plan.campaign}))


def in_plan(plan: prereg.Plan, runs: pd.DataFrame) -> pd.DataFrame:
    """Runs that fall in some cell of the plan (any seed), in its main or smoke campaigns."""
    if runs.empty:
        return runs
    plans = [plan]
    smoke = smoke_plan(plan, set(runs["campaign"].astype(str)))
    if smoke is not None:
        plans.append(smoke)
    ids: set[str] = set()
    for each in plans:
        for fam in each.families:
            ids |= set(relaxed_match(each, fam, runs)[0].get("run_id", []))
    return runs[runs["run_id"].isin(ids)].copy()


def _by_campaign(runset: RunSet) -> RunSet:
    """The run set with campaign in the duplicate key, so that runs whose cells differ only
    by campaign (a workload named by its campaign, e.g. traces_conversation) are not set
    aside as duplicates of each other."""
    every = pd.concat([runset.runs, runset.set_aside], ignore_index=True)
    ordered = every.sort_values(["created_at", "run_id"], kind="stable")
    extra = ordered.duplicated(["campaign", "cell", "seed"], keep="first")
    return RunSet(runset.questions, runset.campaigns, ordered[~extra].reset_index(drop=True),
                  ordered[extra].reset_index(drop=True))


def begin_plan(con, question: str, title: str, plan_dir=None, per_campaign: bool = False
               ) -> tuple[QuestionResult, RunSet, prereg.Plan]:
    """`begin` over the campaigns the question's plan names, restricted to its cells
    (`per_campaign`: campaign in the duplicate key, `_by_campaign`)."""
    plan = load_plan(question, plan_dir)
    reads = plan_reads(plan)
    runset = load_runs(con, reads)
    runset = _by_campaign(runset) if per_campaign else runset
    kept = in_plan(plan, runset.runs)
    runset = RunSet(runset.questions, tuple(sorted(kept["campaign"].unique())), kept,
                    runset.set_aside)
    result = QuestionResult(question, title, runset.questions, runset.campaigns, len(kept))
    result.notes += runset.notes()
    if runset.empty:
        result.sections.append(no_data_section(question, runset.questions))
    else:
        result.add("runs", run_frame(kept))
    return result, runset, plan


def plan_analyzer(question: str, title: str, fill, borrow: tuple | None = None):
    """The `analyze(con, *, plan_dir=None, allow_changed_plan=False)` of a question page
    over its plan: `begin_plan`, then `fill(result, plan, runs, con)` when the plan's
    campaigns hold runs, the plan's families attached, then the rows `borrow` names
    (another question, its experiment, the rows: `borrow_rows`)."""

    def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
        result, runset, plan = begin_plan(con, question, title, plan_dir)
        if not runset.runs.empty:
            fill(result, plan, runset.runs, con)
        attach_families(result, runset.all_runs, question, plan_dir, allow_changed_plan)
        if borrow is not None:
            borrow_rows(result, con, *borrow, plan_dir, allow_changed_plan)
        return result

    return analyze


def run_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """The per-run CSV table: identity, design, readouts and provenance columns."""
    return runs[[c for c in RUN_COLUMNS if c in runs]]


def load_plan(name: str, plan_dir: str | Path | None = None) -> prereg.Plan:
    """prereg.load_plan, cached while the plan file is unchanged (one report loads each often)."""
    path = Path(plan_dir or prereg.PLAN_DIR) / f"{name}.yaml"
    stat = path.stat() if path.is_file() else None
    return _cached_plan(str(path.resolve()), stat and (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=64)
def _cached_plan(path: str, _version) -> prereg.Plan:
    return prereg.load_plan(path)


def attach_families(result: QuestionResult, runs: pd.DataFrame, plan_name: str,
                    plan_dir: str | Path | None, allow_changed_plan: bool,
                    only: Sequence[str] | None = None) -> list:
    """Evaluate the plan's families (or those named in `only`) and attach them."""
    plan = load_plan(plan_name, plan_dir)
    families = evaluate_plan(plan, runs, allow_changed_plan=allow_changed_plan, only=only)
    result.families += families
    return families


def throughput_section(result: QuestionResult, runs: pd.DataFrame,
                       title: str = "Throughput and latency by cell") -> pd.DataFrame:
    cells = result.add("cells", cell_summary(runs))
    if cells.empty:
        return cells
    text = ("Throughput in output tokens/s: arithmetic mean (`_mean`) and geometric mean "
            "(`_geomean`) of run values over seeds; ledger timebase primary, request span "
            "sensitivity. TTFT/E2E p99 (s) are means of run-level p99s, never pooled.")
    columns = ["cell", "n", "seeds", "throughput_ledger_mean", "throughput_ledger_geomean",
               "throughput_span_mean", "throughput_span_geomean", "ttft_p99_mean",
               "e2e_p99_mean"]
    result.sections.append(Section(title, text, [("", cells, columns)]))
    return cells


MEAN_SEEDWISE_TEXT = ("Paired by seed within each condition. Throughput effects are the mean "
                      "of seedwise percent changes 100 (T/C - 1) (AMBIGUOUS A7: one statistic) "
                      "with the 95% paired-t interval of the mean log ratio d = ln(T/C), "
                      "back-transformed. `p_exact` is the unadjusted exact two-sided sign-flip "
                      "p of d.")


def changes_section(result: QuestionResult, runs: pd.DataFrame, name: str, title: str,
                    metrics: Sequence[str], pairs: Sequence[tuple], vary: str = "org",
                    ignore: Sequence[str] | None = None,
                    effect: str = "back_transformed") -> pd.DataFrame:
    """Paired changes for each metric; frames `<name>` and `<name>_seeds` (per-seed d).

    `effect="mean_seedwise"` reports one statistic for log-scale metrics: the mean seedwise
    percent change as `effect` (no second display column), as Q8's reading A7 says.
    """
    tables, seeds = [], []
    for metric in metrics:
        table, per_seed = paired_changes(runs, metric, pairs, vary=vary, ignore=ignore)
        if table.empty:
            continue
        tables.append(table)
        seeds.append(per_seed.assign(metric=metric))
    if not tables:
        result.sections.append(Section(title, f"No data for {title.lower()}: no condition "
                                              "holds both arms of a comparison."))
        return pd.DataFrame()
    frame = pd.concat(tables, ignore_index=True)
    columns, text = list(CHANGE_COLUMNS), CHANGE_TEXT
    if effect == "mean_seedwise":
        logs = frame["metric"].map(lambda m: METRICS[m].scale == "log")
        frame.loc[logs, "effect"] = frame.loc[logs, "display_mean_pct"]
        frame = frame.drop(columns="display_mean_pct")
        columns.remove("display_mean_pct")
        text = MEAN_SEEDWISE_TEXT
    frame = result.add(name, frame)
    result.add(f"{name}_seeds", pd.concat(seeds, ignore_index=True))
    section = Section(title, text)
    for metric in metrics:
        part = frame[frame["metric"] == metric]
        if not part.empty:
            caption = f"{METRICS[metric].label} [{metric}]"
            section.tables.append((caption, part, columns))
    result.sections.append(section)
    return frame


def borrow_rows(result: QuestionResult, con, plan_name: str, family: str,
                tests: Sequence[str], plan_dir, allow_changed_plan: bool) -> list:
    """Show some rows of another plan's family (decided there, over all its tests).

    EXT-22 decides the Q3, Q4 and split contrasts: their pages show its rows with the
    p-values adjusted over all 22, never a second decision.
    """
    plan = load_plan(plan_name, plan_dir)
    runset = load_runs(con, plan_reads(plan))
    families = evaluate_plan(plan, runset.all_runs, allow_changed_plan=allow_changed_plan,
                             only=(family,))
    for fam in families:
        m = fam.m
        fam.tables = {k: v[v["test"].isin(tests)].reset_index(drop=True)
                      for k, v in fam.tables.items()}
        fam.per_seed = (fam.per_seed[fam.per_seed["test"].isin(tests)]
                        if len(fam.per_seed) else fam.per_seed)
        fam.description = (f"Rows {', '.join(tests)} of family {family} "
                           f"(conf/prereg/{plan_name}.yaml), decided there: Holm over all "
                           f"{m or 'its'} tests. " + fam.description)
    result.families += families
    return families


def family_runs(plan: prereg.Plan, name: str, runs: pd.DataFrame) -> pd.DataFrame:
    """Runs in the cells of one family of the plan (any seed; main and smoke stages), with
    the family's `cell_id`."""
    if runs.empty:
        return runs.assign(cell_id=pd.Series(dtype=object))
    parts = [relaxed_match(plan, plan.family(name), runs)[0]]
    smoke = smoke_plan(plan, set(runs["campaign"].astype(str)))
    if smoke is not None and any(f.name == name + SMOKE_TAG for f in smoke.families):
        parts.append(relaxed_match(smoke, smoke.family(name + SMOKE_TAG), runs)[0])
    found = pd.concat([p for p in parts if len(p)], ignore_index=True) if any(
        len(p) for p in parts) else runs.head(0).assign(cell_id=pd.Series(dtype=object))
    return found.drop_duplicates("run_id").reset_index(drop=True)


def planned_runs(plan: prereg.Plan, name: str, runs: pd.DataFrame) -> pd.DataFrame:
    """`family_runs` with main-stage runs kept only at their cell's planned seeds (a cell
    another family extends to more seeds, e.g. Q5's curve cells in the common six, keeps its
    own seed set; smoke-stage runs are kept as collected)."""
    found = family_runs(plan, name, runs)
    if found.empty:
        return found
    seeds = {c.id: {int(s) for s in c.seeds} for c in plan.family(name).cells}
    planned = [int(s) in seeds.get(c, ()) for c, s in zip(found["cell_id"], found["seed"],
                                                          strict=True)]
    keep = (found["stage"] != "main").to_numpy() | np.array(planned, dtype=bool)
    return found[keep].reset_index(drop=True)


def means_table(runs: pd.DataFrame, by: Sequence[str], metrics: Sequence[str],
                ranges: Sequence[str] = ()) -> pd.DataFrame:
    """Arithmetic means over runs per group (docs/statistics.md section 2.5), n seeds, and
    min-max ranges across runs of the `ranges` metrics (e.g. the waiting gauge's run
    maxima)."""
    if runs.empty:
        return pd.DataFrame()
    rows = []
    keys = ["stage", *by]
    for values, group in runs.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, values, strict=True))
        row["n"] = int(group["seed"].nunique())
        row.update({m: float(group[m].astype(float).mean()) for m in metrics if m in group})
        for m in ranges:
            row[f"{m}_range"] = f"{group[m].min():g}-{group[m].max():g}"
        rows.append(row)
    table = pd.DataFrame(rows)
    order = {o: i for i, o in enumerate(ORG_ORDER)}
    rank = {"budget": budget_rank, "org": lambda o: order.get(o, len(order))}
    sort = [c for c in keys if c in ("stage", "budget", "org", "rate", "f", "q", "cap")]
    return table.sort_values(sort, key=lambda s: s.map(rank[s.name]) if s.name in rank else s,
                             kind="stable").reset_index(drop=True)
