"""From a composed run config to the engine spec every executor path builds from.

`engine_spec(cfg)` is the only translation of the `engine`, `retention`, `executor`,
`model`, `org`, `budget` and `trace` config keys into serving_core's
`EngineSpec`: the simulated cell, the in-process torch engine, the HTTP server
(which receives the spec as JSON) and the validation before a run all use it, so
no path can drop a rule. `executor_path(cfg)` says how the cell is served.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from ledgers.arms import arm
from serving_core.engine_spec import EngineSpec

# How a cell is served (executor config `kind` and `name`).
SIMULATED, TORCH_INPROC, TORCH_HTTP, VLLM = "simulated", "torch_inproc", "torch_http", "vllm"
INPROC_NAME = "torch_inproc"  # executor=torch_inproc: the torch engine in this process


def _plain(node) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return dict(node)


def executor_path(executor_cfg) -> str:
    """simulated | torch_inproc | torch_http | vllm for an executor config node."""
    kind = executor_cfg.get("kind") if hasattr(executor_cfg, "get") else None
    if kind == "vllm":
        return VLLM
    if kind == "torch":
        return TORCH_INPROC if executor_cfg.get("name") == INPROC_NAME else TORCH_HTTP
    return SIMULATED


def engine_spec(cfg: DictConfig) -> EngineSpec:
    """The engine spec of a run config; ValueError names the bad field."""
    a = arm(cfg.org)
    path = executor_path(cfg.executor)
    ex_cfg = _plain(cfg.executor)
    if path in (TORCH_INPROC, TORCH_HTTP):
        from serving_core.executor.torch_config import torch_executor_config

        tcfg = torch_executor_config(cfg.executor)
        default_tokens = tcfg.max_num_batched_tokens
        executor = {"kind": "torch", "checkpoint": tcfg.checkpoint, "device": tcfg.device,
                    "dtype": tcfg.dtype, "scan_chunk": tcfg.scan_chunk,
                    "prefill_batch_tokens": tcfg.prefill_batch_tokens}
    elif path == VLLM:
        default_tokens = int(ex_cfg.get("max_num_batched_tokens") or 2048)
        executor = {"kind": "external"}
    else:
        from serving_core.executor.profiles import load_device_profile

        try:
            profile = load_device_profile(ex_cfg)
        except ValueError as err:
            raise ValueError(f"executor: {err}") from err
        default_tokens = profile.max_num_batched_tokens
        executor = {"kind": "simulated", "profile": ex_cfg,
                    "indirection_overhead": float(cfg.engine.indirection_overhead)}
    eng = cfg.engine
    tokens = eng.max_num_batched_tokens or default_tokens
    scheduler = {
        "cap": int(eng.cap),
        "max_num_batched_tokens": int(tokens),
        "headroom": float(eng.headroom),
        "retention_k": int(cfg.retention.k) if a.retention else None,
        "pinning_k": None if eng.pinning_k is None else int(eng.pinning_k),
    }
    # The other rules as the config gives them; a key the config lacks keeps
    # SchedulerConfig's default (no second spelling of the defaults here).
    for key, convert in _SCHEDULER_RULES.items():
        if key in eng:
            scheduler[key] = eng[key] if convert is None else convert(eng[key])
    if a.cache_policy != "lru":  # a cache-policy arm (ledgers.arms) runs under its policy
        scheduler["cache_policy"] = a.cache_policy
    return EngineSpec.from_dict({
        "model": _plain(cfg.model),
        "org": a.org,
        "budget": str(cfg.budget),
        "scheduler": scheduler,
        "executor": executor,
        "trace": bool(cfg.trace),
        "host_tier": _host_tier(cfg),
    })


def _host_tier(cfg: DictConfig) -> dict | None:
    """host_tier.capacity_bytes -> the spec's host tier (null: none)."""
    section = cfg.get("host_tier")
    capacity = None if section is None else section.get("capacity_bytes")
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ValueError(f"host_tier.capacity_bytes={capacity!r}: allowed integers >= 1")
    return {"capacity_bytes": int(capacity)}


# engine.<key> -> how its value becomes a SchedulerConfig field (None: as it is)
_SCHEDULER_RULES = {
    "admission": str,
    "reserve_output_tokens": int,
    "checkpoint_placement": None,
    "align_chunks": None,
    "slab_policy": str,
    "free_queue": str,
    "checkpoint_recency": str,
    "cache_policy": str,
    "marconi_alpha": None,
    "conv_page_recency": str,
    "release_order": str,
    "duplicates": str,
    "private_blocks": str,
    "interleave": lambda value: None if value is None else _plain(value),
    "split_last_boundary": None,
}
