"""Persist one run's ledger tables, atomically, with the runs row last.

Layout: `<root>/<table>/campaign=<c>/<run_id>-<nonce>.parquet`. One write of a
run (an *attempt*) gives every file it writes the same basename stem
`<run_id>-<nonce>`; the nonce is fresh per attempt, so a rerun never collides
with or overwrites an earlier attempt's files. A table file only counts when
the runs row of its own attempt says complete (see ledgers.catalog), so the
leftovers of a crashed attempt never count, even after the run_id completes.

Files are written with `pq.write_table` to `.<basename>.tmp` in the target
directory, fsynced, then `os.replace`d. `pyarrow.dataset.write_dataset` is not
used: it writes in place (no temp-then-rename), and with one campaign per run
its partitioning buys nothing; we write the hive path ourselves. The temp name
starts with a dot (pyarrow.dataset skips it) and does not end in `.parquet`
(the catalog's glob), so no reader ever sees a half-written file.

Adoption: for each (campaign, config_hash, seed) key exactly one complete run
is adopted for analysis. The writer decides at write time: the first complete
run of a key is adopted, and any later complete run of that key (a deliberate
replicate, or an accidental duplicate) is written with adopted=false, so adding
replicates never silently changes what is analysed. `adopt_run` moves the
adoption explicitly by rewriting the runs rows of that key.

Integrity: the runs row lists every table file of its attempt with its row
count, size and sha256 (column `files`), so a file deleted, truncated or
overwritten later is detected (ledgers.integrity) and its run stops counting.
The table files are fsynced one by one and their directories once each, all
before the runs row is written: the row never commits a file not yet durable.
`HSL_LEDGER_SYNC=off` (the test suite's setting, tests/conftest.py) skips the fsyncs and
keeps the temp-then-rename, so a killed process still leaves only complete files; only a
machine crash could lose what was written.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ledgers.files import digest_bytes, probe, read_rows
from ledgers.schemas import (
    RUN_TABLES,
    SCHEMAS,
    TABLES,
    WORKLOAD_COLUMNS,
    WORKLOAD_SENTINEL,
    to_stored_table,
    to_table,
)

TEMP_SUFFIX = ".tmp"
NONCE_HEX = 16  # hex digits of an attempt's nonce
ADOPTION_KEY = ("campaign", "config_hash", "seed")  # one adopted complete run per key
CANONICAL_ORDER = ("created_at", "attempt")  # first complete attempt of (campaign, run_id) counts
WRITER_COLUMNS = ("adopted", "created_at", "files")  # runs columns the writer sets
JSON_COLUMNS = ("units_detail", "environment", "files")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_COMPRESSION = "zstd"


def table_dir(root: str | os.PathLike, table: str, campaign: str) -> Path:
    """Hive partition directory of one table and campaign."""
    return Path(root) / table / f"campaign={campaign}"


def table_glob(root: str | os.PathLike, table: str) -> str:
    """Glob every committed file of a table matches (temp files never do)."""
    return f"{Path(root).resolve().as_posix()}/{table}/**/*.parquet"


def attempt_run_id(attempt: str) -> str:
    """run_id of an attempt stem `<run_id>-<nonce>`."""
    return attempt[: -(NONCE_HEX + 1)]


def temp_path(path: Path) -> Path:
    """Temporary sibling a file is written to before its rename."""
    return path.with_name(f".{path.name}{TEMP_SUFFIX}")


def committed_files(root: str | os.PathLike, table: str) -> list[Path]:
    """Committed Parquet files of a table, across campaigns, sorted."""
    base = Path(root) / table
    return sorted(base.glob("campaign=*/*.parquet")) if base.is_dir() else []


def _check_name(what: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{what}={value!r}: use letters, digits, '_', '.', '-' (not leading)")


SYNC_ENV = "HSL_LEDGER_SYNC"  # on (default): fsync files and directories; off: do not


def syncing() -> bool:
    """Whether writes are fsynced: `HSL_LEDGER_SYNC` on (or unset) or off."""
    value = os.environ.get(SYNC_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{SYNC_ENV}={value!r}: allowed on, off")
    return value == "on"


def _fsync_dir(path: Path) -> None:
    if not syncing():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _statistics_columns(table: pa.Table) -> list[str]:
    """Columns that get min/max statistics: all but floating point ones.

    Parquet min/max ignore NaN, and DuckDB 2.0.1 folds `isnan(x)` (and
    `x = 'nan'`) to false from such statistics, losing the NaN sentinels
    (unfinished finish_s, missing ttft_s). Float columns are never partition or
    pruning keys here, so they carry no statistics.
    """
    return [f.name for f in table.schema if not pa.types.is_floating(f.type)]


@contextmanager
def atomic_open(path: Path, mode: str = "wb", *, sync_dir: bool = True):
    """Yield a handle on a temp sibling of `path`; on success fsync it, rename it over
    `path` and (unless the caller batches it, `sync_dir=False`) fsync the directory. On
    any error the temp file is removed, so readers only ever see complete files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(tmp, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()
            if syncing():
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        _fsync_dir(path.parent)


def write_atomic(table: pa.Table, path: Path, *, sync_dir: bool = True) -> dict:
    """Write `table` to `path` via a fsynced temp file and a rename; return its file record
    {"rows", "bytes", "sha256"} (what the runs row lists for each table file)."""
    sink = pa.BufferOutputStream()
    pq.write_table(
        table, sink, compression=_COMPRESSION, write_statistics=_statistics_columns(table)
    )
    data = sink.getvalue()
    with atomic_open(path, "wb", sync_dir=sync_dir) as fh:
        fh.write(data)
    return {"rows": table.num_rows, "bytes": data.size, "sha256": digest_bytes(data)}


def _with_keys(name: str, table: pa.Table, run_id: str, campaign: str,
               workload: Mapping[str, Mapping[int, int]] | None = None) -> pa.Table:
    n = table.num_rows
    keys = [pa.array([run_id] * n, pa.string()), pa.array([campaign] * n, pa.string())]
    extra = []
    for field in WORKLOAD_COLUMNS.get(name, ()):
        by_request = (workload or {}).get(field.name, {})
        ids = table.column("request_id").to_pylist()
        extra.append(pa.array([by_request.get(r, WORKLOAD_SENTINEL) for r in ids], field.type))
    return pa.Table.from_arrays([*keys, *table.columns, *extra], schema=SCHEMAS[name])


def _json_text(column: str, value) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"runs.{column}: not valid JSON: {e}") from e
        return value
    return json.dumps(value, sort_keys=True)


