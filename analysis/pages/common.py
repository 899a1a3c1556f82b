"""Shared loading and paired summaries for the per-question analyses (docs/statistics.md).

Everything is read through the DuckDB catalog (`ledgers.connect`): adopted
complete runs serving a set of questions, and run-level readouts computed per run
from the requests, steps and poller views. Latency percentiles are run-level
p99s (linear interpolation over the run's finished requests, as the engine
summary computes them); arm summaries average run-level values, never pooled
requests. A cell is one experimental condition: the design columns plus the
model, executor and pool sizes (which separate D0 pool splits).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pandas as pd

from analysis.inference import stats
from analysis.metrics import (  # noqa: F401 (re-exported)
    DESIGN_COLUMNS,
    IDENTITY_COLUMNS,
    METRICS,
    ORG_NAMES,
    ORG_ORDER,
    ORG_SETTINGS,
    Metric,
    budget_rank,
    seeds_text,
)
from analysis.runset import RUN_IDS_VIEW, RunSet, in_list, query  # noqa: F401 (re-exported)
from ledgers.studies import STUDY_SCHEMAS

T = TypeVar("T")

# ---------------------------------------------------------------------------
# Loading through the catalog
# ---------------------------------------------------------------------------


_REQUEST_METRICS = """
    SELECT run_id,
           quantile_cont(ttft_s, 0.99) FILTER (WHERE status = 'finished' AND NOT isnan(ttft_s))
               AS ttft_p99,
           quantile_cont(e2e_s, 0.99) FILTER (WHERE status = 'finished' AND NOT isnan(e2e_s))
               AS e2e_p99,
           quantile_cont(ttft_s, 0.5) FILTER (WHERE status = 'finished' AND NOT isnan(ttft_s))
               AS ttft_p50,
           quantile_cont(e2e_s, 0.5) FILTER (WHERE status = 'finished' AND NOT isnan(e2e_s))
               AS e2e_p50,
           quantile_cont(tpot_s, 0.99) FILTER (WHERE status = 'finished' AND NOT isnan(tpot_s))
               AS tpot_p99,
           count(*) FILTER (WHERE status = 'finished') AS finished_requests,
           count(*) AS num_requests,
           sum(preemptions) AS preemptions,
           sum(prompt_tokens - adopted_prefix_tokens) FILTER (WHERE NOT isnan(start_s))
               AS c_once_tokens,
           sum(output_tokens) AS request_output_tokens
    FROM requests WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id
"""
_STEP_METRICS = """
    SELECT run_id, sum(prefill_tokens_initial) AS prefill_tokens_initial,
           sum(prefill_tokens_resume) AS prefill_tokens_resume, count(*) AS engine_steps
    FROM steps WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id
"""
# D0 samples two pools per second with the same running/waiting gauges: one value per second.
_POLLER_METRICS = """
    SELECT run_id, avg(running) AS poller_running_mean, avg(waiting) AS poller_waiting_mean,
           median(running) AS running_median, max(running) AS running_max,
           median(waiting) AS waiting_median, max(waiting) AS waiting_max,
           quantile_cont(waiting, 0.99) AS waiting_p99
    FROM (SELECT run_id, t_s, max(running) AS running, max(waiting) AS waiting
          FROM poller WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id, t_s)
    GROUP BY run_id
