"""Prometheus exposition of the runtime's snapshot: vLLM 0.32's metrics, plus ours.

Two prefixes, one rule: a metric vLLM's server also exports, with the same meaning, keeps
vLLM's name under `vllm:` and vLLM's labels (`model_name`, `engine`="0"), so vLLM's Grafana
dashboard and any scraper written for vLLM read our server unchanged; what only we measure
is under `hsl:` (labelled `model_name`). vLLM 0.32's names (tests/data/vllm_0_32_metrics.json,
scraped from its /metrics) that we export:

- scheduler: num_requests_running, num_requests_waiting, num_requests_waiting_by_reason
  (capacity; deferred is always 0: no request is held back by a policy), kv_cache_usage_perc
  (used fraction of all state units), engine_sleep_state (always awake), cache_config_info;
- prefix cache: prefix_cache_queries / prefix_cache_hits (tokens; the device cache),
  external_prefix_cache_queries / external_prefix_cache_hits (our host tier, which plays
  vLLM's KV-connector role), prompt_tokens_cached and prompt_tokens_cached_by_source
  (device, host);
- tokens: prompt_tokens (every prompt token of the requests that produced a first token,
  cached or not), prompt_tokens_by_source, generation_tokens, num_preemptions;
- requests: request_success by finished_reason, admission_rejections (0: no queue limit);
- histograms (vLLM's buckets): time_to_first_token_seconds, inter_token_latency_seconds,
  request_time_per_output_token_seconds, e2e_request_latency_seconds,
  request_queue_time_seconds, request_prefill_time_seconds, request_decode_time_seconds,
  request_inference_time_seconds, request_prompt_tokens, request_generation_tokens,
  request_max_num_generation_tokens, request_params_n, request_params_max_tokens,
  request_num_preemptions, request_prefill_kv_computed_tokens, iteration_tokens_total
  (serving_core/server/request_stats.py says what each measures).

Not exported: mm_cache_* (no multimodal inputs) and estimated_*_per_gpu (vLLM's analytic
FLOP and byte counts of its own kernels).

Ours (`hsl:`): prompt_tokens (prompt tokens computed, recompute after preemption included:
not vLLM's prompt_tokens), engine_clock_seconds, engine_steps,
requests_received / finished / aborted / rejected, per-pool units (pool_units_used, _cached,
_free, _total and pool_usage_perc, labelled `pool`: shared for S0/S1/S2/N0, attention and
recurrent for D0), the host tier's external_tier_saves_started / _completed,
external_tier_restores / _resume_restores, external_tier_evictions / _evicted_bytes /
_rejected_saves, external_tier_saved_bytes / _restored_bytes and the gauges
external_tier_usage_bytes / _capacity_bytes / _entries, device_prefix_cache_hits (tokens
adopted from the device cache without a restore), prefix_cache_resets and
requests_by_path{path=recompute|device_reuse|host_reload}. The process_* series come from
Prometheus' process collector, as vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from serving_core.placement import retention_blocks
from serving_core.server.paths import PATHS

PREFIX = "hsl:"
VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")

# ----- ours (hsl:) ------------------------------------------------------------------------
GAUGES = {"engine_clock_seconds": ("clock_s", "Engine clock (seconds since it started).")}
# The host tier's occupancy (0 without a tier); LMCache calls the first local_cache_usage.
TIER_GAUGES = {
    "external_tier_usage_bytes": ("tier_usage_bytes",
                                  "Host-tier bytes held or reserved by saves in flight."),
    "external_tier_capacity_bytes": ("tier_capacity_bytes", "Host-tier capacity in bytes."),
    "external_tier_entries": ("tier_entries",
                              "Host-tier entries (a checkpoint with its attention chain)."),
}
COUNTERS = {  # exposed with the _total suffix: name -> (snapshot key, help)
    "prompt_tokens": ("prompt_tokens_total",
                      "Prompt tokens computed (prefill, recompute after preemption included)."),
    "engine_steps": ("steps_total", "Engine steps run."),
    "requests_received": ("requests_received", "Requests accepted."),
    "requests_finished": ("requests_finished", "Requests finished (length or stop)."),
    "requests_aborted": ("requests_aborted", "Requests aborted (client gone, shutdown, error)."),
    "requests_rejected": ("requests_rejected", "Requests refused while shutting down."),
    "external_tier_saves_started": ("tier_saves_started",
                                    "Host-tier saves started (published entries copied out)."),
    "external_tier_saves_completed": ("tier_saves_completed",
                                      "Host-tier saves completed (entries restorable)."),
    "external_tier_restores": ("tier_restores", "Prefixes restored from the host tier."),
    "external_tier_resume_restores": ("tier_resume_restores",
                                      "Restores for preempted requests resuming."),
    "external_tier_evictions": ("tier_evictions",
                                "Host-tier entries evicted (least recently used first)."),
    "external_tier_evicted_bytes": ("tier_evicted_bytes", "Host-tier bytes evicted."),
    "external_tier_rejected_saves": ("tier_rejected_saves",
                                     "Entries not saved: they did not fit the capacity."),
    "external_tier_saved_bytes": ("tier_bytes_d2h", "Bytes copied device-to-host by saves."),
    "external_tier_restored_bytes": ("tier_bytes_h2d",
                                     "Bytes copied host-to-device by restores."),
    "device_prefix_cache_hits": ("device_prefix_hit_tokens",
                                 "Prompt tokens adopted from the device cache (no restore)."),
    "prefix_cache_resets": ("prefix_cache_resets", "POST /reset_prefix_cache calls done."),
}
PATH_COUNTER = "requests_by_path"  # labels model_name, path
POOL_GAUGES = {  # name -> (index into (used, cached, free, total), help)
    "pool_units_used": (0, "Units held by running requests."),
    "pool_units_cached": (1, "Units holding evictable cached prefix state."),
    "pool_units_free": (2, "Units neither used nor cached."),
    "pool_units_total": (3, "Units in the pool."),
}
USAGE = "pool_usage_perc"

# ----- vLLM's (vllm:) ---------------------------------------------------------------------
VLLM_GAUGES = {
    "num_requests_running": ("running", "Number of requests in model execution batches."),
    "num_requests_waiting": ("waiting", "Number of requests waiting to be processed."),
}
VLLM_COUNTERS = {
    "prefix_cache_queries": ("prefix_query_tokens_total",
                             "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": ("prefix_hit_tokens_total",
                          "Prefix cache hits, in terms of number of cached tokens."),
    "external_prefix_cache_queries": ("tier_query_tokens",
                                      "External prefix cache queries (our host tier), "
                                      "in tokens."),
    "external_prefix_cache_hits": ("tier_restored_tokens",
                                   "External prefix cache hits (tokens restored from our "
                                   "host tier)."),
    "num_preemptions": ("preemptions_total", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("prompt_tokens_all", "Number of prefill tokens processed."),
    "generation_tokens": ("generation_tokens_total", "Number of generation tokens processed."),
}
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds":
        "Histogram of time_per_output_token_seconds per request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_max_num_generation_tokens":
        "Histogram of maximum number of requested generation tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens":
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}

# vLLM's buckets (vllm/v1/metrics/loggers.py, as its /metrics shows them)
_BUCKETS = {
    "time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                            1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                            2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "iteration_tokens": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "request_params_n": (1, 2, 5, 10, 20),
    "request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
}


def histogram_buckets(family: str, max_model_len: int) -> tuple[float, ...]:
    """vLLM's bucket edges of a histogram family; `request_tokens` is vLLM's 1-2-5 series up
    to max_model_len."""
    if family == "request_tokens":
        edges, scale = [], 1
        while True:
            for m in (1, 2, 5):
                if m * scale > max_model_len:
                    return tuple(edges)
                edges.append(m * scale)
            scale *= 10
    return _BUCKETS[family]


def cache_config_labels(engine) -> dict[str, str]:
    """vllm:cache_config_info's labels that mean the same here, read from the engine."""
    mem, sched = engine.mem, engine.sched
    units = {p: pool.num_units for p, pool in mem.pools.items()}
    return {
        "block_size": str(mem.block_tokens),
        "enable_prefix_caching": "True",
        "num_gpu_blocks": str(sum(units.values())),
        "num_cpu_blocks": "None",
        "cache_dtype": "auto",
        # tokens between retained checkpoints: C, or k C under engine.retention_interval=<k>block
        "prefix_cache_retention_interval": str(
            sched.C * (retention_blocks(sched.retention_interval) or 1) or "None"),
        "organization": mem.org,
    }


