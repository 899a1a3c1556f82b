"""The server's records on disk: one Parquet file per engine table and a summary.

Written once at shutdown, each file atomically (temp, then rename), the summary
last: a folder without `summary.json` holds no complete records. Times are on the
engine's clock (seconds since the engine started); `summary.json` carries that
clock's reading at the end so a client can map the times onto its own clock.

The column types are the ledger's (serving_core does not import ledgers): the records are
written through a port, a `RecordWriter` named on the server's command line
(`--records-writer MODULE:FUNCTION`, `load_writer`); the launchers in experiments/ name
`experiments.runners.server_process:write_server_records`, which calls `write_records`
with the ledger's engine schemas.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

RECORD_TABLES = ("requests", "poller", "trace", "slab", "steps")
SUMMARY_FILE = "summary.json"
# (folder, tables, summary) -> the folder written
RecordWriter = Callable[[str | os.PathLike, dict[str, dict[str, list]], dict], Path]


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_records(folder: str | os.PathLike, tables: dict[str, dict[str, list]],
                  summary: dict, schemas: Mapping[str, pa.Schema]) -> Path:
    """Write every table (empty ones too, so readers see the schema) under its schema in
    `schemas` (table name -> Arrow schema), then the summary."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name in RECORD_TABLES:
        table = pa.Table.from_pydict(tables[name], schema=schemas[name])
        _atomic(out / f"{name}.parquet", lambda p, t=table: pq.write_table(t, p))
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v)
             for k, v in summary.items()}
    _atomic(out / SUMMARY_FILE, lambda p: p.write_text(json.dumps(clean, indent=1, default=str)))
    return out


def load_writer(name: str) -> RecordWriter:
    """The RecordWriter `MODULE:FUNCTION` names; ValueError names what is wrong."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"--records-writer={name!r}: allowed values are MODULE:FUNCTION")
    try:
        writer = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--records-writer={name!r}: cannot load ({err})") from None
    if not callable(writer):
        raise ValueError(f"--records-writer={name!r}: not a function")
    return writer


def read_records(folder: str | os.PathLike) -> tuple[dict[str, dict[str, list]], dict]:
    """Tables and summary written by `write_records`; ValueError when incomplete."""
    src = Path(folder)
    if not (src / SUMMARY_FILE).is_file():
        raise ValueError(f"server records in {str(src)!r} are incomplete (no {SUMMARY_FILE})")
    tables = {name: pq.read_table(src / f"{name}.parquet").to_pydict() for name in RECORD_TABLES}
    summary = json.loads((src / SUMMARY_FILE).read_text())
    return tables, summary
