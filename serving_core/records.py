"""Per-run records: requests, poller, trace, slab and steps, kept as column lists, and
the run summary.

Column names match ledgers.schemas exactly; the runner persists them. Trace
events carry a gapless sequence number and the run ends with one END record.
`run_summary` is the one builder of a run's latency and throughput summary, for the
engine's own requests (serving_core.engine) and for a client's records of a served run
(experiments/runners/http_run.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from serving_core.attribution import HitAttribution
from serving_core.lineage import CheckpointLineage
from serving_core.memory import Kind, MemoryEvents, StateObject

_MASK64 = (1 << 64) - 1

# The engine's columns, exactly what the ledger persists (ledgers.schemas.ENGINE_SCHEMAS;
# tests/test_layers.py holds the two equal). serving_core does not import ledgers.
TRACE_COLUMNS = (
    "seq", "t_s", "step", "event", "request_id", "episode", "kind", "boundary", "key", "a_m0",
    "rmax_m0", "j_m0", "a_m1", "rmax_m1", "j_m1", "cause_request_id", "need", "free", "pool",
    "dropped", "write_errors",
)
SLAB_COLUMNS = (
    "seq", "t_s", "step", "event", "page", "slot", "request_id", "occupancy", "invalidated",
)
STEP_COLUMNS = (
    "step", "t_start_s", "duration_s", "num_scheduled", "num_running", "num_waiting",
    "prefill_tokens_initial", "prefill_tokens_resume", "decode_tokens", "num_preempted",
    "num_admitted", "num_decode_seqs", "decode_context_tokens", "prefill_attention_pairs",
    "checkpoint_writes", "num_sampling",
)
POLLER_COLUMNS = (
    "t_s", "pool", "running", "waiting", "units_used", "units_cached", "units_free",
    "units_total", "usage_frac", "preemptions_total", "prompt_tokens_total",
    "generation_tokens_total", "prefix_hit_tokens_total",
)
REQUEST_COLUMNS = (
    "request_id", "arrival_s", "start_s", "first_token_s", "finish_s", "prompt_tokens",
    "output_tokens", "target_output_tokens", "adopted_prefix_tokens", "resume_adopted_tokens",
    "preemptions", "episodes", "context_id", "salt", "ttft_s", "e2e_s", "tpot_s", "status",
)


def record_produced(engine) -> dict[int, list[int]]:
    """Wrap `engine.step` so each token a step produces is appended, by request id, to the
    dict returned (greedy checks compare these with a reference)."""
    produced: dict[int, list[int]] = {}
    original = engine.step

    def step():
        outcome = original()
        if outcome is not None:
            for rid, tok in outcome.produced:
                produced.setdefault(rid, []).append(tok)
        return outcome

    engine.step = step
    return produced


def format_key(key: int | None) -> str:
    return "" if key is None else f"{key & _MASK64:016x}"


def _append(table: dict[str, list], **values) -> None:
    """Append one value to each named column of `table`."""
    for column, value in values.items():
        table[column].append(value)


class Recorder(MemoryEvents):
    """Collects one run's records; also the memory-event sink."""

    def __init__(self, trace: bool, slab: bool, max_trace_events: int = 50_000_000) -> None:
        self.trace_enabled = trace
        self.slab_enabled = slab
        self.max_trace_events = max_trace_events
        self.step = 0
        self.now = 0.0
        self.dropped = 0
        self.trace = {c: [] for c in TRACE_COLUMNS}
        self.slab = {c: [] for c in SLAB_COLUMNS}
        self.steps = {c: [] for c in STEP_COLUMNS}
        self.poller = {c: [] for c in POLLER_COLUMNS}
        # set by the engine (attach): the hit attribution of every run, the checkpoint
        # lineage of a traced one (serving_core.attribution, serving_core.lineage)
        self.attribution: HitAttribution | None = None
        self.lineage: CheckpointLineage | None = None

    def attach(self, mem, tier: bool) -> None:
        """Start the hit attribution (and, traced, the lineage) over `mem`."""
        self.attribution = HitAttribution(mem.block_tokens, mem.checkpoint_interval, tier)
        if self.trace_enabled:
            self.lineage = CheckpointLineage(mem.block_tokens, mem.lookup)

    # ----- trace --------------------------------------------------------------------------
    def event(
        self,
        event: str,
        t: float,
        request_id: int = -1,
        episode: int = 0,
        *,
        hit_m0=None,
        hit_m1=None,
        kind: str = "",
        boundary: int = -1,
        key: str = "",
        cause: int = -1,
        need: int = -1,
        free: int = -1,
        pool: str = "",
    ) -> None:
        tr = self.trace
        if len(tr["seq"]) >= self.max_trace_events:
            self.dropped += 1
            return
        _append(tr, seq=len(tr["seq"]), t_s=t, step=self.step, event=event,
                request_id=request_id, episode=episode, kind=kind, boundary=boundary, key=key)
        for suffix, hit in (("m0", hit_m0), ("m1", hit_m1)):
            tr["a_" + suffix].append(hit.amax if hit else -1)
            tr["rmax_" + suffix].append(hit.rmax if hit else -1)
            tr["j_" + suffix].append(hit.jadopt if hit else -1)
        tr["cause_request_id"].append(cause)
        tr["need"].append(need)
        tr["free"].append(free)
        tr["pool"].append(pool)
        tr["dropped"].append(0)
        tr["write_errors"].append(0)

    def end(self, t: float) -> None:
        """Final END record with dropped and write-error counts (always written)."""
        limit, self.max_trace_events = self.max_trace_events, math.inf
        self.event("END", t)
        self.max_trace_events = limit
        self.trace["dropped"][-1] = self.dropped

    def on_publish(self, obj: StateObject) -> None:
        if self.attribution is not None:
            self.attribution.on_publish(obj)
        if self.trace_enabled:
            self._state_event("PUBLISH", obj, -1)
            if self.lineage is not None:
                self.lineage.published(obj, self.now, self.step, format_key(obj.key))

    def on_loss(self, obj: StateObject, cause_request: int) -> None:
        if self.attribution is not None:
            self.attribution.on_loss(obj, self.loss_reason)
        if self.trace_enabled:
            self._state_event("LOSS", obj, cause_request)
            if self.lineage is not None:
                self.lineage.lost(obj, self.now, self.step, format_key(obj.key),
                                  self.loss_reason, cause_request)

    def _state_event(self, event: str, obj: StateObject, cause: int) -> None:
        kind = "checkpoint" if obj.kind == Kind.COMPOSITE else "attention"
        self.event(
            event,
            self.now,
            obj.producer,
            kind=kind,
            boundary=obj.boundary,
            key=format_key(obj.key),
            cause=cause,
        )

    # ----- slab ---------------------------------------------------------------------------
    def on_slab(self, event, page, slot, request_id, occupancy, invalidated) -> None:
        if not self.slab_enabled:
            return
        sl = self.slab
        _append(sl, seq=len(sl["seq"]), t_s=self.now, step=self.step, event=event, page=page,
                slot=slot, request_id=request_id, occupancy=occupancy, invalidated=invalidated)

    # ----- steps and poller -----------------------------------------------------------------
    def record_step(self, **row) -> None:
        """One steps row, by column name (a missing or extra column raises)."""
        assert row.keys() == self.steps.keys(), sorted(row.keys() ^ self.steps.keys())
        for col, value in row.items():
            self.steps[col].append(value)

    def sample(self, t: int, sched, mem) -> None:
        po = self.poller
        for pool, (used, cached, free, total) in mem.usage().items():
            po["t_s"].append(t)
            po["pool"].append(pool)
            po["running"].append(len(sched.running))
            po["waiting"].append(len(sched.waiting))
            po["units_used"].append(used)
            po["units_cached"].append(cached)
            po["units_free"].append(free)
            po["units_total"].append(total)
            po["usage_frac"].append(used / total)
            po["preemptions_total"].append(sched.preemptions_total)
            po["prompt_tokens_total"].append(sched.prompt_tokens_total)
            po["generation_tokens_total"].append(sched.generation_tokens_total)
            po["prefix_hit_tokens_total"].append(sched.prefix_hit_tokens_total)


