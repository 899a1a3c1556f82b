"""Study tables: one Parquet file per study run under <root>/<table>/, beside the run
tables (a study is not a cell: it has no run_id or campaign). Each table has a documented
schema (`STUDY_SCHEMAS`), is written atomically by `write_study`, read by `read_study`
and audited by `check_studies` (python -m ledgers.check reports a file whose schema is not
the table's)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ledgers.arms import STORAGE_ORGS
from ledgers.schemas import REQUEST_PATHS, _cast, _f
from ledgers.writer import write_atomic

_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()
RELOAD_CONDITIONS = ("cold", "repeat", "reload")

_RELOAD_STUDY = [
    _f("study_id", _S, "", "Study run identifier (UTC start time and a random suffix)."),
    _f("created_at", _S, "", "UTC time the table was written (ISO 8601)."),
    _f("model", _S, "", "Model geometry name (conf/model/)."),
    _f("org", _S, "", "Storage organization the servers ran.", STORAGE_ORGS),
    _f("budget", _S, "", "Memory budget label (bN | pN)."),
    _f("pair", _I, "count", "Server pair: 0 runs OFF then ON, 1 runs ON then OFF."),
    _f("order", _S, "", "Order of the pair's two servers.", ("off_on", "on_off")),
    _f("server", _I, "count", "Position of the server within its pair (0 first, 1 second)."),
    _f("host_tier", _B, "", "The server's effective host_tier rule (its engine line)."),
    _f("split_last_boundary", _B, "", "The server's effective split_last_boundary rule."),
    _f("n_tokens", _I, "tokens", "Prompt length N."),
    _f("interval", _I, "tokens", "Checkpoint interval C of the organization."),
    _f("trial", _I, "count", "Trial index per (server, N); -1 for the excluded warmup."),
    _f("document", _I, "", "Identity of the prompt's early document (distinct per trial)."),
    _f("condition", _S, "", "What the request was sent as (not its path).",
       (*RELOAD_CONDITIONS, "warmup")),
    _f("path", _S, "", "Actual path from the server's record of the request.", REQUEST_PATHS),
    _f("reused_tokens", _I, "tokens",
       "Prefix the request adopted: device tokens, or B for a host reload; 0 recompute."),
    _f("restored_tokens", _I, "tokens", "Prefix B the host tier restored for it (0: none)."),
    _f("suffix_tokens", _I, "tokens", "Prompt tokens computed: N - reused_tokens."),
    _f("first_batch_computed", _I, "tokens", "Tokens already computed at its first batch."),
    _f("first_batch_scheduled", _I, "tokens", "Tokens its first batch scheduled."),
    _f("ttft_s", _F, "s", "Client time to first token (streamed over loopback)."),
    _f("e2e_s", _F, "s", "Client time to the last token."),
    _f("output_tokens", _I, "tokens", "Tokens generated (EOS ignored)."),
    _f("output_ids", _S, "", "Generated token ids, JSON list."),
    _f("output_matches", _B, "",
       "Output ids equal those of the first request with the same prompt in the study."),
]

IDENTIFY_KINDS = ("constant", "residual", "level", "ratio", "slab", "loss", "target", "levels",
                  "selection")
_IDENTIFY = [
    _f("study_id", _S, "", "Search run identifier (UTC start time and the search key)."),
    _f("created_at", _S, "", "UTC time the rows were written (ISO 8601)."),
    _f("search", _S, "",
       "Search key: the candidate space, seeds, requests, iterations and anchors it ran with."),
    _f("combination", _S, "", "Combination name: codes of its non-default levels (base: none)."),
    _f("label", _S, "", "Its non-default levels as factor=level (defaults: none)."),
    _f("form", _S, "", "Step-model form whose paged-state constants were fitted.",
       ("indirection", "pages", "both")),
    _f("rules", _S, "", "Rule overrides per organization, JSON {org: [override, ...]}."),
    _f("seeds_per_cell", _I, "count", "Seeds per simulated cell (0 on selection rows)."),
    _f("requests", _I, "count", "Requests per run (0 on selection rows)."),
    _f("iterations", _I, "count", "Simulate-and-fit iterations run."),
    _f("converged", _B, "", "The last iteration moved no fitted constant by the tolerance."),
    _f("seconds", _F, "s", "Wall time of the combination's refit and score."),
    _f("kind", _S, "", "What the row holds: a fitted constant, a fit residual, an anchor "
       "level, an organization ratio, an S2 slab figure, a part's loss, an acceptance target, "
       "the throughput-levels check, or the search's selection.", IDENTIFY_KINDS),
    _f("part", _S, "", "fit | check (anchor part); selection rows: identified or ''."),
    _f("section", _S, "", "Anchor section (A-D, F), '' when none."),
    _f("point", _S, "", "Anchor point (control, L, M, H, low_b63, low_b108, all), or ''."),
    _f("org", _S, "", "Organization, the ratio (S1/S0, ...), or ''."),
    _f("metric", _S, "", "Anchor metric, constant name, target, or the selection's reason."),
    _f("measured", _F, "", "Measured value (NaN: none)."),
    _f("ours", _F, "", "Simulated value: constant, level, ratio - 1, loss (NaN: none)."),
    _f("error", _F, "", "Relative error (levels), gap in pp (ratios), difference (slab)."),
    _f("residual", _F, "", "Error over its declared tolerance (NaN: not scored)."),
    _f("met", _B, "", "Target met; constant fitted; selection row: the adopted default."),
]

STUDY_SCHEMAS: dict[str, pa.Schema] = {"reload_study": pa.schema(_RELOAD_STUDY),
                                       "identify": pa.schema(_IDENTIFY)}


def study_dir(root: str | os.PathLike, table: str) -> Path:
    return Path(root) / table


def study_files(root: str | os.PathLike) -> list[Path]:
    """Committed files of every study table (temp files excluded)."""
    out = []
    for table in STUDY_SCHEMAS:
        d = study_dir(root, table)
        if d.is_dir():
            out += sorted(p for p in d.glob(f"{table}-*.parquet") if not p.name.startswith("."))
    return out


def write_study(root: str | os.PathLike, table: str, columns: Mapping[str, list]) -> Path:
    """Cast `columns` to the table's schema (ValueError names a bad column) and write
    them as one new file, atomically; returns its path."""
    if table not in STUDY_SCHEMAS:
        raise ValueError(f"study table {table!r}: allowed values are {', '.join(STUDY_SCHEMAS)}")
    data = _cast(table, STUDY_SCHEMAS[table], columns)
    out = study_dir(root, table)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    path = out / f"{table}-{stamp}.parquet"
    write_atomic(data, path)
    return path


def read_study(root: str | os.PathLike, table: str, latest: bool = True) -> pa.Table | None:
    """The newest file of the table (or all files concatenated); None when there is none."""
    files = [p for p in study_files(root) if p.parent.name == table]
    if not files:
        return None
    chosen = files[-1:] if latest else files
    return pa.concat_tables([pq.read_table(p) for p in chosen])


def check_studies(root: str | os.PathLike) -> list[str]:
    """One line per study file that does not read or whose schema is not its table's."""
    problems = []
    for path in study_files(root):
        schema = STUDY_SCHEMAS[path.parent.name]
        try:
            got = pq.read_schema(path)
        except Exception as err:  # noqa: BLE001 - any unreadable file is a finding
            problems.append(f"{path}: unreadable ({type(err).__name__})")
            continue
        if got.remove_metadata() != schema.remove_metadata():
            missing = sorted(set(schema.names) - set(got.names))
            extra = sorted(set(got.names) - set(schema.names))
            problems.append(f"{path}: schema differs from {path.parent.name}'s "
                            f"(missing {missing}, extra {extra})")
    return problems
