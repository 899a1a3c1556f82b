"""Campaign driver: plan a campaign's runs, check them all, skip complete ones, launch the
rest through the configured Hydra launcher, and summarize.

`python -m experiments.run -m campaign=q1` runs this through the campaign
sweeper (hydra_plugins/hsl_campaign). The sweep itself is defined in
experiments.campaigns.sweeps. Every cell is composed (experiments.campaigns.composer) and validated
before the first run starts; a bad one fails the campaign with a message that
names the field and a cell it rejects. `python -m experiments.campaigns.campaign
campaign=q1` lists the runs without running them.
"""

from __future__ import annotations

import gc
import json
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.utils import JobStatus
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.campaigns.composer import CellComposer
from experiments.campaigns.sweeps import (
    CampaignError,
    CampaignSpec,
    Job,
    expand_jobs,
    williams_rows,
)
from experiments.config.bad_input import EXIT_BAD_INPUT, bad_input_message
from experiments.config.validation import check_ledger_root, validate_config
from experiments.runners.ledger_io import RunKey, run_key
from experiments.runners.provenance import prereg_plan_hash
from ledgers.commands import module_command

MAX_LISTED = 10  # invalid cells or failures listed in a message

__all__ = ["CampaignError", "CampaignSpec", "CellComposer", "Job", "expand_jobs",
           "plan_campaign", "plan_runs", "order_runs", "run_campaign", "williams_rows"]


class CampaignFailed(CampaignError):
    """The campaign ran but some runs failed (not bad input: exit code 1)."""

    bad_input = False


