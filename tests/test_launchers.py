"""Launchers: the default process launcher (isolation, failures, timeouts), submitit_local,
the SLURM config, and Ray when its optional extra is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf

import ledgers
from hydra_plugins.hsl_campaign import process_launcher
from ledgers import check as ledger_check

REPO = Path(__file__).resolve().parent.parent
SYNTH = ("workload.source=synthetic", "workload.num_requests=20")

# A stand-in job entry point: its behaviour is chosen by its `mode=` override.
FAKE_JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    mode = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("mode="))
    if mode == "ok":
        print("human summary")
        print(json.dumps({"mode": mode, "argv": sys.argv[1:]}))
    elif mode == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit3":
        print("error: bad cell", file=sys.stderr)
        sys.exit(3)
    elif mode == "hang":
        time.sleep(600)
""")


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k

    def set_postfix(self, **_):
        pass


def fake_launcher(tmp_path: Path, **kwargs) -> process_launcher.ProcessLauncher:
    (tmp_path / "fake_job.py").write_text(FAKE_JOB)
    config = OmegaConf.create({"hydra": {
        "sweep": {"dir": str(tmp_path / "sweep")},
        "runtime": {"cwd": str(tmp_path), "config_sources": []},
        "job": {"config_name": "config", "name": "fake_job"},
        "overrides": {"hydra": ["hydra.verbose=false", "hydra/launcher=local",
                                "hydra.launcher.n_jobs=2"]},
    }})

    def task(_cfg):
        return None

    task.__module__ = "fake_job"
    launcher = process_launcher.ProcessLauncher(**kwargs)
    launcher.setup(hydra_context=None, task_function=task, config=config)
    return launcher


# The job timeout the launcher tests use: long enough that a job which only starts Python
# and prints finishes within it on a loaded machine, short enough that the hanging job's
# kill does not hold up the suite. The hanging job sleeps far longer.
JOB_TIMEOUT_S = 3


def test_process_launcher_isolates_crashes_exits_and_timeouts(tmp_path):
    launcher = fake_launcher(tmp_path, n_jobs=2, timeout_s=JOB_TIMEOUT_S)
    launcher.progress = bar = Bar()
    jobs = [["mode=ok", "x=1"], ["mode=crash"], ["mode=exit3"], ["mode=hang"], ["mode=ok"]]
    rets = launcher.launch(jobs, initial_job_idx=10)
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.FAILED,
                                        JobStatus.FAILED, JobStatus.COMPLETED]
    assert rets[0].return_value["argv"][-3:-1] == ["mode=ok", "x=1"]
    assert rets[0].return_value["argv"][-1] == f"hydra.run.dir='{tmp_path / 'sweep' / '10'}'"
    # the sweep's own hydra overrides stay with the sweep; the rest are forwarded
    assert "hydra.verbose=false" in rets[0].return_value["argv"]
    argv = rets[0].return_value["argv"]
    assert not any(a.startswith(("hydra/launcher", "hydra.launcher")) for a in argv)
    reasons = [str(r._return_value) for r in rets[1:4]]
    # by module attribute: Hydra's plugin scan re-executes plugin modules in place
    failed_type = process_launcher.JobProcessFailed
    assert all(isinstance(r._return_value, failed_type) for r in rets[1:4])
    assert reasons[0].startswith("killed by signal 9")
    assert reasons[1].startswith("exit code 3: error: bad cell")
    assert reasons[2].startswith(f"timed out after {JOB_TIMEOUT_S} s")
    assert bar.n == 5
    assert (tmp_path / "sweep" / "11" / "stdout.log").read_text().startswith("# ")


def test_process_launcher_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"hydra\.launcher\.n_jobs=-1"):
        process_launcher.ProcessLauncher(n_jobs=-1)
    with pytest.raises(ValueError, match=r"hydra\.launcher\.timeout_s=0"):
        process_launcher.ProcessLauncher(timeout_s=0)


