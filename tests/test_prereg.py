"""Preregistration plans: declared counts, plan hash, and the ledger check."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis.inference import prereg

PLAN_DIR = Path(__file__).resolve().parent.parent / "conf" / "prereg"
QUESTIONS = [f"q{i}" for i in range(1, 10)]


def _raw(q: str) -> dict:
    return yaml.safe_load((PLAN_DIR / f"{q}.yaml").read_text())


def _raw_family(q: str, name: str) -> dict:
    return next(f for f in _raw(q)["families"] if f["name"] == name)


def _cell_keys(family: dict) -> dict[str, dict]:
    return {c["id"]: {**family.get("defaults", {}), **c} for c in family["cells"]}


def _complete_runs(plan: prereg.Plan, family: str) -> pd.DataFrame:
    """The family's runs, each stamped with the plan hash of the campaign that collects it."""
    runs = prereg.expected_runs(plan, family).drop(columns="cell_id")
    hashes = runs["campaign"].map(lambda c: prereg.load_plan(c).plan_hash)
    return runs.assign(prereg_plan_hash=hashes, status="complete", adopted=True)


# --- the declared plans -----------------------------------------------------------


@pytest.mark.parametrize("q", QUESTIONS)
def test_every_plan_loads_with_one_primary_family(q):
    plan = prereg.load_plan(q)
    assert plan.campaign == q and plan.question == q.upper()
    assert [f.role for f in plan.families].count("primary") == 1
    assert 0 < plan.alpha < 1
    for fam in plan.families:
        for cell in fam.cells:
            assert set(prereg.CELL_REQUIRED_KEYS) <= set(cell.keys)


@pytest.mark.parametrize("q", QUESTIONS)
def test_plan_hash_is_sha256_of_canonical_json(q):
    raw = _raw(q)
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert prereg.load_plan(q).plan_hash == hashlib.sha256(text.encode()).hexdigest()


def test_plan_hash_ignores_layout_but_not_content(tmp_path):
    raw = _raw("q9")
    reordered = dict(reversed(list(raw.items())))
    assert prereg.plan_hash(reordered) == prereg.plan_hash(raw)
    path = tmp_path / "q9.yaml"
    path.write_text("# a new comment\n" + yaml.safe_dump(raw, sort_keys=False, width=200))
    assert prereg.load_plan(path).plan_hash == prereg.load_plan("q9").plan_hash
    changed = copy.deepcopy(raw)
    changed["families"][0]["seeds"][-1] = 88007
    assert prereg.plan_hash(changed) != prereg.plan_hash(raw)


EXT22 = ["S1_vs_S0_b63", "S1_vs_S0_b83", "S1_vs_S0_b108", "S2_vs_S1_b63", "S2_vs_S1_b83",
         "S2_vs_S1_b108", "D0_vs_S2_b63", "D0_vs_S2_b83", "D0_vs_S2_b108",
         "D0_vs_S2_b108_minus_b63", "D0_vs_S2_b83_minus_b63",
         "D0_RM10_vs_default_b63", "D0_RM05_vs_default_b63", "D0_RP05_vs_default_b63",
         "D0_RP10_vs_default_b63", "D0_RM10_vs_default_b108", "D0_RM05_vs_default_b108",
         "D0_RP05_vs_default_b108", "D0_RP10_vs_default_b108",
         "S1_vs_S0_b83_q1_minus_q0", "S2_vs_S1_b83_q1_minus_q0", "D0_vs_S2_b83_q1_minus_q0"]


