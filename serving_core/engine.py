"""The serving engine loop on a virtual clock: arrivals, steps, executor time, records.

The loop is a pure function of its inputs: no wall-clock reads feed any record,
so the same (config, seed) yields the same tables. Idle gaps jump to the next
arrival; per-step work is proportional to the scheduled requests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from serving_core.geometry import Geometry
from serving_core.memory import MemoryOrganization, build_memory
from serving_core.records import Recorder, mechanism_summary, request_columns
from serving_core.request import Request, Status
from serving_core.scheduler import Scheduler, SchedulerConfig


@dataclass
class EngineResult:
    tables: dict[str, dict[str, list]]
    summary: dict
    requests: list[Request] = field(repr=False)
    memory: MemoryOrganization = field(repr=False)


def check_feasible(mem: MemoryOrganization, specs, org: str, budget: str) -> None:
    """Fail fast when the budget cannot hold one maximal request of this workload."""
    longest = max(len(s.prompt) + int(s.output_tokens) for s in specs)
    composites = 2 if mem.has_recurrent else 0  # working state + one destination at a boundary
    need = mem.demand(math.ceil(longest / mem.block_tokens), composites)
    total = mem.total_units()
    short = {p: (need[p], total[p]) for p in need if need[p] > total[p]}
    if short:
        detail = ", ".join(f"{p} pool needs {n} units but has {t}" for p, (n, t) in short.items())
        raise ValueError(
            f"budget={budget!r} cannot hold one maximal request of {longest} tokens "
            f"under org={org}: {detail}; choose a larger budget"
        )


def _percentile(values: list[float], q: float) -> float:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def run_engine(
    geometry: Geometry,
    org: str,
    pool_units: dict[str, int],
    sched_cfg: SchedulerConfig,
    specs,
    step_model,
    trace: bool = False,
    budget_label: str = "",
    max_steps: int | None = None,
    on_step=None,
) -> EngineResult:
    """Serve `specs` (RequestSpec, arrival order) and return the run's tables and summary.

    `on_step(scheduler, memory)` runs after every step when given (invariant checks).
    """
    wall0 = time.perf_counter()
    if not specs:
        raise ValueError("workload.num_requests must be >= 1")
    recorder = Recorder(trace=trace, slab=org == "S2")
    mem = build_memory(geometry, org, pool_units, recorder, sched_cfg.slab_policy)
    check_feasible(mem, specs, org, budget_label)
    sched = Scheduler(mem, sched_cfg, recorder)
    # Requests are materialized at arrival and drop their token lists when they finish,
    # so memory follows the live set, not the workload size.
    requests: list[Request] = []
    arrivals = [float(s.arrival_s) for s in specs]
    n = len(specs)
    limit = max_steps or 20 * sum(len(s.prompt) + int(s.output_tokens) for s in specs) + 1000

    clock = 0.0
    next_arrival = 0
    next_poll = 0
    finished = 0
    while finished < n:
        while next_arrival < n and arrivals[next_arrival] <= clock:
            req = Request(specs[next_arrival], mem.block_tokens)
            requests.append(req)
            recorder.now = req.arrival_s
            sched.add_request(req, req.arrival_s)
            next_arrival += 1
        if not sched.running and not sched.waiting:
            clock = max(clock, arrivals[next_arrival])  # idle: jump to the next arrival
            while next_poll <= clock:
                recorder.sample(next_poll, sched, mem)
                next_poll += 1
            continue
        recorder.step, recorder.now = sched.step + 1, clock
        plan = sched.schedule(clock)
        if not plan:
            raise RuntimeError(
                f"step {sched.step}: nothing schedulable with {len(sched.waiting)} waiting"
            )
        new_tokens = [item.num_new for item in plan]
        contexts = [item.context for item in plan]
        crossings = sched.boundaries_crossed(plan)
        num_preempted, num_admitted = sched.num_preempted_step, sched.num_admitted_step
        t0 = clock
        dt = step_model.step_seconds(new_tokens, contexts, crossings)
        clock = t0 + dt
        # Publication, sampled tokens and finishes become visible when the step completes.
        recorder.now = clock
        initial, resume, decode = sched.complete_step(plan, clock)
        finished += sched.num_finished_step
        if on_step is not None:
            on_step(sched, mem)  # debug / test hook: invariant checks after every step
        recorder.record_step(
            step=sched.step,
            t_start_s=t0,
            duration_s=dt,
            num_scheduled=len(plan),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            prefill_tokens_initial=initial,
            prefill_tokens_resume=resume,
            decode_tokens=decode,
            num_preempted=num_preempted,
            num_admitted=num_admitted,
            **sched.plan_columns(plan),
        )
        while next_poll <= clock:
            recorder.sample(next_poll, sched, mem)
            next_poll += 1
        if sched.step > limit:
            raise RuntimeError(f"no progress after {sched.step} steps: {finished}/{n} finished")
    recorder.now = clock
    if trace:
        recorder.end(clock)
    wall = time.perf_counter() - wall0
    tables = {
        "requests": request_columns(requests),
        "poller": recorder.poller,
        "trace": recorder.trace,
        "slab": recorder.slab,
        "steps": recorder.steps,
    }
    summary = summarize(requests, sched, clock, wall)
    summary.update(
        mechanism_summary(requests, sched.step, recorder.poller, sched.prefix_hit_tokens_self)
    )
    return EngineResult(tables, summary, requests, mem)


def summarize(requests: list[Request], sched: Scheduler, clock: float, wall: float) -> dict:
    done = [r for r in requests if r.status == Status.FINISHED]
    out = sum(r.num_generated for r in done)
    episode_end = math.ceil(max((r.finish_s for r in done), default=0.0))
    span_start = min(r.arrival_s for r in requests)
    span_end = max((r.finish_s for r in done), default=span_start)
    ttft = [r.first_token_s - r.arrival_s for r in done]
    e2e = [r.finish_s - r.arrival_s for r in done]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.num_generated - 1) for r in done if r.num_generated > 1
    ]
    return {
        "completed": len(done),
        "failed": len(requests) - len(done),
        "output_tokens": out,
        "episode_start_s": 0,
        "episode_end_s": episode_end,
        "span_start_s": span_start,
        "span_end_s": span_end,
        "throughput_ledger": out / episode_end if episode_end else 0.0,
        "throughput_span": out / (span_end - span_start) if span_end > span_start else 0.0,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p99": _percentile(ttft, 99),
        "e2e_p50": _percentile(e2e, 50),
        "e2e_p99": _percentile(e2e, 99),
        "tpot_p99": _percentile(tpot, 99),
        "preemptions": sched.preemptions_total,
        "prefix_hit_tokens": sched.prefix_hit_tokens_total,
        "prefill_tokens_computed": sched.prompt_tokens_total,
        "max_running": sched.max_running,
        "max_waiting": sched.max_waiting,
        "sim_seconds": clock,
        "wall_seconds": wall,
    }
