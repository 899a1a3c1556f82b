"""`python -m analysis.inference.kret`: CSV and ledger inputs, last-line JSON, named errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from analysis.inference import kret, prereg

REPO = Path(__file__).resolve().parent.parent
SEEDS = list(range(88001, 88007))
T_975_DF5 = 2.5705818356363155  # t(0.975, 5)
K_DIFFS = [0.04, 0.06, 0.05, 0.07, 0.03, 0.05]  # per-seed d_SHARE - d_ISOLATE (ledger)
D_ISOLATE = 0.01


def _rows(span_shift: float = 0.0) -> list[dict]:
    rows = []
    for seed, diff in zip(SEEDS, K_DIFFS, strict=True):
        base = 90.0 + seed % 11
        for policy, mode, log_gain in (
            ("S2", "SHARE", 0.0), ("Ret", "SHARE", diff + D_ISOLATE),
            ("S2", "ISOLATE", 0.0), ("Ret", "ISOLATE", D_ISOLATE),
        ):
            scale = 1.0 if mode == "SHARE" else 0.75
            ledger = base * scale * math.exp(log_gain)
            span_gain = span_shift if (policy, mode) == ("Ret", "SHARE") else 0.0
            rows.append({"seed": seed, "policy": policy, "mode": mode,
                         "throughput_ledger": ledger,
                         "throughput_span": 1.1 * ledger * math.exp(span_gain)})
    return rows


def _expected_k_ret(diffs: list[float]) -> tuple[float, float, float]:
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n)
    return tuple(100 * math.expm1(x) for x in (mean, mean - T_975_DF5 * se,
                                                mean + T_975_DF5 * se))


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis.inference.kret", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_csv_prints_table_then_json_last_line(tmp_path):
    csv = tmp_path / "q9.csv"
    frame = pd.DataFrame(_rows()).rename(columns={"throughput_ledger": "throughput"})
    frame.drop(columns="throughput_span").to_csv(csv, index=False)
    proc = _run_cli("--csv", str(csv))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 8 and "decision: CONFIRMED" in proc.stdout
    out = json.loads(lines[-1])
    assert set(out) == {"K_ret", "delta_share", "delta_isolate", "decision", "n"}
    assert set(out["K_ret"]) == {"effect_pct", "ci_low_pct", "ci_high_pct"}
    effect, low, high = _expected_k_ret(K_DIFFS)
    assert out["K_ret"]["effect_pct"] == pytest.approx(effect)
    assert out["K_ret"]["ci_low_pct"] == pytest.approx(low)
    assert out["K_ret"]["ci_high_pct"] == pytest.approx(high)
    assert out["delta_isolate"]["effect_pct"] == pytest.approx(100 * math.expm1(D_ISOLATE))
    assert (out["decision"], out["n"]) == ("CONFIRMED", 6)


def test_cli_names_the_seed_with_a_missing_pair(tmp_path):
    rows = [r for r in _rows() if not (r["seed"] == 88004 and r["policy"] == "S2"
                                       and r["mode"] == "ISOLATE")]
    csv = tmp_path / "gap.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    proc = _run_cli("--csv", str(csv), "--timebase", "span")
    assert proc.returncode == 2
    assert "88004" in proc.stderr and "S2/ISOLATE" in proc.stderr
    assert "{" not in proc.stdout


def test_timebase_selects_the_column(tmp_path, capsys):
    csv = tmp_path / "both.csv"
    pd.DataFrame(_rows(span_shift=0.02)).to_csv(csv, index=False)
    assert kret.main(["--csv", str(csv), "--timebase", "span"]) == 0
    span = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert span["K_ret"]["effect_pct"] == pytest.approx(
        _expected_k_ret([d + 0.02 for d in K_DIFFS])[0])
    assert kret.main(["--csv", str(csv)]) == 0
    ledger = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ledger["K_ret"]["effect_pct"] == pytest.approx(_expected_k_ret(K_DIFFS)[0])


def test_span_timebase_needs_its_column(tmp_path, capsys):
    csv = tmp_path / "plain.csv"
    pd.DataFrame(_rows()).rename(columns={"throughput_ledger": "throughput"}).drop(
        columns="throughput_span").to_csv(csv, index=False)
    assert kret.main(["--csv", str(csv), "--timebase", "span"]) == 2
    assert "throughput_span" in capsys.readouterr().err


def test_duplicated_pair_is_refused(tmp_path, capsys):
    rows = _rows()
    rows.append(dict(rows[5]))
    csv = tmp_path / "dup.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    assert kret.main(["--csv", str(csv)]) == 2
    err = capsys.readouterr().err
    assert f"seeds [{rows[5]['seed']}]" in err and "duplicated" in err


def _ledger_runs() -> pd.DataFrame:
    org = {"S2": "S2", "Ret": "S2_RETENTION"}
    runs = pd.DataFrame([
        {"seed": r["seed"], "org": org[r["policy"]], "reuse": r["mode"].lower(),
         "throughput_ledger": r["throughput_ledger"], "throughput_span": r["throughput_span"],
         "status": "complete", "adopted": True, "campaign": "q9",
         "prereg_plan_hash": prereg.load_plan("q9").plan_hash}
        for r in _rows()
    ])
    noise = runs.iloc[[0, 1, 2]].copy()
    noise["throughput_ledger"] = 1.0  # would change K_ret if any of these were read
    noise["adopted"] = [False, True, True]
    noise["status"] = ["complete", "failed", "complete"]
    noise["campaign"] = ["q9", "q9", "q8"]
    return pd.concat([runs, noise], ignore_index=True)


@pytest.fixture
def fake_ledgers(monkeypatch):
    """A `ledgers` module whose connect() serves a DuckDB `runs` view of `state['runs']`."""
    state = {"runs": _ledger_runs(), "roots": []}

    def connect(root):
        state["roots"].append(root)
        con = duckdb.connect()
        con.register("runs_frame", state["runs"])
        con.execute("CREATE VIEW runs AS SELECT * FROM runs_frame")
        return con

    monkeypatch.setitem(sys.modules, "ledgers", types.SimpleNamespace(connect=connect))
    return state


def test_ledgers_path_reads_adopted_complete_runs(fake_ledgers, capsys, tmp_path):
    assert kret.main(["--ledgers", str(tmp_path), "--campaign", "q9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fake_ledgers["roots"] == [str(tmp_path)]
    assert out["K_ret"]["effect_pct"] == pytest.approx(_expected_k_ret(K_DIFFS)[0])
    assert out["n"] == 6


def test_ledgers_path_accepts_the_runs_table_spelling(fake_ledgers, capsys, tmp_path):
    runs = fake_ledgers["runs"]
    fake_ledgers["runs"] = runs.assign(org=runs.org.str.lower(), reuse=runs.reuse.str.upper())
    assert kret.main(["--ledgers", str(tmp_path), "--campaign", "q9"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["K_ret"]["effect_pct"] == pytest.approx(_expected_k_ret(K_DIFFS)[0])


def test_ledgers_path_names_a_planned_seed_that_never_ran(fake_ledgers, capsys, tmp_path):
    runs = fake_ledgers["runs"]
    fake_ledgers["runs"] = runs[runs.seed != 88006]
    assert kret.main(["--ledgers", str(tmp_path), "--campaign", "q9"]) == 2
    err = capsys.readouterr().err
    assert "[88006]" in err and "missing S2/SHARE" in err


def test_ledgers_path_checks_the_plan_hash(fake_ledgers, capsys, tmp_path):
    runs = fake_ledgers["runs"].copy()
    runs.loc[runs.index[:4], "prereg_plan_hash"] = "0" * 64
    fake_ledgers["runs"] = runs
    assert kret.main(["--ledgers", str(tmp_path), "--campaign", "q9"]) == 2
    err = capsys.readouterr().err
    assert "prereg_plan_hash" in err and "000000000000 x4" in err and "plan changed" in err
    assert kret.main(["--ledgers", str(tmp_path), "--campaign", "q9",
                      "--allow-changed-plan"]) == 0
