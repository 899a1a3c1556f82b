"""The step-wise Engine API: manual stepping, per-step token/finish events, thread submission."""

from __future__ import annotations

import pickle
import threading
from dataclasses import replace

from conftest import compose_config
from engines import simulated_engine

from experiments.runners.cell import run_cell
from experiments.runners.spec import engine_spec
from experiments.workloads.workload import build_workload
from serving_core.executor.profiles import load_device_profile
from serving_core.executor.simulated import build_step_model
from serving_core.geometry import geometry_from_config
from serving_core.planner import plan_budget, units_for

SYNTH = (
    "workload.source=synthetic",
    "workload.synthetic_prompt_tokens=700",
    "workload.synthetic_context_tokens=600",
    "workload.synthetic_output_tokens=12",
    "workload.num_requests=24",
    "org=s2",
    "budget=b63",
)


def _parts(cfg):
    geometry = geometry_from_config(cfg.model)
    device = load_device_profile(cfg.executor)
    units = units_for(plan_budget(geometry, str(cfg.budget)), "S2")
    sched_cfg = engine_spec(cfg).scheduler
    model = build_step_model(geometry, device, "S2")
    specs = build_workload(cfg.workload, cfg.load, int(cfg.seed)).requests
    return geometry, units, sched_cfg, model, specs


def test_manual_stepping_reproduces_run_cell_and_reports_every_token():
    cfg = compose_config(*SYNTH)
    geometry, units, sched_cfg, model, specs = _parts(cfg)
    engine = simulated_engine(geometry, "S2", units, sched_cfg, model)
    for spec in specs:
        engine.add_request(spec)
    produced: dict[int, list[int]] = {}
    finished: list[int] = []
    while engine.has_work():
        out = engine.step()
        if out is None:
            continue
        for rid, token in out.produced:
            produced.setdefault(rid, []).append(token)
        finished += out.finished
    result = engine.result()
    reference = run_cell(cfg)
    assert pickle.dumps(result.tables) == pickle.dumps(reference.tables)
    assert sorted(finished) == list(range(len(specs)))
    for req in result.requests:
        assert len(produced[req.rid]) == req.num_generated == req.target_output


def test_requests_submitted_from_another_thread_are_served_on_a_wall_clock():
    cfg = compose_config(*SYNTH)
    geometry, units, sched_cfg, model, specs = _parts(cfg)
    engine = simulated_engine(geometry, "S2", units, sched_cfg, model, clock="wall")
    specs = [replace(s, arrival_s=0.0) for s in specs[:6]]

    def client():
        for spec in specs:
            engine.submit(spec)

    thread = threading.Thread(target=client)
    thread.start()
    done: set[int] = set()
    while len(done) < len(specs):
        if not engine.wait_for_work(timeout=5.0):
            break
        out = engine.step()
        if out is not None:
            assert out.duration_s >= 0.0
            done.update(out.finished)
    thread.join()
    assert done == {s.request_id for s in specs}
    steps = engine.result().tables["steps"]
    starts = steps["t_start_s"]
    assert starts == sorted(starts)  # wall time only moves forward


def test_abort_waiting_removes_only_a_request_that_never_ran():
    """Scheduler.abort_waiting (the server's path for a client that hangs up while queued):
    a queued request that never ran leaves the queue finished; a running one is refused
    (it ends through the normal finish path), and the remaining requests are still served."""
    cfg = compose_config(*SYNTH)
    geometry, units, sched_cfg, model, specs = _parts(cfg)
    engine = simulated_engine(geometry, "S2", units, sched_cfg, model)
    specs = [replace(s, arrival_s=0.0) for s in specs]  # more than one step admits
    for spec in specs:
        engine.add_request(spec)
    engine.step()
    sched = engine.sched
    running, queued = sched.running[0], engine.requests[-1]
    assert queued in sched.waiting and not queued.episodes
    assert not sched.abort_waiting(running, 0.0)
    assert sched.abort_waiting(queued, 1.5)
    assert queued not in sched.waiting and queued.status.name == "FINISHED"
    assert queued.finish_s == 1.5
    assert not sched.abort_waiting(queued, 2.0)  # already finished
    while engine.has_work():
        engine.step()
    served = [r for r in engine.requests if r is not queued]
    assert all(r.num_generated == r.target_output for r in served)
