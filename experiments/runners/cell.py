"""One serving cell: resolve a config into geometry, budget plan, workload and executor, run it.

`run_cell` is the plain function behind the Hydra entry point (experiments.run),
testable without a command line. It returns the engine's tables, the summary the
command prints, and the episode bounds the ledgers record.

Timings: `engine_seconds` is the engine loop alone, `run_seconds` the whole cell
(workload build plus engine; no process start-up, no ledger writes). In
`CellResult.summary` the engine time keeps the engine's own key `wall_seconds`;
`last_line` gives the command's output its one shape with the unambiguous names.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from experiments.runners.run_plan import RunPlan, plan_run
from experiments.runners.spec import (
    SIMULATED,
    TORCH_HTTP,
    TORCH_INPROC,
    VLLM,
    VLLM_VIRTUAL,
    executor_path,
)
from ledgers.arms import ARM_NAMES, arm
from serving_core.engine_spec import executor_rule_declarations, rule_declarations
from serving_core.records import MECHANISM_KEYS
from serving_core.rules import declared, default_of, hydra_key

ARMS = ARM_NAMES  # ledgers.arms: the one table of arm names
SUMMARY_KEYS = (
    "org",
    "budget",
    "seed",
    "completed",
    "failed",
    "refused",  # of the failed: requests that cannot fit the budget alone (trace, sessions)
    "output_tokens",
    "throughput_ledger",
    "throughput_span",
    "ttft_p50",
    "ttft_p99",
    "e2e_p50",
    "e2e_p99",
    "tpot_p99",
    "itl_p50",  # inter-token times at the client (runs over HTTP only)
    "itl_p99",
    "preemptions",
    "prefix_hit_tokens",
    "prefill_tokens_computed",
    "max_running",
    "max_waiting",
    *MECHANISM_KEYS,
    "sim_seconds",
    "wall_seconds",
)
# The command's last-line JSON: the same keys whether the run ran or was skipped.
LAST_LINE_KEYS = (
    *(k for k in SUMMARY_KEYS if k != "wall_seconds"),
    "engine_seconds", "run_seconds", "run_id", "skipped",
)
# Keys that define a cell's identity (what the run_id hashes); bookkeeping keys are excluded.
_NON_IDENTITY_KEYS = ("ledger_root", "write_ledgers", "hydra", "campaign", "replicate", "progress")
# Keys added after runs were collected, at the default that reproduces the earlier engine
# exactly: at that value they stay out of a cell's identity, so runs collected before the
# key existed keep their run_id (a test holds each default to the config file's).
_NEUTRAL_SETTINGS: dict[tuple[str, str], object] = {
    ("executor", "state_page_s"): 0.0,
    ("executor", "conv_slot_s"): 0.0,
    ("executor", "kv_page_s"): 0.0,
    ("executor", "prefill_chunk_s"): 0.0,
    ("executor", "logit_gemm_s"): 0.0,
    ("executor", "logit_row_s"): 0.0,
    ("executor", "logit_block_rows"): 4,
    ("model", "kv_group_heads"): None,
    ("model", "state_codec"): "auto",
    ("host_tier", "capacity_bytes"): None,
}
# Documentation inside a section, never identity: a preset's card (its public source and
# published size, serving_core/model_card.py).
DOCUMENTATION_KEYS = (("model", "card"),)


def identity_neutral_defaults() -> dict[tuple[str, str], object]:
    """(section, key) -> neutral default: every engine rule declared identity-neutral at its
    declared default (serving_core/rules.py), and the other settings above."""
    rules = {tuple(hydra_key(f).split(".", 1)): default_of(f)
             for _, f in rule_declarations() + executor_rule_declarations()
             if declared(f).config and declared(f).identity_neutral}
    return {**rules, **_NEUTRAL_SETTINGS}


# Sections added after runs were collected: left out of the identity once empty (every
# key of theirs at its neutral default).
IDENTITY_NEUTRAL_SECTIONS = ("host_tier",)


@dataclass
class CellResult:
    summary: dict
    tables: dict[str, dict[str, list]]
    episode: dict[str, Any]  # ledger episode and request-span bounds (seconds)
    workload_meta: dict = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    memory: object = field(default=None, repr=False)  # final allocator state (inspection, tests)
    run_seconds: float = float("nan")  # workload build + engine

    engine_config: dict = field(default_factory=dict)  # the rules the engine ran (its record)
    # the workload's request columns (ledgers.schemas.WORKLOAD_COLUMNS): name -> {request_id:
    # value}; empty for a workload that defines none (the writer stores the sentinel)
    workload_columns: dict[str, dict[int, int]] = field(default_factory=dict)
    # tables the engine reports beside `tables` (the lineage of a traced run)
    extra_tables: dict[str, dict[str, list]] = field(default_factory=dict)

    @property
    def engine_seconds(self) -> float:
        return float(self.summary["wall_seconds"])


def arm_of(org: str) -> str:
    """The arm name of an `org=` value (ledgers.arms); ValueError lists the choices."""
    return arm(org).name


def cell_config(cfg: DictConfig | dict) -> dict:
    """The resolved config that identifies a cell (no paths, no bookkeeping)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    out = {k: v for k, v in data.items() if k not in _NON_IDENTITY_KEYS}
    for (section, key), default in identity_neutral_defaults().items():
        group = out.get(section)
        if isinstance(group, dict) and key in group and group[key] == default:
            out[section] = {k: v for k, v in group.items() if k != key}
    for section, key in DOCUMENTATION_KEYS:
        group = out.get(section)
        if isinstance(group, dict) and key in group:
            out[section] = {k: v for k, v in group.items() if k != key}
    for section in IDENTITY_NEUTRAL_SECTIONS:
        if out.get(section) == {}:
            del out[section]
    return out


