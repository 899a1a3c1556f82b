"""Prometheus exposition of the runtime's snapshot (the usual serving gauges and counters).

Names follow vLLM's under the `hsl:` prefix, and every series carries a `model_name`
label as vLLM's do: request latency histograms (`time_to_first_token_seconds`,
`time_per_output_token_seconds`, `e2e_request_latency_seconds`, vLLM's buckets),
`prefix_cache_queries` / `prefix_cache_hits` (tokens) and `kv_cache_usage_perc` (used
fraction of all units). Per-pool series carry a `pool` label as well (shared for
S0/S1/S2/N0, attention and recurrent for D0); the older names the poller reads
(`prefix_cache_hit_tokens`, `pool_usage_perc`) stay.

The host tier (`--host-tier`) and request paths: `external_tier_saves_started` /
`external_tier_saves_completed` (entries), `external_tier_restores`,
`external_prefix_cache_hits` (restored tokens, vLLM's name for a KV connector's hits),
`external_prefix_cache_queries` (prompt tokens looked up in the tier),
`device_prefix_cache_hits` (tokens adopted from the device cache without a restore),
`prefix_cache_resets` and `requests_by_path{path=recompute|device_reuse|host_reload}`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from serving_core.server.paths import PATHS

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
    "prefix_cache_hits": ("prefix_hit_tokens_total",
                          "Prompt tokens served from the prefix cache (vLLM's name)."),
    "prefix_cache_queries": ("prefix_query_tokens_total",
                             "Prompt tokens of the requests received (prefix-cache queries)."),
    "engine_steps": ("steps_total", "Engine steps run."),
    "requests_received": ("requests_received", "Requests accepted."),
    "requests_finished": ("requests_finished", "Requests finished."),
    "requests_aborted": ("requests_aborted", "Requests aborted (shutdown or engine error)."),
    "requests_rejected": ("requests_rejected", "Requests refused while shutting down."),
    "external_tier_saves_started": ("tier_saves_started",
                                    "Host-tier saves started (published entries copied out)."),
    "external_tier_saves_completed": ("tier_saves_completed",
                                      "Host-tier saves completed (entries restorable)."),
    "external_tier_restores": ("tier_restores", "Prefixes restored from the host tier."),
    "external_prefix_cache_hits": ("tier_restored_tokens",
                                   "Prompt tokens restored from the host tier."),
    "external_prefix_cache_queries": ("tier_query_tokens",
                                      "Prompt tokens looked up in the host tier."),
    "device_prefix_cache_hits": ("device_prefix_hit_tokens",
                                 "Prompt tokens adopted from the device cache (no restore)."),
    "prefix_cache_resets": ("prefix_cache_resets", "POST /reset_prefix_cache calls done."),
}
PATH_COUNTER = "requests_by_path"  # labels model_name, path
# Per-pool gauges: name -> (index into (used, cached, free, total), help)
POOL_GAUGES = {
    "pool_units_used": (0, "Units held by running requests."),
    "pool_units_cached": (1, "Units holding evictable cached prefix state."),
    "pool_units_free": (2, "Units neither used nor cached."),
    "pool_units_total": (3, "Units in the pool."),
}
USAGE = "pool_usage_perc"
# vLLM's buckets (vllm/v1/metrics/loggers.py)
HISTOGRAMS = {
    "time_to_first_token_seconds": (
        "Time to first token: submit to first token handed to the stream.",
        (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)),
    "time_per_output_token_seconds": (
        "Time between consecutive output tokens of a request.",
        (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)),
    "e2e_request_latency_seconds": (
        "End-to-end request latency: submit to last token.",
        (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)),
}


class Histogram:
    """Cumulative-bucket histogram (not thread-safe: the runtime holds its lock)."""

    def __init__(self, buckets) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def copy(self) -> tuple[list, float]:
        """(cumulative [(le, count)], sum) for a snapshot."""
        out, acc = [], 0
        for edge, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += n
            out.append(("+Inf" if edge == float("inf") else repr(edge), acc))
        return out, self.sum


def new_histograms() -> dict[str, Histogram]:
    return {name: Histogram(buckets) for name, (_doc, buckets) in HISTOGRAMS.items()}


class SnapshotCollector:
    """Collects from `source()` (a snapshot dict) at every scrape."""

    def __init__(self, source, model_name: str = "") -> None:
        self.source = source
        self.model = model_name

    def collect(self):
        snap = self.source()
        m = [self.model]
        for name, (key, doc) in GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, snap[key])
            yield fam
        for name, (key, doc) in COUNTERS.items():
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, snap.get(key, 0))
            yield fam
        fam = CounterMetricFamily(PREFIX + PATH_COUNTER,
                                  "Requests admitted, by actual path (recompute, "
                                  "device_reuse, host_reload).", labels=["model_name", "path"])
        for path in PATHS:
            fam.add_metric([self.model, path], snap.get(f"requests_path_{path}", 0))
        yield fam
        pools = snap["pools"]
        for name, (i, doc) in POOL_GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "pool"])
            for pool, usage in pools.items():
                fam.add_metric([self.model, pool], usage[i])
            yield fam
        fam = GaugeMetricFamily(PREFIX + USAGE, "Used fraction of the pool's units.",
                                labels=["model_name", "pool"])
        for pool, (used, _cached, _free, total) in pools.items():
            fam.add_metric([self.model, pool], used / total if total else 0.0)
        yield fam
        used = sum(u[0] for u in pools.values())
        total = sum(u[3] for u in pools.values())
        fam = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                "Used fraction of all state units (1 = full).",
                                labels=["model_name"])
        fam.add_metric(m, used / total if total else 0.0)
        yield fam
        for name, (doc, _buckets) in HISTOGRAMS.items():
            buckets, total_s = snap["histograms"][name]
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, buckets, total_s)
            yield fam


def make_registry(source, model_name: str = "") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(source, model_name))
    # process_resident_memory_bytes and the other process_* series, as vLLM's server
    # exports them (Linux /proc): the poller samples the server's footprint from it.
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
