"""Audit a ledger root: `.venv/bin/python -m ledgers.check ROOT`.

Exit 0 when clean, 1 when any problem is found or ROOT holds no ledger file
(reported as EMPTY), 2 when ROOT does not exist.
Problems: unreadable files (each named, with why), complete runs whose files
are missing or damaged (presence, Parquet probe, size, sha256 and row count
against the runs row's file record), incomplete runs, traced runs whose END is missing or not last,
trace sequence gaps, dropped or write-error counts, requests whose hit attribution
does not add up (ideal = adopted + losses, no loss negative), duplicate complete run
ids, orphan and mislabeled rows, adoption keys without exactly one adopted
run, study files (ledgers.studies) that do not read or whose schema is not
their table's. A run is identified by (campaign, run_id). Notes (never failing):
superseded attempts of runs that later completed, run ids complete in several
campaigns (distinct runs, each counted in its own campaign), stale temp files
left by a killed writer, complete runs written without a file record, Parquet
files outside the ledger layout (read by no view).
A later campaign (or single run) moves damaged files to <ROOT>/quarantine/ and
redoes their runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from ledgers.catalog import LedgerWarning, create_views
from ledgers.commands import module_command
from ledgers.integrity import LedgerScan, damage_lines, stray_files
from ledgers.schemas import ATTRIBUTION_COLUMNS, TABLES
from ledgers.studies import check_studies, study_files
from ledgers.writer import ADOPTION_KEY, TEMP_SUFFIX, attempt_run_id

MAX_LISTED = 20  # detail lines printed per category


@dataclass
class CheckReport:
    """Findings per category; `problems` fail the check, `notes` do not."""

    root: str
    num_complete_runs: int = 0
    num_files: int = 0
    problems: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.num_files == 0

    @property
    def ok(self) -> bool:
        return not any(self.problems.values()) and not self.empty


PROBLEMS = (
    "unreadable files",
    "complete runs with missing or damaged files",
    "incomplete runs",
    "traced runs without a final END",
    "trace sequence gaps",
    "dropped or write-error counts",
    "duplicate run ids among complete runs",
    "orphan rows",
    "mislabeled rows",
    "adoption keys without exactly one adopted run",
    "study files with a wrong schema",
    "requests whose hit attribution does not add up",
)
NOTES = ("superseded attempts", "run ids complete in several campaigns", "stale temp files",
         "complete runs without a file record", "Parquet files outside the ledger layout")


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    return con.execute(sql).fetchall()


def _materialize(con: duckdb.DuckDBPyConnection) -> None:
    """Bind each view once (union_by_name reads every footer); audits query these tables."""
    con.execute("CREATE TEMP TABLE c_raw_runs AS SELECT * FROM raw_runs")
    con.execute(
        "CREATE TEMP TABLE c_runs AS SELECT * EXCLUDE (attempt) FROM c_raw_runs"
        " WHERE attempt IN (SELECT attempt FROM canonical_attempts)"
    )
    con.execute(
        "CREATE TEMP TABLE c_trace AS"
        " SELECT run_id, campaign, seq, event, dropped, write_errors FROM trace"
    )
    keys = " UNION ALL ".join(
        f"SELECT '{t}' AS tbl, run_id, campaign, attempt, count(*) AS n"
        f" FROM {'c_raw_runs' if t == 'runs' else f'raw_{t}'} GROUP BY ALL"
        for t in TABLES
    )
    con.execute(f"CREATE TEMP TABLE c_raw_keys AS {keys}")


def _attempt_files(scan: LedgerScan) -> dict[str, tuple[str, list[str]]]:
    """attempt -> (campaign, tables holding a readable file of it), damaged attempts left
    out (they have their own category), from file names only."""
    found: dict[str, tuple[str, list[str]]] = {}
    for table in TABLES:
        for path in scan.readable.get(table, []):
            if path.stem not in scan.damaged:
                campaign = path.parent.name.removeprefix("campaign=")
                found.setdefault(path.stem, (campaign, []))[1].append(table)
    return found


def _incomplete_and_superseded(con, scan: LedgerScan) -> tuple[list[str], list[str]]:
    complete = set(_rows(con, "SELECT campaign, run_id FROM canonical_attempts"))
    canonical = {r[0] for r in _rows(con, "SELECT attempt FROM canonical_attempts")}
    status = dict(_rows(con, "SELECT attempt, status FROM c_raw_runs"))
    by_run: dict[tuple[str, str], list[str]] = defaultdict(list)
    superseded = []
    for attempt, (campaign, tables) in sorted(_attempt_files(scan).items()):
        run = (campaign, attempt_run_id(attempt))
        state = f"runs row says {status[attempt]}" if attempt in status else "no runs row"
        line = f"attempt {attempt}: {state}; files: {', '.join(tables)}"
        if run not in complete:
            by_run[run].append(line)
        elif attempt not in canonical:
            superseded.append(f"run {run[1]} (campaign {campaign}): {line}")
    incomplete = [
        f"run {run_id} (campaign {campaign}): {'; '.join(lines)}"
        for (campaign, run_id), lines in sorted(by_run.items())
    ]
    return incomplete, superseded


def _trace_end(con) -> list[str]:
    sql = """
        SELECT r.campaign, r.run_id, count(t.seq), count(*) FILTER (t.event = 'END'),
               max(t.seq), max(t.seq) FILTER (t.event = 'END')
        FROM c_runs r LEFT JOIN c_trace t USING (campaign, run_id)
        WHERE r.trace GROUP BY ALL ORDER BY ALL"""
    out = []
    for campaign, run_id, n, n_end, max_seq, end_seq in _rows(con, sql):
        if n_end == 1 and end_seq == max_seq:
            continue
        if n_end == 0:
            why = f"no END among {n} trace events"
        elif n_end > 1:
            why = f"{n_end} END records"
        else:
            why = f"END at seq {end_seq} is not last (max seq {max_seq})"
        out.append(f"run {run_id} (campaign {campaign}): {why}")
    return out


def _trace_gaps(con) -> list[str]:
    sql = """
        WITH d AS (SELECT DISTINCT campaign, run_id, seq FROM c_trace),
        g AS (SELECT campaign, run_id, seq,
                     lead(seq) OVER (PARTITION BY campaign, run_id ORDER BY seq) AS nxt FROM d),
        first_gap AS (
            SELECT campaign, run_id, min(seq) AS min_seq, max(seq) AS max_seq,
                   count(*) AS n_distinct, min(seq + 1) FILTER (nxt > seq + 1) AS gap_at
            FROM g GROUP BY ALL),
        counts AS (SELECT campaign, run_id, count(*) AS n FROM c_trace GROUP BY ALL)
        SELECT campaign, run_id, n, n_distinct, min_seq, max_seq, gap_at
        FROM first_gap JOIN counts USING (campaign, run_id)
        WHERE min_seq != 0 OR max_seq != n - 1 OR n_distinct != n
        ORDER BY ALL"""
    out = []
    for campaign, run_id, n, n_distinct, min_seq, max_seq, gap_at in _rows(con, sql):
        missing = max_seq + 1 - n_distinct
        first = 0 if min_seq > 0 else gap_at
        parts = [f"{n} events, seq {min_seq}..{max_seq}"]
        if missing:
            parts.append(f"{missing} missing (first {first})")
        if n > n_distinct:
            parts.append(f"{n - n_distinct} duplicated")
        out.append(f"run {run_id} (campaign {campaign}): {', '.join(parts)}")
    return out


def _trace_losses(con) -> list[str]:
    sql = """
        SELECT campaign, run_id, sum(dropped), sum(write_errors) FROM c_trace GROUP BY ALL
        HAVING sum(dropped) != 0 OR sum(write_errors) != 0 ORDER BY ALL"""
    return [
        f"run {run_id} (campaign {campaign}): dropped {dropped}, write errors {errors}"
        for campaign, run_id, dropped, errors in _rows(con, sql)
    ]


def _attribution(con) -> list[str]:
    """Requests of complete runs breaking ideal = adopted + the losses, or with a negative
    loss (schemas.WORKLOAD_COLUMNS; -1 or NULL ideal: not attributed)."""
    losses = [c for c in ATTRIBUTION_COLUMNS if c.startswith("lost_")]
    total = " + ".join(["adopted_prefix_tokens", *losses])
    sql = f"""
        SELECT campaign, run_id, request_id, ideal_prefix_tokens, {total}
        FROM requests WHERE ideal_prefix_tokens >= 0
          AND (ideal_prefix_tokens != {total} OR least({", ".join(losses)}) < 0)
        ORDER BY ALL"""
    return [f"run {run_id} (campaign {campaign}) request {rid}: ideal {ideal} != adopted + "
            f"losses {total}" for campaign, run_id, rid, ideal, total in _rows(con, sql)]


def _duplicates(con) -> list[str]:
    sql = """
        SELECT campaign, run_id, count(*), string_agg(attempt, ', ' ORDER BY attempt)
        FROM c_raw_runs WHERE status = 'complete' GROUP BY ALL HAVING count(*) > 1
        ORDER BY ALL"""
    return [
        f"run {run_id} (campaign {campaign}): {n} complete attempts: {attempts}"
        for campaign, run_id, n, attempts in _rows(con, sql)
    ]


def _shared_across_campaigns(con) -> list[str]:
    sql = """
        SELECT run_id, string_agg(campaign, ', ' ORDER BY campaign) FROM c_runs
        GROUP BY run_id HAVING count(DISTINCT campaign) > 1 ORDER BY run_id"""
    return [f"run {run_id}: complete in campaigns {c}" for run_id, c in _rows(con, sql)]


def _orphans_and_mislabeled(con) -> tuple[list[str], list[str]]:
    orphan_sql = """
        SELECT tbl, campaign, run_id, sum(n) FROM c_raw_keys k
        WHERE tbl != 'runs' AND NOT EXISTS (
            SELECT 1 FROM c_raw_runs r WHERE r.campaign = k.campaign AND r.run_id = k.run_id)
        GROUP BY ALL ORDER BY ALL"""
    orphans = [
        f"{table}: {n} rows of run {run_id} (campaign {campaign}) have no runs row"
        for table, campaign, run_id, n in _rows(con, orphan_sql)
    ]
    mislabeled_sql = """
        SELECT tbl, attempt, campaign, run_id, sum(n) FROM c_raw_keys
        WHERE NOT starts_with(attempt, run_id || '-') GROUP BY ALL ORDER BY ALL"""
    mislabeled = [
        f"{table}: {n} rows say run {run_id} inside file {attempt} (campaign {campaign})"
        for table, attempt, campaign, run_id, n in _rows(con, mislabeled_sql)
    ]
    return orphans, mislabeled


def _adoption(con) -> list[str]:
    key = ", ".join(ADOPTION_KEY)
    sql = f"""
        SELECT {key}, count(*), count(*) FILTER (adopted),
               string_agg(run_id, ', ' ORDER BY run_id) FILTER (adopted)
        FROM c_runs GROUP BY {key} HAVING count(*) FILTER (adopted) != 1 ORDER BY ALL"""
    out = []
    for *values, n, n_adopted, adopted in _rows(con, sql):
        cell = ", ".join(f"{k}={v}" for k, v in zip(ADOPTION_KEY, values, strict=True))
        which = f": {adopted}" if adopted else ""
        out.append(f"{cell}: {n} complete runs, {n_adopted} adopted{which}")
    return out


def _stale_temp_files(root: str) -> list[str]:
    return [str(p) for p in sorted(Path(root).rglob(f".*{TEMP_SUFFIX}"))]


def check(root: str | os.PathLike) -> CheckReport:
    """Run every audit over the ledger root (checksums included)."""
    root = str(root)
    report = CheckReport(root=root)
    con = duckdb.connect()
    con.execute("SET parquet_metadata_cache = true")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerWarning)  # reported below, file by file
            scan = create_views(con, root, deep=True)
        report.num_files = scan.num_files + len(study_files(root))
        _materialize(con)
        report.num_complete_runs = _rows(con, "SELECT count(*) FROM c_runs")[0][0]
        incomplete, superseded = _incomplete_and_superseded(con, scan)
        orphans, mislabeled = _orphans_and_mislabeled(con)
        shared = _shared_across_campaigns(con)
        unreadable, damaged = damage_lines(scan)
        by_attempt = {r["attempt"]: r for r in scan.runs}
        unrecorded = [f"run {by_attempt[a]['run_id']} (campaign {by_attempt[a]['campaign']}, "
                      f"attempt {a})" for a in sorted(scan.unrecorded)]
        found = (
            unreadable,
            damaged,
            incomplete,
            _trace_end(con),
            _trace_gaps(con),
            _trace_losses(con),
            _duplicates(con),
            orphans,
            mislabeled,
            _adoption(con),
            check_studies(root),
            _attribution(con),
        )
    finally:
        con.close()
    report.problems = dict(zip(PROBLEMS, found, strict=True))
    stray = [str(p) for p in stray_files(root)]
    report.notes = dict(zip(NOTES, (superseded, shared, _stale_temp_files(root), unrecorded,
                                    stray), strict=True))
    return report


def format_report(report: CheckReport) -> str:
    """Readable listing: one line per category, details indented, a summary last."""
    lines = [f"ledger check: {report.root}", f"complete runs: {report.num_complete_runs}"]
    sections = [("FAIL" if v else "ok", k, v) for k, v in report.problems.items()]
    sections += [("note", k, v) for k, v in report.notes.items() if v]
    for label, name, items in sections:
        lines.append(f"[{label}] {name}: {len(items)}")
        lines += [f"    {item}" for item in items[:MAX_LISTED]]
        if len(items) > MAX_LISTED:
            lines.append(f"    ... and {len(items) - MAX_LISTED} more")
    failing = {k: len(v) for k, v in report.problems.items() if v}
    num_notes = sum(len(v) for v in report.notes.values())
    if report.empty:
        lines.append(f"summary: EMPTY, no ledger files under {report.root}")
    elif failing:
        detail = ", ".join(f"{k}: {n}" for k, n in failing.items())
        lines.append(
            f"summary: FAIL, problems found ({detail}); "
            f"{report.num_complete_runs} complete runs, {num_notes} notes"
        )
    else:
        lines.append(f"summary: OK, {report.num_complete_runs} complete runs, {num_notes} notes")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=module_command("ledgers.check"), description=__doc__.split("\n")[0]
    )
    parser.add_argument("root", help="ledger root directory")
    args = parser.parse_args(argv)
    if not Path(args.root).is_dir():
        print(f"error: ledger root={args.root!r}: no such directory", file=sys.stderr)
        return 2
    report = check(args.root)
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
