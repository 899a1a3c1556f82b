"""Single-run entry point: `python -m experiments.run org=s2 budget=b63 seed=42000`.

Prints a short human summary and, as its last line, one JSON object.

With ledgers on (the default) the run is recorded under `ledger_root=`
(default $LEDGER_ROOT or ledgers/data): a run whose run_id is already complete
is skipped, and its last line then comes from its ledger row; anything else is
(re)run, its manifest written, then its tables and, last, its runs row. A cell
that raises is recorded with status failed. `-m campaign=q1` runs a campaign
(conf/campaign/) through the campaign sweeper and the configured launcher.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from experiments.cell import CellResult, arm_of, format_summary, run_cell
from experiments.ledger_io import (
    RunKey,
    completed_row,
    failed_runs_row,
    json_line,
    run_key,
    run_lock,
    runs_row,
    skipped_summary,
)
from experiments.manifest import build_manifest, write_manifest
from experiments.validation import check_ledger_root, validate_config
from ledgers.writer import write_run


def _record(cfg: DictConfig, root: Path, key: RunKey) -> CellResult:
    """Run the cell and persist it; a raising cell leaves a failed runs row behind."""
    wall0 = time.perf_counter()
    try:
        result = run_cell(cfg)
    except Exception as err:
        wall = time.perf_counter() - wall0
        write_manifest(root, build_manifest(cfg, key, status="failed", error=repr(err)))
        write_run(root, key.campaign, key.run_id, {}, failed_runs_row(cfg, key, wall))
        raise
    row = runs_row(cfg, key, result, time.perf_counter() - wall0)
    manifest = build_manifest(
        cfg, key, status="complete", summary=result.summary,
        workload_meta=result.workload_meta, units=result.units,
    )
    write_manifest(root, manifest)
    # Empty tables (trace when off, slab outside S2) are not written.
    tables = {name: cols for name, cols in result.tables.items() if len(next(iter(cols.values())))}
    write_run(root, key.campaign, key.run_id, tables, row)
    return result


def main_run(cfg: DictConfig) -> dict:
    """Validate, skip or run the cell, print the summary and last-line JSON; return it."""
    validate_config(cfg)
    if not cfg.write_ledgers:
        result = run_cell(cfg)
        print(format_summary(result.summary))
        print(json_line(result.summary), flush=True)
        return result.summary
    root = check_ledger_root(cfg.ledger_root)
    key = run_key(cfg)
    with run_lock(root, key):
        done = completed_row(root, key)
        if done is None:
            result = _record(cfg, root, key)
    if done is not None:
        out = skipped_summary(arm_of(cfg.org), done)
        print(f"skipped: run {key.run_id} ({key.campaign}, {cfg.org} {cfg.budget} seed "
              f"{key.seed}) is already complete in {root}")
        print(json_line(out), flush=True)
        return out
    print(format_summary(result.summary))
    print(f"  ledger       run {key.run_id} written to {root} (campaign {key.campaign})")
    print(json_line(result.summary), flush=True)
    return result.summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return main_run(cfg)  # the launcher records a raising job as failed
    try:
        return main_run(cfg)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
