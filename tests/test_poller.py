"""The poller reads one scrape into poller-ledger rows, per server kind."""

from __future__ import annotations

import math

import pytest

from experiments.poller import parse_metrics

HSL_D0 = """\
# TYPE hsl:num_requests_running gauge
hsl:num_requests_running 3.0
hsl:num_requests_waiting 2.0
# TYPE hsl:num_preemptions counter
hsl:num_preemptions_total 7.0
hsl:prompt_tokens_total 12000.0
hsl:generation_tokens_total 345.0
hsl:prefix_cache_hit_tokens_total 4096.0
hsl:pool_units_used{pool="attention"} 100.0
hsl:pool_units_used{pool="recurrent"} 9.0
hsl:pool_units_cached{pool="attention"} 20.0
hsl:pool_units_cached{pool="recurrent"} 4.0
hsl:pool_units_free{pool="attention"} 80.0
hsl:pool_units_free{pool="recurrent"} 16.0
hsl:pool_units_total{pool="attention"} 200.0
hsl:pool_units_total{pool="recurrent"} 29.0
hsl:pool_usage_perc{pool="attention"} 0.5
hsl:pool_usage_perc{pool="recurrent"} 0.3103
"""

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 900.0
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
"""


def test_hsl_rows_per_pool():
    rows = {r["pool"]: r for r in parse_metrics(HSL_D0, "hsl")}
    assert set(rows) == {"attention", "recurrent"}
    rec = rows["recurrent"]
    assert (rec["units_used"], rec["units_cached"], rec["units_free"], rec["units_total"]) == (
        9, 4, 16, 29)
    assert rec["usage_frac"] == pytest.approx(0.3103)
    for row in rows.values():  # server-wide counters repeat on every pool's row
        assert (row["running"], row["waiting"], row["preemptions_total"]) == (3, 2, 7)
        assert (row["prompt_tokens_total"], row["generation_tokens_total"],
                row["prefix_hit_tokens_total"]) == (12000, 345, 4096)


def test_vllm_names_map_to_the_same_columns():
    (row,) = parse_metrics(VLLM, "vllm")
    assert row["pool"] == "shared"
    assert (row["running"], row["waiting"], row["preemptions_total"]) == (4, 1, 2)
    assert row["usage_frac"] == 0.25 and row["prefix_hit_tokens_total"] == 512
    assert row["units_total"] == -1  # vLLM exports no unit counts


def test_missing_metric_is_marked_not_invented():
    (row,) = parse_metrics("hsl:num_requests_running 1.0\n", "hsl")
    assert row["running"] == 1 and row["waiting"] == -1 and math.isnan(row["usage_frac"])
