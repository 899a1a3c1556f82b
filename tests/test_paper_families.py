"""The real preregistered families (EXT-22, ORIG-5, Q6-17, PIN-2) evaluated on synthetic
runs tables, checked against the paper's rules computed here independently (brute-force
sign flips, statsmodels' Holm, numpy bootstrap)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_ledgers import brute_sign_flip

from analysis.inference import prereg, stats
from analysis.inference.families import evaluate_family


def two_look(d: pd.Series) -> float:
    p6 = brute_sign_flip(d.loc[list(range(6))])
    p9 = brute_sign_flip(d) if len(d) > 6 else 1.0
    return min(1.0, 2 * min(p6, p9))


def runs_for(plan: prereg.Plan, family: str, value) -> pd.DataFrame:
    """One complete adopted run per planned (cell, seed), throughput from value(cell, seed)."""
    runs = prereg.expected_runs(plan, family)
    runs["campaign"] = runs["campaign"].map(lambda c: c if isinstance(c, str) else c[-1])
    runs["prereg_plan_hash"] = runs["campaign"].map(lambda c: prereg.load_plan(c).plan_hash)
    runs["throughput_span"] = [value(c, s) for c, s in zip(runs.cell_id, runs.seed,
                                                          strict=True)]
    runs["throughput_ledger"] = runs["throughput_span"] * 0.97
    return runs.drop(columns="cell_id").assign(status="complete", adopted=True)


def test_two_look_example_from_the_paper():
    assert stats.two_look(2 / 64, 2 / 512) == 0.0078125
    assert stats.two_look(2 / 64) == 0.0625  # comparison 1: first look only, p9 = 1


ORIG_PCT = {  # seedwise 100 (D0/comparator - 1) per contrast, seeds 0..n-1
    "#1": [3.0, -1.0, 4.0, 5.0, 2.0, 6.0],
    "#2": [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0],  # all D0-higher
    "#3": [40.0, -20.0, 3.0, 4.0, 5.0, 6.0, 7.0, -1.0, 9.0],
    "#4": [-1.0, -2.0, 3.0, -4.0, -5.0, -6.0, 1.0, -7.0, -8.0],
    "#5": [2.0, 1.0, -1.0, 3.0, 4.0, -2.0, 5.0, 6.0, 1.0],
}


@pytest.fixture(scope="module")
def orig5():
    plan = prereg.load_plan("orig5")
    fam = plan.primary_family
    pct = {t.cells["treatment"]: ORIG_PCT[t.label] for t in fam.tests}

    def value(cell, seed):
        base = 1000.0 + 13 * seed
        return base * (1 + pct[cell][seed] / 100) if cell in pct else base

    return fam, evaluate_family(plan, fam, runs_for(plan, "ORIG-5", value))


def test_orig5_two_look_relative_percent_and_holm_over_the_five(orig5):
    from statsmodels.stats.multitest import multipletests

    fam, result = orig5
    assert result.accepted and result.m == 5
    table = result.tables["throughput_span"].set_index("label")
    p_seq, p_log = [], []
    for label, pct in ORIG_PCT.items():
        e = pd.Series(pct)
        logs = np.log1p(e / 100)
        p_seq.append(two_look(e))
        p_log.append(two_look(logs))
        row = table.loc[label]
        assert row["effect"] == pytest.approx(e.mean())  # mean seedwise percent change
        assert (row["n_pos"], row["n_neg"]) == ((e > 0).sum(), (e < 0).sum())
        assert row["p_exact"] == pytest.approx(p_seq[-1])
        assert row["p_sensitivity"] == pytest.approx(p_log[-1])
    assert table.loc["#2", "p6"] == 2 / 64 and table.loc["#2", "p9"] == 2 / 512
    assert table.loc["#2", "p_exact"] == 0.0078125
    assert table.loc["#1", "p9"] == 1.0  # stayed at six seeds
    assert table.loc["#3", "p_exact"] != table.loc["#3", "p_sensitivity"]  # % is not log
    reject, adjusted, _, _ = multipletests(p_seq, alpha=0.05, method="holm")
    assert table["p_holm"].to_numpy() == pytest.approx(adjusted)
    assert [d.startswith("reject") for d in table["decision"]] == list(reject)
    assert (result.tables["throughput_ledger"]["decision"] == "").all()


def test_ext22_on_synthetic_runs(tmp_path):
    from statsmodels.stats.multitest import multipletests

    plan = prereg.load_plan("q1")
    rng = np.random.default_rng(7)
    level = {org: 1000 * (1 + 0.05 * i) for i, org in enumerate(("S0", "S1", "S2", "D0"))}
    keys = {c.id: c.keys for c in plan.primary_family.cells}
    noise = {(c, s): rng.normal(0, 0.03) for c in keys for s in range(42000, 42012)}

    def value(cell, seed):
        k = keys[cell]
        return level[k["org"]] * (1 + 0.2 * (k["q"] == 0.0)) * np.exp(noise[(cell, seed)])

    runs = runs_for(plan, "EXT-22", value)
    result = evaluate_family(plan, plan.primary_family, runs)
    assert result.accepted and result.m == 22
    table = result.tables["throughput_span"].set_index("test")
    series = {c: runs[_mask(runs, keys[c])].set_index("seed")["throughput_span"].sort_index()
              for c in keys}
    p = []
    for test in plan.primary_family.tests:
        if test.kind == "paired":
            t, c = series[test.cells["treatment"]], series[test.cells["control"]]
            d, shown = np.log(t / c), 100 * (t / c - 1)
        else:
            (at, ac, bt, bc) = (series[test.cells[r]] for r in (
                "a.treatment", "a.control", "b.treatment", "b.control"))
            d = np.log(at / ac) - np.log(bt / bc)
            shown = 100 * (at / ac - 1) - 100 * (bt / bc - 1)  # pp, seed by seed
        p.append(brute_sign_flip(d))
        assert table.loc[test.id, "effect"] == pytest.approx(shown.mean())
        assert table.loc[test.id, "min_seed"] == pytest.approx(shown.min())
    assert table["p_exact"].to_numpy() == pytest.approx(p)
    reject, adjusted, _, _ = multipletests(p, alpha=0.05, method="holm")
    assert table["p_holm"].to_numpy() == pytest.approx(adjusted)
    assert [d.startswith("reject") for d in table["decision"]] == list(reject)
    assert table["ci_low"].isna().all()  # EXT-22 has no intervals (Tab. B-5)
    assert table.loc["S1_vs_S0_b83_q1_minus_q0", "unit"] == "pp"
    assert (result.tables["throughput_ledger"]["decision"] == "").all()


def _mask(runs: pd.DataFrame, keys) -> pd.Series:
    mask = pd.Series(True, index=runs.index)
    for key in ("org", "budget", "q", "campaign"):
        mask &= runs[key] == keys[key]
    if keys["org"] == "D0":
        mask &= runs["d0_attention_fraction"] == keys["d0_attention_fraction"]
    return mask


def _q6_values(*, seed: int, sd: float, level: float, d0_gain: float):
    """Q6's plan, its primary family and a throughput value(cell, seed): `level` (times
    `d0_gain` for D0 cells) times exp of seeded normal noise of deviation `sd` per run."""
    plan = prereg.load_plan("q6")
    fam = plan.primary_family
    rng = np.random.default_rng(seed)
    noise = {(c.id, s): rng.normal(0, sd) for c in fam.cells for s in fam.seeds}

    def value(cell, seed):
        return level * (d0_gain if cell.startswith("D0") else 1.0) * np.exp(noise[(cell, seed)])

    return plan, fam, value


def test_q6_17_self_comparisons_and_seeded_bootstrap():
    from statsmodels.stats.multitest import multipletests

    plan, fam, value = _q6_values(seed=3, sd=0.04, level=900, d0_gain=1.1)
    result = evaluate_family(plan, fam, runs_for(plan, "Q6-17", value))
    assert result.accepted and result.m == 17
    table = result.tables["throughput_span"].set_index("test")
    for self_test in ("ID_b63", "IS_b108"):
        row = table.loc[self_test]
        assert row["p_exact"] == 1.0 and row["effect"] == 0.0 and np.isnan(row["ci_low"])
    p = table["p_exact"].to_numpy()
    assert table["p_holm"].to_numpy() == pytest.approx(multipletests(p, method="holm")[1])
    t = pd.Series({s: value("D0_b63_f0", s) for s in fam.seeds})
    c = pd.Series({s: value("S2_b63_f0", s) for s in fam.seeds})
    pct = (100 * (t / c - 1)).to_numpy()
    draws = np.random.default_rng(76400).integers(0, 12, size=(10_000, 12))
    low, high = np.quantile(pct[draws].mean(axis=1), [0.025, 0.975])
    row = table.loc["P0_b63"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high))
    assert row["effect"] == pytest.approx(pct.mean()) and low < row["effect"] < high
    assert row["label"] == "P0-b63" and "bootstrap" in row["interval"]


def test_q6_17_cross_budget_rows_are_pt_and_p19_differences_without_intervals():
    """A2: #1 (budget-endpoint) = PT(b108) - PT(b63), #2 = P19(b108) - P19(b63), log-ratio
    differences, no bootstrap interval; every other non-self row keeps its interval."""
    plan, fam, value = _q6_values(seed=8, sd=0.05, level=800, d0_gain=1.05)
    table = evaluate_family(plan, fam, runs_for(plan, "Q6-17", value)).tables[
        "throughput_span"].set_index("test")
    log = {c.id: np.log([value(c.id, s) for s in fam.seeds]) for c in fam.cells}
    expected = {
        "PT_b108_minus_b63": (log["D0_b108_f10"] - log["S2_b108_f0"])
        - (log["D0_b63_f0"] - log["S2_b63_f27"]),
        "P19_b108_minus_b63": (log["D0_b108_f19"] - log["S2_b108_f19"])
        - (log["D0_b63_f19"] - log["S2_b63_f19"]),
    }
    for test, d in expected.items():
        row = table.loc[test]
        assert row["p_exact"] == pytest.approx(brute_sign_flip(d))
        assert row["kind"] == "interaction" and row["interval"] == ""
        assert np.isnan(row["ci_low"]) and np.isnan(row["ci_high"])
        assert row["n_pos"] == int((d > 0).sum())
    assert "budget-endpoint" in table.loc["PT_b108_minus_b63", "label"]
    assert "P0_b108_minus_b63" not in table.index
    with_interval = table.drop(index=["ID_b63", "IS_b108", *expected])
    assert with_interval["ci_low"].notna().all()


def test_a_test_may_declare_no_interval_and_nothing_else():
    plan = prereg.load_plan("q6")
    raw = {**plan.raw, "families": [dict(f) for f in plan.raw["families"]]}
    tests = [dict(t) for t in raw["families"][0]["tests"]]
    tests[0]["intervals"] = "bootstrap"
    raw["families"][0]["tests"] = tests
    with pytest.raises(ValueError, match=r"intervals='bootstrap': allowed values are \('none',\)"):
        prereg.parse_plan(raw)


def test_pin2_relative_gap_change():
    plan = prereg.load_plan("pinning")
    fam = plan.primary_family
    gaps = {"R0": [2.0, 3.0, 1.0, 4.0, 2.5, 3.5], "R2": [1.0, 2.5, 1.5, 2.0, 0.5, 1.0]}

    def value(cell, seed):
        org, _, setting = cell.split("_")
        return 800.0 * (1 + gaps[setting][seed] / 100) if org == "D0" else 800.0 + seed

    result = evaluate_family(plan, fam, runs_for(plan, "PIN-2", value))
    assert result.accepted and result.m == 2
    table = result.tables["throughput_span"].set_index("test")
    s2 = 800.0 + np.arange(6)
    g = {k: 100 * (800.0 * (1 + np.array(v) / 100) / s2 - 1) for k, v in gaps.items()}
    d = g["R2"] - g["R0"]
    row = table.loc["gap_A_R0_to_R2"]
    assert row["effect"] == pytest.approx(d.mean()) and row["unit"] == "pp"
    assert row["p_exact"] == pytest.approx(brute_sign_flip(d))
    logs = np.log(800.0 * (1 + np.array(gaps["R2"]) / 100) / s2) - np.log(
        800.0 * (1 + np.array(gaps["R0"]) / 100) / s2)
    assert row["p_sensitivity"] == pytest.approx(brute_sign_flip(logs))
