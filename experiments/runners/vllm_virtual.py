"""executor=vllm_virtual: vLLM's own scheduler and hybrid KV cache manager on a virtual clock.

A worker in the vLLM venv (experiments/runners/vllm_virtual_worker.py) builds vLLM's
`Scheduler` with the `KVCacheConfig` vLLM's own functions derive from the model preset's
public config (transformers' FalconH1Config / GraniteMoeHybridConfig fields), the budget's
bytes and vLLM's knobs; this process feeds it the cell's workload and prices every step it
schedules with the project's step model (the profile named by `executor.device`, e.g. the
calibrated A100, under org n0: what the simulator charges N0 for the same batch), so the
clock is virtual and a difference against N0 is a difference of rules, not of step time.
The run writes our ledgers: requests (admission and resume hits, preemptions, virtual
times), steps (each step's batch composition), poller (1-s samples of vLLM's block pool)
and the runs row, whose engine_config holds the settings read back from vLLM's objects.
No trace or slab records exist (not applicable). Deterministic for a (config, seed): the
worker reads no clock for a decision and runs with a fixed PYTHONHASHSEED.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from experiments.runners.vllm_arm import DEFAULT_PYTHON, PYTHON_ENV, REPO, VllmServed
from experiments.runners.vllm_arm import VLLM_ORG as VIRTUAL_ORG  # vLLM's organization
from serving_core.placement import retention_blocks  # <k>block, as engine.retention_interval

VIRTUAL_KIND = "vllm_virtual"
BLOCK_RETENTION = "block"
PLATFORMS = ("gpu", "cpu")
CACHE_MODES = ("align", "none")  # vLLM 0.32's MambaCacheMode values
NOT_APPLICABLE = ("trace", "slab")
_FIELDS = ("name", "kind", "python", "device", "platform", "prefix_caching",
           "mamba_cache_mode", "retention_interval", "max_num_batched_tokens")
_WORKER = "experiments.runners.vllm_virtual_worker"


@dataclass(frozen=True)
class VirtualExecutorConfig:
    device: str = "a100"  # the step model's profile (conf/executor/<device>.yaml)
    python: str = str(DEFAULT_PYTHON)
    platform: str = "gpu"
    prefix_caching: bool = True
    mamba_cache_mode: str = "align"
    retention_interval: int | str | None = BLOCK_RETENTION
    max_num_batched_tokens: int | None = None
    name: str = VIRTUAL_KIND


def virtual_executor_config(cfg) -> VirtualExecutorConfig:
    """Parse and check an executor=vllm_virtual node; ValueError names the field."""
    data = {k: cfg[k] for k in cfg} if hasattr(cfg, "keys") else dict(cfg)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"executor.{unknown[0]}: unknown key; allowed keys are "
                         f"{', '.join(_FIELDS)}")
    platform = str(data.get("platform", "gpu"))
    if platform not in PLATFORMS:
        raise ValueError(f"executor.platform={platform!r}: allowed values are "
                         f"{', '.join(PLATFORMS)}")
    mode = str(data.get("mamba_cache_mode", "align"))
    if mode not in CACHE_MODES:
        raise ValueError(f"executor.mamba_cache_mode={mode!r}: allowed values are "
                         f"{', '.join(CACHE_MODES)}")
    caching = data.get("prefix_caching", True)
    if not isinstance(caching, bool):
        raise ValueError(f"executor.prefix_caching={caching!r}: expected true or false")
    if caching and mode == "none":
        raise ValueError("executor.mamba_cache_mode='none': vLLM 0.32 runs align whenever "
                         "prefix caching is on; allowed values with prefix_caching=true: align "
                         "(prefix_caching=false runs none)")
    interval = data.get("retention_interval", BLOCK_RETENTION)
    if interval is not None and retention_blocks(interval) == 0 and (
            isinstance(interval, bool) or not isinstance(interval, numbers.Integral)
            or interval < 0):
        raise ValueError(f"executor.retention_interval={interval!r}: allowed values are "
                         "block, null (vLLM's default 0), <k>block (every k blocks, e.g. "
                         "2block) or an integer >= 0 (tokens)")
    tokens = data.get("max_num_batched_tokens")
    if tokens is not None and (isinstance(tokens, bool)
                               or not isinstance(tokens, numbers.Integral) or tokens < 1):
        raise ValueError(f"executor.max_num_batched_tokens={tokens!r}: expected null or an "
                         "integer >= 1")
    return VirtualExecutorConfig(
        device=str(data.get("device", "a100")),
        python=str(data.get("python") or DEFAULT_PYTHON),
        platform=platform, prefix_caching=caching, mamba_cache_mode=mode,
        retention_interval=interval if interval is None or retention_blocks(interval)
        else int(interval),
        max_num_batched_tokens=None if tokens is None else int(tokens),
        name=str(data.get("name", VIRTUAL_KIND)),
    )


def hf_config(geometry) -> dict:
    """The model's public config as transformers names it (model_type and the fields vLLM
    reads for the KV cache): Falcon-H1 (every layer attention and Mamba2 side by side) or
    Granite-4.0-H (a Mamba2 / attention layer pattern). ValueError for other presets."""
    g = geometry
    if g.kv_codec != "bf16":
        raise ValueError(f"model.kv_codec={g.kv_codec!r}: the vLLM arm stores KV as the model "
                         "dtype; allowed bf16")
    if g.state_codec != "auto":
        raise ValueError(f"model.state_codec={g.state_codec!r}: the vLLM arm runs vLLM's "
                         "default Mamba cache dtype; allowed auto")
    kinds = [s.split("+")[0] for s in g.layer_strings]
    common = {
        "hidden_size": g.hidden_size, "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_attention_heads, "num_key_value_heads": g.num_kv_heads,
        "mamba_n_heads": g.mamba_heads, "mamba_d_head": g.mamba_head_dim,
        "mamba_d_state": g.d_state, "mamba_n_groups": g.n_groups, "mamba_d_conv": g.d_conv,
        "max_position_embeddings": g.max_model_len,
    }
    if set(kinds) == {"hybrid"}:
        return {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"],
                **common, "head_dim": g.head_dim, "mamba_d_ssm": g.mamba_heads * g.mamba_head_dim}
    if set(kinds) == {"mamba2", "attention"}:
        inner = g.mamba_heads * g.mamba_head_dim
        if inner % g.hidden_size or g.hidden_size // g.num_attention_heads != g.head_dim:
            raise ValueError(f"model={g.name!r}: not a GraniteMoeHybrid geometry (Mamba2 "
                             "inner width a multiple of hidden, head_dim = hidden / heads)")
        return {"model_type": "granitemoehybrid",
                "architectures": ["GraniteMoeHybridForCausalLM"], **common,
                "mamba_expand": inner // g.hidden_size,
                "layer_types": ["full_attention" if k == "attention" else "linear_attention"
                                for k in kinds],
                "position_embedding_type": "nope"}
    if set(kinds) == {"mamba2", "attention", "mlp"}:
        return nemotron_h_config(g, kinds)
    raise ValueError(f"model={g.name!r}: executor=vllm_virtual builds vLLM's KV cache for "
                     "Falcon-H1 (hybrid layers), Granite-4.0-H (mamba2 / attention layers) or "
                     "Nemotron-H (mamba2 / attention / mlp layers)")


NEMOTRON_PATTERN = {"mamba2": "M", "attention": "*", "mlp": "-"}


def nemotron_h_config(g, kinds: list[str]) -> dict:
    """Nemotron-H's public config (transformers' NemotronHConfig names): one block per
    layer, its kind a letter of hybrid_override_pattern (M Mamba2, * attention, - MLP)."""
    return {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
            "hidden_size": g.hidden_size, "num_hidden_layers": g.num_layers,
            "num_attention_heads": g.num_attention_heads,
            "num_key_value_heads": g.num_kv_heads, "head_dim": g.head_dim,
            "mamba_num_heads": g.mamba_heads, "mamba_head_dim": g.mamba_head_dim,
            "ssm_state_size": g.d_state, "n_groups": g.n_groups, "conv_kernel": g.d_conv,
            "hybrid_override_pattern": "".join(NEMOTRON_PATTERN[k] for k in kinds),
            "max_position_embeddings": g.max_model_len}


def check_virtual_cell(vcfg: VirtualExecutorConfig, org: str, geometry) -> None:
    """Before a run: the arm is N0, the step model's profile loads, the model has a vLLM
    architecture here, the vLLM interpreter exists (one line each)."""
    from serving_core.executor.profiles import load_device_profile

    if org != VIRTUAL_ORG:
        raise ValueError(f"org={org!r}: executor={VIRTUAL_KIND} runs vLLM's own organization; "
                         f"allowed values are {VIRTUAL_ORG}")
    try:
        load_device_profile(vcfg.device)
    except ValueError as err:
        raise ValueError(f"executor.device: {err}") from err
    hf_config(geometry)
    if not Path(vcfg.python).exists():
        raise ValueError(f"executor.python={vcfg.python!r}: no vLLM interpreter there; run "
                         f"`make setup-vllm` or set {PYTHON_ENV}")


def kv_cache_bytes(geometry, budget: str) -> int:
    """vLLM's KV cache bytes for a budget: the per-layer bytes of our organizations times
    the storage groups (vLLM divides by page x layers of a KV cache group)."""
    from serving_core.planner import plan_budget

    return int(plan_budget(geometry, budget).nominal_bytes) * int(geometry.scope_layers)


def worker_env() -> dict:
    """Offline, no usage reports, our budget not overridden, a fixed hash seed."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONHASHSEED": "0", "HSL_VLLM_CPU_MAMBA2_FIX": "0",
                "PYTHONPATH": str(REPO)})
    return env


