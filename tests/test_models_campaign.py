"""The per-model campaign: its budgets follow its stated rule, `make campaign C=models SMOKE=1`
runs every cell, and the page names a winner per model and budget from the plan's families."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import yaml

import ledgers
from analysis.inference import prereg
from analysis.questions import models as page
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget

REPO = Path(__file__).resolve().parent.parent
CAMPAIGN = yaml.safe_load((REPO / "conf" / "campaign" / "models.yaml").read_text())
BLOCKS = CAMPAIGN["hydra"]["sweeper"]["blocks"]


def test_budgets_are_each_models_b63_and_b108_in_whole_mib():
    assert set(BLOCKS) == {"falcon_h1_7b", "granite_4_0_h_tiny", "granite_4_0_h_small",
                           "nemotron_h_8b", "qwen3_next_80b_a3b", "jamba_v0_1"}
    for name, block in BLOCKS.items():
        g = load_geometry(block["model"])
        expected = [f"{math.ceil(plan_budget(g, b).model_nominal_bytes / 2**20)}MiB"
                    for b in ("b63", "b108")]
        assert block["budget"].split(",") == expected, name
    # Falcon-H1-7B by hand: b63 = 63 pages x 1,568 tokens x 1,024 B x 44 layers
    assert 63 * 1_568 * 1_024 * 44 == 4_450_811_904
    assert BLOCKS["falcon_h1_7b"]["budget"].startswith(f"{math.ceil(4_450_811_904 / 2**20)}MiB")


def test_plan_has_one_family_per_model_with_every_pair_at_its_budgets():
    plan = prereg.load_plan("models")
    assert [f.name for f in plan.families] == list(BLOCKS)
    assert plan.primary_family.name == "falcon_h1_7b"
    for fam in plan.families:
        budgets = BLOCKS[fam.name]["budget"].split(",")
        assert len(fam.tests) == 6 * len(budgets) == 12
        assert {c.keys["budget"] for c in fam.cells} == set(budgets)
        assert {c.keys["model"] for c in fam.cells} == {fam.name}


def test_winners_name_ties_and_the_runner_up():
    import pandas as pd

    runs = pd.DataFrame({
        "stage": "main", "model": "m", "budget": "64MiB", "seed": [1, 1, 1, 2, 2, 2],
        "org": ["S0", "S1", "S2"] * 2,
        "throughput_span": [100.0, 120.0, 120.0, 100.0, 130.0, 130.0]})
    win = page.winners(runs, [])
    assert list(win["best"]) == ["S1=S2"] and list(win["runner_up"]) == ["S0"]
    # seedwise 100 (S1/S0 - 1): 20 % and 30 %, mean 25 %
    assert win["effect_pct"].iloc[0] == pytest.approx(25.0)
    assert win["model_bytes"].iloc[0] == 64 * 2**20
    flat = runs.assign(throughput_span=100.0)
    assert page.winners(flat, [])["decision"].iloc[0] == "all organizations tie"


def test_smoke_campaign_plans_exactly_the_smoke_families_cells():
    """`make campaign C=models SMOKE=1` plans 144 runs under models_smoke, and they are the
    runs the plan's smoke families need (each family accepted, every run used)."""
    from test_campaign_plans import frame

    from analysis.inference.families import smoke_plan
    from experiments.campaigns import campaign as camp

    runs = camp.plan_campaign(["campaign=models", "hydra.sweeper.smoke=true",
                               "ledger_root=/nonexistent/ledgers"])[1]
    assert len(runs) == 6 * 2 * 4 * 3  # models x budgets x organizations x smoke seeds
    assert {r.key.campaign for r in runs} == {"models_smoke"}
    assert all(r.cfg.workload.num_requests == CAMPAIGN["hydra"]["sweeper"]["smoke_requests"]
               for r in runs)
    plan = smoke_plan(prereg.load_plan("models"), {"models_smoke"})
    assert [f.name for f in plan.families] == [f"{m} (smoke)" for m in BLOCKS]
    used: set[str] = set()
    for fam in plan.families:
        check = prereg.check_family(plan, fam, frame(runs))
        assert check.accepted, (fam.name, check.reasons()[:3])
        used |= set(check.runs.run_id)
    assert used == {r.key.run_id for r in runs}


def _page_assertions(con) -> None:
    n = con.execute("SELECT count(*) FROM runs WHERE campaign = 'models_smoke' "
                    "AND status = 'complete'").fetchone()[0]
    assert n == 6 * 2 * 4 * 3  # models x budgets x organizations x smoke seeds
    result = page.analyze(con)
    win = result.tables()["winners"]
    assert len(win) == 12
    assert set(win["model"]) == set(BLOCKS)
    assert {fam.name for fam in result.families} == {f"{m} (smoke)" for m in BLOCKS}
    assert all(fam.accepted for fam in result.families)
    decided = win[win["runner_up"] != ""]
    assert decided["p_exact"].notna().all()
    assert decided["family"].str.contains("(", regex=False).all()
    assert "extrapolated" in result.markdown()


def test_smoke_ledger_of_every_cell_and_its_page(tmp_path):
    """Every smoke cell of the plan run in process (run_cell, written as experiments.run
    writes a run: tests/analysis_ledgers.py) on a short synthetic workload: the page names a
    winner per model and budget from the plan's smoke families."""
    from analysis_ledgers import Part, build

    build(tmp_path, tuple(Part("models", name, "smoke") for name in BLOCKS))
    _page_assertions(ledgers.connect(tmp_path))


@pytest.mark.slow  # 144 forked runs, ~100 CPU s
def test_make_campaign_models_smoke_and_its_page(tmp_path):
    """The whole `make campaign C=models SMOKE=1`. In the default suite: the campaign's smoke
    plan against the families (test_smoke_campaign_plans_exactly_the_smoke_families_cells), the
    page on an in-process ledger of every smoke cell (test_smoke_ledger_of_every_cell_and_its_page),
    and `make campaign SMOKE=1` end to end (tests/test_arms_campaign.py)."""
    root = tmp_path / "ledgers"
    proc = subprocess.run(["make", "--no-print-directory", "campaign", "C=models", "SMOKE=1",
                           f"LEDGER_ROOT={root}"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _page_assertions(ledgers.connect(root))
