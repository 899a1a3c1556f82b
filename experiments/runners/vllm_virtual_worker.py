"""vLLM's own scheduler on a virtual clock (runs in the vLLM venv: `python -m
experiments.runners.vllm_virtual_worker`, started by experiments/runners/vllm_virtual.py).

Reads one JSON line from stdin: the model's public config (transformers model type and
fields), the dtype, vLLM's knobs, the KV cache bytes and the workload. It writes the config
to a temporary directory, builds vLLM's ModelConfig / CacheConfig / SchedulerConfig /
VllmConfig from it, derives the KV cache with vLLM's functions (the stand-ins for a built
model are in experiments/runners/vllm_standins.py) and builds vLLM's `Scheduler`. It then
answers with one JSON line (`ready`: the settings read back from vLLM's objects) and
steps: release the arrivals the clock has reached, `schedule()`, send the batch (new and
cached tokens per scheduled request) and read back the step's seconds (the parent prices
the step with the project's step model), build the `ModelRunnerOutput` (one token per
request whose chunk reaches its last token, none for a partial prefill chunk), call
`update_from_output()` and advance the clock. An idle engine jumps to the next arrival.
At the end it writes the requests, steps and poller records (`done`).

The protocol lines go to the original stdout; everything else vLLM prints goes to stderr.
Nothing reads the wall clock for a decision, so the records are a function of the input
(the parent sets PYTHONHASHSEED so set iteration is the same every run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import deque


def _protocol_stream():
    """The original stdout for protocol lines; fd 1 then points at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _vllm_config(init: dict):
    """vLLM's VllmConfig for the init message (the model's public config written to a
    temporary directory), with the block alignment and retention the knobs ask for."""
    from transformers import AutoConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VllmSchedulerConfig  # vLLM's, not ours

    from experiments.runners import vllm_standins as standins

    hf = dict(init["hf_config"])
    model_type = hf.pop("model_type")
    tmp = tempfile.mkdtemp(prefix="hsl-vllm-virtual-")
    AutoConfig.for_model(model_type, **hf).save_pretrained(tmp)
    knobs = init["vllm"]
    model = ModelConfig(model=tmp, skip_tokenizer_init=True, dtype=init["dtype"],
                        max_model_len=int(init["max_model_len"]))
    cache = CacheConfig(
        enable_prefix_caching=bool(knobs["prefix_caching"]),
        mamba_cache_mode=knobs["mamba_cache_mode"],
        prefix_cache_retention_interval=knobs["retention_interval"],
        kv_cache_memory_bytes=int(init["kv_cache_bytes"]),
    )
    sched_cfg = VllmSchedulerConfig(
        max_num_seqs=int(knobs["max_num_seqs"]),
        max_num_batched_tokens=int(knobs["max_num_batched_tokens"]),
        max_model_len=int(init["max_model_len"]), is_encoder_decoder=False,
    )
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched_cfg)
    standins.align_block_size(vc, knobs["platform"])
    if knobs.get("retention_block") and vc.cache_config.enable_prefix_caching:
        # "<k>block": retain a checkpoint every k block boundaries (the block vLLM derived)
        vc.cache_config.prefix_cache_retention_interval = (
            vc.cache_config.block_size * int(knobs["retention_block"]))
    return vc


