"""The serving engine: a step-wise loop over scheduler, memory organization and executor.

`Engine` is the loop as an object: requests are added (planned arrivals are
released when the clock reaches them), `step()` runs one engine step and
reports the tokens it produced and the requests it finished. The clock is
virtual for the simulated executor (advanced by the step-time model, idle gaps
jump to the next arrival, so the same (config, seed) yields the same tables)
and wall time for a real executor. `submit` may be called from another thread
(an HTTP server) while a driver thread calls `step()` whenever `has_work()`.

`run_engine` serves a whole workload and returns its tables and summary.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving_core.executor.base import Executor, ExecutorOutput
from serving_core.executor.clocks import VirtualClock, WallClock
from serving_core.executor.modelled import PacedExecutor, SimulatedExecutor
from serving_core.geometry import Geometry
from serving_core.memory import MemoryOrganization, build_memory, org_class
from serving_core.records import Recorder, mechanism_summary, request_columns
from serving_core.request import Request, Status
from serving_core.scheduler import Scheduler, SchedulerConfig

# Re-exported: the executor protocol, the modelled executors and the clocks live in
# serving_core.executor; engines are built by serving_core.builder.build_engine.
__all__ = [
    "Engine",
    "EngineResult",
    "Executor",
    "ExecutorOutput",
    "PacedExecutor",
    "SimulatedExecutor",
    "StepOutcome",
    "VirtualClock",
    "WallClock",
    "check_feasible",
    "run_engine",
    "serve",
    "summarize",
]


@dataclass
class EngineResult:
    tables: dict[str, dict[str, list]]
    summary: dict
    requests: list[Request] = field(repr=False)
    memory: MemoryOrganization = field(repr=False)
    engine_config: dict = field(default_factory=dict)  # Engine.effective_rules(): the record


@dataclass(slots=True)
class StepOutcome:
    """One engine step: when it ran, what it computed, which tokens it produced."""

    step: int
    t_start_s: float
    duration_s: float
    num_scheduled: int
    produced: list[tuple[int, int]]  # (request id, token id) in plan order
    finished: list[int]  # request ids that finished in this step


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


def _one(values: set):
    """The value every member agrees on (a rule set per pool must be one rule)."""
    assert len(values) == 1, f"pools disagree: {sorted(values)}"
    return next(iter(values))


def _percentile(values: list[float], q: float) -> float:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan


class Engine:
    """Continuous batching over one memory organization, driven step by step.

    `on_step(scheduler, memory)` runs after every step when given (invariant checks).
    """

    def __init__(
        self,
        geometry: Geometry,
        org: str,
        pool_units: dict[str, int],
        sched_cfg: SchedulerConfig,
        executor,
        *,
        clock=None,
        trace: bool = False,
        budget_label: str = "",
        on_step=None,
        recorder: Recorder | None = None,
        memory: MemoryOrganization | None = None,
    ) -> None:
        self.geometry = geometry
        self.org = org
        self.budget_label = budget_label
        self.recorder = recorder or Recorder(trace=trace, slab=org_class(org).has_slabs)
        self.trace = self.recorder.trace_enabled
        self.mem = memory or build_memory(
            geometry, org, pool_units, self.recorder, **sched_cfg.memory_rules()
        )
        self.sched = Scheduler(self.mem, sched_cfg, self.recorder)
        self.executor = executor
        # An executor that addresses state gets it in the plan (Scheduled.state).
        self.sched.state_views = bool(getattr(executor, "reads_state", False))
        self.clock = clock or VirtualClock()
        self.on_step = on_step
        self.host_tier = None  # an EngineTier (serving_core.executor.host_tier) when on
        # Requests are materialized at arrival and drop their token lists when they finish,
        # so memory follows the live set, not the workload size.
        self.requests: list[Request] = []
        self.num_finished = 0
        self._planned: list[tuple[float, int, object]] = []  # (arrival, order, spec)
        self._order = 0
        self._inbox: deque = deque()  # specs submitted from other threads
        self._cond = threading.Condition()
        self._next_poll = 0
        self._wall0 = time.perf_counter()

    # ----- requests ---------------------------------------------------------------------------
    def check_feasible(self, specs) -> None:
        check_feasible(self.mem, specs, self.org, self.budget_label)

    def add_request(self, spec) -> None:
        """Plan a request: it enters the waiting queue when the clock reaches spec.arrival_s."""
        bisect.insort(self._planned, (float(spec.arrival_s), self._order, spec))
        self._order += 1

    def submit(self, spec) -> None:
        """Thread-safe: enqueue a request that arrives now (the clock at the next step)."""
        self.check_feasible([spec])
        with self._cond:
            self._inbox.append(spec)
            self._cond.notify_all()

    def has_work(self) -> bool:
        return bool(self.sched.running or self.sched.waiting or self._inbox or self._planned)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is submitted or planned (for a driver thread)."""
        with self._cond:
            return self._cond.wait_for(self.has_work, timeout)

    def _enter(self, spec, arrival: float) -> Request:
        req = Request(spec, self.mem.block_tokens)
        req.arrival_s = arrival
        self.requests.append(req)
        self.recorder.now = arrival
        self.sched.add_request(req, arrival)
        return req

    def _release_arrivals(self) -> None:
        now = self.clock.now()
        while self._inbox:
            with self._cond:
                spec = self._inbox.popleft()
            self._enter(spec, now)
        planned = self._planned
        i = 0
        while i < len(planned) and planned[i][0] <= now:
            self._enter(planned[i][2], planned[i][0])
            i += 1
        if i:
            del planned[:i]

    def _poll(self) -> None:
        now = self.clock.now()
        while self._next_poll <= now:
            self.recorder.sample(self._next_poll, self.sched, self.mem)
            self._next_poll += 1

    # ----- one step ---------------------------------------------------------------------------
    def step(self) -> StepOutcome | None:
        """Release due arrivals and run one step; None when idle (after waiting for the
        next planned arrival, if there is one)."""
        self._release_arrivals()
        sched, rec = self.sched, self.recorder
        if not sched.running and not sched.waiting:
            if self._planned:
                self.clock.wait_until(self._planned[0][0])  # idle: jump/sleep to the next arrival
                self._poll()
            return None
        if self.host_tier is not None:  # restore a held prefix before admission looks it up
            self.host_tier.before_schedule(self)
        t0 = self.clock.now()
        rec.step, rec.now = sched.step + 1, t0
        plan = sched.schedule(t0)
        if not plan:
            raise RuntimeError(
                f"step {sched.step}: nothing schedulable with {len(sched.waiting)} waiting"
            )
        crossings = sched.boundaries_crossed(plan)
        num_preempted, num_admitted = sched.num_preempted_step, sched.num_admitted_step
        out = self.executor.execute(plan, crossings)
        produced = []
        for item in plan:
            req = item.req
            if item.context + item.num_new == req.num_tokens:  # this step samples a token
                token = out.sampled.get(req.rid)
                if token is None:
                    token = req.next_generated_token()
                req.next_token = token
                produced.append((req.rid, token))
        t1 = self.clock.step_done(t0, out.duration_s)
        # Publication, sampled tokens and finishes become visible when the step completes.
        rec.now = t1
        initial, resume, decode = sched.complete_step(plan, t1)
        self.executor.commit(plan)  # write the published states into their units
        if self.host_tier is not None:  # save the newly published entries (two-phase)
            self.host_tier.after_step(self)
        # A wall clock measures the step (commit included); a virtual one takes the model's.
        dt = self.clock.now() - t0 if self.clock.wall else out.duration_s
        finished = [item.req.rid for item in plan if item.req.status == Status.FINISHED]
        self.num_finished += sched.num_finished_step
        if self.on_step is not None:
            self.on_step(sched, self.mem)  # debug / test hook: invariant checks after every step
        rec.record_step(
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
            **sched.plan_columns(plan, crossings),
        )
        self._poll()
        return StepOutcome(sched.step, t0, dt, len(plan), produced, finished)

    # ----- what this engine runs ---------------------------------------------------------------
    def effective_rules(self) -> dict[str, Any]:
        """The rules this engine runs, read from its parts (scheduler, memory organization,
        executor, clock, recorder): what a run's record states, never the request."""
        sched, mem = self.sched, self.mem
        rules = {
            "org": mem.org,
            "admission": ("first_chunk" if not sched.full_prompt
                          else "reserve_output" if sched.reserve_output else "full_prompt"),
            "reserve_output_tokens": sched.reserve_output_tokens,
            "checkpoint_placement": (
                ("step_end" if sched.step_end else "every_boundary") if sched.C else None
            ),
            "align_chunks": bool(sched.align),
            "split_last_boundary": sched.split_last_boundary,
            "slab_policy": mem.slab_policy if mem.has_slabs else None,
            "free_queue": _one({"single_queue" if pool.single_queue else "free_first"
                                for pool in mem.pools.values()}),
            "checkpoint_recency": mem.checkpoint_recency,
            "conv_page_recency": mem.conv_page_recency,
            "release_order": mem.release_order,
            "duplicates": mem.duplicates,
            "interleave": None if sched.interleave is None else dict(sched.interleave),
            "retention_k": sched.retention_k,
            "pinning_k": sched.pinning_k,
            "cap": sched.cap,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "headroom": sched.headroom_fraction,
            "headroom_units": dict(sched.headroom),
            "pool_units": {p: pool.num_units for p, pool in mem.pools.items()},
            "step_model": None,
            "clock": self.clock.kind,
            "trace": bool(self.trace),
            "host_tier": self.host_tier is not None,
        }
        rules.update(self.executor.describe())
        return rules

    # ----- results ----------------------------------------------------------------------------
    def result(self) -> EngineResult:
        """Tables and summary of everything served so far (ends the trace)."""
        clock = self.clock.now()
        self.recorder.now = clock
        if self.trace:
            self.recorder.end(clock)
        tables = {
            "requests": request_columns(self.requests),
            "poller": self.recorder.poller,
            "trace": self.recorder.trace,
            "slab": self.recorder.slab,
            "steps": self.recorder.steps,
        }
        wall = time.perf_counter() - self._wall0
        summary = summarize(self.requests, self.sched, clock, wall)
        summary.update(
            mechanism_summary(
                self.requests, self.sched.step, self.recorder.poller,
                self.sched.prefix_hit_tokens_self,
            )
        )
        return EngineResult(tables, summary, self.requests, self.mem, self.effective_rules())