def init_message(vcfg: VirtualExecutorConfig, geometry, *, budget: str, cap: int,
                 max_num_batched_tokens: int, specs) -> dict:
    """The worker's input: model config, knobs, bytes and workload."""
    from serving_core.request import GENERATED_TOKEN_SPACE

    interval = vcfg.retention_interval
    return {
        "hf_config": hf_config(geometry),
        "dtype": {2: "bfloat16", 4: "float32"}[geometry.dtype_bytes],
        "max_model_len": int(geometry.max_model_len),
        "kv_cache_bytes": kv_cache_bytes(geometry, budget),
        "token_space": int(GENERATED_TOKEN_SPACE),
        "vllm": {
            "platform": vcfg.platform, "prefix_caching": vcfg.prefix_caching,
            "mamba_cache_mode": vcfg.mamba_cache_mode if vcfg.prefix_caching else "none",
            "retention_interval": 0 if interval is None or retention_blocks(interval)
            else interval,
            "retention_block": retention_blocks(interval),
            "max_num_seqs": int(cap), "max_num_batched_tokens": int(max_num_batched_tokens),
        },
        "requests": [{"id": int(s.request_id), "arrival_s": float(s.arrival_s),
                      "prompt": [int(t) for t in s.prompt], "output_tokens": int(s.output_tokens),
                      "salt": str(s.salt)} for s in specs],
    }


