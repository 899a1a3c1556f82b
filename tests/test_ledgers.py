"""Ledger schemas, atomic writer, DuckDB catalog and checker on synthetic runs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import crash_before_runs_row

import ledgers
from ledgers import check as ledger_check
from ledgers import integrity, writer
from ledgers.catalog import LedgerWarning
from ledgers.schemas import ENGINE_SCHEMAS, SCHEMAS, TABLES, WORKLOAD_COLUMNS, to_table
from serving_core.records import mechanism_absent

CAMPAIGN = "q1"


def requests_columns(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0.0, 10.0, n))
    start = arrival + 0.1
    first = start + 0.2
    out = rng.integers(2, 50, n)
    finish = first + 0.01 * out
    finish[-1] = math.nan  # the last request never finished
    status = ["finished"] * (n - 1) + ["unfinished"]
    return {
        "request_id": np.arange(n),
        "arrival_s": arrival,
        "start_s": start,
        "first_token_s": first,
        "finish_s": finish,
        "prompt_tokens": rng.integers(100, 3000, n),
        "output_tokens": out,
        "target_output_tokens": out,
        "adopted_prefix_tokens": np.zeros(n, dtype=np.int64),
        "resume_adopted_tokens": np.zeros(n, dtype=np.int64),
        "preemptions": np.zeros(n, dtype=np.int64),
        "episodes": np.ones(n, dtype=np.int64),
        "context_id": [-1] * n,
        "salt": [""] * n,
        "ttft_s": first - arrival,
        "e2e_s": finish - arrival,
        "tpot_s": (finish - first) / np.maximum(out - 1, 1),
        "status": status,
    }


def poller_columns(seconds: int) -> dict:
    t = np.arange(seconds)
    used = (t * 3) % 50
    return {
        "t_s": t,
        "pool": ["shared"] * seconds,
        "running": t % 5,
        "waiting": t % 3,
        "units_used": used,
        "units_cached": np.full(seconds, 4),
        "units_free": 63 - used - 4,
        "units_total": np.full(seconds, 63),
        "usage_frac": used / 63,
        "preemptions_total": np.zeros(seconds, dtype=np.int64),
        "prompt_tokens_total": t * 100,
        "generation_tokens_total": t * 20,
        "prefix_hit_tokens_total": t * 10,
    }


def trace_columns(num_requests: int, *, end: bool = True) -> dict:
    events, request_ids = [], []
    for r in range(num_requests):
        events += ["ENTER_WAITING", "LOOKUP", "ADOPT", "FINISH"]
        request_ids += [r] * 4
    if end:
        events.append("END")
        request_ids.append(-1)
    n = len(events)
    adopt = np.array([e in ("ADOPT", "LOOKUP") for e in events])
    depth = np.where(adopt, 512, -1)
    return {
        "seq": np.arange(n),
        "t_s": np.linspace(0.0, 5.0, n),
        "step": np.arange(n) // 2,
        "event": events,
        "request_id": request_ids,
        "episode": [0 if r >= 0 else -1 for r in request_ids],
        "kind": ["attention" if a else "" for a in adopt],
        "boundary": depth,
        "key": [f"k{i}" if a else "" for i, a in enumerate(adopt)],
        "a_m0": depth,
        "rmax_m0": depth,
        "j_m0": depth,
        "a_m1": depth,
        "rmax_m1": depth,
        "j_m1": depth,
        "cause_request_id": [-1] * n,
        "need": [-1] * n,
        "free": [-1] * n,
        "pool": [""] * n,
        "dropped": [0] * n,
        "write_errors": [0] * n,
    }


def slab_columns() -> dict:
    return {
        "seq": [0, 1, 2, 3],
        "t_s": [0.0, 0.1, 0.5, 0.6],
        "step": [0, 0, 3, 4],
        "event": ["SLAB_ALLOC", "SLOT_ALLOC", "SLOT_FREE", "SLAB_FREE"],
        "page": [7, 7, 7, 7],
        "slot": [-1, 0, 0, -1],
        "request_id": [-1, 0, 0, -1],
        "occupancy": [0, 1, 0, 0],
        "invalidated": [0, 0, 0, 0],
    }


def steps_columns(n: int) -> dict:
    s = np.arange(n)
    return {
        "step": s,
        "t_start_s": s * 0.05,
        "duration_s": np.full(n, 0.05),
        "num_scheduled": s % 4,
        "num_running": s % 4,
        "num_waiting": s % 2,
        "prefill_tokens_initial": s * 10,
        "prefill_tokens_resume": np.zeros(n, dtype=np.int64),
        "decode_tokens": s % 4,
        "num_preempted": np.zeros(n, dtype=np.int64),
        "num_admitted": s % 2,
        "num_decode_seqs": s % 4,
        "decode_context_tokens": (s % 4) * 100,
        "prefill_attention_pairs": np.zeros(n, dtype=np.int64),
        "checkpoint_writes": np.zeros(n, dtype=np.int64),
        "num_sampling": s % 4,
    }


def runs_row(
    *,
    org: str = "s2",
    seed: int = 42000,
    replicate: int = 0,
    trace: bool = False,
    config_hash: str | None = None,
    status: str = "complete",
) -> dict:
    return {
        "question": "q1",
        "arm": org.upper(),
        "org": org,
        "budget": "b63",
        "units": 63,
        "units_detail": {"shared": 63},
        "cap": 63,
        "rate": 3.0,
        "arrival": "poisson",
        "q": 1.0,
        "f": 0.0,
        "retention_k": -1,
        "pinning_k": -1,
        "d0_attention_fraction": 0.527383 if org == "d0" else math.nan,
        "reuse": "SHARE",
        "seed": seed,
        "replicate": replicate,
        "trace": trace,
        "executor": "sim",
        "model": "falcon_h1_7b",
        "config_hash": config_hash or f"cfg-{org}",
        "prereg_plan_hash": "",
        "code_version": "0.1.0",
        "environment": {"python": "3.11"},
        "engine_config": "{}",
        "episode_start_s": 0,
        "episode_end_s": 20,
        "span_start_s": 0.1,
        "span_end_s": 19.5,
        "completed_requests": 9,
        "failed_requests": 0,
        "output_tokens": 250,
        "throughput_ledger": 12.5,
        "throughput_span": 250 / 19.4,
        "status": status,
        "run_seconds": 0.3,
        "engine_seconds": 0.2,
        **mechanism_absent(),
    }


def run_tables(*, num_requests: int = 10, trace: dict | None = None) -> dict:
    tables = {
        "requests": to_table("requests", requests_columns(num_requests, seed=num_requests)),
        "poller": poller_columns(20),
        "slab": slab_columns(),
        "steps": steps_columns(30),
    }
    if trace is not None:
        tables["trace"] = trace
    return tables


def write(
    root: Path,
    run_id: str,
    *,
    trace: dict | None = None,
    traced: bool | None = None,
    num_requests: int = 10,
    campaign: str = CAMPAIGN,
    **row,
) -> None:
    row["trace"] = trace is not None if traced is None else traced
    writer.write_run(
        root, campaign, run_id, run_tables(num_requests=num_requests, trace=trace), runs_row(**row)
    )


def count(con, sql: str):
    ((value,),) = con.execute(sql).fetchall()
    return value


def problems(root: Path) -> dict[str, list[str]]:
    return {k: v for k, v in ledger_check.check(root).problems.items() if v}


# --- schemas -------------------------------------------------------------------------------


def test_schemas_documented_and_keyed():
    assert set(SCHEMAS) == set(TABLES)
    for name, schema in SCHEMAS.items():
        for f in schema:
            assert f.metadata[b"doc"], (name, f.name)
            assert b"unit" in f.metadata, (name, f.name)
            assert not f.nullable
        if name != "runs":
            assert schema.names[:2] == ["run_id", "campaign"]
            workload = [f.name for f in WORKLOAD_COLUMNS.get(name, ())]  # writer-appended
            assert schema.names[2:] == ENGINE_SCHEMAS[name].names + workload
    assert [f.name for f in WORKLOAD_COLUMNS["requests"]] == [
        "reusable_prefix_tokens", "ideal_prefix_tokens", "cached_attention_tokens",
        *(f"lost_{c}_tokens" for c in ("block", "placement", "admission", "attention", "group",
                                       "checkpoint", "tier"))]  # + the hit attribution
    assert ENGINE_SCHEMAS["poller"].names == [
        "t_s",
        "pool",
        "running",
        "waiting",
        "units_used",
        "units_cached",
        "units_free",
        "units_total",
        "usage_frac",
        "preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_hit_tokens_total",
    ]
    assert SCHEMAS["requests"].field("ttft_s").metadata[b"unit"] == b"s"
    assert SCHEMAS["runs"].field("throughput_ledger").metadata[b"unit"] == b"tokens/s"


def test_to_table_rejects_missing_and_extra_columns():
    cols = steps_columns(3)
    del cols["decode_tokens"]
    cols["decode_tokns"] = [0, 0, 0]
    with pytest.raises(ValueError, match=r"missing columns \['decode_tokens'\].*'decode_tokns'"):
        to_table("steps", cols)
    with pytest.raises(ValueError, match="unknown ledger table"):
        to_table("stepz", steps_columns(3))


def test_to_table_casts_and_refuses_lossy_values():
    table = to_table("requests", requests_columns(4, seed=1))
    assert table.schema == ENGINE_SCHEMAS["requests"]
    assert math.isnan(table.column("finish_s")[3].as_py())  # NaN is a value, not a null
    bad = requests_columns(4, seed=1)
    bad["prompt_tokens"] = [1.5, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="prompt_tokens"):
        to_table("requests", bad)
    bad = requests_columns(4, seed=1)
    bad["salt"] = ["", None, "", ""]
    with pytest.raises(ValueError, match="salt: 1 nulls"):
        to_table("requests", bad)
    bad = requests_columns(4, seed=1)
    bad["status"] = ["finished", "done", "finished", "finished"]
    with pytest.raises(ValueError, match=r"status: values \['done'\]"):
        to_table("requests", bad)
    bad = requests_columns(4, seed=1)
    bad["salt"] = ["", ""]
    with pytest.raises(ValueError, match="differ in length"):
        to_table("requests", bad)


# --- writer and catalog -----------------------------------------------------------------------


def test_two_runs_are_visible_through_the_catalog(tmp_path):
    write(tmp_path, "runA", org="s0", num_requests=10)
    write(tmp_path, "runB", org="s2", num_requests=7, trace=trace_columns(3))
    con = ledgers.connect(tmp_path)
    assert con.execute("SELECT org, count(*) FROM runs GROUP BY ALL ORDER BY org").fetchall() == [
        ("s0", 1),
        ("s2", 1),
    ]
    assert con.execute(
        "SELECT run_id, count(*) FROM requests GROUP BY ALL ORDER BY run_id"
    ).fetchall() == [("runA", 10), ("runB", 7)]
    assert count(con, "SELECT count(*) FROM poller") == 40
    assert count(con, "SELECT count(*) FROM trace WHERE run_id = 'runB'") == 13
    assert count(con, "SELECT count(DISTINCT campaign) FROM steps") == 1
    assert count(con, "SELECT count(*) FROM requests WHERE isnan(finish_s)") == 2
    for table in TABLES:
        schema = con.sql(f"SELECT * FROM {table}").to_arrow_table().schema
        assert (schema.names, schema.types) == (SCHEMAS[table].names, SCHEMAS[table].types)
    assert count(con, "SELECT units_detail FROM runs WHERE run_id = 'runA'") == '{"shared": 63}'
    assert integrity.completed_run_ids(tmp_path) == {"runA", "runB"}
    assert integrity.completed_run_ids(tmp_path, "q9") == set()
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.parquet"))
    assert len(files) == 5 + 6  # runA has no trace file
    assert all(f.split("/")[1] == "campaign=q1" for f in files)
    assert ledger_check.check(tmp_path).ok


def test_crashed_attempt_is_invisible_listed_and_superseded_by_rerun(tmp_path, monkeypatch):
    write(tmp_path, "runA")
    real = crash_before_runs_row(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, "runC", num_requests=5)
    monkeypatch.setattr(writer, "write_atomic", real)

    con = ledgers.connect(tmp_path)
    assert count(con, "SELECT count(*) FROM raw_requests WHERE run_id = 'runC'") == 5
    assert count(con, "SELECT count(*) FROM requests WHERE run_id = 'runC'") == 0
    assert count(con, "SELECT count(*) FROM runs") == 1
    assert integrity.completed_run_ids(tmp_path) == {"runA"}
    found = problems(tmp_path)
    assert set(found) == {"incomplete runs", "orphan rows"}
    assert found["incomplete runs"][0].startswith("run runC (campaign q1): ")
    assert "no runs row" in found["incomplete runs"][0]
    assert ledger_check.main([str(tmp_path)]) == 1

    write(tmp_path, "runC", num_requests=5)  # the redo: new nonce, leftovers stay
    con = ledgers.connect(tmp_path)
    assert count(con, "SELECT count(*) FROM raw_requests WHERE run_id = 'runC'") == 10
    assert count(con, "SELECT count(*) FROM requests WHERE run_id = 'runC'") == 5
    report = ledger_check.check(tmp_path)
    assert report.ok
    assert len(report.notes["superseded attempts"]) == 1


def test_failed_run_does_not_count(tmp_path):
    write(tmp_path, "runF", status="failed")
    con = ledgers.connect(tmp_path)
    assert count(con, "SELECT count(*) FROM runs") == 0
    assert count(con, "SELECT count(*) FROM raw_runs WHERE NOT adopted") == 1
    assert count(con, "SELECT count(*) FROM steps") == 0
    assert integrity.completed_run_ids(tmp_path) == set()
    found = problems(tmp_path)
    assert list(found) == ["incomplete runs"]
    assert "runs row says failed" in found["incomplete runs"][0]


def test_duplicate_complete_run_ids_are_reported_and_counted_once(tmp_path):
    write(tmp_path, "runD", num_requests=6)
    write(tmp_path, "runD", num_requests=6)
    con = ledgers.connect(tmp_path)
    assert count(con, "SELECT count(*) FROM raw_runs") == 2
    assert count(con, "SELECT count(*) FROM runs") == 1
    assert count(con, "SELECT count(*) FROM requests") == 6
    assert count(con, "SELECT adopted FROM runs") is True  # the first attempt is canonical
    found = problems(tmp_path)
    assert list(found) == ["duplicate run ids among complete runs"]
    assert found["duplicate run ids among complete runs"][0].startswith(
        "run runD (campaign q1): 2 complete"
    )


def test_same_run_id_in_two_campaigns_are_two_runs(tmp_path):
    write(tmp_path, "runS", num_requests=4, campaign="q1")
    write(tmp_path, "runS", num_requests=6, campaign="q4")
    con = ledgers.connect(tmp_path)
    assert con.execute(
        "SELECT campaign, count(*) FROM requests GROUP BY ALL ORDER BY ALL"
    ).fetchall() == [("q1", 4), ("q4", 6)]
    assert count(con, "SELECT count(*) FROM runs WHERE adopted") == 2
    assert integrity.completed_run_ids(tmp_path, "q4") == {"runS"}
    report = ledger_check.check(tmp_path)
    assert report.ok
    assert report.notes["run ids complete in several campaigns"] == [
        "run runS: complete in campaigns q1, q4"
    ]


def test_trace_gap_is_reported_with_first_missing_seq(tmp_path):
    gap = trace_columns(2)
    gap["seq"] = np.array([0, 1, 2, 4, 5, 6, 7, 8, 9])  # seq 3 missing
    dup = trace_columns(1)
    dup["seq"] = np.array([0, 1, 1, 3, 4])  # seq 2 missing, seq 1 twice
    write(tmp_path, "runG", trace=gap)
    write(tmp_path, "runH", trace=dup, config_hash="cfg-h")
    write(tmp_path, "runOK", trace=trace_columns(2), config_hash="cfg-ok")
    found = problems(tmp_path)
    assert list(found) == ["trace sequence gaps"]
    assert found["trace sequence gaps"] == [
        "run runG (campaign q1): 9 events, seq 0..9, 1 missing (first 3)",
        "run runH (campaign q1): 5 events, seq 0..4, 1 missing (first 2), 1 duplicated",
    ]


def test_traced_run_without_final_end_is_reported(tmp_path):
    late_end = trace_columns(1)
    late_end["event"] = ["ENTER_WAITING", "LOOKUP", "END", "FINISH", "FINISH"]
    write(tmp_path, "runN", trace=trace_columns(2, end=False))
    write(tmp_path, "runL", trace=late_end, config_hash="cfg-l")
    write(tmp_path, "runT", traced=True, config_hash="cfg-t")  # traced, no trace table at all
    found = problems(tmp_path)
    assert list(found) == ["traced runs without a final END"]
    assert found["traced runs without a final END"] == [
        "run runL (campaign q1): END at seq 2 is not last (max seq 4)",
        "run runN (campaign q1): no END among 8 trace events",
        "run runT (campaign q1): no END among 0 trace events",
    ]


def test_dropped_and_write_errors_are_reported(tmp_path):
    lossy = trace_columns(1)
    lossy["dropped"] = [0, 0, 0, 0, 3]
    lossy["write_errors"] = [0, 0, 0, 0, 1]
    write(tmp_path, "runE", trace=lossy)
    assert problems(tmp_path) == {
        "dropped or write-error counts": ["run runE (campaign q1): dropped 3, write errors 1"]
    }


def test_orphan_and_mislabeled_rows_are_reported(tmp_path):
    write(tmp_path, "runA")
    steps = writer._with_keys("steps", to_table("steps", steps_columns(3)), "runX", CAMPAIGN)
    writer.write_atomic(
        steps, writer.table_dir(tmp_path, "steps", CAMPAIGN) / f"runA-{'0' * 16}.parquet"
    )
    found = problems(tmp_path)
    assert found["orphan rows"] == ["steps: 3 rows of run runX (campaign q1) have no runs row"]
    assert found["mislabeled rows"] == [
        f"steps: 3 rows say run runX inside file runA-{'0' * 16} (campaign q1)"
    ]


# --- adoption ---------------------------------------------------------------------------------


def test_adoption_reads_each_runs_file_once_per_process(tmp_path, monkeypatch):
    """Deciding adoption reads the campaign's runs rows on every write; files already read
    (unchanged: same inode, size, mtime) are not read again, so a campaign's writes cost
    linear, not quadratic, reads. The decisions are those of reading everything."""
    read = []
    real = writer._read_complete_keys
    monkeypatch.setattr(writer, "_read_complete_keys", lambda path: read.append(
        path.name.split("-")[0]) or real(path))
    for i in range(4):
        write(tmp_path, f"rep{i}", replicate=i)
    assert read == ["rep0", "rep1", "rep2"]  # the first write finds no runs file
    con = ledgers.connect(tmp_path)
    adopted = dict(con.execute("SELECT run_id, adopted FROM runs").fetchall())
    assert adopted == {"rep0": True, "rep1": False, "rep2": False, "rep3": False}
    # A runs file rewritten in place (new inode) is read again.
    writer.adopt_run(tmp_path, CAMPAIGN, "rep2")
    read.clear()
    write(tmp_path, "rep4", replicate=4)
    assert sorted(read) == ["rep0", "rep2", "rep3"]  # adoption rewrote rep0's and rep2's files


def test_first_complete_run_of_a_cell_seed_is_adopted(tmp_path, monkeypatch):
    write(tmp_path, "rep0", replicate=0)
    write(tmp_path, "rep1", replicate=1)
    write(tmp_path, "other-seed", seed=42001)
    con = ledgers.connect(tmp_path)
    adopted = dict(con.execute("SELECT run_id, adopted FROM runs").fetchall())
    assert adopted == {"rep0": True, "rep1": False, "other-seed": True}
    assert ledger_check.check(tmp_path).ok

    writer.adopt_run(tmp_path, CAMPAIGN, "rep1")
    con = ledgers.connect(tmp_path)
    assert dict(con.execute("SELECT run_id, adopted FROM runs").fetchall()) == {
        "rep0": False,
        "rep1": True,
        "other-seed": True,
    }
    assert ledger_check.check(tmp_path).ok
    with pytest.raises(ValueError, match="no complete run"):
        writer.adopt_run(tmp_path, CAMPAIGN, "nope")

    calls = []
    real = writer._set_adopted

    def crash_after_first(path, adopted):
        if calls:
            raise KeyboardInterrupt("killed mid-adoption")
        calls.append(path)
        real(path, adopted)

    monkeypatch.setattr(writer, "_set_adopted", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        writer.adopt_run(tmp_path, CAMPAIGN, "rep0")
    assert problems(tmp_path) == {
        "adoption keys without exactly one adopted run": [
            "campaign=q1, config_hash=cfg-s2, seed=42000: 2 complete runs, 2 adopted: rep0, rep1"
        ]
    }


# --- empty roots, atomicity, validation -------------------------------------------------------


@pytest.mark.parametrize("exists", [True, False])
def test_empty_root_gives_typed_empty_views(tmp_path, exists):
    root = tmp_path if exists else tmp_path / "missing"
    with pytest.warns(LedgerWarning, match="is empty" if exists else "does not exist"):
        con = ledgers.connect(root)
    for table in TABLES:
        rel = con.execute(f"SELECT * FROM {table}")
        assert [d[0] for d in rel.description] == SCHEMAS[table].names
        assert rel.fetchall() == []
        assert con.sql(f"SELECT * FROM {table}").to_arrow_table().schema.types == (
            SCHEMAS[table].types
        )
    assert integrity.completed_run_ids(root) == set()
    assert ledger_check.main([str(root)]) == (1 if exists else 2)
    report = ledger_check.check(root)
    assert report.empty and not report.ok
    assert ledger_check.format_report(report).splitlines()[-1] == (
        f"summary: EMPTY, no ledger files under {root}")


def test_writes_leave_no_temp_files_and_temp_names_never_match(tmp_path, monkeypatch):
    write(tmp_path, "runA", trace=trace_columns(1))
    assert list(tmp_path.rglob(f"*{writer.TEMP_SUFFIX}")) == []

    final = writer.table_dir(tmp_path, "requests", CAMPAIGN) / f"runZ-{'1' * 16}.parquet"
    tmp = writer.temp_path(final)
    pq.write_table(
        writer._with_keys(
            "requests", to_table("requests", requests_columns(3, 0)), "runZ", CAMPAIGN
        ),
        tmp,
    )  # a killed writer's leftover
    con = ledgers.connect(tmp_path)
    globbed = {
        r[0]
        for r in con.execute(
            "SELECT file FROM glob(?)", [writer.table_glob(tmp_path, "requests")]
        ).fetchall()
    }
    assert str(tmp.resolve()) not in globbed and len(globbed) == 1
    assert count(con, "SELECT count(*) FROM raw_requests") == 10
    report = ledger_check.check(tmp_path)
    assert report.ok and report.notes["stale temp files"] == [str(tmp)]
    tmp.unlink()

    def fail_mid_write(table, where, **kwargs):
        where.write(b"PAR1 partial")
        raise OSError("disk full")

    monkeypatch.setattr(writer.pq, "write_table", fail_mid_write)
    with pytest.raises(OSError, match="disk full"):
        write(tmp_path, "runB")
    assert list(tmp_path.rglob(f"*{writer.TEMP_SUFFIX}")) == []
    assert integrity.completed_run_ids(tmp_path) == {"runA"}
    assert not [p for p in tmp_path.rglob("runB-*")]


def test_every_file_and_directory_is_fsynced_unless_sync_is_off(tmp_path, monkeypatch):
    """HSL_LEDGER_SYNC=on (the default; the suite runs with off): each table file, before
    its rename, and each directory it lands in; off: no fsync, the same files."""
    synced = []

    def record(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(writer.os, "fsync", record)
    monkeypatch.setenv(writer.SYNC_ENV, "on")
    write(tmp_path / "on", "runA")
    files = sorted((tmp_path / "on").rglob("*.parquet"))
    temps = [p for p in synced if p.suffix == writer.TEMP_SUFFIX]
    assert sorted(writer.temp_path(f) for f in files) == sorted(temps)
    assert sorted(p for p in synced if p not in temps) == sorted({f.parent for f in files})
    synced.clear()
    monkeypatch.setenv(writer.SYNC_ENV, "off")
    write(tmp_path / "off", "runA")
    assert synced == [] and len(list((tmp_path / "off").rglob("*.parquet"))) == len(files)
    monkeypatch.setenv(writer.SYNC_ENV, "no")
    with pytest.raises(ValueError, match=r"^HSL_LEDGER_SYNC='no': allowed on, off$"):
        write(tmp_path / "bad", "runA")


def test_write_run_validates_everything_before_writing(tmp_path):
    row = runs_row()
    del row["seed"]
    with pytest.raises(ValueError, match=r"runs: missing columns \['seed'\]"):
        writer.write_run(tmp_path, CAMPAIGN, "runA", run_tables(), row)
    with pytest.raises(ValueError, match="set by the writer"):
        writer.write_run(tmp_path, CAMPAIGN, "runA", run_tables(), {**runs_row(), "adopted": True})
    with pytest.raises(ValueError, match="campaign='q2' differs"):
        writer.write_run(tmp_path, CAMPAIGN, "runA", run_tables(), {**runs_row(), "campaign": "q2"})
    with pytest.raises(ValueError, match="unknown run tables"):
        writer.write_run(tmp_path, CAMPAIGN, "runA", {"trcae": {}}, runs_row())
    with pytest.raises(ValueError, match="campaign="):
        writer.write_run(tmp_path, "../q1", "runA", run_tables(), runs_row())
    with pytest.raises(ValueError, match="environment: not valid JSON"):
        writer.write_run(
            tmp_path, CAMPAIGN, "runA", run_tables(), {**runs_row(), "environment": "{"}
        )
    assert list(tmp_path.iterdir()) == []


def test_check_cli_exit_codes(tmp_path):
    write(tmp_path, "runA", trace=trace_columns(1, end=False))
    cmd = [sys.executable, "-m", "ledgers.check", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 1, proc.stderr
    assert "[FAIL] traced runs without a final END: 1" in proc.stdout
    assert (
        proc.stdout.strip()
        .splitlines()[-1]
        .startswith("summary: FAIL, problems found (traced runs without a final END: 1)")
    )


# --- damaged ledgers ---------------------------------------------------------------------------


def attempt_file(root: Path, table: str, run_id: str, campaign: str = CAMPAIGN) -> Path:
    (path,) = writer.table_dir(root, table, campaign).glob(f"{run_id}-*.parquet")
    return path


def connect_warned(root: Path) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        con = ledgers.connect(root)
    return con, [str(w.message) for w in caught if issubclass(w.category, LedgerWarning)]


def test_runs_row_records_every_table_file_with_rows_size_and_checksum(tmp_path):
    write(tmp_path, "runA", trace=trace_columns(2))
    ((text,),) = ledgers.connect(tmp_path).execute("SELECT files FROM runs").fetchall()
    record = json.loads(text)
    assert sorted(record) == ["poller", "requests", "slab", "steps", "trace"]
    for table, entry in record.items():
        path = attempt_file(tmp_path, table, "runA")
        data = path.read_bytes()
        assert entry == {"rows": pq.read_metadata(path).num_rows, "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()}
    assert record["requests"]["rows"] == 10 and record["trace"]["rows"] == 9


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_table_file_fails_the_check_and_the_run_stops_counting(tmp_path, damage):
    write(tmp_path, "runA")
    write(tmp_path, "runB", org="s0")
    victim = attempt_file(tmp_path, "requests", "runA")
    rel = victim.relative_to(tmp_path).as_posix()
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[:100])
    elif damage == "delete":
        victim.unlink()
    else:  # same size, one byte changed in the middle: only the checksum sees it
        middle = len(data) // 2
        victim.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    expected = {"truncate": "no Parquet magic bytes", "delete": "missing",
                "flip": "checksum differs"}[damage]
    report = ledger_check.check(tmp_path)
    (line,) = report.problems["complete runs with missing or damaged files"]
    assert line.startswith("run runA (campaign q1, attempt runA-") and f"{rel}: {expected}" in line
    assert report.num_complete_runs == 1 and not report.ok
    assert not report.problems["incomplete runs"]  # reported once, in its own category
    assert (report.problems["unreadable files"] != []) == (damage == "truncate")
    text = ledger_check.format_report(report)
    assert text.splitlines()[-1].startswith("summary: FAIL") and rel in text

    if damage == "flip":  # the cheap catalog check sees nothing wrong, the deep one does
        assert integrity.completed_run_ids(tmp_path) == {"runA", "runB"}
        assert integrity.scan_root(tmp_path, deep=True).complete_runs == {("q1", "runB")}
        return
    con, warned = connect_warned(tmp_path)
    assert count(con, "SELECT count(*) FROM runs") == 1
    assert con.execute("SELECT DISTINCT run_id FROM requests").fetchall() == [("runB",)]
    assert any("not counted" in w and rel in w for w in warned)
    assert integrity.completed_run_ids(tmp_path) == {"runB"}


def test_garbage_and_truncated_files_are_skipped_with_a_warning_naming_them(tmp_path):
    write(tmp_path, "runA")
    garbage = writer.table_dir(tmp_path, "poller", CAMPAIGN) / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all" * 10)
    bad_runs = writer.table_dir(tmp_path, "runs", "q2") / f"runX-{'0' * 16}.parquet"
    bad_runs.parent.mkdir(parents=True)
    bad_runs.write_bytes(attempt_file(tmp_path, "runs", "runA").read_bytes()[:100])
    con, warned = connect_warned(tmp_path)
    assert count(con, "SELECT count(*) FROM runs") == 1
    assert count(con, "SELECT count(*) FROM raw_poller") == 20
    (warning,) = warned
    assert "2 skipped unreadable files" in warning
    assert "poller/campaign=q1/garbage.parquet" in warning and "runs/campaign=q2/runX-" in warning
    assert integrity.completed_run_ids(tmp_path) == {"runA"}
    assert [r["run_id"] for r in writer.read_raw_runs(tmp_path)] == ["runA"]
    (tmp_path / "stray.parquet").write_bytes(b"junk")
    (tmp_path / "requests" / "nested").mkdir()
    (tmp_path / "requests" / "nested" / "deep.parquet").write_bytes(b"junk")
    report = ledger_check.check(tmp_path)
    assert sorted(line.split(":")[0] for line in report.problems["unreadable files"]) == [
        "poller/campaign=q1/garbage.parquet", f"runs/campaign=q2/runX-{'0' * 16}.parquet"]
    assert report.num_complete_runs == 1
    assert report.notes["Parquet files outside the ledger layout"] == [
        str(tmp_path / "requests" / "nested" / "deep.parquet"), str(tmp_path / "stray.parquet")]


def test_file_damaged_inside_despite_its_magic_bytes_costs_only_itself(tmp_path):
    write(tmp_path, "runA")
    write(tmp_path, "runB", org="s0")
    victim = attempt_file(tmp_path, "runs", "runB")
    data = bytearray(victim.read_bytes())
    data[4:200] = b"\xff" * 196  # column chunks overwritten, magic bytes and footer intact
    victim.write_bytes(bytes(data))
    rows, bad = ledgers.files.read_rows(sorted(writer.committed_files(tmp_path, "runs")))
    assert [r["run_id"] for r in rows] == ["runA"] and list(bad) == [victim]
    assert integrity.completed_run_ids(tmp_path) == {"runA"}


def test_quarantine_moves_damage_aside_and_a_rewrite_repairs_the_run(tmp_path):
    write(tmp_path, "runA")
    write(tmp_path, "runB", org="s0")
    attempt_file(tmp_path, "steps", "runA").unlink()
    garbage = writer.table_dir(tmp_path, "requests", CAMPAIGN) / "garbage.parquet"
    garbage.write_bytes(b"PAR1 no")
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*.parquet")}

    moved = integrity.quarantine_damage(integrity.scan_root(tmp_path, deep=True))
    assert moved.runs == ["q1/runA"]
    assert len(moved.moved) == 1 + 4  # the garbage, runA's runs row and its three left files
    assert moved.directory.parent == tmp_path / integrity.QUARANTINE_DIR
    kept = {p.name: p.read_bytes() for p in tmp_path.rglob("*.parquet")}
    assert kept == before  # nothing deleted, nothing changed: only moved
    reasons = (moved.directory / integrity.REASONS_FILE).read_text()
    assert "requests/campaign=q1/garbage.parquet: 7 bytes, too short for a Parquet" in reasons
    assert "steps/campaign=q1/runA-" in reasons and ": missing" in reasons
    assert integrity.completed_run_ids(tmp_path) == {"runB"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", LedgerWarning)  # nothing left to warn about
        assert count(ledgers.connect(tmp_path), "SELECT count(*) FROM runs") == 1

    write(tmp_path, "runA")  # what a rerun does
    report = ledger_check.check(tmp_path)
    assert report.ok and report.num_complete_runs == 2
    assert integrity.quarantine_damage(integrity.scan_root(tmp_path, deep=True)).moved == []


def test_report_skips_damaged_files_with_a_warning_and_refuses_a_missing_root(tmp_path):
    from analysis import report

    root = tmp_path / "ledgers"
    write(root, "runA")
    write(root, "runB", org="s0")
    victim = attempt_file(root, "requests", "runB")
    victim.write_bytes(b"\0" * 100)
    (writer.table_dir(root, "steps", CAMPAIGN) / "garbage.parquet").write_bytes(b"x" * 64)
    with pytest.warns(LedgerWarning) as caught:
        assert report.main(["--ledgers", str(root), "--out", str(tmp_path / "out")]) == 0
    text = " ".join(str(w.message) for w in caught)
    assert victim.relative_to(root).as_posix() in text and "steps/campaign=q1/garbage" in text
    assert (tmp_path / "out" / "index.md").is_file()
    assert report.main(["--ledgers", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    with pytest.warns(LedgerWarning, match="is empty"):
        ledgers.connect(tmp_path / "out")


def test_plan_file_hash_is_read_again_when_the_file_changes(tmp_path):
    """ledgers.plans caches a plan file's hash per process: an edited file gets its new hash,
    the hash of the YAML as PyYAML's safe loader reads it; a file that is no mapping is
    refused each time."""
    import yaml

    from ledgers.plans import plan_file_hash, plan_hash

    path = tmp_path / "qx.yaml"
    path.write_text("question: qx\nfamilies: []\n")
    first = plan_file_hash("qx", tmp_path)
    assert first == plan_hash(yaml.safe_load(path.read_text())) == plan_file_hash("qx", tmp_path)
    path.write_text("question: qx\nfamilies: [{name: f1}]\n")
    assert plan_file_hash("qx", tmp_path) == plan_hash(yaml.safe_load(path.read_text())) != first
    assert plan_file_hash("", tmp_path) == plan_file_hash("absent", tmp_path) == ""
    path.write_text("- a list\n")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"question='qx': invalid preregistered plan"):
            plan_file_hash("qx", tmp_path)