def serve(engine: Engine, specs, max_steps: int | None = None) -> EngineResult:
    """Plan every spec at its arrival time and step until all have finished."""
    if not specs:
        raise ValueError("workload.num_requests must be >= 1")
    engine.check_feasible(specs)
    for spec in specs:
        engine.add_request(spec)
    n = len(specs)
    limit = max_steps or 20 * sum(len(s.prompt) + int(s.output_tokens) for s in specs) + 1000
    while engine.num_finished < n:
        engine.step()
        if engine.sched.step > limit:
            raise RuntimeError(
                f"no progress after {engine.sched.step} steps: {engine.num_finished}/{n} finished"
            )
    return engine.result()


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
    """Serve `specs` (RequestSpec, arrival order) on the simulated executor with the given
    step model object (tests, fits). Built through serving_core.builder like every engine.

    `on_step(scheduler, memory)` runs after every step when given (invariant checks).
    """
    from dataclasses import asdict

    from serving_core.builder import build_engine
    from serving_core.engine_spec import EngineSpec, ExecutorSpec

    if not specs:
        raise ValueError("workload.num_requests must be >= 1")
    spec = EngineSpec(
        model=asdict(geometry), org=org, budget=budget_label or "explicit",
        scheduler=sched_cfg, executor=ExecutorSpec("simulated"), trace=trace,
        pool_units=pool_units,
    )
    engine = build_engine(spec, on_step=on_step, step_model=step_model)
    return serve(engine, specs, max_steps)


def summarize(requests: list[Request], sched: Scheduler, clock: float, wall: float) -> dict:
    done = [r for r in requests if r.status == Status.FINISHED]
    out = sum(r.num_generated for r in done)
    episode_end = math.ceil(max((r.finish_s for r in done), default=0.0))
    span_start = min((r.arrival_s for r in requests), default=0.0)
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
