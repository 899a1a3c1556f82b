"""Integrity of a ledger root: which files are unreadable, which complete runs lost a file,
and moving the damage aside so a rerun redoes those runs.

Every runs row written since file records exist lists its attempt's table files
(column `files`: rows, bytes, sha256 per table). A complete runs row counts only
while each listed file is present, passes the Parquet probe and has its recorded
size (`scan_root`, cheap: one stat and a few bytes per file); `deep=True` also
compares checksums and footer row counts (ledgers.check, campaign start).
`quarantine_damage` moves unreadable files and every file of a damaged attempt
under `<root>/quarantine/<time>/` (never deleting anything), after which the
run is simply not complete and the next campaign or run redoes it.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from ledgers.files import digest_file, probe, read_rows, split_readable
from ledgers.schemas import TABLES
from ledgers.writer import attempt_run_id, committed_files, table_dir

QUARANTINE_DIR = "quarantine"  # under the root; outside every table's glob
REASONS_FILE = "REASONS.txt"


@dataclass
class LedgerScan:
    """One look at a ledger root (or some of its campaigns)."""

    root: Path
    readable: dict[str, list[Path]] = field(default_factory=dict)  # table -> whole files
    unreadable: dict[Path, str] = field(default_factory=dict)  # file -> why
    runs: list[dict] = field(default_factory=list)  # readable runs rows, with attempt
    damaged: dict[str, list[str]] = field(default_factory=dict)  # complete attempt -> problems
    unrecorded: list[str] = field(default_factory=list)  # complete attempts without `files`

    @property
    def complete_attempts(self) -> list[dict]:
        """Complete runs rows whose files are all present and whole."""
        return [r for r in self.runs
                if r["status"] == "complete" and r["attempt"] not in self.damaged]

    @property
    def complete_runs(self) -> set[tuple[str, str]]:
        """(campaign, run_id) of runs with at least one intact complete attempt."""
        return {(r["campaign"], r["run_id"]) for r in self.complete_attempts}

    @property
    def num_files(self) -> int:
        return sum(len(v) for v in self.readable.values()) + len(self.unreadable)

    def relative(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)


def _campaign_of(path: Path) -> str:
    return path.parent.name.removeprefix("campaign=")


def _files(root: Path, table: str, campaigns: set[str] | None, run_id: str | None) -> list[Path]:
    if run_id is not None:  # one run's attempts: glob its names only
        found = sorted((root / table).glob(f"campaign=*/{run_id}-*.parquet"))
    else:
        found = committed_files(root, table)
    return found if campaigns is None else [p for p in found if _campaign_of(p) in campaigns]


def _file_problems(path: Path, record: dict, deep: bool) -> str | None:
    """Why one listed file no longer matches its record, or None."""
    if not path.is_file():
        return "missing"
    reason = probe(path)
    if reason is not None:
        return reason
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{size} bytes, {record['bytes']} recorded"
    if not deep:
        return None
    if digest_file(path) != record["sha256"]:
        return "checksum differs from the recorded sha256"
    try:
        rows = pq.read_metadata(path).num_rows
    except (OSError, ValueError) as err:
        return f"unreadable footer ({err})"
    if rows != record["rows"]:
        return f"{rows} rows, {record['rows']} recorded"
    return None


def verify_attempt(root: Path, row: dict, present: dict[str, set[str]],
                   deep: bool) -> list[str] | None:
    """Problems of one complete attempt's files; None when it has no file record."""
    text = row.get("files")
    if not text:
        return None
    record = json.loads(text)
    campaign, attempt = row["campaign"], row["attempt"]
    problems = []
    for table in sorted(record):
        path = table_dir(root, table, campaign) / f"{attempt}.parquet"
        why = _file_problems(path, record[table], deep)
        if why is not None:
            problems.append(f"{path.relative_to(root).as_posix()}: {why}")
    for table in TABLES[1:]:
        if table not in record and attempt in present.get(table, set()):
            problems.append(f"{table}/campaign={campaign}/{attempt}.parquet: "
                            "not in the run's file record")
    return problems


