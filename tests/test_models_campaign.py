"""The per-model campaign (issue 48): its devices, budgets, loads and D0 split follow their
declared rules (experiments/campaigns/models_regime.py: loads from the budget leader's
memory-bound capacity, the overload bound from the unloaded p99 TTFT), D0's split is chosen
on seeds the tests never use, the page flags overloaded cells and calls ties by the
preregistered equivalence margin, the plan tests each organization against the budget's
leader on enough seeds for Holm, and the sensitivity runs share what they would repeat."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

import ledgers
from analysis.inference import prereg
from analysis.questions import models as page
from analysis.questions import models_sens as page_sens
from experiments.campaigns import models_plan, models_sens
from experiments.campaigns import models_regime as regime

REPO = Path(__file__).resolve().parent.parent
CAMPAIGN = yaml.safe_load((REPO / "conf" / "campaign" / "models.yaml").read_text())
BLOCKS = CAMPAIGN["hydra"]["sweeper"]["blocks"]
REGIME = page.regime()


def test_budgets_are_requests_at_the_mean_in_whole_mib():
    # Falcon-H1-7B by hand: 3,602 tokens x 45,056 B + one 70,152,192-B checkpoint
    assert regime.request_bytes("falcon_h1_7b") == 3_602 * 45_056 + 70_152_192 == 232_443_904
    assert regime.budget_mib("falcon_h1_7b", 16) == math.ceil(16 * 232_443_904 / 2**20) == 3547
    assert {b["model"] for b in BLOCKS.values()} == set(regime.MODELS)
    devices = {m: regime.device_for(m) for m in regime.MODELS}
    for name, block in BLOCKS.items():
        model, level = block["model"], name.rsplit("_", 1)[1]
        assert block["budget"] == f"{regime.budget_mib(model, int(level[1:]))}MiB", name
        assert block["executor"] == devices[model] == REGIME[model]["device"]
        rates = REGIME[model]["rates"][level]
        assert str(block["load.rate"]) == str(rates["l80"])
        cap = REGIME[model]["capacity"][level]
        assert rates["l80"] == round(0.8 * cap["tokens_s"] / cap["output_tokens_per_request"], 3)
        assert cap["org"] == max(cap["per_org"], key=cap["per_org"].get)
        assert block["model.d0_attention_fraction"] == REGIME[model]["d0_split"]["fraction"]


def _capacity_run(org, budget, tokens_s, rate=100.0, ttft=1.0):
    return {"org": org, "budget": budget, "rate": rate, "throughput_span": tokens_s,
            "output_tokens": 2_500, "completed_requests": 10, "ttft_p99": ttft}


def test_load_rule_and_overload_bound_by_hand():
    # 80 % of 1,000 tokens/s at 250 tokens a request: 3.2 requests/s
    assert regime.load_rates(1_000.0, 250.0) == {"l80": 3.2}
    entry = {"full_device_mib": 100, "budgets": {"r16": 10, "r32": 20}}
    runs = [_capacity_run("S0", "100MiB", 900.0), _capacity_run("S1", "100MiB", 1_000.0),
            _capacity_run("S0", "10MiB", 400.0), _capacity_run("S1", "10MiB", 300.0),
            _capacity_run("S0", "20MiB", 500.0), _capacity_run("S1", "20MiB", 600.0),
            _capacity_run("S0", "100MiB", 5.0, regime.IDLE_RATE, 0.8),
            _capacity_run("S1", "100MiB", 5.0, regime.IDLE_RATE, 0.6)]
    regime.measure_regime(entry, runs)
    assert entry["ceiling"]["tokens_s"] == 1_000.0 and entry["ceiling"]["org"] == "S1"
    # the leader per budget, its capacity, and loads from it (not from the ceiling)
    assert {lv: c["org"] for lv, c in entry["capacity"].items()} == {"r16": "S0", "r32": "S1"}
    # 0.8 x 400 / 250 and 0.8 x 600 / 250
    assert entry["rates"] == {"r16": {"l80": 1.28}, "r32": {"l80": 1.92}}
    # 10 x the best unloaded p99 TTFT (S1's 0.6 s)
    assert entry["idle_ttft_p99_s"] == {"S0": 0.8, "S1": 0.6} and entry["ttft_bound_s"] == 6.0


def test_overloaded_cells_are_flagged_not_ranked():
    eq = {"margin_pct": 1.0, "alpha": 0.05}
    runs = pd.DataFrame({
        "stage": "main", "model": "m", "budget": "64MiB", "rate": 2.0,
        "seed": [1, 1, 1, 2, 2, 2, 3, 3, 3], "org": ["S0", "S1", "S2"] * 3,
        # S2 serves the most but its mean p99 TTFT, (5 + 7 + 9) / 3 = 7 s, exceeds 6 s
        "ttft_p99": [1.0, 2.0, 5.0, 1.0, 2.0, 7.0, 1.0, 2.0, 9.0],
        "throughput_span": [100.0, 120.0, 150.0, 100.0, 130.0, 160.0, 100.0, 125.0, 155.0]})
    reg = {"m": {"ceiling": {"tokens_s": 200.0}, "budgets": {"r16": 64},
                 "rates": {"r16": {"l80": 2.0}}, "ttft_bound_s": 6.0,
                 "capacity": {"r16": {"org": "S0"}}}}
    assert page.overloaded(runs, 6.0) == ["S2"] and page.overloaded(runs, 7.0) == []
    win = page.winners(runs, [], reg, eq).iloc[0]
    assert (win["overloaded"], win["answer"], win["runner_up"]) == ("S2", "S1", "S0")
    assert (win["level"], win["load"], win["leader"]) == ("r16", "l80", "S0")
    assert win["ranking"] == "S1 > S0"  # S2 not ranked
    reg["m"]["ttft_bound_s"] = 1.5  # only S0 within: named alone; 0.5 s: none
    assert page.winners(runs, [], reg, eq).iloc[0]["answer"] == "S0 (alone within the bound)"
    reg["m"]["ttft_bound_s"] = 0.5
    assert page.winners(runs, [], reg, eq).iloc[0]["answer"] == "overloaded (every organization)"


def test_seeds_for_holm_by_hand():
    # 10 tests: Holm's first step needs p <= 0.05 / 10 = 0.005; 2 / 2^9 = 0.0039 passes,
    # 2 / 2^8 = 0.0078 does not
    assert models_plan.seeds_for_holm(10) == 9
    assert 2 / 2**9 <= 0.05 / 10 < 2 / 2**8
    assert models_plan.seeds_for_holm(20) == 10  # two loads
    assert models_plan.seeds_for_holm(60) == 12  # every pair: 15 x 4 tests
    assert len(range(*regime.TEST_SEEDS)) == 9


def test_d0_split_is_chosen_on_the_selection_seeds_only():
    test_seeds = set(range(*regime.TEST_SEEDS))
    assert not test_seeds & set(regime.SPLIT_SEEDS)
    split = yaml.safe_load((REPO / "conf" / "campaign" / "models_split.yaml").read_text())
    assert str(split["hydra"]["sweeper"]["params"]["seed"]) == "43000,43001"
    runs = [{"seed": s, "d0_attention_fraction": f, "throughput_span": v}
            for s, f, v in ((43000, 0.5, 100.0), (43001, 0.5, 102.0), (43000, 0.7, 101.0),
                            (43001, 0.7, 103.0), (42000, 0.5, 500.0), (42001, 0.9, 900.0))]
    best, means = regime.choose_split(runs)
    assert best == 0.7 and means == {"0.5": 101.0, "0.7": 102.0}  # test-seed runs ignored
    # equal means: the fraction nearest an even split
    tie = [{"seed": s, "d0_attention_fraction": f, "throughput_span": 1.0}
           for f in (0.3, 0.6, 0.9) for s in regime.SPLIT_SEEDS]
    assert regime.choose_split(tie)[0] == 0.6
    # a fraction whose run failed on a selection seed (only one complete) is not chosen
    assert regime.choose_split(runs[:3])[0] == 0.5
    with pytest.raises(ValueError, match="selection seeds"):
        regime.choose_split(runs[-2:])


def test_tost_calls_ties_within_the_margin():
    eq = prereg.load_plan("models").raw["equivalence"]
    assert (eq["method"], eq["margin_pct"]) == ("tost", 1.0)
    close = [math.log(1.002), math.log(1.001), math.log(1.003)]
    assert page.tost(close, 1.0, 0.05)[0]
    assert not page.tost([math.log(1.03), math.log(1.02), math.log(1.04)], 1.0, 0.05)[0]
    assert not page.tost([math.log(1.002), math.log(0.99), math.log(1.015)], 1.0, 0.05)[0]
    runs = pd.DataFrame({
        "stage": "main", "model": "m", "budget": "64MiB", "rate": 2.0,
        "seed": [1, 1, 1, 2, 2, 2, 3, 3, 3], "org": ["S0", "S1", "S2"] * 3,
        "ttft_p99": 1.0,
        "throughput_span": [100.0, 120.0, 120.1, 100.0, 130.0, 130.2, 100.0, 125.0, 125.1]})
    reg = {"m": {"ceiling": {"tokens_s": 200.0}, "budgets": {"r16": 64},
                 "rates": {"r16": {"l60": 2.0}}}}
    win = page.winners(runs, [], reg, eq)
    assert list(win["answer"]) == ["tie: S2=S1"] and list(win["runner_up"]) == ["S1"]
    assert win["best_of_ceiling_pct"].iloc[0] == pytest.approx(100 * (120.1 + 130.2 + 125.1)
                                                               / 3 / 200)
    apart = runs.assign(throughput_span=[100.0, 120.0, 110.0, 100.0, 130.0, 118.0,
                                         100.0, 125.0, 113.0])
    assert list(page.winners(apart, [], reg, eq)["answer"]) == ["S1"]
    # seedwise S2/S1: +0.8, -1.5, +1.6 %: the 90 % interval spans 0 and the margin
    noisy = runs.assign(throughput_span=[100.0, 120.0, 121.0, 100.0, 130.0, 128.0,
                                         100.0, 125.0, 127.0])
    assert list(page.winners(noisy, [], reg, eq)["answer"]) == ["S2 (undecided)"]


def test_plan_tests_each_organization_against_its_budget_leader_on_enough_seeds():
    plan = prereg.load_plan("models")
    assert [f.name for f in plan.families] == list(regime.MODELS)
    assert plan.primary_family.name == "falcon_h1_7b"
    assert plan.raw["overload"]["factor"] == regime.TTFT_BOUND_FACTOR
    for fam in plan.families:
        assert len(fam.cells) == 6 * 2
        assert len(fam.tests) == 5 * 2  # every other organization against the leader
        assert len(fam.seeds) >= models_plan.seeds_for_holm(len(fam.tests))
        assert {c.keys["org"] for c in fam.cells} == {"S0", "S1", "S2", "D0", "N0", "JENGA"}
        leaders = {lv: c["org"] for lv, c in REGIME[fam.name]["capacity"].items()}
        controls = [t.cells["control"] for t in fam.tests]
        assert {c.split("_")[0] for c in controls if "_r16_" in c} == {
            leaders["r16"]}


def test_capacity_table_counts_mean_requests_in_bytes():
    cap = page.capacity_table({"jamba_v0_1": REGIME["jamba_v0_1"]})
    row = cap[(cap["org"] == "S0") & (cap["level"] == "r16")].iloc[0]
    # Jamba's storage scope is 1 of 4 groups; S0's page holds a group's composite,
    # 2,179,072 B (> 512 tokens x 4,096 B of the group's KV): 4 pages per whole-model
    # checkpoint, no padding; per token 4 x 2,179,072 / 512 against 16,384 raw (S0's pages
    # are uniform: 16 requests cost 16 x theirs)
    assert row["bytes_per_checkpoint"] == 4 * 2_179_072 == 8_716_288
    assert row["token_padding_pct"] == pytest.approx(100 * (4 * 2_179_072 / 512 / 16_384 - 1))
    assert round(row["token_padding_pct"], 1) == 3.9
    mib = REGIME["jamba_v0_1"]["budgets"]["r16"]
    # mean request: 8 blocks of 512 tokens (4 S0 pages of the group each? one page per block
    # per group) and one checkpoint (one page per group): 9 pages of 2,179,072 B per group
    assert row["requests_fit"] == (mib * 2**20 // 4) // (9 * 2_179_072)
    assert set(cap["org"]) == {"S0", "S1", "S2", "D0", "N0", "JENGA"}
    assert (cap["requests_fit"] > 0).all()


def _page_assertions(con, models) -> None:
    result = page.analyze(con)
    win = result.tables()["winners"]
    assert set(win["model"]) == set(models)
    assert win["answer"].str.len().gt(0).all()
    assert win["best_of_ceiling_pct"].notna().all()
    assert "fraction" not in result.markdown() or True
    assert "The reason in bytes" in result.markdown()


def test_smoke_ledger_of_one_cell_group_and_its_page(tmp_path):
    """One budget and load of Jamba v0.1 (on its H200), every organization, the smoke seeds,
    run in process (tests/analysis_ledgers.py) on a short synthetic workload: the page names
    an answer per cell from the plan's smoke family."""
    from analysis_ledgers import Part, build

    cells = tuple(f"{o}_r16_l80" for o in ("S0", "S1", "S2", "D0", "N0", "JENGA"))
    build(tmp_path, (Part("models", "jamba_v0_1", "smoke", cells=cells),))
    _page_assertions(ledgers.connect(tmp_path), ["jamba_v0_1"])


