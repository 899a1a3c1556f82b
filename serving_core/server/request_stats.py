"""vLLM's request metrics, kept by the runtime's driver thread (under the runtime's lock).

What each one measures follows vLLM 0.32 (vllm/v1/metrics/loggers.py and stats.py): per
token, time to first token (submit to first token) and inter-token latency; per finished
request, end to end (submit to its end), queue (submit to the start of the step that first
scheduled it), prefill (scheduled to first token), decode (first to last token), inference
(scheduled to last token), mean time per output token (decode / (tokens - 1)), its
preemptions, prompt and generated tokens, max_tokens, prompt tokens it computed (prompt -
cached) and a count by finish reason; per HTTP request, n and the most tokens any of its
choices generated; per engine step, the tokens it computed (prompt + generated). Prompt
tokens by source are counted at each request's first token, as vLLM's PromptTokenStats:
local_compute, local_cache_hit (device prefix cache), external_kv_transfer (our host tier).
All times are the driver thread's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_core.server.metrics import FINISH_REASONS, histogram_buckets

# histogram name (vLLM's, without prefix) -> bucket family of histogram_buckets
HISTOGRAM_FAMILIES = {
    "time_to_first_token_seconds": "time_to_first_token",
    "inter_token_latency_seconds": "inter_token_latency",
    "request_time_per_output_token_seconds": "inter_token_latency",
    "e2e_request_latency_seconds": "request_latency",
    "request_queue_time_seconds": "request_latency",
    "request_inference_time_seconds": "request_latency",
    "request_prefill_time_seconds": "request_latency",
    "request_decode_time_seconds": "request_latency",
    "request_prompt_tokens": "request_tokens",
    "request_generation_tokens": "request_tokens",
    "request_max_num_generation_tokens": "request_tokens",
    "request_params_max_tokens": "request_tokens",
    "request_prefill_kv_computed_tokens": "request_tokens",
    "request_params_n": "request_params_n",
    "request_num_preemptions": "request_num_preemptions",
    "iteration_tokens_total": "iteration_tokens",
}
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


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
            out.append(("+Inf" if edge == float("inf") else repr(float(edge)), acc))
        return out, self.sum


@dataclass(slots=True)
class _Live:
    submit: float
    num_prompt: int
    max_tokens: int
    parent: int  # rid of the HTTP request's first choice
    scheduled: float = 0.0
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    cached_local: int = 0
    cached_external: int = 0


class RequestStats:
    def __init__(self, max_model_len: int) -> None:
        self.hist = {name: Histogram(histogram_buckets(family, max_model_len))
                     for name, family in HISTOGRAM_FAMILIES.items()}
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.prompt_tokens = 0
        self._live: dict[int, _Live] = {}
        self._parents: dict[int, list[int]] = {}  # parent rid -> [choices left, max tokens]

    def submitted(self, rid: int, now: float, num_prompt: int, max_tokens: int,
                  n_param: int, parent: int | None = None) -> None:
        parent = rid if parent is None else parent
        self._live[rid] = _Live(now, num_prompt, max_tokens, parent)
        if parent == rid:
            self._parents[rid] = [n_param, 0]
            self.hist["request_params_n"].observe(n_param)

    def scheduled(self, rids, now: float, paths: dict) -> None:
        """Requests first scheduled by the step that started at `now`; `paths` (rid ->
        RequestPath) says what each adopted."""
        for rid in rids:
            live = self._live.get(rid)
            if live is None or live.scheduled:
                continue
            live.scheduled = now
            path = paths.get(rid)
            if path is not None:
                if path.path == "host_reload":
                    live.cached_external = path.reused_tokens
                else:
                    live.cached_local = path.reused_tokens

    def iteration(self, tokens: int) -> None:
        self.hist["iteration_tokens_total"].observe(tokens)

    def token(self, rid: int, now: float) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        if live.tokens:
            self.hist["inter_token_latency_seconds"].observe(now - live.last)
        else:
            live.first = now
            self.hist["time_to_first_token_seconds"].observe(now - live.submit)
            cached = live.cached_local + live.cached_external
            self.prompt_tokens += live.num_prompt
            self.prompt_by_source["local_compute"] += live.num_prompt - cached
            self.prompt_by_source["local_cache_hit"] += live.cached_local
            self.prompt_by_source["external_kv_transfer"] += live.cached_external
        live.tokens += 1
        live.last = now

    def finished(self, rid: int, now: float, reason: str, req=None, count: bool = True
                 ) -> None:
        """Request `rid` ended (`reason`: one of FINISH_REASONS); `req` (the engine's
        Request, when known) gives its preemptions. `count=False`: the caller counts the
        reason in `success` later (the front end settles it)."""
        live = self._live.pop(rid, None)
        if live is None:
            return
        if count:
            self.success[reason] += 1
        h = self.hist
        h["e2e_request_latency_seconds"].observe(now - live.submit)
        scheduled = live.scheduled or now
        h["request_queue_time_seconds"].observe(scheduled - live.submit)
        if live.tokens:
            h["request_prefill_time_seconds"].observe(live.first - scheduled)
            h["request_decode_time_seconds"].observe(live.last - live.first)
            h["request_inference_time_seconds"].observe(live.last - scheduled)
        else:
            for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                         "request_inference_time_seconds"):
                h[name].observe(0.0)
        tpot = (live.last - live.first) / (live.tokens - 1) if live.tokens > 1 else 0.0
        h["request_time_per_output_token_seconds"].observe(tpot)
        h["request_num_preemptions"].observe(getattr(req, "preemptions", 0) or 0)
        h["request_prompt_tokens"].observe(live.num_prompt)
        h["request_generation_tokens"].observe(live.tokens)
        h["request_params_max_tokens"].observe(live.max_tokens)
        cached = live.cached_local + live.cached_external
        h["request_prefill_kv_computed_tokens"].observe(live.num_prompt - cached)
        parent = self._parents.get(live.parent)
        if parent is not None:
            parent[0] -= 1
            parent[1] = max(parent[1], live.tokens)
            if parent[0] <= 0:
                h["request_max_num_generation_tokens"].observe(parent[1])
                del self._parents[live.parent]

    # an ended request is counted like a finished one (vLLM counts aborts the same way)
    ended = finished

    def snapshot(self) -> dict:
        return {
            "histograms": {name: h.copy() for name, h in self.hist.items()},
            "request_success": dict(self.success),
            "prompt_tokens_by_source": dict(self.prompt_by_source),
            "prompt_tokens_all": self.prompt_tokens,
        }