def build_scheduler(init: dict):
    """vLLM's config objects and Scheduler for the init message; (scheduler, vc, settings)."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from experiments.runners import vllm_standins as standins

    vc = _vllm_config(init)
    platform = init["vllm"]["platform"]
    model_cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architectures,
                                                   vc.model_config)
    specs = standins.layer_specs(vc, model_cls, platform)
    kv_config, block, hash_block = standins.initialize_kv_caches(
        vc, specs, init["kv_cache_bytes"], platform)
    scheduler = Scheduler(vllm_config=vc, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(vc),
                          block_size=block, hash_block_size=hash_block, log_stats=True)
    settings = _settings(scheduler, vc, kv_config, platform)
    settings.update(scheduler_block_size=int(block), hash_block_size=int(hash_block))
    return scheduler, vc, settings


def _settings(scheduler, vc, kv_config, platform: str) -> dict:
    """The settings read back from vLLM's objects (the runs row's engine_config)."""
    import vllm

    c, s, model = vc.cache_config, vc.scheduler_config, vc.model_config
    groups = kv_config.kv_cache_groups
    return {
        "engine": "vllm_virtual", "version": vllm.__version__,
        "architecture": model.architecture, "platform": platform,
        "dtype": str(model.dtype).removeprefix("torch."),
        "block_size": int(c.block_size), "mamba_block_size": c.mamba_block_size,
        "page_bytes": int(groups[0].kv_cache_spec.page_size_bytes),
        "mamba_page_size_padded": c.mamba_page_size_padded,
        "num_blocks": int(kv_config.num_blocks),
        "kv_cache_groups": [[type(g.kv_cache_spec).__name__, len(g.layer_names)]
                            for g in groups],
        "kv_cache_memory_bytes": int(c.kv_cache_memory_bytes),
        "kv_cache_size_tokens": c.kv_cache_size_tokens,
        "prefix_caching": bool(c.enable_prefix_caching),
        "mamba_cache_mode": c.mamba_cache_mode,
        "mamba_ssm_cache_dtype": c.mamba_ssm_cache_dtype,
        "retention_interval": c.prefix_cache_retention_interval,
        "prefix_caching_hash_algo": c.prefix_caching_hash_algo,
        "max_num_seqs": int(s.max_num_seqs),
        "max_num_batched_tokens": int(s.max_num_batched_tokens),
        "long_prefill_token_threshold": int(s.long_prefill_token_threshold),
        "scheduler_reserve_full_isl": bool(s.scheduler_reserve_full_isl),
        "watermark": s.watermark, "policy": str(s.policy),
        "async_scheduling": bool(s.async_scheduling),
        "scheduler_class": type(scheduler).__name__,
    }


class _Track:
    """Per-request record of one run (what the requests ledger needs)."""

    __slots__ = ("rid", "arrival", "start", "first", "finish", "output", "adopted_first",
                 "adopted_resume", "episodes", "preemptions", "target", "prompt")

    def __init__(self, rid: int, arrival: float, prompt: int):
        self.rid, self.arrival, self.prompt = rid, arrival, prompt
        self.start = self.first = self.finish = None
        self.output = self.adopted_first = self.adopted_resume = self.episodes = 0
        self.preemptions = 0
        self.target = 0

    def record(self) -> dict:
        """The request's row for the parent (requests ledger)."""
        return {"id": self.rid, "arrival_s": self.arrival, "start_s": self.start,
                "first_token_s": self.first, "finish_s": self.finish,
                "prompt_tokens": self.prompt, "output_tokens": self.output,
                "adopted_first": self.adopted_first, "adopted_resume": self.adopted_resume,
                "episodes": self.episodes, "preemptions": self.preemptions}


STEP_FIELDS = ("step", "t_start_s", "duration_s", "num_scheduled", "num_running",
               "num_waiting", "prefill_tokens_initial", "prefill_tokens_resume",
               "decode_tokens", "num_preempted", "num_admitted", "num_decode_seqs",
               "decode_context_tokens", "prefill_attention_pairs", "num_sampling")
POLLER_FIELDS = ("t_s", "running", "waiting", "units_used", "units_cached", "units_free",
                 "units_total", "preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_hit_tokens_total")


