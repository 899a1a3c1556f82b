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

from experiments.vllm_arm import (
    check_vllm_cell,
    is_vllm_executor,
    run_cell_on_vllm,
    vllm_executor_config,
)
from experiments.workload import build_workload
from serving_core.engine import run_engine, serve
from serving_core.executor.profiles import load_device_profile
from serving_core.executor.simulated import build_step_model
from serving_core.geometry import geometry_from_config
from serving_core.layout import normalize_org
from serving_core.planner import plan_budget, units_for
from serving_core.records import MECHANISM_KEYS
from serving_core.scheduler import SchedulerConfig

ARMS = ("s0", "s1", "s2", "d0", "n0", "s2_retention")
SUMMARY_KEYS = (
    "org",
    "budget",
    "seed",
    "completed",
    "failed",
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


@dataclass
class CellResult:
    summary: dict
    tables: dict[str, dict[str, list]]
    episode: dict[str, Any]  # ledger episode and request-span bounds (seconds)
    workload_meta: dict = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    memory: object = field(default=None, repr=False)  # final allocator state (inspection, tests)
    run_seconds: float = float("nan")  # workload build + engine

    @property
    def engine_seconds(self) -> float:
        return float(self.summary["wall_seconds"])
    engine_config: dict = field(default_factory=dict)  # a real engine's effective settings


def arm_of(org: str) -> str:
    arm = str(org).strip().lower().replace("+", "_")
    if arm not in ARMS:
        raise ValueError(f"org={org!r}: allowed values are {', '.join(ARMS)}")
    return arm


def cell_config(cfg: DictConfig | dict) -> dict:
    """The resolved config that identifies a cell (no paths, no bookkeeping)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return {k: v for k, v in data.items() if k not in _NON_IDENTITY_KEYS}


def config_hash(cfg: DictConfig | dict) -> str:
    blob = json.dumps(cell_config(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def scheduler_config(cfg, arm: str, device) -> SchedulerConfig:
    eng = cfg.engine
    tokens = eng.max_num_batched_tokens or device.max_num_batched_tokens
    return SchedulerConfig(
        cap=int(eng.cap),
        max_num_batched_tokens=int(tokens),
        headroom=float(eng.headroom),
        retention_k=int(cfg.retention.k) if arm == "s2_retention" else None,
        pinning_k=None if eng.pinning_k is None else int(eng.pinning_k),
        admission=str(eng.get("admission", "full_prompt")),
        checkpoint_placement=eng.get("checkpoint_placement"),
        align_chunks=eng.get("align_chunks"),
        slab_policy=str(eng.get("slab_policy", "write_once")),
    )


INPROC_NAME = "torch_inproc"  # executor=torch_inproc: the engine in this process


@dataclass
class _Served:
    """Tables and summary of a run served over HTTP (no allocator to inspect)."""

    tables: dict
    summary: dict
    memory: object = None


def _run_torch(cfg, geometry, org, pool_units, sched_cfg, specs, on_step):
    """Serve the workload on the real executor: the model on the organization's arenas,
    wall clock, arrivals released at their planned times."""
    from serving_core.executor.torch_config import check_checkpoint, torch_executor_config
    from serving_core.executor.torch_executor import build_torch_engine
    from serving_core.model.falcon_h1 import FalconH1

    tcfg = torch_executor_config(cfg.executor)
    check_checkpoint(tcfg, geometry)
    model = FalconH1.load(tcfg.checkpoint, tcfg.device, tcfg.dtype, tcfg.scan_chunk)
    engine = build_torch_engine(
        model, geometry, org, pool_units, sched_cfg, trace=bool(cfg.trace),
        budget_label=str(cfg.budget), on_step=on_step,
    )
    engine.check_feasible(specs)  # before the clock matters
    return serve(engine, specs)


def run_cell(cfg: DictConfig, on_step=None) -> CellResult:
    """Run one cell (simulated time, or wall time with executor=torch) and return its
    records and summary.

    `on_step(scheduler, memory)` is the engine's per-step hook (invariant checks in tests).
    """
    from serving_core.executor.torch_config import is_torch_executor, torch_executor_config

    run0 = time.perf_counter()
    arm = arm_of(cfg.org)
    org = normalize_org(arm)
    geometry = geometry_from_config(cfg.model)
    plan = plan_budget(geometry, str(cfg.budget))
    real = is_torch_executor(cfg.executor)
    vllm = is_vllm_executor(cfg.executor)
    if vllm:
        device = vllm_executor_config(cfg.executor)
        check_vllm_cell(device, arm)
    else:
        device = (torch_executor_config(cfg.executor) if real
                  else load_device_profile(cfg.executor))
    sched_cfg = scheduler_config(cfg, arm, device)
    workload = build_workload(cfg.workload, cfg.load, int(cfg.seed))
    wall0 = time.perf_counter()
    pool_units = units_for(plan, org)
    if vllm:  # real vLLM over HTTP: its own organization (N0), the blocks it allocated
        result = run_cell_on_vllm(cfg, device, geometry, sched_cfg, workload.requests)
        pool_units = result.units
    elif real and device.name == INPROC_NAME:
        result = _run_torch(cfg, geometry, org, pool_units, sched_cfg, workload.requests, on_step)
    elif real:  # the server in a subprocess, driven over HTTP (on_step does not cross it)
        from experiments.http_run import run_cell_over_http

        tables, served = run_cell_over_http(cfg, device, geometry, arm, sched_cfg,
                                            workload.requests)
        result = _Served(tables, served)
    else:
        step_model = build_step_model(geometry, device, org, cfg.engine.indirection_overhead)
        result = run_engine(
            geometry,
            org,
            pool_units,
            sched_cfg,
            workload.requests,
            step_model,
            trace=bool(cfg.trace),
            budget_label=str(cfg.budget),
            on_step=on_step,
        )
    summary = {"org": arm, "budget": str(cfg.budget), "seed": int(cfg.seed)}
    summary.update({k: result.summary[k] for k in SUMMARY_KEYS if k in result.summary})
    summary["wall_seconds"] = time.perf_counter() - wall0
    episode = {
        k: result.summary[k]
        for k in ("episode_start_s", "episode_end_s", "span_start_s", "span_end_s")
    }
    return CellResult(
        summary, result.tables, episode, dict(workload.meta), pool_units, result.memory,
        run_seconds=time.perf_counter() - run0,
        engine_config=getattr(result, "engine_config", {}),
    )


def last_line(summary: Mapping, *, run_id: str, skipped: bool, engine_seconds: float,
              run_seconds: float) -> dict:
    """The command's last-line JSON, keys LAST_LINE_KEYS (a key the summary lacks is None)."""
    values = {**summary, "engine_seconds": engine_seconds, "run_seconds": run_seconds,
              "run_id": run_id, "skipped": skipped}
    return {k: values.get(k) for k in LAST_LINE_KEYS}


def clock_label(executor_cfg) -> str:
    """The unit of a run's episode time: "simulated s" for the simulated executor,
    "wall-clock s" for real ones (torch, torch_inproc, vllm)."""
    from serving_core.executor.torch_config import is_torch_executor

    real = is_torch_executor(executor_cfg) or is_vllm_executor(executor_cfg)
    return "wall-clock s" if real else "simulated s"


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