def test_ext22_membership_by_name_and_category():
    plan = prereg.load_plan("q1")
    fam = plan.primary_family
    assert fam.name == "EXT-22" and fam.decision["statistic"] == "log_ratio"
    assert [t.id for t in fam.tests] == EXT22
    assert [t.label for t in fam.tests] == [f"row {i}" for i in range(1, 23)]
    keys = {c.id: c.keys for c in fam.cells}

    def of(test, role):
        return keys[test.cells[role]]

    for test in fam.tests[11:19]:  # split rows: D0 at r against D0 at 0.527383, same budget
        t, c = of(test, "treatment"), of(test, "control")
        assert (t["org"], c["org"], c["d0_attention_fraction"]) == ("D0", "D0", 0.527383)
        assert t["campaign"] == "d0_split" and c["campaign"] == "q4"
    fractions = sorted({of(t, "treatment")["d0_attention_fraction"] for t in fam.tests[11:19]})
    assert fractions == [0.427383, 0.477383, 0.577383, 0.627383]
    for test in fam.tests[19:]:  # sharing endpoints at b83: q = 1 (Q1/Q4) minus q = 0 (Q3)
        assert of(test, "a.treatment")["q"] == 1.0 and of(test, "b.treatment")["q"] == 0.0
        assert of(test, "b.control")["campaign"] == "q3"
    assert {c.keys["cap"] for c in fam.cells} == {63}
    assert {c.keys["pinning_k"] for c in fam.cells} == {2}
    assert fam.seeds == tuple(range(42000, 42012))
    assert fam.primary_estimand.metric == "throughput_span"


Q6_17 = ["P0_b63", "P19_b63", "PT_b63", "ID_b63", "IS_b63", "P0_b83", "P19_b83", "PT_b83",
         "ID_b83", "IS_b83", "P0_b108", "P19_b108", "PT_b108", "ID_b108", "IS_b108",
         "PT_b108_minus_b63", "P19_b108_minus_b63"]


def test_q6_17_membership_preselected_f_and_self_comparisons():
    plan = prereg.load_plan("q6")
    fam = plan.primary_family
    assert fam.name == "Q6-17" and [t.id for t in fam.tests] == Q6_17
    assert fam.seeds == tuple(range(76400, 76412))
    keys = {c.id: c.keys for c in fam.cells}
    chosen = {}
    for test in fam.tests:
        if test.id.startswith("PT_b") and "minus" not in test.id:
            t, c = keys[test.cells["treatment"]], keys[test.cells["control"]]
            chosen[t["budget"]] = (t["f"], c["f"])
    assert chosen == {"b63": (0.0, 0.27), "b83": (0.10, 0.35), "b108": (0.10, 0.0)}
    selves = [t.id for t in fam.tests if t.kind == "paired"
              and t.cells["treatment"] == t.cells["control"]]
    assert selves == ["ID_b63", "IS_b108"]
    assert fam.decision["bootstrap"] == {"resamples": 10000, "seed": 76400}
    assert {c.keys["pinning_k"] for c in fam.cells} == {1}


def test_orig5_and_pin2_membership():
    fam = prereg.load_plan("orig5").primary_family
    assert fam.name == "ORIG-5" and fam.decision["statistic"] == "relative_pct"
    assert fam.decision["first_look_seeds"] == list(range(6))
    assert [t.label for t in fam.tests] == ["#1", "#2", "#3", "#4", "#5"]
    comparators = [fam.cell(t.cells["control"]).keys["org"] for t in fam.tests]
    assert comparators == ["S2", "S2", "S2", "S2", "S0"]
    seeds = [len(fam.cell(t.cells["treatment"]).seeds) for t in fam.tests]
    assert seeds == [6, 9, 9, 9, 9]
    conditions = [(c.keys["budget"], c.keys["rate"], c.keys["cap"], c.keys["arrival"])
                  for c in (fam.cell(t.cells["treatment"]) for t in fam.tests)]
    assert conditions == [("b63", 3.0, 63, "poisson"), ("b108", 4.5, 109, "poisson"),
                          ("b63", 1.7, 8, "poisson"), ("b63", 1.7, 63, "onoff"),
                          ("b160", 8.0, 136, "poisson")]
    pin = prereg.load_plan("pinning").primary_family
    assert pin.name == "PIN-2" and [t.id for t in pin.tests] == ["gap_A_R0_to_R2",
                                                                 "gap_B_R0_to_R2"]
    ks = {(pin.cell(t.cells["a.treatment"]).keys["pinning_k"],
           pin.cell(t.cells["b.treatment"]).keys["pinning_k"]) for t in pin.tests}
    assert ks == {(1, 3)} and pin.decision["sensitivity_statistic"] == "log_ratio"