def request_columns(requests) -> dict[str, list]:
    cols = {c: [] for c in REQUEST_COLUMNS}
    for r in requests:
        finished = not math.isnan(r.finish_s)
        ttft = r.first_token_s - r.arrival_s
        e2e = r.finish_s - r.arrival_s
        tpot = (
            (r.finish_s - r.first_token_s) / (r.num_generated - 1)
            if r.num_generated > 1
            else math.nan
        )
        row = {
            "request_id": r.rid,
            "arrival_s": r.arrival_s,
            "start_s": r.start_s,
            "first_token_s": r.first_token_s,
            "finish_s": r.finish_s,
            "prompt_tokens": r.num_prompt,
            "output_tokens": r.num_generated,
            "target_output_tokens": r.target_output,
            "adopted_prefix_tokens": r.adopted_first,
            "resume_adopted_tokens": r.adopted_resume,
            "preemptions": r.preemptions,
            "episodes": r.episodes,
            "context_id": int(r.spec.context_id),
            "salt": r.spec.salt,
            "ttft_s": ttft,
            "e2e_s": e2e,
            "tpot_s": tpot,
            "status": "refused" if r.refusal else "finished" if finished else "unfinished",
        }
        for col in REQUEST_COLUMNS:
            cols[col].append(row[col])
    return cols


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile of the values that are not NaN (NaN when none are)."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else math.nan