class SnapshotCollector:
    """Collects from `source()` (a snapshot dict) at every scrape."""

    def __init__(self, source, model_name: str = "", cache_info: dict | None = None) -> None:
        self.source = source
        self.model = model_name
        self.cache_info = dict(cache_info or {})

    def collect(self):
        snap = self.source()
        yield from self._vllm(snap)
        yield from self._ours(snap)

    def _vllm(self, snap):
        yield from self._vllm_scheduler(snap)
        yield from self._vllm_tokens(snap)
        yield from self._vllm_requests(snap)

    def _vllm_scheduler(self, snap):
        """Queue gauges, sleep state and KV-cache usage."""
        v = [self.model, ENGINE_INDEX]
        labels = ["model_name", "engine"]
        for name, (key, doc) in VLLM_GAUGES.items():
            fam = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
            fam.add_metric(v, snap[key])
            yield fam
        fam = GaugeMetricFamily(VLLM_PREFIX + "num_requests_waiting_by_reason",
                                "Waiting requests by reason (all wait for capacity here).",
                                labels=[*labels, "reason"])
        fam.add_metric([*v, "capacity"], snap["waiting"])
        fam.add_metric([*v, "deferred"], 0)
        yield fam
        fam = GaugeMetricFamily(VLLM_PREFIX + "engine_sleep_state",
                                "Engine sleep state (1 for the current state).",
                                labels=[*labels, "sleep_state"])
        for state in SLEEP_STATES:
            fam.add_metric([*v, state], 1 if state == "awake" else 0)
        yield fam
        pools = snap["pools"]
        used = sum(u[0] for u in pools.values())
        total = sum(u[3] for u in pools.values())
        fam = GaugeMetricFamily(VLLM_PREFIX + "kv_cache_usage_perc",
                                "KV-cache usage (all state units). 1 means 100 percent usage.",
                                labels=labels)
        fam.add_metric(v, used / total if total else 0.0)
        yield fam

    def _vllm_tokens(self, snap):
        """Prefix-cache, token and preemption counters; prompt tokens by source."""
        v = [self.model, ENGINE_INDEX]
        labels = ["model_name", "engine"]
        for name, (key, doc) in VLLM_COUNTERS.items():
            fam = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
            fam.add_metric(v, snap.get(key, 0))
            yield fam
        by_source = snap["prompt_tokens_by_source"]
        fam = CounterMetricFamily(VLLM_PREFIX + "prompt_tokens_by_source",
                                  "Number of prompt tokens by source.", labels=[*labels, "source"])
        for source, n in by_source.items():
            fam.add_metric([*v, source], n)
        yield fam
        cached = {"device": by_source["local_cache_hit"],
                  "host": by_source["external_kv_transfer"]}
        fam = CounterMetricFamily(VLLM_PREFIX + "prompt_tokens_cached",
                                  "Number of cached prompt tokens (local + external).",
                                  labels=labels)
        fam.add_metric(v, sum(cached.values()))
        yield fam
        fam = CounterMetricFamily(VLLM_PREFIX + "prompt_tokens_cached_by_source",
                                  "Prefix-cache hit tokens by the cache tier that supplied "
                                  "them (device; host: our host tier).",
                                  labels=[*labels, "source"])
        for source in CACHED_SOURCES:
            fam.add_metric([*v, source], cached.get(source, 0))
        yield fam

    def _vllm_requests(self, snap):
        """Requests by finish reason, admission rejections, the histograms, cache info."""
        v = [self.model, ENGINE_INDEX]
        labels = ["model_name", "engine"]
        fam = CounterMetricFamily(VLLM_PREFIX + "request_success",
                                  "Count of successfully processed requests.",
                                  labels=[*labels, "finished_reason"])
        for reason, n in snap["request_success"].items():
            fam.add_metric([*v, reason], n)
        yield fam
        fam = CounterMetricFamily(VLLM_PREFIX + "admission_rejections",
                                  "Admission attempts rejected by a queue limit (none here).",
                                  labels=["model_name", "reason"])
        for reason in ADMISSION_REASONS:
            fam.add_metric([self.model, reason], 0)
        yield fam
        for name, doc in VLLM_HISTOGRAMS.items():
            buckets, total_s = snap["histograms"][name]
            fam = HistogramMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
            fam.add_metric(v, buckets, total_s)
            yield fam
        if self.cache_info:
            info = dict(self.cache_info, engine=ENGINE_INDEX)
            fam = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info",
                                    "Information of the engine's cache configuration.",
                                    labels=sorted(info))
            fam.add_metric([info[k] for k in sorted(info)], 1)
            yield fam

    def _ours(self, snap):
        m = [self.model]
        for name, (key, doc) in GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, snap[key])
            yield fam
        for name, (key, doc) in TIER_GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(m, snap.get(key, 0))
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


def make_registry(source, model_name: str = "", cache_info: dict | None = None
                  ) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(source, model_name, cache_info))
    # process_resident_memory_bytes and the other process_* series, as vLLM's server
    # exports them (Linux /proc): the poller samples the server's footprint from it.
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
