"""Stage 4: one short real cell beside the same cell simulated with the fitted profile.

The workload is generated here, seeded (the ShareGPT workload of experiments/workloads/
needs packages and a token cache the device does not have): `cell_requests` requests, half
of them opening with one of four shared contexts of `cell_context_tokens` tokens (so
prefix reuse, and with it C_once, depends on the organization), own prompt tokens and
output lengths uniform in the plan's ranges, Poisson arrivals. The arrival rate is scaled
to the device: `cell_load` times the capacity the fitted profile predicts for this
workload (requests per second of the same cell simulated with every request at t = 0),
at least `cell_requests / cell_max_span_s` (the run stays inside its time limit even when
the fit predicts a slow device; the result says when the floor applied).

Both runs use one EngineSpec but for the executor: the real run is the torch executor on
the device on a wall clock, the simulated one the fitted profile on a virtual clock.
Reported both ways: output throughput (tokens per second of the episode), C_once, TTFT p99,
completed requests, preemptions and steps; for the real run also its effective rules
(device, dtype, decode attention), read back from the engine.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import serve
from serving_core.engine_spec import EngineSpec
from serving_core.geometry import Geometry
from serving_core.server.runtime import ServedSpec as Spec

METRICS = ("throughput_ledger", "throughput_span", "c_once_tokens", "ttft_p50", "ttft_p99",
           "e2e_p99", "completed", "output_tokens", "preemptions", "engine_steps",
           "prefix_hit_tokens")
SEED = 32


def workload(plan, rate: float | None, seed: int = SEED) -> list[Spec]:
    """The cell's requests; every arrival at 0 when `rate` is None."""
    rng = np.random.default_rng(seed)
    contexts = [rng.integers(0, 128_256, plan.cell_context_tokens) for _ in range(4)]
    n = plan.cell_requests
    shared = rng.random(n) < 0.5
    which = rng.integers(0, 4, n)
    own = rng.integers(plan.cell_suffix[0], plan.cell_suffix[1] + 1, n)
    outputs = rng.integers(plan.cell_output[0], plan.cell_output[1] + 1, n)
    gaps = rng.exponential(1.0, n)
    arrivals = np.zeros(n) if rate is None else np.cumsum(gaps) / rate
    specs = []
    for i in range(n):
        body = rng.integers(0, 128_256, int(own[i]))
        prompt = np.concatenate([contexts[which[i]], body]) if shared[i] else body
        specs.append(Spec(i, float(arrivals[i]), prompt.astype(np.int32), int(outputs[i]),
                          int(which[i]) if shared[i] else -1))
    return specs


def _scheduler(plan) -> dict:
    """The cell's scheduler fields (the rest: SchedulerConfig's defaults)."""
    return {"cap": plan.cell_cap, "max_num_batched_tokens": plan.max_num_batched_tokens}


def simulated(geometry: Geometry, org: str, plan, profile: dict, specs) -> dict:
    spec = EngineSpec.from_dict({
        "model": asdict(geometry), "org": org, "budget": plan.cell_budget,
        "scheduler": _scheduler(plan),
        "executor": {"kind": "simulated", "profile": dict(profile)}, "clock": "virtual"})
    return serve(build_engine(spec), specs).summary


def capacity_rps(geometry: Geometry, org: str, plan, profile: dict) -> float:
    """Requests per second of the cell simulated with every request at t = 0."""
    s = simulated(geometry, org, plan, profile, workload(plan, None))
    return plan.cell_requests / max(s["sim_seconds"], 1e-9)


def real(model, geometry: Geometry, org: str, plan, specs) -> tuple[dict, dict]:
    spec = loaded_model_spec(model, geometry, org, plan.cell_budget, _scheduler(plan),
                             clock="wall")
    engine = build_engine(spec, model=model)
    result = serve(engine, specs)
    rules = result.engine_config
    keep = ("org", "device", "dtype", "decode_attention", "clock", "cap",
            "max_num_batched_tokens", "pool_units", "scan_chunk", "prefill_batch_tokens")
    return result.summary, {k: rules.get(k) for k in keep}


def run(model, geometry: Geometry, plan, profile: dict, profile_source: str,
        deadline: float, emit) -> dict:
    out = {"requests": plan.cell_requests, "budget": plan.cell_budget, "cap": plan.cell_cap,
           "profile": profile_source, "load": plan.cell_load, "orgs": {}, "stopped": None}
    # One rate for both organizations (the slower one's capacity), so they see one workload.
    caps = {org: capacity_rps(geometry, org, plan, profile) for org in plan.cell_orgs}
    rate = plan.cell_load * min(caps.values())
    floor = plan.cell_requests / plan.cell_max_span_s  # bounds the real run's arrival span
    out.update({"capacity_rps": caps, "rate_rps": max(rate, floor),
                "rate_floor_applied": rate < floor})
    rate = max(rate, floor)
    specs = workload(plan, rate)
    out["prompt_tokens_mean"] = float(np.mean([len(s.prompt) for s in specs]))
    out["output_tokens_mean"] = float(np.mean([s.output_tokens for s in specs]))
    for org in plan.cell_orgs:
        if time.perf_counter() > deadline:
            out["stopped"] = f"time limit reached before {org}"
            break
        sim = simulated(geometry, org, plan, profile, specs)
        t0 = time.perf_counter()
        measured, rules = real(model, geometry, org, plan, specs)
        row = {"real": {k: measured.get(k) for k in METRICS},
               "simulated": {k: sim.get(k) for k in METRICS},
               "real_wall_s": time.perf_counter() - t0, "rules": rules}
        row["ratio"] = {k: (row["simulated"][k] / row["real"][k]
                            if row["real"][k] else None)
                        for k in ("throughput_ledger", "c_once_tokens", "ttft_p99")}
        out["orgs"][org] = row
        emit(dict(out))
    out["complete"] = len(out["orgs"]) == len(plan.cell_orgs)
    return out


