"""make sensitivity: the primary families rerun under declared alternative engine rules, and
the sensitivity.md page (analysis.studies.sensitivity) that marks contrasts whose sign or decision
changes. The page's rules are checked in the default suite; the pipeline end to end (smoke
size, ~15 s of CPU, and the full design) runs with the slow tests (`make test-all`)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import ledgers
from analysis import report
from analysis.studies import sensitivity as page
from experiments.studies import sensitivity as sens

FAMILIES = "EXT-22,Q6-17"  # the end-to-end checks' families (22 + 17 primary contrasts)


def test_plan_cells_map_to_run_overrides():
    cells = {c["id"]: c for c in sens.family_cells("q1", "EXT-22")}
    assert len(cells) == 24
    d0 = sens.cell_overrides(cells["D0_b63_RM10"]["keys"])
    assert "org=d0" in d0 and "model.d0_attention_fraction=0.427383" in d0
    assert "engine.pinning_k=2" in d0 and "engine.cap=63" in d0 and "load.rate=3.0" in d0
    s1 = sens.cell_overrides(cells["S1_b83_q0"]["keys"])
    assert "workload.q=0.0" in s1 and not any("d0_attention" in o for o in s1)
    q6 = {c["id"]: c for c in sens.family_cells("q6", "Q6-17")}
    assert "engine.headroom=0.27" in sens.cell_overrides(q6["S2_b63_f27"]["keys"])
    with pytest.raises(ValueError, match="cell key 'colour'"):
        sens.cell_overrides({"colour": "red"})


def test_planned_jobs_cover_every_cell_seed_and_alternative():
    raw, alts = sens.load_alternatives()
    chosen = [alts["default"], alts["slab_dense"]]
    planned = sens.planned_jobs(chosen, raw["families"], smoke=True, seeds=2, requests=12)
    jobs = [j.overrides for j in planned]
    cells = sum(len(sens.family_cells(f["plan"], f["family"])) for f in raw["families"])
    assert cells > len(sens.family_cells("q1", "EXT-22")) + len(sens.family_cells("q6", "Q6-17"))
    assert len(jobs) == 2 * cells * 2
    dense = [j for j in jobs if "campaign_name=sens_slab_dense_smoke" in j]
    assert len(dense) == cells * 2 and all("engine.slab_policy=dense" in j for j in dense)
    assert all("question=sensitivity" in j for j in dense)
    assert all("workload.num_requests=12" in j for j in jobs)
    # the default's runs are the page's own: the cell's home campaign (smoke), its question
    default = [j for j in planned if j.alternative.name == "default"]
    arms = [j.overrides for j in default if j.family == "ARMS-9"]
    assert arms and all("campaign_name=arms_smoke" in j and "question=arms" in j for j in arms)
    q4 = {(j.campaign, next(o for o in j.overrides if o.startswith("question=")))
          for j in default if j.family == "four_orgs"}  # Q4 reads Q1's runs and its own
    assert q4 == {("q1_smoke", "question=q1"), ("q4_smoke", "question=q4")}
    bursts = {j.campaign for j in default if j.family == "burst_pattern"}  # [q5, bursts]
    assert bursts == {"q5_smoke", "bursts_smoke"}  # Q5's cells in q5, where Q5 runs them
    assert not any("question=sensitivity" in j.overrides for j in default)


def test_a_run_is_the_defaults_only_when_its_engine_and_executor_are():
    """A slab policy asks nothing of D0 (no slabs): its run is the page's own. An identified
    alternative's fitted step-model constants are not engine rules, yet change every run:
    D0 under it must run (it once was taken for the default's)."""
    from hydra import compose, initialize_config_dir

    _, alts = sens.load_alternatives()
    identified = next(n for n in alts if n.startswith("identified_"))
    with initialize_config_dir(version_base="1.3", config_dir=str(sens.ROOT / "conf")):
        def asks_default(org, alt):
            base = (f"org={org}", "budget=b63", "seed=1")
            cfg = compose(config_name="config", overrides=[
                *base, *alts[alt].for_org(org), "campaign_name=x", "question=sensitivity"])
            return sens._asks_default_rules(cfg, base)

        assert asks_default("d0", "slab_dense")
        assert not asks_default("s2", "slab_dense")
        assert not asks_default("d0", identified)


def test_robustness_marks_sign_and_decision_changes():
    long = pd.DataFrame([
        ("default", "F", "t1", 5.0, "reject H0 (positive)"),
        ("alt", "F", "t1", 4.0, "reject H0 (positive)"),
        ("default", "F", "t2", 2.0, "not rejected"),
        ("alt", "F", "t2", -1.0, "not rejected"),
        ("default", "F", "t3", 6.0, "reject H0 (positive)"),
        ("alt", "F", "t3", 1.0, "not rejected"),
        ("default", "F", "t4", 0.0, "not rejected"),  # identical runs: no sign to flip
        ("alt", "F", "t4", -0.4, "not rejected"),
    ], columns=["alternative", "family", "test", "effect", "decision"]).assign(
        label="", unit="%")
    table = page.robustness(long).set_index("contrast")
    assert table.loc["t1", "robust"] == "yes"
    assert table.loc["t2", "robust"] == "no" and table.loc["t2", "changes"] == "alt: sign"
    assert table.loc["t3", "changes"] == "alt: decision"
    assert page.CHANGED in table.loc["t3", "alt"] and page.CHANGED not in table.loc["t1", "alt"]
    assert table.loc["t4", "robust"] == "yes"


def test_bad_alternative_exits_2(tmp_path, capsys):
    assert sens.main(["--ledgers", str(tmp_path), "--alternatives", "default,magic"]) == 2
    assert "magic" in capsys.readouterr().err
    assert sens.main(["--ledgers", str(tmp_path), "--families", "ARMS-9,Q99"]) == 2
    err = capsys.readouterr().err
    assert "--families: unknown Q99; allowed values are EXT-22, Q6-17, ARMS-9" in err
    assert not any(tmp_path.iterdir())  # nothing written


def _check_page(root, out, alternatives):
    con = ledgers.connect(root)
    try:
        path, info = page.write_page(con, out)
    finally:
        con.close()
    text = path.read_text()
    assert info["contrasts"] == 22 + 17 and info["alternatives"] == alternatives
    assert "Robust and fragile conclusions" in text
    for alt in alternatives:
        assert f"`{alt}`" in text
    long = pd.read_csv(out / "tables" / "sensitivity_long.csv")
    assert set(long["alternative"]) == set(alternatives)
    assert long.groupby("alternative")["test"].nunique().eq(39).all()
    assert not long["effect"].map(lambda v: isinstance(v, float) and math.isnan(v)).all()
    return text


@pytest.mark.slow  # end to end: 80 runs through experiments.run, the page, the whole report
def test_sensitivity_at_smoke_size_writes_its_page_into_the_report(tmp_path):
    root, out = tmp_path / "ledgers", tmp_path / "report"
    """Two alternatives, Q1's and Q6's families, one seed and 12 requests per run (80 runs):
    the pipeline end to end."""
    assert sens.main(["--ledgers", str(root), "--smoke", "--alternatives",
                      "default,slab_dense", "--families", FAMILIES, "--seeds", "1",
                      "--requests", "12", "--quiet"]) == 0
    out.mkdir()
    text = _check_page(root, out, ["default", "slab_dense"])
    assert "Smoke size" in text and "no test can be rejected" in text
    summary = report.write_report(root, tmp_path / "full_report")
    assert (tmp_path / "full_report" / page.PAGE) in summary.pages
    assert page.PAGE in (tmp_path / "full_report" / "index.md").read_text()


@pytest.mark.slow
def test_sensitivity_at_full_size(tmp_path):
    """Every alternative at Q1's and Q6's full design (about 480 runs per alternative)."""
    root, out = tmp_path / "ledgers", tmp_path / "report"
    assert sens.main(["--ledgers", str(root), "--families", FAMILIES, "--quiet"]) == 0
    out.mkdir()
    _, alts = sens.load_alternatives()
    text = _check_page(root, out, list(alts))
    assert "Smoke size" not in text


def test_an_identified_alternative_is_read_under_its_own_executor_profile():
    """An identified combination runs on its fitted profile (executor.name=...), so its runs
    record `sim:<profile>`; the derived plan must look for them there, not under the plan's
    `sim:a100-calibrated` (they were reported as `no runs yet` while the runs were there)."""
    from analysis.inference import prereg

    alts = page.load_alternatives()["alternatives"]
    identified = [n for n in alts if n.startswith("identified_")]
    assert identified, "conf/calibration/identified.yaml names no combination"
    name = identified[0]
    overrides = alts[name]["overrides"]
    profile = next(o.split("=", 1)[1] for o in overrides if o.startswith("executor.name="))
    plan = prereg.load_plan("q1", prereg.PLAN_DIR)
    family = plan.families[0].name
    seeds = set(plan.families[0].seeds)
    derived = page.derived_plan(plan, family, "sens_x", seeds, overrides)
    assert {c.keys["executor"] for c in derived.families[0].cells} == {f"sim:{profile}"}
    plain = page.derived_plan(plan, family, "sens_x", seeds, alts["slab_dense"]["overrides"])
    assert {c.keys["executor"] for c in plain.families[0].cells} == {
        c.keys["executor"] for c in plan.families[0].cells}
    assert page.executor_of("torch:cpu", overrides) == "torch:cpu"  # only simulated cells move


def test_retention_host_tier_and_cell_seeds_map_to_run_overrides():
    """Q8/Q9's retention_k, the tier page's host_tier_bytes (-1: not applicable) and a
    cell's own seeds (read by family_cells) so every page's family can be rerun."""
    assert sens.cell_overrides({"org": "S2_RETENTION", "retention_k": 2, "seeds": [1]}) == [
        "org=s2_retention", "retention.k=2"]
    assert sens.cell_overrides({"org": "S2", "retention_k": -1, "host_tier_bytes": -1}) == [
        "org=s2", "host_tier.capacity_bytes=null"]
    assert sens.cell_overrides({"host_tier_bytes": 4294967296}) == [
        "host_tier.capacity_bytes=4294967296"]