def _runs_table(run_id: str, campaign: str, runs_row: Mapping, adopted: bool,
                files: Mapping) -> pa.Table:
    owned = [c for c in WRITER_COLUMNS if c in runs_row]
    if owned:
        raise ValueError(f"runs row: columns {owned} are set by the writer")
    for key, value in (("run_id", run_id), ("campaign", campaign)):
        if key in runs_row and runs_row[key] != value:
            raise ValueError(f"runs row: {key}={runs_row[key]!r} differs from {value!r}")
    row = {**runs_row, "run_id": run_id, "campaign": campaign, "adopted": adopted,
           "files": dict(files)}
    row["created_at"] = datetime.now(UTC).isoformat(timespec="microseconds")
    for column in JSON_COLUMNS:
        if column in row:
            row[column] = _json_text(column, row[column])
    return to_stored_table("runs", {c: [v] for c, v in row.items()})


def _runs_files(root: str | os.PathLike, campaign: str | None) -> list[Path]:
    if campaign is None:
        return committed_files(root, "runs")
    _check_name("campaign", campaign)
    return sorted(table_dir(root, "runs", campaign).glob("*.parquet"))


def read_raw_runs(root: str | os.PathLike, campaign: str | None = None) -> list[dict]:
    """Every readable runs row (any status, duplicates included) with its attempt and file
    path (`filename`); unreadable runs files are left out (ledgers.integrity names them)."""
    return read_rows(_runs_files(root, campaign))[0]


# runs file -> (its stat signature, the (run_id, *ADOPTION_KEY) of its complete rows). A
# runs file's key columns never change once written (adoption rewrites only `adopted`), so
# a process that writes many runs reads each file once, not once per write (quadratic).
_KEY_CACHE: dict[str, tuple[tuple[int, int, int], list[tuple]]] = {}


def _complete_keys(root: str | os.PathLike, campaign: str | None) -> list[tuple]:
    """(run_id, *ADOPTION_KEY) of complete runs rows (hot path: every write). Files whose
    stat signature (inode, size, mtime) is unchanged are not read again."""
    out: list[tuple] = []
    fresh: dict[str, tuple[int, int, int]] = {}
    for path in _runs_files(root, campaign):
        try:
            st = path.stat()
        except OSError:
            continue  # removed meanwhile (a repair): not a run any more
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = _KEY_CACHE.get(Path(path).as_posix())
        if cached is not None and cached[0] == sig:
            out += cached[1]
        else:
            fresh[Path(path).as_posix()] = sig
    for p, sig in fresh.items():
        keys = _read_complete_keys(Path(p))
        _KEY_CACHE[p] = (sig, keys)
        out += keys
    return out


