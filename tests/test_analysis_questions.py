"""Per-question analyses on a small real ledger built from the real plans, checked against
the raw Parquet tables.

Expectations are computed here from the files themselves (pyarrow, numpy, itertools,
statsmodels), never through the catalog or the analysis code.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from analysis_ledgers import brute_sign_flip, shared_ledger

import ledgers
from analysis import report
from analysis.inference.families import SMOKE_STATUS
from analysis.pages import common
from analysis.questions import q1, q2, q3, q4, q5, q6, q7, q8, q9

QUESTIONS = (q1, q2, q3, q4, q5, q6, q7, q8, q9)


@pytest.fixture(scope="session")
def ledger(tmp_path_factory):
    return shared_ledger(tmp_path_factory)


@pytest.fixture(scope="module")
def con(ledger):
    """The test ledger's connection; the module's analyses read its runs as the report does
    (`common.cached_runs`: each connection's runs rows once, each question's runs once)."""
    connection = ledgers.connect(ledger.root)
    with common.cached_runs():
        yield connection
    connection.close()


@pytest.fixture(scope="module")
def analyzed(con):
    cache = {}

    def get(module):
        if module not in cache:
            cache[module] = module.analyze(con)
        return cache[module]

    return get


def raw(ledger, table: str, *campaigns: str) -> pd.DataFrame:
    files = [f for c in campaigns
             for f in sorted((ledger.root / table / f"campaign={c}").glob("*.parquet"))]
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def by_seed(runs: pd.DataFrame, column: str = "throughput_span", **keys) -> pd.Series:
    mask = pd.Series(True, index=runs.index)
    for key, value in keys.items():
        mask &= np.isclose(runs[key], value) if isinstance(value, float) else runs[key] == value
    return runs[mask].set_index("seed")[column].sort_index()


def family(result, name):
    return next(f for f in result.families if f.name == name)


# --- run-level readouts -------------------------------------------------------------------


def test_work_and_gauge_readouts_match_the_raw_tables(con, ledger):
    """C_once, H, K, H/K, gauges, percentiles and requests/s from requests/steps/poller."""
    runs = common.load_runs(con, ["q2"]).runs.set_index("run_id")
    requests = raw(ledger, "requests", "q2").groupby("run_id")
    steps = raw(ledger, "steps", "q2").groupby("run_id")
    poller = raw(ledger, "poller", "q2").groupby(["run_id", "t_s"])[["running", "waiting"]].max()
    assert len(runs) == 18
    for run_id, row in runs.iterrows():
        req = requests.get_group(run_id)
        started = req[req["start_s"].notna()]
        c_once = int((started["prompt_tokens"] - started["adopted_prefix_tokens"]).sum())
        assert row["c_once_tokens"] == c_once
        assert row["h_tokens"] == c_once + req["output_tokens"].sum()
        assert row["engine_steps"] == len(steps.get_group(run_id))
        assert row["h_per_k"] == pytest.approx(row["h_tokens"] / len(steps.get_group(run_id)))
        gauges = poller.loc[run_id]
        assert row["running_median"] == pytest.approx(gauges["running"].median())
        assert row["waiting_max"] == gauges["waiting"].max()
        assert row["running_max"] == gauges["running"].max()
        done = req[req["status"] == "finished"]
        assert row["ttft_p50"] == pytest.approx(np.percentile(done["ttft_s"], 50))
        assert row["tpot_p99"] == pytest.approx(np.percentile(done["tpot_s"].dropna(), 99))
        span = row["span_end_s"] - row["span_start_s"]
        assert row["requests_per_s"] == pytest.approx(row["completed_requests"] / span)


def test_q1_low_load_table_means_and_waiting_run_maxima(analyzed, ledger):
    result = analyzed(q1)
    table = result.frames["exp1b"].set_index(["budget", "org"])
    runs = raw(ledger, "runs", "q1")
    poller = raw(ledger, "poller", "q1").groupby(["run_id", "t_s"])["waiting"].max()
    maxima = poller.groupby("run_id").max()
    for (budget, org), row in table.iterrows():
        cell = runs[(runs.budget == budget) & (runs.org == org) & (runs.rate == 0.8)]
        assert row["n"] == 3
        assert row["throughput_span"] == pytest.approx(cell["throughput_span"].mean())
        peaks = maxima.loc[cell["run_id"]]
        assert row["waiting_max_range"] == f"{peaks.min():g}-{peaks.max():g}"
    fam = family(result, "exp1b_low_load")  # a secondary, descriptive family: no labels
    assert fam.accepted and (fam.tables["throughput_span"]["decision"] == "").all()
    assert fam.tables["ttft_p99"]["p_exact"].notna().all()


def test_ext22_smoke_is_the_real_family_over_four_campaigns(analyzed, ledger):
    from statsmodels.stats.multitest import multipletests

    result = analyzed(q1)
    fam = family(result, "EXT-22 (smoke)")
    assert fam.accepted and fam.status == SMOKE_STATUS and fam.m == 22
    table = fam.tables["throughput_span"].set_index("test")
    assert len(table) == 22 and list(table["label"]) == [f"row {i}" for i in range(1, 23)]
    runs = raw(ledger, "runs", "q1_smoke", "q3_smoke", "q4_smoke", "d0_split_smoke")
    main = runs[runs.q == 1.0]
    t = {o: by_seed(main, org=o, budget="b83") for o in ("S0", "S1")}
    t0 = {o: by_seed(runs, org=o, budget="b83", q=0.0) for o in ("S0", "S1")}
    d_step = np.log(t["S1"] / t["S0"])
    assert table.loc["S1_vs_S0_b83", "p_exact"] == pytest.approx(brute_sign_flip(d_step))
    assert table.loc["S1_vs_S0_b83", "effect"] == pytest.approx(
        (100 * (t["S1"] / t["S0"] - 1)).mean())
    d_inter = d_step - np.log(t0["S1"] / t0["S0"])
    row = table.loc["S1_vs_S0_b83_q1_minus_q0"]
    assert row["p_exact"] == pytest.approx(brute_sign_flip(d_inter))
    pp = 100 * (t["S1"] / t["S0"] - 1) - 100 * (t0["S1"] / t0["S0"] - 1)
    assert row["effect"] == pytest.approx(pp.mean()) and row["unit"] == "pp"
    split = by_seed(runs, org="D0", budget="b63", d0_attention_fraction=0.427383)
    default = by_seed(runs[runs.campaign == "q4_smoke"], org="D0", budget="b63")
    assert table.loc["D0_RM10_vs_default_b63", "p_exact"] == pytest.approx(
        brute_sign_flip(np.log(split / default)))
    p = table["p_exact"].to_numpy()
    assert table["p_holm"].to_numpy() == pytest.approx(multipletests(p, method="holm")[1])


def test_q3_and_q4_show_ext22_rows_decided_over_all_22(analyzed):
    ext = family(analyzed(q1), "EXT-22 (smoke)").tables["throughput_span"].set_index("test")
    for module, rows in ((q3, q3.ENDPOINT_ROWS), (q4, q4.D0_ROWS)):
        borrowed = family(analyzed(module), "EXT-22 (smoke)")
        table = borrowed.tables["throughput_span"].set_index("test")
        assert list(table.index) == list(rows) and borrowed.m == 22
        assert table["p_holm"].to_numpy() == pytest.approx(ext.loc[list(rows), "p_holm"])
        assert "decided there: Holm over all 22" in borrowed.description


def test_q2_exp2c_s0_index_is_formed_within_seed(analyzed, ledger):
    result = analyzed(q2)
    runs = raw(ledger, "runs", "q3_smoke")
    q0 = runs[runs.q == 0.0]
    t = {o: by_seed(q0, org=o) for o in ("S0", "S1", "S2")}
    index = result.frames["s0_index"].set_index("org")
    assert index.loc["S0", "t_index"] == 1.0
    assert index.loc["S2", "t_index"] == pytest.approx(
        ((t["S1"] / t["S0"]) * (t["S2"] / t["S1"])).mean())
    assert family(result, "anchors").accepted
    anchors = family(result, "anchors").tables["c_once"].set_index("test")
    assert anchors.loc["S1_vs_S0_2a", "unit"] == "%"


# --- Q7/Q8: containment gate, then depth over INITIAL admissions ---------------------------


def initial_by_hand(ledger, campaign: str) -> pd.DataFrame:
    """Per run: means over ADOPT events of episode 1 (INITIAL) from the raw trace."""
    trace = raw(ledger, "trace", campaign)
    adopt = trace[(trace.event == "ADOPT") & (trace.episode == 1)]
    return adopt.groupby("run_id").agg(jadopt=("boundary", "mean"), rmax_m1=("rmax_m1", "mean"),
                                       amax_m1=("a_m1", "mean"), amax_m0=("a_m0", "mean"))


def test_q7_gate_is_not_informative_in_simulation_and_depth_uses_initial_admissions(
        analyzed, ledger):
    result = analyzed(q7)
    gate = family(result, "probe_containment")
    assert gate.accepted and gate.gate_passed
    probes = gate.tables["probe_effect"]
    assert probes["note"].str.startswith("not informative in simulation").all()
    assert (probes["decision"] == "not informative in simulation").all()  # never "PASS"
    assert "Gate: not informative in simulation" in result.markdown()
    assert "passed" not in " ".join(result.notes)
    hand = initial_by_hand(ledger, "q7")
    table = result.frames["initial_depth"]
    runs = raw(ledger, "runs", "q7").set_index("run_id")
    for run_id, row in hand.iterrows():
        org, f, seed = runs.loc[run_id, ["org", "f", "seed"]]
        got = table[(table.org == org) & np.isclose(table.f, f) & (table.seed == seed)].iloc[0]
        assert got["jadopt"] == pytest.approx(row["jadopt"])
        assert got["gap_r"] == pytest.approx(row["rmax_m1"] - row["jadopt"])
    classes = result.frames["depth_classes"]
    counted = classes[[c for c in classes if c.startswith("count_")]].to_numpy().sum()
    trace = raw(ledger, "trace", "q7")
    assert counted == ((trace.event == "ADOPT") & (trace.episode == 1)).sum()  # INITIAL only
    depth = family(result, "depth")
    change = depth.tables["jadopt"].set_index("test").loc["S2_f19_vs_f0_depth"]
    j = hand.join(runs[["org", "f", "seed"]])
    s2 = j[j.org == "S2"].set_index(["f", "seed"])["jadopt"]
    assert change["effect"] == pytest.approx((s2.loc[0.19] - s2.loc[0.0]).mean())


def test_q8_amax_bracket_from_m0_and_m1(analyzed, ledger):
    result = analyzed(q8)
    hand = initial_by_hand(ledger, "q8").join(raw(ledger, "runs", "q8").set_index("run_id")[
        ["org", "seed"]]).set_index(["org", "seed"])
    ret, s2 = hand.loc["S2_RETENTION"], hand.loc["S2"]
    brackets = result.frames["amax_bracket"]
    rows = brackets[brackets.seed != "mean"].set_index("seed")
    for seed in s2.index:
        assert rows.loc[seed, "d_amax_low"] == pytest.approx(
            ret.loc[seed, "amax_m0"] - s2.loc[seed, "amax_m1"])
        assert rows.loc[seed, "d_amax_high"] == pytest.approx(
            ret.loc[seed, "amax_m1"] - s2.loc[seed, "amax_m0"])
        assert rows.loc[seed, "d_jadopt"] == pytest.approx(
            ret.loc[seed, "jadopt"] - s2.loc[seed, "jadopt"])
    assert family(result, "retention_depth").accepted


def test_q8_secondary_depth_and_throughput_tables_read_as_the_families(analyzed, ledger):
    """Issue 20, section 5: the depth-change table uses INITIAL admissions, M1 (M0 as the
    bracket) and GapR = Rmax - Jadopt; the throughput change shows one statistic (A7)."""
    result = analyzed(q8)
    trace = raw(ledger, "trace", "q8")
    adopt = trace[(trace.event == "ADOPT") & (trace.episode == 1)]
    hand = adopt.assign(gap_m1=adopt.rmax_m1 - adopt.boundary,
                        gap_m0=adopt.rmax_m0 - adopt.boundary).groupby("run_id")[
        ["boundary", "gap_m1", "gap_m0", "rmax_m1"]].mean()
    runs = raw(ledger, "runs", "q8").set_index("run_id")
    hand = hand.join(runs[["org", "seed"]]).set_index(["org", "seed"])
    seeds = result.frames["depth_changes_seeds"]
    for metric, column in (("jadopt_initial_mean", "boundary"), ("gap_r_initial_mean", "gap_m1"),
                           ("gap_r_m0_initial_mean", "gap_m0"),
                           ("rmax_m1_initial_mean", "rmax_m1")):
        d = seeds[seeds.metric == metric].set_index("seed")["d"].sort_index()
        expected = (hand.loc["S2_RETENTION", column] - hand.loc["S2", column]).sort_index()
        assert d.to_numpy() == pytest.approx(expected.to_numpy()), metric
    assert "jadopt_tokens_mean" not in set(result.frames["depth_changes"].metric)
    # per-cell GapR bracket: Rmax - Jadopt (the adopted depth) over every episode
    every = trace[trace.event == "ADOPT"]
    per_run = every.assign(g=every.rmax_m1 - every.boundary).groupby("run_id")["g"].mean()
    cells = result.frames["depth_cells"]
    assert sorted(cells["gap_m1_mean"]) == pytest.approx(sorted(
        per_run.to_frame().join(runs["org"]).groupby("org")["g"].mean()))
    change = result.frames["retention"]
    assert "display_mean_pct" not in change
    row = change[change.metric == "throughput_ledger"].iloc[0]
    t = by_seed(runs.reset_index(), "throughput_ledger", org="S2_RETENTION")
    c = by_seed(runs.reset_index(), "throughput_ledger", org="S2")
    assert row["effect"] == pytest.approx((100 * (t / c - 1)).mean())
    assert "one statistic" in result.markdown()


def test_q7_depth_page_says_where_jenter_comes_from(analyzed):
    assert "offline from block ids" in analyzed(q7).markdown()


# --- Q9 ------------------------------------------------------------------------------------


def test_q9_kret_label_only_on_the_primary_and_isolate_note(analyzed, ledger):
    result = analyzed(q9)
    runs = raw(ledger, "runs", "q9")
    g = {(o, r): np.log(by_seed(runs, "throughput_ledger", org=o, reuse=r))
         for o in ("S2", "S2_RETENTION") for r in ("share", "isolate")}
    k = ((g[("S2_RETENTION", "share")] - g[("S2", "share")])
         - (g[("S2_RETENTION", "isolate")] - g[("S2", "isolate")]))
    kret = result.frames["kret"].set_index(["timebase", "estimand"])
    assert kret.loc[("ledger", "K_ret"), "effect_pct"] == pytest.approx(
        100 * math.expm1(k.mean()))
    assert kret.loc[("ledger", "K_ret"), "decision"] != ""
    if identical_isolate(runs):
        row = family(result, "within_mode").tables["delta"].set_index("test").loc[
            "delta_isolate"]
        assert row["note"].startswith("identical runs") and row["effect"] == 0
    assert (kret.drop(index=("ledger", "K_ret"))["decision"] == "").all()
    fam = family(result, "k_ret")
    assert fam.accepted  # written in the balanced order
    assert (fam.tables["K_ret_span"]["decision"] == "").all()
    assert (family(result, "within_mode").tables["delta"]["decision"] == "").all()
    assert (q9.ISOLATE_NOTE in result.notes) == identical_isolate(runs)


def identical_isolate(runs: pd.DataFrame) -> bool:
    return bool((by_seed(runs, "throughput_ledger", org="S2", reuse="isolate")
                 == by_seed(runs, "throughput_ledger", org="S2_RETENTION", reuse="isolate"))
                .all())


def test_q9_out_of_order_runs_are_refused(ledger, tmp_path):
    root = tmp_path / "ledger"
    shutil.copytree(ledger.root, root)
    for path in (root / "runs" / "campaign=q9").glob("*.parquet"):
        table = pq.read_table(path).to_pandas()
        table["created_at"] = "2026-01-01T00:00:00." + table["org"].map(
            {"S2": "000001", "S2_RETENTION": "000002"}) + table["reuse"].map(
            {"share": "1", "isolate": "2"})
        table.to_parquet(path, index=False)
    connection = ledgers.connect(root)
    try:
        result = q9.analyze(connection)
    finally:
        connection.close()
    fam = family(result, "k_ret")
    assert not fam.accepted
    assert any(r.startswith("run order not balanced") for r in fam.reasons)


# --- partial families: one-line reasons and fill commands ---------------------------------


def test_partial_families_say_what_is_missing_and_how_to_fill_it(analyzed):
    r5, r6 = analyzed(q5), analyzed(q6)
    page = r5.markdown()
    assert "> Family `load_curves` refused: missing 54 of 66 planned runs" in page
    assert "fill with `make q5`" in page
    assert "fill with `make q6 SMOKE=1`" in r6.markdown()
    assert "curve_runs" in r5.frames and len(r5.frames["curve_runs"]) == 12


def test_changed_plan_is_refused_unless_allowed(ledger, tmp_path):
    from analysis.inference import prereg

    plans = tmp_path / "plans"
    shutil.copytree(prereg.PLAN_DIR, plans)
    path = plans / "q9.yaml"
    path.write_text(path.read_text().replace("title: Is the retention", "title: Was the"))
    connection = ledgers.connect(ledger.root)
    try:
        strict = q9.analyze(connection, plan_dir=plans)
        allowed = q9.analyze(connection, plan_dir=plans, allow_changed_plan=True)
    finally:
        connection.close()
    assert not family(strict, "k_ret").accepted
    assert "plan changed after collection (refused)" in " ".join(family(strict, "k_ret").reasons)
    assert family(allowed, "k_ret").accepted and family(allowed, "k_ret").plan_changed


def test_every_page_on_an_empty_ledger_says_no_data(tmp_path):
    connection = ledgers.connect(tmp_path / "nothing")
    try:
        for module in report.QUESTIONS:
            result = module.analyze(connection)
            assert result.num_runs == 0
            assert f"No data for {module.QUESTION.upper()}" in result.markdown()
            assert all(f.no_data or (not f.accepted and "withheld" in f.reasons[0])
                       for f in result.families)
            assert all(f.status != "refused" for f in result.families)  # "no runs yet"
            if module is q7:
                assert {f.status for f in result.families} == {"no runs yet"}
    finally:
        connection.close()