class WorkerError(RuntimeError):
    """The vLLM worker failed; the message ends with its stderr's tail."""


def run_worker(python: str, init: dict, price, on_ready=None) -> tuple[dict, dict]:
    """Start the worker, send `init`, pass vLLM's settings to `on_ready`, answer each step
    with `price(new, ctx)` seconds; (vLLM's settings, the run's records)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([python, "-m", _WORKER], cwd=REPO, env=worker_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, bufsize=1)
        try:
            proc.stdin.write(json.dumps(init) + "\n")
            proc.stdin.flush()
            settings = None
            for line in proc.stdout:
                msg = json.loads(line)
                if "step" in msg:
                    proc.stdin.write(repr(float(price(*msg["step"]))) + "\n")
                    proc.stdin.flush()
                elif "ready" in msg:
                    settings = msg["ready"]
                    if on_ready is not None:
                        on_ready(settings)
                elif "done" in msg:
                    proc.stdin.close()
                    if proc.wait(timeout=60) != 0:
                        break
                    return settings, msg["done"]
            proc.wait(timeout=60)
        except (BrokenPipeError, json.JSONDecodeError):
            pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        tail = err.read()[-3000:]
    raise WorkerError(f"vLLM virtual worker exited with code {proc.returncode}: {tail}")


def crossings(new, ctx, block: int) -> int:
    """Block boundaries the step's chunks cross (the composites align mode writes)."""
    return sum((c + n) // block - c // block for n, c in zip(new, ctx, strict=True))


def _tables(specs, done: dict, checkpoint_writes: list[int]) -> dict:
    from serving_core.records import REQUEST_COLUMNS

    by_id = {int(s.request_id): s for s in specs}
    cols = {c: [] for c in REQUEST_COLUMNS}
    for r in done["requests"]:
        spec = by_id[r["id"]]
        n, first, finish = r["output_tokens"], r["first_token_s"], r["finish_s"]
        if n != int(spec.output_tokens) or finish is None:
            raise RuntimeError(f"vLLM virtual worker: request {r['id']} produced {n} of "
                               f"{int(spec.output_tokens)} tokens")
        row = {
            "request_id": r["id"], "arrival_s": r["arrival_s"], "start_s": r["start_s"],
            "first_token_s": first, "finish_s": finish, "prompt_tokens": r["prompt_tokens"],
            "output_tokens": n, "target_output_tokens": int(spec.output_tokens),
            "adopted_prefix_tokens": r["adopted_first"],
            "resume_adopted_tokens": r["adopted_resume"], "preemptions": r["preemptions"],
            "episodes": r["episodes"], "context_id": int(spec.context_id), "salt": spec.salt,
            "ttft_s": first - r["arrival_s"], "e2e_s": finish - r["arrival_s"],
            "tpot_s": (finish - first) / (n - 1) if n > 1 else math.nan,
            "status": "finished",
        }
        for c in REQUEST_COLUMNS:
            cols[c].append(row[c])
    steps = dict(done["steps"])
    steps["checkpoint_writes"] = checkpoint_writes
    poller = dict(done["poller"])
    poller["pool"] = ["shared"] * len(poller["t_s"])
    poller["usage_frac"] = [u / t for u, t in zip(poller["units_used"], poller["units_total"],
                                                   strict=True)]
    return {"requests": cols, "poller": poller, "steps": steps}


def _summary(done: dict, wall: float) -> dict:
    from serving_core.records import mechanism_summary, run_summary

    reqs = done["requests"]
    finish = [r["finish_s"] for r in reqs]
    summary = run_summary(
        arrival_s=[r["arrival_s"] for r in reqs], first_token_s=[r["first_token_s"] for r in reqs],
        finish_s=finish, output_tokens=[r["output_tokens"] for r in reqs],
        done=[True] * len(reqs), episode_end_s=math.ceil(max(finish, default=0.0)),
        sim_seconds=done["clock_s"], wall_seconds=wall)
    poller = done["poller"]
    summary.update({
        "preemptions": done["preemptions"], "prefix_hit_tokens": done["prefix_hit_tokens"],
        "prefill_tokens_computed": done["prefill_tokens_computed"],
        "max_running": max(poller["running"], default=0),
        "max_waiting": max(poller["waiting"], default=0),
    })
    view = [SimpleNamespace(num_prompt=r["prompt_tokens"], adopted_first=r["adopted_first"],
                            num_generated=r["output_tokens"]) for r in reqs]
    summary.update(mechanism_summary(view, len(done["steps"]["step"]), poller,
                                     sum(r["adopted_resume"] for r in reqs)))
    return summary


def serve_on_vllm_virtual(vcfg: VirtualExecutorConfig, geometry, specs, *, budget: str,
                          cap: int, max_num_batched_tokens: int) -> VllmServed:
    """The workload through vLLM's scheduler on a virtual clock; the run's tables."""
    from serving_core.executor.profiles import load_device_profile
    from serving_core.executor.simulated import build_step_model

    profile = load_device_profile(vcfg.device)
    model = build_step_model(geometry, profile, VIRTUAL_ORG)
    wall0 = time.perf_counter()
    init = init_message(vcfg, geometry, budget=budget, cap=cap,
                        max_num_batched_tokens=max_num_batched_tokens, specs=specs)
    block = [0]  # vLLM's Mamba block in align mode (0: no checkpoints), set when ready
    writes: list[int] = []

    def on_ready(settings):
        if settings["prefix_caching"] and settings["mamba_cache_mode"] == "align":
            block[0] = int(settings["mamba_block_size"] or settings["block_size"])

    def price(new, ctx):
        k = crossings(new, ctx, block[0]) if block[0] else 0
        writes.append(k)
        return model.step_seconds(new, ctx, k)

    settings, done = run_worker(vcfg.python, init, price, on_ready)
    align = bool(block[0])
    wall = time.perf_counter() - wall0
    tables = _tables(specs, done, writes)
    engine_config = {
        **settings, "org": "N0", "clock": "virtual", "executor": VIRTUAL_KIND,
        "step_model": getattr(model, "kind", type(model).__name__),
        "profile": profile.name, "checkpoint_writes": "block boundaries crossed"
        if align else "none", "not_applicable": list(NOT_APPLICABLE),
        "cap": int(cap),
    }
    usable = int(settings["num_blocks"]) - 1  # less vLLM's null block, as N0's units
    return VllmServed(tables, _summary(done, wall), {"shared": usable}, engine_config)


def run_cell_on_vllm_virtual(cfg, geometry, sched_cfg, specs) -> VllmServed:
    """executor=vllm_virtual: the cell's workload through vLLM's scheduler at the cell's
    budget, cap and token budget."""
    vcfg = virtual_executor_config(cfg.executor)
    return serve_on_vllm_virtual(vcfg, geometry, specs, budget=str(cfg.budget),
                                 cap=sched_cfg.cap,
                                 max_num_batched_tokens=sched_cfg.max_num_batched_tokens)
