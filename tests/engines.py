"""Engines for tests, built the one way every path builds them: an EngineSpec through
serving_core.builder.build_engine (which checks the engine runs the requested rules).

The tests hand in what a run config would resolve: a geometry, an organization, explicit
pool units and the rules (a SchedulerConfig, or {section: rule dataclass} from
serving_core.engine_spec.rule_sections for rules of several layers), plus a step-time
model object (modelled executors) or an already loaded model (torch).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import Engine, EngineResult, serve
from serving_core.engine_spec import EngineSpec, ExecutorSpec
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget, units_for
from serving_core.records import record_produced
from serving_core.scheduler import SchedulerConfig
from serving_core.server.runtime import ServedSpec

Spec = ServedSpec  # a request as the engine reads it (greedy, EOS ignored)


def prompt_set(seed: int, context: int, suffixes) -> list[np.ndarray]:
    """A shared random document of `context` tokens, then one random question per suffix
    length (token ids below 128,256)."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 128_256, context)
    return [np.concatenate([ctx, rng.integers(0, 128_256, n)]).astype(np.int32) for n in suffixes]


def _sections(rules) -> dict:
    """{section: rule dataclass} of a SchedulerConfig or of rule_sections' mapping."""
    return dict(rules) if isinstance(rules, dict) else {"scheduler": rules}


def simulated_engine(geometry, org: str, pool_units: dict[str, int], sched_cfg, step_model, *,
                     kind: str = "simulated", clock: str | None = None, trace: bool = False,
                     budget: str = "explicit", on_step=None) -> Engine:
    """A modelled engine (`kind` simulated or paced) running `step_model`; `clock`
    virtual | wall | None (the kind's default)."""
    spec = EngineSpec(model=asdict(geometry), org=org, budget=budget,
                      **_sections(sched_cfg), executor=ExecutorSpec(kind), clock=clock,
                      trace=trace, pool_units=pool_units)
    return build_engine(spec, on_step=on_step, step_model=step_model)


def run_simulated(geometry, org: str, pool_units: dict[str, int], sched_cfg, specs,
                  step_model, *, trace: bool = False, budget: str = "explicit",
                  max_steps: int | None = None, on_step=None) -> EngineResult:
    """Serve `specs` (RequestSpec, arrival order) on the simulated executor."""
    engine = simulated_engine(geometry, org, pool_units, sched_cfg, step_model, trace=trace,
                              budget=budget, on_step=on_step)
    return serve(engine, specs, max_steps)


def torch_engine(model, geometry, org: str, pool_units: dict[str, int], sched_cfg, *,
                 clock: str | None = None, trace: bool = False, budget: str = "explicit",
                 on_step=None, host_tier: dict | None = None) -> Engine:
    """A torch engine over an already loaded `model` (`clock` virtual | wall | None:
    the torch executor's default, wall; `host_tier`: {capacity_bytes: N} or None)."""
    flat = {k: v for rules in _sections(sched_cfg).values() for k, v in asdict(rules).items()}
    spec = loaded_model_spec(model, geometry, org, budget, flat, clock=clock,
                             trace=trace, pool_units=pool_units)
    if host_tier is not None:
        spec = replace(spec, host_tier=host_tier)
    return build_engine(spec, on_step=on_step, model=model)


def serve_greedy(model, preset: str, org: str, budget: str, specs, max_tokens: int = 2048,
                 cap: int = 4, **rules) -> tuple[EngineResult, dict[int, list[int]]]:
    """Serve `specs` greedily on a virtual clock with the preset's pools at `budget`; the
    result and each request's produced tokens."""
    geometry = load_geometry(preset)
    units = units_for(plan_budget(geometry, budget), org)
    engine = torch_engine(model, geometry, org, units,
                          SchedulerConfig(cap=cap, max_num_batched_tokens=max_tokens, **rules),
                          clock="virtual")
    produced = record_produced(engine)
    return serve(engine, specs), produced
