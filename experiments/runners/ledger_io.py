"""From a cell config and its CellResult to ledger rows: run identity, runs row, skip lookup.

Identity: `config_hash` hashes the resolved cell config without seed and
replicate (experiments.runners.cell.config_hash over the identity keys), so it names
the cell across seeds; `run_id` hashes (config_hash, seed, replicate). A run
id whose runs row says complete is skipped; anything else is run again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from experiments.runners.cell import CellResult, arm_of, cell_config, config_hash, last_line
from experiments.runners.provenance import code_version, environment, prereg_plan_hash
from experiments.workloads.workload import normalize_load_config, normalize_workload_config
from ledgers.arms import arm
from ledgers.integrity import Quarantine, quarantine_damage, scan_root
from ledgers.schemas import SCHEMAS
from ledgers.writer import WRITER_COLUMNS, read_complete_keys
from serving_core.geometry import geometry_from_config
from serving_core.planner import parse_budget, plan_budget, units_for
from serving_core.records import mechanism_absent

LOCK_DIR = ".locks"  # under the ledger root; never matched by the catalog's globs
# Last-line keys the runs row holds (column names where they differ).
ROW_SUMMARY_COLUMNS = {
    "completed": "completed_requests", "failed": "failed_requests",
    "output_tokens": "output_tokens", "throughput_ledger": "throughput_ledger",
    "throughput_span": "throughput_span", "engine_seconds": "engine_seconds",
    "run_seconds": "run_seconds",
}

@dataclass(frozen=True, slots=True)
class RunKey:
    """Who a run is: its id, the campaign partition it lives in, and what the id hashes."""

    run_id: str
    campaign: str
    question: str
    config_hash: str
    seed: int
    replicate: int


def run_key(cfg: DictConfig, resolved: Mapping | None = None) -> RunKey:
    """The run's identity; `resolved`: the config already as plain Python
    (experiments.runners.spec.resolved_config; None: converted here)."""
    cell = cell_config(cfg if resolved is None else resolved)
    seed = int(cell.pop("seed"))
    replicate = int(cfg.replicate)
    cell_hash = config_hash(cell)
    run_id = hashlib.sha256(f"{cell_hash}:{seed}:{replicate}".encode()).hexdigest()[:16]
    return RunKey(run_id, str(cfg.campaign_name), str(cfg.question), cell_hash, seed, replicate)


def cell_columns(cfg: DictConfig, resolved: Mapping | None = None) -> dict:
    """Runs columns that follow from the config alone (what preregistered cells match on);
    `resolved`: the config already as plain Python (experiments.runners.spec.resolved_config),
    read instead of the config (the same values, ~30x cheaper to read)."""
    c = cfg if resolved is None else resolved
    a = arm(c["org"])
    workload = normalize_workload_config(c["workload"])
    load = normalize_load_config(c["load"])
    engine, executor = c["engine"], c["executor"]
    pinning = engine["pinning_k"]
    return {
        "question": str(c["question"]),
        "arm": a.label,
        "org": a.ledger_org,
        "budget": parse_budget(str(c["budget"])).label,
        "cap": int(engine["cap"]),
        # a trace replays its own timestamps (load.* unused): its time scale stands as the rate
        "rate": workload["trace_speed"] if workload["source"] == "trace" else load["rate"],
        "arrival": "trace" if workload["source"] == "trace" else load["arrival"],
        "q": workload["q"],
        "f": float(engine["headroom"]),
        "retention_k": int(c["retention"]["k"]) if a.retention else -1,
        "pinning_k": -1 if pinning is None else int(pinning),
        "d0_attention_fraction": (
            float(c["model"]["d0_attention_fraction"]) if a.org == "D0" else math.nan
        ),
        "reuse": workload["reuse"],
        "seed": int(c["seed"]),
        "replicate": int(c["replicate"]),
        "trace": bool(c["trace"]),
        "executor": (
            f"{executor['name']}:{executor['device']}"
            if executor.get("kind") in ("torch", "vllm", "vllm_virtual")
            else f"sim:{executor['name']}"
        ),
        "model": str(c["model"]["name"]),
    }


def planned_units(cfg: DictConfig) -> dict[str, int]:
    """Units per pool the budget gives the config's organization (no run needed)."""
    plan = plan_budget(geometry_from_config(cfg.model), str(cfg.budget))
    return units_for(plan, arm(cfg.org).org)


def _select_schema_columns(values: Mapping) -> dict:
    columns = [c for c in SCHEMAS["runs"].names if c not in WRITER_COLUMNS]
    missing = [c for c in columns if c not in values]
    if missing:
        raise ValueError(f"runs row: no value for schema columns {missing}")
    return {c: values[c] for c in columns}


def _provenance_columns(key: RunKey) -> dict:
    return {
        "run_id": key.run_id,
        "campaign": key.campaign,
        "config_hash": key.config_hash,
        "prereg_plan_hash": prereg_plan_hash(key.question),
        "code_version": code_version(),
        "environment": environment(),
    }


