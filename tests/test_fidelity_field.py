"""The fidelity page's arithmetic (analysis/field_errors.py) on hand-made cells:
MAPE, Kendall's tau, pairwise order agreement per factor, cells paired across arms."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.field_errors import METRICS, cells, errors, order_agreement


def _runs(ref: list[float], sim: list[float]) -> pd.DataFrame:
    """Two budgets x two loads, one seed; every metric set to the given values."""
    keys = [("b63", 1.0), ("b63", 3.0), ("b108", 1.0), ("b108", 3.0)]
    rows = []
    for arm, values in (("ref", ref), ("sim", sim)):
        for (budget, rate), v in zip(keys, values, strict=True):
            rows.append({"arm": arm, "model": "m", "budget": budget, "rate": rate, "seed": 1,
                         **{m: v for m in METRICS}})
    return pd.DataFrame(rows)


def test_mape_tau_and_order_agreement():
    table = cells(_runs([100, 200, 300, 400], [110, 180, 300, 500]), ["budget", "rate"])
    assert len(table) == 4 and set(table["seeds_ref"]) == {1}
    err = errors(table).set_index("metric")
    assert err.loc["throughput_span", "mape_pct"] == pytest.approx((10 + 10 + 0 + 25) / 4)
    assert err.loc["throughput_span", "median_ape_pct"] == pytest.approx(10)
    assert err.loc["throughput_span", "max_ape_pct"] == pytest.approx(25)
    assert err.loc["throughput_span", "kendall_tau"] == pytest.approx(1.0)
    order = order_agreement(table, ["budget", "rate"]).set_index(["factor", "metric"])
    assert order.loc[("rate", "throughput_span"), ["pairs", "agree"]].tolist() == [2, 2]


def test_a_reversed_order_and_a_zero_reference():
    table = cells(_runs([0, 200, 300, 400], [0, 180, 450, 350]), ["budget", "rate"])
    err = errors(table).set_index("metric")
    assert err.loc["preemptions", "cells_with_ape"] == 4  # 0 vs 0 is no error
    assert err.loc["preemptions", "mape_pct"] == pytest.approx((0 + 10 + 50 + 12.5) / 4)
    order = order_agreement(table, ["budget", "rate"]).set_index(["factor", "metric"])
    # b108: 300 -> 400 (ref) but 450 -> 350 (sim): one of the two load pairs disagrees
    assert order.loc[("rate", "ttft_p50"), "agree"] == 1
    ref_zero = cells(_runs([0, 1, 2, 3], [5, 1, 2, 3]), ["budget", "rate"])
    assert errors(ref_zero).set_index("metric").loc["hit_tokens", "cells_with_ape"] == 3


def test_only_cells_both_arms_ran_are_compared():
    runs = _runs([1, 2, 3, 4], [1, 2, 3, 4])
    runs = runs[~((runs["arm"] == "sim") & (runs["budget"] == "b108"))]
    table = cells(runs, ["budget", "rate"])
    assert set(table["budget"]) == {"b63"}
    assert math.isnan(errors(table.iloc[:0]).loc[0, "mape_pct"])
