"""Campaign configs and driver: expansion, order, prereg coverage, end-to-end multiruns,
rerun, crash resume after SIGKILL, and bad input rejected before any run."""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from cli_batch import run_cases
from conftest import wait_until
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import open_dict

import ledgers
from experiments.campaigns import campaign as camp
from experiments.runners.cell import cell_config, config_hash
from experiments.runners.ledger_io import cell_columns
from experiments.runners.spec import resolved_config
from ledgers import check as ledger_check

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
SYNTH = ("workload.source=synthetic", "workload.num_requests=20")
QUESTIONS = ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "arms")  # `make <q>` targets


@functools.cache
def plan(*overrides: str):
    return camp.plan_campaign([*overrides, "ledger_root=/nonexistent/ledgers"])


def multirun(tmp_path: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "experiments.run", "-m", *overrides,
           f"ledger_root={tmp_path / 'ledgers'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one(con, sql: str):
    ((value,),) = con.execute(sql).fetchall()
    return value


# ---------------------------------------------------------------- expansion and order


def test_blocks_merge_params_and_the_command_line_wins():
    spec = camp.CampaignSpec(
        params={"org": "s0,s1", "load.rate": 3.0},
        blocks={"a": {"budget": "b63,b83", "seed": "range(0,3)"},
                "b": {"budget": "b108", "org": "d0", "seed": 7}},
    )
    jobs = camp.expand_jobs(spec, ["load.rate=0.8", "campaign=q1"], "x")
    assert Counter(j.block for j in jobs) == {"a": 2 * 2 * 3, "b": 1}
    assert all("load.rate=0.8" in j.overrides and "load.rate=3.0" not in j.overrides
               for j in jobs)
    assert jobs[-1].overrides == ("budget=b108", "org=d0", "seed=7", "load.rate=0.8",
                                  "campaign=q1")
    only_b = camp.expand_jobs(camp.CampaignSpec(blocks=spec.blocks, only=("b",)), [], "x")
    assert [j.block for j in only_b] == ["b"]


def test_smoke_keeps_three_seeds_sixty_requests_and_its_own_campaign():
    spec = camp.CampaignSpec(params={"org": "s0,s1", "seed": "range(100,112)"}, smoke=True)
    jobs = camp.expand_jobs(spec, [], "q1")
    assert len(jobs) == 2 * 3
    assert {o for j in jobs for o in j.overrides if o.startswith("seed=")} == {
        "seed=100", "seed=101", "seed=102"}
    assert all("workload.num_requests=60" in j.overrides for j in jobs)
    assert all("campaign_name=q1_smoke" in j.overrides for j in jobs)
    explicit = camp.expand_jobs(spec, ["workload.num_requests=20"], "q1")
    assert all("workload.num_requests=20" in j.overrides for j in explicit)


def test_sweeper_fields_are_checked_by_name():
    with pytest.raises(camp.CampaignError, match=r"hydra\.sweeper\.order='random'"):
        camp.CampaignSpec.from_config({"order": "random"})
    with pytest.raises(camp.CampaignError, match=r"hydra\.sweeper\.only=\['nope'\]"):
        camp.CampaignSpec.from_config({"blocks": {"a": {"org": "s0"}}, "only": ["nope"]})
    with pytest.raises(camp.CampaignError, match=r"hydra\.sweeper\.blocks\.a\.org"):
        camp.CampaignSpec.from_config({"blocks": {"a": {"org": ["s0", "s1"]}}})
    with pytest.raises(camp.CampaignError, match=r"hydra\.sweeper\.smoke_seeds=0"):
        camp.CampaignSpec.from_config({"smoke_seeds": 0})


@pytest.mark.parametrize("n", range(1, 8))
def test_williams_rows_balance_positions_and_carryover(n):
    rows = camp.williams_rows(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    reps = len(rows) // n
    for pos in range(n):
        assert Counter(r[pos] for r in rows) == {c: reps for c in range(n)}
    pairs = Counter((a, b) for r in rows for a, b in itertools.pairwise(r))
    assert set(pairs.values()) <= {reps} and len(pairs) == n * (n - 1)


def test_q9_runs_balanced_within_each_seed():
    spec, runs = plan("campaign=q9")
    assert spec.order == "balanced" and len(runs) == 24
    seeds = [r.key.seed for r in runs]
    assert seeds == sorted(seeds)  # seed by seed
    orders = [tuple(r.cell for r in runs if r.key.seed == s) for s in sorted(set(seeds))]
    assert all(len(set(o)) == 4 for o in orders)
    assert len(set(orders[:4])) == 4  # the order varies by seed
    for pos in range(4):  # over the first four seeds each condition takes each position once
        assert len({o[pos] for o in orders[:4]}) == 4


def test_supporting_sweeps_couple_caps_to_budgets():
    _, caps = plan("campaign=caps")
    pairs = {(cell_columns(r.cfg)["budget"], cell_columns(r.cfg)["cap"]) for r in caps}
    assert pairs == ({("b63", c) for c in (3, 5, 6, 8, 63)}  # cap 63/109: the Q5 references
                     | {("b108", c) for c in (5, 8, 10, 13, 109)})
    _, pins = plan("campaign=pinning")
    assert {cell_columns(r.cfg)["pinning_k"] for r in pins} == {-1, 1, 2, 3}
    _, bursts = plan("campaign=bursts")
    assert {cell_columns(r.cfg)["arrival"] for r in bursts} == {"poisson", "onoff"}
    # plan coverage and cross-campaign reuse: tests/test_campaign_plans.py
    _, demo = plan("campaign=demo")
    assert Counter(r.key.campaign for r in demo) == {"demo_q1": 27, "demo_q9": 12}


def test_fast_composition_equals_hydra_composition():
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("config", ["campaign=q1"], RunMode.MULTIRUN)
        composer = camp.CellComposer(loader, master)
        samples = [
            ["campaign=q1", "org=d0", "budget=b108", "model.d0_attention_fraction=0.35", "seed=3"],
            ["campaign=q1", "model=granite", "org=s1", "workload.q=0.0"],
            ["campaign=q9", "org=s2_retention", "workload.reuse=isolate", "seed=88002"],
            ["campaign=q1", "model=granite", "+extra=1", "~workload.q"],  # whole conversion
        ]
        for overrides in samples:
            fast = composer.compose(overrides)
            full = loader.load_sweep_config(master, overrides)
            with open_dict(full):
                del full["hydra"]  # the task config, as a job sees it
            assert cell_config(fast) == cell_config(full)
            assert config_hash(fast) == config_hash(full)
            # the plain copy derived from the base's, in the same key order and types
            resolved = composer.compose_resolved(overrides)[1]
            assert repr(resolved) == repr(resolved_config(full))


# ---------------------------------------------------------------- end to end (subprocesses)


@pytest.mark.slow  # end to end: three multirun processes, damage, quarantine, repair (~8 s CPU)
def test_smoke_campaign_writes_ledgers_and_rerun_adds_nothing(tmp_path):
    args = ("campaign=q1", "hydra.sweeper.smoke=true", "hydra.sweeper.only=[exp1a]",
            "hydra.sweeper.smoke_seeds=2", "org=s0,s2", "budget=b63,b108", *SYNTH)
    first = multirun(tmp_path, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert summary_of(first)["done"] == 8
    root = tmp_path / "ledgers"
    assert ledger_check.main([str(root)]) == 0
    con = ledgers.connect(root)
    cells = con.execute(
        "SELECT org, budget, count(*) FROM runs GROUP BY ALL ORDER BY ALL").fetchall()
    assert cells == [("S0", "b108", 2), ("S0", "b63", 2), ("S2", "b108", 2), ("S2", "b63", 2)]
    assert set(con.execute("SELECT DISTINCT campaign FROM runs").fetchall()) == {("q1_smoke",)}
    assert one(con, "SELECT count(DISTINCT prereg_plan_hash) FROM runs") == 1

    files = {p: p.stat().st_mtime_ns for p in root.rglob("*.parquet")}
    again = multirun(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert summary_of(again) | {"wall_seconds": 0} == summary_of(first) | {
        "done": 0, "skipped": 8, "wall_seconds": 0}
    # skipped means not run again: not one ledger file added or rewritten (how fast a
    # skip is belongs to `make bench`, not to a test)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.parquet")} == files
    assert one(ledgers.connect(root), "SELECT count(*) FROM raw_runs") == 8

    # Damage: one run loses its requests file, another's steps file is truncated, and a
    # garbage file sits among the poller files. The rerun moves all of it to the
    # quarantine and redoes exactly the two damaged runs.
    part = "campaign=q1_smoke"
    requests_files = sorted((root / "requests" / part).glob("*.parquet"))
    steps_files = sorted((root / "steps" / part).glob("*.parquet"))
    lost, cut = requests_files[0], steps_files[-1]
    damaged_runs = {lost.stem[:16], cut.stem[:16]}
    assert len(damaged_runs) == 2
    lost.unlink()
    cut.write_bytes(cut.read_bytes()[:100])
    (root / "poller" / part / "garbage.parquet").write_bytes(b"not parquet" * 20)
    assert ledger_check.main([str(root)]) == 1
    listing = subprocess.run([sys.executable, "-m", "experiments.campaigns.campaign", *args,
                              f"ledger_root={root}"], cwd=REPO, capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert sum(" damaged " in line for line in listing.stdout.splitlines()) == 2

    repaired = multirun(tmp_path, *args)
    assert repaired.returncode == 0, repaired.stderr[-2000:]
    assert summary_of(repaired)["done"] == 2 and summary_of(repaired)["skipped"] == 6
    (quarantine,) = (root / "quarantine").iterdir()
    moved = sorted(quarantine.rglob("*.parquet"))
    assert f"quarantined {len(moved)} damaged ledger files (runs to redo: 2)" in repaired.stdout
    assert {p.stem[:16] for p in moved if p.name != "garbage.parquet"} == damaged_runs
    assert (quarantine / "poller" / part / "garbage.parquet").is_file()
    assert (quarantine / "steps" / part / cut.name).stat().st_size == 100
    assert not (quarantine / "requests" / part / lost.name).exists()  # it was gone already
    assert ledger_check.main([str(root)]) == 0
    con = ledgers.connect(root)
    assert one(con, "SELECT count(*) FROM runs") == 8
    redone = {r[0] for r in con.execute(
        "SELECT run_id FROM runs WHERE created_at > (SELECT min(created_at) FROM runs)"
        " QUALIFY rank() OVER (ORDER BY created_at DESC) <= 2").fetchall()}
    assert redone == damaged_runs


def _live_pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline and str(os.getpid()) != entry.name:
                pids.append(int(entry.name))
    return pids


def test_sigkill_mid_campaign_then_rerun_leaves_no_duplicate_or_partial_run(tmp_path):
    root = tmp_path / "ledgers"
    cmd = [sys.executable, "-m", "experiments.run", "-m", "campaign_name=crash",
           "org=s0,s1,s2", "seed=1,2", *SYNTH, "hydra.launcher.n_jobs=1",
           f"ledger_root={root}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs_dir = root / "runs" / "campaign=crash"

    def first_run_written():
        assert proc.poll() is None, "the campaign ended before it could be killed"
        return runs_dir.is_dir() and any(runs_dir.glob("*.parquet"))

    wait_until(first_run_written, timeout_s=300, poll_s=0.02, what="the first runs row")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until(lambda: not _live_pids_mentioning(str(root)), timeout_s=60, poll_s=0.1,
               what="every run of the killed campaign to exit")

    con = ledgers.connect(root)
    done_before = one(con, "SELECT count(*) FROM runs")
    assert 1 <= done_before < 6
    assert one(con, "SELECT count(*) FROM requests") == 20 * done_before  # nothing partial

    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = summary_of(rerun)
    assert summary["skipped"] == done_before and summary["done"] == 6 - done_before
    con = ledgers.connect(root)
    assert one(con, "SELECT count(*) FROM raw_runs WHERE status = 'complete'") == 6
    assert one(con, "SELECT count(DISTINCT run_id) FROM runs") == 6
    assert one(con, "SELECT count(*) FROM requests") == 6 * 20
    assert ledger_check.check(root).ok


BAD_CAMPAIGNS = [
    (("campaign=q99",), "campaign=q99: allowed"),
    (("campaign=q1", "org=s0,s9"), "org='s9'"),
    (("campaign=q1", "engine.capp=3"), "engine.capp"),
    (("campaign=q1", "engine.cap=="), "engine.cap=="),
    (("campaign=q1", "hydra.sweeper.order=shuffled"), "hydra.sweeper.order='shuffled'"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[tuple[Path, tuple[int, str, str]]]:
    """(its directory, (exit code, stdout, stderr)) of each BAD_CAMPAIGNS multirun, then of a
    campaign whose ledger root is under a file: each its own `python -m experiments.run -m`
    process, forked by one batch interpreter that imported the entry module once
    (tests/cli_batch.py)."""
    base = tmp_path_factory.mktemp("refused")
    dirs = [base / str(i) for i in range(len(BAD_CAMPAIGNS) + 1)]
    for tmp in dirs:
        tmp.mkdir()
    commands = [[sys.executable, "-m", "experiments.run", "-m", *overrides, *SYNTH,
                 f"ledger_root={tmp / 'ledgers'}", f"hydra.sweep.dir={tmp / 'sweep'}"]
                for (overrides, _), tmp in zip(BAD_CAMPAIGNS, dirs[:-1], strict=True)]
    blocker = dirs[-1] / "a-file"
    blocker.write_text("")
    commands.append([sys.executable, "-m", "experiments.run", "-m", "campaign=q9", *SYNTH,
                     f"ledger_root={blocker / 'ledgers'}", f"hydra.sweep.dir={dirs[-1] / 'sweep'}"])
    outcomes = run_cases(commands, str(REPO), ("experiments.run",),
                         {"config_dir": str(CONF), "overrides": [["campaign=q1"]]})
    return list(zip(dirs, outcomes, strict=True))


@pytest.mark.parametrize(("overrides", "message"), BAD_CAMPAIGNS)
def test_bad_campaign_input_fails_before_any_run(refused, overrides, message):
    tmp, (code, out, err) = refused[BAD_CAMPAIGNS.index((overrides, message))]
    assert code != 0
    assert message in out + err
    assert not (tmp / "ledgers" / "runs").exists()
    assert not (tmp / "sweep").exists()  # no job was launched


def test_unwritable_ledger_root_fails_the_campaign_before_any_run(refused):
    tmp, (code, _, err) = refused[-1]
    assert code != 0
    assert "ledger_root=" in err and "not a writable directory" in err
    assert not (tmp / "sweep").exists()


def test_plan_listing_runs_nothing(tmp_path, capsys):
    assert camp.main(["campaign=q8", f"ledger_root={tmp_path / 'ledgers'}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7 and lines[-1].startswith("6 runs (-: 6); 6 to run; order seed_major")
    assert all(" q8 " in line and "to run" in line for line in lines[:6])
    assert not (tmp_path / "ledgers").exists()
    assert camp.main(["campaign=q8", "org=s7", f"ledger_root={tmp_path}"]) == 2
    assert "error: org='s7'" in capsys.readouterr().err


def test_make_question_targets_are_the_campaigns_marked_for_make():
    """`make <q>` exists for exactly the campaign files with a `# make:` line, each with its
    plan and its report page; `make help` lists each with that line's description."""
    import re

    from analysis.questions import QUESTION_MODULES

    marked = {p.stem: m.group(1) for p in (CONF / "campaign").glob("*.yaml")
              if (m := re.search(r"^# make: (.+)$", p.read_text(), re.M))}
    assert sorted(marked) == sorted(QUESTIONS)
    run = functools.partial(subprocess.run, cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    listed = run(["make", "-s", "--no-print-directory", "help"]).stdout
    for name, description in marked.items():
        assert (CONF / "prereg" / f"{name}.yaml").is_file() and name in QUESTION_MODULES
        assert re.search(rf"^{name} +{re.escape(description)}$", listed, re.M), name
        dry = run(["make", "-n", "--no-print-directory", name, "LEDGER_ROOT=/x"]).stdout
        assert f"experiments.run -m campaign={name} ledger_root=/x" in dry
    assert "hydra.launcher.n_jobs=1" in run(["make", "-n", "q9"]).stdout  # one at a time
