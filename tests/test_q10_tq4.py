"""Q10 (TQ4) page: the side-by-side table, the ranking, and cell labels that keep codecs apart.

The tables below are typed by hand; the page must copy each codec's numbers into its own
columns and pair the codec interaction with its contrast by test id.
"""

from __future__ import annotations

import math

import pandas as pd

from analysis.inference import prereg
from analysis.inference.families import FamilyResult
from analysis.pages import common
from analysis.questions import q10_tq4


def _family(name: str, rows: list[dict]) -> FamilyResult:
    fam = FamilyResult("Q10", name, "secondary", "sign_flip_holm", "", True, [])
    columns = {"label": "", "unit": "%", "n": 12, "min_seed": -1.0, "max_seed": 1.0,
               "n_pos": 6, "n_neg": 6, "p_exact": 0.5, "p_holm": 1.0}
    fam.tables = {"throughput_span": pd.DataFrame([{**columns, **r} for r in rows])}
    return fam


def test_side_by_side_pairs_codecs_and_interactions_by_test():
    bf16 = _family("bf16_contrasts", [
        {"test": "S1_vs_S0_b63", "label": "EXT-22 row 1", "effect": 59.3, "p_holm": 0.005},
        {"test": "D0_vs_S2_b108_minus_b63", "label": "EXT-22 row 10", "unit": "pp",
         "effect": -6.3}])
    tq4 = _family("tq4_contrasts", [
        {"test": "D0_vs_S2_b108_minus_b63", "label": "EXT-22 row 10", "unit": "pp",
         "effect": 15.6, "n": 11},
        {"test": "S1_vs_S0_b63", "label": "EXT-22 row 1", "effect": 135.5, "p_holm": 0.01}])
    inter = _family("codec_interactions", [
        {"test": "S1_vs_S0_b63_tq4_minus_bf16", "unit": "pp", "effect": 76.1,
         "p_exact": 0.0005, "p_holm": 0.004}])
    table = q10_tq4.side_by_side([bf16, tq4, inter])
    assert list(table["test"]) == ["S1_vs_S0_b63", "D0_vs_S2_b108_minus_b63"]
    first, second = table.iloc[0], table.iloc[1]
    assert (first["bf16_effect"], first["tq4_effect"]) == (59.3, 135.5)
    assert (first["bf16_p_holm"], first["tq4_p_holm"]) == (0.005, 0.01)
    assert (first["codec_pp"], first["codec_p_holm"]) == (76.1, 0.004)
    assert first["sign_kept"] == "yes"
    assert second["sign_kept"] == "NO" and math.isnan(second["codec_pp"])
    assert second["n"] == 11  # the smaller of the two codecs' paired seeds


def test_side_by_side_is_empty_without_both_codecs():
    only = _family("tq4_contrasts", [{"test": "S1_vs_S0_b63", "effect": 1.0}])
    assert q10_tq4.side_by_side([only]).empty


def test_ranking_orders_organizations_by_mean_throughput():
    cells = pd.DataFrame({"stage": "main", "budget": "b63",
                          "kv_codec": ["bf16"] * 3 + ["tq4"] * 3,
                          "org": ["S0", "S1", "S2"] * 2,
                          "throughput_span": [285.0, 455.0, 482.0, 292.0, 689.0, 681.0]})
    out = q10_tq4.ranking(cells)
    assert list(out["ranking"]) == ["S2 > S1 > S0", "S1 > S2 > S0"]
    assert list(out["best_tokens_s"]) == [482.0, 689.0]


def test_cell_labels_keep_two_models_with_the_same_units_apart():
    # S0 gets the same pages under bf16 and TQ4 KV; only the model tells the runs apart.
    base = {"stage": "main", "org": "S0", "budget": "b63", "cap": 63, "rate": 3.0,
            "arrival": "poisson", "q": 1.0, "f": 0.0, "reuse": "share", "retention_k": -1,
            "pinning_k": 2, "d0_attention_fraction": math.nan, "trace": False,
            "host_tier_bytes": -1, "executor": "sim:a100-calibrated",
            "units_detail": '{"shared": 63}'}
    runs = pd.DataFrame([{**base, "model": "falcon_h1_7b"},
                         {**base, "model": "falcon_h1_7b_tq4"}])
    labels = common.cell_labels(runs)
    assert labels.nunique() == 2
    assert labels.iloc[1].endswith("falcon_h1_7b_tq4")


def test_plan_is_exploratory_and_pairs_every_cell_with_its_codec():
    plan = prereg.load_plan("q10_tq4")
    assert plan.raw["exploratory"] is True
    assert "EXPLORATORY" in plan.raw["families"][0]["description"]
    names = [f.name for f in plan.families]
    assert names == ["tq4_contrasts", "bf16_contrasts", "codec_interactions", "codec_effect"]
    tq4, bf16 = plan.family("tq4_contrasts"), plan.family("bf16_contrasts")
    assert [t.id for t in tq4.tests] == [t.id for t in bf16.tests]
    assert {c.keys["model"] for c in tq4.cells} == {"falcon_h1_7b_tq4"}
    assert {c.keys["model"] for c in bf16.cells} == {"falcon_h1_7b"}
    assert {c.keys["campaign"] for c in bf16.cells} == {"q1", "q4"}
    assert len(plan.family("codec_interactions").tests) == 9


def test_side_by_side_falls_back_to_the_smoke_families():
    smoke = [_family(f"{name} (smoke)", [{"test": "S1_vs_S0_b63", "effect": e, "n": 3}])
             for name, e in (("bf16_contrasts", 62.2), ("tq4_contrasts", 97.5))]
    table = q10_tq4.side_by_side(smoke)
    assert (table.loc[0, "bf16_effect"], table.loc[0, "tq4_effect"], table.loc[0, "n"]) == (
        62.2, 97.5, 3)
