"""DuckDB catalog: one view per ledger table over the whole ledger root.

raw_<table> views read every committed file found at connect time (hive
partitions, union by name) and add `attempt`, the file's basename stem `<run_id>-<nonce>`. The table
canonical_attempts holds, per (campaign, run_id), the first complete attempt
(ordered by created_at, then attempt). The public views (one per table of
ledgers.schemas.TABLES) keep only rows of canonical attempts: a crashed attempt's
files, failed runs and accidental duplicate attempts never count.

Study tables (ledgers.studies: not runs, one file per study run) get one view each,
named as the table, over every file of it that reads with the table's schema; a file
that does not is skipped with a LedgerWarning (ledgers.check lists it).

canonical_attempts is a snapshot taken at connect time, so one connection sees
one consistent set of runs even while a campaign keeps writing; reconnect (or
call create_views) to refresh. Every view starts from an empty relation typed
by the schema, so columns and types are fixed even for a table with no files.
Everything is TEMP: nothing is stored in a database file passed to connect.

Damage: the views read an explicit list of the files that pass the Parquet
probe (ledgers.integrity); an unreadable file is skipped with a LedgerWarning
naming it, and a complete run whose listed files are missing, unreadable or of
the wrong size is not canonical (a second warning names it and its files).
`connect(root, deep=True)` also compares checksums.

Cost: union_by_name reads every file footer whenever a view is bound, so the
Parquet metadata cache is switched on; for many queries over a large root,
materialize what you need once (CREATE TEMP TABLE ... AS SELECT ...).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import duckdb
import pyarrow as pa

from ledgers.commands import module_command
from ledgers.integrity import LedgerScan, damage_lines, scan_root
from ledgers.schemas import SCHEMAS, TABLES
from ledgers.studies import STUDY_SCHEMAS, readable_study_files
from ledgers.writer import CANONICAL_ORDER

MAX_WARNED = 10  # files or runs named in one warning


class LedgerWarning(UserWarning):
    """Ledger files were skipped (unreadable) or runs not counted (files missing/damaged)."""

_SQL_TYPES = {
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
    pa.bool_(): "BOOLEAN",
}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _typed_columns(schema: pa.Schema) -> str:
    return ", ".join(f'CAST(NULL AS {_SQL_TYPES[f.type]}) AS "{f.name}"' for f in schema)


def _typed_empty(table: str) -> str:
    return (f"SELECT {_typed_columns(SCHEMAS[table])}, CAST(NULL AS VARCHAR) AS attempt"
            " WHERE false")


def _file_list(files: Sequence[Path]) -> str:
    return "[" + ", ".join(_quote(f.resolve().as_posix()) for f in files) + "]"


def raw_sql(table: str, files: Sequence[Path]) -> str:
    """SELECT over the given committed files of `table`, with its attempt column."""
    sql = _typed_empty(table)
    if files:
        sql += (
            " UNION ALL BY NAME SELECT * EXCLUDE (filename),"
            " parse_filename(filename, true) AS attempt"
            f" FROM read_parquet({_file_list(files)}, hive_partitioning = true,"
            " union_by_name = true, filename = true, hive_types = {'campaign': VARCHAR})"
        )
    return sql


def _warn(scan: LedgerScan, num_study_files: int) -> None:
    if not scan.root.is_dir():
        warnings.warn(f"ledger root {scan.root} does not exist: no runs", LedgerWarning,
                      stacklevel=4)
    elif scan.num_files == 0 and num_study_files == 0:
        warnings.warn(f"ledger root {scan.root} is empty: no ledger files", LedgerWarning,
                      stacklevel=4)
    files, runs = damage_lines(scan)
    for what, lines in (("skipped unreadable files", files),
                        ("complete runs not counted, their files are missing or damaged", runs)):
        if lines:
            shown = "; ".join(lines[:MAX_WARNED])
            more = f"; ... and {len(lines) - MAX_WARNED} more" if len(lines) > MAX_WARNED else ""
            warnings.warn(f"ledger root {scan.root}: {len(lines)} {what}: {shown}{more} "
                          f"(details: {module_command('ledgers.check', str(scan.root))})",
                          LedgerWarning, stacklevel=4)


def create_views(con: duckdb.DuckDBPyConnection, root: str | os.PathLike, *,
                 deep: bool = False, campaigns: str | Sequence[str] | None = None) -> LedgerScan:
    """(Re)create the raw_* views, the canonical_attempts snapshot and the public views over
    the readable files of `root` (of `campaigns` only, when given: a reader of a few
    campaigns in a large root probes only their files); warn about skipped files and runs;
    return the scan."""
    scan = scan_root(root, campaigns, deep=deep)
    studies = readable_study_files(scan.root)
    _warn(scan, sum(map(len, studies[0].values())) + len(studies[1]))
    for table in TABLES:
        sql = raw_sql(table, scan.readable.get(table, []))
        con.execute(f"CREATE OR REPLACE TEMP VIEW raw_{table} AS {sql}")
    damaged = sorted(scan.damaged) or [""]
    con.execute(
        "CREATE OR REPLACE TEMP TABLE canonical_attempts AS"
        " SELECT run_id, campaign, attempt FROM raw_runs WHERE status = 'complete'"
        " AND attempt NOT IN (SELECT unnest(?::VARCHAR[]))"
        " QUALIFY row_number() OVER"
        f" (PARTITION BY campaign, run_id ORDER BY {', '.join(CANONICAL_ORDER)}) = 1",
        [damaged],
    )
    for table in TABLES:
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * EXCLUDE (attempt)"
            f" FROM raw_{table} WHERE attempt IN (SELECT attempt FROM canonical_attempts)"
        )
    _study_views(con, scan.root, *studies)
    return scan


def _study_views(con: duckdb.DuckDBPyConnection, root: Path, good: dict[str, list[Path]],
                 bad: dict[Path, str]) -> None:
    """One view per study table over its files that read with the table's schema."""
    for table, schema in STUDY_SCHEMAS.items():
        sql = f"SELECT {_typed_columns(schema)} WHERE false"
        if good[table]:
            sql += f" UNION ALL BY NAME SELECT * FROM read_parquet({_file_list(good[table])})"
        con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS {sql}")
    if bad:
        shown = "; ".join(f"{p}: {why}" for p, why in list(bad.items())[:MAX_WARNED])
        more = f"; ... and {len(bad) - MAX_WARNED} more" if len(bad) > MAX_WARNED else ""
        warnings.warn(f"ledger root {root}: {len(bad)} study files skipped: {shown}{more} "
                      f"(details: {module_command('ledgers.check', str(root))})",
                      LedgerWarning, stacklevel=4)


def connect(root: str | os.PathLike, database: str = ":memory:", *,
            deep: bool = False,
            campaigns: str | Sequence[str] | None = None) -> duckdb.DuckDBPyConnection:
    """DuckDB connection with the ledger views over `root` (which may not exist yet), over
    the runs of `campaigns` only when given."""
    con = duckdb.connect(database)
    con.execute("SET parquet_metadata_cache = true")  # views re-read footers at every bind
    create_views(con, root, deep=deep, campaigns=campaigns)
    return con


__all__ = ["LedgerWarning", "connect", "create_views", "raw_sql"]
