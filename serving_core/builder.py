"""The one engine builder: an `EngineSpec` in, a ready `Engine` out.

Every path that serves requests builds its engine here: a simulated cell, the
in-process torch engine, the HTTP server (which receives the spec as JSON),
continuation, calibration and the benchmarks. The executor is chosen from
`EXECUTORS` by the spec's `executor.kind`, the way a serving engine picks its
executor class from its config; the clock from the spec (or the executor's
default). After building, the engine's effective rules are read back from its
parts and compared with the spec's requested rules: an engine that would run
other rules than asked is refused before it serves anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from serving_core.engine import Engine
from serving_core.engine_spec import EngineSpec, check_effective, rule_sections
from serving_core.executor.base import EXECUTOR_RULE_KEYS
from serving_core.executor.clocks import CLOCK_CLASSES
from serving_core.geometry import Geometry
from serving_core.memory import MemoryOrganization, build_memory, org_class
from serving_core.records import Recorder


def _step_model(spec: EngineSpec, geometry: Geometry):
    from serving_core.executor.simulated import build_step_model

    if not spec.executor.profile:
        raise ValueError(f"executor.kind={spec.executor.kind}: a device profile is required")
    return build_step_model(geometry, dict(spec.executor.profile), spec.org,
                            spec.executor.indirection_overhead)


def _simulated(spec: EngineSpec, geometry: Geometry, mem: MemoryOrganization, *,
               step_model=None, model=None):
    from serving_core.executor.modelled import SimulatedExecutor

    return SimulatedExecutor(step_model or _step_model(spec, geometry))


def _paced(spec: EngineSpec, geometry: Geometry, mem: MemoryOrganization, *,
           step_model=None, model=None):
    from serving_core.executor.modelled import PacedExecutor

    return PacedExecutor(step_model or _step_model(spec, geometry))


def _torch(spec: EngineSpec, geometry: Geometry, mem: MemoryOrganization, *,
           step_model=None, model=None):
    """The model (loaded from the spec's checkpoint unless given) over the pools' arenas."""
    from serving_core.executor.state_arena import StateArena
    from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
    from serving_core.executor.torch_executor import TorchExecutor

    if not geometry.has_recurrent:
        raise ValueError(f"model={geometry.name!r}: the torch executor serves hybrid models only")
    ex = spec.executor
    if model is None:
        from serving_core.model.loader import load_model

        tcfg = TorchExecutorConfig(str(ex.checkpoint), ex.device, ex.dtype,
                                   spec.scheduler.max_num_batched_tokens)
        check_checkpoint(tcfg, geometry)
        try:
            model = load_model(tcfg.checkpoint, tcfg.device, tcfg.dtype, ex.scan_chunk)
        except Exception as err:  # corrupt weights, wrong shapes: the folder does not load
            raise RuntimeError(f"executor.checkpoint={tcfg.checkpoint!r}: the checkpoint does "
                               f"not load ({type(err).__name__}: {err})") from None
    return TorchExecutor(model, StateArena(mem, geometry, model.device),
                         prefill_batch_tokens=ex.prefill_batch_tokens)


def _vocab_size(executor) -> int:
    """Token ids the engine produces: the model's vocabulary, or the synthetic token space."""
    from serving_core.request import GENERATED_TOKEN_SPACE

    model = getattr(executor, "model", None)
    return int(model.cfg["vocab_size"]) if model is not None else GENERATED_TOKEN_SPACE


# executor.kind -> factory(spec, geometry, memory, step_model=, model=) -> executor
EXECUTORS: dict[str, Callable[..., Any]] = {
    "simulated": _simulated,
    "paced": _paced,
    "torch": _torch,
}


def _host_tier(spec: EngineSpec, executor, geometry, mem, clock):
    """A host tier of the spec's capacity for the engine over `executor`: real copies
    through the arena's copier on a worker thread (torch), or the profile's host-link
    model (simulated: `host_link_bandwidth_Bps`, `host_link_latency_s`). The tier itself
    never touches the arena."""
    from serving_core.host_tier import EngineTier, HostTier

    tier = HostTier(spec.host_tier.capacity_bytes, poison=spec.host_tier.poison)
    if spec.executor.kind == "torch":
        from serving_core.executor.state_copy import ArenaCopier, ThreadCopier

        copier = ArenaCopier(executor.arena)
        return EngineTier(tier, copier, ThreadCopier(copier))
    from serving_core.executor.profiles import load_device_profile
    from serving_core.executor.state_copy import ModelledCopier

    if not spec.executor.profile:
        raise ValueError("host_tier: a simulated host tier needs the executor profile's host "
                         "link (host_link_bandwidth_Bps, host_link_latency_s)")
    profile = load_device_profile(spec.executor.profile)
    link = ModelledCopier(mem, geometry, profile.host_link_bandwidth_Bps,
                          profile.host_link_latency_s, clock.now)
    return EngineTier(tier, link, link)


def _assemble(spec: EngineSpec, make_executor, on_step=None) -> Engine:
    """Geometry, pools, recorder and memory organization of `spec`, the executor
    `make_executor(geometry, memory)` makes over them, the host tier when the spec asks
    for one, the clock, and the Engine around them."""
    geometry = spec.geometry()
    units = spec.units(geometry)
    recorder = Recorder(trace=spec.trace, slab=org_class(spec.org).has_slabs)
    mem = build_memory(geometry, spec.org, units, recorder, spec.allocator)
    executor = make_executor(geometry, mem)
    clock = CLOCK_CLASSES[spec.clock_kind]()
    return Engine(
        spec, geometry, mem, recorder, executor, clock,
        vocab_size=_vocab_size(executor),
        host_tier=(_host_tier(spec, executor, geometry, mem, clock)
                   if spec.host_tier is not None else None), on_step=on_step,
    )


def build_engine(spec: EngineSpec, *, on_step=None, step_model=None, model=None,
                 check: bool = True) -> Engine:
    """The engine `spec` describes.

    step_model: a step-time model object in place of the profile's (tests, fits);
    model: an already loaded torch model in place of the spec's checkpoint (one model
    shared by many engines); on_step(scheduler, memory): per-step hook (invariants).
    With `check`, refuse (ValueError, one line) an engine whose effective rules differ
    from the spec's requested rules.
    """
    factory = EXECUTORS.get(spec.executor.kind)
    if factory is None:
        raise ValueError(f"executor.kind={spec.executor.kind!r}: built here are "
                         f"{', '.join(EXECUTORS)}")
    engine = _assemble(
        spec, lambda geometry, mem: factory(spec, geometry, mem, step_model=step_model,
                                            model=model),
        on_step=on_step,
    )
    if check:
        requested = spec.requested_rules()
        if step_model is not None:
            requested["step_model"] = getattr(step_model, "kind", type(step_model).__name__)
        check_effective(requested, engine.effective_rules())
    return engine


def loaded_model_spec(model, geometry: Geometry, org: str, budget: str,
                      rules: Mapping[str, Any], *, clock: str | None = "virtual",
                      trace: bool = False,
                      pool_units: Mapping[str, int] | None = None) -> EngineSpec:
    """The spec of a torch engine over an already loaded `model` (benchmarks, checks that
    share one model across engines), running `rules` (rule name -> value, any layer's):
    pass the model to build_engine(spec, model=model)."""
    from dataclasses import asdict

    return replace(EngineSpec.from_dict({
        "model": asdict(geometry), "org": org, "budget": budget,
        "executor": {"kind": "torch", "checkpoint": "<in-memory model>",
                     "device": str(model.device),
                     "dtype": str(model.dtype).removeprefix("torch."),
                     "scan_chunk": int(model.chunk)},
        "clock": clock, "trace": trace, "pool_units": pool_units,
    }), **rule_sections(**rules))


class _Unbuilt:
    """Stands in for an executor in `preflight`: runs nothing, describes nothing, holds no
    state (a host tier over it is never used: a preflight engine is never stepped)."""

    reads_state = False
    arena = None

    def execute(self, plan, checkpoint_writes):
        raise RuntimeError("preflight engines do not run")

    def commit(self, plan) -> None:
        pass

    def describe(self) -> dict:
        return {}


def preflight(spec: EngineSpec) -> dict[str, Any]:
    """Check, before a run starts, that the engine `spec` describes runs the requested
    rules (ValueError, one line); return its effective rules. Modelled executors are
    built in full (cheap); a torch engine is built without its model, so its executor's
    own keys are checked when the run builds it."""
    if spec.executor.kind in ("simulated", "paced"):
        return build_engine(spec).effective_rules()
    engine = _assemble(spec, lambda geometry, mem: _Unbuilt())
    effective = engine.effective_rules()
    requested = {k: v for k, v in spec.requested_rules().items()
                 if k not in EXECUTOR_RULE_KEYS}
    check_effective(requested, effective)
    return effective
