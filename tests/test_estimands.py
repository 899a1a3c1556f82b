"""Section-2 estimands (analysis.inference.estimands) against expectations computed here by hand or
with independent tools (numpy percentiles, statsmodels, brute-force sign flips), on small
hand-made frames and on a small real ledger read back from its Parquet files."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from analysis_ledgers import Part, brute_sign_flip, build
from test_paper_families import runs_for

import ledgers
from analysis.inference import estimands, prereg
from analysis.inference.families import evaluate_family
from analysis.questions import q1, q6, supporting

# --- pure pieces ------------------------------------------------------------------------------


def test_central_window_and_window_rates_by_hand():
    arrivals = np.arange(100.0)[::-1]  # 0..99, unsorted
    # linear quantile of 0..99: position 0.2 * 99 = 19.8, 0.8 * 99 = 79.2
    assert estimands.central_window(arrivals) == pytest.approx((19.8, 79.2))
    t = np.arange(0.0, 11.0)
    g = np.where(t <= 5, 10 * t, 50 + 30 * (t - 5))  # 10 tokens/s, then 30 tokens/s
    curve = (t, g)
    assert estimands.window_rate(curve, 1.0, 4.0) == pytest.approx(10.0)
    assert estimands.window_rate(curve, 2.5, 7.5) == pytest.approx((125 - 25) / 5)
    # halves of [1, 9]: [1, 5] at 10/s and [5, 9] at 30/s; whole window 20/s
    assert estimands.drift(curve, 1.0, 9.0) == pytest.approx(abs(30 - 10) / 20)
    assert estimands.drift(curve, 0.0, 4.0) == 0.0


def test_goodput_thresholds_and_goodput_by_hand():
    control = pd.DataFrame({"e2e_s": np.arange(1.0, 11.0), "output_tokens": [10] * 10,
                            "status": ["finished"] * 10})
    treatment = pd.DataFrame({"e2e_s": [0.5, 20.0, 30.0, math.nan], "output_tokens": [7, 8, 9, 5],
                              "status": ["finished", "finished", "finished", "unfinished"]})
    tau = estimands.goodput_thresholds(treatment, control, 0.9)
    assert tau["comparator"] == pytest.approx(9 + 0.1 * (10 - 9))  # position 8.1 of 1..10
    union = sorted([*range(1, 11), 0.5, 20.0, 30.0])  # 13 finished: position 0.9 * 12 = 10.8
    assert tau["union"] == pytest.approx(union[10] + 0.8 * (union[11] - union[10]))
    assert estimands.goodput(control, tau["comparator"], 10.0) == pytest.approx(9 * 10 / 10.0)
    assert tau["union"] == pytest.approx(18.0)  # 10 + 0.8 * (20 - 10)
    assert estimands.goodput(treatment, tau["union"], 4.0) == pytest.approx(7 / 4.0)


def test_stranded_fraction_by_hand():
    att, rec = 16_384, 1_594_368
    rows = [  # t, pool, free, cached, total, steps
        (0, "attention", 4, 6, 100, 2), (0, "recurrent", 0, 0, 30, 2),
        (1, "attention", 0, 5, 100, 1), (1, "recurrent", 1, 3, 30, 1),
        (2, "attention", 0, 0, 100, 3), (2, "recurrent", 2, 0, 30, 3),
    ]
    pools = pd.DataFrame(rows, columns=["t_s", "pool", "units_free", "units_cached",
                                        "units_total", "steps"])
    out = estimands.stranded_fractions(pools, {"attention": att, "recurrent": rec})
    total = 100 * att + 30 * rec
    # available = free + cached: t0 recurrent exhausted (10 attention units stranded),
    # t1 nothing exhausted, t2 attention exhausted (2 recurrent units stranded)
    num = [2 * 10 * att, 0, 3 * 2 * rec]
    assert out["stranded_frac"] == pytest.approx(sum(num) / (6 * total))
    running = [num[0] / (2 * total), num[0] / (3 * total), sum(num) / (6 * total)]
    assert out["stranded_max_progress"] == pytest.approx(max(running))
    # free only: t0 4 attention units, t1 attention free = 0 so 1 recurrent unit, t2 as above
    free = 2 * 4 * att + 1 * 1 * rec + 3 * 2 * rec
    assert out["stranded_frac_free_only"] == pytest.approx(free / (6 * total))


# Per-layer unit bytes of D0's two pools, by hand: 16 tokens x KV bytes per token, and one
# composite (Falcon-H1-7B 16 x 1,024 and 1,594,368; its TQ4 KV 16 x 264; Granite 16 x 2,048
# and 1,074,688).
D0_UNIT_BYTES = {
    "falcon_h1_7b": {"attention": 16_384, "recurrent": 1_594_368},
    "falcon_h1_7b_tq4": {"attention": 4_224, "recurrent": 1_594_368},
    "granite": {"attention": 32_768, "recurrent": 1_074_688},
}


@pytest.mark.parametrize("model", sorted(D0_UNIT_BYTES))
def test_d0_runs_record_the_unit_bytes_the_analysis_reads(model):
    """The stranded-byte estimand takes unit sizes from the run's record (engine_config,
    read back from the built pools), not from a table of models."""
    from conftest import compose_config

    from experiments.runners.spec import engine_spec
    from serving_core.builder import build_engine

    cfg = compose_config(f"model={model}", "org=d0", "budget=b63")
    rules = build_engine(engine_spec(cfg)).effective_rules()
    assert rules["pool_unit_bytes"] == D0_UNIT_BYTES[model]
    assert estimands.pool_unit_bytes({"engine_config": json.dumps(rules)}) == D0_UNIT_BYTES[model]
    assert estimands.pool_unit_bytes({"engine_config": "{}"}) is None  # older records: NaN
    assert estimands.pool_unit_bytes({"engine_config": json.dumps(
        {"pool_unit_bytes": {"shared": 524_288}})}) is None  # not the two pools


# --- Q6 bounds and EXT-22 scenarios -------------------------------------------------------------


def test_q6_declares_36_bounds_against_the_preselected_f():
    plan = prereg.load_plan("q6")
    spec, chosen = plan.raw["simultaneous_upper_bounds"], plan.raw["preselected_f"]
    assert spec["against"] == "preselected" and spec["alternative_against"] == "zero"
    members = estimands.bound_members(spec, chosen)
    ids = [m["id"] for m in members]
    assert len(ids) == len(set(ids)) == 36
    within = [m for m in members if "against_f" in m]
    gaps = [i for i in ids if i.startswith("D0_vs_S2_")]
    assert len(within) == 24 and len(gaps) == 12
    for m in within:  # every other f of the grid against the preselected f
        assert m["against_f"] == chosen[m["budget"]][m["org"]] and m["f"] != m["against_f"]
    for name in ("S2_b83_f0.27_vs_f0.35", "S2_b83_f0_vs_f0.35", "S2_b63_f0.35_vs_f0.27",
                 "D0_b83_f0_vs_f0.1", "S2_b108_f0.1_vs_f0", "D0_vs_S2_b83_f0.19"):
        assert name in ids
    assert not any(i.endswith("_f0") for i in gaps)  # f = 0 gaps are P0 of Q6-17
    assert spec["margin_pct"] == 3.0 and spec["alpha"] == 0.05
    old = [m["id"] for m in estimands.bound_members(spec, chosen, "zero")]
    assert len(old) == 36 and "S2_b83_f0.27_vs_f0" in old
    with pytest.raises(ValueError, match="against='best'"):
        estimands.bound_members(spec, chosen, "best")


def test_q6_bounds_are_bonferroni_one_sided_t_bounds():
    from statsmodels.stats.weightstats import DescrStatsW

    plan = prereg.load_plan("q6")
    spec, chosen = plan.raw["simultaneous_upper_bounds"], plan.raw["preselected_f"]
    rng = np.random.default_rng(11)
    rows = [{"stage": "main", "org": org, "budget": b, "f": f, "seed": s,
             "throughput_span": 1000 * (1 + f / 10) * math.exp(rng.normal(0, 0.02))}
            for org in ("D0", "S2") for b in ("b63", "b83", "b108")
            for f in spec["f_grid"] for s in range(12)]
    runs = pd.DataFrame(rows)
    key = lambda o, b, f: runs[(runs.org == o) & (runs.budget == b) & (runs.f == f)]  # noqa: E731
    for against, name, base in (("preselected", "S2_b83_f0.27_vs_f0.35", 0.35),
                                ("zero", "S2_b83_f0.27_vs_f0", 0.0)):
        table = estimands.simultaneous_bounds(runs, spec, preselected=chosen,
                                              against=against).set_index("bound")
        assert len(table) == 36 and (table["m"] == 36).all()
        t = key("S2", "b83", 0.27).set_index("seed")["throughput_span"]
        c = key("S2", "b83", base).set_index("seed")["throughput_span"]
        d = np.log(t / c).to_numpy()
        _, upper = DescrStatsW(d).tconfint_mean(alpha=0.05 / 36, alternative="smaller")
        row = table.loc[name]
        assert row["upper"] == pytest.approx(100 * math.expm1(upper))
        assert row["effect"] == pytest.approx(100 * math.expm1(d.mean()))
        assert row["excludes_margin"] == (100 * math.expm1(upper) < 3.0)


def test_q6_page_prints_the_section_5_4_bound():
    from analysis.pages.render import QuestionResult
    from analysis.questions import q6

    plan = prereg.load_plan("q6")
    spec, chosen = plan.raw["simultaneous_upper_bounds"], plan.raw["preselected_f"]
    rng = np.random.default_rng(2)
    runs = pd.DataFrame([{"stage": "main", "org": o, "budget": b, "f": f, "seed": s,
                          "throughput_span": 700 * math.exp(rng.normal(0, 0.03))}
                         for o in ("D0", "S2") for b in ("b63", "b83", "b108")
                         for f in spec["f_grid"] for s in range(12)])
    result = QuestionResult("q6", "t", ("q6",), ("q6",), len(runs))
    q6.bounds_section(result, plan, runs, chosen)
    text = result.sections[-1].text
    row = result.frames["upper_bounds"].set_index("bound").loc["S2_b83_f0.27_vs_f0.35"]
    assert f"upper bound {row['upper']:+.2f} %" in text
    assert "S2_b83_f0.27_vs_f0.35" in text and "Section 5.4" in text
    assert "upper_bounds_alternative" in result.frames
    assert len(result.sections[-1].tables) == 2


def test_ext22_adoption_scenarios_b_and_c():
    from statsmodels.stats.multitest import multipletests

    plan = prereg.load_plan("q1")
    spec = plan.raw["adoption_scenarios"]
    fam = plan.primary_family
    rng = np.random.default_rng(5)
    noise = {(c.id, s): rng.normal(0, 0.03) for c in fam.cells for s in fam.seeds}

    def value(cell, seed):
        return 1000 * (1 + 0.04 * cell.startswith("S2")) * math.exp(noise[(cell, seed)])

    runs = runs_for(plan, "EXT-22", value)
    result = evaluate_family(plan, fam, runs)
    table = estimands.adoption_scenarios(result, fam, spec).set_index("test")
    affected = ["S1_vs_S0_b108", "S2_vs_S1_b108"]
    assert sorted(table.index[table["affected"]]) == sorted(affected)
    p_a = result.tables["throughput_span"].set_index("test")["p_exact"]
    assert table["p_holm_A"].to_numpy() == pytest.approx(multipletests(p_a, method="holm")[1])
    p_b, p_c = p_a.copy(), p_a.copy()
    seeds = [s for s in fam.seeds if s != 42004]
    for test in affected:
        cells = next(t for t in fam.tests if t.id == test).cells
        d = np.array([math.log(value(cells["treatment"], s) / value(cells["control"], s))
                      for s in seeds])
        p_b[test], p_c[test] = brute_sign_flip(d), 1.0
        assert table.loc[test, "n_B"] == 11
        assert table.loc[test, "effect_B"] == pytest.approx(np.mean(100 * np.expm1(d)))
    assert table["p_holm_B"].to_numpy() == pytest.approx(multipletests(p_b, method="holm")[1])
    assert table["p_holm_C"].to_numpy() == pytest.approx(multipletests(p_c, method="holm")[1])
    assert (table.loc["D0_vs_S2_b63", ["n_A", "n_B"]] == 12).all()


# --- on a real ledger ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimands") / "ledger"
    build(root, (Part("bursts", "burst_pattern", "smoke"),
                 Part("caps", "cap_curves", "smoke", cells=("D0_b63_cap3", "S2_b63_cap3")),
                 Part("orig5", "ORIG-5", "smoke", cells=("D0_c5_granite_b160",))))
    con = ledgers.connect(root)
    yield root, con
    con.close()


def raw(root, table: str, campaign: str) -> pd.DataFrame:
    files = sorted((root / table / f"campaign={campaign}").glob("*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def test_burst_page_ratios_goodput_and_window_from_the_raw_tables(small):
    root, con = small
    result = supporting.PAGES[4].analyze(con)
    table = result.frames["pair_estimands"]
    runs, req, poll = (raw(root, t, "bursts_smoke") for t in ("runs", "requests", "poller"))
    runs = runs.assign(org=runs["org"].str.upper())
    onoff = runs[runs["arrival"] == "onoff"]
    d0, s2 = (onoff[onoff.org == o].set_index("seed") for o in ("D0", "S2"))
    rows = table[table["test"] == "D0_vs_S2_onoff"].set_index("estimand")
    assert rows["label"].iloc[0] == "D0_vs_S2_onoff" and (rows["stage"] == "smoke").all()

    def p99(run_id, column):
        r = req[(req.run_id == run_id) & (req.status == "finished")]
        return float(np.percentile(r[column], 99))

    e2e = {o: np.array([p99(f.loc[s, "run_id"], "e2e_s") for s in (0, 1, 2)])
           for o, f in (("D0", d0), ("S2", s2))}
    row = rows.loc["E2E p99 ratio (ratio of mean run p99s)"]
    assert row["estimate"] == pytest.approx(e2e["D0"].mean() / e2e["S2"].mean())
    assert row["alternative"] == pytest.approx((e2e["D0"] / e2e["S2"]).mean())
    assert row["ci_low"] <= row["estimate"] <= row["ci_high"]
    good, central = [], []
    for s in (0, 1, 2):
        rt = req[req.run_id == d0.loc[s, "run_id"]]
        rc = req[req.run_id == s2.loc[s, "run_id"]]
        tau = np.percentile(rc.loc[rc.status == "finished", "e2e_s"], 90)
        g = [r.loc[(r.status == "finished") & (r.e2e_s <= tau), "output_tokens"].sum()
             / (f.loc[s, "span_end_s"] - f.loc[s, "span_start_s"])
             for r, f in ((rt, d0), (rc, s2))]
        good.append(100 * (g[0] / g[1] - 1))
        lo, hi = np.percentile(rc["arrival_s"], [20, 80])
        rate = []
        for f in (d0, s2):
            p = poll[poll.run_id == f.loc[s, "run_id"]].groupby("t_s")[
                "generation_tokens_total"].max()
            gen = np.interp([lo, hi], p.index.to_numpy(float), p.to_numpy(float))
            rate.append((gen[1] - gen[0]) / (hi - lo))
        central.append(100 * (rate[0] / rate[1] - 1))
    goodput = rows.loc["goodput, comparator-threshold (E2E <= p90)"]
    assert goodput["estimate"] == pytest.approx(np.mean(good))
    assert rows.loc["central-arrival gap", "estimate"] == pytest.approx(np.mean(central))
    full = 100 * (d0["throughput_span"] / s2["throughput_span"] - 1)
    assert rows.loc["central minus full-run gap", "estimate"] == pytest.approx(
        np.mean(central) - full.mean())
    drift = rows[rows.index.str.startswith("runs failing")]
    assert len(drift) == 1 and drift["n"].iloc[0] == 6
    assert "decision" not in table.columns  # descriptive: no labels


def test_cap_ratios_from_the_raw_requests(small):
    root, con = small
    result = supporting.PAGES[3].analyze(con)
    table = result.frames["cap_ratios"].set_index("org")
    runs, req = raw(root, "runs", "caps_smoke"), raw(root, "requests", "caps_smoke")
    for org in ("D0", "S2"):
        ids = runs.loc[runs["org"].str.upper() == org, "run_id"]
        per_run = [req[req.run_id == r] for r in ids]
        done = [float((r.status == "finished").sum()) for r in per_run]
        assert table.loc[org, "victims_per_completion"] == pytest.approx(
            np.mean([(r.preemptions > 0).sum() / n for r, n in zip(per_run, done, strict=True)]))
        assert table.loc[org, "preemptions_per_completion"] == pytest.approx(
            np.mean([r.preemptions.sum() / n for r, n in zip(per_run, done, strict=True)]))
        assert np.isnan(table.loc[org, "rejections_per_completion"])  # untraced runs


def test_stranded_table_joins_steps_to_poller_seconds(small):
    root, con = small
    runs = raw(root, "runs", "orig5_smoke").assign(org=lambda r: r["org"].str.upper())
    d0 = runs[runs.org == "D0"].assign(trace=False, stage="smoke")
    got = estimands.stranded_table(con, d0).set_index("run_id")
    assert len(got) == 3 and (got["stranded_frac_free_only"] > 0).any()  # granite's pools
    poll, steps = raw(root, "poller", "orig5_smoke"), raw(root, "steps", "orig5_smoke")
    for run_id in d0["run_id"]:
        p = poll[poll.run_id == run_id]
        s = steps[steps.run_id == run_id]
        per_second = np.floor(s["t_start_s"]).astype(int).value_counts()
        pools = p.assign(steps=p["t_s"].map(per_second).fillna(0))
        want = estimands.stranded_fractions(pools, D0_UNIT_BYTES["granite"])
        assert got.loc[run_id, "stranded_frac"] == pytest.approx(want["stranded_frac"])
        assert got.loc[run_id, "stranded_frac_free_only"] == pytest.approx(
            want["stranded_frac_free_only"])


def test_q1_and_q6_pages_without_their_runs_skip_the_new_sections(small):
    _, con = small
    assert "adoption_scenarios" not in q1.analyze(con).frames
    assert "upper_bounds" not in q6.analyze(con).frames
