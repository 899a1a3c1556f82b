"""One cell served over HTTP: server subprocess, streaming client, metrics poller.

Per run: start the server and wait for /health (boot, outside the episode); at
t0 (episode start) read the server's clock once to map its times onto the
client's; send the workload at its planned arrival times while the poller samples
/metrics every second; when every request has completed, the episode ends at the
next whole second; then stop the server (graceful: records with END) and build
the same tables a simulated run produces. Request latencies (TTFT, E2E, TPOT)
are the client's; engine-side counts (adopted prefix, preemptions, episodes) and
the trace, slab and steps tables come from the server's records on the client's
clock, with request ids mapped back to workload ids.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
import time

import httpx

from experiments.runners.http_client import ClientRecord, send_workload
from experiments.runners.poller import Poller
from experiments.runners.server_process import ServerError, ServerProcess, hsl_server_command
from ledgers.schemas import ENGINE_SCHEMAS
from serving_core.records import REQUEST_COLUMNS, run_summary
from serving_core.server.records_out import RECORD_TABLES, read_records

logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request or scrape

# Summary keys copied from the server's own summary (engine-side counts).
ENGINE_KEYS = ("preemptions", "prefix_hit_tokens", "prefill_tokens_computed", "max_running",
               "max_waiting")


def _clock_offset(base_url: str, t0: float) -> float:
    """Client episode time minus server clock (midpoint of one /health round trip)."""
    a = time.perf_counter() - t0
    r = httpx.get(base_url + "/health", timeout=5.0)
    b = time.perf_counter() - t0
    r.raise_for_status()
    return (a + b) / 2 - float(r.json()["clock_s"])


def _engine_id(server_id: str) -> int:
    try:
        return int(server_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def request_table(specs, records: list[ClientRecord], server_requests: dict, offset: float):
    """The requests table: client timings, engine counts joined by engine request id."""
    by_engine = {rid: i for i, rid in enumerate(server_requests["request_id"])}
    cols = {c: [] for c in REQUEST_COLUMNS}
    for spec, rec in zip(specs, records, strict=True):
        i = by_engine.get(_engine_id(rec.server_id))
        srv = {c: server_requests[c][i] for c in server_requests} if i is not None else {}
        n = len(rec.token_times_s)
        ok = rec.ok
        row = {
            "request_id": int(spec.request_id),
            "arrival_s": rec.sent_s,
            "start_s": srv.get("start_s", math.nan) + offset,
            "first_token_s": rec.first_token_s,
            "finish_s": rec.finish_s if ok else math.nan,
            "prompt_tokens": len(spec.prompt),
            "output_tokens": n,
            "target_output_tokens": int(spec.output_tokens),
            "adopted_prefix_tokens": srv.get("adopted_prefix_tokens", 0),
            "resume_adopted_tokens": srv.get("resume_adopted_tokens", 0),
            "preemptions": srv.get("preemptions", 0),
            "episodes": srv.get("episodes", 0),
            "context_id": int(spec.context_id),
            "salt": spec.salt,
            "ttft_s": rec.first_token_s - rec.sent_s,
            "e2e_s": rec.finish_s - rec.sent_s if ok else math.nan,
            "tpot_s": (rec.finish_s - rec.first_token_s) / (n - 1) if ok and n > 1 else math.nan,
            "status": "finished" if ok else "failed",
        }
        for c in REQUEST_COLUMNS:
            cols[c].append(row[c])
    return cols


def request_paths_table(records: list[ClientRecord]) -> dict:
    """The request_paths table: each request's actual path as the server reported it."""
    return {
        "request_id": [r.request_id for r in records],
        "path": [r.path for r in records],
        "reused_tokens": [r.reused_tokens for r in records],
        "restored_tokens": [r.restored_tokens for r in records],
        "first_batch_computed": [r.first_batch_computed for r in records],
        "first_batch_scheduled": [r.first_batch_scheduled for r in records],
        "cached_prompt_tokens": [r.cached_prompt_tokens for r in records],
    }


def _remap(table: dict, offset: float, ids: dict[int, int], time_cols, id_cols) -> dict:
    out = dict(table)
    for c in time_cols:
        out[c] = [t + offset for t in table[c]]
    for c in id_cols:
        out[c] = [ids.get(r, r) if r >= 0 else r for r in table[c]]
    return out


def summarize_client(records: list[ClientRecord], episode_end: int, wall: float) -> dict:
    """The run summary (serving_core.records.run_summary) of the client's records: send
    times, first-token and finish times and token gaps as the client saw them."""
    return run_summary(
        arrival_s=[r.sent_s for r in records],
        first_token_s=[r.first_token_s for r in records],
        finish_s=[r.finish_s for r in records],
        output_tokens=[len(r.token_times_s) for r in records],
        done=[r.ok for r in records],
        episode_end_s=episode_end,
        sim_seconds=float(episode_end),
        wall_seconds=wall,
        inter_token_s=[d for r in records if r.ok for d in r.inter_token_s()],
    )