def _block_hasher(vc, scheduler):
    """vLLM's request block hasher where prefix caching is on, else None."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not vc.cache_config.enable_prefix_caching:
        return None
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler.hash_block_size, hash_fn)


class _Run:
    """One cell through vLLM's scheduler on the virtual clock: the arrivals still to come,
    the per-request tracks, the step and poller columns and the cumulative counters."""

    def __init__(self, scheduler, vc, init: dict):
        self.scheduler, self.hasher = scheduler, _block_hasher(vc, scheduler)
        self.space = int(init["token_space"])
        self.pending = deque(sorted(init["requests"], key=lambda r: (r["arrival_s"], r["id"])))
        self.n = len(self.pending)
        self.tracks: dict[str, _Track] = {}
        self.pool = scheduler.kv_cache_manager.block_pool
        self.total_blocks = self.pool.num_gpu_blocks - 1  # less the null block
        self.steps = {k: [] for k in STEP_FIELDS}
        self.poller = {k: [] for k in POLLER_FIELDS}
        self.counters = {"preemptions": 0, "prompt": 0, "generation": 0, "hits": 0}
        self.clock, self.next_poll, self.finished = 0.0, 0, 0

    def token_of(self, request) -> int:  # serving_core.request.Request.next_generated_token's
        rid, j = int(request.request_id), request.num_output_tokens
        return (rid * 1_000_003 + j * 7_919 + 17) % self.space

    def poll(self) -> None:
        """One poller row per whole second the clock has passed."""
        s, pool, c = self.scheduler, self.pool, self.counters
        while self.next_poll <= self.clock:
            free_queue = pool.get_num_free_blocks()
            cached = sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                         if b.block_hash is not None)
            row = (self.next_poll, len(s.running), len(s.waiting) + len(s.kv_holding_waiting),
                   self.total_blocks - free_queue, cached, free_queue - cached,
                   self.total_blocks, c["preemptions"], c["prompt"], c["generation"], c["hits"])
            for key, value in zip(self.poller, row, strict=True):
                self.poller[key].append(value)
            self.next_poll += 1

    def release_arrivals(self) -> None:
        """Add to the scheduler every request the clock has reached."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        while self.pending and self.pending[0]["arrival_s"] <= self.clock:
            spec = self.pending.popleft()
            rid = str(spec["id"])
            self.tracks[rid] = _Track(spec["id"], spec["arrival_s"], len(spec["prompt"]))
            self.scheduler.add_request(Request(
                request_id=rid, prompt_token_ids=list(spec["prompt"]),
                sampling_params=SamplingParams(max_tokens=int(spec["output_tokens"]),
                                               ignore_eos=True),
                pooling_params=None, arrival_time=spec["arrival_s"],
                cache_salt=spec["salt"] or None, block_hasher=self.hasher))

    def account(self, out, t0: float) -> tuple[list, list, tuple]:
        """Admissions, hits and token kinds of a scheduled batch: (new tokens, context per
        scheduled request, (initial, resume, decode, decode seqs, decode context, pairs,
        sampling, admitted)); a request samples when its computed tokens reach its tokens."""
        new_ids = {r.req_id for r in out.scheduled_new_reqs}
        resumed = set(out.scheduled_cached_reqs.resumed_req_ids)
        new, ctx = [], []
        initial = resume = decode = dec_seqs = dec_ctx = pairs = sampling = 0
        for rid, num in out.num_scheduled_tokens.items():
            req, track = self.scheduler.requests[rid], self.tracks[rid]
            c0 = req.num_computed_tokens - num
            new.append(num)
            ctx.append(c0)
            if rid in new_ids or rid in resumed:  # an admission: its hit is c0
                self._admitted(track, req, c0, t0)
            prefill = max(min(c0 + num, track.target) - c0, 0)
            if track.episodes == 1:
                initial += prefill
            else:
                resume += prefill
            decode += num - prefill
            sampling += req.num_computed_tokens >= req.num_tokens
            if num == 1:
                dec_seqs += 1
                dec_ctx += c0
            else:
                pairs += num * c0 + num * (num + 1) // 2
        return new, ctx, (initial, resume, decode, dec_seqs, dec_ctx, pairs, sampling,
                          len(new_ids) + len(resumed))

    def _admitted(self, track: _Track, req, c0: int, t0: float) -> None:
        track.episodes += 1
        track.target = req.num_tokens
        if track.episodes == 1:
            track.start, track.adopted_first = t0, c0
        else:
            track.adopted_resume += c0
        self.counters["hits"] += c0

    def count_preemptions(self, before: dict) -> int:
        """Preemptions this step (per request, from vLLM's counts before it)."""
        num = 0
        for rid, k in before.items():
            delta = self.scheduler.requests[rid].num_preemptions - k
            self.tracks[rid].preemptions += delta
            num += delta
        self.counters["preemptions"] += num
        return num

    def record_outputs(self, output) -> None:
        """First-token and finish times of the requests that sampled a token this step."""
        for rid, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
            if not tokens:
                continue
            track = self.tracks[rid]
            track.output += 1
            self.counters["generation"] += 1
            if track.output == 1:
                track.first = self.clock
            req = self.scheduler.requests.get(rid)
            if req is None or req.is_finished():
                track.finish = self.clock
                self.finished += 1

    def step(self, ask_seconds) -> None:
        """schedule(), price the batch, update_from_output(), advance the clock, record."""
        from experiments.runners import vllm_standins as standins

        s, t0 = self.scheduler, self.clock
        before = {rid: s.requests[rid].num_preemptions for rid in self.tracks
                  if rid in s.requests}
        out = s.schedule()
        if not out.num_scheduled_tokens:
            state = [(r.request_id, r.status.name, r.num_computed_tokens, r.num_tokens,
                      r.num_output_placeholders) for r in s.running]
            raise RuntimeError(f"step {len(self.steps['step']) + 1}: vLLM scheduled nothing "
                               f"with {len(s.waiting)} waiting; running {state}")
        new, ctx, (initial, resume, decode, *batch, admitted) = self.account(out, t0)
        num_preempted = self.count_preemptions(before)
        self.counters["prompt"] += initial + resume
        seconds = ask_seconds(new, ctx)
        output = standins.model_runner_output(s, out, self.token_of)
        s.update_from_output(out, output)
        self.clock = t0 + seconds
        self.record_outputs(output)
        row = (len(self.steps["step"]) + 1, t0, seconds, len(output.req_ids), len(s.running),
               len(s.waiting) + len(s.kv_holding_waiting), initial, resume, decode,
               num_preempted, admitted, *batch)
        for key, value in zip(self.steps, row, strict=True):
            self.steps[key].append(value)
        self.poll()

    def result(self) -> dict:
        requests = [t.record() for t in sorted(self.tracks.values(), key=lambda t: t.rid)]
        c = self.counters
        return {"requests": requests, "steps": self.steps, "poller": self.poller,
                "clock_s": self.clock, "preemptions": c["preemptions"],
                "prefix_hit_tokens": c["hits"], "prefill_tokens_computed": c["prompt"]}


