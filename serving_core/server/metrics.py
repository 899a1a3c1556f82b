"""Prometheus exposition of the runtime's snapshot (the usual serving gauges and counters).

Names follow vLLM's style under the `hsl:` prefix; per-pool series carry a `pool`
label (shared for S0/S1/S2, attention and recurrent for D0).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "hsl:"
# Gauges: name -> (snapshot key, help)
GAUGES = {
    "num_requests_running": ("running", "Requests running in the engine."),
    "num_requests_waiting": ("waiting", "Requests waiting to be admitted."),
    "engine_clock_seconds": ("clock_s", "Engine clock (seconds since the engine started)."),
}
# Counters (exposed with the _total suffix): name -> (snapshot key, help)
COUNTERS = {
    "num_preemptions": ("preemptions_total", "Cumulative preemptions."),
    "prompt_tokens": ("prompt_tokens_total", "Cumulative prompt tokens computed."),
    "generation_tokens": ("generation_tokens_total", "Cumulative tokens generated."),
    "prefix_cache_hit_tokens": ("prefix_hit_tokens_total",
                                "Cumulative prompt tokens served from the prefix cache."),
    "engine_steps": ("steps_total", "Engine steps run."),
    "requests_received": ("requests_received", "Requests accepted."),
    "requests_finished": ("requests_finished", "Requests finished."),
    "requests_aborted": ("requests_aborted", "Requests aborted (shutdown or engine error)."),
    "requests_rejected": ("requests_rejected", "Requests refused while shutting down."),
}
# Per-pool gauges: name -> (index into (used, cached, free, total), help)
POOL_GAUGES = {
    "pool_units_used": (0, "Units held by running requests."),
    "pool_units_cached": (1, "Units holding evictable cached prefix state."),
    "pool_units_free": (2, "Units neither used nor cached."),
    "pool_units_total": (3, "Units in the pool."),
}
USAGE = "pool_usage_perc"


class SnapshotCollector:
    """Collects from `source()` (a snapshot dict) at every scrape."""

    def __init__(self, source) -> None:
        self.source = source

    def collect(self):
        snap = self.source()
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=snap[key])
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=snap[key])
        pools = snap["pools"]
        for name, (i, doc) in POOL_GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["pool"])
            for pool, usage in pools.items():
                fam.add_metric([pool], usage[i])
            yield fam
        fam = GaugeMetricFamily(PREFIX + USAGE, "Used fraction of the pool's units.",
                                labels=["pool"])
        for pool, (used, _cached, _free, total) in pools.items():
            fam.add_metric([pool], used / total if total else 0.0)
        yield fam


def make_registry(source) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(source))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
