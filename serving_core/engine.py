"""The serving engine: a step-wise loop over scheduler, memory organization and executor.

`Engine` is the loop as an object: requests are added (planned arrivals are
released when the clock reaches them), `step()` runs one engine step and
reports the tokens it produced and the requests it finished. The clock is
virtual for the simulated executor (advanced by the step-time model, idle gaps
jump to the next arrival, so the same (config, seed) yields the same tables)
and wall time for a real executor. `submit` may be called from another thread
(an HTTP server) while a driver thread calls `step()` whenever `has_work()`.

Engines are built by serving_core.builder.build_engine from an EngineSpec: the engine
takes its collaborators (memory organization, recorder, executor, clock, host tier)
ready-made. `serve` plans a whole workload on an engine and returns its tables and
summary.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from serving_core.engine_spec import EngineSpec
from serving_core.executor.base import EXECUTOR_RULE_KEYS, Executor, ExecutorOutput
from serving_core.executor.clocks import VirtualClock, WallClock
from serving_core.executor.modelled import PacedExecutor, SimulatedExecutor
from serving_core.geometry import Geometry
from serving_core.memory import MemoryOrganization
from serving_core.records import (
    Recorder,
    format_key,
    mechanism_summary,
    request_columns,
    run_summary,
)
from serving_core.request import Request, Status
from serving_core.rules import effective as rule_effective
from serving_core.scheduler import Scheduler

if TYPE_CHECKING:  # the host tier module needs torch; simulated engines never import it
    from serving_core.host_tier import EngineTier

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
    "serve",
]


@dataclass
class EngineResult:
    tables: dict[str, dict[str, list]]
    summary: dict
    requests: list[Request] = field(repr=False)
    memory: MemoryOrganization = field(repr=False)
    engine_config: dict = field(default_factory=dict)  # Engine.effective_rules(): the record
    # Outside `tables` (whose digests tests/test_table_hashes.py holds): the hit attribution's
    # request columns (name -> {request_id: value}) and, traced, the lineage table.
    request_columns: dict = field(default_factory=dict)
    extra_tables: dict = field(default_factory=dict)


@dataclass(slots=True)
class StepOutcome:
    """One engine step: when it ran, what it computed, which tokens it produced."""

    step: int
    t_start_s: float
    duration_s: float
    num_scheduled: int
    produced: list[tuple[int, int]]  # (request id, token id) in plan order
    finished: list[int]  # request ids that finished in this step
    logprobs: dict[int, tuple] = field(default_factory=dict)  # ExecutorOutput.logprobs
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # ExecutorOutput's


REFUSED_UNFIT = "cannot fit the budget alone"  # Request.refusal of a refused request


def shortfall(mem: MemoryOrganization, tokens: int) -> dict[str, tuple[int, int]]:
    """Pool -> (units needed, units there) for each pool that cannot hold one request of
    `tokens` prompt + output tokens alone (empty: it fits)."""
    composites = 2 if mem.has_recurrent else 0  # working state + one destination at a boundary
    need = mem.demand(math.ceil(tokens / mem.block_tokens), composites)
    total = mem.total_units()
    return {p: (need[p], total[p]) for p in need if need[p] > total[p]}


def check_feasible(mem: MemoryOrganization, specs, org: str, budget: str) -> None:
    """Fail fast when the budget cannot hold one maximal request of this workload."""
    longest = max(len(s.prompt) + int(s.output_tokens) for s in specs)
    short = shortfall(mem, longest)
    if short:
        detail = ", ".join(f"{p} pool needs {n} units but has {t}" for p, (n, t) in short.items())
        raise ValueError(
            f"budget={budget!r} cannot hold one maximal request of {longest} tokens "
            f"under org={org}: {detail}; choose a larger budget"
        )


class Engine:
    """Continuous batching over one memory organization, driven step by step.

    Built by serving_core.builder.build_engine, which makes every collaborator from the
    spec; the engine makes only its scheduler (over `memory`, recording to `recorder`).
    `on_step(scheduler, memory)` runs after every step when given (invariant checks);
    `on_plan(plan)`, when set, sees each step's plan (the `Scheduled` items) after the
    scheduler made it and before the executor runs it: an observer for studies and tests
    (experiments/studies/continuation.py reads a request's first batch from it).
    """

    spec: EngineSpec  # what the engine was built from (its requested rules)
    geometry: Geometry
    org: str
    budget_label: str
    recorder: Recorder
    trace: bool
    mem: MemoryOrganization
    sched: Scheduler
    executor: Executor
    clock: VirtualClock | WallClock
    vocab_size: int  # token ids the engine produces lie in [0, vocab_size)
    host_tier: EngineTier | None  # saves published state, restores held prefixes (or off)
    on_step: Callable[[Scheduler, MemoryOrganization], None] | None
    on_plan: Callable[[list], None] | None  # set by an observer (see above)
    requests: list[Request]
    num_finished: int
    refuse_unfit: bool  # serve(refuse_unfit=True): a request that cannot fit alone is refused
    refused: list[int]  # ids of the requests refused at arrival

    def __init__(
        self,
        spec: EngineSpec,
        geometry: Geometry,
        memory: MemoryOrganization,
        recorder: Recorder,
        executor: Executor,
        clock: VirtualClock | WallClock,
        *,
        vocab_size: int,
        host_tier: EngineTier | None = None,
        on_step: Callable[[Scheduler, MemoryOrganization], None] | None = None,
    ) -> None:
        self.spec = spec
        self.geometry = geometry
        self.org = spec.org
        self.budget_label = spec.budget
        self.recorder = recorder
        self.trace = recorder.trace_enabled
        self.mem = memory
        recorder.attach(memory, tier=host_tier is not None)
        self.sched = Scheduler(memory, spec.scheduler, recorder)
        self.executor = executor
        # An executor that addresses state gets it in the plan (Scheduled.state).
        self.sched.state_views = executor.reads_state
        self.clock = clock
        self.vocab_size = vocab_size
        self.host_tier = host_tier
        if host_tier is not None:  # the tier saves what the state manager logs
            self.sched.state.log_publications()
        self.on_step = on_step
        self.on_plan = None  # observer of each step's plan (see the class docstring)
        # Requests are materialized at arrival and drop their token lists when they finish,
        # so memory follows the live set, not the workload size.
        self.requests = []
        self.num_finished = 0
        self._entered: list[Request] = []  # entered since the last step (host tier lookups)
        self._planned: list[tuple[float, int, object]] = []  # (arrival, order, spec)
        self._order = 0
        self._inbox: deque = deque()  # specs submitted from other threads
        self._cond = threading.Condition()
        self._next_poll = 0
        self._wall0 = time.perf_counter()
        # serve(refuse_unfit=True): a request that cannot fit alone is refused at arrival
        # (REFUSED_UNFIT, counted finished for the loop, never scheduled); their ids in order
        self.refuse_unfit = False
        self.refused = []

    def start_wall_clock(self) -> None:
        """An engine on a wall clock, built ahead of its run and not yet stepped: its clock
        and wall seconds count from now (the run's start), not from its construction."""
        assert self.sched.step == 0 and not self.requests, "the engine has already run"
        self.clock.restart()
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
        if self.refuse_unfit and shortfall(self.mem, req.num_prompt + req.target_output):
            req.refusal = REFUSED_UNFIT
            self.refused.append(req.rid)
            self.num_finished += 1  # done with: nothing will ever run it
            return req
        self.recorder.now = arrival
        self.sched.add_request(req, arrival)
        if self.host_tier is not None:
            self._entered.append(req)
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
        restore_s = 0.0  # modelled restore transfers (simulated tier), charged to the step
        if self.host_tier is not None:  # restore held prefixes before admission looks them up
            restore_s = self.host_tier.before_admission(sched.state, self._entered)
            self._entered = []
        t0 = self.clock.now()
        rec.step, rec.now = sched.step + 1, t0
        plan = sched.schedule(t0)
        if self.on_plan is not None:
            self.on_plan(plan)
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
            if item.samples:  # this step samples a token
                token = out.sampled.get(req.rid)
                if token is None:
                    token = req.next_generated_token()
                req.next_token = token
                produced.append((req.rid, token))
                params = req.sampling  # serving_core/sampling_params.py
                if params is not None and params.stops(token, req.num_generated + 1):
                    req.target_output = req.num_generated + 1  # a stop token ends it here
        t1 = self.clock.step_done(t0, out.duration_s + restore_s)
        # Publication, sampled tokens and finishes become visible when the step completes.
        rec.now = t1
        initial, resume, decode = sched.complete_step(plan, t1)
        self.executor.commit(plan)  # write the published states into their units
        if self.host_tier is not None:  # save the newly published entries (two-phase)
            self.host_tier.after_step(sched.state)
        # A wall clock measures the step (commit included); a virtual one takes the model's.
        dt = self.clock.now() - t0 if self.clock.wall else out.duration_s + restore_s
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
            num_sampling=len(produced),
        )
        self._poll()
        return StepOutcome(sched.step, t0, dt, len(plan), produced, finished, out.logprobs,
                           out.prompt_logprobs)

    # ----- what this engine runs ---------------------------------------------------------------
    def effective_rules(self) -> dict[str, Any]:
        """The rules this engine runs, read from its parts (scheduler, memory organization,
        executor, clock, recorder): what a run's record states, never the request."""
        sched, mem = self.sched, self.mem
        # each section's rules (those the part was built with), read back from that part
        rules = {"org": mem.org}
        for part, declared_by in ((sched, sched.cfg), (mem, mem.rules)):
            rules.update(rule_effective(declared_by, part))
        rules.update({
            "headroom_units": dict(sched.headroom),
            "optimal_checkpoints": sched.placement.optimal_checkpoints if sched.C else None,
            "pool_units": {p: pool.num_units for p, pool in mem.pools.items()},
            "pool_unit_bytes": {p: pool.unit_bytes for p, pool in mem.pools.items()},
            "step_model": None,
            "clock": self.clock.kind,
            "trace": bool(self.trace),
            "host_tier": self.host_tier.describe() if self.host_tier is not None else False,
        })
        if mem.cache_policy is not None:  # Marconi's tuned weights (memory.marconi_tuning)
            rules["marconi_tuning"] = mem.cache_policy.tuning_record()
        if self.host_tier is not None:
            rules["host_tier_copies"] = self.host_tier.describe_transfer()
        described = self.executor.describe()
        assert described.keys() <= set(EXECUTOR_RULE_KEYS), sorted(described)
        rules.update(described)
        return rules

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache (nothing may run): see
        HybridStateManager.reset_prefix_cache. A host tier keeps what it holds; its copies
        in flight land first (their holds are references)."""
        if self.host_tier is not None:
            self.host_tier.flush(self.sched.state)
        return self.sched.state.reset_prefix_cache()

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
        summary = engine_summary(self.requests, self.sched, clock, wall)
        summary.update(
            mechanism_summary(
                self.requests, self.sched.step, self.recorder.poller,
                self.sched.prefix_hit_tokens_self,
            )
        )
        extra = {}
        if self.recorder.lineage is not None:
            self.recorder.lineage.close(clock, self.sched.step, self.mem.cache.checkpoints,
                                        format_key)
            extra["lineage"] = self.recorder.lineage.rows
        attribution = self.recorder.attribution.columns([r.rid for r in self.requests])
        return EngineResult(tables, summary, self.requests, self.mem, self.effective_rules(),
                            request_columns=attribution, extra_tables=extra)


def serve(engine: Engine, specs, max_steps: int | None = None, *,
          refuse_unfit: bool = False) -> EngineResult:
    """Plan every spec at its arrival time and step until all have finished. A spec with
    `after` >= 0 (a session's later turn) is planned when request `after` finishes, at the
    engine's clock then plus its `think_s` (its own arrival_s is not used).

    A request that cannot fit the budget even alone: by default the whole run is refused
    before its first step (check_feasible); with `refuse_unfit` that request alone is
    refused when it arrives (status refused, never scheduled, its later turns released)."""
    if not specs:
        raise ValueError("workload.num_requests must be >= 1")
    engine.refuse_unfit = refuse_unfit
    if not refuse_unfit:
        engine.check_feasible(specs)
    dependents: dict[int, list] = {}
    for spec in specs:
        after = getattr(spec, "after", -1)
        if after >= 0:
            dependents.setdefault(after, []).append(spec)
        else:
            engine.add_request(spec)
    n = len(specs)
    limit = max_steps or 20 * sum(len(s.prompt) + int(s.output_tokens) for s in specs) + 1000
    refused = 0  # engine.refused already seen
    while engine.num_finished < n:
        outcome = engine.step()
        if dependents and outcome is not None:
            _release_dependents(engine, dependents, outcome.finished)
        if dependents and len(engine.refused) > refused:
            _release_dependents(engine, dependents, engine.refused[refused:])
            refused = len(engine.refused)
        if engine.sched.step > limit:
            raise RuntimeError(
                f"no progress after {engine.sched.step} steps: {engine.num_finished}/{n} finished"
            )
    return engine.result()


def _release_dependents(engine: Engine, dependents: dict[int, list], finished) -> None:
    """Plan the turns waiting on the requests that just finished (their finish is now)."""
    now = engine.clock.now()
    for rid in finished:
        for spec in dependents.pop(rid, ()):
            engine.add_request(replace(spec, arrival_s=now + float(spec.think_s)))


def engine_summary(requests: list[Request], sched: Scheduler, clock: float,
                   wall: float) -> dict:
    """The run summary (serving_core.records.run_summary) of the engine's requests, with
    the scheduler's counters; the episode ends at the whole second after the last finish."""
    done = [r.status == Status.FINISHED for r in requests]
    finish = [r.finish_s for r in requests]
    summary = run_summary(
        arrival_s=[r.arrival_s for r in requests],
        first_token_s=[r.first_token_s for r in requests],
        finish_s=finish,
        output_tokens=[r.num_generated for r in requests],
        done=done,
        episode_end_s=math.ceil(max((f for f, d in zip(finish, done, strict=True) if d),
                                    default=0.0)),
        sim_seconds=clock,
        wall_seconds=wall,
    )
    summary.update({
        "preemptions": sched.preemptions_total,
        "prefix_hit_tokens": sched.prefix_hit_tokens_total,
        "prefill_tokens_computed": sched.prompt_tokens_total,
        "max_running": sched.max_running,
        "max_waiting": sched.max_waiting,
        "refused": sum(1 for r in requests if r.refusal),
    })
    return summary