def scan_root(root: str | os.PathLike, campaigns: str | Iterable[str] | None = None, *,
              deep: bool = False, run_id: str | None = None) -> LedgerScan:
    """Probe every committed file (of `campaigns`, default all; of one run's attempts when
    `run_id` is given), read the runs rows and verify each complete attempt's files
    against its record."""
    root = Path(root)
    wanted = {campaigns} if isinstance(campaigns, str) else (
        None if campaigns is None else set(campaigns))
    scan = LedgerScan(root)
    for table in TABLES:
        files = _files(root, table, wanted, run_id)
        if table == "runs":
            scan.runs, bad = read_rows(files)
            unreadable = set(bad)
            good = [p for p in files if p not in unreadable]
        else:
            good, bad = split_readable(files)
        scan.readable[table] = good
        scan.unreadable.update(bad)
    present = {t: {p.stem for p in files} for t, files in scan.readable.items()}
    for row in scan.runs:
        if row["status"] != "complete":
            continue
        problems = verify_attempt(root, row, present, deep)
        if problems is None:
            scan.unrecorded.append(row["attempt"])
        elif problems:
            scan.damaged[row["attempt"]] = problems
    return scan


def stray_files(root: str | os.PathLike) -> list[Path]:
    """Parquet files under `root` outside the ledger layout (and outside the quarantine):
    no view reads them, so they are listed rather than silently ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    from ledgers.studies import study_files

    layout = {p for table in TABLES for p in committed_files(root, table)}
    layout |= set(study_files(root))
    quarantine = root / QUARANTINE_DIR
    return sorted(p for p in root.rglob("*.parquet")
                  if p not in layout and quarantine not in p.parents)


def damage_lines(scan: LedgerScan) -> tuple[list[str], list[str]]:
    """Readable lines: (unreadable files, complete runs with missing or damaged files)."""
    files = [f"{scan.relative(p)}: {why}" for p, why in sorted(scan.unreadable.items())]
    by_attempt = {r["attempt"]: r for r in scan.runs}
    runs = [f"run {by_attempt[a]['run_id']} (campaign {by_attempt[a]['campaign']}, "
            f"attempt {a}): {'; '.join(p)}" for a, p in sorted(scan.damaged.items())]
    return files, runs


@dataclass
class Quarantine:
    """What `quarantine_damage` moved and where."""

    directory: Path | None
    moved: list[str]
    runs: list[str]  # "<campaign>/<run_id>" whose complete attempt was moved

    def format(self) -> str:
        return (f"quarantined {len(self.moved)} damaged ledger files (runs to redo: "
                f"{len(self.runs)}) to {self.directory}")


def _damaged_attempts(scan: LedgerScan) -> set[tuple[str, str]]:
    """(campaign, attempt) of complete attempts with bad files or unreadable runs files."""
    bad = {(r["campaign"], r["attempt"]) for r in scan.runs if r["attempt"] in scan.damaged}
    bad |= {(_campaign_of(p), p.stem) for p in scan.unreadable if p.parent.parent.name == "runs"}
    return bad


def quarantine_damage(scan: LedgerScan) -> Quarantine:
    """Move unreadable files and every file of a damaged attempt (runs row first, so the
    run stops counting before anything else moves) under `<root>/quarantine/<time>/`,
    keeping their relative paths, with a REASONS.txt naming why."""
    root = scan.root
    attempts = _damaged_attempts(scan)
    reasons: dict[Path, str] = dict(scan.unreadable)
    for campaign, attempt in attempts:
        for table in TABLES:
            path = table_dir(root, table, campaign) / f"{attempt}.parquet"
            if path.exists():
                reasons.setdefault(path, f"part of damaged attempt {attempt}")
    if not reasons:
        return Quarantine(None, [], [])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    directory = root / QUARANTINE_DIR / f"{stamp}-{secrets.token_hex(3)}"
    # runs files first: once its runs row is gone a damaged run no longer counts
    order = sorted(reasons, key=lambda p: (p.parent.parent.name != "runs", str(p)))
    moved = []
    for path in order:
        target = directory / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, target)
        except FileNotFoundError:  # another process moved it first
            continue
        moved.append(path.relative_to(root).as_posix())
    lines = [f"{p}: {reasons[root / p]}" for p in moved]
    lines += [f"damaged {line}" for line in damage_lines(scan)[1]]
    (directory / REASONS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    runs = sorted(f"{c}/{attempt_run_id(a)}" for c, a in attempts if attempt_run_id(a))
    return Quarantine(directory, moved, runs)


def completed_run_ids(root: str | os.PathLike, campaign: str | None = None) -> set[str]:
    """run_ids of complete runs whose table files are all present and whole (size and Parquet
    probe); the runner skips these. verify_root also compares checksums."""
    return {run_id for _, run_id in scan_root(root, campaign).complete_runs}


__all__ = ["LedgerScan", "Quarantine", "completed_run_ids", "damage_lines", "quarantine_damage",
           "scan_root", "stray_files", "verify_attempt"]