def run_multirun(tmp_path: Path, *overrides: str, timeout: float = 300):
    cmd = [sys.executable, "-m", "experiments.run", "-m", *overrides, *SYNTH,
           f"ledger_root={tmp_path / 'ledgers'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_a_failing_cell_does_not_poison_the_campaign(tmp_path):
    # p7 passes planning but cannot hold one request of S2: the engine raises at run time.
    proc = run_multirun(tmp_path, "campaign_name=iso", "org=s2", "budget=p7,p254")
    assert proc.returncode == 1
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["done"], summary["failed"]) == (1, 1)
    assert "cannot hold one maximal request" in proc.stdout
    con = ledgers.connect(tmp_path / "ledgers")
    assert con.execute("SELECT budget, status FROM raw_runs ORDER BY budget").fetchall() == [
        ("p254", "complete"), ("p7", "failed")]


@pytest.mark.slow  # end to end: a submitit multirun, two runs in their own processes (~4 s CPU)
def test_submitit_local_tiny_multirun_writes_ledgers(tmp_path):
    proc = run_multirun(tmp_path, "hydra/launcher=submitit_local", "campaign_name=sub",
                        "org=s0,s2", "budget=b63")
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "ledgers"
    con = ledgers.connect(root)
    assert con.execute("SELECT org, count(*) FROM runs GROUP BY ALL ORDER BY ALL").fetchall() == [
        ("S0", 1), ("S2", 1)]
    assert con.execute("SELECT count(*) FROM requests").fetchall() == [(40,)]
    assert ledger_check.check(root).ok
    assert list((tmp_path / "sweep" / ".submitit").iterdir())  # submitit ran the jobs


def test_slurm_config_composes_onto_submitit():
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.cpus_per_task, launcher.array_parallelism) == (1, 256)
    assert "partition" in launcher and "submitit_folder" in launcher


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None,
                    reason="optional extra: pip install -e '.[ray]'")
