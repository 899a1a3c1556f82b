"""make fidelity: the two halves plan the same cells, the comparison tables compute what
they say, and the whole pipeline (real half stood in for by the simulator under a known
profile) fits that profile back and reproduces the "real" cells."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from analysis.studies import fidelity as fa
from experiments.campaigns.campaign import plan_campaign
from experiments.studies import fidelity as fe

KNOWN = {"memory_efficiency": 0.02, "matmul_efficiency": 0.05, "scan_efficiency": 0.01,
         "attention_efficiency": 0.025, "mixed_step_s": 0.02, "per_step_overhead_s": 0.03,
         "per_seq_overhead_s": 0.004, "indirection_overhead": 0.08}


def _cells(campaign: str, *extra: str) -> set[tuple]:
    _, runs = plan_campaign([f"campaign={campaign}", "ledger_root=/nonexistent", *extra])
    out = set()
    for run in runs:
        cfg = run.cfg
        out.add((cfg.org, cfg.budget, cfg.seed, cfg.model.name, json.dumps(
            {k: dict(cfg[k]) for k in ("workload", "load", "engine")}, sort_keys=True)))
    return out


def test_real_and_simulated_halves_plan_the_same_cells(tiny_checkpoint):
    real, sim = _cells(fe.REAL, f"++executor.checkpoint={tiny_checkpoint}"), _cells(fe.SIM)
    assert len(real) == 40 and real == sim
    assert {c[1] for c in real} == {"b8", "b63"} and {c[0] for c in real} == {
        "s0", "s1", "s2", "d0"}


def _frame(values: dict, executor: str) -> pd.DataFrame:
    rows = []
    for (org, budget, seed), tput in values.items():
        rows.append({"org": org, "budget": budget, "seed": seed, "throughput_span": tput,
                     "throughput_ledger": tput * 0.9, "ttft_p99": 1.0, "e2e_p99": 10.0 / tput,
                     "preemptions": 1 if org == "S0" else 0, "c_once_tokens": 1000,
                     "executor": executor})
    return pd.DataFrame(rows)


def test_tables_compute_errors_effects_and_rankings():
    real = _frame({("S0", "b8", 1): 10.0, ("S0", "b8", 2): 20.0,
                   ("S2", "b8", 1): 15.0, ("S2", "b8", 2): 22.0}, "torch")
    sim = _frame({("S0", "b8", 1): 11.0, ("S0", "b8", 2): 19.0,
                  ("S2", "b8", 1): 12.0, ("S2", "b8", 2): 17.5}, "sim:x")
    cells = fa.cell_table(real, sim).set_index("org")
    assert cells.loc["S0", "throughput_span_err_pct"] == pytest.approx(100 * (15 / 15 - 1))
    assert cells.loc["S2", "throughput_span_err_pct"] == pytest.approx(100 * (14.75 / 18.5 - 1))
    assert cells.loc["S0", "preemptions_diff"] == 0
    eff = fa.effect_table(real, sim)
    row = eff[(eff["contrast"] == "S2 vs S0") & (eff["metric"] == "throughput_span")].iloc[0]
    assert row["real_pct"] == pytest.approx(100 * np.mean([15 / 10 - 1, 22 / 20 - 1]))
    assert row["sim_pct"] == pytest.approx(100 * np.mean([12 / 11 - 1, 17.5 / 19 - 1]))
    d = np.log([15 / 10, 22 / 20])
    half = 12.706204736174698 * d.std(ddof=1) / math.sqrt(2)  # t(0.975, 1)
    assert row["real_low"] == pytest.approx(100 * math.expm1(d.mean() - half))
    assert row["real_pct"] > 0 and row["sim_pct"] > 0 and row["same_sign"]
    assert not row["sim_in_real_ci"] or row["real_low"] <= row["sim_pct"] <= row["real_high"]
    ranks = fa.rankings(real, sim).iloc[0]
    assert ranks["real"] == "S2 > S0" and ranks["sim"] == "S0 > S2" and not ranks["agree"]
    text, info, _ = fa.section(real.assign(model="m", rate=1.0, cap=4, completed_requests=3),
                               sim)
    assert info["ranking_agrees"] == {"b8": False} and "S2 vs S0" in text


def test_missing_half_says_which_and_how_to_fill():
    text, info, _ = fa.section(_frame({("S0", "b8", 1): 1.0}, "torch"), pd.DataFrame())
    assert info == {"cells": 0} and "fidelity_sim" in text and "make fidelity" in text


@pytest.mark.slow  # end to end: steps ledger, fit, profile, report (~9 s CPU)
def test_pipeline_recovers_a_known_profile_end_to_end(tmp_path, capsys):
    """The "real" half is simulated under KNOWN; the fit finds KNOWN, so the simulated half
    reproduces every cell (ranking agrees, errors near zero). Two seeds, both budgets."""
    fewer = ["hydra.sweeper.params.seed='42000,42001'"]
    stand_in = ["hydra.sweeper.params.executor=cpu",
                *(f"executor.{k}={v}" for k, v in KNOWN.items())]
    root = tmp_path / "ledgers"
    assert fe._campaign(fe.REAL, root, [*fewer, *stand_in]) == 0
    assert fe.main(["--ledger-root", str(root), "--skip-real", *fewer]) == 0
    assert fa.main(["--ledgers", str(root), "--out", str(tmp_path / "report")]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["cells"] == 8
    ranks = pd.read_csv(tmp_path / "report" / "tables" / "fidelity_rankings.csv")
    assert list(ranks["real"]) == list(ranks["sim"])  # ties (S1 = S2 at b63) included
    assert info["ranking_agrees"]["b8"]
    assert info["throughput_span_abs_err_pct_max"] < 1.0
    page = (tmp_path / "report" / "fidelity.md").read_text()
    assert "## Fitted step profile" in page and "| per_step_overhead_s |" in page
    assert (tmp_path / "report" / "figures" / "fidelity_throughput.svg").exists()


def test_a_tie_is_shown_and_is_not_agreement():
    real = _frame({("S0", "b63", 1): 10.0, ("S2", "b63", 1): 9.0, ("D0", "b63", 1): 5.0}, "t")
    sim = _frame({("S0", "b63", 1): 8.0, ("S2", "b63", 1): 8.0, ("D0", "b63", 1): 4.0}, "s")
    row = fa.rankings(real, sim).iloc[0]
    assert row["real"] == "S0 > S2 > D0" and row["sim"] == "S0 = S2 > D0"
    assert not row["agree"]
    same = fa.rankings(real, real).iloc[0]
    assert same["agree"] and same["kendall_tau"] == pytest.approx(1.0)


def test_separated_pairs_are_those_whose_real_interval_excludes_zero():
    """Three seeds at b63. Real S0/S2 = 1.25, 1.22, 1.20 (log ratios 0.223, 0.201, 0.182:
    mean 0.202, sd 0.021, 95 % t(2) half-width 0.051) is separated; D0/S0 = 0.95, 1.05, 0.88
    and D0/S2 = 1.19, 1.28, 1.05 have half-widths 0.22 and 0.25 around means -0.047 and
    0.155, so they are not. A simulation ranking S2 above S0 gets the separated pair wrong;
    one with D0 first but S0 above S2 gets it right although the full ranking differs."""
    real = _frame({("S0", "b63", 1): 10.0, ("S0", "b63", 2): 11.0, ("S0", "b63", 3): 12.0,
                   ("S2", "b63", 1): 8.0, ("S2", "b63", 2): 9.0, ("S2", "b63", 3): 10.0,
                   ("D0", "b63", 1): 9.5, ("D0", "b63", 2): 11.5, ("D0", "b63", 3): 10.5},
                  "t")

    def sim(s0, s2, d0):
        return _frame({(org, "b63", seed): v for org, v in (("S0", s0), ("S2", s2),
                                                             ("D0", d0))
                       for seed in (1, 2, 3)}, "s")

    wrong = fa.rankings(real, sim(9.0, 9.5, 5.0)).iloc[0]
    assert wrong["separated"] == "S0 > S2" and wrong["separated_wrong"] == "S0 > S2"
    assert not wrong["separated_agree"]
    right = fa.rankings(real, sim(9.0, 8.0, 12.0)).iloc[0]
    assert right["real"] == "S0 > D0 > S2" and right["sim"] == "D0 > S0 > S2"
    assert not right["agree"] and right["separated_agree"]
    assert right["separated_wrong"] == "none"
    info = fa.summary(fa.cell_table(real, sim(9.0, 8.0, 12.0)),
                      fa.effect_table(real, sim(9.0, 8.0, 12.0)),
                      fa.rankings(real, sim(9.0, 8.0, 12.0)))
    assert info["separated_ranking_agrees"] == {"b63": True}
    assert info["ranking_agrees"] == {"b63": False}


def test_findings_say_in_words_what_the_tables_show():
    """Cells: S0 b63 real 10, sim 10.5 (+5 %); S2 b63 real 9, sim 10.8 (+20 %): one of two
    cells within 10 %, S2 named beyond it. Real S0 > S2 on every seed by 10/9 -> separated;
    the simulation orders them otherwise. A budget whose real intervals separate nothing
    is said to check nothing."""
    real = _frame({("S0", "b63", s): 10.0 + 0.1 * s for s in (1, 2, 3)}
                  | {("S2", "b63", s): 9.0 + 0.09 * s for s in (1, 2, 3)}, "t")
    sim = _frame({("S0", "b63", s): 10.5 + 0.105 * s for s in (1, 2, 3)}
                 | {("S2", "b63", s): 10.8 + 0.108 * s for s in (1, 2, 3)}, "s")
    cells, ranks = fa.cell_table(real, sim), fa.rankings(real, sim)
    lines = fa.findings(cells, ranks)
    assert lines[0].startswith("Span throughput: the simulator is within 10 % of the real "
                               "runs in 1 of 2 cells; the largest error is +20.0 % (S2 at b63)")
    assert "Beyond it: S2 b63 +20.0 %." in lines[0]
    assert "the real runs separate S0 > S2; the simulator orders S0 > S2 otherwise" in lines[1]
    noisy = _frame({("S0", "b8", 1): 10.0, ("S0", "b8", 2): 12.0,
                    ("S2", "b8", 1): 11.0, ("S2", "b8", 2): 11.5}, "t")
    line = fa.findings(fa.cell_table(noisy, noisy), fa.rankings(noisy, noisy))[-1]
    assert line.startswith("At b8 the real runs' 95 % intervals separate no pair")


class _FakeLedger:
    """ledgers.connect's answer for real_runs: the runs query, then the steps query (a
    DataFrame, or a DuckDB binder error where no file has the column)."""

    def __init__(self, steps):
        self.answers = [pd.DataFrame({"run_id": ["r1", "r2"], "org": ["S0", "S2"],
                                      "executor": ["torch", "torch"],
                                      "created_at": ["a", "b"]}), steps]

    def execute(self, sql, params=None):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return type("Result", (), {"df": lambda _self: answer})()

    def close(self):
        pass


@pytest.mark.parametrize("sampling", [[1.0, math.nan], "absent"])
def test_real_runs_without_num_sampling_are_refused(monkeypatch, sampling):
    """Real runs of the executor before the one LM head per step (no num_sampling: NaN in a
    root that unites both, a binder error where no file has it) are not fitted."""
    import duckdb

    steps = (duckdb.BinderException("num_sampling") if sampling == "absent" else
             pd.DataFrame({"run_id": ["r1", "r2"], "step": [1, 1], "num_sampling": sampling}))
    monkeypatch.setattr(fe.ledgers, "connect", lambda root: _FakeLedger(steps))
    with pytest.raises(ValueError, match="without num_sampling.*fresh ledger root"):
        fe.real_runs("/nowhere")