@dataclass(frozen=True)
class PlannedRun:
    job: Job
    key: RunKey
    cfg: DictConfig = field(repr=False, compare=False)
    # the config as plain Python (None: it does not resolve), for cheap reads such as
    # experiments.runners.ledger_io.cell_columns(cfg, resolved)
    resolved: dict | None = field(default=None, repr=False, compare=False)

    @property
    def cell(self) -> tuple[str, ...]:
        """The job's overrides without its seed: the condition ordered within a seed."""
        return tuple(o for o in self.job.overrides if not o.lstrip("+~").startswith("seed="))


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off for the block: planning allocates millions of
    config nodes it keeps, which the collector would walk again and again (~40% of the
    planning's CPU); what the block leaves as garbage is collected after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def plan_runs(jobs: Sequence[Job], composer: CellComposer) -> list[PlannedRun]:
    """Compose and validate every job; any invalid one fails the campaign before it starts."""
    with _collector_paused():
        planned, errors = _compose_and_check(jobs, composer)
    if errors:
        lines = [f"{msg} ({len(bad)} of {len(jobs)} cells, e.g. [{' '.join(bad[0].overrides)}])"
                 for msg, bad in list(errors.items())[:MAX_LISTED]]
        if len(errors) == 1:
            raise CampaignError(f"{lines[0]}; no run was started")
        if len(errors) > MAX_LISTED:
            lines.append(f"... and {len(errors) - MAX_LISTED} more errors")
        num_bad = sum(len(v) for v in errors.values())
        raise CampaignError(f"{num_bad} of {len(jobs)} cells are invalid; no run was started:\n  "
                            + "\n  ".join(lines))
    return planned


def _compose_and_check(jobs: Sequence[Job], composer: CellComposer
                       ) -> tuple[list[PlannedRun], dict[str, list[Job]]]:
    """The valid jobs' planned runs, and message -> the jobs it rejects."""
    planned: list[PlannedRun] = []
    errors: dict[str, list[Job]] = {}
    for job in jobs:
        try:
            cfg, resolved = composer.compose_resolved(job.overrides)  # resolved once for both
            validate_config(cfg, check_root=False, resolved=resolved)
            key = run_key(cfg, resolved)
            prereg_plan_hash(key.question)
        except (ValueError, HydraException, OmegaConfBaseException) as err:
            errors.setdefault(" ".join(str(err).split()), []).append(job)
            continue
        planned.append(PlannedRun(job, key, cfg, resolved))
    return planned, errors


def order_runs(runs: Sequence[PlannedRun], order: str) -> list[PlannedRun]:
    """product: expansion order; seed_major: grouped by seed; balanced: grouped by seed,
    the conditions of seed i in row i of a Williams design (cycled)."""
    if order == "product":
        return list(runs)
    by_seed: dict[int, list[PlannedRun]] = {}
    for run in runs:
        by_seed.setdefault(run.key.seed, []).append(run)
    out = []
    for i, seed in enumerate(sorted(by_seed)):
        group = by_seed[seed]
        if order == "balanced" and len(group) > 1:
            rows = williams_rows(len(group))
            group = [group[c] for c in rows[i % len(rows)]]
        out += group
    return out


def _unique(runs: Sequence[PlannedRun]) -> tuple[list[PlannedRun], int]:
    seen, out = set(), []
    for run in runs:
        if run.key.run_id not in seen:
            seen.add(run.key.run_id)
            out.append(run)
    return out, len(runs) - len(out)


def _ledger_root(runs: Sequence[PlannedRun]) -> Path:
    roots = sorted({str(r.cfg.ledger_root) for r in runs})
    if len(roots) != 1:
        raise CampaignError(f"ledger_root: a campaign writes to one ledger root, got {roots}")
    if not all(r.cfg.write_ledgers for r in runs):
        raise CampaignError("write_ledgers=false: a campaign records every run in the ledgers")
    try:
        return check_ledger_root(roots[0])
    except ValueError as err:
        raise CampaignError(str(err)) from err


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def launch_overrides(run: PlannedRun, root: Path) -> list[str]:
    """The job's overrides with the ledger root made absolute (workers may run elsewhere)."""
    keep = [o for o in run.job.overrides if not o.lstrip("+~").startswith("ledger_root=")]
    return [*keep, f"ledger_root={_quoted(str(root))}"]


def prepare_workloads(runs: Sequence[PlannedRun]) -> None:
    """Build the tokenized ShareGPT cache once here, not in every parallel worker, and keep
    it loaded, with the provenance every runs row stamps: forked runs inherit all of it."""
    from experiments.runners import provenance
    from experiments.workloads import sharegpt
    from experiments.workloads.workload import default_cache_dir

    tokenizers = sorted({str(r.cfg.workload.tokenizer) for r in runs
                         if str(r.cfg.workload.source).lower() == "sharegpt"})
    cache = default_cache_dir()
    for tok in tokenizers:
        if not sharegpt.is_cached(tok, cache):
            print(f"building the ShareGPT token cache for {tok} under {cache} (first use) ...",
                  flush=True)
        sharegpt.load_pool(tok, cache)
    provenance.code_version()
    provenance.environment()
    for question in sorted({r.key.question for r in runs}):
        provenance.prereg_plan_hash(question)


# ---------------------------------------------------------------- launching and the summary


@dataclass
class CampaignSummary:
    campaigns: tuple[str, ...]
    ledger_root: str
    planned: int
    done: int = 0
    skipped: int = 0
    failed: int = 0
    merged_duplicates: int = 0
    wall_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        keys = ("campaigns", "ledger_root", "planned", "done", "skipped", "failed",
                "merged_duplicates", "wall_seconds")
        return {k: getattr(self, k) for k in keys}

    def format(self) -> str:
        lines = [
            f"campaign {', '.join(self.campaigns)}: {self.planned} runs - {self.done} done, "
            f"{self.skipped} skipped (already complete), {self.failed} failed; "
            f"wall time {self.wall_seconds:.1f} s",
            f"ledgers: {self.ledger_root}  "
            f"(check: {module_command('ledgers.check', self.ledger_root)})",
        ]
        if self.merged_duplicates:
            lines.append(f"note: {self.merged_duplicates} duplicate cells ran once")
        lines += [f"failed: {f}" for f in self.failures[:MAX_LISTED]]
        if len(self.failures) > MAX_LISTED:
            lines.append(f"failed: ... and {len(self.failures) - MAX_LISTED} more")
        return "\n".join(lines)


def _failure_reason(ret) -> str:
    if ret is None:
        return "the launcher raised before returning this job"
    if ret.status == JobStatus.FAILED:
        return f"{type(ret._return_value).__name__}: {ret._return_value}"
    return "finished without a complete runs row"


def _was_skipped(ret) -> bool:
    if ret is None or ret.status != JobStatus.COMPLETED:
        return False
    value = ret._return_value
    return isinstance(value, Mapping) and bool(value.get("skipped"))


def launch_runs(launcher, runs: Sequence[PlannedRun], root: Path, batch_size: int | None,
                progress) -> tuple[list, list[str]]:
    """Launch in batches; returns one JobReturn (or None) per run and launcher-level errors."""
    returns: list = []
    errors: list[str] = []
    reports_progress = hasattr(launcher, "progress")
    if reports_progress:
        launcher.progress = progress
    size = batch_size or len(runs)
    for start in range(0, len(runs), size):
        batch = runs[start : start + size]
        overrides = [launch_overrides(r, root) for r in batch]
        try:
            got = list(launcher.launch(overrides, initial_job_idx=start))
        except Exception as err:  # submitit and Ray raise when a job process dies
            errors.append(f"jobs {start}..{start + len(batch) - 1}: {type(err).__name__}: {err}")
            got = [None] * len(batch)
        returns += got
        if not reports_progress:
            progress.update(len(batch))
    return returns, errors


def run_campaign(spec: CampaignSpec, arguments: Sequence[str], *, config_loader,
                 config: DictConfig, launcher) -> CampaignSummary:
    """Plan, check, skip, launch and summarize one campaign; raise if any run failed."""
    from tqdm import tqdm

    from ledgers.integrity import quarantine_damage, scan_root

    tqdm.monitor_interval = 0  # no monitor thread: the launcher forks job processes

    wall0 = time.perf_counter()
    jobs = expand_jobs(spec, arguments, str(config.campaign_name))
    composer = CellComposer(config_loader, config)
    planned = plan_runs(jobs, composer)
    if hasattr(launcher, "composer"):  # one cache of base configs for planning and launching
        launcher.composer = composer
    root = _ledger_root(planned)
    planned, merged = _unique(order_runs(planned, spec.order))
    campaigns = tuple(sorted({r.key.campaign for r in planned}))
    # Damaged runs (a file missing, unreadable or not matching its checksum) are moved
    # aside first, so they are not complete and run again below.
    moved = quarantine_damage(scan_root(root, campaigns, deep=True))
    if moved.moved:
        print(moved.format(), flush=True)
    complete = scan_root(root, campaigns).complete_runs
    todo = [r for r in planned if (r.key.campaign, r.key.run_id) not in complete]
    summary = CampaignSummary(campaigns, str(root), len(planned), merged_duplicates=merged)
    summary.skipped = len(planned) - len(todo)
    print(f"campaign {', '.join(campaigns)}: {len(planned)} runs, {summary.skipped} already "
          f"complete, {len(todo)} to run; ledgers {root}", flush=True)
    if todo:
        prepare_workloads(todo)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, sweep_dir / "multirun.yaml")
        with tqdm(total=len(todo), desc=" ".join(campaigns), unit="run", mininterval=0.5,
                  dynamic_ncols=True) as progress:
            returns, errors = launch_runs(launcher, todo, root, spec.max_batch_size, progress)
        now_complete = scan_root(root, campaigns).complete_runs
        for run, ret in zip(todo, returns, strict=True):
            if (run.key.campaign, run.key.run_id) in now_complete:
                if _was_skipped(ret):
                    summary.skipped += 1
                else:
                    summary.done += 1
            else:
                summary.failed += 1
                cell = shlex.join(run.job.overrides)
                summary.failures.append(f"run {run.key.run_id} [{cell}]: {_failure_reason(ret)}")
        summary.failures += errors
    summary.wall_seconds = time.perf_counter() - wall0
    print(summary.format())
    print(json.dumps(summary.as_dict()), flush=True)
    if summary.failed:
        raise CampaignFailed(f"{summary.failed} of {summary.planned} runs failed; rerunning the "
                            "same command redoes only those (see the list above)")
    return summary