def read_complete_keys(root: str | os.PathLike, campaign: str) -> None:
    """Read `campaign`'s complete runs keys into this process's cache (the adoption check's,
    `write_run`). A process that forks the writers (the campaign launcher) calls it before
    each fork: the child inherits the cache and reads only the runs files written since,
    where each forked run read every earlier one (quadratic in the campaign's runs)."""
    _complete_keys(root, campaign)


def _read_complete_keys(path: Path) -> list[tuple]:
    """(run_id, *ADOPTION_KEY) of one runs file's complete rows; none from a file that does
    not read (ledgers.integrity names it). One small file: pyarrow, no DuckDB connection."""
    if probe(path) is not None:
        return []
    try:
        rows = pq.read_table(path, columns=["run_id", "status", *ADOPTION_KEY]).to_pylist()
    except (OSError, pa.ArrowException):
        return []
    return [(r["run_id"], *(r[k] for k in ADOPTION_KEY)) for r in rows
            if r["status"] == "complete"]


def _key_has_complete_run(root: str | os.PathLike, campaign: str, row: Mapping) -> bool:
    key = tuple(row[k] for k in ADOPTION_KEY)
    return any(tuple(found[1:]) == key for found in _complete_keys(root, campaign))


def write_run(
    root: str | os.PathLike,
    campaign: str,
    run_id: str,
    tables: Mapping[str, pa.Table | Mapping],
    runs_row: Mapping,
    workload_columns: Mapping[str, Mapping[int, int]] | None = None,
) -> None:
    """Persist one attempt of a run: its tables, then its runs row.

    `tables` maps run-table names to engine columns (pa.Table or dict of
    columns, exactly `ENGINE_SCHEMAS[name]`); absent tables are not written.
    `runs_row` holds every runs column except adopted and created_at (run_id
    and campaign optional, must match). `workload_columns` maps a workload
    column (schemas.WORKLOAD_COLUMNS) to its value per request_id; a request or
    column it lacks stores the sentinel. Everything is validated before the
    first file is written.
    """
    _check_name("campaign", campaign)
    _check_name("run_id", run_id)
    unknown = sorted(set(tables) - set(RUN_TABLES))
    if unknown:
        raise ValueError(f"unknown run tables {unknown}: expected a subset of {RUN_TABLES}")
    stored = {
        name: _with_keys(name, to_table(name, tables[name]), run_id, campaign,
                         workload_columns or {})
        for name in RUN_TABLES
        if name in tables
    }
    _runs_table(run_id, campaign, runs_row, adopted=False, files={})  # validate before writing
    stem = f"{run_id}-{secrets.token_hex(NONCE_HEX // 2)}"
    files = {}
    for name, table in stored.items():
        path = table_dir(root, name, campaign) / f"{stem}.parquet"
        files[name] = write_atomic(table, path, sync_dir=False)
    for directory in sorted({table_dir(root, name, campaign) for name in stored}):
        _fsync_dir(directory)  # one directory fsync per table, all before the runs row
    # Decide adoption as late as possible, right before the runs row commits the run.
    adopted = runs_row["status"] == "complete" and not _key_has_complete_run(
        root, campaign, {**runs_row, "campaign": campaign})
    runs = _runs_table(run_id, campaign, runs_row, adopted=adopted, files=files)
    write_atomic(runs, table_dir(root, "runs", campaign) / f"{stem}.parquet")


def _set_adopted(path: str, adopted: bool) -> None:
    table = pq.read_table(path)
    index = table.schema.get_field_index("adopted")
    column = pa.array([adopted] * table.num_rows)
    table = table.set_column(index, table.schema.field(index), column)
    write_atomic(table, Path(path))


def adopt_run(root: str | os.PathLike, campaign: str, run_id: str) -> None:
    """Make the run the adopted one of its (campaign, config_hash, seed) key.

    Rewrites runs rows in place (temp then rename): the new run is marked
    first and the others cleared after, so a crash in between leaves two
    adopted runs, which ledgers.check reports, never none.
    """
    complete = [r for r in read_raw_runs(root, campaign) if r["status"] == "complete"]
    own = sorted(
        (r for r in complete if r["run_id"] == run_id),
        key=lambda r: tuple(r[c] for c in CANONICAL_ORDER),
    )
    if not own:
        raise ValueError(f"run_id={run_id!r}: no complete run to adopt in campaign {campaign!r}")
    target = own[0]
    peers = [r for r in complete if all(r[k] == target[k] for k in ADOPTION_KEY)]
    if not target["adopted"]:
        _set_adopted(target["filename"], True)
    for r in peers:
        if r["attempt"] != target["attempt"] and r["adopted"]:
            _set_adopted(r["filename"], False)


__all__ = [
    "ADOPTION_KEY",
    "TABLES",
    "adopt_run",
    "read_raw_runs",
    "table_dir",
    "table_glob",
    "write_atomic",
    "write_run",
]