def serve(scheduler, vc, init: dict, ask_seconds) -> dict:
    """Run the workload through the scheduler; `ask_seconds(new, ctx)` prices a step."""
    run = _Run(scheduler, vc, init)
    while run.finished < run.n:
        run.release_arrivals()
        if not scheduler.get_num_unfinished_requests():
            run.clock = run.pending[0]["arrival_s"]  # idle: jump to the next arrival
            run.poll()
            continue
        run.step(ask_seconds)
    return run.result()


def main() -> None:
    """Serve one cell (stdin protocol); `--settings`: only vLLM's settings for each init of
    a JSON list on stdin; `--hashes`: the mirrored functions' source hashes."""
    proto = _protocol_stream()
    if sys.argv[1:] == ["--hashes"]:
        from experiments.runners.vllm_standins import source_hashes

        proto.write(json.dumps(source_hashes()) + "\n")
        return
    if sys.argv[1:] == ["--settings"]:
        inits = json.loads(sys.stdin.read())
        proto.write(json.dumps([build_scheduler(init)[2] for init in inits]) + "\n")
        return
    init = json.loads(sys.stdin.readline())
    scheduler, vc, settings = build_scheduler(init)
    proto.write(json.dumps({"ready": settings}) + "\n")

    def ask_seconds(new, ctx):
        proto.write(json.dumps({"step": [new, ctx]}) + "\n")
        return float(sys.stdin.readline())

    result = serve(scheduler, vc, init, ask_seconds)
    proto.write(json.dumps({"done": result}) + "\n")


if __name__ == "__main__":
    main()
