"""Config checks run before any cell starts; every error names the offending field.

`validate_config` builds everything a run derives from its config that is
cheap to build (geometry, budget plan, device profile, engine rules, normalized
workload and load) without building the workload itself, so a campaign can check
all of its cells before launching the first one; it returns the run's plan
(experiments.runners.run_plan.RunPlan), which the run then uses.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.config.spec import (
    SIMULATED,
    TORCH_INPROC,
    VLLM,
    VLLM_VIRTUAL,
    engine_spec,
    executor_path,
)
from experiments.runners.run_plan import RunPlan
from experiments.workloads.workload import normalize_load_config, normalize_workload_config
from ledgers.arms import arm as arm_row
from serving_core.executor.device_fit import check_fits
from serving_core.executor.profiles import load_device_profile
from serving_core.geometry import geometry_from_config
from serving_core.planner import plan_budget, units_for

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # the ledger writer's campaign names


SECTIONS = ("engine", "retention", "load", "workload", "model", "executor", "host_tier")


def _integer(value, field: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{field}={value!r}: allowed integers >= {low}")
    return int(value)


def _flag(value, field: str) -> bool:
    """Booleans are exactly true or false (`maybe`, `no`, `off`, `1` are refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r}: allowed true, false")
    return value


def _positive_finite(value, field: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{field}={value!r}: allowed finite numbers > 0")
    return float(value)


def _optional_integer(value, field: str, low: int) -> int | None:
    return None if value is None else _integer(value, field, low)


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{field}={value!r}: allowed finite numbers")
    return float(value)


def _prefixed(section: str, build, *args):
    try:
        return build(*args)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{section}: {err}") from err


_BUILT: dict[tuple[str, str], Any] = {}  # (section, repr of its resolved values) -> built
_MAX_BUILT = 4096


def _built(section: str, build, node, resolved: Mapping | None):
    """`_prefixed(section, build, node)`, memoized on the section's resolved values (a
    campaign repeats a few model and executor sections over thousands of cells; what is
    built is frozen). Failures are not kept: each cell raises its own error."""
    values = resolved.get(section) if resolved is not None else None
    if not isinstance(values, dict):
        return _prefixed(section, build, node)
    key = (section, repr(values))
    if key not in _BUILT:
        if len(_BUILT) >= _MAX_BUILT:
            _BUILT.clear()
        _BUILT[key] = _prefixed(section, build, node)
    return _BUILT[key]


def _check_sessions_path(workload, path: str) -> None:
    """Sessions (turns that wait on earlier turns) run only in an engine's own loop
    (serving_core.engine.serve): the simulated and in-process paths."""
    if str(workload.get("source", "")).strip().lower() == "sessions" and \
            path not in (SIMULATED, TORCH_INPROC):
        raise ValueError(f"workload.source=sessions: allowed only with executor=a100 (or "
                         f"another simulated profile) or executor=torch_inproc; the {path} "
                         "path has no turn dependencies")


def _check_trace_vocab(workload: dict, model, geometry) -> None:
    """A trace or sessions workload's token ids must lie in the model's vocabulary (where it
    states one)."""
    source = workload["source"]
    key = {"trace": "trace_vocab_size", "sessions": "session_vocab_size"}.get(source)
    if key is None:
        return
    stated = [geometry.vocab_size, *(model.get(section, {}).get("vocab_size", 0)
                                    for section in ("architecture", "count_fields"))]
    vocab = next((int(v) for v in stated if v), 0)
    if vocab and workload[key] > vocab:
        raise ValueError(f"workload.{key}={workload[key]}: allowed "
                         f"integers <= {vocab}, the vocabulary of model={model['name']}")


def check_ledger_root(root: str | os.PathLike) -> Path:
    """Create the ledger root if needed and prove it is writable; return it absolute."""
    path = Path(root).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-", suffix=".tmp"):
            pass
    except OSError as err:
        raise ValueError(f"ledger_root={str(root)!r}: not a writable directory ({err})") from err
    return path.resolve()


def _check_executor(cfg: DictConfig, run_arm, geometry, budget,
                    resolved: Mapping | None = None) -> str:
    """Check the executor the config names against the arm and the model (a simulated
    device must hold the model and its budget); its path."""
    values = cfg if resolved is None else resolved
    path = executor_path(values["executor"])
    _check_sessions_path(values["workload"], path)
    if path == VLLM:  # real vLLM: N0, its interpreter, a matching checkpoint
        from experiments.runners.vllm_arm import check_vllm_cell, vllm_executor_config
        from serving_core.executor.torch_config import check_checkpoint

        device = vllm_executor_config(cfg.executor)
        check_vllm_cell(device, run_arm.name)
        check_checkpoint(device, geometry)
    elif path == VLLM_VIRTUAL:  # vLLM's scheduler on a virtual clock: N0, a vLLM venv
        from experiments.runners.vllm_virtual import check_virtual_cell, virtual_executor_config

        check_virtual_cell(virtual_executor_config(cfg.executor), run_arm.name, geometry)
    elif path != SIMULATED:  # the real executor: its checkpoint must match the model
        from serving_core.executor.torch_config import check_checkpoint, torch_executor_config

        check_checkpoint(torch_executor_config(cfg.executor), geometry)
    else:  # the simulated device must hold the model (serving_core/executor/device_fit.py)
        profile = _built("executor", load_device_profile, cfg.executor, resolved)
        check_fits(geometry, profile, budget.model_nominal_bytes, "executor")
    return path


_ENGINES_CHECKED: set[tuple] = set()  # (spec, organizations) whose preflight passed
_MAX_ENGINES_CHECKED = 4096


def _check_engine(spec) -> None:
    """serving_core.builder.preflight of `spec`, once per distinct spec and registry of
    organizations in this process (a campaign validates thousands of cells with a few
    dozen distinct engines)."""
    from serving_core.builder import preflight
    from serving_core.memory import ORG_TO_CLASS

    # the spec's whole value (a frozen dataclass of plain fields) and the classes it builds
    key = (repr(spec), tuple(ORG_TO_CLASS.items()))
    if key in _ENGINES_CHECKED:
        return
    preflight(spec)
    if len(_ENGINES_CHECKED) >= _MAX_ENGINES_CHECKED:
        _ENGINES_CHECKED.clear()
    _ENGINES_CHECKED.add(key)


def validate_config(cfg: DictConfig, *, check_root: bool = True,
                    preflight: bool = True, resolved: Mapping | None = None) -> RunPlan:
    """The run plan of a cell config (experiments.runners.run_plan); ValueError names the
    first bad field. With `preflight`, the engine the plan describes is checked to run the
    requested rules (a run that builds its engine next checks it there instead).
    `resolved`: the config as plain Python (experiments.runners.spec.resolved_config),
    converted once for this and the run's identity."""
    for section in SECTIONS:
        if not isinstance(cfg.get(section), DictConfig):
            raise ValueError(f"{section}={cfg.get(section)!r}: allowed a config group or "
                             f"{section}.<key>=value overrides, not a value")
    if resolved is None:
        return _plan(cfg, cfg, check_root, preflight, None)
    try:  # plain Python reads are ~30x cheaper than OmegaConf's
        return _plan(cfg, resolved, check_root, preflight, resolved)
    except KeyError:  # a deleted key: read from the config, which names it as OmegaConf does
        return _plan(cfg, cfg, check_root, preflight, None)


def _plan(cfg: DictConfig, v: Mapping, check_root: bool, preflight: bool,
          resolved: Mapping | None) -> RunPlan:
    """validate_config's checks, reading values from `v` (`cfg` or it as plain Python)."""
    run_arm = arm_row(v["org"])
    _integer(v["seed"], "seed", 0)
    _integer(v["replicate"], "replicate", 0)
    _flag(v["trace"], "trace")
    _flag(v["write_ledgers"], "write_ledgers")
    name = v["campaign_name"]
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"campaign_name={name!r}: allowed letters, digits, '_', '.', '-' (not leading)"
        )
    if not isinstance(v["question"], str):
        raise ValueError(f"question={v['question']!r}: expected a string")
    geometry = _built("model", geometry_from_config, cfg.model, resolved)
    budget = plan_budget(geometry, str(v["budget"]))  # planned once for the run
    units = units_for(budget, run_arm.org)  # refuses an org the layer pattern does not fit
    # (serving_core/planner.py, refusals)
    path = _check_executor(cfg, run_arm, geometry, budget, resolved)
    _number(v["engine"]["indirection_overhead"], "engine.indirection_overhead")
    _integer(v["retention"]["k"], "retention.k", 1)
    unknown = sorted(set(v["host_tier"]) - {"capacity_bytes"})
    if unknown:
        raise ValueError(f"host_tier.{unknown[0]}: unknown key; allowed keys are capacity_bytes")
    _optional_integer(v["host_tier"]["capacity_bytes"], "host_tier.capacity_bytes", 1)
    if v["host_tier"]["capacity_bytes"] is not None and path in (VLLM, VLLM_VIRTUAL):
        raise ValueError("host_tier.capacity_bytes: the vLLM arm runs no host tier of ours; "
                         "allowed null")
    # every engine rule is checked by its declaration (serving_core/rules.py) here
    plan = RunPlan(run_arm, path, geometry, budget,
                   engine_spec(cfg, run_arm=run_arm, pool_units=units, resolved=resolved))
    if preflight and path not in (VLLM, VLLM_VIRTUAL):
        _check_engine(plan.spec)  # the engine would run the requested rules, or it is refused
    _check_trace_vocab(normalize_workload_config(v["workload"]), v["model"], geometry)
    for key in ("rate", "on_s"):  # rate=inf would put every arrival at t = 0
        if key in v["load"]:
            _positive_finite(v["load"][key], f"load.{key}")
    off = v["load"].get("off_s", 0.0)
    if isinstance(off, numbers.Real) and not math.isfinite(off):
        raise ValueError(f"load.off_s={off!r}: allowed finite numbers >= 0")
    normalize_load_config(v["load"])
    if check_root and v["write_ledgers"]:
        check_ledger_root(v["ledger_root"])
    return plan
