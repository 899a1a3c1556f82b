"""Parquet ledgers of serving runs: schemas, atomic writer, DuckDB catalog, checker."""

from ledgers.catalog import connect
from ledgers.schemas import ENGINE_SCHEMAS, SCHEMAS, TABLES, to_table
from ledgers.writer import adopt_run, completed_run_ids, write_run

__all__ = [
    "ENGINE_SCHEMAS",
    "SCHEMAS",
    "TABLES",
    "adopt_run",
    "completed_run_ids",
    "connect",
    "to_table",
    "write_run",
]