async def run_episode(base_url: str, kind: str, specs, t0: float, *, model: str | None = None,
                      extra: dict | None = None):
    """Send the workload while the poller samples; (client records, poller)."""
    poller = Poller(base_url, kind, t0)
    poll_task = asyncio.create_task(poller.run())
    try:
        records = await send_workload(base_url, specs, t0, model=model, extra=extra)
    finally:
        poller.stop()
        await poll_task
    return records, poller


def _from_poller(columns: dict) -> dict:
    """Engine-side summary keys as the poller saw them (servers without records)."""
    def last(col):
        return columns[col][-1] if columns[col] else 0

    return {
        "preemptions": last("preemptions_total"),
        "prefix_hit_tokens": last("prefix_hit_tokens_total"),
        "prefill_tokens_computed": last("prompt_tokens_total"),
        "max_running": max(columns["running"], default=0),
        "max_waiting": max(columns["waiting"], default=0),
    }


def serve_over_http(cmd: list[str], specs, *, kind: str = "hsl", records_dir: str | None,
                    health_timeout_s: float = 180.0, on_boot=None):
    """Run the workload against the server started by `cmd`; (tables, summary).

    With `records_dir` (our server) the engine's tables and counts come from its records;
    without (another server kind) trace, slab and steps stay empty and the engine-side
    counts come from the last /metrics sample. `on_boot(server_process)` runs once the
    server is healthy, before any request (a check that may refuse the run)."""
    wall0 = time.perf_counter()
    with ServerProcess(cmd, health_timeout_s=health_timeout_s) as srv:
        if on_boot is not None:
            on_boot(srv)
        t0 = time.perf_counter()  # episode start: orchestration begins, boot excluded
        offset = _clock_offset(srv.base_url, t0) if records_dir else 0.0
        # the final usage chunk carries the server's record of each request's path
        usage = {"stream_options": {"include_usage": True}}
        records, poller = asyncio.run(run_episode(srv.base_url, kind, specs, t0, extra=usage))
        episode_end = math.ceil(time.perf_counter() - t0)
        failed = [r for r in records if not r.ok]
        died = srv.proc.poll()
        code = srv.stop(abort=bool(failed))
        if failed:
            first = failed[0]
            state = f"exited with code {died}" if died is not None else "stopped"
            raise ServerError(
                f"{len(failed)}/{len(records)} requests failed (server {state}); first: "
                f"request {first.request_id}: {first.error or first.finish_reason or 'no finish'}"
                f"; server stderr: {srv.stderr_tail()}"
            )
        if code != 0:
            raise ServerError(f"server exited with code {code} at shutdown: {srv.stderr_tail()}")
    if records_dir:
        tables, server_summary = read_records(records_dir)
        engine_counts = {k: server_summary[k] for k in ENGINE_KEYS}
    else:
        tables = {name: {c: [] for c in ENGINE_SCHEMAS[name].names} for name in RECORD_TABLES}
        engine_counts = _from_poller(poller.columns)
    ids = {_engine_id(r.server_id): r.request_id for r in records}
    out = {
        "requests": request_table(specs, records, tables["requests"], offset),
        "poller": poller.columns,
        "footprint": poller.footprint,
        "request_paths": request_paths_table(records),
        "trace": _remap(tables["trace"], offset, ids, ("t_s",),
                        ("request_id", "cause_request_id")),
        "slab": _remap(tables["slab"], offset, ids, ("t_s",), ("request_id",)),
        "steps": _remap(tables["steps"], offset, {}, ("t_start_s",), ()),
    }
    summary = summarize_client(records, episode_end, time.perf_counter() - wall0)
    summary.update(engine_counts)
    summary["poller_errors"] = poller.errors
    return out, summary


def run_cell_over_http(spec, specs):
    """executor=torch: the workload through `python -m serving_core.server`, which builds
    the engine from `spec` (the whole EngineSpec, as JSON). Returns (tables, summary,
    effective rules); the run is refused before its first request when the server's
    engine runs other rules than the spec requests."""
    from serving_core.engine import check_feasible
    from serving_core.engine_spec import check_effective
    from serving_core.memory import build_memory

    geometry = spec.geometry()
    mem = build_memory(geometry, spec.org, spec.units(geometry))
    check_feasible(mem, specs, spec.org, spec.budget)  # before a server boots for nothing
    requested = spec.requested_rules()
    effective: dict = {}

    def check(srv) -> None:
        effective.update(srv.engine_config() or {})
        check_effective(requested, effective)
        runtime = srv.runtime_config()
        if runtime is not None:  # the server process's threads and allocator, read back
            effective["runtime"] = runtime

    with tempfile.TemporaryDirectory(prefix="server-records-") as tmp:
        spec_path = f"{tmp}/spec.json"
        with open(spec_path, "w", encoding="utf-8") as fh:
            fh.write(spec.to_json())
        rec_dir = f"{tmp}/records"
        cmd = hsl_server_command(spec=spec_path, records=rec_dir)
        tables, summary = serve_over_http(cmd, specs, records_dir=rec_dir, on_boot=check)
    return tables, summary, effective
