"""Ledger files on disk: a cheap Parquet probe, content digests, and reads that skip bad files.

A damaged file (truncated, overwritten with garbage, emptied) must never take a
whole query down: `probe` rejects what lacks the Parquet magic bytes or a
plausible footer without reading the data, and `read_rows` reads many small
files at once, falling back to one file at a time to name the ones that fail.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

MAGIC = b"PAR1"
_MIN_SIZE = 12  # magic, footer length, magic


def probe(path: str | os.PathLike) -> str | None:
    """Why `path` is not a whole Parquet file, or None when it looks whole.

    Checks the leading and trailing magic bytes and that the footer length fits
    the file: a few bytes read, so it runs on every file at catalog connect.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < _MIN_SIZE:
            return f"{size} bytes, too short for a Parquet file"
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(-8, os.SEEK_END)
            tail = fh.read(8)
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if head != MAGIC or tail[4:] != MAGIC:
        return "no Parquet magic bytes (truncated or not a Parquet file)"
    if int.from_bytes(tail[:4], "little") + _MIN_SIZE > size:
        return "Parquet footer longer than the file (truncated)"
    return None


def digest_bytes(data: bytes | memoryview) -> str:
    """Checksum recorded for a ledger file: sha256, hex."""
    return hashlib.sha256(data).hexdigest()


def digest_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def split_readable(paths: Iterable[Path]) -> tuple[list[Path], dict[Path, str]]:
    """(files passing the probe, {bad file: reason})."""
    good, bad = [], {}
    for path in paths:
        reason = probe(path)
        if reason is None:
            good.append(path)
        else:
            bad[path] = reason
    return good, bad


def _fetch(con, select: str, files: Sequence[Path]) -> list[dict]:
    rel = con.execute(
        f"SELECT {select}, parse_filename(filename, true) AS attempt, filename FROM "
        "read_parquet(?, union_by_name = true, filename = true)",
        [[f.as_posix() for f in files]],
    )
    names = [d[0] for d in rel.description]
    return [dict(zip(names, r, strict=True)) for r in rel.fetchall()]


def read_rows(files: Sequence[Path], select: str = "*") -> tuple[list[dict], dict[Path, str]]:
    """Rows of many small Parquet files (with `attempt` and `filename`), and the files that
    could not be read with the reason; a bad file costs only its own rows."""
    good, bad = split_readable(files)
    if not good:
        return [], bad
    import duckdb  # here: a run that writes but never reads back does not import it

    with duckdb.connect() as con:
        try:
            return _fetch(con, select, good), bad
        except duckdb.Error:
            pass  # a file passed the probe but is damaged inside: find it
        rows: list[dict] = []
        for path in good:
            try:
                rows += _fetch(con, select, [path])
            except duckdb.Error as err:
                bad[path] = f"unreadable ({str(err).splitlines()[0][:160]})"
        return rows, bad


__all__ = ["MAGIC", "digest_bytes", "digest_file", "probe", "read_rows", "split_readable"]
