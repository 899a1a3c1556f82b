"""Study tables: one Parquet file per study run under <root>/<table>/, beside the run
tables (a study is not a cell: it has no run_id or campaign).

The one convention every study follows (its driver in experiments/studies/, its page in
analysis/studies/): the table has a documented schema here (`STUDY_SCHEMAS`, every
column with its unit and meaning, enumerated values checked), opens with `study_id`
(`new_study_id()`, one per study run) and `created_at`, is written atomically by
`write_study`, is audited by `check_studies` (python -m ledgers.check reports a file
that does not read or whose schema is not its table's) and is read through the DuckDB
catalog (one view per table, ledgers.catalog) or `read_study`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ledgers.arms import ARMS, STORAGE_ORGS
from ledgers.files import probe
from ledgers.schemas import REQUEST_PATHS, _cast, _f
from ledgers.writer import write_atomic

_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()
RELOAD_CONDITIONS = ("cold", "repeat", "reload")
# Arms the continuation matrix covers: every one with checkpoints (S2+Retention runs S2).
CONTINUATION_ORGS = tuple(a.name for a in ARMS.values() if not a.retention)
CONTINUATION_FAULTS = ("credit_n_minus_1",)  # injected faults; '' in the table: none
PLACEMENTS = ("step_end", "every_boundary", "align", "all", "junction")  # continuation runs
SENSITIVITY_OUTCOMES = ("ran", "skipped", "as_default")

_STUDY = [
    _f("study_id", _S, "", "Study run identifier (UTC start time and a random suffix)."),
    _f("created_at", _S, "", "UTC time the table was written (ISO 8601)."),
]

_RELOAD_STUDY = [
    *_STUDY,
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

_CONTINUATION = [
    *_STUDY,
    _f("model", _S, "", "Model geometry name (conf/model/)."),
    _f("budget", _S, "", "Memory budget label (bN | pN)."),
    _f("seed", _I, "", "Seed of the pair's prompts (target and interposers)."),
    _f("org", _S, "", "Arm the pair ran (config value).", CONTINUATION_ORGS),
    _f("length_case", _S, "", "Prompt length as an offset from multiples of C (kC+d)."),
    _f("n_tokens", _I, "tokens", "Prompt length N = k C + d."),
    _f("interval", _I, "tokens", "Checkpoint interval C of the organization."),
    _f("placement", _S, "", "Checkpoint placement the engine ran.", PLACEMENTS),
    _f("align_chunks", _B, "", "The engine's effective chunk alignment."),
    _f("split_last_boundary", _B, "", "The engine's effective split_last_boundary rule."),
    _f("output_tokens", _I, "tokens", "Tokens generated per run of the target (greedy)."),
    _f("restored_prefix_b", _I, "tokens", "B: prefix the host tier restored for the reload."),
    _f("credited_prefix_p", _I, "tokens", "p: prefix the scheduler credited the reload."),
    _f("expected_p", _I, "tokens",
       "Deepest boundary strictly inside the prompt that the placement rule publishes."),
    _f("full_prefix", _I, "tokens", "C floor((N-1)/C)."),
    _f("reuse_lost", _I, "tokens", "full_prefix - expected_p."),
    _f("tier_full_depth", _I, "tokens", "Deepest prefix the tier held over all the prompt's "
                                        "blocks (N when it holds the state at B = N)."),
    _f("first_context", _I, "tokens", "Tokens computed before the reload's first batch."),
    _f("first_scheduled", _I, "tokens", "Tokens the reload's first batch scheduled."),
    _f("expected_first", _I, "tokens", "The rule's first chunk from B."),
    _f("bytes_h2d", _I, "bytes", "Host-to-device bytes the restore copied."),
    _f("expected_bytes", _I, "bytes", "layers x (B x KV bytes per token + SSM + conv bytes)."),
    _f("unit_capacity_bytes", _I, "bytes", "Bytes of the destination units the restore "
                                           "allocated."),
    _f("restored_units", _I, "count", "Units the restore allocated."),
    _f("expected_units", _I, "count",
       "The organization's units for B (attention blocks + one composite)."),
    _f("poisoned_units", _I, "count", "Destination units filled with NaN before the restore."),
    _f("restored_exact", _B, "",
       "Every restored view equals the host copy bit for bit, no NaN left."),
    _f("window_b", _I, "tokens",
       "Delayed-save audit: B of a request inside the save window (-1: not run)."),
    _f("window_p", _I, "tokens", "Delayed-save audit: its credited p (-1: not run)."),
    _f("window_pending", _I, "count", "Saves still incomplete when it arrived."),
    _f("window_tokens_equal", _B, "", "Its tokens equal the cold run's."),
    _f("fault", _S, "", "Injected fault ('' for none).", ("", *CONTINUATION_FAULTS)),
    _f("tokens_equal", _B, "", "The reload's generated ids equal the cold run's."),
    _f("first_mismatch", _I, "", "Index of the first differing token (-1: none)."),
    _f("cold_tokens", _S, "", "Generated ids of the cold run, JSON list."),
    _f("reload_tokens", _S, "", "Generated ids of the reload, JSON list."),
    _f("host_saves", _I, "count", "Saves the tier completed before the device reset."),
    _f("reload_units_fresh", _B, "",
       "The reset device held nothing and the reload's objects live there now."),
    _f("state_codec", _S, "", "How the SSM state was stored (model.state_codec)."),
    _f("chunk_tokens", _I, "tokens", "Token budget per step (max_num_batched_tokens)."),
    _f("same_chunks", _B, "", "The cold run ended a chunk at B and its chunks after B are the "
                              "reload's: the reload must repeat its logprobs bit for bit."),
    _f("logprobs_equal", _B, "", "The reload's token logprobs equal the cold run's bit for bit."),
    _f("b_equals_p", _B, "", "B = p = expected p."),
    _f("audits_ok", _B, "", "Byte, unit, poisoning and delayed-save audits all hold."),
    _f("ok", _B, "", "Every column of the pair holds."),
]

_CONTINUATION_HTTP = [
    *_STUDY,
    _f("model", _S, "", "Model geometry name (conf/model/)."),
    _f("budget", _S, "", "Memory budget label (bN | pN)."),
    _f("seed", _I, "", "Seed of the random prompts and interposers."),
    _f("org", _S, "", "Arm the server ran (config value).", CONTINUATION_ORGS),
    _f("case", _S, "", "Offset case (kC+d) or N=<n> for a template prompt."),
    _f("template", _S, "", "Prompt template ('random': random token ids)."),
    _f("n_tokens", _I, "tokens", "Prompt length N."),
    _f("interval", _I, "tokens", "Checkpoint interval C of the organization."),
    _f("output_tokens", _I, "tokens", "Tokens generated per request (greedy)."),
    _f("cold_path", _S, "", "Actual path of the cold request.", REQUEST_PATHS),
    _f("reload_path", _S, "", "Actual path of the request after the cache reset.",
       REQUEST_PATHS),
    _f("restored_b", _I, "tokens", "B: prefix the server's host tier restored."),
    _f("credited_p", _I, "tokens", "p: prefix the reload adopted."),
    _f("expected_p", _I, "tokens", "C floor((N-1)/C)."),
    _f("first_computed", _I, "tokens", "Tokens computed before the reload's first batch."),
    _f("first_scheduled", _I, "tokens", "Tokens the reload's first batch scheduled."),
    _f("expected_first", _I, "tokens", "The rule's first chunk from p."),
    _f("tokens_equal", _B, "", "The reload's generated ids equal the cold run's."),
    _f("first_mismatch", _I, "", "Index of the first differing token (-1: none)."),
    _f("seconds", _F, "s", "Wall time of the case's five operations."),
    _f("b_equals_p", _B, "", "B = p = expected p."),
    _f("ok", _B, "", "Every column of the case holds."),
]

_FIDELITY_FIT = [
    *_STUDY,
    _f("model", _S, "", "Model geometry the profile was fitted for (conf/model/)."),
    _f("start", _S, "", "Step profile the fit started from (conf/executor/)."),
    _f("profile", _S, "", "Name of the fitted profile (the simulated runs' sim:<name>)."),
    _f("parameter", _S, "", "A fitted constant of the step profile (one row each)."),
    _f("value", _F, "", "Its fitted value (unit of the profile field)."),
    _f("rows", _I, "count", "Steps the fit used."),
    _f("rms_rel_error", _F, "", "Root mean square relative step-time error of the fit."),
    _f("org_errors", _S, "",
       "Per organization: (sum of fitted - sum of measured) / sum of measured, JSON."),
    _f("runs", _S, "", "Run ids of the real runs whose steps were fitted, JSON list."),
    _f("overrides", _S, "", "The executor.* overrides the simulated campaign ran, JSON list."),
]

_SENSITIVITY_RUNS = [
    *_STUDY,
    _f("alternative", _S, "", "Engine-rule alternative (conf/sensitivity/alternatives.yaml)."),
    _f("alternative_overrides", _S, "", "Its overrides as run, JSON list."),
    _f("plan", _S, "", "Preregistered plan of the family (conf/prereg/<plan>.yaml)."),
    _f("family", _S, "", "Primary family the cell belongs to."),
    _f("cell", _S, "", "Cell id within the family."),
    _f("seed", _I, "", "Seed of the run."),
    _f("campaign", _S, "", "Campaign the run was recorded in (sens_<alternative>[_smoke]; "
       "the page's own for `default`)."),
    _f("run_id", _S, "", "Run id in the runs table."),
    _f("outcome", _S, "", "ran, skipped as complete, or as_default (it asks the default's "
       "rules: the page's own run stands for it).", SENSITIVITY_OUTCOMES),
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
    _f("ours", _F, "", "Simulated value: constant, level, ratio - 1, loss (NaN: none); "
       "selection rows: levels the defaults hold within the limit that it moves outside."),
    _f("error", _F, "", "Relative error (levels), gap in pp (ratios), difference (slab)."),
    _f("residual", _F, "", "Error over its declared tolerance (NaN: not scored)."),
    _f("met", _B, "", "Target met; constant fitted; selection row: the adopted default."),
]

_CODEC_CONTINUATION = [
    *_STUDY,
    _f("model", _S, "", "Model geometry name (conf/model/)."),
    _f("budget", _S, "", "Memory budget label (bN | pN)."),
    _f("seed", _I, "", "Seed of the request's prompt."),
    _f("org", _S, "", "Arm the request ran (config value).", CONTINUATION_ORGS),
    _f("state_codec", _S, "", "model.state_codec of the run (serving_core/state_codec.py)."),
    _f("n_tokens", _I, "tokens", "Prompt length 2C + 1."),
    _f("interval", _I, "tokens", "Checkpoint interval C of the organization under the codec."),
    _f("preempted_at", _I, "tokens", "Tokens computed when the request was preempted."),
    _f("resumed_b", _I, "tokens", "Prefix the resumed request adopted (must be C)."),
    _f("preemptions", _I, "", "Preemptions the request went through (must be 1)."),
    _f("tokens_equal", _B, "", "Tokens equal the unpreempted run's."),
    _f("logprobs_equal", _B, "", "Token logprobs equal the unpreempted run's bit for bit."),
    _f("state_equal", _B, "", "The checkpoint written at 2C equals the unpreempted run's."),
    _f("fp32_differs", _B, "", "Control: an fp32 state over the same chunks differs at 2C."),
    _f("reuse_ok", _B, "", "The reuse pair of the same codec and organization passed "
       "(its row is in the continuation table)."),
    _f("ok", _B, "", "Every column above as required."),
]

STUDY_SCHEMAS: dict[str, pa.Schema] = {
    "reload_study": pa.schema(_RELOAD_STUDY),
    "continuation": pa.schema(_CONTINUATION),
    "continuation_http": pa.schema(_CONTINUATION_HTTP),
    "codec_continuation": pa.schema(_CODEC_CONTINUATION),
    "fidelity_fit": pa.schema(_FIDELITY_FIT),
    "sensitivity_runs": pa.schema(_SENSITIVITY_RUNS),
    "identify": pa.schema(_IDENTIFY),
}


def new_study_id() -> str:
    """A study run's identifier: UTC start time (sorts by time) and a random suffix."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