def test_ray_launcher_tiny_multirun(tmp_path):
    proc = run_multirun(tmp_path, "hydra/launcher=ray_cluster", "campaign_name=ray",
                        "+hydra.launcher.ray.init.num_cpus=2",
                        "+hydra.launcher.ray.init.include_dashboard=false",
                        "org=s0,s2", "budget=b63", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = tmp_path / "ledgers"
    assert ledgers.connect(root).execute("SELECT count(*) FROM runs").fetchall() == [(2,)]
    assert ledger_check.check(root).ok


# ---------------------------------------------------------------- forked jobs

TOUCHED: list[str] = []  # a forked job appends here; the launching process must not see it


def forked_task(cfg):
    import os
    import signal
    import time

    TOUCHED.append(cfg.mode)
    if cfg.mode == "ok":
        print("human summary")
        print(json.dumps({"mode": cfg.mode, "pid": os.getpid()}))
    elif cfg.mode == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif cfg.mode == "exit3":
        print("error: bad cell", file=sys.stderr)
        sys.exit(3)
    elif cfg.mode == "hang":
        time.sleep(600)
    elif cfg.mode == "bad":
        raise ValueError("org='s9': allowed values are s0, s1")
    elif cfg.mode == "bug":
        raise RuntimeError("engine bug")


def test_forked_jobs_are_isolated_processes_with_the_commands_exit_codes(tmp_path):
    from types import SimpleNamespace

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        config = compose("config", [f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         return_hydra_config=True)
    launcher = process_launcher.ProcessLauncher(n_jobs=2, timeout_s=JOB_TIMEOUT_S, start="fork")
    launcher.setup(hydra_context=SimpleNamespace(config_loader=None),
                   task_function=forked_task, config=config)
    launcher.compose = lambda overrides: OmegaConf.create(
        {"mode": overrides[0].split("=", 1)[1]})
    assert launcher.forks
    modes = ["ok", "crash", "exit3", "hang", "bad", "bug", "ok"]
    rets = launcher.launch([[f"mode={m}"] for m in modes], initial_job_idx=0)
    assert [r.status for r in rets] == [JobStatus.COMPLETED] + [JobStatus.FAILED] * 5 + [
        JobStatus.COMPLETED]
    reasons = [str(r._return_value) for r in rets[1:6]]
    assert reasons[0].startswith("killed by signal 9")
    assert reasons[1].startswith("exit code 3: error: bad cell")
    assert reasons[2].startswith(f"timed out after {JOB_TIMEOUT_S} s")
    assert reasons[3].startswith("exit code 2: error: org='s9': allowed values are s0, s1")
    assert reasons[4].startswith("exit code 1: RuntimeError: engine bug")
    pids = {rets[0].return_value["pid"], rets[6].return_value["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids  # one fresh process per job
    assert TOUCHED == []  # nothing a job did leaked into the launching process
    log = (tmp_path / "sweep" / "0" / "stdout.log").read_text().splitlines()
    job_dir = tmp_path / "sweep" / "0"
    assert log[0].startswith(f"# {sys.executable} -m ")
    assert log[0].endswith(f"mode=ok hydra.run.dir='{job_dir}'")  # the command to rerun by hand
    with pytest.raises(ValueError, match=r"hydra\.launcher\.start='spawn': allowed fork, exec"):
        process_launcher.ProcessLauncher(start="spawn")


def test_forked_and_exec_runs_write_identical_tables(tmp_path):
    files = {}
    for start in ("fork", "exec"):
        proc = run_multirun(tmp_path / start, f"hydra.launcher.start={start}", "campaign_name=eq",
                            "org=s0,s2", "budget=b63", "trace=true")
        assert proc.returncode == 0, proc.stderr[-3000:]
        con = ledgers.connect(tmp_path / start / "ledgers")
        files[start] = dict(con.execute("SELECT run_id, files FROM runs").fetchall())
    assert len(files["fork"]) == 2 and files["fork"].keys() == files["exec"].keys()
    for run_id, text in files["fork"].items():  # same rows, byte for byte (sha256)
        assert json.loads(text) == json.loads(files["exec"][run_id])


SEEN_BEFORE_FORK: list[str] = []  # what the before_fork hook saw, in the launching process


def record_before_fork(cfg):
    SEEN_BEFORE_FORK.append(cfg.mode)


def test_before_fork_runs_in_the_launching_process_once_per_forked_job(tmp_path):
    from types import SimpleNamespace

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        config = compose("config", [f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         return_hydra_config=True)
    launcher = process_launcher.ProcessLauncher(
        n_jobs=2, start="fork", before_fork=[f"{__name__}:record_before_fork"])
    launcher.setup(hydra_context=SimpleNamespace(config_loader=None),
                   task_function=forked_task, config=config)
    launcher.compose = lambda overrides: OmegaConf.create(
        {"mode": overrides[0].split("=", 1)[1]})
    rets = launcher.launch([["mode=ok"], ["mode=exit3"]], initial_job_idx=0)
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.FAILED]
    assert SEEN_BEFORE_FORK == ["ok", "exit3"]
    for bad in ("json", "json:no_such_function", f"{__name__}:SEEN_BEFORE_FORK"):
        launcher.before_fork = (bad,)
        with pytest.raises(ValueError, match=r"^hydra\.launcher\.before_fork: .*allowed"):
            launcher.launch([["mode=ok"], ["mode=ok"]], initial_job_idx=0)


def test_keys_read_before_the_fork_are_not_read_again_in_the_child(tmp_path, monkeypatch):
    """The campaign process reads the campaign's runs files once (read_keys_before_fork); a
    forked run's adoption check (`_complete_keys`) then reads only the files written since."""
    from experiments.runners.ledger_io import read_keys_before_fork
    from ledgers import writer
    from ledgers.writer import table_dir

    reads: list[str] = []
    monkeypatch.setattr(writer, "_KEY_CACHE", {})
    monkeypatch.setattr(writer, "_read_complete_keys", lambda path: reads.append(path.name) or [])
    runs = table_dir(tmp_path, "runs", "c1")
    runs.mkdir(parents=True)
    for name in ("a.parquet", "b.parquet"):
        (runs / name).write_bytes(b"x")
    cfg = OmegaConf.create({"ledger_root": str(tmp_path), "campaign_name": "c1",
                            "write_ledgers": True})
    read_keys_before_fork(cfg)
    assert sorted(reads) == ["a.parquet", "b.parquet"]
    (runs / "c.parquet").write_bytes(b"x")  # a run that finished since
    writer._complete_keys(tmp_path.resolve(), "c1")
    assert sorted(reads) == ["a.parquet", "b.parquet", "c.parquet"]
    read_keys_before_fork(OmegaConf.create({**cfg, "write_ledgers": False}))
    read_keys_before_fork(OmegaConf.create({**cfg, "campaign_name": "../bad"}))
    assert len(reads) == 3