def test_q9_k_ret_is_primary_on_fresh_seeds():
    plan = prereg.load_plan("q9")
    fam = plan.primary_family
    assert fam.seeds == tuple(range(88001, 88007))
    assert fam.primary_estimand.metric == "throughput_ledger"
    (k_ret,) = fam.tests
    assert (k_ret.id, k_ret.kind, k_ret.predicted) == ("K_ret", "interaction", "positive")
    keys = {role: fam.cell(c).keys for role, c in k_ret.cells.items()}
    assert (keys["a.treatment"]["org"], keys["a.treatment"]["reuse"]) == ("S2_RETENTION", "share")
    assert (keys["b.control"]["org"], keys["b.control"]["reuse"]) == ("S2", "isolate")
    assert fam.decision["method"] == "paired_t_interval" and fam.decision["confidence"] == 0.95


@pytest.mark.parametrize(
    ("q", "seeds"),
    [("q1", range(42000, 42012)), ("q7", range(76600, 76603)), ("q8", range(79010, 79013))],
)
def test_primary_seeds_follow_the_campaign_map(q, seeds):
    assert prereg.load_plan(q).primary_family.seeds == tuple(seeds)


def test_expected_runs_lists_cells_times_seeds():
    runs = prereg.expected_runs(prereg.load_plan("q1"), "EXT-22")
    assert len(runs) == 24 * 12
    assert runs.groupby("cell_id").seed.nunique().eq(12).all()
    assert set(runs.campaign) == {"q1", "q3", "q4", "d0_split"}


# --- checking runs against a plan ---------------------------------------------------


def test_complete_runs_are_accepted():
    plan = prereg.load_plan("q9")
    check = prereg.check_family(plan, "k_ret", _complete_runs(plan, "k_ret"))
    assert check.accepted and not check.plan_changed and check.reasons() == []
    assert len(check.runs) == 24 and set(check.runs.cell_id) == {
        "S2_share", "Ret_share", "S2_isolate", "Ret_isolate"}


def test_missing_seed_is_named_and_family_refused():
    plan = prereg.load_plan("q9")
    runs = _complete_runs(plan, "k_ret")
    runs = runs[~((runs.seed == 88004) & (runs.org == "S2_RETENTION") & (runs.reuse == "isolate"))]
    check = prereg.check_family(plan, "k_ret", runs)
    assert not check.accepted
    assert [(m.cell_id, m.seeds) for m in check.missing] == [("Ret_isolate", (88004,))]
    (reason,) = check.reasons()
    assert re.search(r"missing runs: Ret_isolate .*seeds \[88004\]", reason)


def test_reruns_failures_and_duplicates():
    plan = prereg.load_plan("q9")
    runs = _complete_runs(plan, "k_ret")
    rerun = runs.head(2).assign(adopted=False)
    failed = runs.head(2).assign(status="failed")
    assert prereg.check_family(plan, "k_ret", pd.concat([runs, rerun, failed])).accepted
    dup = prereg.check_family(plan, "k_ret", pd.concat([runs, runs.head(1)]))
    assert not dup.accepted
    assert [(d.cell_id, d.seed, d.count) for d in dup.duplicated] == [("S2_share", 88001, 2)]
    only_failed = runs.assign(status=["failed"] + ["complete"] * (len(runs) - 1))
    assert prereg.check_family(plan, "k_ret", only_failed).missing[0].seeds == (88001,)


def test_changed_plan_refused_unless_allowed():
    plan = prereg.load_plan("q9")
    runs = _complete_runs(plan, "k_ret")
    runs.loc[runs.index[:3], "prereg_plan_hash"] = "0" * 64
    check = prereg.check_family(plan, "k_ret", runs)
    assert not check.accepted and check.plan_changed
    assert [(c.campaign, c.run_hash, c.num_runs) for c in check.changed] == [("q9", "0" * 64, 3)]
    assert any(r.startswith("plan changed after collection (refused)")
               for r in check.reasons())
    allowed = prereg.check_family(plan, "k_ret", runs, allow_changed_plan=True)
    assert allowed.accepted and allowed.plan_changed
    assert any("allow_changed_plan" in r for r in allowed.reasons())


