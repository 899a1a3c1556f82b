"""Standard readouts shared by the questions: throughput/latency by cell, paired changes.

Each builder adds its CSV frame to the QuestionResult and appends a Markdown
section; the question modules only choose which readouts and comparisons apply.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis import prereg
from analysis.common import DESIGN_COLUMNS, METRICS, RunSet, cell_summary, load_runs
from analysis.families import evaluate_plan
from analysis.paired import paired_changes
from analysis.render import QuestionResult, Section, no_data_section

RUN_COLUMNS = ("run_id", "cell", "seed", *DESIGN_COLUMNS, "throughput_ledger",
               "throughput_span", "ttft_p99", "e2e_p99", "finished_requests",
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
    families = evaluate_plan(plan, runs, allow_changed_plan=allow_changed_plan)
    families = [f for f in families if only is None or f.name in only]
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


def changes_section(result: QuestionResult, runs: pd.DataFrame, name: str, title: str,
                    metrics: Sequence[str], pairs: Sequence[tuple], vary: str = "org",
                    ignore: Sequence[str] | None = None) -> pd.DataFrame:
    """Paired changes for each metric; frames `<name>` and `<name>_seeds` (per-seed d)."""
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
    frame = result.add(name, pd.concat(tables, ignore_index=True))
    result.add(f"{name}_seeds", pd.concat(seeds, ignore_index=True))
    section = Section(title, CHANGE_TEXT)
    for metric in metrics:
        part = frame[frame["metric"] == metric]
        if not part.empty:
            caption = f"{METRICS[metric].label} [{metric}]"
            section.tables.append((caption, part, list(CHANGE_COLUMNS)))
    result.sections.append(section)
    return frame
