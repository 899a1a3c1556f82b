"""Parquet ledgers of serving runs: schemas, atomic writer, DuckDB catalog, checker."""

from ledgers.integrity import completed_run_ids
from ledgers.schemas import ENGINE_SCHEMAS, SCHEMAS, TABLES, to_table
from ledgers.writer import adopt_run, write_run


def __getattr__(name: str):
    """`connect` imports DuckDB on first use: a run that only writes never pays for it."""
    if name == "connect":
        from ledgers.catalog import connect

        return connect
    raise AttributeError(f"module 'ledgers' has no attribute {name!r}")


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
