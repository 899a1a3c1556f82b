"""Bad input, from the command line: one line `error: field=value: ...` on stderr, exit code 2,
nothing written. Hydra-level errors (unknown keys, group options, unparsable overrides)
included; plus the Makefile variables and the app's --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_batch import run_cases

from experiments.runners.cell import ARMS
from experiments.workloads.workload import ARRIVALS, REUSE_MODES

REPO = Path(__file__).resolve().parent.parent
SMALL = ("workload.source=synthetic", "workload.num_requests=5")
RUN = (sys.executable, "-m", "experiments.run")

# (command-line arguments, the exact start of the one stderr line)
SINGLE = [
    (("write_ledgers=maybe",), "error: write_ledgers='maybe': allowed true, false"),
    (("write_ledgers=no",), "error: write_ledgers='no': allowed true, false"),
    (("write_ledgers=off",), "error: write_ledgers='off': allowed true, false"),
    (("trace=yes",), "error: trace='yes': allowed true, false"),
    (("trace=1",), "error: trace=1: allowed true, false"),
    (("load.rate=inf",), "error: load.rate=inf: allowed finite numbers > 0"),
    (("load.rate=0",), "error: load.rate=0: allowed finite numbers > 0"),
    (("load.rate=-2",), "error: load.rate=-2: allowed finite numbers > 0"),
    (("load.arrival=bursty",), "error: load.arrival='bursty': allowed"),
    (("org=s9",), "error: org='s9': allowed values are s0, s1, s2, d0, s2_retention, n0, "
                  "n0_vllm, jenga"),
    (("budget=q12",), "error: budget='q12'"),
    (("engine.cap=0",), "error: engine.cap=0: allowed integers >= 1"),
    (("engine.cap=many",), "error: engine.cap='many': allowed integers >= 1"),
    (("workload.q=1.5",), "error: workload.q=1.5"),
    (("workload.reuse=maybe",), "error: workload.reuse='maybe': allowed"),
    (("seed=-1",), "error: seed=-1: allowed integers >= 0"),
    (("replicate=-1",), "error: replicate=-1: allowed integers >= 0"),
    (("campaign_name=bad/name",), "error: campaign_name='bad/name': allowed letters"),
    (("engine.capp=3",), "error: engine.capp=3: unknown key; allowed keys of engine: cap, "),
    (("foo=1",), "error: foo=1: unknown key; allowed keys: org, budget, seed"),
    (("model=foo",), "error: model=foo: allowed attention_only, falcon_h1_7b, "),
    (("executor=tpu",), "error: executor=tpu: allowed a100, "),
    (("engine.cap==",), "error: engine.cap==: cannot parse this override"),
    (("org=s0,s1",), "error: org=s0,s1: a sweep needs -m (multirun)"),
    (("engine=3",), "error: engine=3: allowed a config group or engine.<key>=value"),
    (("~org",), "error: org: required, it cannot be removed"),
    (("model.state_codec=fp4",), "error: model: model.state_codec='fp4': allowed values are "
                                 "auto, fp32, bf16, fp16, fp8_e4m3, int8, bf16_sr, fp16_sr"),
    (("org=n0", "model.state_codec=int8"), "error: org=n0 cannot hold model 'falcon_h1_7b': "
     "model.state_codec='int8', allowed values are auto, fp32, bf16, fp16, fp8_e4m3, fp16_sr"),
    # model presets (tests/test_model_presets.py): a layer pattern that does not hold, and
    # organizations that cannot hold a preset
    (("model=granite_4_0_h_tiny", "model.num_layers=39", "budget=4096MiB"),
     "error: model: model.layers lists 40 layers but num_layers=39"),
    (("model=granite_4_0_h_tiny", "model.sliding_window=4096", "budget=4096MiB"),
     "error: model: model.sliding_window=4096"),
    (("model=granite_4_0_h_tiny", "model.vocab_size=0", "budget=4096MiB"),
     "error: model: model.vocab_size=0"),
    (("model=nemotron_h_8b", "model.num_kv_heads=1", "org=s2", "budget=4096MiB"),
     "error: org=s2 cannot hold model 'nemotron_h_8b'"),
    (("model=zamba2_7b", "org=n0", "budget=4096MiB"),
     "error: org=n0 cannot hold model 'zamba2_7b'"),
]
MULTI = [
    (("campaign=q99",), "error: campaign=q99: allowed arms, bursts, caps, d0_split, demo"),
    (("campaign=q9", "org=s0,s9"), "error: org='s9': allowed values are s0, s1, s2, d0"),
    (("campaign=q9", "hydra.sweeper.order=shuffled"),
     "error: hydra.sweeper.order='shuffled': allowed values are product, seed_major, balanced"),
    (("campaign=q9", "hydra.sweeper.smoke=maybe"),
     "error: hydra.sweeper.smoke='maybe': allowed true, false"),
    (("campaign=q9", "hydra.launcher.n_jobs=-1"),
     "error: hydra.launcher.n_jobs=-1: allowed integers >= 0"),
    (("campaign=q9", "write_ledgers=false"),
     "error: write_ledgers=false: a campaign records every run in the ledgers"),
    (("campaign=q9", "hydra/launcher=nope"), "error: hydra/launcher=nope: allowed basic, local"),
    (("campaign=q9", "engine.capp=3"), "error: engine.capp=3: unknown key"),
    (("campaign=q9", "load.rate=inf"), "error: load.rate=inf: allowed finite numbers > 0"),
]
CASES = [(("run", *a), m) for a, m in SINGLE] + [(("multirun", *a), m) for a, m in MULTI]
CASES += [
    (("check", "{tmp}/missing"), "error: ledger root='{tmp}/missing': no such directory"),
    (("report", "--ledgers", "{tmp}/missing", "--out", "{tmp}/out"),
     "error: --ledgers='{tmp}/missing': no such directory"),
    (("plan", "campaign=q9", "org=s7"), "error: org='s7': allowed values are s0, s1"),
    (("run", "ledger_root={tmp}/a-file/ledgers"), "error: ledger_root='{tmp}/a-file/ledgers': "
                                                  "not a writable directory"),
]


def _command(kind: str, args: tuple[str, ...], tmp: Path) -> list[str]:
    args = tuple(a.format(tmp=tmp) for a in args)
    if kind == "run":
        own_root = any(a.startswith("ledger_root=") for a in args)
        return [*RUN, *args, *SMALL, *([] if own_root else [f"ledger_root={tmp}/ledgers"])]
    if kind == "multirun":
        return [*RUN, "-m", *args, *SMALL, f"ledger_root={tmp}/ledgers",
                f"hydra.sweep.dir={tmp}/sweep"]
    if kind == "check":
        return [sys.executable, "-m", "ledgers.check", *args]
    if kind == "report":
        return [sys.executable, "-m", "analysis.report", *args]
    return [sys.executable, "-m", "experiments.campaigns.campaign", *args,
            f"ledger_root={tmp}/ledgers"]


def _listing(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*")} if path.exists() else set()


# Every case is its own `python -m` process, forked by tests/cli_batch.py from one
# interpreter that imported these once (the imports were most of each case's CPU).
PRELOAD = ("experiments.run", "experiments.campaigns.campaign")
# Configs the batch composes once before forking (tests/cli_batch.py `warm`): the commands
# inherit the YAML files parsed for them.
WARM = [["campaign=q9"]]


def _run_cases(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each `python -m` command, run from REPO."""
    return run_cases(commands, str(REPO), PRELOAD,
                     {"config_dir": str(REPO / "conf"), "overrides": WARM})


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every case (tests/cli_batch.py: PARALLEL processes at a time); REPO listings
    around them."""
    base = tmp_path_factory.mktemp("bad")
    watched = (REPO / "outputs", REPO / "ledgers" / "data", REPO / "reports")
    before = {p: _listing(p) for p in watched}
    commands, dirs = [], []
    for i, (args, _) in enumerate(CASES):
        tmp = base / str(i)
        tmp.mkdir()
        (tmp / "a-file").write_text("a file, not a directory")
        commands.append(_command(args[0], args[1:], tmp))
        dirs.append(tmp)
    results = [(tmp, *outcome) for tmp, outcome in zip(dirs, _run_cases(commands), strict=True)]
    after = {p: _listing(p) for p in watched}
    return results, before, after


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_gives_one_line_exit_2_and_writes_nothing(outcomes, index):
    results, _, _ = outcomes
    tmp, code, out, err = results[index]
    expected = CASES[index][1].format(tmp=tmp)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(expected), err
    assert out == ""
    assert sorted(p.name for p in tmp.iterdir()) == ["a-file"]  # no ledgers, no sweep dir


def test_bad_input_writes_nothing_in_the_repository(outcomes):
    _, before, after = outcomes
    assert after == before


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("variable", "message"),
    [("SMOKE=on", "SMOKE=on: allowed 1, true, yes (smoke size) or 0, false, no, empty"),
     ("SMOKE=2", "SMOKE=2: allowed 1, true, yes"),
     ("JOBS=two", "JOBS=two: allowed whole numbers >= 1"),
     ("JOBS=0", "JOBS=0: allowed whole numbers >= 1"),
     ("LAUNCHER=nope", "LAUNCHER=nope: allowed local submitit_local slurm ray_cluster"),
     ("BENCH=speed", "BENCH=speed: allowed any of engine single campaign ledger")],
)
def test_makefile_variables_are_checked_before_anything_runs(variable, message):
    proc = _make("-n", "q9", variable)  # -n: even a valid run would only be printed
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert message in line and line.endswith("Stop.")


@pytest.mark.parametrize("smoke", ["1", "true", "yes", "0", "false", "no", ""])
def test_makefile_smoke_values_of_the_documented_set(smoke):
    proc = _make("-n", "q9", f"SMOKE={smoke}", "LEDGER_ROOT=/nonexistent")
    assert proc.returncode == 0, proc.stderr
    assert ("hydra.sweeper.smoke=true" in proc.stdout) == (smoke in ("1", "true", "yes"))


def test_help_lists_groups_and_the_allowed_values_the_code_accepts():
    proc = subprocess.run([*RUN, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def allowed(prefix: str) -> set[str]:
        (line,) = [line for line in lines if line.startswith(prefix)]
        return set(line[len(prefix):].split()[0].split("|"))

    assert allowed("org=") == set(ARMS)
    assert allowed("workload.reuse=") == set(REUSE_MODES)
    assert allowed("load.arrival=") == set(ARRIVALS)
    for group in ("model", "executor"):
        options = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        assert allowed(f"{group}=") == options
        assert f"{group}: {', '.join(sorted(options))}" in lines
    assert any(line.startswith("budget=bN|pN") for line in lines)
    assert any("--cfg job --resolve" in line for line in lines)
    assert all("python -m" not in line or ".venv/bin/python -m" in line for line in lines)


def test_cfg_job_resolve_shows_resolved_values():
    proc = subprocess.run([*RUN, "--cfg", "job", "--resolve", "ledger_root=/x/y"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ledger_root: /x/y" in proc.stdout and "${" not in proc.stdout


def test_no_config_file_sets_the_run_mode():
    """experiments.run reads hydra.mode from overrides only; a config file must not set it."""
    import yaml

    def mentions_mode(node) -> bool:
        if isinstance(node, dict):
            hydra = node.get("hydra")
            if isinstance(hydra, dict) and "mode" in hydra:
                return True
            return any(mentions_mode(v) for v in node.values())
        return False

    files = sorted((REPO / "conf").rglob("*.yaml"))
    assert len(files) > 20
    assert [f for f in files if mentions_mode(yaml.safe_load(f.read_text()) or {})] == []
    proc = subprocess.run([*RUN, "hydra.mode=MULTIRUN", "campaign=q9", *SMALL,
                           "hydra.sweeper.only=[nope]"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "hydra.sweeper.only=['nope']: unknown blocks" in proc.stderr


def test_bench_parts_are_checked(capsys):
    from bench.__main__ import main as bench_main

    assert bench_main(["ledger", "speed"]) == 2  # checked before any part runs
    assert capsys.readouterr().err.strip() == (
        "error: part=speed: allowed engine, single, campaign, ledger, kernel, serve, profile, scan")


def test_makefile_model_picks_the_tiny_checkpoint_and_preset_or_is_refused():
    """MODEL=falcon|granite (default falcon) names the checkpoint and preset of the real-path
    targets; another value stops them with one line, exit 2; targets without a model ignore it."""
    granite = _make("-n", "continuation", "MODEL=granite", "LEDGER_ROOT=/nonexistent")
    assert granite.returncode == 0, granite.stderr
    assert ("--checkpoint models/granite_hybrid_tiny --preset granite_hybrid_tiny"
            in granite.stdout)
    falcon = _make("-n", "http-smoke", "LEDGER_ROOT=/nonexistent")
    assert "executor.checkpoint=models/falcon_h1_tiny model=falcon_h1_tiny" in falcon.stdout
    proc = _make("-n", "serve", "MODEL=llama")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "MODEL=llama: allowed values are falcon, granite" in line and line.endswith("Stop.")
    assert _make("-n", "help", "MODEL=llama").returncode == 0