"""


_RUN_CACHE: dict | None = None  # set while a report runs: one load per set of questions
# Inside `cached_runs()`: the complete adopted runs rows, read from the runs view once per
# connection into this temporary table (a report loads some 30 sets of questions, and each
# read of the view scans every runs file of the ledger again).
_COMPLETE_RUNS = "analysis_complete_runs"
_COMPLETE_RUNS_SQL = "SELECT * FROM runs WHERE status = 'complete' AND adopted"


@contextlib.contextmanager
def cached_runs():
    """Within the block, `load_runs` loads each (connection, questions) once, and the runs
    rows of each connection are read from its ledger once."""
    global _RUN_CACHE
    _RUN_CACHE = {}
    try:
        yield
    finally:
        connections, _RUN_CACHE = _RUN_CACHE.get("connections", {}), None
        for con in filter(None, connections.values()):
            with contextlib.suppress(Exception):  # a connection the caller already closed
                con.execute(f"DROP TABLE IF EXISTS {_COMPLETE_RUNS}")


def _runs_source(con) -> str:
    """Where `_load_runs` reads runs rows: the runs view, or inside `cached_runs()` this
    connection's temporary copy of its complete adopted rows (the same rows and types)."""
    if _RUN_CACHE is None:
        return "runs"
    connections = _RUN_CACHE.setdefault("connections", {})  # kept: their ids stay unique
    if id(con) not in connections:
        try:
            con.execute(f"CREATE OR REPLACE TEMPORARY TABLE {_COMPLETE_RUNS} AS "
                        f"{_COMPLETE_RUNS_SQL}")
        except Exception:  # noqa: BLE001 - a connection that cannot hold one reads the view
            connections[id(con)] = None
        else:
            connections[id(con)] = con
    return "runs" if connections[id(con)] is None else _COMPLETE_RUNS


def once_per_report(con, name: str, compute: Callable[[], T]) -> T:
    """`compute()`, once per (connection, name) inside `cached_runs()`; its later calls get
    what the first returned (callers copy what they change)."""
    if _RUN_CACHE is None:
        return compute()
    key = ("once", id(con), name)
    if key not in _RUN_CACHE:
        _RUN_CACHE[key] = (con, compute())  # the connection kept: its id stays unique
    return _RUN_CACHE[key][1]


def load_runs(con, questions: Sequence[str]) -> RunSet:
    """`_load_runs`, memoized inside `cached_runs()` (the frames are copied out)."""
    if _RUN_CACHE is None:
        return _load_runs(con, questions)
    key = (id(con), tuple(questions))
    if key not in _RUN_CACHE:
        _RUN_CACHE[key] = _load_runs(con, questions)
    runset = _RUN_CACHE[key]
    return RunSet(runset.questions, runset.campaigns, runset.runs.copy(),
                  runset.set_aside.copy())


def _load_runs(con, questions: Sequence[str]) -> RunSet:
    """Adopted complete runs whose `question` is one of `questions`, with readouts and cells.

    Runs of every campaign serving the question count (q1, q1_smoke, demo_q1); the
    collection stage (main, smoke, demo) is a design column, so stages never pool. org is
    upper-cased and reuse lower-cased (the plans compare them that way).
    """
    questions = tuple(questions)
    runs = con.execute(f"SELECT * FROM {_runs_source(con)} WHERE "
                       f"{in_list('question', questions)} AND status = 'complete' AND adopted "
                       "ORDER BY campaign, seed, run_id").df()
    campaigns = tuple(sorted(runs["campaign"].unique()))
    runs["org"] = runs["org"].astype(str).str.strip().str.upper()
    runs["reuse"] = runs["reuse"].astype(str).str.strip().str.lower()
    runs["trace"] = runs["trace"].astype(bool)
    runs["stage"] = runs["campaign"].map(stage_of)
    runs["host_tier_bytes"] = runs["engine_config"].map(host_tier_bytes)
    runs["placement"] = runs["engine_config"].map(placement_of)
    staged = RunSet(questions, campaigns, runs, runs.head(0))
    for sql in (_REQUEST_METRICS, _STEP_METRICS, _POLLER_METRICS):
        metrics = query(con, sql, staged)
        # Readouts are recomputed from the raw tables; the runs row's own copies (written by
        # newer engines) give way, so old and new ledgers are read the same way.
        runs = runs.drop(columns=[c for c in metrics.columns if c != "run_id" and c in runs])
        runs = runs.merge(metrics, on="run_id", how="left")
    runs["prefill_tokens_computed"] = runs["prefill_tokens_initial"] + runs["prefill_tokens_resume"]
    add_work_readouts(runs)
    runs["cell"] = cell_labels(runs)
    ordered = runs.sort_values(["created_at", "run_id"], kind="stable")
    extra = ordered.duplicated(["cell", "seed"], keep="first")
    return RunSet(questions, campaigns, ordered[~extra].sort_index().reset_index(drop=True),
                  ordered[extra].reset_index(drop=True))