def run_summary(*, arrival_s: Sequence[float], first_token_s: Sequence[float],
                finish_s: Sequence[float], output_tokens: Sequence[int],
                done: Sequence[bool], episode_end_s: int, sim_seconds: float,
                wall_seconds: float, inter_token_s: Sequence[float] | None = None) -> dict:
    """Counts, spans, throughputs and latency percentiles of one run, per request in the
    columns (arrival at the engine or the client's send time; `done`: completed).

    Output tokens and latencies count completed requests only; the request span runs
    from the first arrival of any request to the last completion; the ledger throughput
    divides by the episode [0, episode_end_s). TPOT is per request over its tokens after
    the first; `inter_token_s` (a client's token gaps) adds itl_p50 / itl_p99."""
    rows = list(zip(arrival_s, first_token_s, finish_s, output_tokens, done, strict=True))
    ok = [(a, f, e, n) for a, f, e, n, d in rows if d]
    out = sum(n for _, _, _, n in ok)
    span_start = min(arrival_s, default=0.0)
    span_end = max((e for _, _, e, _ in ok), default=span_start)
    summary = {
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "output_tokens": out,
        "episode_start_s": 0,
        "episode_end_s": episode_end_s,
        "span_start_s": span_start,
        "span_end_s": span_end,
        "throughput_ledger": out / episode_end_s if episode_end_s else 0.0,
        "throughput_span": out / (span_end - span_start) if span_end > span_start else 0.0,
        "ttft_p50": _percentile([f - a for a, f, _, _ in ok], 50),
        "ttft_p99": _percentile([f - a for a, f, _, _ in ok], 99),
        "e2e_p50": _percentile([e - a for a, _, e, _ in ok], 50),
        "e2e_p99": _percentile([e - a for a, _, e, _ in ok], 99),
        "tpot_p99": _percentile([(e - f) / (n - 1) for _, f, e, n in ok if n > 1], 99),
    }
    if inter_token_s is not None:
        summary["itl_p50"] = _percentile(list(inter_token_s), 50)
        summary["itl_p99"] = _percentile(list(inter_token_s), 99)
    summary["sim_seconds"] = sim_seconds
    summary["wall_seconds"] = wall_seconds
    return summary


MECHANISM_KEYS = (
    "c_once_tokens",
    "h_tokens",
    "engine_steps",
    "h_per_step",
    "running_median",
    "running_mean",
    "running_max",
    "waiting_median",
    "waiting_mean",
    "waiting_max",
    "prefix_hit_tokens_cross",
    "prefix_hit_tokens_self",
)


def _gauge(values: list[int]) -> tuple[float, float, float]:
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return float(median), sum(ordered) / n, float(ordered[-1])


def mechanism_summary(requests, num_steps: int, poller: dict, hit_self: int) -> dict:
    """Work and concurrency readouts of one run.

    C_once: prompt tokens minus the prefix adopted at each request's FIRST admission
    (resume recomputation excluded); H = C_once + output tokens; K = engine steps.
    Running / waiting gauges are the poller's 1-s samples (one row per sample instant).
    Prefix hits split into cross-request reuse (first admissions) and a request
    re-adopting its own prefix on resume.
    """
    c_once = sum(r.num_prompt - r.adopted_first for r in requests)
    h = c_once + sum(r.num_generated for r in requests)
    times, running, waiting = poller["t_s"], poller["running"], poller["waiting"]
    keep = [i for i in range(len(times)) if i == 0 or times[i] != times[i - 1]]
    run = _gauge([running[i] for i in keep])
    wait = _gauge([waiting[i] for i in keep])
    return {
        "c_once_tokens": c_once,
        "h_tokens": h,
        "engine_steps": num_steps,
        "h_per_step": h / num_steps if num_steps else math.nan,
        "running_median": run[0],
        "running_mean": run[1],
        "running_max": run[2],
        "waiting_median": wait[0],
        "waiting_mean": wait[1],
        "waiting_max": wait[2],
        "prefix_hit_tokens_cross": sum(r.adopted_first for r in requests),
        "prefix_hit_tokens_self": hit_self,
    }


_MECHANISM_COUNTS = ("c_once_tokens", "h_tokens", "engine_steps", "prefix_hit_tokens_cross",
                     "prefix_hit_tokens_self")


def mechanism_absent() -> dict:
    """Mechanism readouts of a run that produced none: -1 for counts, NaN otherwise."""
    return {k: (-1 if k in _MECHANISM_COUNTS else math.nan) for k in MECHANISM_KEYS}
