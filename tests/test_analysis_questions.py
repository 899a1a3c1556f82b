"""Per-question analyses on a small real ledger, checked against the raw Parquet tables.

Expectations are computed here from the files themselves (pyarrow, numpy,
itertools, scipy, statsmodels), never through the catalog or analysis code.
"""

from __future__ import annotations

import itertools
import math
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from analysis_ledgers import shared_ledger
from scipy import stats as scipy_stats
from statsmodels.stats.multitest import multipletests

import ledgers
from analysis import common, q1, q2, q3, q4, q5, q6, q7, q8, q9

QUESTIONS = (q1, q2, q3, q4, q5, q6, q7, q8, q9)


@pytest.fixture(scope="session")
def ledger(tmp_path_factory):
    return shared_ledger(tmp_path_factory)


@pytest.fixture(scope="module")
def con(ledger):
    connection = ledgers.connect(ledger.root)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def analyzed(con, ledger):
    """Each question's result on the test ledger, computed once."""
    cache = {}

    def get(module):
        if module not in cache:
            cache[module] = module.analyze(con, plan_dir=ledger.plan_dir)
        return cache[module]

    return get


def raw(ledger, table: str, campaign: str) -> pd.DataFrame:
    files = sorted((ledger.root / table / f"campaign={campaign}").glob("*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def by_seed(runs: pd.DataFrame, column: str = "throughput_ledger", **keys) -> pd.Series:
    mask = pd.Series(True, index=runs.index)
    for key, value in keys.items():
        mask &= runs[key] == value
    return runs[mask].set_index("seed")[column].sort_index()


def brute_sign_flip(d) -> float:
    d = np.asarray(d, dtype=float)
    observed = abs(d.mean())
    hits = [abs(np.mean(d * np.array(signs))) >= observed - 1e-12
            for signs in itertools.product((1, -1), repeat=d.size)]
    return sum(hits) / len(hits)


def t_interval_pct(d, confidence=0.95) -> tuple[float, float]:
    d = np.asarray(d, dtype=float)
    half = scipy_stats.t.ppf(0.5 + confidence / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return 100 * math.expm1(d.mean() - half), 100 * math.expm1(d.mean() + half)


# --- Q1: throughput tables, latency, step changes, the family --------------------------


def test_q1_cells_hold_arithmetic_and_geometric_means_per_org(analyzed, ledger):
    result = analyzed(q1)
    runs = raw(ledger, "runs", "q1")
    cells = result.frames["cells"].set_index("cell")
    assert sorted(cells.index) == ["D0", "S0", "S1", "S2"]
    for org, group in runs.groupby("org"):
        values = group["throughput_ledger"].to_numpy()
        assert cells.loc[org, "n"] == 3
        assert cells.loc[org, "throughput_ledger_mean"] == pytest.approx(values.mean())
        assert cells.loc[org, "throughput_ledger_geomean"] == pytest.approx(
            math.exp(np.log(values).mean()))
        span = group["throughput_span"].to_numpy()
        assert cells.loc[org, "throughput_span_geomean"] == pytest.approx(
            math.exp(np.log(span).mean()))


def test_q1_latency_is_the_mean_of_run_level_p99s(analyzed, ledger):
    cells = analyzed(q1).frames["cells"].set_index("cell")
    runs = raw(ledger, "runs", "q1").set_index("run_id")
    requests = raw(ledger, "requests", "q1")
    finished = requests[requests["status"] == "finished"]
    for metric, column in (("ttft_p99", "ttft_s"), ("e2e_p99", "e2e_s")):
        p99 = finished.groupby("run_id")[column].apply(lambda x: np.percentile(x, 99))
        per_org = p99.groupby(runs.loc[p99.index, "org"].to_numpy()).mean()
        for org, value in per_org.items():
            assert cells.loc[org, f"{metric}_mean"] == pytest.approx(value)


def test_q1_step_changes_match_hand_computed_effects_signs_and_exact_p(analyzed, ledger):
    result = analyzed(q1)
    steps = result.frames["steps"]
    runs = raw(ledger, "runs", "q1")
    for treatment, control in q1.STEPS:
        for metric in ("throughput_ledger", "throughput_span"):
            d = np.log(by_seed(runs, metric, org=treatment)) - np.log(by_seed(runs, metric,
                                                                             org=control))
            row = steps[(steps["comparison"] == f"{treatment} vs {control}")
                        & (steps["metric"] == metric)].iloc[0]
            assert row["n"] == 3
            assert row["effect"] == pytest.approx(100 * math.expm1(d.mean()))
            assert (row["n_pos"], row["n_neg"], row["n_zero"]) == (
                int((d > 0).sum()), int((d < 0).sum()), int((d == 0).sum()))
            assert row["p_exact"] == pytest.approx(brute_sign_flip(d.to_numpy()))
            low, high = t_interval_pct(d.to_numpy())
            assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high))
            seeds = result.frames["steps_seeds"]
            shown = seeds[(seeds["comparison"] == row["comparison"]) & (seeds["metric"] == metric)]
            assert shown["d"].to_numpy() == pytest.approx(d.to_numpy())


def test_q1_family_is_holm_adjusted_within_the_declared_family(analyzed, ledger):
    result = analyzed(q1)
    fam = next(f for f in result.families if f.name == "steps")
    assert fam.accepted and fam.reasons == []
    table = fam.tables["throughput"].set_index("test")
    assert list(table.index) == ["S1_vs_S0", "S2_vs_S1", "D0_vs_S2", "S2_vs_S1_minus_S1_vs_S0"]
    runs = raw(ledger, "runs", "q1")
    g = {org: np.log(by_seed(runs, org=org)) for org in ("S0", "S1", "S2", "D0")}
    d = {"S1_vs_S0": g["S1"] - g["S0"], "S2_vs_S1": g["S2"] - g["S1"],
         "D0_vs_S2": g["D0"] - g["S2"]}
    d["S2_vs_S1_minus_S1_vs_S0"] = d["S2_vs_S1"] - d["S1_vs_S0"]
    p = [brute_sign_flip(d[t].to_numpy()) for t in table.index]
    assert table["p_exact"].to_numpy() == pytest.approx(p)
    reject, adjusted, _, _ = multipletests(p, alpha=0.05, method="holm")
    assert table["p_holm"].to_numpy() == pytest.approx(adjusted)
    assert [s.startswith("reject") for s in table["decision"]] == list(reject)
    # displays: mean seedwise percent change; interaction: mean of seedwise pp differences
    pct = {k: 100 * np.expm1(v) for k, v in d.items() if "minus" not in k}
    for test in ("S1_vs_S0", "S2_vs_S1", "D0_vs_S2"):
        assert table.loc[test, "effect"] == pytest.approx(pct[test].mean())
    pp = (pct["S2_vs_S1"] - pct["S1_vs_S0"]).mean()
    assert table.loc["S2_vs_S1_minus_S1_vs_S0", "effect"] == pytest.approx(pp)
    assert table.loc["S2_vs_S1_minus_S1_vs_S0", "unit"] == "pp"
    assert (fam.tables["ttft_p99"]["decision"] == "").all()  # only the primary is labelled
    assert fam.tables["ttft_p99"]["p_holm"].notna().all()


def test_refused_family_names_missing_cells_and_seeds_and_stays_exploratory(analyzed):
    result = analyzed(q1)
    fam = next(f for f in result.families if f.name == "more_seeds")
    assert not fam.accepted and fam.status == "refused"
    reasons = " ".join(fam.reasons)
    assert "missing runs: S0 " in reasons and "seeds [3]" in reasons
    assert "S1_b83" in reasons and "seeds [0, 1, 2, 3]" in reasons
    table = fam.tables["throughput"].set_index("test")
    assert (table["decision"] == "refused").all() and table["p_holm"].isna().all()
    assert table.loc["S1_vs_S0", "n"] == 3 and table.loc["S1_b83_vs_S0", "n"] == 0
    markdown = result.markdown()
    assert "Exploratory only (family refused)" in markdown and "seeds [3]" in markdown


def test_changed_plan_is_refused_unless_allowed(ledger, tmp_path):
    changed = tmp_path / "plans"
    shutil.copytree(ledger.plan_dir, changed)
    path = changed / "q1.yaml"
    path.write_text(path.read_text().replace("title: test steps", "title: edited later"))
    connection = ledgers.connect(ledger.root)
    try:
        strict = q1.analyze(connection, plan_dir=changed)
        allowed = q1.analyze(connection, plan_dir=changed, allow_changed_plan=True)
    finally:
        connection.close()
    strict_fam = next(f for f in strict.families if f.name == "steps")
    assert not strict_fam.accepted and "plan changed after collection (refused)" in " ".join(
        strict_fam.reasons)
    allowed_fam = next(f for f in allowed.families if f.name == "steps")
    assert allowed_fam.accepted and allowed_fam.plan_changed
    assert "--allow-changed-plan" in allowed_fam.status
    assert not allowed_fam.tables["throughput"]["p_holm"].isna().any()


# --- run-level readouts (Q2's measures) ---------------------------------------------------


def test_run_level_work_gauges_and_preemptions_match_raw_tables(con, ledger):
    runs = common.load_runs(con, ["q1"]).runs.set_index("run_id")
    steps = raw(ledger, "steps", "q1").groupby("run_id")
    poller = raw(ledger, "poller", "q1").groupby(["run_id", "t_s"])[["running", "waiting"]].max()
    requests = raw(ledger, "requests", "q1").groupby("run_id")
    assert len(runs) == 12
    for run_id, row in runs.iterrows():
        initial = steps.get_group(run_id)["prefill_tokens_initial"].sum()
        resume = steps.get_group(run_id)["prefill_tokens_resume"].sum()
        assert (row["prefill_tokens_initial"], row["prefill_tokens_resume"]) == (initial, resume)
        assert row["prefill_tokens_computed"] == initial + resume
        gauges = poller.loc[run_id]
        assert row["poller_running_mean"] == pytest.approx(gauges["running"].mean())
        assert row["poller_waiting_mean"] == pytest.approx(gauges["waiting"].mean())
        assert row["preemptions"] == requests.get_group(run_id)["preemptions"].sum()


def test_q2_without_runs_says_no_data_and_names_its_refused_families(analyzed, ledger):
    result = analyzed(q2)
    markdown = result.markdown()
    assert result.num_runs == 0 and "No data for Q2" in markdown
    assert all(not f.accepted for f in result.families)
    assert "none of the 36 planned runs" in markdown


# --- Q7/Q8: containment gate, then state depth ---------------------------------------------


def depth_by_hand(ledger, campaign: str) -> pd.DataFrame:
    """Per run: mean adopted depth and entry-vs-adopted class counts from the raw trace."""
    trace = raw(ledger, "trace", campaign)
    rows = []
    for run_id, events in trace.groupby("run_id"):
        entries = {}
        classes = dict.fromkeys(q7.CLASSES, 0)
        adopted = []
        for e in events.sort_values("seq").itertuples():
            if e.event == "ENTER_WAITING":
                entries[(e.request_id, e.episode)] = e.j_m0
            elif e.event == "ADOPT":
                entry, depth = entries[(e.request_id, e.episode)], e.boundary
                adopted.append(depth)
                if entry == 0:
                    classes["zero->zero" if depth == 0 else "zero->positive"] += 1
                elif depth == entry:
                    classes["positive-equal"] += 1
                else:
                    classes["deeper" if depth > entry else "shallower"] += 1
        rows.append({"run_id": run_id, "jadopt": np.mean(adopted), **classes})
    return pd.DataFrame(rows).set_index("run_id")


def test_q7_gate_passes_then_depth_matches_the_trace(analyzed, ledger):
    result = analyzed(q7)
    gate = next(f for f in result.families if f.name == "probe_containment")
    assert gate.accepted and gate.gate_passed
    runs = raw(ledger, "runs", "q7")
    on = by_seed(runs, org="S2", trace=True)
    off = by_seed(runs, org="S2", trace=False)
    d = 100 * (np.log(on) - np.log(off))
    half = scipy_stats.t.ppf(0.95, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    probe = gate.tables["probe_effect"].set_index("test").loc["probe_S2"]
    assert probe["effect"] == pytest.approx(d.mean())
    assert (probe["ci_low"], probe["ci_high"]) == pytest.approx((d.mean() - half,
                                                                d.mean() + half), abs=1e-9)
    hand = depth_by_hand(ledger, "q7").join(runs.set_index("run_id")[["org"]])
    cells = result.frames["depth_cells"].set_index("cell")
    classes = result.frames["depth_classes"].set_index("cell")
    for org, group in hand.groupby("org"):
        cell = f"{org} trace on"
        assert cells.loc[cell, "jadopt_mean"] == pytest.approx(group["jadopt"].mean())
        for name in q7.CLASSES:
            assert classes.loc[cell, f"count_{name}"] == group[name].sum()
    assert cells["episodes"].sum() == sum(hand[list(q7.CLASSES)].sum())
    depth = next(f for f in result.families if f.name == "depth")
    assert depth.accepted
    jadopt = hand.join(runs.set_index("run_id")[["seed"]]).set_index(["org", "seed"])["jadopt"]
    diff = jadopt.loc["D0"] - jadopt.loc["S2"]
    assert depth.tables["jadopt_mean"].iloc[0]["effect"] == pytest.approx(diff.mean())
    assert "[M0; M1]" in result.markdown()


def test_q7_depth_is_withheld_when_the_gate_family_is_refused(ledger, tmp_path):
    plans = tmp_path / "plans"
    shutil.copytree(ledger.plan_dir, plans)
    path = plans / "q7.yaml"
    path.write_text(path.read_text().replace("seeds: [0, 1, 2]", "seeds: [0, 1, 2, 5]", 1))
    connection = ledgers.connect(ledger.root)
    try:
        result = q7.analyze(connection, plan_dir=plans, allow_changed_plan=True)
    finally:
        connection.close()
    assert "depth_cells" not in result.frames
    markdown = result.markdown()
    assert "Depth analysis withheld" in markdown and "seeds [5]" in markdown
    depth = next(f for f in result.families if f.name == "depth")
    assert not depth.accepted and "withheld" in depth.reasons[0]


def test_runs_outside_the_plan_campaign_are_analysed_as_exploratory(ledger, tmp_path):
    """A smoke-like campaign: its own ON/OFF pairs gate its depth; K_ret is exploratory."""
    plans = tmp_path / "plans"
    shutil.copytree(ledger.plan_dir, plans)
    for name in ("q7", "q9"):
        path = plans / f"{name}.yaml"
        path.write_text(path.read_text().replace(f"campaign: {name}", f"campaign: {name}_main"))
    connection = ledgers.connect(ledger.root)
    try:
        r7 = q7.analyze(connection, plan_dir=plans)
        r9 = q9.analyze(connection, plan_dir=plans)
    finally:
        connection.close()
    assert "depth_cells" in r7.frames
    assert any("campaign q7: depth analysed" in n and "exploratory" in n for n in r7.notes)
    depth = next(f for f in r7.families if f.name == "depth")
    assert not depth.accepted and "withheld" in depth.reasons[0]
    kret = r9.frames["kret"]
    assert set(kret["status"]) == {"exploratory"} and set(kret["condition"]) == {"q9"}
    assert "no preregistered K_ret" in r9.markdown()


def test_q8_depth_uses_the_q7_gate_and_compares_retention(analyzed, ledger):
    result = analyzed(q8)
    assert any("campaign q8: depth analysed" in note
               and "Q7 campaign q7: preregistered containment family" in note
               for note in result.notes)
    hand = depth_by_hand(ledger, "q8").join(raw(ledger, "runs", "q8").set_index("run_id")[
        ["org", "seed"]]).set_index(["org", "seed"])["jadopt"]
    diff = hand.loc["S2_RETENTION"] - hand.loc["S2"]
    changes = result.frames["depth_changes"]
    row = changes[changes["metric"] == "jadopt_tokens_mean"].iloc[0]
    assert row["effect"] == pytest.approx(diff.mean())
    assert row["n_pos"] == int((diff > 0).sum())
    fam = result.families[0]
    assert fam.accepted and fam.tables["jadopt_mean"].iloc[0]["effect"] == pytest.approx(
        diff.mean())


# --- Q9: K_ret ---------------------------------------------------------------------------


def test_q9_kret_matches_the_hand_computed_interaction(analyzed, ledger):
    result = analyzed(q9)
    runs = raw(ledger, "runs", "q9")
    for timebase, column in (("ledger", "throughput_ledger"), ("span", "throughput_span")):
        g = {(org, reuse): np.log(by_seed(runs, column, org=org, reuse=reuse))
             for org in ("S2", "S2_RETENTION") for reuse in ("share", "isolate")}
        d_share = g[("S2_RETENTION", "share")] - g[("S2", "share")]
        d_isolate = g[("S2_RETENTION", "isolate")] - g[("S2", "isolate")]
        k = (d_share - d_isolate).to_numpy()
        kret = result.frames["kret"].query("status == 'preregistered'")
        kret = kret.set_index(["timebase", "estimand"])
        row = kret.loc[(timebase, "K_ret")]
        assert row["n"] == 3
        assert row["effect_pct"] == pytest.approx(100 * math.expm1(k.mean()))
        assert (row["ci_low_pct"], row["ci_high_pct"]) == pytest.approx(t_interval_pct(k))
        expected = ("CONFIRMED" if t_interval_pct(k)[0] > 0 else
                    "DIRECTIONAL" if (k > 0).all() else "NOT_CONFIRMED")
        assert row["decision"] == expected
        share = kret.loc[(timebase, "delta_share")]
        assert share["effect_pct"] == pytest.approx(100 * math.expm1(d_share.mean()))
    seeds = result.frames["kret_seeds"]
    assert len(seeds) == 2 * 3 * 3
    fam = next(f for f in result.families if f.name == "k_ret")
    assert set(result.frames["kret"]["status"]) == {"preregistered"}  # one condition: no repeat
    k_ledger = result.frames["kret"].set_index(["timebase", "estimand"]).loc[("ledger", "K_ret")]
    assert fam.tables["K_ret"].set_index("test").loc["K_ret", "effect"] == pytest.approx(
        k_ledger["effect_pct"])


# --- Q4/Q5/Q6: D0/S2 contrasts by budget, load and headroom -------------------------------


def test_q4_reuses_q1_runs_for_the_d0_s2_contrast_and_indices(analyzed, ledger):
    result = analyzed(q4)
    runs = raw(ledger, "runs", "q1")
    d = np.log(by_seed(runs, org="D0")) - np.log(by_seed(runs, org="S2"))
    row = result.frames["d0_vs_s2"].query("metric == 'throughput_ledger'").iloc[0]
    assert row["effect"] == pytest.approx(100 * math.expm1(d.mean()))
    index = result.frames["normalized_index"].set_index("arm")
    chain = (by_seed(runs, org="S2") / by_seed(runs, org="S0"))
    assert index.loc["S2", "index_mean"] == pytest.approx(chain.mean())
    assert index.loc["D0", "index_geomean"] == pytest.approx(
        math.exp(np.log(by_seed(runs, org="D0") / by_seed(runs, org="S0")).mean()))
    assert result.families[0].accepted


def test_q5_and_q6_contrast_per_load_and_headroom(analyzed, ledger):
    r5 = analyzed(q5)
    runs = raw(ledger, "runs", "q5")
    contrast = r5.frames["d0_vs_s2"].query("metric == 'throughput_ledger'").set_index("rate")
    for rate in (6.0, 12.0):
        d = (np.log(by_seed(runs, org="D0", rate=rate))
             - np.log(by_seed(runs, org="S2", rate=rate)))
        assert contrast.loc[rate, "effect"] == pytest.approx(100 * math.expm1(d.mean()))
    r6 = analyzed(q6)
    runs = raw(ledger, "runs", "q6")
    headroom = r6.frames["headroom"].query("metric == 'throughput_ledger'").set_index("org")
    for org in ("S2", "D0"):
        d = np.log(by_seed(runs, org=org, f=0.19)) - np.log(by_seed(runs, org=org, f=0.0))
        assert headroom.loc[org, "effect"] == pytest.approx(100 * math.expm1(d.mean()))
        assert headroom.loc[org, "n"] == 2


def test_every_question_on_an_empty_ledger_says_no_data(tmp_path):
    connection = ledgers.connect(tmp_path / "nothing")
    try:
        for module in QUESTIONS:
            result = module.analyze(connection)
            assert result.num_runs == 0
            assert f"No data for {module.QUESTION.upper()}" in result.markdown()
    finally:
        connection.close()