def now_iso() -> str:
    """UTC now, ISO 8601 to the second (the `created_at` of a table being written)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


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


def rows_to_columns(table: str, rows: list[Mapping], /, **fixed) -> dict[str, list]:
    """Columns of `table` from row mappings, each column taken from `fixed` (the values
    every row shares: study_id, created_at, model, ...) or else from the rows."""
    return {name: [fixed[name]] * len(rows) if name in fixed else [r[name] for r in rows]
            for name in STUDY_SCHEMAS[table].names}


def read_study(root: str | os.PathLike, table: str, latest: bool = True) -> pa.Table | None:
    """The newest file of the table (or all files concatenated); None when there is none.

    The pages read study tables through the catalog; this direct read of the files is the
    tests' oracle of what a driver wrote (tests/test_reload_study.py)."""
    files = [p for p in study_files(root) if p.parent.name == table]
    if not files:
        return None
    chosen = files[-1:] if latest else files
    return pa.concat_tables([pq.read_table(p) for p in chosen])


def _problem(path: Path) -> str | None:
    """Why a study file cannot be read as its table, or None."""
    why = probe(path)
    if why is not None:
        return f"unreadable ({why})"
    schema = STUDY_SCHEMAS[path.parent.name]
    try:
        got = pq.read_schema(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a finding
        return f"unreadable ({type(err).__name__})"
    if got.remove_metadata() != schema.remove_metadata():
        missing = sorted(set(schema.names) - set(got.names))
        extra = sorted(set(got.names) - set(schema.names))
        return (f"schema differs from {path.parent.name}'s (missing {missing}, "
                f"extra {extra})")
    return None


def readable_study_files(root: str | os.PathLike) -> tuple[dict[str, list[Path]],
                                                          dict[Path, str]]:
    """({table: files that read as the table}, {other study file: why not})."""
    good: dict[str, list[Path]] = {table: [] for table in STUDY_SCHEMAS}
    bad: dict[Path, str] = {}
    for path in study_files(root):
        why = _problem(path)
        if why is None:
            good[path.parent.name].append(path)
        else:
            bad[path] = why
    return good, bad


def check_studies(root: str | os.PathLike) -> list[str]:
    """One line per study file that does not read or whose schema is not its table's."""
    return [f"{path}: {why}" for path, why in readable_study_files(root)[1].items()]
