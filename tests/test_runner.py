"""The single-run runner: run ids, runs rows, manifests, skip/redo, failures, bad input."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import pytest
from conftest import crash_before_runs_row

import ledgers
from analysis.inference import prereg
from experiments import run as runner
from experiments.runners import cell, ledger_io, manifest, provenance
from ledgers import check as ledger_check
from ledgers import writer
from ledgers.schemas import SCHEMAS

SMALL = ("workload.source=synthetic", "workload.num_requests=20")


def problems(root: Path) -> dict[str, list[str]]:
    return {k: v for k, v in ledger_check.check(root).problems.items() if v}


def one(con, sql: str):
    ((value,),) = con.execute(sql).fetchall()
    return value


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_run_writes_every_table_then_skips_on_rerun(make_cfg, tmp_path, capsys):
    cfg = make_cfg(*SMALL, "org=s2", "budget=b63", "trace=true", "campaign_name=t1",
                   "question=q9")
    root = tmp_path / "ledgers"
    summary = runner.main_run(cfg)
    first = capsys.readouterr().out
    assert last_json(first) == json.loads(json.dumps(summary))  # last line = the summary
    key = ledger_io.run_key(cfg)
    con = ledgers.connect(root)
    row = con.execute("SELECT * FROM runs").df().iloc[0]
    assert row.run_id == key.run_id and row.campaign == "t1" and row.question == "q9"
    assert (row.org, row.arm, row.reuse, row.budget, row.arrival) == ("S2", "S2", "share", "b63",
                                                                      "poisson")
    assert row.units == sum(json.loads(row.units_detail).values()) > 0
    assert row.status == "complete" and row.adopted and row.trace
    assert row.completed_requests == summary["completed"] == 20
    assert row.output_tokens == summary["output_tokens"]
    assert row.throughput_ledger == pytest.approx(summary["throughput_ledger"])
    assert row.prereg_plan_hash == prereg.load_plan("q9").plan_hash
    assert row.retention_k == -1 and row.pinning_k == -1 and math.isnan(row.d0_attention_fraction)
    env = json.loads(row.environment)
    assert env["packages"]["hydra-core"] == "1.3.8" and env["cpu"] and env["python"]
    assert row.code_version.startswith(provenance.package_version(provenance.PACKAGE))
    assert one(con, "SELECT count(*) FROM requests") == 20
    assert one(con, "SELECT count(*) FROM trace WHERE event = 'END'") == 1
    assert not problems(root)

    assert list(summary) == list(cell.LAST_LINE_KEYS) and summary["skipped"] is False
    assert summary["run_id"] == key.run_id
    assert 0 < summary["engine_seconds"] <= summary["run_seconds"]
    assert row.engine_seconds == summary["engine_seconds"]
    assert row.run_seconds == summary["run_seconds"]

    runner.main_run(cfg)
    again = capsys.readouterr().out
    assert again.startswith(f"skipped: run {key.run_id}")
    skipped = last_json(again)
    # same keys, same values read back from the ledger; only the skipped flag differs
    assert skipped == json.loads(json.dumps(summary)) | {"skipped": True}
    assert one(ledgers.connect(root), "SELECT count(*) FROM raw_runs") == 1

    manifest.manifest_path(root, "t1", key.run_id).unlink()  # summary keys beyond the runs row
    runner.main_run(cfg)
    bare = last_json(capsys.readouterr().out)
    assert list(bare) == list(cell.LAST_LINE_KEYS) and bare["ttft_p99"] is None
    assert bare["output_tokens"] == summary["output_tokens"] and bare["skipped"] is True


def test_damaged_complete_run_is_quarantined_and_redone(make_cfg, tmp_path, capsys):
    cfg = make_cfg(*SMALL, "campaign_name=t6")
    root = tmp_path / "ledgers"
    first = runner.main_run(cfg)
    (victim,) = (root / "requests" / "campaign=t6").glob("*.parquet")
    victim.write_bytes(victim.read_bytes()[:100])
    capsys.readouterr()
    again = runner.main_run(cfg)
    out = capsys.readouterr().out
    assert f"run {first['run_id']}: quarantined " in out and "runs to redo: 1" in out
    assert again["skipped"] is False and again["output_tokens"] == first["output_tokens"]
    (moved,) = (root / "quarantine").glob("*/requests/campaign=t6/*.parquet")
    assert moved.name == victim.name and moved.stat().st_size == 100
    assert ledger_check.check(root).ok
    assert one(ledgers.connect(root), "SELECT count(*) FROM requests") == 20


def test_run_id_hashes_identity_not_bookkeeping(make_cfg, tmp_path):
    base = ledger_io.run_key(make_cfg(*SMALL))
    same = ledger_io.run_key(make_cfg(*SMALL, f"ledger_root={tmp_path / 'elsewhere'}",
                                      "write_ledgers=false"))
    assert same == base
    seed = ledger_io.run_key(make_cfg(*SMALL, "seed=7"))
    rep = ledger_io.run_key(make_cfg(*SMALL, "replicate=1"))
    org = ledger_io.run_key(make_cfg(*SMALL, "org=s1"))
    assert len({base.run_id, seed.run_id, rep.run_id, org.run_id}) == 4
    assert seed.config_hash == rep.config_hash == base.config_hash != org.config_hash
    expected = hashlib.sha256(f"{base.config_hash}:42000:0".encode()).hexdigest()[:16]
    assert base.run_id == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("org=d0", "model.d0_attention_fraction=0.35"),
         {"org": "D0", "arm": "D0", "d0_attention_fraction": 0.35, "retention_k": -1}),
        (("org=s2_retention", "retention.k=3", "workload.reuse=isolate", "budget=254 pages"),
         {"org": "S2_RETENTION", "arm": "S2+Retention", "retention_k": 3, "reuse": "isolate",
          "budget": "p254"}),
        (("org=s0", "engine.pinning_k=2", "load.arrival=onoff", "engine.headroom=0.19"),
         {"org": "S0", "pinning_k": 2, "arrival": "onoff", "f": 0.19}),
    ],
)
def test_cell_columns_follow_the_config(make_cfg, overrides, expected):
    columns = ledger_io.cell_columns(make_cfg(*overrides))
    assert {k: columns[k] for k in expected} == expected
    runs_columns = set(SCHEMAS["runs"].names)
    assert set(columns) <= runs_columns


def test_crashed_attempt_is_invisible_and_redone(make_cfg, tmp_path, monkeypatch):
    cfg = make_cfg(*SMALL, "campaign_name=t2")
    root = tmp_path / "ledgers"
    real_write = crash_before_runs_row(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner.main_run(cfg)
    con = ledgers.connect(root)
    assert one(con, "SELECT count(*) FROM raw_requests") == 20
    assert one(con, "SELECT count(*) FROM requests") == 0
    assert one(con, "SELECT count(*) FROM runs") == 0
    assert "incomplete runs" in problems(root)

    monkeypatch.setattr(writer, "write_atomic", real_write)
    runner.main_run(cfg)
    con = ledgers.connect(root)
    assert one(con, "SELECT count(*) FROM runs") == 1
    assert one(con, "SELECT count(*) FROM requests") == 20  # the crashed attempt's rows never count
    report = ledger_check.check(root)
    assert report.ok and report.notes["superseded attempts"]


def test_raising_cell_is_recorded_failed_then_redone(make_cfg, tmp_path, monkeypatch):
    cfg = make_cfg(*SMALL, "campaign_name=t3")
    root = tmp_path / "ledgers"

    def engine_bug(_cfg, **_plan_and_engine):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(runner, "run_cell", engine_bug)
    with pytest.raises(RuntimeError, match="engine bug"):
        runner.main_run(cfg)
    con = ledgers.connect(root)
    assert con.execute("SELECT status, completed_requests FROM raw_runs").fetchall() == [
        ("failed", 0)]
    assert one(con, "SELECT count(*) FROM runs") == 0
    key = ledger_io.run_key(cfg)
    assert manifest.read_manifest(root, "t3", key.run_id)["error"] == "RuntimeError('engine bug')"
    assert "incomplete runs" in problems(root)

    monkeypatch.undo()
    runner.main_run(cfg)
    assert one(ledgers.connect(root), "SELECT status FROM runs") == "complete"
    assert ledger_check.check(root).ok


def test_manifest_records_provenance_and_resolved_config(make_cfg, tmp_path):
    cfg = make_cfg(*SMALL, "org=s1", "campaign_name=t4", "question=q1")
    runner.main_run(cfg)
    key = ledger_io.run_key(cfg)
    data = manifest.read_manifest(tmp_path / "ledgers", "t4", key.run_id)
    assert data["config_hash"] == key.config_hash and data["status"] == "complete"
    assert data["prereg_plan_hash"] == prereg.load_plan("q1").plan_hash
    assert data["code_version"] == provenance.code_version()
    assert data["environment"]["packages"]["pyarrow"] == provenance.package_version("pyarrow")
    assert data["config"]["org"] == "s1" and data["config"]["workload"]["num_requests"] == 20
    assert data["workload"]["num_requests"] == 20 and data["summary"]["completed"] == 20
    assert data["units"] == {"shared": one(ledgers.connect(tmp_path / "ledgers"),
                                          "SELECT units FROM runs")}


def test_prereg_plan_hash_only_for_questions_with_a_plan():
    assert provenance.prereg_plan_hash("q9") == prereg.load_plan("q9").plan_hash
    assert provenance.prereg_plan_hash("caps") == prereg.load_plan("caps").plan_hash
    assert provenance.prereg_plan_hash("adhoc") == provenance.prereg_plan_hash("") == ""


def _git_index(entries: list[tuple[str, bytes]]) -> bytes:
    out = struct.pack(">4sII", b"DIRC", 2, len(entries))
    for path, sha in entries:
        name = path.encode()
        body = bytes(40) + sha + struct.pack(">H", len(name)) + name
        out += body + b"\0" * (8 - len(body) % 8)
    return out + bytes(20)


def test_code_version_reads_git_files_and_works_without_git(tmp_path):
    assert provenance.code_version.__wrapped__(tmp_path).endswith("+nogit")
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / ".git" / "refs" / "heads" / "main").write_text(commit + "\n")
    files = {"a.py": b"print(1)\n", "conf/b.yaml": b"x: 1\n"}
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    shas = [(n, hashlib.sha1(b"blob %d\0" % len(d) + d).digest()) for n, d in files.items()]
    (repo / ".git" / "index").write_bytes(_git_index(shas))
    version = provenance.package_version(provenance.PACKAGE)
    assert provenance.code_version.__wrapped__(repo) == f"{version}+g0123456789ab"
    (repo / "conf" / "b.yaml").write_bytes(b"x: 2\n")
    assert provenance.code_version.__wrapped__(repo) == f"{version}+g0123456789ab.dirty"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("org=s9", "org='s9'"),
        ("budget=q12", "budget='q12'"),
        ("engine.cap=0", "engine.cap=0"),
        ("engine.cap=many", "engine.cap='many'"),
        ("workload.q=1.5", "workload.q=1.5"),
        ("load.arrival=bursty", "load.arrival='bursty'"),
        ("seed=-1", "seed=-1"),
        ("campaign_name=bad/name", "campaign_name='bad/name'"),
        ("model.d0_attention_fraction=0", "d0_attention_fraction=0"),
    ],
)
def test_bad_input_names_the_field_before_running(make_cfg, tmp_path, override, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        runner.main_run(make_cfg(*SMALL, override))
    assert not (tmp_path / "ledgers" / "runs").exists()


def test_unwritable_ledger_root_is_named(make_cfg, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="ledger_root=.*not a writable directory"):
        runner.main_run(make_cfg(*SMALL, f"ledger_root={blocker / 'ledgers'}"))


# The command line's exit 2 naming the field (org=s9, nothing written) is the case
# "run org=s9" of tests/test_bad_input.py, run there with the other bad input in one batch.


def test_deliberate_replicate_is_kept_but_not_adopted(make_cfg, tmp_path):
    first = make_cfg(*SMALL, "campaign_name=t5")
    second = make_cfg(*SMALL, "campaign_name=t5", "replicate=1")
    runner.main_run(first)
    runner.main_run(second)
    rows = ledgers.connect(tmp_path / "ledgers").execute(
        "SELECT replicate, adopted, config_hash FROM runs ORDER BY replicate").fetchall()
    assert [(r, a) for r, a, _ in rows] == [(0, True), (1, False)]
    assert rows[0][2] == rows[1][2]  # same cell, same seed: one adoption key
    assert ledger_check.check(tmp_path / "ledgers").ok


@pytest.mark.parametrize("executor, clock", [("a100", "simulated s"), ("torch", "wall-clock s"),
                                             ("torch_inproc", "wall-clock s"),
                                             ("vllm", "wall-clock s")])
def test_summary_names_the_clock_of_its_executor(make_cfg, monkeypatch, capsys, executor, clock):
    """The human summary's episode time is "simulated s" only for the simulated executor;
    the cell itself is the simulated one (run_cell is swapped in for real executors)."""
    simulated = make_cfg(*SMALL, "write_ledgers=false")
    result = cell.run_cell(simulated)
    cfg = make_cfg(*SMALL, "write_ledgers=false", f"executor={executor}", "model=falcon_h1_tiny")
    monkeypatch.setattr(runner, "validate_config", lambda c, **kw: None)  # no checkpoint needed
    monkeypatch.setattr(runner, "checked_engine", lambda plan: None)  # here, nor an engine
    monkeypatch.setattr(runner, "run_cell", lambda c, **kw: result)
    line = runner.main_run(cfg)
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith(f"output tokens in {line['sim_seconds']:.1f} {clock}")
    assert ("simulated" in head) == (executor == "a100")