# ---------------------------------------------------------------- planning without running

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def plan_campaign(overrides: Sequence[str], config_dir: str | Path = CONF_DIR
                  ) -> tuple[CampaignSpec, list[PlannedRun]]:
    """The checked, ordered, de-duplicated runs a multirun with `overrides` would plan.

    `overrides` are command-line overrides as for `python -m experiments.run -m`,
    e.g. ["campaign=q1", "hydra.sweeper.smoke=true"].
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("config", list(overrides), RunMode.MULTIRUN)
        spec = CampaignSpec.from_config(master.hydra.sweeper)
        jobs = expand_jobs(spec, list(master.hydra.overrides.task), str(master.campaign_name))
        runs = plan_runs(jobs, CellComposer(loader, master))
    return spec, _unique(order_runs(runs, spec.order))[0]


def main(argv: Sequence[str] | None = None) -> int:
    """`.venv/bin/python -m experiments.campaigns.campaign campaign=q1 [overrides]`: list the
    runs and whether each is complete; run nothing."""
    import argparse

    from ledgers.integrity import scan_root

    parser = argparse.ArgumentParser(prog=module_command("experiments.campaigns.campaign"),
                                     description=main.__doc__)
    parser.add_argument("overrides", nargs="+", help="overrides, as for experiments.run -m")
    args = parser.parse_args(argv)
    try:
        spec, runs = plan_campaign(args.overrides)
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        message = bad_input_message(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    roots = {str(r.cfg.ledger_root) for r in runs}
    complete, damaged = set(), set()
    for root in roots:
        if Path(root).is_dir():
            scan = scan_root(root)
            complete |= scan.complete_runs
            damaged |= {(r["campaign"], r["run_id"]) for r in scan.runs
                        if r["attempt"] in scan.damaged}
    for i, run in enumerate(runs):
        pair = (run.key.campaign, run.key.run_id)
        state = "complete" if pair in complete else "damaged" if pair in damaged else "to run"
        print(f"{i:5d} {run.key.run_id} {run.key.campaign:>12} {run.job.block or '-':>12} "
              f"{state:>8}  {' '.join(run.cell)} seed={run.key.seed}")
    blocks: dict[str, int] = {}
    for run in runs:
        blocks[run.job.block or "-"] = blocks.get(run.job.block or "-", 0) + 1
    todo = sum((r.key.campaign, r.key.run_id) not in complete for r in runs)
    print(f"{len(runs)} runs ({', '.join(f'{b}: {n}' for b, n in blocks.items())}); "
          f"{todo} to run; order {spec.order}; ledgers {', '.join(sorted(roots))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
