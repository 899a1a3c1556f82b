"""Single-run entry point: `python -m experiments.run org=s2 budget=b63 seed=42000`.

Prints a short human summary and, as its last line, one JSON object whose keys
(experiments.runners.cell.LAST_LINE_KEYS) are the same whether the run ran or was skipped.

With ledgers on (the default) the run is recorded under `ledger_root=`
(default $LEDGER_ROOT or ledgers/data): a run whose run_id is already complete,
its files intact, is skipped, and its last line is read back from its runs row
and manifest; a complete run whose files are damaged is moved to the quarantine
(ledgers.integrity) and redone; anything else is (re)run, its manifest written,
then its tables and, last, its runs row. A cell that raises is recorded with
status failed. Bad input ends with one line and exit code 2 (experiments.config.bad_input).
`-m campaign=q1` runs a campaign (conf/campaign/) through the campaign sweeper
and the configured launcher.

`main` is Hydra's task function and only hands the composed config to `main_run`, the
plain function that tests, the sensitivity study and the launchers' jobs call. Two
private Hydra functions are replaced, each for a reason a test holds: Hydra's error
report (bad input in one line, experiments.config.bad_input) and, for start-up,
`Hydra.get_mode`, which composes the whole config a second time only to read
`hydra.mode` (conf/ never sets it; about 0.1 s CPU of a 1 s single run). A campaign on
the fork launcher composes once and forks its jobs, so there the saving is one
composition per campaign.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from experiments.config.bad_input import bad_input_message, exit_bad_input, report_bad_input
from experiments.config.validation import check_ledger_root, validate_config
from experiments.runners.cell import (
    CellResult,
    checked_engine,
    clock_label,
    format_summary,
    last_line,
    run_cell,
)
from experiments.runners.ledger_io import (
    RunKey,
    completed_row,
    failed_runs_row,
    json_line,
    run_key,
    run_lock,
    runs_row,
    skipped_line,
)
from experiments.runners.manifest import build_manifest, read_manifest, write_manifest
from experiments.runners.run_plan import RunPlan
from experiments.runners.spec import resolved_config
from ledgers.writer import write_run

# `HSL_PHASES=<file>`: at exit, write the marks of this process's phases there (wall clock
# in epoch seconds and, as cpu_<mark>, the process's CPU seconds so far: imported, composed,
# cell start/end, end) with the cell's own engine and run seconds; `make bench BENCH=single`
# reads them. Unset, nothing is written.
PHASES_ENV = "HSL_PHASES"
_PHASES: dict[str, float] = {"imported": time.time(), "cpu_imported": time.process_time()}


def _mark(name: str, value: float | None = None) -> None:
    if value is None:
        _PHASES[name], _PHASES[f"cpu_{name}"] = time.time(), time.process_time()
    else:
        _PHASES[name] = value


def _write_phases(path: str) -> None:
    _mark("end")
    Path(path).write_text(json.dumps(_PHASES))


if os.environ.get(PHASES_ENV):
    atexit.register(_write_phases, os.environ[PHASES_ENV])


def _ran_line(key: RunKey, result: CellResult) -> dict:
    return last_line(result.summary, run_id=key.run_id, skipped=False,
                     engine_seconds=result.engine_seconds, run_seconds=result.run_seconds)


def _record(cfg: DictConfig, root: Path, key: RunKey, plan: RunPlan, engine,
            resolved: dict | None) -> dict:
    """Run the cell and persist it; a raising cell leaves a failed runs row behind.
    `resolved`: the config as plain Python, converted once at the start (the manifest's)."""
    run0 = time.perf_counter()
    try:
        result = _timed_cell(cfg, plan, engine)
    except Exception as err:
        elapsed = time.perf_counter() - run0
        write_manifest(root, build_manifest(cfg, key, status="failed", error=repr(err),
                                            resolved=resolved))
        write_run(root, key.campaign, key.run_id, {}, failed_runs_row(cfg, key, elapsed))
        raise
    line = _ran_line(key, result)
    row = runs_row(cfg, key, result, result.run_seconds)
    manifest = build_manifest(
        cfg, key, status="complete", summary=line,
        workload_meta=result.workload_meta, units=result.units, engine=result.engine_config,
        resolved=resolved,
    )
    write_manifest(root, manifest)
    # Empty tables (trace when off, slab outside S2) are not written.
    tables = {name: cols for name, cols in {**result.tables, **result.extra_tables}.items()
              if len(next(iter(cols.values())))}
    write_run(root, key.campaign, key.run_id, tables, row, result.workload_columns)
    return line


def _timed_cell(cfg: DictConfig, plan: RunPlan, engine) -> CellResult:
    _mark("cell_start")
    result = run_cell(cfg, plan=plan, engine=engine)
    _mark("cell_end")
    _mark("engine_seconds", result.engine_seconds)
    _mark("run_seconds", result.run_seconds)
    return result


def _manifest_or_none(root: Path, key: RunKey) -> dict | None:
    try:
        return read_manifest(root, key.campaign, key.run_id)
    except (OSError, ValueError):
        return None


def main_run(cfg: DictConfig) -> dict:
    """Validate, skip or run the cell, print the summary and last-line JSON; return it.

    The last line has the same keys (experiments.runners.cell.LAST_LINE_KEYS) whether the run
    ran or was skipped as complete.
    """
    _mark("composed")
    resolved = resolved_config(cfg)  # converted once for the plan and the identity
    plan = validate_config(cfg, preflight=False, resolved=resolved)
    engine = checked_engine(plan)  # built once (in process), checked before anything is written
    key = run_key(cfg, resolved)
    if not cfg.write_ledgers:
        line = _ran_line(key, _timed_cell(cfg, plan, engine))
        print(format_summary(line, clock_label(cfg.executor)))
        print(json_line(line), flush=True)
        return line
    root = check_ledger_root(cfg.ledger_root)
    with run_lock(root, key):
        done, moved = completed_row(root, key)
        if moved.moved:
            print(f"run {key.run_id}: {moved.format()}")
        line = _record(cfg, root, key, plan, engine, resolved) if done is None else None
    if done is not None:
        line = skipped_line(cfg, done, _manifest_or_none(root, key))
        print(f"skipped: run {key.run_id} ({key.campaign}, {cfg.org} {cfg.budget} seed "
              f"{key.seed}) is already complete in {root}")
        print(json_line(line), flush=True)
        return line
    print(format_summary(line, clock_label(cfg.executor)))
    print(f"  ledger       run {key.run_id} written to {root} (campaign {key.campaign})")
    print(json_line(line), flush=True)
    return line


def _one_line_bad_input(task):
    """A single run's bad input ends in the task, in one line with exit code 2: Hydra would
    print a line of its own before re-raising it. In a sweep the launcher records it."""

    @functools.wraps(task)
    def run(cfg: DictConfig):
        try:
            return task(cfg)
        except (ValueError, OmegaConfBaseException) as err:
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                raise
            exit_bad_input(bad_input_message(err) or str(err))

    return run


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@_one_line_bad_input
def main(cfg: DictConfig) -> dict:
    """The composed config to the plain function."""
    return main_run(cfg)


def _mode_from_overrides(self, config_name, overrides) -> RunMode | None:
    """Hydra's get_mode without its extra composition of the whole config (a tenth of a
    run's start-up): conf/ never sets hydra.mode (a test holds it), so only an override can."""
    for override in reversed(overrides):
        key, _, value = override.lstrip("+").partition("=")
        if key == "hydra.mode" and value.upper() in RunMode.__members__:
            return RunMode[value.upper()]
    return None


def install_hooks() -> None:
    """The two Hydra replacements (get_mode, bad input in one line) the command runs under."""
    from hydra._internal.hydra import Hydra  # hydra-core==1.3.8

    Hydra.get_mode = _mode_from_overrides
    report_bad_input()


def cli() -> None:
    """The command: Hydra's main with bad input reported in one line, exit code 2."""
    install_hooks()
    try:
        main()
    finally:
        # Everything is recorded and printed: the interpreter's last full garbage collection
        # would only traverse what exiting frees anyway (about 0.15 s CPU of a single run).
        gc.freeze()


if __name__ == "__main__":
    cli()
