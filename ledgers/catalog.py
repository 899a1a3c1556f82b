"""DuckDB catalog: one view per ledger table over the whole ledger root.

raw_<table> views read every committed file (hive partitions, union by name)
and add `attempt`, the file's basename stem `<run_id>-<nonce>`. The table
canonical_attempts holds, per (campaign, run_id), the first complete attempt
(ordered by created_at, then attempt). The public views runs, requests, poller, trace,
slab and steps keep only rows of canonical attempts: a crashed attempt's
files, failed runs and accidental duplicate attempts never count.

canonical_attempts is a snapshot taken at connect time, so one connection sees
one consistent set of runs even while a campaign keeps writing; reconnect (or
call create_views) to refresh. Every view starts from an empty relation typed
by the schema, so columns and types are fixed even for a table with no files.
Everything is TEMP: nothing is stored in a database file passed to connect.

Cost: union_by_name reads every file footer whenever a view is bound, so the
Parquet metadata cache is switched on; for many queries over a large root,
materialize what you need once (CREATE TEMP TABLE ... AS SELECT ...).
"""

from __future__ import annotations

import os

import duckdb
import pyarrow as pa

from ledgers.schemas import SCHEMAS, TABLES
from ledgers.writer import CANONICAL_ORDER, committed_files, table_glob

_SQL_TYPES = {
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.string(): "VARCHAR",
    pa.bool_(): "BOOLEAN",
}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _typed_empty(table: str) -> str:
    columns = [f'CAST(NULL AS {_SQL_TYPES[f.type]}) AS "{f.name}"' for f in SCHEMAS[table]]
    return f"SELECT {', '.join(columns)}, CAST(NULL AS VARCHAR) AS attempt WHERE false"


def raw_sql(root: str | os.PathLike, table: str) -> str:
    """SELECT over every committed file of `table`, with its attempt column."""
    sql = _typed_empty(table)
    if committed_files(root, table):
        sql += (
            " UNION ALL BY NAME SELECT * EXCLUDE (filename),"
            " parse_filename(filename, true) AS attempt"
            f" FROM read_parquet({_quote(table_glob(root, table))}, hive_partitioning = true,"
            " union_by_name = true, filename = true, hive_types = {'campaign': VARCHAR})"
        )
    return sql


def create_views(con: duckdb.DuckDBPyConnection, root: str | os.PathLike) -> None:
    """(Re)create the raw_* views, the canonical_attempts snapshot and the public views."""
    for table in TABLES:
        con.execute(f"CREATE OR REPLACE TEMP VIEW raw_{table} AS {raw_sql(root, table)}")
    con.execute(
        "CREATE OR REPLACE TEMP TABLE canonical_attempts AS"
        " SELECT run_id, campaign, attempt FROM raw_runs WHERE status = 'complete'"
        " QUALIFY row_number() OVER"
        f" (PARTITION BY campaign, run_id ORDER BY {', '.join(CANONICAL_ORDER)}) = 1"
    )
    for table in TABLES:
        con.execute(
            f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * EXCLUDE (attempt)"
            f" FROM raw_{table} WHERE attempt IN (SELECT attempt FROM canonical_attempts)"
        )


def connect(root: str | os.PathLike, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
    """DuckDB connection with the ledger views over `root` (which may not exist yet)."""
    con = duckdb.connect(database)
    con.execute("SET parquet_metadata_cache = true")  # views re-read footers at every bind
    create_views(con, root)
    return con


__all__ = ["connect", "create_views", "raw_sql"]