def placement_of(engine_config: str) -> str:
    """The checkpoint placement a run's engine ran (its record's `checkpoint_placement`;
    "none": no recurrent state; "": not recorded): the runs' `placement` column."""
    try:
        rules = json.loads(engine_config or "{}")
    except (TypeError, ValueError):
        return ""
    value = rules.get("checkpoint_placement", "")
    return "none" if value is None else str(value)


def host_tier_bytes(engine_config: str) -> int:
    """The host tier capacity a run's engine ran (its record's `host_tier`), -1: none."""
    try:
        tier = json.loads(engine_config or "{}").get("host_tier")
    except (TypeError, ValueError):
        return -1
    return int(tier["capacity_bytes"]) if isinstance(tier, dict) else -1


def add_work_readouts(runs: pd.DataFrame) -> None:
    """H = C_once + output tokens, H/K, and completed requests per request-span second.

    C_once (docs/statistics.md section 2.3) is the sum over admitted requests of prompt
    tokens minus the prefix adopted at their FIRST admission (requests ledger); K is the
    number of engine
    steps (steps ledger rows). The engine counts every step, so K is a step count here.
    """
    runs["h_tokens"] = runs["c_once_tokens"] + runs["request_output_tokens"]
    runs["h_per_k"] = runs["h_tokens"] / runs["engine_steps"]
    span = runs["span_end_s"].astype(float) - runs["span_start_s"].astype(float)
    runs["requests_per_s"] = runs["completed_requests"].astype(float) / span.where(span > 0)


# ---------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------


MAIN_STAGE = "main"


def stage_of(campaign: str) -> str:
    """Collection stage of a campaign: main, smoke (`<c>_smoke`) or demo (`demo_<c>`).

    Runs reused across campaigns pool into one cell (the campaign that collected a run
    is not a condition); stages never pool.
    """
    campaign = str(campaign)
    if campaign.endswith("_smoke"):
        return "smoke"
    return "demo" if campaign.startswith("demo_") else MAIN_STAGE


LABEL_PREFIX = {"retention_k": "K", "pinning_k": "pin K", "d0_attention_fraction": "attn"}


def fmt_value(column: str, value) -> str:
    """Label fragment of one design value ("" for an unset org-specific setting)."""
    if column == "trace":
        return "trace on" if bool(value) else "trace off"
    if column == "stage":
        return "" if value == MAIN_STAGE else str(value)
    if column == "host_tier_bytes":
        return "tier off" if value < 0 else f"tier {value / 2**30:g} GiB"
    if column in ("campaign", "budget", "reuse", "arrival"):
        return str(value)
    if pd.isna(value) or (column in LABEL_PREFIX and float(value) < 0):
        return ""
    return f"{LABEL_PREFIX.get(column, column)} {float(value):g}"


def _units_text(units_detail: str) -> str:
    try:
        units = json.loads(units_detail)
    except (TypeError, ValueError):
        return str(units_detail)
    return ", ".join(f"{k} {v}" for k, v in sorted(units.items()))


