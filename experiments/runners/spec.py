"""From a composed run config to the engine spec every executor path builds from.

It lives in runners (they build from it; runners do not import config); config/spec.py
re-exports it for validation.

`engine_spec(cfg)` is the only translation of the `engine`, `retention`, `executor`,
`model`, `org`, `budget` and `trace` config keys into serving_core's
`EngineSpec`: the simulated cell, the in-process torch engine, the HTTP server
(which receives the spec as JSON) and the validation before a run all use it, so
no path can drop a rule. `executor_path(cfg)` says how the cell is served.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ledgers.arms import Arm, arm
from serving_core.engine_spec import RULE_SECTIONS, EngineSpec, rule_declarations
from serving_core.rules import declared

# How a cell is served (executor config `kind` and `name`).
SIMULATED, TORCH_INPROC, TORCH_HTTP, VLLM = "simulated", "torch_inproc", "torch_http", "vllm"
VLLM_VIRTUAL = "vllm_virtual"  # vLLM's own scheduler on a virtual clock (our step model)
INPROC_NAME = "torch_inproc"  # executor=torch_inproc: the torch engine in this process


def _plain(node) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return dict(node)


def resolved_config(cfg: DictConfig) -> dict[str, Any] | None:
    """The whole config as plain Python, resolved once for a run's validation and identity
    (engine_spec and run_key take it instead of converting their sections again); None
    where it does not resolve, so the checks that follow name the field as without it."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:
        return None


def _section(cfg: DictConfig, resolved: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """Section `name` of the config as plain Python (from `resolved` where given)."""
    return dict(resolved[name]) if resolved is not None else _plain(cfg[name])


def _plain_value(value):
    """A config value as plain Python (a mapping node as a dict)."""
    return _plain(value) if isinstance(value, DictConfig) else value


def executor_path(executor_cfg) -> str:
    """simulated | torch_inproc | torch_http | vllm | vllm_virtual for an executor config
    node."""
    kind = executor_cfg.get("kind") if hasattr(executor_cfg, "get") else None
    if kind == "vllm":
        return VLLM
    if kind == VLLM_VIRTUAL:
        return VLLM_VIRTUAL
    if kind == "torch":
        return TORCH_INPROC if executor_cfg.get("name") == INPROC_NAME else TORCH_HTTP
    return SIMULATED


def engine_spec(cfg: DictConfig, *, run_arm: Arm | None = None,
                pool_units: Mapping[str, int] | None = None,
                resolved: Mapping[str, Any] | None = None) -> EngineSpec:
    """The engine spec of a run config; ValueError names the bad field. `run_arm`: the
    config's arm, already resolved; `pool_units`: the planner's units, already planned
    (None: the builder plans them from the budget); `resolved`: the config already as plain
    Python (resolved_config; None: its sections are converted here)."""
    a = run_arm or arm(cfg.org)
    executor, default_tokens = _executor(cfg, resolved)
    # Every declared rule the config sets (engine.<name>), routed to the layer that declares
    # it; a key the config lacks keeps its declaration's default (no second spelling here).
    eng = resolved["engine"] if resolved is not None else cfg.engine
    sections: dict[str, dict[str, Any]] = {section: {} for section in RULE_SECTIONS}
    for section, f in rule_declarations():
        if declared(f).config and f.name in eng:
            sections[section][f.name] = _plain_value(eng[f.name])
        if f.name in a.rules:  # the arm's own rules (ledgers.arms), over the config's
            sections[section][f.name] = a.rules[f.name]
    scheduler = sections["scheduler"]
    if scheduler.get("max_num_batched_tokens") is None:  # null: the executor's default
        scheduler["max_num_batched_tokens"] = int(default_tokens)
    scheduler["retention_k"] = cfg.retention.k if a.retention else None
    return EngineSpec.from_dict({
        "model": _section(cfg, resolved, "model"),
        "org": a.org,
        "budget": str(cfg.budget),
        **sections,
        "executor": executor,
        "trace": bool(cfg.trace),
        "host_tier": _host_tier(cfg),
        "pool_units": pool_units,
    })


def _executor(cfg: DictConfig, resolved: Mapping[str, Any] | None = None
              ) -> tuple[dict[str, Any], int]:
    """The spec's executor section of a run config and the executor's default token budget
    of a step (engine.max_num_batched_tokens: null)."""
    path = executor_path(cfg.executor)
    ex_cfg = _section(cfg, resolved, "executor")
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
    elif path == VLLM_VIRTUAL:  # the step model's profile gives the default token budget
        from experiments.runners.vllm_virtual import virtual_executor_config
        from serving_core.executor.profiles import load_device_profile

        vcfg = virtual_executor_config(ex_cfg)
        try:
            profile = load_device_profile(vcfg.device)
        except ValueError as err:
            raise ValueError(f"executor.device: {err}") from err
        default_tokens = vcfg.max_num_batched_tokens or profile.max_num_batched_tokens
        executor = {"kind": "external"}
    else:
        from serving_core.executor.profiles import load_device_profile, resolve_derived

        try:
            ex_cfg = resolve_derived(ex_cfg)
            profile = load_device_profile(ex_cfg)
        except ValueError as err:
            raise ValueError(f"executor: {err}") from err
        default_tokens = profile.max_num_batched_tokens
        executor = {"kind": "simulated", "profile": ex_cfg,
                    "indirection_overhead": float(cfg.engine.indirection_overhead)}
    return executor, default_tokens


def _host_tier(cfg: DictConfig) -> dict | None:
    """host_tier.capacity_bytes -> the spec's host tier (null: none)."""
    section = cfg.get("host_tier")
    capacity = None if section is None else section.get("capacity_bytes")
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ValueError(f"host_tier.capacity_bytes={capacity!r}: allowed integers >= 1")
    return {"capacity_bytes": int(capacity)}
