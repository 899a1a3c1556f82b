"""The server's records on disk: one Parquet file per engine table and a summary.

Written once at shutdown, each file atomically (temp, then rename), the summary
last: a folder without `summary.json` holds no complete records. Times are on the
engine's clock (seconds since the engine started); `summary.json` carries that
clock's reading at the end so a client can map the times onto its own clock.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ledgers.schemas import ENGINE_SCHEMAS

RECORD_TABLES = ("requests", "poller", "trace", "slab", "steps")
SUMMARY_FILE = "summary.json"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_records(folder: str | os.PathLike, tables: dict[str, dict[str, list]],
                  summary: dict) -> Path:
    """Write every table (empty ones too, so readers see the schema) then the summary."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name in RECORD_TABLES:
        table = pa.Table.from_pydict(tables[name], schema=ENGINE_SCHEMAS[name])
        _atomic(out / f"{name}.parquet", lambda p, t=table: pq.write_table(t, p))
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v)
             for k, v in summary.items()}
    _atomic(out / SUMMARY_FILE, lambda p: p.write_text(json.dumps(clean, indent=1, default=str)))
    return out


def read_records(folder: str | os.PathLike) -> tuple[dict[str, dict[str, list]], dict]:
    """Tables and summary written by `write_records`; ValueError when incomplete."""
    src = Path(folder)
    if not (src / SUMMARY_FILE).is_file():
        raise ValueError(f"server records in {str(src)!r} are incomplete (no {SUMMARY_FILE})")
    tables = {name: pq.read_table(src / f"{name}.parquet").to_pydict() for name in RECORD_TABLES}
    summary = json.loads((src / SUMMARY_FILE).read_text())
    return tables, summary