def test_reused_runs_are_checked_against_their_own_campaign_plan():
    q1, q3 = prereg.load_plan("q1"), prereg.load_plan("q3")
    runs = _complete_runs(q3, "sharing_levels")
    assert set(runs.campaign) == {"q1", "q3", "q4"}
    assert prereg.check_family(q3, "sharing_levels", runs).accepted
    stamped_q3 = runs.assign(prereg_plan_hash=q3.plan_hash)
    check = prereg.check_family(q3, "sharing_levels", stamped_q3)
    assert not check.accepted
    assert {c.campaign: c.expected_hash for c in check.changed}["q1"] == q1.plan_hash


def test_numeric_cell_values_match_across_types_and_splits_stay_apart():
    plan = prereg.load_plan("q1")
    runs = _complete_runs(plan, "EXT-22")
    runs["rate"] = runs["rate"].astype(int)  # 3 in the ledger, 3.0 in the plan
    check = prereg.check_family(plan, "EXT-22", runs)
    assert check.accepted
    assert check.runs.groupby("cell_id").size().eq(12).all()


def test_ledger_spellings_match_plan_values():
    plan = prereg.load_plan("q9")
    runs = _complete_runs(plan, "k_ret")
    runs["org"] = runs["org"].str.lower()  # the runs table writes s2 / s2_retention
    runs["reuse"] = runs["reuse"].str.upper()  # ... and SHARE / ISOLATE
    runs["budget"] = "254 pages"
    runs["retention_k"] = runs["retention_k"].fillna(-1).astype(int)  # -1: no retention
    check = prereg.check_family(plan, "k_ret", runs)
    assert check.accepted and len(check.runs) == 24
    unstamped = prereg.check_family(plan, "k_ret", runs.assign(prereg_plan_hash=""))
    assert [c.run_hash for c in unstamped.changed] == ["<none>"]


def test_empty_ledger_names_every_cell_and_schema_gaps_are_errors():
    plan = prereg.load_plan("q8")
    check = prereg.check_family(plan, "retention_depth", pd.DataFrame())
    assert {m.cell_id for m in check.missing} == {"S2", "S2_RETENTION"}
    assert all(m.seeds == (79010, 79011, 79012) for m in check.missing)
    runs = _complete_runs(plan, "retention_depth").drop(columns="trace")
    with pytest.raises(ValueError, match=r"missing columns \['trace'\]"):
        prereg.check_family(plan, "retention_depth", runs)


# --- plan validation -----------------------------------------------------------------


def _mutated(edit) -> dict:
    raw = _raw("q9")
    edit(raw)
    return raw


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda r: r["families"][0].update(role="main"), r"role='main'.*allowed values"),
        (lambda r: r["families"][1].update(role="primary"), "exactly one family"),
        (lambda r: r["families"][0]["tests"][0]["a"].update(treatment="nope"),
         r"a.treatment='nope' is not a cell"),
        (lambda r: r["families"][0]["cells"][0].update(seeds=[88001]), "must share their seeds"),
        (lambda r: r["families"][0]["cells"][0].update(reuse="shared"), r"reuse='shared'"),
        (lambda r: r["families"][0]["cells"][0].update(org="S3"), r"org='S3'"),
        (lambda r: r["families"][0].update(tests=[]), "tests may be empty only"),
        (lambda r: r["families"][0].update(seeds=[1, 1]), "duplicated values"),
        (lambda r: r["families"][0]["decision"].pop("confidence"),
         r"needs fields \['confidence'\]"),
        (lambda r: r.update(alpha=5), "alpha=5"),
    ],
)
def test_invalid_plans_are_rejected_by_field(edit, needle):
    with pytest.raises(ValueError, match=needle):
        prereg.parse_plan(_mutated(edit))


def test_yaml_boolean_keys_are_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    text = (PLAN_DIR / "q7.yaml").read_text().replace("probe_on:", "on:", 1)
    path.write_text(text)
    with pytest.raises(ValueError, match="keys must be strings"):
        prereg.load_plan(path)
