"""executor=vllm: one cell served by a real vLLM OpenAI server, the same client and poller.

Per run: start `python -m vllm.entrypoints.openai.api_server` from the vLLM venv on a
free 127.0.0.1 port with the checkpoint (token-id prompts, so no tokenizer:
`--skip-tokenizer-init`), wait for /health (boot is outside the episode and measured),
read vLLM's version (/version) and effective cache configuration (the
`vllm:cache_config_info` metric and the boot log), send the workload with the streaming
client (greedy, ignore_eos, exact max_tokens, cache_salt for ISOLATE, no seeds), poll
/metrics every second, then stop the server's whole process group, on failure too.

vLLM's organization is N0 (one page size for attention and Mamba layers), so the arm is
`org=n0`. The memory budget is matched by giving vLLM the same per-layer bytes as our
organizations (`--kv-cache-memory-bytes` = nominal bytes x layers) and recording the
blocks it allocated. vLLM exports no per-event trace, slab or step records: those tables
are not applicable (named in the runs row's engine_config), never written as zeros; the
requests' per-request preemption and episode counts are not exported either and are -1.
"""

from __future__ import annotations

import math
import numbers
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving_core.executor.torch_config import checked_model_fields

# The HTTP client, the metrics parser and the server/episode helpers are imported where a
# vLLM run uses them: a simulated run imports this module (its executor check) and must not
# pay for them.

VLLM_KIND = "vllm"
VLLM_ORG = "n0"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PYTHON_ENV = "HSL_VLLM_PYTHON"
# The plugin (vllm_plugin/, installed by `make setup-vllm`) and its switch and log line.
PLUGIN_SWITCH = "HSL_VLLM_CPU_MAMBA2_FIX"
PLUGIN_APPLIED = "hsl: CPU Mamba2 prefix-caching workaround applied"
NOT_APPLICABLE = ("trace", "slab", "steps")  # tables vLLM has no records for

_FIELDS = ("name", "kind", "checkpoint", "python", "device", "dtype", "max_num_batched_tokens",
           "prefix_caching", "cpu_mamba2_fix", "retention_interval", "enforce_eager",
           "boot_timeout_s")
# retention_interval=block: a checkpoint at every block boundary, as N0 in the simulator
# (vLLM's default 0 keeps only "semantic" checkpoints: replay boundaries, shared-prefix
# junctions found when a second request arrives).
BLOCK_RETENTION = "block"
_BLOCK_RE = re.compile(r"Setting attention block size to (\d+) tokens")
_PAD_RE = re.compile(r"Padding mamba page size by ([0-9.]+)%")
_MODE_RE = re.compile(r"Mamba cache mode is set to '(\w+)'")
_ERROR_RE = re.compile(r"\b[A-Z]\w*(Error|Exception): ")


@dataclass(frozen=True)
class VllmExecutorConfig:
    checkpoint: str
    python: str = str(DEFAULT_PYTHON)
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    cpu_mamba2_fix: bool = True
    retention_interval: int | str | None = "block"
    enforce_eager: bool = True
    boot_timeout_s: float = 900.0
    name: str = VLLM_KIND


def _flag(data: dict, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"executor.{key}={value!r}: expected true or false")
    return value


def _int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"executor.{name}={value!r}: expected an integer >= {low}")
    return int(value)


def vllm_executor_config(cfg) -> VllmExecutorConfig:
    """Parse and check an executor=vllm node; ValueError names the field."""
    data, dtype = checked_model_fields(cfg, _FIELDS)
    device = str(data.get("device", "cpu"))
    if device not in ("cpu", "cuda"):
        raise ValueError(f"executor.device={device!r}: allowed values are cpu, cuda")
    interval = data.get("retention_interval", BLOCK_RETENTION)
    if interval is not None and interval != BLOCK_RETENTION:
        interval = _int(interval, "retention_interval", 0)
    timeout = data.get("boot_timeout_s", 900.0)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or timeout <= 0:
        raise ValueError(f"executor.boot_timeout_s={timeout!r}: expected a number > 0")
    return VllmExecutorConfig(
        checkpoint=str(data["checkpoint"]),
        python=str(data.get("python") or DEFAULT_PYTHON),
        device=device,
        dtype=dtype,
        max_num_batched_tokens=_int(data.get("max_num_batched_tokens", 2048),
                                    "max_num_batched_tokens", 1),
        prefix_caching=_flag(data, "prefix_caching", True),
        cpu_mamba2_fix=_flag(data, "cpu_mamba2_fix", True),
        retention_interval=interval,
        enforce_eager=_flag(data, "enforce_eager", True),
        boot_timeout_s=float(timeout),
        name=str(data.get("name", VLLM_KIND)),
    )


