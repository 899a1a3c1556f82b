"""Arrow schemas of the nine ledger tables (TABLES), documented field by field.

Every field carries metadata {"doc", "unit"} (and "values" for enumerated
strings). Units: "s" seconds, "tokens", "units" (allocation units of the
organization's pools), "count", "fraction", "tokens/s", "1/s", "" for labels
and ids. Engine times are seconds on the run's virtual clock. No field is
nullable: absence is a sentinel (-1, NaN or "") stated in the field's doc.

`SCHEMAS[name]` is the stored schema (what the Parquet files and the catalog
views hold). The engine produces `ENGINE_SCHEMAS[name]`, which for every table
but runs lacks the leading run_id and campaign columns the writer prepends, and
lacks the columns the writer appends (`WORKLOAD_COLUMNS`): the workload's, which describe
the workload, and the engine's hit attribution, reported beside its tables; so the
engine's tables stay what they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

TABLES = ("runs", "requests", "poller", "trace", "slab", "steps", "footprint", "request_paths",
          "lineage")
RUN_TABLES = TABLES[1:]  # per-run tables the engine produces; runs is written last

POOLS = ("shared", "attention", "recurrent")
# refused: it cannot fit the budget even alone (trace and sessions workloads; docs/usage.md)
REQUEST_STATUSES = ("finished", "failed", "unfinished", "refused")
RUN_STATUSES = ("complete", "failed")
ARRIVALS = ("poisson", "onoff", "trace")
TRACE_EVENTS = (
    "ENTER_WAITING",
    "LOOKUP",
    "ADOPT",
    "PUBLISH",
    "LOSS",
    "PREEMPT",
    "RESUME",
    "FINISH",
    "ALLOC_FAIL",
    "END",
)
TRACE_KINDS = ("attention", "checkpoint", "")
SLAB_EVENTS = (
    "SLAB_ALLOC",
    "SLOT_ALLOC",
    "SLOT_FREE",
    "SLAB_RECLAIM",
    "CROSS_INVALIDATE",
    "SLAB_FREE",
)

_I, _F, _S, _B = pa.int64(), pa.float64(), pa.string(), pa.bool_()


def _f(name: str, type_: pa.DataType, unit: str, doc: str, values: Sequence[str] = ()) -> pa.Field:
    meta = {"doc": doc, "unit": unit}
    if values:
        meta["values"] = "|".join(values)
    return pa.field(name, type_, nullable=False, metadata=meta)


_KEY_FIELDS = [
    _f("run_id", _S, "", "Run identifier: hash of the resolved cell config, seed and replicate."),
    _f("campaign", _S, "", "Campaign name; also the hive partition key (campaign=<c>)."),
]

_REQUESTS = [
    _f("request_id", _I, "", "Request id within the run's workload."),
    _f("arrival_s", _F, "s", "Arrival time."),
    _f("start_s", _F, "s", "First time the request was scheduled (NaN if never)."),
    _f("first_token_s", _F, "s", "Time the first output token was produced (NaN if never)."),
    _f("finish_s", _F, "s", "Completion time (NaN if unfinished)."),
    _f("prompt_tokens", _I, "tokens", "Prompt length."),
    _f("output_tokens", _I, "tokens", "Output tokens generated."),
    _f("target_output_tokens", _I, "tokens", "Output length the workload asked for."),
    _f("adopted_prefix_tokens", _I, "tokens", "Cached prefix adopted at the first admission."),
    _f("resume_adopted_tokens", _I, "tokens", "Cached prefix adopted, summed over resumes."),
    _f("preemptions", _I, "count", "Times the request was preempted."),
    _f("episodes", _I, "count", "Admission episodes (1 + resumes)."),
    _f("context_id", _I, "", "Shared-context id of the prompt (-1: unique prompt)."),
    _f("salt", _S, "", 'Cache salt isolating the request\'s prefix entries ("": none).'),
    _f("ttft_s", _F, "s", "Time to first token: first_token_s - arrival_s (NaN if none)."),
    _f("e2e_s", _F, "s", "End-to-end latency: finish_s - arrival_s (NaN if unfinished)."),
    _f("tpot_s", _F, "s", "Time per output token after the first (NaN if < 2 tokens)."),
    _f("status", _S, "", "Request outcome.", REQUEST_STATUSES),
]

# Appended to requests by the writer from the workload (ledgers.writer.write_run); a workload
# that defines none stores the sentinel (files written before the column read NULL).
_REQUESTS_WORKLOAD = [
    _f("reusable_prefix_tokens", _I, "tokens",
       "Infinite-cache bound: the longest prefix of the prompt's whole blocks that earlier "
       "requests of the workload held (trace workloads; experiments/workloads/trace.py); "
       "compare adopted_prefix_tokens (-1: the workload defines none, e.g. ShareGPT)."),
]
# The engine's hit attribution of each request's first admission (serving_core/attribution.py;
# docs/engine_rules.md section 18): ideal = adopted_prefix_tokens + the seven losses, each
# level of the waterfall at most the one above; -1 throughout: not attributed (never
# admitted, or a path that does not run our engine: vLLM, files written before the columns).
_LOSS_DOCS = {
    "block": "beyond the strict prefix's last whole attention block (below the first block: all)",
    "placement": "no other request ever published a checkpoint at those boundaries",
    "admission": "checkpoints there were published only after this request's lookup",
    "attention": "the cached attention prefix no longer reached them (attention evicted)",
    "group": "checkpoint lost through another state group's storage (slab, large page)",
    "checkpoint": "checkpoint evicted while its attention blocks were present",
    "tier": "evicted and not restored by the host tier (host copy absent or partial)",
}
_REQUESTS_ATTRIBUTION = [
    _f("ideal_prefix_tokens", _I, "tokens",
       "Longest token prefix shared with any request first admitted earlier (same salt; "
       "finished ones with their output): the attribution's ideal (-1: not attributed)."),
    _f("cached_attention_tokens", _I, "tokens",
       "Contiguous cached attention prefix at the first admission's lookup (-1: not "
       "attributed)."),
    *(_f(f"lost_{cause}_tokens", _I, "tokens", f"Tokens of the ideal lost: {doc}.")
      for cause, doc in _LOSS_DOCS.items()),
]
WORKLOAD_COLUMNS: dict[str, tuple[pa.Field, ...]] = {
    "requests": (*_REQUESTS_WORKLOAD, *_REQUESTS_ATTRIBUTION)}
ATTRIBUTION_COLUMNS = tuple(f.name for f in _REQUESTS_ATTRIBUTION)
WORKLOAD_SENTINEL = -1

_POLLER = [
    _f("t_s", _I, "s", "Sample time in whole virtual seconds (one sample per second)."),
    _f("pool", _S, "", "Pool sampled: shared (S0/S1/S2) or attention/recurrent (D0).", POOLS),
    _f("running", _I, "count", "Requests running."),
    _f("waiting", _I, "count", "Requests waiting."),
    _f("units_used", _I, "units", "Units held by running requests."),
    _f("units_cached", _I, "units", "Units holding evictable cached prefix state."),
    _f("units_free", _I, "units", "Units neither used nor cached."),
    _f("units_total", _I, "units", "Units in the pool."),
    _f("usage_frac", _F, "fraction", "units_used / units_total."),
    _f("preemptions_total", _I, "count", "Cumulative preemptions."),
    _f("prompt_tokens_total", _I, "tokens", "Cumulative prompt tokens computed."),
    _f("generation_tokens_total", _I, "tokens", "Cumulative tokens generated."),
    _f("prefix_hit_tokens_total", _I, "tokens", "Cumulative prompt tokens served from cache."),
]

_NOT_ADOPT = "(-1 when not an ADOPT/LOOKUP)"
_TRACE = [
    _f("seq", _I, "", "Event sequence number, gapless from 0; END is the last event."),
    _f("t_s", _F, "s", "Event time."),
    _f("step", _I, "", "Engine step of the event."),
    _f("event", _S, "", "Event type.", TRACE_EVENTS),
    _f("request_id", _I, "", "Request the event is about (-1: none)."),
    _f("episode", _I, "", "Admission episode of the request (-1: none)."),
    _f("kind", _S, "", 'Cache entry kind of PUBLISH/LOSS/LOOKUP ("": none).', TRACE_KINDS),
    _f("boundary", _I, "tokens", "Token boundary of the entry (-1: none)."),
    _f("key", _S, "", 'Prefix-cache key of the entry ("": none).'),
    _f("a_m0", _I, "tokens", f"Attention prefix A valid at lookup (bracket M0) {_NOT_ADOPT}."),
    _f("rmax_m0", _I, "tokens", f"Deepest recurrent checkpoint Rmax, bracket M0 {_NOT_ADOPT}."),
    _f("j_m0", _I, "tokens", f"Joint adopted depth Jadopt, bracket M0 {_NOT_ADOPT}."),
    _f("a_m1", _I, "tokens", f"A with entries valid at step start (bracket M1) {_NOT_ADOPT}."),
    _f("rmax_m1", _I, "tokens", f"Rmax, bracket M1 {_NOT_ADOPT}."),
    _f("j_m1", _I, "tokens", f"Jadopt, bracket M1 {_NOT_ADOPT}."),
    _f("cause_request_id", _I, "", "Request whose allocation caused a LOSS (-1: none)."),
    _f("need", _I, "units", "Units an ALLOC_FAIL asked for (-1: none)."),
    _f("free", _I, "units", "Free units at an ALLOC_FAIL (-1: none)."),
    _f("pool", _S, "", 'Pool of an ALLOC_FAIL ("": none).', (*POOLS, "")),
    _f("dropped", _I, "count", "Events dropped by the recorder (non-zero only on END)."),
    _f("write_errors", _I, "count", "Recorder write errors (non-zero only on END)."),
]

# Served runs only (a server process to measure): the poller's process-footprint samples.
_FOOTPRINT = [
    _f("t_s", _F, "s", "Sample time, seconds since the episode start (one every 0.25 s)."),
    _f("rss_bytes", _I, "bytes", "Server process resident set size "
       "(process_resident_memory_bytes; -1: not exported)."),
]

# Served runs only: each request's actual path as the server recorded it (our server's
# usage.hsl_path; vLLM reports cached prompt tokens only), kept by the client.
REQUEST_PATHS = ("recompute", "device_reuse", "host_reload")  # the server's record (paths.py)
_REQUEST_PATHS = [
    _f("request_id", _I, "", "Workload request id (joins requests.request_id)."),
    _f("path", _S, "", 'Actual path of the first admission ("": the server does not say).',
       (*REQUEST_PATHS, "")),
    _f("reused_tokens", _I, "tokens", "Prefix tokens adopted from the device cache (-1: not "
       "reported)."),
    _f("restored_tokens", _I, "tokens", "Prefix tokens the host tier restored, B (-1: not "
       "reported)."),
    _f("first_batch_computed", _I, "tokens", "Tokens already computed when the request's first "
       "batch ran (-1: not reported)."),
    _f("first_batch_scheduled", _I, "tokens", "Tokens the first batch scheduled (-1: not "
       "reported)."),
    _f("cached_prompt_tokens", _I, "tokens", "usage.prompt_tokens_details.cached_tokens "
       "(-1: absent)."),
]

_SLAB = [    _f("seq", _I, "", "Slab event sequence number."),
    _f("t_s", _F, "s", "Event time."),
    _f("step", _I, "", "Engine step of the event."),
    _f("event", _S, "", "Slab event type.", SLAB_EVENTS),
    _f("page", _I, "", "Slab page id."),
    _f("slot", _I, "", "Conv slot within the page (-1: none)."),
    _f("request_id", _I, "", "Request the event is about (-1: none)."),
    _f("occupancy", _I, "count", "Slots in use on the page after the event."),
    _f("invalidated", _I, "count", "Cached entries invalidated by the event."),
]

_STEPS = [
    _f("step", _I, "", "Engine step number."),
    _f("t_start_s", _F, "s", "Step start time."),
    _f("duration_s", _F, "s", "Step duration."),
    _f("num_scheduled", _I, "count", "Requests scheduled in the step."),
    _f("num_running", _I, "count", "Requests running after scheduling."),
    _f("num_waiting", _I, "count", "Requests waiting after scheduling."),
    _f("prefill_tokens_initial", _I, "tokens", "New prefill tokens of first admissions."),
    _f("prefill_tokens_resume", _I, "tokens", "New prefill tokens recomputed on resume."),
    _f("decode_tokens", _I, "tokens", "Decode tokens."),
    _f("num_preempted", _I, "count", "Requests preempted in the step."),
    _f("num_admitted", _I, "count", "Requests admitted (first or resumed) in the step."),
    _f("num_decode_seqs", _I, "count", "Scheduled sequences with one new token (decode)."),
    _f("decode_context_tokens", _I, "tokens", "Cached tokens of the decode sequences, summed."),
    _f("prefill_attention_pairs", _I, "count",
       "Causal (query, key) pairs of the prefill chunks: sum of n c + n (n + 1) / 2."),
    _f("checkpoint_writes", _I, "count", "Recurrent checkpoints the step's chunks publish."),
    _f("num_sampling", _I, "count",
       "Scheduled items that sample a token (decode sequences and chunks that complete their "
       "known tokens): the rows of the step's one LM-head product."),
]

_RUNS = [
    *_KEY_FIELDS,
    _f("question", _S, "", "Paper question the run serves (q1..q9 or a supporting sweep)."),
    _f("arm", _S, "", "Arm label within the question (e.g. S2, S2+Retention)."),
    _f("org", _S, "", ("Arm's organization (ledgers.arms: S0, S1, S2, D0, S2_RETENTION, N0, JENGA, "
                     "S2_MARCONI, D0_MARCONI).")),
    _f("budget", _S, "", "Memory budget name (e.g. b63)."),
    _f("units", _I, "units", "Total units of the budget (both D0 pools summed)."),
    _f("units_detail", _S, "", "JSON object of units per pool."),
    _f("cap", _I, "count", "Concurrency cap (max running requests)."),
    _f("rate", _F, "1/s", "Offered load lambda (Poisson arrivals per second); trace "
       "workloads: workload.trace_speed, the factor the trace's timestamps are divided by; "
       "sessions: sessions started per second."),
    _f("arrival", _S, "", "Arrival process (onoff: 5 s on, 15 s off, same mean; trace: the "
       "trace's own timestamps).", ARRIVALS),
    _f("q", _F, "fraction", "Share of requests drawn from shared contexts."),
    _f("f", _F, "fraction", "Admission headroom fraction."),
    _f("retention_k", _I, "count", "Checkpoint retention K (-1: none)."),
    _f("pinning_k", _I, "count", "Preemption-time pinning threshold K (-1: Roff, no pinning)."),
    _f("d0_attention_fraction", _F, "fraction",
       "D0 static split: attention pool share of nominal bytes (NaN: not D0)."),
    _f("reuse", _S, "", "Reuse mode (e.g. SHARE, ISOLATE)."),
    _f("seed", _I, "", "Workload seed."),
    _f("replicate", _I, "", "Replicate index of a deliberate rerun (0: first)."),
    _f("trace", _B, "", "Whether the trace recorder was on."),
    _f("executor", _S, "", "Executor (sim or real)."),
    _f("model", _S, "", "Model name."),
    _f("config_hash", _S, "", "Hash of the cell config (campaign and question in; seed, "
       "replicate and bookkeeping keys out)."),
    _f("prereg_plan_hash", _S, "", 'Hash of the campaign\'s preregistered plan ("": none).'),
    _f("code_version", _S, "", "Code version the run was produced with."),
    _f("environment", _S, "", "JSON object: package versions, CPU, Python."),
    _f("engine_config", _S, "",
       "JSON object: the rules the engine ran, read back from it (Engine.effective_rules(); "
       "vLLM: version, block size, page padding, cache mode, blocks, bytes, tables not "
       "applicable); {} for a failed run."),
    _f("episode_start_s", _I, "s", "Ledger episode start (orchestration start, boot excluded)."),
    _f("episode_end_s", _I, "s", "Ledger episode end (completion polling done)."),
    _f("span_start_s", _F, "s", "First request arrival."),
    _f("span_end_s", _F, "s", "Last request finish."),
    _f("completed_requests", _I, "count", "Requests finished."),
    _f("failed_requests", _I, "count", "Requests failed."),
    _f("output_tokens", _I, "tokens", "Output tokens of completed requests."),
    _f("throughput_ledger", _F, "tokens/s", "output_tokens / ledger episode seconds (primary)."),
    _f("throughput_span", _F, "tokens/s", "output_tokens / request span seconds (sensitivity)."),
    _f("c_once_tokens", _I, "tokens",
       "C_once: prompt minus prefix adopted at first admission, summed (-1: failed run)."),
    _f("h_tokens", _I, "tokens", "H = C_once + output tokens."),
    _f("engine_steps", _I, "count", "K: engine steps of the run."),
    _f("h_per_step", _F, "tokens", "H / K."),
    _f("running_median", _F, "count", "Median of the 1-s running gauge."),
    _f("running_mean", _F, "count", "Mean of the 1-s running gauge."),
    _f("running_max", _F, "count", "Maximum of the 1-s running gauge."),
    _f("waiting_median", _F, "count", "Median of the 1-s waiting gauge."),
    _f("waiting_mean", _F, "count", "Mean of the 1-s waiting gauge."),
    _f("waiting_max", _F, "count", "Maximum of the 1-s waiting gauge."),
    _f("prefix_hit_tokens_cross", _I, "tokens",
       "Prefix tokens adopted at first admissions (cross-request reuse)."),
    _f("prefix_hit_tokens_self", _I, "tokens",
       "Prefix tokens a resumed request re-adopted from its own earlier episodes."),
    _f("status", _S, "", "Run outcome; only complete runs count.", RUN_STATUSES),
    _f("adopted", _B, "", "Whether this run is the one analysed for its (cell, seed) key."),
    _f("run_seconds", _F, "s",
       "Wall-clock seconds of the cell: workload build plus engine (no start-up, no writes)."),
    _f("created_at", _S, "", "UTC wall-clock write time, ISO 8601 (excluded from determinism)."),
    _f("engine_seconds", _F, "s", "Wall-clock seconds of the engine loop alone (NaN: failed)."),
    _f("files", _S, "",
       'JSON object: per table file of this attempt, {"rows", "bytes", "sha256"}; '
       "a run counts only while every listed file is present and whole."),
]

LINEAGE_EVENTS = ("PUBLISH", "ADOPT", "END", "DEPTH_DOWN", "DEPTH_UP")
LINEAGE_CAUSES = ("lru", "slab_reclaim", "pool_pressure", "reset", "run_end", "attention",
                  "checkpoint", "")
_LINEAGE = [
    _f("seq", _I, "", "Gapless order of the run's lineage rows."),
    _f("t_s", _F, "s", "Engine time of the event."),
    _f("step", _I, "", "Engine step of the event."),
    _f("event", _S, "", "PUBLISH, ADOPT, END of a checkpoint; DEPTH_DOWN / DEPTH_UP of a "
       "waiting episode's joint depth.", LINEAGE_EVENTS),
    _f("key", _S, "", "Checkpoint key (16 hex; \"\" for depth events)."),
    _f("boundary", _I, "tokens", "Boundary of the checkpoint (or of the entry whose "
       "publication or loss moved the depth)."),
    _f("request_id", _I, "", "Producer (PUBLISH, END), adopter (ADOPT) or the waiting "
       "request (DEPTH_*)."),
    _f("episode", _I, "count", "Admission episode of ADOPT / DEPTH_* rows (0 otherwise)."),
    _f("cause", _S, "", "END: lru, slab_reclaim, pool_pressure, reset, run_end; DEPTH_*: "
       "the kind of entry (attention, checkpoint); \"\" otherwise.", LINEAGE_CAUSES),
    _f("cause_request_id", _I, "", "END / DEPTH_DOWN: whose allocation took the entry "
       "(-1: none); DEPTH_UP: the publishing request."),
    _f("age_s", _F, "s", "END / ADOPT: time since the checkpoint's publication (NaN else)."),
    _f("age_steps", _I, "count", "END / ADOPT: steps since its publication (-1 else)."),
    _f("depth_before", _I, "tokens", "DEPTH_*: the waiting episode's joint depth before."),
    _f("depth_after", _I, "tokens", "DEPTH_*: its joint depth after (-1 else)."),
    _f("same_step", _I, "count", "PUBLISH: 1 when a request whose chain holds the key was "
       "admitted in the same step (a same-step ambiguous publication), else 0."),
]

ENGINE_SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema(_RUNS),
    "requests": pa.schema(_REQUESTS),
    "poller": pa.schema(_POLLER),
    "trace": pa.schema(_TRACE),
    "slab": pa.schema(_SLAB),
    "steps": pa.schema(_STEPS),
    "footprint": pa.schema(_FOOTPRINT),
    "request_paths": pa.schema(_REQUEST_PATHS),
    "lineage": pa.schema(_LINEAGE),
}
SCHEMAS: dict[str, pa.Schema] = {
    name: schema if name == "runs" else pa.schema(
        [*_KEY_FIELDS, *schema, *WORKLOAD_COLUMNS.get(name, ())])
    for name, schema in ENGINE_SCHEMAS.items()
}


def _check_names(table: str, given: Sequence[str], expected: Sequence[str]) -> None:
    missing = [c for c in expected if c not in given]
    extra = [c for c in given if c not in expected]
    if missing or extra:
        raise ValueError(f"{table}: missing columns {missing}, unexpected columns {extra}")


def _to_array(table: str, field: pa.Field, values) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        if isinstance(values, pa.Array):
            arr = values.cast(field.type, safe=True)
        else:
            arr = pa.array(np.asarray(values) if not isinstance(values, list) else values)
            arr = arr.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as e:
        raise ValueError(f"{table}.{field.name}: cannot cast to {field.type}: {e}") from e
    if arr.null_count:
        raise ValueError(f"{table}.{field.name}: {arr.null_count} nulls (use the field's sentinel)")
    allowed = field.metadata.get(b"values")
    if allowed is not None and len(arr):
        allowed_values = pa.array(allowed.decode().split("|"))
        import pyarrow.compute as pc  # here: its import costs as much as a short run's writes

        bad = pc.filter(arr, pc.invert(pc.is_in(arr, value_set=allowed_values)))
        if len(bad):
            shown = sorted(set(bad.to_pylist()))[:5]
            raise ValueError(f"{table}.{field.name}: values {shown} not in {allowed.decode()}")
    return arr


def _cast(table: str, schema: pa.Schema, columns: Mapping) -> pa.Table:
    _check_names(table, list(columns), schema.names)
    arrays = [_to_array(table, field, columns[field.name]) for field in schema]
    lengths = {field.name: len(a) for field, a in zip(schema, arrays, strict=True)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{table}: columns differ in length: {lengths}")
    return pa.Table.from_arrays(arrays, schema=schema)


def to_table(name: str, columns: Mapping[str, list | np.ndarray] | pa.Table) -> pa.Table:
    """Cast engine columns to `ENGINE_SCHEMAS[name]`.

    Column names must match exactly (ValueError names missing and unexpected
    ones); values are cast safely (no silent truncation), nulls are refused
    and enumerated strings are checked against the field's allowed values.
    """
    if name not in ENGINE_SCHEMAS:
        raise ValueError(f"unknown ledger table {name!r}: expected one of {TABLES}")
    if isinstance(columns, pa.Table):
        columns = {c: columns.column(c) for c in columns.column_names}
    return _cast(name, ENGINE_SCHEMAS[name], columns)


def to_stored_table(name: str, columns: Mapping | pa.Table) -> pa.Table:
    """Cast a table already holding every stored column to `SCHEMAS[name]`."""
    if name not in SCHEMAS:
        raise ValueError(f"unknown ledger table {name!r}: expected one of {TABLES}")
    if isinstance(columns, pa.Table):
        columns = {c: columns.column(c) for c in columns.column_names}
    return _cast(name, SCHEMAS[name], columns)