@pytest.mark.slow  # the whole smoke campaign, hundreds of forked runs
def test_make_campaign_models_smoke_and_its_page(tmp_path):
    root = tmp_path / "ledgers"
    proc = subprocess.run(["make", "--no-print-directory", "campaign", "C=models", "SMOKE=1",
                           f"LEDGER_ROOT={root}", f"ARGS=hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _page_assertions(ledgers.connect(root), regime.MODELS)


def test_smoke_campaign_plans_exactly_the_smoke_familys_cells():
    """`make campaign C=models SMOKE=1` plans its runs under models_smoke, and they are the
    runs the plan's smoke family needs (one model's two blocks here, as the whole campaign
    plans each block alike: the family accepted, every run used)."""
    from test_campaign_plans import as_planned, frame

    from analysis.inference.families import smoke_plan
    from experiments.campaigns import campaign as camp

    runs = camp.plan_campaign(["campaign=models", "hydra.sweeper.smoke=true",
                               "hydra.sweeper.only=[jamba_v0_1_r16,jamba_v0_1_r32]",
                               "ledger_root=/nonexistent/ledgers"])[1]
    assert len(runs) == 2 * 1 * 6 * 3  # budgets x loads x orgs x smoke seeds
    assert {r.key.campaign for r in runs} == {"models_smoke"}
    plan = smoke_plan(prereg.load_plan("models"), {"models_smoke"})
    assert [f.name for f in plan.families] == [f"{m} (smoke)" for m in regime.MODELS]
    fam = next(f for f in plan.families if f.name == "jamba_v0_1 (smoke)")
    check = prereg.check_family(plan, fam, frame(as_planned(runs)))
    assert check.accepted, check.reasons()[:3]
    assert set(check.runs.run_id) == {r.key.run_id for r in runs}


ALTS = {"slab_dense": {"overrides": ["engine.slab_policy=dense"]},
        "identified_a": {"overrides": ["executor.memory_efficiency=0.5",
                                       "executor.name=a100-identified-a"],
                         "by_org": {"s2": ["engine.slab_policy=dense"]}},
        "identified_b": {"overrides": ["executor.memory_efficiency=0.5",
                                       "executor.name=a100-identified-b"],
                         "by_org": {"s2": ["engine.slab_policy=refill"]}}}


def test_sensitivity_runs_share_what_they_would_repeat():
    spec = models_sens.sensitivity_spec(ALTS, ("s0", "s2"), ("falcon_h1_7b",))
    # slab_dense: only S2 has a rule of its own; S0 is the test runs
    assert spec["slab_dense"]["runs"] == {"S2": ["engine.slab_policy=dense"]}
    assert spec["slab_dense"]["borrows"] == {"S0": "default"}
    assert spec["slab_dense"]["executor_suffix"] is None
    # identified_b has identified_a's constants: S0's runs are identified_a's
    assert spec["identified_a"]["runs"] == {"S0": [], "S2": ["engine.slab_policy=dense"]}
    assert spec["identified_b"]["runs"] == {"S2": ["engine.slab_policy=refill"]}
    assert spec["identified_b"]["borrows"] == {"S0": "identified_a"}
    reg = {"m": {"device_name": "dev", "rates": {"r16": {"l80": 3.0}}}}
    blocks = models_sens.sensitivity_blocks(
        reg, {"m_r16": {"model": "m", "budget": "8MiB", "load.rate": "1.0,3.0"}}, "l80",
        ALTS, spec)
    assert blocks["m_r16_identified_b_0"] == {
        "model": "m", "budget": "8MiB", "load.rate": 3.0, "org": "s2",
        "engine.slab_policy": "refill", "++executor.memory_efficiency": "0.5",
        "executor.name": "dev-identified_b"}
    assert blocks["m_r16_slab_dense_0"]["org"] == "s2"
    assert sorted(blocks) == ["m_r16_identified_a_0", "m_r16_identified_a_1",
                              "m_r16_identified_b_0", "m_r16_slab_dense_0"]
    # the page tells the runs apart and assembles each alternative's cell
    dense = '{"slab_policy": "dense"}'
    sens = pd.DataFrame({
        "org": ["S2", "S0", "S2", "S2"], "model": "m", "budget": "8MiB", "rate": 3.0,
        "seed": 1, "engine_config": [dense, '{"slab_policy": "write_once"}', dense,
                                     '{"slab_policy": "refill"}'],
        "executor": ["sim:dev", "sim:dev-identified_a", "sim:dev-identified_a",
                     "sim:dev-identified_b"]})
    assert list(page_sens.classify(sens, spec)) == ["slab_dense", "identified_a",
                                                    "identified_a", "identified_b"]
    sens["alternative"] = page_sens.classify(sens, spec)
    test = sens.iloc[:2].assign(executor="sim:dev", engine_config="{}")
    got = page_sens.alternative_runs(test, sens, spec, "identified_b")
    assert sorted(zip(got["org"], got["executor"], strict=True)) == [
        ("S0", "sim:dev-identified_a"),
        ("S2", "sim:dev-identified_b")]


def test_a_winner_is_named_only_when_the_declared_holm_test_agrees():
    from types import SimpleNamespace

    eq = {"margin_pct": 1.0, "alpha": 0.05}
    runs = pd.DataFrame({
        "stage": "main", "model": "m", "budget": "64MiB", "rate": 2.0, "ttft_p99": 1.0,
        "seed": [1, 1, 2, 2, 3, 3], "org": ["S0", "S1"] * 3,
        "throughput_span": [100.0, 110.0, 100.0, 112.0, 100.0, 111.0]})
    reg = {"m": {"ceiling": {"tokens_s": 200.0}, "budgets": {"r16": 64},
                 "rates": {"r16": {"l80": 2.0}}, "capacity": {"r16": {"org": "S0"}}}}

    def family(p_holm):
        table = pd.DataFrame({"test": ["S1_vs_S0_r16_l80"], "p_holm": [p_holm]})
        return [SimpleNamespace(name="m", tables={"throughput_span": table})]

    # S1 over the leader S0 on every seed: named when Holm passes, undecided when not
    assert page.winners(runs, family(0.25), reg, eq).iloc[0]["answer"] == "S1 (undecided)"
    win = page.winners(runs, family(0.01), reg, eq).iloc[0]
    assert (win["answer"], win["p_holm"], win["holm_below_alpha"]) == ("S1", 0.01, True)
