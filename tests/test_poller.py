"""The poller reads one scrape into poller-ledger rows, per server kind."""

from __future__ import annotations

import math
import os

import pytest

from experiments.runners.poller import parse_metrics, parse_rss
from ledgers.schemas import to_table
from serving_core.server.metrics import make_registry, render
from serving_core.server.request_stats import RequestStats

# Our server: vLLM's names where both export the same quantity, ours (hsl:) for the rest
HSL_D0 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
hsl:prompt_tokens_total 12000.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 16096.0
vllm:generation_tokens_total{engine="0",model_name="m"} 345.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4096.0
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
    (row,) = parse_metrics("vllm:num_requests_running 1.0\n", "hsl")
    assert row["running"] == 1 and row["waiting"] == -1 and math.isnan(row["usage_frac"])


def test_server_scrape_carries_its_resident_memory():
    """The server's registry exports process_resident_memory_bytes (Prometheus' process
    collector); the poller reads it back, and it agrees with /proc/self/statm read here."""
    snap = {"running": 0, "waiting": 0, "clock_s": 0.0, "pools": {"shared": (0, 0, 8, 8)},
            **RequestStats(8192).snapshot()}
    rss = parse_rss(render(make_registry(lambda: snap)).decode())
    with open("/proc/self/statm") as fh:
        resident_pages = int(fh.read().split()[1])
    here = resident_pages * os.sysconf("SC_PAGE_SIZE")
    assert rss > 0 and abs(rss - here) < 0.05 * here
    assert parse_rss(HSL_D0) == -1  # not exported: marked, not invented


def test_footprint_table_takes_the_poller_samples():
    table = to_table("footprint", {"t_s": [0.0, 0.25, 0.5], "rss_bytes": [10, 12, -1]})
    assert table.column_names == ["t_s", "rss_bytes"] and table.num_rows == 3


def test_request_paths_table_keeps_the_servers_record_per_request():
    from experiments.runners.http_client import ClientRecord
    from experiments.runners.http_run import request_paths_table

    reload = ClientRecord(7, path="host_reload", reused_tokens=0, restored_tokens=1792,
                          first_batch_computed=1792, first_batch_scheduled=1791)
    vllm = ClientRecord(8, cached_prompt_tokens=512)  # a server that reports no path
    table = to_table("request_paths", request_paths_table([reload, vllm]))
    rows = table.to_pylist()
    assert rows[0] == {"request_id": 7, "path": "host_reload", "reused_tokens": 0,
                       "restored_tokens": 1792, "first_batch_computed": 1792,
                       "first_batch_scheduled": 1791, "cached_prompt_tokens": -1}
    assert rows[1]["path"] == "" and rows[1]["cached_prompt_tokens"] == 512
    with pytest.raises(ValueError):
        to_table("request_paths", {**request_paths_table([reload]), "path": ["sideways"]})
