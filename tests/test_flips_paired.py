"""The flip column from runs: a contrast planted in the runs flips its sign under one
alternative, paired by seed with the page's own runs (the seeds complete in both), with the
cells the runner did not rerun (`as_default`) read from the page's runs."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis import flips
from analysis.inference import prereg
from analysis.inference.families import FamilyResult
from analysis.studies import sensitivity as sens

PLAN = """question: T
campaign: t
title: planted
alpha: 0.05
defaults: {model: falcon_h1_7b, executor: 'sim:a100-calibrated', budget: b63, cap: 63, rate: 3.0,
  arrival: poisson, q: 1.0, f: 0.0, reuse: share, pinning_k: 2, trace: false}
families:
- name: F
  role: primary
  description: planted
  seeds: [1, 2, 3, 4, 5, 6]
  cells:
  - {id: S2, org: S2}
  - {id: D0, org: D0, d0_attention_fraction: 0.5}
  - {id: JENGA, org: JENGA}
  estimands:
  - {name: throughput_span, metric: throughput_span, role: primary}
  decision: {method: sign_flip_holm, statistic: log_ratio, intervals: none, rule: planted}
  tests:
  - {id: D0_vs_S2, kind: paired, treatment: D0, control: S2, predicted: positive}
  - {id: JENGA_vs_D0, kind: paired, treatment: JENGA, control: D0, predicted: none}
"""
CELL = {"budget": "b63", "cap": 63, "rate": 3.0, "arrival": "poisson", "q": 1.0, "f": 0.0,
        "reuse": "share", "pinning_k": 2, "trace": False}
PAGE = {"S2": 100.0, "D0": 110.0, "JENGA": 105.0}  # D0 beats S2 by 10 % on the page
DENSE_S2 = 120.0  # under slab_dense S2 gains 20 %: D0 vs S2 turns negative


def _runs(campaign, plan_hash, values, seeds):
    return [{"run_id": f"{campaign}-{org}-{s}", "campaign": campaign, "question": "t",
             "prereg_plan_hash": plan_hash,
             "status": "complete", "adopted": True, "model": "falcon_h1_7b",
             "executor": "sim:a100-calibrated", "org": org, "seed": s, **CELL,
             "d0_attention_fraction": 0.5 if org == "D0" else float("nan"),
             "throughput_span": v * (1 + s / 1000)} for org, v in values.items() for s in seeds]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    plan_dir = tmp_path_factory.mktemp("plans")
    (plan_dir / "t.yaml").write_text(PLAN)
    plan_hash = prereg.load_plan("t", plan_dir).plan_hash
    other = _runs("sens_slab_dense", "", {"S2": 50.0}, [1])  # another family's rerun of a
    other[0]["run_id"] = "another-family"  # cell alike on the plan's keys: not this family's
    runs = pd.DataFrame(_runs("t", plan_hash, PAGE, range(1, 7))  # the page's own, 6 seeds
                        + _runs("sens_slab_dense", "", {"S2": DENSE_S2}, range(1, 5)) + other)
    record = pd.DataFrame(
        [{"alternative": "slab_dense", "family": "F", "cell": c, "seed": s, "run_id": "",
          "outcome": "as_default"} for c in ("D0", "JENGA") for s in range(1, 5)]
        + [{"alternative": "slab_dense", "family": "F", "cell": "S2", "seed": s,
            "run_id": f"sens_slab_dense-S2-{s}", "outcome": "ran"} for s in range(1, 5)])
    spec = {"families": [{"plan": "t", "family": "F"}],
            "alternatives": {"default": {"overrides": []},
                             "slab_dense": {"overrides": ["engine.slab_policy=dense"]}}}
    return plan_dir, runs, record, spec


def test_the_default_is_the_pages_own_runs_at_the_alternatives_seeds(planted):
    plan_dir, runs, record, spec = planted
    long, status = sens.evaluate(runs, spec, plan_dir, record)
    assert not long.empty, status
    by = long.set_index(["alternative", "test"])
    assert set(long["n"]) == {4}  # seeds 1-4 (seed 1 not taken for a duplicate), not 5-6
    assert by.loc[("default", "D0_vs_S2"), "effect"] == pytest.approx(10.0, abs=0.1)
    assert by.loc[("slab_dense", "D0_vs_S2"), "effect"] == pytest.approx(-8.33, abs=0.1)
    assert by.loc[("slab_dense", "JENGA_vs_D0"), "effect"] == pytest.approx(
        by.loc[("default", "JENGA_vs_D0"), "effect"])  # both cells read from the page's runs
    assert "the page's own runs" in status[("default", "F")]
    # without the record, D0 and JENGA have no runs under slab_dense: nothing compared
    assert sens.evaluate(runs, spec, plan_dir, None)[0].empty


def test_the_planted_flip_reads_depends_on_its_rule(planted, monkeypatch):
    plan_dir, runs, record, spec = planted
    monkeypatch.setattr(sens, "load_inputs", lambda con: (runs, record))
    table = pd.DataFrame({"test": ["D0_vs_S2", "JENGA_vs_D0"], "effect": [10.0, -4.5]})
    fam = FamilyResult("T", "F", "primary", "sign_flip_holm", "", True, [],
                       tables={"throughput_span": table}, primary="throughput_span")
    flips.add_flip_columns([fam], con=None, plan_dir=plan_dir, spec=spec)
    column = dict(zip(table["test"], table[flips.COLUMN], strict=True))
    size = " (n = 4 of the plan's 6 seeds: signs only)"  # seeds 5-6 not rerun
    assert column["D0_vs_S2"] == "depends on slab_dense (sign)" + size
    assert column["JENGA_vs_D0"] == "holds under all 1 alternatives" + size


@pytest.mark.slow  # ~3 s of CPU; the default suite holds pairing (planted runs) and as_default
def test_the_column_from_real_runs_at_the_smallest_size(tmp_path):
    """The runner and the column end to end: Q2's family (6 cells) at one seed and 10
    requests under `default` (the page's own runs, campaign q2_smoke) and slab_dense (its
    2 S2 cells rerun, the 4 S0/S1 cells read from the page's runs): 8 runs."""
    import ledgers
    from experiments.studies import sensitivity as runner

    root = tmp_path / "ledgers"
    assert runner.main(["--ledgers", str(root), "--smoke", "--alternatives",
                        "default,slab_dense", "--families", "anchors", "--seeds", "1",
                        "--requests", "10", "--quiet"]) == 0
    con = ledgers.connect(root)
    try:
        record = con.execute("SELECT alternative, campaign, outcome FROM sensitivity_runs").df()
        long = flips.alternative_effects(con, "q2", "anchors")
    finally:
        con.close()
    outcomes = record.groupby(["alternative", "campaign", "outcome"]).size().to_dict()
    assert outcomes == {("default", "q2_smoke", "ran"): 6,
                        ("slab_dense", "sens_slab_dense_smoke", "ran"): 2,
                        ("slab_dense", "sens_slab_dense_smoke", "as_default"): 4}
    assert set(long["alternative"]) == {"default", "slab_dense"} and set(long["n"]) == {1}
    texts = flips.flip_texts(long)
    assert texts and all(t.startswith(("holds under all 1", "depends on slab_dense"))
                         for t in texts.values())