def runs_row(cfg: DictConfig, key: RunKey, result: CellResult, run_seconds: float) -> dict:
    """The complete runs row of a finished cell (adopted and created_at come from the writer)."""
    s = result.summary
    episode = result.episode
    values = {
        **cell_columns(cfg),
        **_engine_columns(result.engine_config),
        **_provenance_columns(key),
        "units": sum(result.units.values()),
        "units_detail": result.units,
        "engine_config": json.dumps(result.engine_config, sort_keys=True),
        "episode_start_s": int(episode["episode_start_s"]),
        "episode_end_s": int(episode["episode_end_s"]),
        "span_start_s": float(episode["span_start_s"]),
        "span_end_s": float(episode["span_end_s"]),
        "completed_requests": int(s["completed"]),
        "failed_requests": int(s["failed"]),
        "output_tokens": int(s["output_tokens"]),
        "throughput_ledger": float(s["throughput_ledger"]),
        "throughput_span": float(s["throughput_span"]),
        "status": "complete",
        "run_seconds": float(run_seconds),
        "engine_seconds": result.engine_seconds,
        # A client-side (HTTP) summary lacks the engine's mechanism readouts: recorded absent.
        **{k: s.get(k, v) for k, v in mechanism_absent().items()},
    }
    return _select_schema_columns(values)


def _engine_columns(effective: Mapping) -> dict:
    """Rule columns read back from the engine (its effective rules), where it reports them;
    the builder refused any run whose rules differ from the config's, so these equal the
    config's values: the row states what ran."""
    out = {}
    if "cap" in effective:
        out["cap"] = int(effective["cap"])
    if "headroom" in effective:
        out["f"] = float(effective["headroom"])
    if "pinning_k" in effective:
        out["pinning_k"] = -1 if effective["pinning_k"] is None else int(effective["pinning_k"])
    if "retention_k" in effective:
        k = effective["retention_k"]
        out["retention_k"] = -1 if k is None else int(k)
    return out


def failed_runs_row(cfg: DictConfig, key: RunKey, run_seconds: float) -> dict:
    """Runs row recording a cell that raised: no output, status failed (never counted)."""
    units = planned_units(cfg)
    values = {
        **cell_columns(cfg),
        **_provenance_columns(key),
        "units": sum(units.values()),
        "units_detail": units,
        "engine_config": "{}",
        "episode_start_s": 0,
        "episode_end_s": 0,
        "span_start_s": math.nan,
        "span_end_s": math.nan,
        "completed_requests": 0,
        "failed_requests": int(cfg.workload.num_requests),
        "output_tokens": 0,
        "throughput_ledger": math.nan,
        "throughput_span": math.nan,
        "status": "failed",
        "run_seconds": float(run_seconds),
        "engine_seconds": math.nan,
        **mechanism_absent(),
    }
    return _select_schema_columns(values)


def completed_row(root: str | os.PathLike, key: RunKey) -> tuple[dict | None, Quarantine]:
    """The first complete runs row of `key` (by created_at) whose files are all intact, or
    None; damaged attempts of this run (unreadable runs file, a listed file missing or not
    matching its checksum) are moved to the quarantine first, so the run is redone.

    Reads only this run's attempt files `<run_id>-<nonce>.parquet`.
    """
    scan = scan_root(root, key.campaign, deep=True, run_id=key.run_id)
    moved = quarantine_damage(scan)
    rows = [r for r in scan.complete_attempts if r["run_id"] == key.run_id]
    return (min(rows, key=lambda r: r["created_at"]) if rows else None), moved


def skipped_line(cfg: DictConfig, row: Mapping, manifest: Mapping | None) -> dict:
    """Last-line JSON of a skipped run, read back from the ledger: the runs row, and the
    run's manifest for the summary keys the runs row does not hold."""
    summary = dict((manifest or {}).get("summary") or {})
    if manifest is None or manifest.get("config_hash") != row["config_hash"]:
        summary = {}
    summary.update({"org": arm_of(cfg.org), "budget": str(cfg.budget), "seed": int(cfg.seed)})
    summary.update({k: row[c] for k, c in ROW_SUMMARY_COLUMNS.items() if row.get(c) is not None})
    out = last_line(summary, run_id=row["run_id"], skipped=True,
                    engine_seconds=summary.get("engine_seconds"),
                    run_seconds=summary.get("run_seconds"))
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def read_keys_before_fork(cfg: DictConfig) -> None:
    """Launcher hook (`hydra.launcher.before_fork`): the run's campaign's complete runs keys
    read into the campaign process before the run is forked (ledgers.writer
    `read_complete_keys`), at the ledger root the run writes to (check_ledger_root's)."""
    root = Path(str(cfg.ledger_root)).expanduser()
    if cfg.get("write_ledgers", True) and root.is_dir():
        with contextlib.suppress(ValueError):  # a bad campaign name: the run reports it
            read_complete_keys(root.resolve(), str(cfg.campaign_name))


@contextlib.contextmanager
def run_lock(root: str | os.PathLike, key: RunKey) -> Iterator[None]:
    """Hold an exclusive lock on one run id, so concurrent campaigns never run it twice.

    The lock is an flock on `<root>/.locks/<campaign>/<run_id>.lock`; the kernel
    releases it when its holder dies, so a killed run never blocks a rerun.
    """
    path = Path(root) / LOCK_DIR / key.campaign / f"{key.run_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def json_line(data: Mapping) -> str:
    """One-line JSON with NaN as null."""
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}
    return json.dumps(clean, default=str)