def config_hash(cfg: DictConfig | dict) -> str:
    blob = json.dumps(cell_config(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class _Served:
    """Tables and summary of a run served over HTTP (no allocator to inspect)."""

    tables: dict
    summary: dict
    memory: object = None
    engine_config: dict = field(default_factory=dict)


def checked_engine(plan: RunPlan, on_step=None):
    """Check, before a run starts, that its engine runs the requested rules (ValueError,
    one line). An engine of this process (simulated, or torch in process: its model
    loaded) is built here from the plan's spec, once, checked as it is built, and returned
    for run_cell; the server's engine (torch over HTTP) is checked without its model
    (preflight: the server builds it) and None returned, as for a run served elsewhere
    (vLLM)."""
    from serving_core.builder import build_engine, preflight

    if plan.path in (SIMULATED, TORCH_INPROC):
        return build_engine(plan.spec, on_step=on_step)
    if plan.path == TORCH_HTTP:
        preflight(plan.spec)
    return None


def run_cell(cfg: DictConfig, on_step=None, *, plan: RunPlan | None = None,
             engine=None) -> CellResult:
    """Run one cell (simulated time, or wall time on a real executor) and return its
    records, its summary and the rules its engine ran (read back from the engine).

    `plan`: the config's run plan (validate_config's; None: derived here, unchecked);
    `engine`: the plan's engine already built (checked_engine; None: built here).
    `on_step(scheduler, memory)` is the engine's per-step hook (invariant checks in tests).
    """
    from experiments.workloads.workload import build_workload

    run0 = time.perf_counter()
    plan = plan or plan_run(cfg)
    name, path, spec = plan.arm.name, plan.path, plan.spec
    if path == VLLM:
        from experiments.runners.vllm_arm import check_vllm_cell, vllm_executor_config

        device = vllm_executor_config(cfg.executor)
        check_vllm_cell(device, name)
    workload = build_workload(cfg.workload, cfg.load, int(cfg.seed))
    wall0 = time.perf_counter()
    pool_units = plan.units
    if path == VLLM_VIRTUAL:  # vLLM's scheduler on a virtual clock, our step model
        from experiments.runners.vllm_virtual import run_cell_on_vllm_virtual

        result = run_cell_on_vllm_virtual(cfg, plan.geometry, spec.scheduler,
                                          workload.requests)
        pool_units = result.units
    elif path == VLLM:  # real vLLM over HTTP: its own organization (N0), the blocks it allocated
        from experiments.runners.vllm_arm import run_cell_on_vllm

        result = run_cell_on_vllm(cfg, device, plan.geometry, spec.scheduler,
                                  workload.requests)
        pool_units = result.units
    elif path == TORCH_HTTP:  # the server in a subprocess, driven over HTTP
        from experiments.runners.http_run import run_cell_over_http

        tables, served, effective = run_cell_over_http(spec, workload.requests)
        result = _Served(tables, served, engine_config=effective)
    else:
        result = _serve_here(plan, engine, on_step, workload.requests,
                             refuse_unfit=workload.reusable_prefix is not None)
    summary = {"org": name, "budget": str(cfg.budget), "seed": int(cfg.seed)}
    summary.update({k: result.summary[k] for k in SUMMARY_KEYS if k in result.summary})
    summary["wall_seconds"] = time.perf_counter() - wall0
    episode = {
        k: result.summary[k]
        for k in ("episode_start_s", "episode_end_s", "span_start_s", "span_end_s")
    }
    return CellResult(
        summary, result.tables, episode, dict(workload.meta), pool_units, result.memory,
        run_seconds=time.perf_counter() - run0,
        engine_config=dict(getattr(result, "engine_config", {}) or {}),
        workload_columns={**workload_columns(workload),
                          **getattr(result, "request_columns", {})},
        extra_tables=dict(getattr(result, "extra_tables", {})),
    )


def _serve_here(plan: RunPlan, engine, on_step, requests, refuse_unfit: bool):
    """Serve `requests` on this process's engine of the plan (simulated or torch in
    process): `engine` as checked_engine built it (None: built here). `refuse_unfit`
    (trace and sessions): a request that cannot fit alone is refused, not the run."""
    from serving_core.builder import build_engine
    from serving_core.engine import serve

    assert plan.path in (SIMULATED, TORCH_INPROC)
    if engine is None:
        engine = build_engine(plan.spec, on_step=on_step)
    else:  # built ahead by checked_engine: a wall clock starts at the run
        if engine.clock.wall:
            engine.start_wall_clock()
        if on_step is not None:
            engine.on_step = on_step
    result = serve(engine, requests, refuse_unfit=refuse_unfit)
    if plan.path == TORCH_INPROC:  # wall-clock timings depend on this process's settings
        from serving_core.server.process_settings import runtime_settings

        result.engine_config = {**result.engine_config, "runtime": runtime_settings()}
    return result


def workload_columns(workload) -> dict[str, dict[int, int]]:
    """The workload's request columns: each request's infinite-cache bound, where defined."""
    if workload.reusable_prefix is None:
        return {}
    return {"reusable_prefix_tokens": {
        spec.request_id: int(bound)
        for spec, bound in zip(workload.requests, workload.reusable_prefix, strict=True)}}


def last_line(summary: Mapping, *, run_id: str, skipped: bool, engine_seconds: float,
              run_seconds: float) -> dict:
    """The command's last-line JSON, keys LAST_LINE_KEYS (a key the summary lacks is None)."""
    values = {**summary, "engine_seconds": engine_seconds, "run_seconds": run_seconds,
              "run_id": run_id, "skipped": skipped}
    return {k: values.get(k) for k in LAST_LINE_KEYS}


def clock_label(executor_cfg) -> str:
    """The unit of a run's episode time: "simulated s" for the simulated executor and the
    virtual-clock vLLM arm, "wall-clock s" for real ones (torch, torch_inproc, vllm)."""
    virtual = executor_path(executor_cfg) in (SIMULATED, VLLM_VIRTUAL)
    return "simulated s" if virtual else "wall-clock s"


def format_summary(summary: Mapping, clock: str = "simulated s") -> str:
    """A short human summary of one run (from its `last_line`); `clock` names the unit of
    its episode time (`clock_label` of the run's executor)."""
    s = summary
    return "\n".join(
        [
            f"{s['org']} {s['budget']} seed {s['seed']}: {s['completed']} completed, "
            f"{s['failed']} failed, {s['output_tokens']} output tokens in "
            f"{s['sim_seconds']:.1f} {clock}",
            f"  throughput   {s['throughput_ledger']:.1f} tok/s (ledger)  "
            f"{s['throughput_span']:.1f} tok/s (span)",
            f"  TTFT p50/p99 {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} s   E2E p50/p99 "
            f"{s['e2e_p50']:.2f} / {s['e2e_p99']:.2f} s   TPOT p99 {1000 * s['tpot_p99']:.1f} ms",
            f"  preemptions  {s['preemptions']}   prefix-hit tokens {s['prefix_hit_tokens']}   "
            f"prefill computed {s['prefill_tokens_computed']}   max running/waiting "
            f"{s['max_running']}/{s['max_waiting']}",
            f"  wall clock   engine {s['engine_seconds']:.2f} s, cell {s['run_seconds']:.2f} s",
        ]
    )
