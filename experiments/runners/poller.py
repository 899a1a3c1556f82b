"""The metrics poller: one GET /metrics per second into poller-ledger rows, and the
server's resident memory (`process_resident_memory_bytes`, Prometheus' process collector,
exported by our server and vLLM's alike) every 0.25 s into footprint-ledger rows.

`METRIC_NAMES` maps each poller column to a metric name per server kind, so the
same poller reads our server (`hsl`) and a vLLM server (`vllm`). A column a kind
does not export is recorded as -1 (NaN for fractions).
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serving_core.records import POLLER_COLUMNS

# column -> metric sample name (counters with their _total suffix); per-pool columns
# read the sample whose `pool` label names the pool.
METRIC_NAMES: dict[str, dict[str, str]] = {
    "hsl": {  # vLLM's names where both servers export the same quantity
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "units_used": "hsl:pool_units_used",
        "units_cached": "hsl:pool_units_cached",
        "units_free": "hsl:pool_units_free",
        "units_total": "hsl:pool_units_total",
        "usage_frac": "hsl:pool_usage_perc",
        "preemptions_total": "vllm:num_preemptions_total",
        "prompt_tokens_total": "hsl:prompt_tokens_total",  # computed (vLLM's counts all)
        "generation_tokens_total": "vllm:generation_tokens_total",
        "prefix_hit_tokens_total": "vllm:prefix_cache_hits_total",
    },
    "vllm": {  # vLLM V1: one KV-cache pool, usage as a fraction, no unit counts
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "usage_frac": "vllm:kv_cache_usage_perc",
        "preemptions_total": "vllm:num_preemptions_total",
        "prompt_tokens_total": "vllm:prompt_tokens_total",
        "generation_tokens_total": "vllm:generation_tokens_total",
        "prefix_hit_tokens_total": "vllm:prefix_cache_hits_total",
    },
}
RSS_METRIC = "process_resident_memory_bytes"
FOOTPRINT_PERIOD_S = 0.25
POOL_COLUMNS = ("units_used", "units_cached", "units_free", "units_total", "usage_frac")
_SERVER_COLUMNS = tuple(c for c in POLLER_COLUMNS if c not in ("t_s", "pool"))


def parse_metrics(text: str, kind: str) -> list[dict]:
    """Poller rows (without t_s) of one scrape: one row per pool."""
    names = METRIC_NAMES[kind]
    wanted = {v: k for k, v in names.items()}
    scalars: dict[str, float] = {}
    per_pool: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            col = wanted.get(sample.name)
            if col is None:
                continue
            if col in POOL_COLUMNS and "pool" in sample.labels:
                per_pool.setdefault(sample.labels["pool"], {})[col] = sample.value
            else:
                scalars[col] = scalars.get(col, 0.0) + sample.value  # summed over labels
    pools = per_pool or {"shared": {}}
    rows = []
    for pool, values in sorted(pools.items()):
        row: dict = {"pool": pool}
        for col in _SERVER_COLUMNS:
            value = values.get(col, scalars.get(col))
            if col == "usage_frac":
                row[col] = math.nan if value is None else float(value)
            else:
                row[col] = -1 if value is None else int(round(value))
        rows.append(row)
    return rows


def parse_rss(text: str) -> int:
    """The scrape's resident set size in bytes; -1 when the server does not export it."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RSS_METRIC:
                return int(sample.value)
    return -1


class Poller:
    """Samples `base_url/metrics` at t0 + 0, 1, 2, ... seconds until stopped."""

    def __init__(self, base_url: str, kind: str, t0: float, period_s: float = 1.0) -> None:
        if kind not in METRIC_NAMES:
            raise ValueError(f"server kind {kind!r}: allowed values are {sorted(METRIC_NAMES)}")
        self.base_url = base_url
        self.kind = kind
        self.t0 = t0
        self.period_s = period_s
        self.columns: dict[str, list] = {c: [] for c in POLLER_COLUMNS}
        self.footprint: dict[str, list] = {"t_s": [], "rss_bytes": []}
        self.footprint_period_s = FOOTPRINT_PERIOD_S
        self.errors = 0
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def sample(self, client: httpx.AsyncClient, tick: int) -> None:
        try:
            r = await client.get(self.base_url + "/metrics", timeout=5.0)
            r.raise_for_status()
            rows = parse_metrics(r.text, self.kind)
        except (httpx.HTTPError, ValueError):
            self.errors += 1  # a missed sample; the ledger keeps the ones taken
            return
        for row in rows:
            self.columns["t_s"].append(tick)
            for col in POLLER_COLUMNS[1:]:
                self.columns[col].append(row[col])

    async def sample_footprint(self, client: httpx.AsyncClient, tick: int) -> None:
        try:
            r = await client.get(self.base_url + "/metrics", timeout=5.0)
            r.raise_for_status()
            rss = parse_rss(r.text)
        except (httpx.HTTPError, ValueError):
            self.errors += 1
            return
        self.footprint["t_s"].append(round(tick * self.footprint_period_s, 6))
        self.footprint["rss_bytes"].append(rss)

    async def _footprint_loop(self, client: httpx.AsyncClient) -> None:
        """RSS at t0 + 0, 0.25, 0.5, ... s until `stop()` (a missed tick is skipped)."""
        tick = 0
        while not self._stop.is_set():
            await self.sample_footprint(client, tick)
            now = (time.perf_counter() - self.t0) / self.footprint_period_s
            tick = max(tick + 1, math.ceil(now))
            delay = self.t0 + tick * self.footprint_period_s - time.perf_counter()
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, delay))
            except TimeoutError:
                continue

    async def run(self) -> None:
        """Sample once per period (whole seconds since t0) until `stop()`; one final
        sample at the stop so the ledger sees the end state. The footprint is sampled
        alongside every 0.25 s."""
        async with httpx.AsyncClient() as client:
            footprint = asyncio.create_task(self._footprint_loop(client))
            try:
                await self._run(client)
            finally:
                self._stop.set()
                await footprint

    async def _run(self, client: httpx.AsyncClient) -> None:
        tick = 0
        while True:
            await self.sample(client, tick)
            tick += 1
            delay = self.t0 + tick * self.period_s - time.perf_counter()
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, delay))
            except TimeoutError:
                continue
            end_tick = math.ceil((time.perf_counter() - self.t0) / self.period_s)
            if end_tick >= tick:
                await self.sample(client, end_tick)
            return