def check_vllm_cell(vcfg: VllmExecutorConfig, org: str) -> None:
    """Before a run: the arm is N0 and the vLLM interpreter exists (one line each)."""
    if org != VLLM_ORG:
        raise ValueError(f"org={org!r}: executor=vllm serves vLLM's own organization; "
                         f"allowed values are {VLLM_ORG}")
    if not Path(vcfg.python).exists():
        raise ValueError(f"executor.python={vcfg.python!r}: no vLLM interpreter there; run "
                         f"`make setup-vllm` or set {PYTHON_ENV}")


# Ports handed to vLLM come from below the kernel's ephemeral range (ip_local_port_range),
# where no socket the OS numbers itself lands: vLLM binds seconds after it starts, and in
# that window a port 0 choice of the OS's could go to a client's connection, to another
# server started with port 0 or to vLLM's own ZMQ sockets (CI lost one such race).
PORT_FLOOR = 20000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
BIND_RACE = "Address already in use"
BOOT_TRIES = 3


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for vLLM (which takes no port 0): a random one between
    PORT_FLOOR and the ephemeral range's start that binds now; the OS's own choice where
    that range leaves no room."""
    low = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.exists() else 32768
    rng = random.SystemRandom()
    for _ in range(64 if low > PORT_FLOOR + 64 else 0):
        port = rng.randrange(PORT_FLOOR, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_cache_bytes(nominal_layer_bytes: int, num_layers: int) -> int:
    """vLLM's `--kv-cache-memory-bytes` for a budget: the same bytes per storage group as
    ours, times the groups (`num_layers`: Geometry.scope_layers, Falcon-H1's layer count;
    vLLM divides its cache by page x layers of a KV-cache group into blocks)."""
    return int(nominal_layer_bytes) * int(num_layers)


def vllm_command(vcfg: VllmExecutorConfig, *, served_name: str, port: int, cap: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_bytes: int,
                 block_tokens: int) -> list[str]:
    """The vLLM server's command line for one cell."""
    cmd = [vcfg.python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", vcfg.checkpoint, "--served-model-name", served_name,
           "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--dtype", vcfg.dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(cap), "--max-num-batched-tokens", str(max_num_batched_tokens),
           "--kv-cache-memory-bytes", str(kv_bytes), "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if vcfg.prefix_caching else "--no-enable-prefix-caching"]
    if vcfg.prefix_caching and vcfg.retention_interval is not None:
        interval = (block_tokens if vcfg.retention_interval == BLOCK_RETENTION
                    else vcfg.retention_interval)
        cmd += ["--prefix-cache-retention-interval", str(interval)]
    if vcfg.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd


def vllm_env(vcfg: VllmExecutorConfig) -> dict:
    """The server's environment: offline, no usage reports, our budget not overridden by
    the legacy VLLM_CPU_KVCACHE_SPACE, and the workaround's switch."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", PLUGIN_SWITCH: "1" if vcfg.cpu_mamba2_fix else "0"})
    return env


def cache_config_info(metrics_text: str) -> dict:
    """The labels of vLLM's `vllm:cache_config_info` gauge (its effective CacheConfig)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise ValueError("vllm:cache_config_info not found in /metrics")


def boot_log_facts(log: str) -> dict:
    """What only the boot log says: the enlarged block, the Mamba page padding, the cache
    mode, and whether our CPU workaround was applied in the worker."""
    block = _BLOCK_RE.search(log)
    pad = _PAD_RE.search(log)
    mode = _MODE_RE.search(log)
    return {
        "log_block_size": int(block.group(1)) if block else -1,
        "page_padding_percent": float(pad.group(1)) if pad else 0.0,
        "log_cache_mode": mode.group(1) if mode else "",
        "cpu_mamba2_fix_applied": PLUGIN_APPLIED in log,
    }


def first_error(log: str) -> str:
    """The first exception line of the server log ("IndexError: ..."), "" if none."""
    for line in log.splitlines():
        if _ERROR_RE.search(line):
            return line.strip()
    return ""


def effective_cache(info: dict, facts: dict, *, kv_bytes: int, kv_token_bytes: int,
                    num_layers: int) -> dict:
    """Block size, blocks, page bytes and allocated bytes as vLLM resolved them."""
    block = int(info["block_size"])
    blocks = int(info["num_gpu_blocks"])
    page = block * kv_token_bytes  # one layer's page: the attention block's KV bytes
    return {
        "block_size": block,
        "num_blocks": blocks,
        "page_bytes": page,
        "page_padding_percent": facts["page_padding_percent"],
        "cache_mode": info.get("mamba_cache_mode", ""),
        "prefix_caching": info.get("enable_prefix_caching") == "True",
        "retention_interval": int(info.get("prefix_cache_retention_interval", "0")),
        "kv_cache_memory_bytes_requested": kv_bytes,
        "kv_cache_memory_bytes_allocated": blocks * page * num_layers,
        "kv_cache_size_tokens": int(info.get("kv_cache_size_tokens", "-1")),
        "cpu_mamba2_fix_applied": facts["cpu_mamba2_fix_applied"],
    }


def engine_summary(poller_cols: dict) -> dict:
    """Engine-side counts from the last scrape (vLLM's cumulative counters) and maxima.

    prefill_tokens_computed = prompt tokens - prefix-cache hit tokens (vLLM counts hits
    per scheduling, a resumed request's included)."""
    def last(col):
        vals = [v for v in poller_cols[col] if v >= 0]
        return vals[-1] if vals else -1

    hits, prompt = last("prefix_hit_tokens_total"), last("prompt_tokens_total")
    return {
        "preemptions": last("preemptions_total"),
        "prefix_hit_tokens": hits,
        "prefill_tokens_computed": prompt - hits if prompt >= 0 and hits >= 0 else -1,
        "max_running": max(poller_cols["running"], default=-1),
        "max_waiting": max(poller_cols["waiting"], default=-1),
    }


@dataclass
class VllmServed:
    """Tables, summary, allocated units and effective configuration of one vLLM run."""

    tables: dict
    summary: dict
    units: dict
    engine_config: dict = field(default_factory=dict)
    memory: object = None


def request_extra() -> dict:
    """vLLM-specific request fields: greedy, token ids in the stream, final usage (with
    cached prompt tokens). No per-request seed (it crashed vLLM 0.32 on CPU)."""
    return {"temperature": 0.0, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


def _requests(specs, records) -> dict[str, list]:
    """The requests table from the client's records: vLLM reports each request's cached
    prompt tokens (adopted prefix) and not its resumes, preemptions or episodes (-1)."""
    from experiments.runners.http_run import request_table

    no_server = {c: [] for c in ("start_s", "adopted_prefix_tokens", "resume_adopted_tokens",
                                 "preemptions", "episodes", "request_id")}
    requests = request_table(specs, records, no_server, 0.0)
    requests["adopted_prefix_tokens"] = [r.cached_prompt_tokens for r in records]
    for col in ("resume_adopted_tokens", "preemptions", "episodes"):
        requests[col] = [-1] * len(records)  # not exported by vLLM
    return requests


def _boot(vcfg: VllmExecutorConfig, served_name: str, **limits):
    """vLLM's server process, started and healthy on a free port, and its base URL. A start
    that lost its port to another process between `free_port` and vLLM's bind is retried on
    a new port (BOOT_TRIES starts in all); any other failed start is raised as it is."""
    from experiments.runners.server_process import ServerError, ServerProcess

    for attempt in range(1, BOOT_TRIES + 1):
        port = free_port()
        cmd = vllm_command(vcfg, served_name=served_name, port=port, **limits)
        base_url = f"http://127.0.0.1:{port}"
        srv = ServerProcess(cmd, base_url=base_url, health_timeout_s=vcfg.boot_timeout_s,
                            env=vllm_env(vcfg))
        try:
            return srv.start(), base_url
        except ServerError:
            lost_port = BIND_RACE in srv.log_text()
            srv.__exit__(ServerError, None, None)  # stopped by start(); its log removed
            if attempt == BOOT_TRIES or not lost_port:
                raise


def serve_on_vllm(vcfg: VllmExecutorConfig, specs, *, served_name: str, cap: int,
                  max_num_batched_tokens: int, max_model_len: int, kv_bytes: int,
                  kv_token_bytes: int, num_layers: int, block_tokens: int) -> VllmServed:
    """Boot vLLM, run the workload, stop it (always); the run's tables and summary."""
    import asyncio

    import httpx

    from experiments.runners.http_run import (
        request_paths_table,
        run_episode,
        summarize_client,
    )
    from experiments.runners.server_process import ServerError

    wall0 = time.perf_counter()
    srv, base_url = _boot(vcfg, served_name, cap=cap,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, kv_bytes=kv_bytes,
                          block_tokens=block_tokens)
    with srv:
        boot_s = time.perf_counter() - wall0
        boot_err, boot_out = len(srv.log_text()), len(srv.stdout_lines)
        version = httpx.get(base_url + "/version", timeout=10.0).json()["version"]
        info = cache_config_info(httpx.get(base_url + "/metrics", timeout=10.0).text)
        t0 = time.perf_counter()  # episode start: boot excluded
        records, poller = asyncio.run(run_episode(base_url, VLLM_KIND, specs, t0,
                                                   model=served_name, extra=request_extra()))
        episode_end = math.ceil(time.perf_counter() - t0)
        failed = [r for r in records if not r.ok]
        err_text, out_lines = srv.log_text(), srv.stdout_lines
        log = err_text + "\n".join(out_lines)
        after_boot = err_text[boot_err:] + "\n".join(out_lines[boot_out:])
        code = srv.stop()
        if failed:
            first = failed[0]
            raise ServerError(
                f"vLLM: {len(failed)}/{len(records)} requests failed; first: request "
                f"{first.request_id}: {first.error or first.finish_reason or 'no finish'}; "
                f"server error: {first_error(after_boot) or srv.stderr_tail()}")
    facts = boot_log_facts(log)
    cache = effective_cache(info, facts, kv_bytes=kv_bytes, kv_token_bytes=kv_token_bytes,
                            num_layers=num_layers)
    requests = _requests(specs, records)
    summary = summarize_client(records, episode_end, time.perf_counter() - wall0)
    summary.update(engine_summary(poller.columns))
    summary["poller_errors"] = poller.errors
    engine_config = {
        "engine": "vllm", "version": version, "boot_s": round(boot_s, 2), "exit_code": code,
        "enforce_eager": vcfg.enforce_eager, **cache,
        "not_applicable": list(NOT_APPLICABLE),
        "requests_not_exported": ["start_s", "resume_adopted_tokens", "preemptions",
                                  "episodes"],
    }
    return VllmServed({"requests": requests, "poller": poller.columns,
                      "footprint": poller.footprint,
                      "request_paths": request_paths_table(records)}, summary,
                      {"shared": cache["num_blocks"]}, engine_config)


def run_cell_on_vllm(cfg, vcfg: VllmExecutorConfig, geometry, sched_cfg, specs) -> VllmServed:
    """executor=vllm: the cell's workload through a vLLM server at the cell's budget."""
    from serving_core.memory.n0 import N0_BLOCK_ALIGNMENT, N0_CPU_BLOCK_ALIGNMENT, n0_layout
    from serving_core.planner import plan_budget

    plan = plan_budget(geometry, str(cfg.budget))
    align = N0_CPU_BLOCK_ALIGNMENT if vcfg.device == "cpu" else N0_BLOCK_ALIGNMENT
    layers = geometry.scope_layers  # copies of the storage group (Falcon-H1: its layers)
    return serve_on_vllm(
        vcfg, specs, served_name=str(geometry.name), cap=sched_cfg.cap,
        max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
        max_model_len=int(cfg.model.max_model_len),
        kv_bytes=kv_cache_bytes(plan.nominal_bytes, layers),
        kv_token_bytes=geometry.layer_kv_bytes_per_token, num_layers=layers,
        block_tokens=n0_layout(geometry, align).block_tokens,
    )
