"""The Q6 admission-development stage (issue 20, section 6).

Design: docs/paper_design.md sections 3.4, 5.8, A5.

The selection rule is checked on synthetic run means whose answer is worked out by hand;
`derive_plan` with the paper's values must rebuild the YAML's Q6-17 family exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from test_paper_families import runs_for

from analysis.inference import prereg
from analysis.inference.families import evaluate_family
from analysis.questions import development


def dev_runs(means: dict, ext: dict | None = None) -> pd.DataFrame:
    """One run per planned (cell, seed) of the development plan; a run's throughput is the
    cell's mean from `means` {(org, budget): {f: mean}} (or `ext` for the extension) plus a
    seed offset that averages to zero over the three seeds."""
    plan = prereg.load_plan("q6_development")
    rows = []
    for fam in plan.families:
        table = means if fam.name == "initial_search" else (ext or {})
        for cell in fam.cells:
            org, budget, f = cell.keys["org"], cell.keys["budget"], float(cell.keys["f"])
            mean = table.get((org, budget), {}).get(f, 500.0)
            for k, seed in enumerate(cell.seeds):
                rows.append({**cell.keys, "seed": seed, "throughput_span": mean + (k - 1) * 3.0})
    runs = pd.DataFrame(rows)
    runs["prereg_plan_hash"] = plan.plan_hash
    return runs.assign(status="complete", adopted=True, stage="main")


GRID = (0.0, 0.1, 0.19, 0.27, 0.35)


def test_selection_picks_the_smallest_f_within_one_percent_of_the_best():
    means = {("S2", "b63"): dict(zip(GRID, (900.0, 950.0, 995.0, 1000.0, 1004.0), strict=True)),
             ("D0", "b108"): dict(zip(GRID, (1000.0, 980.0, 970.0, 960.0, 950.0), strict=True))}
    # b83 extension baseline 1000 vs initial 500 (the default): beyond 5 %, not merged
    ext = {("S2", "b83"): {0.0: 1000.0, 0.35: 1020.0, 0.43: 1030.0, 0.5: 1025.0, 0.6: 990.0}}
    plan = prereg.load_plan("q6_development")
    table = development.select(plan, dev_runs(means, ext)).set_index(["org", "budget"])
    assert len(table) == 6
    s2 = table.loc[("S2", "b63")]
    # best 1004 at 0.35; 1 % floor 993.96: candidates 0.19 (995), 0.27, 0.35 -> smallest 0.19
    assert s2["best_f"] == 0.35 and s2["candidates"] == "0.19, 0.27, 0.35"
    assert s2["selected_f"] == 0.19 and s2["selected_mean"] == pytest.approx(995.0)
    assert table.loc[("D0", "b108"), "selected_f"] == 0.0  # monotone decreasing: f = 0
    flat = table.loc[("D0", "b63")]  # every f at 500: all candidates, the smallest is 0
    assert flat["selected_f"] == 0.0 and flat["candidates"] == "0, 0.1, 0.19, 0.27, 0.35"
    b83 = table.loc[("S2", "b83")]  # extension alone: best 1030 at .43, floor 1019.7
    assert b83["source"] == "b83_extension" and "not merged" in b83["note"]
    assert b83["candidates"] == "0.35, 0.43, 0.5" and b83["selected_f"] == 0.35
    assert table.loc[("D0", "b83"), "source"] == "initial_search"


def test_b83_curves_merge_when_the_baselines_agree_within_five_percent():
    means = {("S2", "b83"): {0.0: 1000.0, 0.1: 1010.0, 0.19: 1012.0, 0.27: 1032.0,
                             0.35: 1030.0}}
    ext = {("S2", "b83"): {0.0: 1020.0, 0.35: 1050.0, 0.43: 1040.0, 0.5: 1000.0, 0.6: 990.0}}
    plan = prereg.load_plan("q6_development")
    row = development.select(plan, dev_runs(means, ext)).set_index(["org", "budget"]).loc[
        ("S2", "b83")]
    assert "merged" in row["source"] and "+2.00 %" in row["note"]
    # merged means: f 0 -> 1010, .27 -> 1032, .35 -> 1040, .43 -> 1040; best 1040, floor
    # 1029.6: candidates .27, .35, .43 (the extension alone would give .35, .43 -> .35)
    assert row["best_mean"] == pytest.approx(1040.0)
    assert row["candidates"] == "0.27, 0.35, 0.43" and row["selected_f"] == 0.27


def test_an_incomplete_search_selects_nothing():
    plan = prereg.load_plan("q6_development")
    runs = dev_runs({})
    runs = runs[~((runs["org"] == "D0") & (runs["budget"] == "b63") & (runs["f"] == 0.1)
                  & (runs["seed"] == 76201))]
    table = development.select(plan, runs).set_index(["org", "budget"])
    assert math.isnan(table.loc[("D0", "b63"), "selected_f"])
    assert "make campaign C=q6_development" in table.loc[("D0", "b63"), "note"]
    assert development.as_preselected(table.reset_index()) is None
    assert not math.isnan(table.loc[("S2", "b63"), "selected_f"])


def test_selection_table_sets_the_choice_next_to_the_paper():
    plan = prereg.load_plan("q6_development")
    table = development.selection_table(development.select(plan, dev_runs({})),
                                        prereg.load_plan("q6").raw["preselected_f"])
    row = table.set_index(["org", "budget"]).loc[("S2", "b63")]
    assert row["paper_f"] == 0.27 and row["selected_f"] == 0.0 and not row["same_as_paper"]
    assert list(table.columns[:4]) == ["org", "budget", "paper_f", "selected_f"]


def test_derive_plan_with_the_paper_values_rebuilds_the_yaml_family():
    plan = prereg.load_plan("q6")
    assert plan.raw["preselected"] == "paper"
    derived = development.derive_plan(plan, plan.raw["preselected_f"])
    old, new = plan.primary_family, derived.primary_family
    keys = lambda fam, test: {r: dict(fam.cell(c).keys) for r, c in test.cells.items()}  # noqa: E731
    assert [t.id for t in new.tests] == [t.id for t in old.tests]
    for a, b in zip(old.tests, new.tests, strict=True):
        assert keys(old, a) == keys(new, b), a.id
        assert a.label == b.label and a.intervals == b.intervals
    assert derived.plan_hash == plan.plan_hash


def test_derive_plan_moves_the_preselected_cells_and_adds_new_f():
    plan = prereg.load_plan("q6")
    chosen = {"b63": {"D0": 0.1, "S2": 0.27}, "b83": {"D0": 0.1, "S2": 0.43},
              "b108": {"D0": 0.1, "S2": 0.0}}
    derived = development.derive_plan(plan, chosen)
    fam = derived.primary_family
    tests = {t.id: t for t in fam.tests}
    assert tests["ID_b63"].cells == {"treatment": "D0_b63_f10", "control": "D0_b63_f0"}
    assert "self-comparison" not in tests["ID_b63"].label
    assert tests["IS_b83"].cells == {"treatment": "S2_b83_f43", "control": "S2_b83_f0"}
    assert fam.cell("S2_b83_f43").keys["f"] == 0.43
    assert tests["PT_b108_minus_b63"].cells["b.treatment"] == "D0_b63_f10"
    assert tests["P0_b63"] == plan.primary_family.tests[0]
    rng = np.random.default_rng(4)
    noise = {(c.id, s): rng.normal(0, 0.03) for c in fam.cells for s in fam.seeds}
    runs = runs_for(derived, "Q6-17", lambda c, s: 700 * np.exp(noise[(c, s)]))
    result = evaluate_family(derived, fam, runs)
    assert result.accepted and result.m == 17
    runs = runs[runs["f"] != 0.43]  # the confirmation grid has no f = 0.43: refused
    assert not evaluate_family(derived, fam, runs).accepted