def cell_labels(runs: pd.DataFrame) -> pd.Series:
    """Short label per run: org plus the design columns that vary in `runs`.

    Two cells sharing a label (e.g. D0 pool splits) get their pool sizes appended.
    """
    if runs.empty:
        return pd.Series([], dtype=object, index=runs.index)
    per_org = runs.groupby("org")
    varying = [c for c in DESIGN_COLUMNS if c != "org" and (
        per_org[c].nunique(dropna=False).max() > 1
        or (c not in ORG_SETTINGS and runs[c].nunique(dropna=False) > 1))]
    labels = runs.apply(lambda r: " ".join(
        [ORG_NAMES.get(r["org"], r["org"]), *(t for c in varying if (t := fmt_value(c, r[c])))]),
        axis=1)
    identity = runs[list(IDENTITY_COLUMNS)].map(str).agg("|".join, axis=1)
    ambiguous = identity.groupby(labels).transform("nunique") > 1
    labels[ambiguous] = labels[ambiguous] + " [" + runs.loc[ambiguous, "units_detail"].map(
        _units_text) + "]"
    # Same units, different model (e.g. S0 under bf16 and TQ4 KV): name the model.
    ambiguous = identity.groupby(labels).transform("nunique") > 1
    labels[ambiguous] = labels[ambiguous] + " " + runs.loc[ambiguous, "model"].astype(str)
    # issue 44: placements compared within a campaign (an alternative rule's reruns, each in
    # a campaign of its own, keep their labels)
    by_campaign = runs.groupby(["campaign", "org"])["placement"] if "placement" in runs else None
    if by_campaign is not None and (by_campaign.nunique(dropna=False) > 1).any():
        labels = labels + " " + runs["placement"].astype(str)
    return labels


def org_rank(org: str) -> int:
    return ORG_ORDER.index(org) if org in ORG_ORDER else len(ORG_ORDER)


def cell_order(runs: pd.DataFrame) -> list[str]:
    """Cells sorted by the design columns (org last within a condition)."""
    if runs.empty:
        return []
    first = runs.drop_duplicates("cell").copy()
    first["_org"] = first["org"].map(org_rank)
    keys = [c for c in DESIGN_COLUMNS if c not in ("org", "budget")]
    first["_budget"] = first["budget"].map(budget_rank)
    return first.sort_values(["_budget", *keys, "_org", "cell"])["cell"].tolist()


def cell_summary(runs: pd.DataFrame, metrics: Sequence[str] = (
        "throughput_ledger", "throughput_span", "ttft_p99", "e2e_p99")) -> pd.DataFrame:
    """One row per cell: design columns, seeds, and per metric the mean of run values.

    Throughput metrics also get the geometric mean (docs/statistics.md section 2.5).
    """
    rows = []
    for cell in cell_order(runs):
        group = runs[runs["cell"] == cell]
        row = {"cell": cell, **{c: group[c].iloc[0] for c in DESIGN_COLUMNS},
               "n": len(group), "seeds": seeds_text(group["seed"])}
        for name in metrics:
            values = group[name].astype(float)
            row[f"{name}_mean"] = float(values.mean())
            if name.startswith("throughput"):
                row[f"{name}_geomean"] = _geomean(values)
        rows.append(row)
    return pd.DataFrame(rows)


def _geomean(values: pd.Series) -> float:
    values = values.dropna()
    if values.empty or (values <= 0).any():
        return math.nan
    return stats.geometric_mean(values.to_numpy())


def latest_study(con, table: str) -> pd.DataFrame:
    """Rows of the newest study run (greatest `study_id`: its UTC start time) of a study
    table (ledgers.studies), in the order written; empty when the table has none."""
    if table not in STUDY_SCHEMAS:
        raise ValueError(f"study table {table!r}: allowed values are {', '.join(STUDY_SCHEMAS)}")
    return con.execute(f"SELECT * FROM {table} WHERE study_id = "
                       f"(SELECT max(study_id) FROM {table})").df()


def write_study_page(con, out: Path, table: str, page: str, render, summarize
                     ) -> tuple[Path, dict] | None:
    """Write `page` = render(rows) of the newest study run of `table` into `out`; its path
    and summarize(rows), None when the table is empty."""
    rows = latest_study(con, table)
    if rows.empty:
        return None
    path = Path(out) / page
    path.write_text(render(rows), encoding="utf-8")
    return path, summarize(rows)


def write_tables(out: Path, prefix: str, tables) -> list[Path]:
    """Each (name, frame) of `tables` as out/tables/<prefix>_<name>.csv; the paths written."""
    paths = []
    for name, frame in tables.items():
        path = Path(out) / "tables" / f"{prefix}_{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(path, index=False)
        paths.append(path)
    return paths
